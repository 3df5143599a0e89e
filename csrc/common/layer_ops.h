// The small float operations of a decoder layer that sit between its GEMMs: RMSNorm (with the residual add before it),
// rotary position embedding, the dispatch of the prompt attention's softmax, and the decode attention over the KV
// cache. A model runs them on every layer of every token; as separate torch ops they were ~10% of SmolLM2's prefill
// and a Python dispatch each per decode step. Plain C++ on rows of fp32/bf16/fp16 elements, computed in fp32 in a fixed
// operation order (no FMA contraction: see CMakeLists), one rounding to the element type at the end.
#pragma once

#include <cstdint>

#include "microkernel.h"
#include "parallel.h"

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

// Scratch floats decode_attention needs for `heads` query heads over `keys` keys of head_dim d.
int64_t decode_attention_scratch_floats(int64_t heads, int64_t keys, int64_t d);

// The attention of one decode position: out [heads][d] = per query head h, softmax(scale q_h . k_j) weighting v_j over
// the cache's keys j < keys of KV head h / (heads / kv_heads) (grouped-query attention), by activation.h's rule (keys
// in blocks of kDecodeKeyBlock, combined in block order), in the kernel's ISA where it has a copy: the same bits on
// every variant and thread count. q [heads][d] (unscaled); KV head g's rows at kv_rows_from(cache, g * length, d)
// (length >= keys: the cache's positions); 1 <= keys, d <= kMaxHeadDim. The work is split over (KV head, key block)
// tasks, the query heads of a KV head sharing its block's reads. scratch: decode_attention_scratch_floats floats; out
// must not overlap q, the cache or scratch.
void decode_attention(const MicroKernel& kernel, const float* q, int64_t heads, const KvRows& cache, int64_t kv_heads,
                      int64_t length, int64_t keys, int64_t d, float scale, float* scratch, float* out,
                      const ParallelFor& parallel_for);

// Stores one cached row of d fp32 values at row j of rows of `kind` (rows d elements apart; int8: its scale at
// scales[j]): fp32 as is, fp16 rounded to nearest even (Inf past its range), int8 by quantize_rows' rule (per token
// and head: scale = max|x| / 127, q = round_half_even(x * 127 / max|x|); zeros for a zero row; scale NaN and q = 0
// for a row holding NaN or Inf).
void store_kv_row(const MicroKernel& kernel, const float* x, int64_t d, KvKind kind, void* rows, float* scales,
                  int64_t j);

// activation.h's softmax_numerators_row on one row of attention scores (returns their sum), in the kernel's ISA where
// it has a copy (the same bits either way).
float softmax_numerators(const MicroKernel& kernel, float* s, int64_t len, int64_t n);

}  // namespace w8a8_cpu
