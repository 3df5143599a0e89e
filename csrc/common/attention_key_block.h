// The decode attention's key block in vectors: activation.h's attend_key_block_row (the rule, and its bits: every
// operation below is one of it, in its order), restructured once for every vector width. The row's loops are latency
// chains: each key's lane_dot is 16 lane sums over the head's dims and then 16 scalar adds one after another, and
// o[e] += w v[j][e] goes through memory for every key. Here the dot products of kChainKeys keys run at once (their
// chains interleave), W keys' 16 lane sums (16 / W vectors a key) are transposed so that one vector add does the same
// step of all W sums (then one product by their W scales for int8), and the weighted values accumulate in registers,
// 64 dims at a time over tiles of kValueTile keys (a tile's values stay in L1 for the next 64 dims), for up to
// kValueHeads query heads of the group at once: each value vector is read and widened once for them, and their
// accumulators are independent chains. Plain products and sums (-ffp-contract=off: no fused multiply-add).
//
// Written over `Ops`, an ISA's vector operations (attention_vec4.h's for GCC's generic 4-float vectors, x86_common.h's
// for AVX2, avx512_vnni.cpp's for AVX-512), all static members:
//   Vec, kWidth (W: 4, 8 or 16, a divisor of 16), kRegisters (the ISA's vector registers),
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

// Heads query heads' scores over the block (queries [Heads][d], scores of head h at scores + h * kDecodeKeyBlock):
// s_j, W keys at a time (the rest by the rule's key_score), each key vector read and widened once for all of them.
template <typename Ops, KvKind Kind, int Heads>
static void key_block_scores(const float* queries, const KvRows& rows, int64_t keys, int64_t d, float* scores,
                             bool prefetch_values) {
  using Vec = typename Ops::Vec;
  // W `static`: GCC (12) gives a plain constexpr local that a lambda names a stack slot, and the larger frame kept
  // these functions from being inlined (--param large-stack-frame-growth), which changed the x86 loops' registers.
  static constexpr int W = Ops::kWidth;
  constexpr int kLaneVectors = 16 / W;  // lane_dot's 16 lanes
  static_assert(16 % W == 0, "lane_dot's 16 lanes in whole vectors");
  // Keys whose dot products run at once (a divisor of W): the heads' sums of them in half the ISA's vector registers.
  static constexpr int kChainKeys = [] {
    int n = W;
    while (n > 1 && Heads * kLaneVectors * n > Ops::kRegisters / 2) n /= 2;
    return n;
  }();
  const int64_t row_bytes = d * kv_element_bytes(Kind);
  const char* k = static_cast<const char*>(rows.k);
  int64_t j = 0;
  for (; j + W <= keys; j += W) {
    Vec lanes[Heads][kLaneVectors][W];  // lanes[h][c][t]: lane_dot's lanes W c .. W c + W - 1 of head h, key j + t
    // The W keys' value rows, read next: the value pass's loads wait on memory otherwise (an fp32 cache's 4 lines a
    // row are too many requests at once: there the reads are the limit, and the prefetches slowed them).
    if (Kind != KvKind::f32 && prefetch_values)
      for (int64_t at = j * row_bytes; at < (j + W) * row_bytes; at += 64)
        __builtin_prefetch(static_cast<const char*>(rows.v) + at);
#pragma GCC unroll 16
    for (int t0 = 0; t0 < W; t0 += kChainKeys) {
#pragma GCC unroll 8
      for (int h = 0; h < Heads; ++h)
#pragma GCC unroll 16
        for (int t = t0; t < t0 + kChainKeys; ++t)
#pragma GCC unroll 4
          for (int c = 0; c < kLaneVectors; ++c) lanes[h][c][t] = Ops::zero();
      for (int64_t i = 0; i < d; i += 16) {
#pragma GCC unroll 16
        for (int t = t0; t < t0 + kChainKeys; ++t) {
          const char* key = k + (j + t) * row_bytes;
#pragma GCC unroll 4
          for (int c = 0; c < kLaneVectors; ++c) {
            const Vec x = Ops::template load_kv<Kind>(key, i + W * c);
#pragma GCC unroll 8
            for (int h = 0; h < Heads; ++h)
              lanes[h][c][t] = Ops::add(lanes[h][c][t], Ops::mul(Ops::load(queries + h * d + i + W * c), x));
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int h = 0; h < Heads; ++h) {
#pragma GCC unroll 4
      for (int c = 0; c < kLaneVectors; ++c) Ops::transpose(lanes[h][c]);  // lanes[h][c][r]: lane W c + r of the keys
      Vec sum = Ops::zero();
#pragma GCC unroll 4
      for (int c = 0; c < kLaneVectors; ++c)
#pragma GCC unroll 16
        for (int r = 0; r < W; ++r) sum = Ops::add(sum, lanes[h][c][r]);
      if constexpr (Kind == KvKind::i8) sum = Ops::mul(sum, Ops::load(rows.k_scale + j));
      Ops::store(scores + h * kDecodeKeyBlock + j, sum);
    }
  }
  for (; j < keys; ++j)
    for (int h = 0; h < Heads; ++h) scores[h * kDecodeKeyBlock + j] = key_score<Kind>(queries + h * d, rows, j, d);
}

// Heads query heads' o over the block (their numerators at scores + i * kDecodeKeyBlock), o of head i to
// out + i * out_stride: each value row read and widened once for all of them.
template <typename Ops, KvKind Kind, int Heads>
static void key_block_values(const float* scores, const KvRows& rows, int64_t keys, int64_t d, float* out,
                             int64_t out_stride) {
  using Vec = typename Ops::Vec;
  static constexpr int W = Ops::kWidth;
  static constexpr int kDimVectors = 64 / W;  // the value accumulators of a head: 64 dims
  const int64_t row_bytes = d * kv_element_bytes(Kind);
  const char* v = static_cast<const char*>(rows.v);
  constexpr int64_t kValueTile = 128;
  for (int64_t j0 = 0; j0 < keys; j0 += kValueTile) {
    const int64_t j1 = std::min(keys, j0 + kValueTile);
    for (int64_t e0 = 0; e0 < d; e0 += 64) {
      const int vectors = static_cast<int>(std::min<int64_t>(64, d - e0) / W);
      Vec acc[Heads][kDimVectors];
#pragma GCC unroll 8
      for (int h = 0; h < Heads; ++h)
        for (int b = 0; b < kDimVectors; ++b)
          acc[h][b] = j0 == 0 || b >= vectors ? Ops::zero() : Ops::load(out + h * out_stride + e0 + b * W);
      auto accumulate = [&](auto all_dims) {  // all_dims: vectors == kDimVectors, a loop of constant length
        for (int64_t key = j0; key < j1; ++key) {
          const char* value = v + key * row_bytes;
          Vec x[kDimVectors];
          for (int b = 0; b < (all_dims ? kDimVectors : vectors); ++b)
            x[b] = Ops::template load_kv<Kind>(value, e0 + b * W);
#pragma GCC unroll 8
          for (int h = 0; h < Heads; ++h) {
            const Vec w = Ops::set1(value_weight<Kind>(scores[h * kDecodeKeyBlock + key], rows, key));
            for (int b = 0; b < (all_dims ? kDimVectors : vectors); ++b)
              acc[h][b] = Ops::add(acc[h][b], Ops::mul(w, x[b]));
          }
        }
      };
      if (vectors == kDimVectors)
        accumulate(std::true_type{});
      else
        accumulate(std::false_type{});
#pragma GCC unroll 8
      for (int h = 0; h < Heads; ++h)
        for (int b = 0; b < vectors; ++b) Ops::store(out + h * out_stride + e0 + b * W, acc[h][b]);
    }
  }
}

// MicroKernel::attend_key_block in Ops' vectors: the heads' scores kScoreHeads at a time, their softmax numerators,
// their o kValueHeads at a time; each pass's head count a constant (microkernel.h's with_row_count, as a tile's rows),
// so that the loops over heads unroll and their accumulators stay in registers.
template <typename Ops>
static void attend_key_block_vectors(const float* queries, int heads, const KvRows& rows, int64_t keys, int64_t d,
                                     float* scores, const KeyBlockOutputs& o) {
  attend_key_block_by_kind(queries, heads, rows, keys, d, scores, o, [&](auto kind) {
    constexpr KvKind Kind = decltype(kind)::value;
    // Heads sharing each key vector's widening: a GQA group of 3 or 4 in one pass (more sums than registers halve
    // kChainKeys instead).
    constexpr int kScoreHeads = 4;
    // Heads whose value accumulators (64 dims each) fit half the ISA's vector registers, at least 1.
    constexpr int kValueHeads = std::max(1, Ops::kRegisters / 2 / (64 / Ops::kWidth));
    for (int i = 0; i < heads; i += kScoreHeads)
      with_row_count<kScoreHeads>(heads - i, [&](auto n) {
        key_block_scores<Ops, Kind, decltype(n)::value>(queries + i * d, rows, keys, d, scores + i * kDecodeKeyBlock,
                                                        i == 0);
      });
    for (int i = 0; i < heads; ++i)
      o.sum[i * o.stat_stride] = softmax_numerators_with_max(scores + i * kDecodeKeyBlock, keys, keys,
                                                             o.max + i * o.stat_stride);
    for (int i = 0; i < heads; i += kValueHeads)
      with_row_count<kValueHeads>(heads - i, [&](auto n) {
        key_block_values<Ops, Kind, decltype(n)::value>(scores + i * kDecodeKeyBlock, rows, keys, d,
                                                        o.out + i * o.out_stride, o.out_stride);
      });
  });
}

}  // namespace w8a8_cpu
