// The activations of a decoder layer, one definition each: silu(gate) * up (gated_linear, the fused MoE), the causal
// softmax of attention scores (causal_attention) and the decode attention's rule over a KV cache of fp32, fp16 or int8
// rows (decode_attention_).
// `static` (as microkernel.h's helpers): the driver and each ISA-flagged variant TU compile their own copy, which the
// compiler vectorizes with that TU's ISA (SmolLM2's prefill: 512 x 1536 SiLU elements a layer, 1.0 ms with the
// baseline ISA, 0.24 ms with AVX-512). Plain IEEE operations in a fixed order, no library call and no FMA
// (-ffp-contract=off): every copy gives the same bits.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "float_convert.h"
#include "microkernel.h"

namespace w8a8_cpu {

// exp(x) for x in [-87, 88] without a library call, so the loop below vectorizes:
// x = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-6 polynomial (rel. error < 2e-7), 2^n via the exponent bits.
// n is rounded by adding and subtracting 1.5 * 2^23 (plain IEEE adds, no rounding instruction needed).
static inline float exp_poly(float x) {
  x = std::min(88.f, std::max(-87.f, x));
  const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// gate[j] = silu(gate[j]) * up[j] for j < n, in place.
static void silu_mul_row(float* gate, const float* up, int64_t n) {
  for (int64_t j = 0; j < n; ++j) gate[j] = gate[j] / (1.f + exp_poly(-gate[j])) * up[j];
}

// Sum of term(i) for i < n in one fixed order: 16 running lane sums (a vector register's worth, so the loop
// vectorizes without reassociation), then the lanes in order. Every sum of this file is one: the same order, the
// same bits in every copy.
template <typename Term>
static inline float lane_reduce(int64_t n, Term term) {
  constexpr int kLanes = 16;
  float lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) lane[j] += term(i + j);
  for (int j = 0; i < n; ++i, ++j) lane[j] += term(i);
  float sum = 0.f;
  for (int j = 0; j < kLanes; ++j) sum += lane[j];
  return sum;
}

// Sum of a[i] * b[i] (rms_norm's sum of squares is lane_dot(v, v, n)).
static float lane_dot(const float* a, const float* b, int64_t n) {
  return lane_reduce(n, [&](int64_t i) { return a[i] * b[i]; });
}

// The largest of v[0, n), n >= 1, by 16 lane maxima like lane_reduce (any order gives the same maximum).
static float lane_max(const float* v, int64_t n) {
  constexpr int kLanes = 16;
  float lane[kLanes];
  std::fill(lane, lane + kLanes, v[0]);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) lane[j] = std::max(lane[j], v[i + j]);
  for (; i < n; ++i) lane[0] = std::max(lane[0], v[i]);
  return *std::max_element(lane, lane + kLanes);
}

// The numerators of a causal softmax over one row of attention scores s[0, n), in place: s[j] = exp(s[j] - max) for
// j < len (1 <= len <= n: the keys at or before the query's position; max over those, stored in *max), s[j] = 0
// beyond; returns their sum (lane_reduce's order; >= 1, the maximum's own term). The caller divides the weighted sum of
// values by it once, d outputs a row instead of len weights, and reads the row once less. Any non-finite kept score
// (NaN, Inf, -Inf) makes the row and the sum NaN (torch's softmax does so for NaN and Inf; a -Inf score it weighs 0):
// each term adds s[j] * 0 (0 for a finite score, NaN otherwise), since exp_poly's clamp and the lane maxima would
// pass over it and return weights that look valid.
static float softmax_numerators_with_max(float* s, int64_t len, int64_t n, float* max) {
  const float m = *max = lane_max(s, len);
  const float sum = lane_reduce(len, [&](int64_t j) {
    const float score = s[j];
    return s[j] = exp_poly(score - m) + score * 0.f;
  });
  if (std::isnan(sum)) std::fill(s, s + len, std::numeric_limits<float>::quiet_NaN());
  std::fill(s + len, s + n, 0.f);
  return sum;
}

// softmax_numerators_with_max without the maximum (the prompt attention's rows).
static float softmax_numerators_row(float* s, int64_t len, int64_t n) {
  float max;
  return softmax_numerators_with_max(s, len, n, &max);
}

// ---- The decode attention's rule (layer_ops.h's decode_attention: the driver; every variant's copy gives these bits)
//
// The cache's keys of one KV head are split into blocks of kDecodeKeyBlock positions from position 0 (the last one
// shorter): a fixed partition, whatever the thread count. A query head's block (attend_key_block_head):
//   query = q * scale (the caller's, once a head; fp32 products),
//   s_j   = lane_dot(query, key_j), times key_j's scale for an int8 cache (the dequantization applied to the dot
//           product: one fp32 product a key), where a key's stored values are widened to fp32 exactly (int8, fp16),
//   m, p_j, l = softmax_numerators_with_max over the block's scores (its maximum, numerators, their sum),
//   w_j   = p_j, times value_j's scale for an int8 cache,
//   o[e]  = sum of w_j * value_j[e] in key order.
// The blocks of a head combine in block order (combine_key_blocks): M = the largest m, c_b = exp_poly(m_b - M),
// out[e] = (sum of c_b * o_b[e]) * (1 / sum of c_b * l_b). A cache within one block: c = 1, the single pass's bits. A
// non-finite score makes its block's sum NaN, and so the head's output NaN (an int8 row of NaN/Inf values has scale
// NaN: the same).

// Element i of a cached row of `Kind` as fp32 (exact).
template <KvKind Kind>
static inline float kv_element(const void* row, int64_t i) {
  if constexpr (Kind == KvKind::f32) return static_cast<const float*>(row)[i];
  if constexpr (Kind == KvKind::i8) return static_cast<float>(static_cast<const int8_t*>(row)[i]);
  if constexpr (Kind == KvKind::f16) return f16_bits_to_float(static_cast<const uint16_t*>(row)[i]);
}

// Calls body(std::integral_constant<KvKind, kind>{}): a kernel compiled per storage, without a branch per element.
template <typename F>
static inline void with_kv_kind(KvKind kind, F&& body) {
  if (kind == KvKind::i8) return body(std::integral_constant<KvKind, KvKind::i8>{});
  if (kind == KvKind::f16) return body(std::integral_constant<KvKind, KvKind::f16>{});
  body(std::integral_constant<KvKind, KvKind::f32>{});
}

// The rule's s_j: the scaled query's dot product with key j (lane_dot's order), times its scale for int8.
template <KvKind Kind>
static inline float key_score(const float* query, const KvRows& rows, int64_t j, int64_t d) {
  const void* key = static_cast<const char*>(rows.k) + j * d * kv_element_bytes(Kind);
  const float dot = lane_reduce(d, [&](int64_t i) { return query[i] * kv_element<Kind>(key, i); });
  return Kind == KvKind::i8 ? dot * rows.k_scale[j] : dot;
}

// The rule's w_j from numerator p of key j.
template <KvKind Kind>
static inline float value_weight(float p, const KvRows& rows, int64_t j) {
  return Kind == KvKind::i8 ? p * rows.v_scale[j] : p;
}

// One query head's block (the rule above): query d floats (scaled), keys of the block (1 <= keys <= kDecodeKeyBlock,
// d <= kMaxHeadDim); scores: kDecodeKeyBlock floats of scratch; writes o to out[0, d) and m to *max, returns l.
static float attend_key_block_head(const float* query, const KvRows& rows, int64_t keys, int64_t d, float* scores,
                                   float* out, float* max) {
  float sum = 0.f;
  with_kv_kind(rows.kind, [&](auto kind) {
    constexpr KvKind Kind = decltype(kind)::value;
    for (int64_t j = 0; j < keys; ++j) scores[j] = key_score<Kind>(query, rows, j, d);
    sum = softmax_numerators_with_max(scores, keys, keys, max);
    std::fill(out, out + d, 0.f);
    for (int64_t j = 0; j < keys; ++j) {
      const float w = value_weight<Kind>(scores[j], rows, j);
      const void* value = static_cast<const char*>(rows.v) + j * d * kv_element_bytes(Kind);
      for (int64_t e = 0; e < d; ++e) out[e] += w * kv_element<Kind>(value, e);
    }
  });
  return sum;
}

// MicroKernel::attend_key_block by the rule: query heads [heads][d] (scaled) one after another.
static void attend_key_block_row(const float* queries, int heads, const KvRows& rows, int64_t keys, int64_t d,
                                 float* scores, const KeyBlockOutputs& o) {
  for (int i = 0; i < heads; ++i)
    o.sum[i * o.stat_stride] = attend_key_block_head(queries + i * d, rows, keys, d, scores,
                                                     o.out + i * o.out_stride, o.max + i * o.stat_stride);
}

// A variant's copy of attend_key_block_row: copy(std::integral_constant<KvKind, kind>{}) for head dims that are a
// multiple of 16 (lane_dot's 16 lanes in whole vectors), the row for others.
template <typename Copy>
static void attend_key_block_by_kind(const float* queries, int heads, const KvRows& rows, int64_t keys, int64_t d,
                                     float* scores, const KeyBlockOutputs& outputs, Copy&& copy) {
  if (d % 16 != 0) return attend_key_block_row(queries, heads, rows, keys, d, scores, outputs);
  with_kv_kind(rows.kind, copy);
}

// A query head's output from its blocks' o (partials[b * d + e]), m and l (the rule above), in block order.
static void combine_key_blocks(const float* partials, const float* maxes, const float* sums, int64_t blocks, int64_t d,
                               float* out) {
  const float top = lane_max(maxes, blocks);
  float sum = 0.f;
  std::fill(out, out + d, 0.f);
  for (int64_t b = 0; b < blocks; ++b) {
    const float c = exp_poly(maxes[b] - top);
    sum += c * sums[b];
    for (int64_t e = 0; e < d; ++e) out[e] += c * partials[b * d + e];
  }
  const float inv = 1.f / sum;
  for (int64_t e = 0; e < d; ++e) out[e] *= inv;
}

}  // namespace w8a8_cpu
