// The portable reference variant, and the pieces of it other variants and the driver reuse.
#pragma once

#include "microkernel.h"

namespace w8a8_cpu {

// Panel width of the layout the reference variant packs (with kr = 4). The reference tile reads any
// layout, so a weight packed by any variant can be checked against it.
constexpr int kRefNr = 16;

extern const MicroKernel kRefKernel;

// Packed A row as plain int8, zero-padded to k_padded (also the aarch64 variants' A format).
void ref_pack_a_row(const int8_t* a, int64_t k, int64_t k_padded, void* dst);
void ref_tile(const void* a, size_t a_row_stride, int m, const int8_t* panel, const int32_t* col_sums,
              PanelLayout layout, int64_t k_padded, int32_t* c);
uint32_t ref_row_absmax_bits(const void* x, FloatKind kind, int64_t k);
void ref_quantize_row(const void* x, FloatKind kind, int64_t k, float inv_scale, int8_t* q);

}  // namespace w8a8_cpu
