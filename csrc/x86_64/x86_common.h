// What every x86 variant shares: the panel geometry and prefetch distance, and the AVX2 per-token quantization
// (defined in avx2.cpp; every x86 variant requires AVX2).
#pragma once

#include "../common/microkernel.h"

namespace w8a8_cpu {
// The x86 panel width: one zmm of vpdpbusd (16 channels x 4 k) in the VNNI variant, two ymm in the AVX2 one. Both
// pack the same [k/4][16][4] layout, so a blob packed by either is read by the other.
constexpr int kX86PanelWidth = 16;
// Software prefetch into L2, 8 KiB ahead in the weight panel: when weights come from DRAM the hardware prefetcher
// alone stays too close (measured with the VNNI tile: decode M = 1 14336x4096 +9-16%, MoE experts +13-26%, 4096x4096
// at M = 16 up to +35%; 1-4 KiB ahead into L1 lost ~8% at M = 1, 16 KiB and L3 hints measured no better).
constexpr int kX86PrefetchBytes = 8192;

uint32_t avx2_row_absmax_bits(const void* x, FloatKind kind, int64_t k);
void avx2_quantize_row(const void* x, FloatKind kind, int64_t k, float inv_scale, int8_t* q);
}  // namespace w8a8_cpu
