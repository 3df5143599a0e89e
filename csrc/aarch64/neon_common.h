// Pieces of the NEON variant that the dotprod and i8mm variants reuse. They are defined in neon.cpp,
// which is compiled for baseline armv8-a: code that must run on every AArch64 CPU lives only there,
// because GCC auto-vectorises into sdot/smmla anywhere in a TU built with +dotprod/+i8mm.
#pragma once

#include "../common/microkernel.h"
#include "../common/ref_kernel.h"  // ref_pack_a_row: the aarch64 variants read A as plain int8

namespace w8a8_cpu {
// The panel width every variant of this arch packs (kr differs: 4, or 8 for smmla), in one place.
constexpr int kAarch64PanelWidth = 16;
uint32_t neon_row_absmax_bits(const void* x, FloatKind kind, int64_t k);
void neon_quantize_row(const void* x, FloatKind kind, int64_t k, float inv_scale, int8_t* q);
// MicroKernel::attend_key_block in NEON (attention_vec4.h's copy of activation.h's rule, compiled for the baseline).
void neon_attend_key_block(const float* queries, int heads, const KvRows& rows, int64_t keys, int64_t d,
                           float* scores, const KeyBlockOutputs& outputs);
}  // namespace w8a8_cpu
