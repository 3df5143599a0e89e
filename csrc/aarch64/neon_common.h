// Pieces of the NEON variant that the dotprod and i8mm variants reuse. They are defined in neon.cpp,
// which is compiled for baseline armv8-a: code that must run on every AArch64 CPU lives only there,
// because GCC auto-vectorises into sdot/smmla anywhere in a TU built with +dotprod/+i8mm.
#pragma once

#include "../common/microkernel.h"

namespace w8a8_cpu {
// Packed A row for the aarch64 variants: the int8 values themselves, zero-padded to k_padded.
void neon_pack_a_row_int8(const int8_t* a, int64_t k, int64_t k_padded, void* dst);
uint32_t neon_row_absmax_bits(const void* x, FloatKind kind, int64_t k);
void neon_quantize_row(const void* x, FloatKind kind, int64_t k, float inv_scale, int8_t* q);
}  // namespace w8a8_cpu
