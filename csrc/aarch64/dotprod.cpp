// Dotprod variant (Armv8.2-A FEAT_DotProd: Cortex-A55/A76, Neoverse N1 and later). Compiled with
// -march=armv8.2-a+dotprod. sdot (vdotq_s32) adds four int8 x int8 products into each int32 lane:
// exact for every int8 input, -128 included (each sum is at most 4 * 2^14).
//
// Layout {16, 4}, shared with neon and ref: one 16-byte load is 4 channels x 4 k, exactly one sdot
// operand. The tile is register-blocked 4 rows x 16 channels = 16 int32x4 accumulators; 16 bytes of A
// per row (4 k groups) are loaded at once and used lane by lane with vdotq_laneq_s32.
//
// Only code that runs on dotprod CPUs lives here (GCC may auto-vectorise into sdot anywhere in this TU);
// A packing and quantization are the baseline ones from neon.cpp.
#if !defined(__ARM_FEATURE_DOTPROD)
#error "dotprod.cpp is a variant TU: build it with its ISA flags (-march=armv8.2-a+dotprod), through w8a8_cpu_add_variant"
#endif
#include <arm_neon.h>

#include <cstring>

#include "../common/cpu_features.h"
#include "neon_common.h"

namespace w8a8_cpu {
namespace {

constexpr int kNr = kAarch64PanelWidth;
constexpr int kMr = 4;

template <int M>
void tile_rows(const int8_t* a, size_t a_stride, const int8_t* panel, int64_t k_padded, int32_t* c) {
  int32x4_t acc[M][4];
  for (int i = 0; i < M; ++i)
    for (int q = 0; q < 4; ++q) acc[i][q] = vdupq_n_s32(0);
  const int8_t* b = panel;
  int64_t k = 0;
  // Main loop: 16 k per step. Loads stay within k_padded, the end of each packed A row.
  for (; k + 16 <= k_padded; k += 16) {
    int8x16_t av[M];
    for (int i = 0; i < M; ++i) av[i] = vld1q_s8(a + i * a_stride + k);
#define W8A8_DOT_GROUP(L)                                                                      \
  {                                                                                            \
    const int8x16_t w0 = vld1q_s8(b), w1 = vld1q_s8(b + 16), w2 = vld1q_s8(b + 32), w3 = vld1q_s8(b + 48); \
    for (int i = 0; i < M; ++i) {                                                              \
      acc[i][0] = vdotq_laneq_s32(acc[i][0], w0, av[i], L);                                    \
      acc[i][1] = vdotq_laneq_s32(acc[i][1], w1, av[i], L);                                    \
      acc[i][2] = vdotq_laneq_s32(acc[i][2], w2, av[i], L);                                    \
      acc[i][3] = vdotq_laneq_s32(acc[i][3], w3, av[i], L);                                    \
    }                                                                                          \
    b += kNr * 4;                                                                              \
  }
    // The lane index of vdotq_laneq_s32 must be a constant, hence the unrolled groups.
    W8A8_DOT_GROUP(0)
    W8A8_DOT_GROUP(1)
    W8A8_DOT_GROUP(2)
    W8A8_DOT_GROUP(3)
#undef W8A8_DOT_GROUP
  }
  // Remaining k groups of 4 (k_padded is a multiple of 4, not necessarily of 16).
  for (; k < k_padded; k += 4, b += kNr * 4) {
    const int8x16_t w0 = vld1q_s8(b), w1 = vld1q_s8(b + 16), w2 = vld1q_s8(b + 32), w3 = vld1q_s8(b + 48);
    for (int i = 0; i < M; ++i) {
      int32_t a4;
      std::memcpy(&a4, a + i * a_stride + k, 4);
      const int8x16_t av = vreinterpretq_s8_s32(vdupq_n_s32(a4));
      acc[i][0] = vdotq_s32(acc[i][0], w0, av);
      acc[i][1] = vdotq_s32(acc[i][1], w1, av);
      acc[i][2] = vdotq_s32(acc[i][2], w2, av);
      acc[i][3] = vdotq_s32(acc[i][3], w3, av);
    }
  }
  for (int i = 0; i < M; ++i)
    for (int q = 0; q < 4; ++q) vst1q_s32(c + i * kNr + q * 4, acc[i][q]);
}

void dotprod_tile(const void* a, size_t a_row_stride, int m, const int8_t* panel, const int32_t*, PanelLayout,
                  int64_t k_padded, int32_t* c) {
  const auto* a8 = static_cast<const int8_t*>(a);
  with_row_count<4>(m, [&](auto rows) { tile_rows<decltype(rows)::value>(a8, a_row_stride, panel, k_padded, c); });
}

}  // namespace

extern const MicroKernel kDotprodKernel;  // external linkage: the registry refers to it
const MicroKernel kDotprodKernel = {
    /*name=*/"dotprod",
    /*required_features=*/kFeatAsimd | kFeatDotprod,
    /*geometry=*/fixed_geometry<kNr, 4, kMr, 1>,
    /*reads_any_layout=*/false,
    pack_rows_one_by_one<ref_pack_a_row>,
    dotprod_tile,
    neon_row_absmax_bits,
    neon_quantize_row,
    /*thread_enter=*/nullptr,
    /*thread_leave=*/nullptr,
    /*a_excludes_int8_min=*/false,
    /*int4_tile=*/nullptr,
    /*silu_mul=*/nullptr,
    /*softmax_numerators=*/nullptr,
    neon_attend_key_block,
};

}  // namespace w8a8_cpu
