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

#include "../common/activation.h"
#include "../common/cpu_features.h"
#include "../common/epilogue.h"
#include "../common/ref_kernel.h"
#include "x86_common.h"

namespace w8a8_cpu {
namespace {

constexpr int kNr = kX86PanelWidth;
constexpr int kMr = 4;

// One k group of a panel is 64 bytes: channels 0-7 x 4 k, then channels 8-15 x 4 k. Each int32 lane of the
// products is one channel's sum over the group's 4 k. P panels (the second panel_bytes after the first) in one pass:
// P = 2 is the decode tile (MicroKernel::two_panel_rows), c[i * P * 16 + p * 16 + j].
// Small rows (MicroKernel::a_row_small): a product's pair sum |u0 a0 + u1 a1| <= 128 (|a0| + |a1|) (u = |w| <= 128),
// so two k steps' int16 lanes (k, k + 1 and k + 4, k + 5 from k = 0 mod 8; likewise k + 2, k + 3, k + 6, k + 7) add
// exactly in int16 when those four |a| sum to at most 255 (128 * 255 = 32640): one vpmaddwd and one vpaddd for the
// two steps instead of two each. Real rows are mostly small (per-token int8 activations have one 127 and small values
// around it: ~95% of SmolLM2's prefill rows).
constexpr int kSmallLaneSum = 255;

bool avx2_row_small(const int8_t* a, int64_t k) {
  const __m256i ones = _mm256_set1_epi8(1);
  __m256i worst = _mm256_setzero_si256();
  // |a| summed in pairs (int16 lane j: |a[2j]| + |a[2j + 1]|), then each 8 k's pairs 0 + 2 and 1 + 3 (a 64-bit lane
  // shifted down by two int16 lanes); its lanes 2 and 3 keep a single pair sum (<= 256: never above the bound)
  auto fold = [&](const int8_t* at) {
    const __m256i pairs = _mm256_maddubs_epi16(
        _mm256_abs_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at))), ones);
    worst = _mm256_max_epu16(worst, _mm256_add_epi16(pairs, _mm256_srli_epi64(pairs, 32)));
  };
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) fold(a + i);
  if (i < k) {  // the last < 32 k, zero-padded as the packed row is
    int8_t tail[32] = {};
    std::memcpy(tail, a + i, static_cast<size_t>(k - i));
    fold(tail);
  }
  alignas(32) uint16_t lanes[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), worst);
  return *std::max_element(lanes, lanes + 16) <= kSmallLaneSum;
}

template <int M, int P = 1, bool kSmall = false>
void tile_rows(const int8_t* a, size_t stride, const int8_t* panel, int64_t panel_bytes, int64_t k_padded,
               int32_t* c) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[M][2 * P];
  // Fully unrolled so the accumulators live in registers (GCC 12 at -O2 keeps a rolled loop's array in memory).
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i)
#pragma GCC unroll 4
    for (int h = 0; h < 2 * P; ++h) acc[i][h] = _mm256_setzero_si256();
  // The weights of one k step of each panel: w as stored, u = |w|; the activations' sign goes to a (vpsignb).
  auto load_step = [&](int64_t offset, __m256i* w, __m256i* u) {
    // Into L2, kX86PrefetchBytes ahead in each panel's stream (why and how far: x86_common.h); past a panel's end,
    // the stream goes on in the same panel of the next P (the driver's next call), not in this call's next panel.
    const int64_t ahead = kX86PrefetchBytes + (offset + kX86PrefetchBytes >= panel_bytes ? (P - 1) * panel_bytes : 0);
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) {
      const int8_t* b = panel + p * panel_bytes + offset;
      _mm_prefetch(reinterpret_cast<const char*>(b + ahead), _MM_HINT_T1);
      w[2 * p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
      w[2 * p + 1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32));
      u[2 * p] = _mm256_abs_epi8(w[2 * p]), u[2 * p + 1] = _mm256_abs_epi8(w[2 * p + 1]);
    }
  };
  auto a_step = [&](int i, int64_t k) {
    int32_t a4;
    std::memcpy(&a4, a + i * stride + k, 4);
    return _mm256_set1_epi32(a4);
  };
  int64_t k = 0, offset = 0;
  if constexpr (kSmall)
    for (; k + 8 <= k_padded; k += 8, offset += kNr * 8) {
      __m256i w0[2 * P], u0[2 * P], w1[2 * P], u1[2 * P];
      load_step(offset, w0, u0);
      load_step(offset + kNr * 4, w1, u1);
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i) {
        const __m256i a0 = a_step(i, k), a1 = a_step(i, k + 4);
#pragma GCC unroll 4
        for (int h = 0; h < 2 * P; ++h) {
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u0[h], _mm256_sign_epi8(a0, w0[h])),
                                                 _mm256_maddubs_epi16(u1[h], _mm256_sign_epi8(a1, w1[h])));
          acc[i][h] = _mm256_add_epi32(acc[i][h], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
  for (; k < k_padded; k += 4, offset += kNr * 4) {
    __m256i w[2 * P], u[2 * P];
    load_step(offset, w, u);
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      const __m256i av = a_step(i, k);
#pragma GCC unroll 4
      for (int h = 0; h < 2 * P; ++h)
        acc[i][h] = _mm256_add_epi32(acc[i][h],
                                     _mm256_madd_epi16(_mm256_maddubs_epi16(u[h], _mm256_sign_epi8(av, w[h])), ones));
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i)
#pragma GCC unroll 4
    for (int h = 0; h < 2 * P; ++h) _mm256_storeu_si256(reinterpret_cast<__m256i*>(c + i * P * kNr + h * 8), acc[i][h]);
}

void avx2_tile(const void* a, size_t a_row_stride, int m, const int8_t* panel, const int32_t*, PanelLayout,
               int64_t k_padded, int32_t* c) {
  const auto* a8 = static_cast<const int8_t*>(a);
  with_row_count<kMr>(m, [&](auto rows) {
    tile_rows<decltype(rows)::value>(a8, a_row_stride, panel, 0, k_padded, c);
  });
}

void avx2_tile_small(const void* a, size_t a_row_stride, int m, const int8_t* panel, const int32_t*, PanelLayout,
                     int64_t k_padded, int32_t* c) {
  const auto* a8 = static_cast<const int8_t*>(a);
  with_row_count<kMr>(m, [&](auto rows) {
    tile_rows<decltype(rows)::value, 1, true>(a8, a_row_stride, panel, 0, k_padded, c);
  });
}

void avx2_two_panel_rows(const void* a, size_t a_row_stride, int m, const int8_t* panel, int64_t panel_bytes,
                         const int32_t*, PanelLayout, int64_t k_padded, int32_t* c) {
  const auto* a8 = static_cast<const int8_t*>(a);
  with_row_count<kTwoPanelMaxRows>(m, [&](auto rows) {
    tile_rows<decltype(rows)::value, 2>(a8, a_row_stride, panel, panel_bytes, k_padded, c);
  });
}

// a + b (int16 lanes) as an asm statement: GCC 12 reassociates a chain of _mm256_add_epi16 over an unrolled chunk,
// computing all its 64 products first and spilling them (4 rows ran 1.2x the int8 tile's time instead of ~0.8x).
inline __m256i add_in_order(__m256i a, __m256i b) {
  __asm__("vpaddw %1, %0, %0" : "+x"(a) : "x"(b));
  return a;
}

// W4A8: the panel's nibbles u = q + 8 widened in registers (32 bytes: the low nibbles are channels 0-7 x 4 k, the high
// ones channels 8-15, the int8 tile's w0 and w1) are the unsigned operand of vpmaddubsw against the plain int8
// activations. Its pair sums, |u0 a0 + u1 a1| <= 2 * 15 * 127 = 3810, never saturate, and eight of them (32 k) still
// fit int16 (30480), so each 32 k costs one vpmaddwd per channel half. acc = sum u * a = sum q * a + 8 * sum a:
// starting acc at -8 * the row's group sum leaves q's exact group product. The groups combine in the driver's fp32
// order (mul, then add: no FMA).
// P panels (the second panel_bytes after the first) in one pass: P = 2 is the decode row tile
// (MicroKernel::int4_two_panel_rows), t[i * P * 16 + p * 16 + j].
// Compiled per storage (fp16 or fp32 scales, minimums or not: int4_rows_for), and the group's scales and minimums read
// through pointers moved a group at a time: at M = 1 a group of two panels took ~260 instructions, ~110 of them outside
// its 8 steps, mostly the storage tests and address arithmetic of a loop written once for every storage (W4A8's M = 1
// loop ran no more weights a second than W8A8's with both in L1; now 1.3x).
template <int M, int P, bool kHalfScales, bool kHasMins>
void int4_rows(const int8_t* a, size_t stride, const uint8_t* panel, int64_t panel_bytes, const Int4Groups& f,
               const int32_t* a_group_sums, float* t) {
  const int64_t group = f.group, groups = f.groups;
  const __m256i low_nibbles = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  constexpr int kCols = P * kNr;
  constexpr int64_t kScaleSize = int4_scale_bytes(kHalfScales);
  Int4PanelStream stream[P];
  const uint8_t* nibbles[P];
  const uint8_t* scales[P];  // group g's
  const float* mins[P];
#pragma GCC unroll 2
  for (int p = 0; p < P; ++p) {
    // running on into the next panels for decode only: a 4-row tile is also the prefill tile
    stream[p] = int4_panel_stream(panel + p * panel_bytes, f, /*decode=*/M <= 2, P);
    nibbles[p] = stream[p].panel;
    scales[p] = stream[p].scales(0);
    mins[p] = kHasMins ? stream[p].mins(0) : nullptr;
  }
  // t in registers across the groups where they fit beside the chunk's pair sums and nibbles (decode rows), else in
  // memory (L1)
  constexpr bool kSumsInRegisters = M * 2 * P <= 4;
  __m256 sums[M][2 * P];
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i)
#pragma GCC unroll 4
    for (int h = 0; h < 2 * P; ++h) sums[i][h] = _mm256_setzero_ps();
  if constexpr (!kSumsInRegisters)
    for (int i = 0; i < M * kCols; ++i) t[i] = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) {
      _mm_prefetch(stream[p].scales_ahead(g), _MM_HINT_T1);
      if constexpr (kHasMins) _mm_prefetch(stream[p].mins_ahead(g), _MM_HINT_T1);
    }
    // The pair sums of one 32-k chunk (8 steps of 4 k) into pairs, the nibble pointers moved past it.
    auto chunk = [&](int64_t k0, __m256i (&pairs)[M][2 * P]) {
      const char* ahead[P];
#pragma GCC unroll 2
      for (int p = 0; p < P; ++p) ahead[p] = stream[p].nibbles_ahead(nibbles[p]);
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) {
        __m256i u[2 * P];
#pragma GCC unroll 2
        for (int p = 0; p < P; ++p) {
          if (s % 2 == 0) _mm_prefetch(ahead[p] + s * 32, _MM_HINT_T1);  // one per line
          const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles[p] + s * 32));
          u[2 * p] = _mm256_and_si256(packed, low_nibbles);
          u[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low_nibbles);
        }
#pragma GCC unroll 8
        for (int i = 0; i < M; ++i) {
          int32_t a4;
          std::memcpy(&a4, a + i * stride + k0 + s * 4, 4);
          const __m256i av = _mm256_set1_epi32(a4);
#pragma GCC unroll 4
          for (int h = 0; h < 2 * P; ++h) {
            const __m256i products = _mm256_maddubs_epi16(u[h], av);
            pairs[i][h] = s == 0 ? products : add_in_order(pairs[i][h], products);  // the first step starts them
          }
        }
      }
#pragma GCC unroll 2
      for (int p = 0; p < P; ++p) nibbles[p] += 256;
    };
    // t += the exact group products (8 channels: row i, panel p, half h) times their scales (+ sum a times minimums)
    auto combine = [&](int i, int p, int h, __m256i products) {
      float* ti = t + i * kCols + p * kNr + h * 8;
      const __m256 scale = load_scales8(scales[p] + h * 8 * kScaleSize, kHalfScales);
      __m256 v = _mm256_add_ps(kSumsInRegisters ? sums[i][p * 2 + h] : _mm256_loadu_ps(ti),
                               _mm256_mul_ps(_mm256_cvtepi32_ps(products), scale));
      if constexpr (kHasMins) {
        const __m256 a_sum = _mm256_set1_ps(static_cast<float>(a_group_sums[i * groups + g]));
        v = _mm256_add_ps(v, _mm256_mul_ps(a_sum, _mm256_loadu_ps(mins[p] + h * 8)));
      }
      if constexpr (kSumsInRegisters)
        sums[i][p * 2 + h] = v;
      else
        _mm256_storeu_ps(ti, v);
    };
    if (group == 32) {
      // one chunk: the products straight from its pair sums (registers), no accumulator in memory (decode: ~1/3 of
      // the group's instructions outside the chunk loop were that accumulator's stores and loads)
      __m256i pairs[M][2 * P];
      chunk(g * group, pairs);
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i) {
        const __m256i start = _mm256_set1_epi32(-8 * a_group_sums[i * groups + g]);
#pragma GCC unroll 4
        for (int h = 0; h < 2 * P; ++h)
          combine(i, h / 2, h % 2, _mm256_add_epi32(start, _mm256_madd_epi16(pairs[i][h], ones)));
      }
    } else {
      // Longer groups: the products in memory (L1) between their 32-k chunks: with the pair sums in registers as
      // well, 16 ymm are too few at 4 rows (GCC spilled inside the chunk).
      alignas(32) int32_t acc[M * kCols];
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i) {
        const __m256i start = _mm256_set1_epi32(-8 * a_group_sums[i * groups + g]);
#pragma GCC unroll 4
        for (int h = 0; h < 2 * P; ++h) _mm256_store_si256(reinterpret_cast<__m256i*>(acc + i * kCols + h * 8), start);
      }
      for (int64_t k0 = g * group; k0 < (g + 1) * group; k0 += 32) {
        __m256i pairs[M][2 * P];
        chunk(k0, pairs);
#pragma GCC unroll 8
        for (int i = 0; i < M; ++i)
#pragma GCC unroll 4
          for (int h = 0; h < 2 * P; ++h) {
            auto* row = reinterpret_cast<__m256i*>(acc + i * kCols + h * 8);
            _mm256_store_si256(row, _mm256_add_epi32(_mm256_load_si256(row), _mm256_madd_epi16(pairs[i][h], ones)));
          }
      }
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i)
#pragma GCC unroll 4
        for (int h = 0; h < 2 * P; ++h)
          combine(i, h / 2, h % 2, _mm256_load_si256(reinterpret_cast<const __m256i*>(acc + i * kCols + h * 8)));
    }
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) {
      scales[p] += kNr * kScaleSize;
      if constexpr (kHasMins) mins[p] += kNr;
    }
    // t stays in memory (the tiles that keep it there: one panel of 3-4 rows, two panels of 2 rows): GCC otherwise
    // holds part of it in registers across the groups and spills pair sums inside the chunk instead (4 rows ~10%
    // slower)
    if constexpr (!kSumsInRegisters) __asm__ volatile("" ::: "memory");
  }
  if constexpr (kSumsInRegisters)
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i)
#pragma GCC unroll 4
      for (int h = 0; h < 2 * P; ++h) _mm256_storeu_ps(t + i * kCols + h * 8, sums[i][h]);
}

// int4_rows for m <= MaxM rows and the panels' storage.
template <int MaxM, int P>
void int4_rows_for(const int8_t* a, size_t stride, int m, const uint8_t* panel, int64_t panel_bytes,
                   const Int4Groups& f, const int32_t* a_group_sums, float* t) {
  with_row_count<MaxM>(m, [&](auto rows) {
    with_int4_storage(f, [&](auto half_scales, auto has_mins) {
      int4_rows<decltype(rows)::value, P, decltype(half_scales)::value, decltype(has_mins)::value>(
          a, stride, panel, panel_bytes, f, a_group_sums, t);
    });
  });
}

void avx2_int4_tile(const int8_t* a, size_t a_row_stride, int m, const uint8_t* panel, PanelLayout,
                    const Int4Groups& groups, const int32_t* a_group_sums, float* t) {
  int4_rows_for<kMr, 1>(a, a_row_stride, m, panel, 0, groups, a_group_sums, t);
}

void avx2_int4_two_panel_rows(const int8_t* a, size_t a_row_stride, int m, const uint8_t* panel, int64_t panel_bytes,
                              PanelLayout, const Int4Groups& groups, const int32_t* a_group_sums, float* t) {
  int4_rows_for<kTwoPanelMaxRows, 2>(a, a_row_stride, m, panel, panel_bytes, groups, a_group_sums, t);
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
    avx2_int4_tile,
    silu_mul_row,
    softmax_numerators_row,
    attend_key_block_vectors<Avx2Ops>,
    scale_tile,
    avx2_two_panel_rows,
    avx2_int4_two_panel_rows,
    avx2_row_small,
    avx2_tile_small,
};

}  // namespace w8a8_cpu
