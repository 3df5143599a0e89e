// AVX2 variant (Haswell / Zen and later; needs AVX2 + FMA + F16C). Compiled with -mavx2 -mfma -mf16c.
//
// Exactness: vpmaddubsw (u8 x s8 -> saturating int16 pair sums) can saturate, so this variant sign-extends
// both operands to int16 and uses vpmaddwd, whose int16 x int16 pair sums into int32 are exact for every
// int8 input (including -128). A rows are packed as int16 once per call; weights stay int8 in the shared
// [k/4][nr][4] panel layout and are widened on load.
#include <immintrin.h>

#include <cstring>

#include "../common/cpu_features.h"
#include "../common/ref_kernel.h"
#include "avx2_quant.h"

namespace w8a8_cpu {
namespace {

constexpr int kNr = 16;  // shared x86 panel width (one zmm of vpdpbusd in the VNNI variant)
constexpr int kMr = 4;
constexpr int kPrefetchBytes = 8192;

void pack_a_row_int16(const int8_t* a, int64_t k, int64_t k_padded, void* dst) {
  auto* out = static_cast<int16_t*>(dst);
  int64_t i = 0;
  for (; i + 16 <= k; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i),
                        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a + i))));
  for (; i < k; ++i) out[i] = a[i];
  for (; i < k_padded; ++i) out[i] = 0;
}

// One k-group of 4 for 4 channels is 16 bytes; widened, each int32 lane of vpmaddwd holds one channel's
// partial sum over k-pair (0,1) or (2,3). The two halves are added with vphaddd at the end.
template <int M>
void tile_half(const int16_t* a, size_t a_stride_elems, const int8_t* panel, int64_t k_padded, int half,
               int32_t* c) {
  __m256i acc[M][2];
  for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_si256();
  const int8_t* b = panel + half * 32;
  for (int64_t k = 0; k < k_padded; k += 4, b += kNr * 4) {
    // Into L2, 8 KiB ahead, on the first of the two passes (why and how far: see the VNNI variant).
    if (half == 0) _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchBytes), _MM_HINT_T1);
    const __m256i b0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    const __m256i b1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16)));
    for (int i = 0; i < M; ++i) {
      int64_t a4;
      std::memcpy(&a4, a + i * a_stride_elems + k, 8);
      const __m256i av = _mm256_set1_epi64x(a4);
      acc[i][0] = _mm256_add_epi32(acc[i][0], _mm256_madd_epi16(av, b0));
      acc[i][1] = _mm256_add_epi32(acc[i][1], _mm256_madd_epi16(av, b1));
    }
  }
  for (int i = 0; i < M; ++i) {
    // hadd gives [c0 c1 c4 c5 | c2 c3 c6 c7]; the permute restores channel order.
    const __m256i sums = _mm256_permute4x64_epi64(_mm256_hadd_epi32(acc[i][0], acc[i][1]), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + i * kNr + half * 8), sums);
  }
}

template <int M>
void tile_rows(const int16_t* a, size_t stride, const int8_t* panel, int64_t k_padded, int32_t* c) {
  tile_half<M>(a, stride, panel, k_padded, 0, c);
  tile_half<M>(a, stride, panel, k_padded, 1, c);
}

void avx2_tile(const void* a, size_t a_row_stride, int m, const int8_t* panel, const int32_t*, PanelLayout,
               int64_t k_padded, int32_t* c) {
  const auto* a16 = static_cast<const int16_t*>(a);
  const size_t stride = a_row_stride / sizeof(int16_t);
  with_row_count<4>(m, [&](auto rows) { tile_rows<decltype(rows)::value>(a16, stride, panel, k_padded, c); });
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
    /*layout=*/{kNr, 4},
    /*reads_any_layout=*/false,
    /*mr=*/kMr,
    /*a_elem_bytes=*/sizeof(int16_t),
    pack_a_row_int16,
    avx2_tile,
    avx2_row_absmax_bits,
    avx2_quantize_row,
};

}  // namespace w8a8_cpu
