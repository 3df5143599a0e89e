// The decode attention's key block (activation.h's attend_key_block_row: the rule, and its bits) for 128-bit vector
// ISAs, in GCC's generic vectors of 4 floats: one source that compiles to NEON in neon.cpp and to VSX in vsx.cpp (their
// baseline TUs; the dotprod / i8mm and MMA variants use those). The x86 copy's structure (x86_common.h) with 4-wide
// vectors: 4 keys' 16 lane sums (lane_dot's 16 lanes: 4 vectors a key) transposed so that one vector add does the same
// step of all 4 sums, then one product by their 4 scales for int8, and the weighted values accumulated in registers,
// 64 dims at a time over tiles of kValueTile keys. Plain products and sums (-ffp-contract=off: no fused multiply-add).
// `static`: each TU that includes it keeps its own copy, in its own ISA.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "activation.h"

namespace w8a8_cpu {

typedef float Float4 __attribute__((vector_size(16)));
typedef int8_t Int8x4 __attribute__((vector_size(4)));

static inline Float4 load_float4(const float* at) {
  Float4 v;
  std::memcpy(&v, at, sizeof v);
  return v;
}

// Elements [i, i + 4) of a cached row of `Kind` as fp32 (exact; fp16 widened one by one).
template <KvKind Kind>
static inline Float4 load_kv4(const void* row, int64_t i) {
  if constexpr (Kind == KvKind::f32) return load_float4(static_cast<const float*>(row) + i);
  if constexpr (Kind == KvKind::i8) {
    Int8x4 q;
    std::memcpy(&q, static_cast<const int8_t*>(row) + i, sizeof q);
    return __builtin_convertvector(q, Float4);
  }
  if constexpr (Kind == KvKind::f16) {
    const auto* h = static_cast<const uint16_t*>(row) + i;
    return Float4{f16_bits_to_float(h[0]), f16_bits_to_float(h[1]), f16_bits_to_float(h[2]), f16_bits_to_float(h[3])};
  }
}

// 4 x 4 floats transposed: r[i] lane j <- r[j] lane i.
static inline void transpose4x4(Float4 r[4]) {
  const Float4 t0 = __builtin_shufflevector(r[0], r[1], 0, 4, 1, 5);
  const Float4 t1 = __builtin_shufflevector(r[0], r[1], 2, 6, 3, 7);
  const Float4 t2 = __builtin_shufflevector(r[2], r[3], 0, 4, 1, 5);
  const Float4 t3 = __builtin_shufflevector(r[2], r[3], 2, 6, 3, 7);
  r[0] = __builtin_shufflevector(t0, t2, 0, 1, 4, 5), r[1] = __builtin_shufflevector(t0, t2, 2, 3, 6, 7);
  r[2] = __builtin_shufflevector(t1, t3, 0, 1, 4, 5), r[3] = __builtin_shufflevector(t1, t3, 2, 3, 6, 7);
}

template <KvKind Kind>
static float attend_key_block_vec4_kind(const float* query, const KvRows& rows, int64_t keys, int64_t d, float* scores,
                                        float* out, float* max) {
  const int64_t row_bytes = d * kv_element_bytes(Kind);
  const char* k = static_cast<const char*>(rows.k);
  const char* v = static_cast<const char*>(rows.v);
  int64_t j = 0;
  for (; j + 4 <= keys; j += 4) {
    Float4 lanes[4][4];  // lanes[c][t]: lane_dot's lanes 4c .. 4c + 3 of key j + t
    for (int t = 0; t < 4; ++t) {
      const char* key = k + (j + t) * row_bytes;
      Float4 acc[4] = {};
      for (int64_t i = 0; i < d; i += 16)
        for (int c = 0; c < 4; ++c) acc[c] += load_float4(query + i + 4 * c) * load_kv4<Kind>(key, i + 4 * c);
      for (int c = 0; c < 4; ++c) lanes[c][t] = acc[c];
    }
    Float4 sum = {};
    for (int c = 0; c < 4; ++c) {
      transpose4x4(lanes[c]);  // lanes[c][r]: lane 4c + r of the 4 keys
      for (int r = 0; r < 4; ++r) sum += lanes[c][r];
    }
    if constexpr (Kind == KvKind::i8) sum *= load_float4(rows.k_scale + j);
    std::memcpy(scores + j, &sum, sizeof sum);
  }
  for (; j < keys; ++j) scores[j] = key_score<Kind>(query, rows, j, d);
  const float total = softmax_numerators_with_max(scores, keys, keys, max);
  constexpr int64_t kValueTile = 128;
  for (int64_t j0 = 0; j0 < keys; j0 += kValueTile) {
    const int64_t j1 = std::min(keys, j0 + kValueTile);
    for (int64_t e0 = 0; e0 < d; e0 += 64) {
      const int vectors = static_cast<int>(std::min<int64_t>(64, d - e0) / 4);
      Float4 acc[16];
      for (int b = 0; b < 16; ++b) acc[b] = j0 == 0 || b >= vectors ? Float4{} : load_float4(out + e0 + b * 4);
      for (int64_t key = j0; key < j1; ++key) {
        const float w = value_weight<Kind>(scores[key], rows, key);
        const Float4 weight = {w, w, w, w};
        const char* value = v + key * row_bytes;
        for (int b = 0; b < vectors; ++b) acc[b] += weight * load_kv4<Kind>(value, e0 + b * 4);
      }
      for (int b = 0; b < vectors; ++b) std::memcpy(out + e0 + b * 4, &acc[b], sizeof acc[b]);
    }
  }
  return total;
}

// MicroKernel::attend_key_block of a 128-bit vector ISA.
static float attend_key_block_vec4(const float* query, const KvRows& rows, int64_t keys, int64_t d, float* scores,
                                   float* out, float* max) {
  return attend_key_block_by_kind(query, rows, keys, d, scores, out, max, [&](auto kind) {
    return attend_key_block_vec4_kind<decltype(kind)::value>(query, rows, keys, d, scores, out, max);
  });
}

}  // namespace w8a8_cpu
