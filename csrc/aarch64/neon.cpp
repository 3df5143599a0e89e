// NEON variant for every AArch64 CPU (baseline armv8-a, Advanced SIMD only). Compiled with -march=armv8-a.
//
// Exactness without sdot: smull (vmull_s8) multiplies int8 lanes into int16 products, each at most
// (-128)*(-128) = 16384 in magnitude, which fits int16. Adding two such products in int16 could reach
// 32768 and overflow, so the products go straight into int32 with sadalp (vpadalq_s16: pairwise add
// widened to int32 and accumulate). Every step is exact for all int8 inputs, -128 included.
//
// Layout {16, 4}, the same as ref and dotprod (their blobs are interchangeable): one 16-byte load of a
// panel row group holds 4 channels x 4 k. The A group of 4 k is broadcast to all four 32-bit lanes, so
// smull of the low / high halves gives the products of 2 channels x 4 k each.
//
// This TU also holds the NEON quantization shared by all aarch64 variants (see neon_common.h).
#if !defined(__ARM_NEON)
#error "neon.cpp is a variant TU: build it with its ISA flags (-march=armv8-a), through w8a8_cpu_add_variant"
#endif
#include <arm_neon.h>

#include <cstring>

#include "../common/attention_vec4.h"
#include "../common/cpu_features.h"
#include "../common/ref_kernel.h"
#include "neon_common.h"

namespace w8a8_cpu {
namespace {

constexpr int kNr = kAarch64PanelWidth;
constexpr int kMr = 4;

// Half a panel (8 channels) for M rows: per row, 4 int32x4 accumulators, acc[p] lanes =
// [ch 2p k01, ch 2p k23, ch 2p+1 k01, ch 2p+1 k23] summed over all k groups. 4 rows x 4 = 16 registers,
// plus 2 weight and up to 4 A registers, fits the 32 NEON registers.
template <int M>
void tile_half(const int8_t* a, size_t a_stride, const int8_t* panel, int64_t k_padded, int half, int32_t* c) {
  int32x4_t acc[M][4];
  for (int i = 0; i < M; ++i)
    for (int p = 0; p < 4; ++p) acc[i][p] = vdupq_n_s32(0);
  const int8_t* b = panel + half * 32;
  for (int64_t k = 0; k < k_padded; k += 4, b += kNr * 4) {
    const int8x16_t w01 = vld1q_s8(b), w23 = vld1q_s8(b + 16);  // channels (0,1), (2,3) of this half
    for (int i = 0; i < M; ++i) {
      int32_t a4;
      std::memcpy(&a4, a + i * a_stride + k, 4);
      const int8x16_t av = vreinterpretq_s8_s32(vdupq_n_s32(a4));
      acc[i][0] = vpadalq_s16(acc[i][0], vmull_s8(vget_low_s8(av), vget_low_s8(w01)));
      acc[i][1] = vpadalq_s16(acc[i][1], vmull_high_s8(av, w01));
      acc[i][2] = vpadalq_s16(acc[i][2], vmull_s8(vget_low_s8(av), vget_low_s8(w23)));
      acc[i][3] = vpadalq_s16(acc[i][3], vmull_high_s8(av, w23));
    }
  }
  for (int i = 0; i < M; ++i) {
    // addp of [c0 c0' c1 c1'] and [c2 c2' c3 c3'] gives [c0 c1 c2 c3] in channel order.
    vst1q_s32(c + i * kNr + half * 8, vpaddq_s32(acc[i][0], acc[i][1]));
    vst1q_s32(c + i * kNr + half * 8 + 4, vpaddq_s32(acc[i][2], acc[i][3]));
  }
}

template <int M>
void tile_rows(const int8_t* a, size_t stride, const int8_t* panel, int64_t k_padded, int32_t* c) {
  tile_half<M>(a, stride, panel, k_padded, 0, c);
  tile_half<M>(a, stride, panel, k_padded, 1, c);
}

void neon_tile(const void* a, size_t a_row_stride, int m, const int8_t* panel, const int32_t*, PanelLayout,
               int64_t k_padded, int32_t* c) {
  const auto* a8 = static_cast<const int8_t*>(a);
  with_row_count<4>(m, [&](auto rows) { tile_rows<decltype(rows)::value>(a8, a_row_stride, panel, k_padded, c); });
}

// Loads 4 elements as fp32. bf16: shift into the high half (exact). fp16: fcvtl, baseline AArch64 and
// exact for every finite value incl. subnormals (FPCR.FZ16/FZ are off under Linux). A signalling fp16 NaN
// comes back quiet, which only changes which NaN bits the amax reports (still >= 0x7f800000).
inline float32x4_t load4(const void* x, FloatKind kind, int64_t i) {
  switch (kind) {
    case FloatKind::bf16:
      return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(static_cast<const uint16_t*>(x) + i), 16));
    case FloatKind::f16:
      return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(static_cast<const uint16_t*>(x) + i)));
    case FloatKind::f32: break;
  }
  return vld1q_f32(static_cast<const float*>(x) + i);
}

}  // namespace

uint32_t neon_row_absmax_bits(const void* x, FloatKind kind, int64_t k) {
  // Unsigned max of |x| bit patterns, like the reference: monotone for non-negative floats, and Inf/NaN
  // patterns lie above every finite one, so one pass also detects them.
  const uint32x4_t abs_mask = vdupq_n_u32(0x7fffffffu);
  uint32x4_t m = vdupq_n_u32(0);
  int64_t i = 0;
  for (; i + 4 <= k; i += 4) m = vmaxq_u32(m, vandq_u32(vreinterpretq_u32_f32(load4(x, kind, i)), abs_mask));
  const uint32_t head = vmaxvq_u32(m);
  const uint32_t tail = ref_row_absmax_bits(element_at(x, kind, i), kind, k - i);
  return head > tail ? head : tail;
}

void neon_quantize_row(const void* x, FloatKind kind, int64_t k, float inv_scale, int8_t* q) {
  const float32x4_t inv = vdupq_n_f32(inv_scale);
  const int32x4_t lo = vdupq_n_s32(-127), hi = vdupq_n_s32(127);
  auto quant4 = [&](int64_t i) {
    // fcvtns rounds to nearest, ties to even, whatever FPCR says: the same as std::nearbyint in the
    // reference under the default rounding mode. The fp32 multiply is the reference's, unfused.
    const int32x4_t v = vcvtnq_s32_f32(vmulq_f32(load4(x, kind, i), inv));
    return vminq_s32(vmaxq_s32(v, lo), hi);
  };
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    // Values are already within [-127, 127], so plain narrowing is exact.
    const int16x8_t h0 = vcombine_s16(vmovn_s32(quant4(i)), vmovn_s32(quant4(i + 4)));
    const int16x8_t h1 = vcombine_s16(vmovn_s32(quant4(i + 8)), vmovn_s32(quant4(i + 12)));
    vst1q_s8(q + i, vcombine_s8(vmovn_s16(h0), vmovn_s16(h1)));
  }
  ref_quantize_row(element_at(x, kind, i), kind, k - i, inv_scale, q + i);
}

void neon_attend_key_block(const float* queries, int heads, const KvRows& rows, int64_t keys, int64_t d,
                           float* scores, const KeyBlockOutputs& outputs) {
  attend_key_block_vectors<Vec4Ops>(queries, heads, rows, keys, d, scores, outputs);
}

extern const MicroKernel kNeonKernel;  // external linkage: the registry refers to it
const MicroKernel kNeonKernel = {
    /*name=*/"neon",
    /*required_features=*/kFeatAsimd,
    /*geometry=*/fixed_geometry<kNr, 4, kMr, 1>,
    /*reads_any_layout=*/false,
    pack_rows_one_by_one<ref_pack_a_row>,
    neon_tile,
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
