// The epilogue of the GEMMs: what a GEMM writes (GemmOutput) and the one rule that turns accumulators into outputs.
// `static` (as activation.h): the driver and each ISA-flagged variant TU compile their own copy, vectorized with that
// TU's ISA (MicroKernel::scale_tile; SmolLM2's prefill GEMMs, K = 576: the epilogue took 19% of the tile's time in
// the baseline copy, 9% in the AVX-512 one).
// Fixed operation order, no FMA contraction (see CMakeLists): every copy gives the same bits.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "float_convert.h"
#include "microkernel.h"

namespace w8a8_cpu {

// What a GEMM writes, rows ldo elements apart, cast once to out_kind:
//  int8 weights: out[r, n] = float(acc) * (a_scales[r] * w_scales[n]) (+ bias[n]); or, with raw_int32, the exact int32
//    accumulators themselves (scales and bias unused), for callers that add partial products before the epilogue
//    (tensor parallelism).
//  int4 weights (groups g of the blob's group size, the blob's group scales s and minimums mn; acc_g the exact int32
//    products of group g): t = 0; for g in order: t = t + float(acc_g) * s[n, g]; then, int4_min weights,
//    t = t + float(a_group_sums[r, g]) * mn[n, g]; out[r, n] = t * (a_scales[r] * w_scales[n]) (+ bias[n]): the
//    int8 epilogue on t. One order, in the driver and the int4 tiles, for every variant.
struct GemmOutput {
  const float* a_scales;
  const float* w_scales;  // [n]
  const float* bias;      // may be null
  void* out;
  FloatKind out_kind;
  int64_t ldo;
  bool raw_int32 = false;
  const int32_t* a_group_sums = nullptr;  // int4 weights: [m, groups] sums of A's int8 rows per group (linear())
  const uint8_t* a_rows_small = nullptr;  // [m]: 1 where MicroKernel::a_row_small holds for A's row (linear())
  // out holds the outputs from row first_row and column first_col on (a task's own block, gated_linear); a_scales,
  // w_scales, bias and a_group_sums stay indexed by the whole GEMM's rows and columns.
  int64_t first_row = 0, first_col = 0;

  // The index of output (r, n0) in out's elements (out_kind's, or int32 with raw_int32).
  int64_t element(int64_t r, int64_t n0) const { return (r - first_row) * ldo + n0 - first_col; }
  // The address of output (r, n0) in out_kind.
  void* at(int64_t r, int64_t n0) const {
    return static_cast<char*>(out) + element(r, n0) * element_bytes(out_kind);
  }
};

constexpr int64_t kScaleRowCols = 256;  // most columns scale_row takes at once (its fp32 row buffer)

// out[j] = float(acc[j]) * (a_scale * ws[j]) (+ bias[j]) for j < cols: the rule's arithmetic, written once.
template <typename Acc>
static void scale_values(const Acc* acc, float a_scale, const float* ws, const float* bias, int64_t cols, float* out) {
  if (bias)
    for (int64_t j = 0; j < cols; ++j) out[j] = static_cast<float>(acc[j]) * (a_scale * ws[j]) + bias[j];
  else
    for (int64_t j = 0; j < cols; ++j) out[j] = static_cast<float>(acc[j]) * (a_scale * ws[j]);
}

// The epilogue of one row of accumulators (cols of them, output columns n0.. of row r). Fixed operation order (no FMA
// contraction, see CMakeLists) so every variant, and scale_accumulators, agree bit for bit.
// acc: int32 products (int8 weights) or the fp32 group sums t of int4 weights: the same epilogue on either.
template <typename Acc>
static void scale_row(const Acc* acc, int64_t r, int64_t n0, int64_t cols, const GemmOutput& o) {
  if constexpr (std::is_same_v<Acc, int32_t>) {
    if (o.raw_int32) {
      std::memcpy(static_cast<int32_t*>(o.out) + o.element(r, n0), acc, static_cast<size_t>(cols) * 4);
      return;
    }
  }
  float v[kScaleRowCols];
  void* dst = o.at(r, n0);
  // fp32 rows go straight to the output (the MoE's intermediates: a 64-byte memcpy call per row was ~8% of it).
  float* vr = o.out_kind == FloatKind::f32 ? static_cast<float*>(dst) : v;
  scale_values(acc, o.a_scales[r], o.w_scales + n0, o.bias ? o.bias + n0 : nullptr, cols, vr);
  if (vr == v) store_row_from_float(dst, o.out_kind, v, cols);
}

// The epilogue of one tile: rows [r0, r0 + rows) of c (nr accumulators a row), output columns [n0, n0 + cols). fp32
// outputs (prefill's common case) with the branches hoisted out of the row loop, so short rows (16 columns) do not
// pay scale_row's per-row set-up.
static void scale_tile(const int32_t* c, int rows, int nr, int64_t r0, int64_t n0, int64_t cols, const GemmOutput& o) {
  if (o.raw_int32 || o.out_kind != FloatKind::f32) {
    for (int i = 0; i < rows; ++i) scale_row(c + i * nr, r0 + i, n0, cols, o);
    return;
  }
  const float* ws = o.w_scales + n0;
  const float* bias = o.bias ? o.bias + n0 : nullptr;
  for (int i = 0; i < rows; ++i)
    scale_values(c + i * nr, o.a_scales[r0 + i], ws, bias, cols, static_cast<float*>(o.at(r0 + i, n0)));
}

}  // namespace w8a8_cpu
