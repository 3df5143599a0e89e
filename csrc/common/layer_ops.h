// The small float operations of a decoder layer that sit between its GEMMs: RMSNorm (with the residual add before it),
// rotary position embedding, and the dispatch of the prompt attention's softmax. A model runs them on every layer of
// every token; as separate torch ops they were ~10% of SmolLM2's prefill and a Python dispatch each per decode step.
// Plain C++ on rows of fp32/bf16/fp16 elements, computed in fp32 in a fixed operation order (no FMA contraction: see
// CMakeLists), one rounding to the element type at the end.
#pragma once

#include <cstdint>

#include "microkernel.h"

namespace w8a8_cpu {

// Most elements of a normed row (its fp32 copy of a bf16/fp16 row lives on the stack, 64 KiB): hidden sizes of today's
// LLMs are <= 16384. A head's: kMaxHeadDim (microkernel.h).
constexpr int64_t kMaxNormRow = 16384;

// y = weight * (v / sqrt(mean(v^2) + eps)) over one row of n elements (transformers' RMSNorm), where v = x, or
// v = x + delta written to sum_out when delta is not null (the pre-norm residual stream: h += delta; y = norm(h);
// sum_out may be x). x, delta, sum_out and y are of kind `kind`, weight fp32; n <= kMaxNormRow.
void rms_norm_row(const void* x, const void* delta, void* sum_out, FloatKind kind, const float* weight, float eps,
                  int64_t n, void* y);

// Rotary embedding in place on the first `heads` heads of one row (heads x d elements of kind `kind`), the
// "rotate half" form of Llama-family models: for i < d/2, with x1 = x[i], x2 = x[i + d/2],
// x[i] = x1 * cos[i] + (-x2) * sin[i] and x[i + d/2] = x2 * cos[i + d/2] + x1 * sin[i + d/2] (cos, sin: fp32, d;
// d even, <= kMaxHeadDim).
void rotary_row(void* x, FloatKind kind, int64_t heads, int64_t d, const float* cos, const float* sin);

// One query head's attention at one decode position: out[0, d) = sum over keys j < keys of p_j * v[j], with
// p = softmax(scale * q . k[j]) (rows of k and v d floats apart; 1 <= keys, d <= kMaxHeadDim; scores: `keys` floats
// of scratch). The dot products in lane_dot's fixed order, the softmax as the prompt attention's (softmax_numerators:
// a non-finite score makes the head's output NaN), the weighted sum in key order divided by the numerators' sum: the
// same bits on every thread, in the kernel's ISA where it has a copy (activation.h's attend_one_position_row). out
// must not overlap q, k, v or scores.
void attend_one_position(const MicroKernel& kernel, const float* q, const float* k, const float* v, int64_t keys,
                         int64_t d, float scale, float* scores, float* out);

// activation.h's softmax_numerators_row on one row of attention scores (returns their sum), in the kernel's ISA where
// it has a copy (the same bits either way).
float softmax_numerators(const MicroKernel& kernel, float* s, int64_t len, int64_t n);

}  // namespace w8a8_cpu
