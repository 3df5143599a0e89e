// Pieces of the VSX variant that the MMA variant reuses. They are defined in vsx.cpp, which is compiled
// for the POWER8 baseline: code that must run on every ppc64le CPU lives only there, because a TU built
// with -mcpu=power10 may contain prefixed / MMA instructions anywhere.
#pragma once

#include "../common/microkernel.h"

namespace w8a8_cpu {
// The panel width every variant of this arch packs, in one place.
constexpr int kPpc64PanelWidth = 16;
// Packed A row for the ppc64 variants: uint8 a + 128 (vmsummbm and xvi8ger4 take one unsigned operand),
// padded with 128 (a = 0) up to k_padded.
void vsx_pack_a_row_biased_u8(const int8_t* a, int64_t k, int64_t k_padded, void* dst);
uint32_t vsx_row_absmax_bits(const void* x, FloatKind kind, int64_t k);
void vsx_quantize_row(const void* x, FloatKind kind, int64_t k, float inv_scale, int8_t* q);
// MicroKernel::attend_key_block in VSX (attention_vec4.h's copy of activation.h's rule, compiled for the baseline).
void vsx_attend_key_block(const float* queries, int heads, const KvRows& rows, int64_t keys, int64_t d,
                          float* scores, const KeyBlockOutputs& outputs);
}  // namespace w8a8_cpu
