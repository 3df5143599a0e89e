// AVX2 per-token quantization, shared by every x86 variant that requires AVX2 (compiled in avx2.cpp).
#pragma once

#include "../common/microkernel.h"

namespace w8a8_cpu {
uint32_t avx2_row_absmax_bits(const void* x, FloatKind kind, int64_t k);
void avx2_quantize_row(const void* x, FloatKind kind, int64_t k, float inv_scale, int8_t* q);
}  // namespace w8a8_cpu
