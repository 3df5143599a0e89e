// Fused W8A8 / W4A8 mixture-of-experts (SiLU-gated experts), written once over the MicroKernel interface via the
// GEMM driver's prepare_rows_for and compute_panel_rows (so int4 experts run the dense int4 path, bit for bit). No
// torch: the caller validates, allocates the scratch, parallelises.
#pragma once

#include <cstdint>

#include "gemm_driver.h"

namespace w8a8_cpu {

struct MoeProblem {
  int64_t tokens, hidden, intermediate, experts, topk;
  const void* x;  // [tokens, hidden] activations, rows ldx elements apart
  FloatKind x_kind;
  int64_t ldx;
  const float* topk_weights;        // [tokens, topk]
  const int64_t* topk_ids;          // [tokens, topk], validated against [0, experts) by the driver
  // Per expert, int8 or int4 (WeightScheme); the experts of one projection share one layout and format, since A is
  // prepared once for all of them.
  const PackedWeightView* w13;      // [experts]: n = 2 * intermediate (gate rows, then up rows), k = hidden
  const float* w13_scales;          // [experts, 2 * intermediate] (int4: on top of the group scales)
  const PackedWeightView* w2;       // [experts]: n = hidden, k = intermediate
  const float* w2_scales;           // [experts, hidden]
  void* out;                        // [tokens, hidden], contiguous
  FloatKind out_kind;
  bool reject_non_finite;           // strict mode: a NaN/Inf hidden or intermediate row throws
};

int64_t moe_scratch_nbytes(const MicroKernel& kernel, const MoeProblem& p);

// For each token t and slot k with expert e = topk_ids[t, k]:
//   gate_up = (q(x[t]) . w13[e]^T) * scales       (exact int32, fp32 epilogue; int4: GemmOutput's group order)
//   act     = silu(gate_up[:I]) * gate_up[I:]
//   down    = (q(act) . w2[e]^T) * scales         (act re-quantized per row)
//   out[t] += topk_weights[t, k] * down          (k = 0, 1, ... in order; one cast at the end)
// q() is the per-token quantization of quantize_rows. Results do not depend on the thread count or the
// variant (given its exact int32). A NaN/Inf row of x (or of a token's intermediate activation) makes that token's
// output row NaN (quantize_rows), or throws std::invalid_argument when p.reject_non_finite; out-of-range ids throw,
// and so do experts of one projection packed in different layouts or formats.
void fused_experts(const MicroKernel& kernel, const MoeProblem& p, void* scratch, const ParallelFor& parallel_for);

}  // namespace w8a8_cpu
