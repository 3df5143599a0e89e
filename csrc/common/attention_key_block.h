// The decode attention's key block in vectors: activation.h's attend_key_block_row (the rule, and its bits: every
// operation below is one of it, in its order), restructured once for every vector width. The row's two loops are latency
// chains: each key's lane_dot ends in 16 scalar adds one after another, and o[e] += w v[j][e] goes through memory for
// every key. Here W keys' 16 lane sums (16 / W vectors a key) are transposed so that one vector add does the same step
// of all W sums (then one product by their W scales for int8), and the weighted values accumulate in registers, 64
// dims at a time over tiles of kValueTile keys (a tile's values stay in L1 for the next 64 dims). Plain products and
// sums (-ffp-contract=off: no fused multiply-add). AVX2, fp32 rows: decode_attention_ of SmolLM2's layer (9 heads,
// d = 64, 1 thread, Zen3, K / V in cache) ~1.6x the row's speed at 1024 keys, ~1.8x at 2048.
//
// Written over `Ops`, an ISA's vector operations (attention_vec4.h's for GCC's generic 4-float vectors, x86_common.h's
// for AVX2, avx512_vnni.cpp's for AVX-512), all static members:
//   Vec, kWidth (W: 4, 8 or 16, a divisor of 16),
//   zero(), load(const float*) (W floats, any alignment), load_kv<Kind>(row, i) (elements [i, i + W) of a cached row of
//   `Kind` as fp32, exactly), set1(float), add(a, b), mul(a, b), store(float*, v), transpose(Vec r[W]) (r[i] lane j
//   <- r[j] lane i).
// `static`, and each Ops in an unnamed namespace: each TU that includes it keeps its own copy, in its own ISA.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "activation.h"
#include "microkernel.h"

namespace w8a8_cpu {

template <typename Ops, KvKind Kind>
static float attend_key_block_vectors_kind(const float* query, const KvRows& rows, int64_t keys, int64_t d,
                                           float* scores, float* out, float* max) {
  using Vec = typename Ops::Vec;
  // W and kDimVectors `static`: GCC (12) gives a plain constexpr local that the lambda below names a stack slot, and
  // the larger frame kept this function from being inlined into attend_key_block_vectors (--param
  // large-stack-frame-growth), which changed the x86 loops' register allocation.
  static constexpr int W = Ops::kWidth;
  constexpr int kLaneVectors = 16 / W;         // lane_dot's 16 lanes
  static constexpr int kDimVectors = 64 / W;   // the value accumulators: 64 dims
  static_assert(16 % W == 0, "lane_dot's 16 lanes in whole vectors");
  const int64_t row_bytes = d * kv_element_bytes(Kind);
  const char* k = static_cast<const char*>(rows.k);
  const char* v = static_cast<const char*>(rows.v);
  int64_t j = 0;
  for (; j + W <= keys; j += W) {
    Vec lanes[kLaneVectors][W];  // lanes[c][t]: lane_dot's lanes W c .. W c + W - 1 of key j + t
#pragma GCC unroll 8
    for (int t = 0; t < W; ++t) {
      const char* key = k + (j + t) * row_bytes;
#pragma GCC unroll 4
      for (int c = 0; c < kLaneVectors; ++c) lanes[c][t] = Ops::zero();
      for (int64_t i = 0; i < d; i += 16)
#pragma GCC unroll 4
        for (int c = 0; c < kLaneVectors; ++c)
          lanes[c][t] = Ops::add(lanes[c][t], Ops::mul(Ops::load(query + i + W * c),
                                                       Ops::template load_kv<Kind>(key, i + W * c)));
    }
#pragma GCC unroll 4
    for (int c = 0; c < kLaneVectors; ++c) Ops::transpose(lanes[c]);  // lanes[c][r]: lane W c + r of the W keys
    Vec sum = Ops::zero();
#pragma GCC unroll 4
    for (int c = 0; c < kLaneVectors; ++c)
#pragma GCC unroll 8
      for (int r = 0; r < W; ++r) sum = Ops::add(sum, lanes[c][r]);
    if constexpr (Kind == KvKind::i8) sum = Ops::mul(sum, Ops::load(rows.k_scale + j));
    Ops::store(scores + j, sum);
  }
  for (; j < keys; ++j) scores[j] = key_score<Kind>(query, rows, j, d);
  const float total = softmax_numerators_with_max(scores, keys, keys, max);
  constexpr int64_t kValueTile = 128;
  for (int64_t j0 = 0; j0 < keys; j0 += kValueTile) {
    const int64_t j1 = std::min(keys, j0 + kValueTile);
    for (int64_t e0 = 0; e0 < d; e0 += 64) {
      const int vectors = static_cast<int>(std::min<int64_t>(64, d - e0) / W);
      Vec acc[kDimVectors];
      for (int b = 0; b < kDimVectors; ++b)
        acc[b] = j0 == 0 || b >= vectors ? Ops::zero() : Ops::load(out + e0 + b * W);
      auto accumulate = [&](auto all_dims) {  // all_dims: vectors == kDimVectors, a loop of constant length
        for (int64_t key = j0; key < j1; ++key) {
          const Vec w = Ops::set1(value_weight<Kind>(scores[key], rows, key));
          const char* value = v + key * row_bytes;
          for (int b = 0; b < (all_dims ? kDimVectors : vectors); ++b)
            acc[b] = Ops::add(acc[b], Ops::mul(w, Ops::template load_kv<Kind>(value, e0 + b * W)));
        }
      };
      if (vectors == kDimVectors)
        accumulate(std::true_type{});
      else
        accumulate(std::false_type{});
      for (int b = 0; b < vectors; ++b) Ops::store(out + e0 + b * W, acc[b]);
    }
  }
  return total;
}

// MicroKernel::attend_key_block in Ops' vectors.
template <typename Ops>
static float attend_key_block_vectors(const float* query, const KvRows& rows, int64_t keys, int64_t d, float* scores,
                                      float* out, float* max) {
  return attend_key_block_by_kind(query, rows, keys, d, scores, out, max, [&](auto kind) {
    return attend_key_block_vectors_kind<Ops, decltype(kind)::value>(query, rows, keys, d, scores, out, max);
  });
}

}  // namespace w8a8_cpu
