// I8MM variant (Armv8.6-A FEAT_I8MM, optional from 8.2: Neoverse V1/N2, Cortex-A510/A710, Graviton3
// and later). Compiled with -march=armv8.2-a+i8mm+dotprod. smmla (vmmlaq_s32) multiplies a 2x8 int8
// block of A by an 8x2 block of weights into a 2x2 int32 block: 32 exact int8 products per instruction,
// twice sdot's 16, at the same issue rate on current cores.
//
// Layout {16, 8}: in panel[k/8][n%16][k%8] the 16 bytes at one k group and channels (2q, 2q+1) are
// [w_2q k0..7 | w_2q+1 k0..7], exactly smmla's second operand. A rows are plain int8; a row pair
// (2p, 2p+1) is combined on load from two 8-byte loads. The accumulator of row pair p and channel pair
// q holds [r0 c0, r0 c1, r1 c0, r1 c1] and is de-interleaved with zip1/zip2 on 64-bit lanes at the end.
// The tile is 4 rows x 16 channels = 2 x 8 accumulators. For an odd row count the missing row of the
// last pair is zeros (its results are discarded).
//
// Decode (m == 1): smmla would spend half its products on a zero row, so one row goes through an sdot
// GEMV over the same kr = 8 panels instead: with A's 8 bytes duplicated into both halves of a register,
// one sdot per channel pair and k group of 8 gives [c0 k0..3, c0 k4..7, c1 k0..3, c1 k4..7], and a final
// addp folds the halves. Same useful products per instruction as smmla here, no zero row to build, and
// the weights (the whole cost of a GEMV) are read the same way. FEAT_I8MM CPUs all have dotprod, which
// this variant requires too.
//
// Only code that runs on i8mm CPUs lives here; A packing and quantization are the baseline ones from neon.cpp.
#if !defined(__ARM_FEATURE_MATMUL_INT8)
#error "i8mm.cpp is a variant TU: build it with its ISA flags (-march=armv8.2-a+i8mm+dotprod), through w8a8_cpu_add_variant"
#endif
#include <arm_neon.h>

#include "../common/cpu_features.h"
#include "neon_common.h"

namespace w8a8_cpu {
namespace {

constexpr int kNr = kAarch64PanelWidth;
constexpr int kKr = 8;
constexpr int kMr = 4;

void gemv_sdot(const int8_t* a, const int8_t* panel, int64_t k_padded, int32_t* c) {
  int32x4_t acc[8];
  for (int q = 0; q < 8; ++q) acc[q] = vdupq_n_s32(0);
  const int8_t* b = panel;
  for (int64_t k = 0; k < k_padded; k += kKr, b += kNr * kKr) {
    const int8x8_t a8 = vld1_s8(a + k);
    const int8x16_t av = vcombine_s8(a8, a8);
    for (int q = 0; q < 8; ++q) acc[q] = vdotq_s32(acc[q], vld1q_s8(b + q * 16), av);
  }
  for (int h = 0; h < 4; ++h) vst1q_s32(c + h * 4, vpaddq_s32(acc[2 * h], acc[2 * h + 1]));
}

// M = 2..4 rows as ceil(M / 2) row pairs.
template <int M>
void tile_smmla(const int8_t* a, size_t a_stride, const int8_t* panel, int64_t k_padded, int32_t* c) {
  constexpr int P = (M + 1) / 2;
  int32x4_t acc[P][8];
  for (int p = 0; p < P; ++p)
    for (int q = 0; q < 8; ++q) acc[p][q] = vdupq_n_s32(0);
  const int8_t* b = panel;
  for (int64_t k = 0; k < k_padded; k += kKr, b += kNr * kKr) {
    int8x16_t av[P];
    for (int p = 0; p < P; ++p) {
      const int8x8_t r0 = vld1_s8(a + (2 * p) * a_stride + k);
      const int8x8_t r1 = 2 * p + 1 < M ? vld1_s8(a + (2 * p + 1) * a_stride + k) : vdup_n_s8(0);
      av[p] = vcombine_s8(r0, r1);
    }
    for (int q = 0; q < 8; ++q) {
      const int8x16_t w = vld1q_s8(b + q * 16);
      for (int p = 0; p < P; ++p) acc[p][q] = vmmlaq_s32(acc[p][q], av[p], w);
    }
  }
  for (int p = 0; p < P; ++p)
    for (int h = 0; h < 4; ++h) {
      const int64x2_t x = vreinterpretq_s64_s32(acc[p][2 * h]), y = vreinterpretq_s64_s32(acc[p][2 * h + 1]);
      vst1q_s32(c + (2 * p) * kNr + h * 4, vreinterpretq_s32_s64(vzip1q_s64(x, y)));
      if (2 * p + 1 < M) vst1q_s32(c + (2 * p + 1) * kNr + h * 4, vreinterpretq_s32_s64(vzip2q_s64(x, y)));
    }
}

void i8mm_tile(const void* a, size_t a_row_stride, int m, const int8_t* panel, const int32_t*, PanelLayout,
               int64_t k_padded, int32_t* c) {
  const auto* a8 = static_cast<const int8_t*>(a);
  if (m == 1) return gemv_sdot(a8, panel, k_padded, c);
  with_row_count<4>(m, [&](auto rows) { tile_smmla<decltype(rows)::value>(a8, a_row_stride, panel, k_padded, c); });
}

}  // namespace

extern const MicroKernel kI8mmKernel;  // external linkage: the registry refers to it
const MicroKernel kI8mmKernel = {
    /*name=*/"i8mm",
    /*required_features=*/kFeatAsimd | kFeatDotprod | kFeatI8mm,
    /*geometry=*/fixed_geometry<kNr, kKr, kMr, 1>,
    /*reads_any_layout=*/false,
    pack_rows_one_by_one<ref_pack_a_row>,
    i8mm_tile,
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
