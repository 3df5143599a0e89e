// AVX2 variant (Haswell / Zen and later; needs AVX2 + FMA + F16C). Compiled with -mavx2 -mfma -mf16c.
//
// Exactness: vpmaddubsw multiplies unsigned x signed bytes and adds adjacent pairs into a *saturating* int16,
// which is why ONNX Runtime and fbgemm need 7-bit operands (reduce_range) on CPUs without VNNI. Here the unsigned
// operand is |w| (0..128, -128 included) and the signed one is a * sign(w) (vpsignb), so each product keeps its
// sign and value, and a pair sum is at most 2 * 128 * 127 = 32512 < 32767: never saturates, for every weight, as
// long as a >= -127 (vpsignb cannot negate -128). The driver's per-token quantizer only produces [-127, 127]; a
// caller's A holding -128 goes to the reference tile (gemm(), a_excludes_int8_min). vpmaddwd with ones
// then sums the pairs into int32, 32 multiply-adds per two multiplier instructions, all 16 channels of a
// panel in one pass (two int32 accumulators per row, no horizontal adds).
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "avx2.cpp is a variant TU: build it with its ISA flags (-mavx2 -mfma -mf16c), through w8a8_cpu_add_variant"
#endif
#include <immintrin.h>

#include <cstring>

#include "../common/cpu_features.h"
#include "../common/ref_kernel.h"
#include "x86_common.h"

namespace w8a8_cpu {
namespace {

constexpr int kNr = kX86PanelWidth;
constexpr int kMr = 4;

// One k group of a panel is 64 bytes: channels 0-7 x 4 k, then channels 8-15 x 4 k. Each int32 lane of the
// products is one channel's sum over the group's 4 k.
template <int M>
void tile_rows(const int8_t* a, size_t stride, const int8_t* panel, int64_t k_padded, int32_t* c) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[M][2];
  // Fully unrolled so the accumulators live in registers (GCC 12 at -O2 keeps a rolled loop's array in memory).
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
  const int8_t* b = panel;
  for (int64_t k = 0; k < k_padded; k += 4, b += kNr * 4) {
    // Into L2, kX86PrefetchBytes ahead (why and how far: x86_common.h).
    _mm_prefetch(reinterpret_cast<const char*>(b + kX86PrefetchBytes), _MM_HINT_T1);
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32));
    const __m256i u0 = _mm256_abs_epi8(w0), u1 = _mm256_abs_epi8(w1);
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      int32_t a4;
      std::memcpy(&a4, a + i * stride + k, 4);
      const __m256i av = _mm256_set1_epi32(a4);
      const __m256i p0 = _mm256_maddubs_epi16(u0, _mm256_sign_epi8(av, w0));
      const __m256i p1 = _mm256_maddubs_epi16(u1, _mm256_sign_epi8(av, w1));
      acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(p0, ones));
      acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(p1, ones));
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + i * kNr), acc[i][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + i * kNr + 8), acc[i][1]);
  }
}

void avx2_tile(const void* a, size_t a_row_stride, int m, const int8_t* panel, const int32_t*, PanelLayout,
               int64_t k_padded, int32_t* c) {
  const auto* a8 = static_cast<const int8_t*>(a);
  with_row_count<kMr>(m, [&](auto rows) { tile_rows<decltype(rows)::value>(a8, a_row_stride, panel, k_padded, c); });
}

// Loads 8 elements as fp32 (bf16: shift into the high half; fp16: F16C, exact).
inline __m256 load8(const void* x, FloatKind kind, int64_t i) {
  switch (kind) {
    case FloatKind::bf16:
      return _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + i))),
          16));
    case FloatKind::f16:
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(x) + i)));
    case FloatKind::f32: break;
  }
  return _mm256_loadu_ps(static_cast<const float*>(x) + i);
}

}  // namespace

uint32_t avx2_row_absmax_bits(const void* x, FloatKind kind, int64_t k) {
  // Max of |x| bit patterns as int32: monotone for non-negative floats, and Inf/NaN compare above all
  // finite values, so a single pass also detects them.
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  __m256i m = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8)
    m = _mm256_max_epi32(m, _mm256_and_si256(_mm256_castps_si256(load8(x, kind, i)), abs_mask));
  __m128i m4 = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  m4 = _mm_max_epi32(m4, _mm_shuffle_epi32(m4, 0x4e));
  m4 = _mm_max_epi32(m4, _mm_shuffle_epi32(m4, 0xb1));
  const uint32_t head = static_cast<uint32_t>(_mm_cvtsi128_si32(m4));
  const uint32_t tail = ref_row_absmax_bits(element_at(x, kind, i), kind, k - i);
  return head > tail ? head : tail;
}

void avx2_quantize_row(const void* x, FloatKind kind, int64_t k, float inv_scale, int8_t* q) {
  const __m256 inv = _mm256_set1_ps(inv_scale);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  auto quant8 = [&](int64_t i) {
    // cvtps2dq rounds half to even under the default MXCSR, matching std::nearbyint in the reference.
    const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x, kind, i), inv));
    return _mm256_min_epi32(_mm256_max_epi32(v, lo), hi);
  };
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    const __m256i p01 = _mm256_packs_epi32(quant8(i), quant8(i + 8));
    const __m256i p23 = _mm256_packs_epi32(quant8(i + 16), quant8(i + 24));
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p01, p23), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), bytes);
  }
  ref_quantize_row(element_at(x, kind, i), kind, k - i, inv_scale, q + i);
}

extern const MicroKernel kAvx2Kernel;  // external linkage: the registry refers to it
const MicroKernel kAvx2Kernel = {
    /*name=*/"avx2",
    /*required_features=*/kFeatAvx2,
    /*geometry=*/fixed_geometry<kNr, 4, kMr, 1>,
    /*reads_any_layout=*/false,
    pack_rows_one_by_one<ref_pack_a_row>,
    avx2_tile,
    avx2_row_absmax_bits,
    avx2_quantize_row,
    /*thread_enter=*/nullptr,
    /*thread_leave=*/nullptr,
    /*a_excludes_int8_min=*/true,
};

}  // namespace w8a8_cpu
