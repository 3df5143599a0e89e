// The one W8A8 driver, written over the MicroKernel interface: per-token quantization, A packing, and the blocked
// GEMM with the fp32 epilogue. No torch: the caller allocates and provides parallelism (parallel.h). The packed weight
// format is packed_weight.h's.
#pragma once

#include <cstdint>

#include "epilogue.h"
#include "microkernel.h"
#include "packed_weight.h"
#include "parallel.h"

namespace w8a8_cpu {

// amax is clamped to this before scale = amax / 127, so an all-zero row quantizes to zeros.
constexpr float kAmaxEps = 1e-10f;

// Per-token symmetric quantization of x [m, k] (rows ldx elements apart) into q (rows ldq apart) and
// scales [m]: scale = max(amax, kAmaxEps) / 127, q = clamp(round_half_even(x * (127 / amax)), -127, 127).
// A row holding NaN or Inf gets scale NaN and q all 0, so every product with it is NaN: like nn.Linear, a non-finite
// activation row gives a non-finite output row and leaves the other rows exact (one bad request must not fail a
// whole batch). Returns the first such row (callers in strict mode reject it), or -1 when all rows are finite.
// row_amax (may be null): each row's absmax to quantize with instead of its own, e.g. the maximum over the ranks that
// hold slices of one row. The row's own absmax is read too: a NaN/Inf row, or a NaN/+Inf row_amax, marks the row
// non-finite as above; a row_amax below the row's own throws std::invalid_argument naming amax.
int64_t quantize_rows(const MicroKernel& kernel, const void* x, FloatKind kind, int64_t m, int64_t k, int64_t ldx,
                      int8_t* q, int64_t ldq, float* scales, const ParallelFor& parallel_for,
                      const float* row_amax = nullptr);

// Throws std::invalid_argument naming `arg` unless `kernel` reads w's layout.
void check_kernel_reads(const MicroKernel& kernel, const PackedWeightView& w, const char* arg);

// Packs rows [r0, r1) of A, row r read from row_at(r), to dst + r * stride through the variant's pack_a_rows, in
// blocks of pointers (strided rows, or rows gathered from anywhere).
template <typename RowAt>
void pack_rows_via(const MicroKernel& kernel, int64_t r0, int64_t r1, RowAt row_at, int64_t k, int64_t k_padded,
                   uint8_t* dst, int64_t stride) {
  constexpr int64_t kBlock = 64;
  const int8_t* rows[kBlock];
  for (int64_t b = r0; b < r1; b += kBlock) {
    const int64_t n = b + kBlock < r1 ? kBlock : r1 - b;
    for (int64_t i = 0; i < n; ++i) rows[i] = row_at(b + i);
    kernel.pack_a_rows(rows, n, k, k_padded, dst + b * stride, static_cast<size_t>(stride));
  }
}

// A rows packed for `kernel` (pack_a_rows) lie packed_a_stride bytes apart.
int64_t packed_a_stride(const MicroKernel& kernel, int64_t k_padded);

// The variant that packs A for w: plain int8 rows (the reference packing) where w holds int4 weights and the variant
// has an int4 tile (it reads plain rows), else the variant itself.
const MicroKernel& a_packer_for(const MicroKernel& kernel, const PackedWeightView& w);
// The stride of A's rows packed for w (a_packer_for), and the bytes of their int4 group sums (0 for int8 weights).
int64_t packed_a_stride(const MicroKernel& kernel, const PackedWeightView& w);
int64_t a_group_sums_nbytes(const PackedWeightView& w, int64_t m);

// Sums of one int8 row (w.header.k elements) over each of int4 weight w's scale groups into sums [w.groups]: the
// activations' side of the minimums' term (GemmOutput::a_group_sums).
void int4_group_sums(const int8_t* row, const PackedWeightView& w, int32_t* sums);

// A's rows [r0, r1) for w, row r read from row_at(r) (w.header.k int8): packed by a_packer_for(kernel, w) to
// dst + r * packed_a_stride(kernel, w), and for int4 weights their group sums to group_sums + r * w.groups. Every
// driver prepares A through this, so int8 and int4 weights run the same GEMM (compute_panel_rows) after it.
template <typename RowAt>
void prepare_rows_for(const MicroKernel& kernel, const PackedWeightView& w, int64_t r0, int64_t r1, RowAt row_at,
                      uint8_t* dst, int32_t* group_sums) {
  pack_rows_via(a_packer_for(kernel, w), r0, r1, row_at, w.header.k, w.header.k_padded, dst,
                packed_a_stride(kernel, w));
  if (w.int4())
    for (int64_t r = r0; r < r1; ++r) int4_group_sums(row_at(r), w, group_sums + r * w.groups);
}
void pack_a_rows(const MicroKernel& kernel, const int8_t* a, int64_t m, int64_t lda, int64_t k, int64_t k_padded,
                 uint8_t* dst, const ParallelFor& parallel_for);

// The unit of work of every driver: rows [r0, r1) of packed A times one weight panel, through the tile and the
// epilogue into o. The caller has checked check_kernel_reads.
void compute_panel_rows(const MicroKernel& kernel, const uint8_t* a_packed, int64_t a_stride, int64_t r0, int64_t r1,
                        const PackedWeightView& w, int64_t panel, const GemmOutput& o);

// The epilogue alone, for int32 accumulators [m, n] (rows lda apart) summed elsewhere: the same rule, bit for bit.
void scale_accumulators(const int32_t* acc, int64_t m, int64_t n, int64_t lda, const GemmOutput& o,
                        const ParallelFor& parallel_for);

// Scratch bytes gemm() and linear() need for m rows of A with k columns (linear: and `groups` int4 scale groups, whose
// per-row sums of A it computes; 0 for int8).
int64_t gemm_scratch_nbytes(const MicroKernel& kernel, int64_t m, int64_t k_padded);
int64_t linear_scratch_nbytes(const MicroKernel& kernel, int64_t m, int64_t k, int64_t k_padded, int64_t groups = 0);

// o <- a [m, k] (int8, rows lda apart) times w^T: acc[i, j] = sum_k a[i, k] * w[j, k] through the epilogue.
// w packed for a panel width `kernel` reads, int8 weights (int4 weights need linear(): their epilogue needs A's group
// sums).
void gemm(const MicroKernel& kernel, const int8_t* a, int64_t m, int64_t lda, const PackedWeightView& w,
          const GemmOutput& o, void* scratch, const ParallelFor& parallel_for);

// The linear layer: per-token quantization of x [m, k] (rows ldx apart; row_amax as in quantize_rows, may be null)
// and the GEMM, in at most two parallel regions (one when m * k is small). The per-row scales are written to
// a_scales_out [m] (o.a_scales is ignored). Returns the first non-finite row or -1 (quantize_rows).
int64_t linear(const MicroKernel& kernel, const void* x, FloatKind kind, int64_t m, int64_t ldx,
               const float* row_amax, const PackedWeightView& w, GemmOutput o, float* a_scales_out, void* scratch,
               const ParallelFor& parallel_for);

// silu(gate) * up for n elements, in place into gate (activation.h), in the kernel's ISA where it has a copy: one
// operation order, so every variant, the fused MoE and gated_linear agree bit for bit.
void silu_mul(const MicroKernel& kernel, float* gate, const float* up, int64_t n);

// The gated linear layer (SwiGLU MLPs' gate/up projection as one GEMM): w holds 2I channels, gate rows [0, I) then up
// rows [I, 2I); out[r, j] = silu(g[r, j]) * u[r, j] where g and u are linear()'s fp32 outputs of those channels, cast
// once to o.out_kind (o.out [m, I], rows o.ldo apart; o.w_scales and o.bias cover all 2I channels). One activation
// quantization, one GEMM; for rows of tiles (m > kTwoPanelMaxRows) with I whole panels, silu(gate) * up applied by
// each task to its own gate and up blocks, else by a pass over all 2I fp32 channels (the same bits either way).
// Returns the first non-finite row or -1 (quantize_rows).
int64_t gated_linear_scratch_nbytes(const MicroKernel& kernel, int64_t m, int64_t k, int64_t k_padded, int64_t n,
                                    int64_t groups = 0);
int64_t gated_linear(const MicroKernel& kernel, const void* x, FloatKind kind, int64_t m, int64_t ldx,
                     const float* row_amax, const PackedWeightView& w, GemmOutput o, float* a_scales_out,
                     void* scratch, const ParallelFor& parallel_for);

}  // namespace w8a8_cpu
