// The activations of a decoder layer, one definition each: silu(gate) * up (gated_linear, the fused MoE), the causal
// softmax of attention scores (causal_attention) and one head's attention at a decode position (decode_attention_).
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
// j < len (1 <= len <= n: the keys at or before the query's position; max over those), s[j] = 0 beyond; returns their
// sum (lane_reduce's order; >= 1, the maximum's own term). The caller divides the weighted sum of values by it once,
// d outputs a row instead of len weights, and reads the row once less. Any non-finite kept score (NaN, Inf, -Inf)
// makes the row and the sum NaN (torch's softmax does so for NaN and Inf; a -Inf score it weighs 0): each term adds
// s[j] * 0 (0 for a finite score, NaN otherwise), since exp_poly's clamp and the lane maxima would pass over it and
// return weights that look valid.
static float softmax_numerators_row(float* s, int64_t len, int64_t n) {
  const float max = lane_max(s, len);
  const float sum = lane_reduce(len, [&](int64_t j) {
    const float score = s[j];
    return s[j] = exp_poly(score - max) + score * 0.f;
  });
  if (std::isnan(sum)) std::fill(s, s + len, std::numeric_limits<float>::quiet_NaN());
  std::fill(s + len, s + n, 0.f);
  return sum;
}

// One query head's attention at one decode position (layer_ops.h's attend_one_position: the contract): the query
// scaled, its dot products with the keys in lane_dot's order, softmax_numerators_row over them, the values weighted by
// them summed in key order, then divided by their sum. d <= kMaxHeadDim; scores: `keys` floats of scratch.
static void attend_one_position_row(const float* q, const float* k, const float* v, int64_t keys, int64_t d,
                                    float scale, float* scores, float* out) {
  float query[kMaxHeadDim];
  for (int64_t e = 0; e < d; ++e) query[e] = q[e] * scale;
  for (int64_t j = 0; j < keys; ++j) scores[j] = lane_dot(query, k + j * d, d);
  const float inv = 1.f / softmax_numerators_row(scores, keys, keys);
  std::fill(out, out + d, 0.f);
  for (int64_t j = 0; j < keys; ++j) {
    const float p = scores[j];
    const float* vj = v + j * d;
    for (int64_t e = 0; e < d; ++e) out[e] += p * vj[e];
  }
  for (int64_t e = 0; e < d; ++e) out[e] *= inv;
}

}  // namespace w8a8_cpu
