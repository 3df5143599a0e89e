// AVX512-VNNI variant (Cascade Lake / Ice Lake / Sapphire Rapids / Zen4 and later). Compiled with
// -mavx512f -mavx512bw -mavx512vl -mavx512vnni (plus AVX2 for the shared quantization).
//
// vpdpbusd multiplies unsigned x signed bytes and sums groups of 4 into int32 without saturation. A is
// packed as u8 = a + 128, so acc = sum (a + 128) * w = sum a * w + 128 * sum w; the weight sums stored
// in the packed blob remove the bias. int32 arithmetic wraps, and the true result fits int32 for
// K <= kMaxK, so the corrected result is exact.
#if !defined(__AVX512VNNI__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__AVX2__)
#error "avx512_vnni.cpp is a variant TU: build it with its ISA flags (-mavx512f -mavx512bw -mavx512vl -mavx512vnni (see variants.cmake)), through w8a8_cpu_add_variant"
#endif
#include <immintrin.h>

#include <cstring>

#include "../common/activation.h"
#include "../common/attention_key_block.h"
#include "../common/cpu_features.h"
#include "../common/epilogue.h"
#include "x86_common.h"

namespace w8a8_cpu {
namespace {

constexpr int kNr = kX86PanelWidth;  // one zmm = 16 channels x 4 k
constexpr int kMr = 8;
// The wide prefill tile (MicroKernel::wide_tile): 6 rows x 4 panels = 24 accumulators, 4 panel lines and a broadcast
// of A in the other 8 of the 32 zmm registers.
constexpr int kWideMr = 6, kWidePanels = 4;

// acc += a (u8) . b (s8), four products per int32 lane. Inline asm instead of _mm512_dpbusd_epi32: GCC 12
// copies every accumulator through a spare register around that builtin's tied operand (two extra zmm moves
// per vpdpbusd in the tile loop), which cost ~8% of prefill throughput.
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

void pack_a_row_biased_u8(const int8_t* a, int64_t k, int64_t k_padded, void* dst) {
  auto* out = static_cast<uint8_t*>(dst);
  const __m512i bias = _mm512_set1_epi8(static_cast<char>(0x80));
  int64_t i = 0;
  for (; i + 64 <= k; i += 64)
    _mm512_storeu_si512(out + i, _mm512_xor_si512(_mm512_loadu_si512(a + i), bias));
  for (; i < k; ++i) out[i] = static_cast<uint8_t>(a[i] ^ 0x80);
  // Zero weights pad K, so any value works here; 128 keeps "a = 0" for readability in dumps.
  for (; i < k_padded; ++i) out[i] = 0x80;
}

// U independent accumulators per row and panel over interleaved k groups: with few rows, one accumulator per row
// would serialize every vpdpbusd on the previous one's latency (decode, M = 1, ran at ~1/4 of throughput). P panels
// (panel p at p * panel_bytes) in one pass, c[i * P * 16 + p * 16 + j]: P = 2 is the decode tile
// (MicroKernel::two_panel_rows; its rows keep 4 chains as the one-panel tile's, 2 a panel: <= 8 accumulators), P = 4
// the wide prefill tile (U = 1: 4 panels are already 4 chains a row). Stream: the decode tiles read each panel once
// from memory and prefetch it; the wide tile reads panels that a task reuses from cache for all its rows.
template <int M, int P = 1, int U = (M <= 2 ? 4 / P : M <= 4 ? 2 : 1), bool Stream = true>
void tile_rows(const uint8_t* a, size_t stride, const int8_t* panel, int64_t panel_bytes, const int32_t* col_sums,
               int64_t k_padded, int32_t* c) {
  static_assert(M * P * U + P + 1 <= 32, "accumulators, panel lines and the broadcast of A fit the 32 zmm registers");
  __m512i acc[M][P][U];
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i)
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p)
#pragma GCC unroll 4
      for (int u = 0; u < U; ++u) acc[i][p][u] = _mm512_setzero_si512();
  // One k step (one line of each panel) into accumulator u.
  auto step = [&](int64_t k, int u) {
    const int64_t offset = k * kNr;
    __m512i b[P];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const int8_t* line = panel + p * panel_bytes + offset;
      if constexpr (Stream) {
        // Into L2, kX86PrefetchBytes ahead in each panel's stream (why and how far: x86_common.h); past a panel's
        // end, the stream goes on in the same panel of the next P (the driver's next call), not in this call's next.
        const int64_t ahead =
            kX86PrefetchBytes + (offset + kX86PrefetchBytes >= panel_bytes ? (P - 1) * panel_bytes : 0);
        _mm_prefetch(reinterpret_cast<const char*>(line + ahead), _MM_HINT_T1);
      }
      b[p] = _mm512_loadu_si512(line);
    }
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      int32_t a4;
      std::memcpy(&a4, a + i * stride + k, 4);
      const __m512i av = _mm512_set1_epi32(a4);
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) acc[i][p][u] = dpbusd(acc[i][p][u], av, b[p]);
    }
  };
  int64_t k = 0;
  for (; k + 4 * U <= k_padded; k += 4 * U)
#pragma GCC unroll 4
    for (int u = 0; u < U; ++u) step(k + 4 * u, u);
  for (; k < k_padded; k += 4) step(k, 0);
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p) {
    const __m512i correction = _mm512_slli_epi32(_mm512_loadu_si512(col_sums + p * kNr), 7);
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i) {
      __m512i sum = acc[i][p][0];
#pragma GCC unroll 4
      for (int u = 1; u < U; ++u) sum = _mm512_add_epi32(sum, acc[i][p][u]);
      _mm512_storeu_si512(c + i * P * kNr + p * kNr, _mm512_sub_epi32(sum, correction));
    }
  }
}

void vnni_tile(const void* a, size_t a_row_stride, int m, const int8_t* panel, const int32_t* col_sums, PanelLayout,
               int64_t k_padded, int32_t* c) {
  const auto* a8 = static_cast<const uint8_t*>(a);
  with_row_count<kMr>(m, [&](auto rows) {
    tile_rows<decltype(rows)::value>(a8, a_row_stride, panel, 0, col_sums, k_padded, c);
  });
}

void vnni_two_panel_rows(const void* a, size_t a_row_stride, int m, const int8_t* panel, int64_t panel_bytes,
                         const int32_t* col_sums, PanelLayout, int64_t k_padded, int32_t* c) {
  const auto* a8 = static_cast<const uint8_t*>(a);
  with_row_count<kTwoPanelMaxRows>(m, [&](auto rows) {
    tile_rows<decltype(rows)::value, 2>(a8, a_row_stride, panel, panel_bytes, col_sums, k_padded, c);
  });
}

void vnni_wide_tile(const void* a, size_t a_row_stride, int m, const int8_t* panel, int64_t panel_bytes,
                    const int32_t* col_sums, PanelLayout, int64_t k_padded, int32_t* c) {
  const auto* a8 = static_cast<const uint8_t*>(a);
  with_row_count<kWideMr>(m, [&](auto rows) {
    tile_rows<decltype(rows)::value, kWidePanels, 1, /*Stream=*/false>(a8, a_row_stride, panel, panel_bytes, col_sums,
                                                                       k_padded, c);
  });
}

// W4A8: the panel's nibbles u = q + 8 multiplied as the unsigned operand of vpdpbusd against the plain int8
// activations: acc = sum u * a = sum q * a + 8 * sum a, so q's exact group product is acc - 8 * (the row's group sum).
// A 64-byte line of a panel is 8 k: bytes 0-31 hold k .. k + 3 (low nibbles channels 0-7, high nibbles 8-15, 4 k a
// channel), bytes 32-63 k + 4 .. k + 7 likewise. So the line's low nibbles are channels 0-7 in int32 lanes 0-7 against
// a[k .. k + 3] and in lanes 8-15 against a[k + 4 .. k + 7], its high nibbles channels 8-15 the same way: two
// vpdpbusd a line against one activation vector of both quads, no shuffle of the weights (3 vector operations a line
// to widen, not 6: the tile ran at ~2.5x the memory's speed from cache and no faster from memory than ~90% of it); a
// group's sums add the lanes' two halves (exact int32). The groups combine in the driver's fp32 order (mul, then
// add: no FMA, as everywhere). P panels (the second panel_bytes after the first) in one pass: P = 2 is the decode
// tile (MicroKernel::int4_two_panel_rows), t[i * P * 16 + p * 16 + j].
template <int M, int P = 1>
void int4_rows(const int8_t* a, size_t stride, const uint8_t* panel, int64_t panel_bytes, const Int4Groups& f,
               const int32_t* a_group_sums, float* t) {
  static_assert(P == 1 || M <= kTwoPanelMaxRows, "the two-panel tile is a decode tile");
  const int64_t group = f.group, groups = f.groups;
  const bool has_mins = f.has_mins;
  // Independent accumulators per row, panel and nibble half (latency, as tile_rows): lines alternate between them.
  // Groups are multiples of 32 k, 4 lines.
  constexpr int U = M * P <= 2 ? 2 : 1;
  static_assert(M * P * 2 * U + M * P + 5 <= 32, "accumulators, sums, lines and the activations fit the zmm registers");
  // The row loops are unrolled so that sum and acc stay in registers (GCC 12 kept a rolled loop's sum in memory:
  // prefill ~15% slower).
  const __m512i low_nibbles = _mm512_set1_epi8(0x0f);
  Int4PanelStream stream[P];
  const uint8_t* nibbles[P];
#pragma GCC unroll 2
  for (int p = 0; p < P; ++p) {
    stream[p] = int4_panel_stream(panel + p * panel_bytes, f, /*decode=*/M <= 4, P);
    nibbles[p] = stream[p].panel;
  }
  __m512 sum[M][P];
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i)
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) sum[i][p] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) {
      _mm_prefetch(stream[p].scales_ahead(g), _MM_HINT_T1);
      if (has_mins) _mm_prefetch(stream[p].mins_ahead(g), _MM_HINT_T1);
    }
    __m512i acc[M][P][2][U];  // [..][0]: low nibbles (channels 0-7), [..][1]: high (8-15); lanes 8-15 the second quad
#pragma GCC unroll 8
    for (int i = 0; i < M; ++i)
#pragma GCC unroll 2
      for (int p = 0; p < P; ++p)
#pragma GCC unroll 2
        for (int u = 0; u < U; ++u) acc[i][p][0][u] = acc[i][p][1][u] = _mm512_setzero_si512();
    // One line (8 k) of each panel into accumulators u.
    auto line = [&](int64_t k, int u) {
      __m512i low[P], high[P];
#pragma GCC unroll 2
      for (int p = 0; p < P; ++p) {
        _mm_prefetch(stream[p].nibbles_ahead(nibbles[p]), _MM_HINT_T1);
        const __m512i x = _mm512_loadu_si512(nibbles[p]);
        low[p] = _mm512_and_si512(x, low_nibbles);
        high[p] = _mm512_and_si512(_mm512_srli_epi16(x, 4), low_nibbles);
        nibbles[p] += 64;
      }
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i) {
        int32_t quads[2];
        std::memcpy(quads, a + i * stride + k, 8);
        const __m512i av = _mm512_mask_set1_epi32(_mm512_set1_epi32(quads[0]), 0xff00, quads[1]);
#pragma GCC unroll 2
        for (int p = 0; p < P; ++p) {
          acc[i][p][0][u] = dpbusd(acc[i][p][0][u], low[p], av);
          acc[i][p][1][u] = dpbusd(acc[i][p][1][u], high[p], av);
        }
      }
    };
    for (int64_t k = g * group; k < (g + 1) * group; k += 8 * U)
#pragma GCC unroll 2
      for (int u = 0; u < U; ++u) line(k + 8 * u, u);
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) {
      const uint8_t* scales = stream[p].scales(g);
      const __m512 scale = f.half_scales
                               ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)))
                               : _mm512_loadu_ps(scales);
#pragma GCC unroll 8
      for (int i = 0; i < M; ++i) {
        __m512i low = acc[i][p][0][0], high = acc[i][p][1][0];
#pragma GCC unroll 2
        for (int u = 1; u < U; ++u) {
          low = _mm512_add_epi32(low, acc[i][p][0][u]);
          high = _mm512_add_epi32(high, acc[i][p][1][u]);
        }
        // channels 0-7 from the low nibbles' two quads, 8-15 from the high ones'
        const __m512i total = _mm512_add_epi32(_mm512_shuffle_i64x2(low, high, 0x44),
                                               _mm512_shuffle_i64x2(low, high, 0xee));
        const int32_t a_sum = a_group_sums[i * groups + g];
        const __m512i exact = _mm512_sub_epi32(total, _mm512_set1_epi32(8 * a_sum));
        sum[i][p] = _mm512_add_ps(sum[i][p], _mm512_mul_ps(_mm512_cvtepi32_ps(exact), scale));
        if (has_mins)
          sum[i][p] = _mm512_add_ps(sum[i][p], _mm512_mul_ps(_mm512_set1_ps(static_cast<float>(a_sum)),
                                                             _mm512_loadu_ps(stream[p].mins(g))));
      }
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < M; ++i)
#pragma GCC unroll 2
    for (int p = 0; p < P; ++p) _mm512_storeu_ps(t + i * P * kNr + p * kNr, sum[i][p]);
}

void vnni_int4_tile(const int8_t* a, size_t a_row_stride, int m, const uint8_t* panel, PanelLayout,
                    const Int4Groups& groups, const int32_t* a_group_sums, float* t) {
  with_row_count<kMr>(m, [&](auto rows) {
    int4_rows<decltype(rows)::value>(a, a_row_stride, panel, 0, groups, a_group_sums, t);
  });
}

void vnni_int4_two_panel_rows(const int8_t* a, size_t a_row_stride, int m, const uint8_t* panel, int64_t panel_bytes,
                              PanelLayout, const Int4Groups& groups, const int32_t* a_group_sums, float* t) {
  with_row_count<kTwoPanelMaxRows>(m, [&](auto rows) {
    int4_rows<decltype(rows)::value, 2>(a, a_row_stride, panel, panel_bytes, groups, a_group_sums, t);
  });
}

// The decode attention's key block (attention_key_block.h) in zmm vectors: lane_dot's 16 lanes are one vector a key,
// 16 keys' sums transposed at once, 64 value dims in 4 accumulators: half the instructions of the AVX2 copy for the
// same operations in the same order (the same bits). At long contexts the block is compute-bound (int8 keys and values
// widened to fp32 once a query head), so the width counts there.
struct Avx512Ops {
  using Vec = __m512;
  static constexpr int kWidth = 16;
  static constexpr int kRegisters = 32;

  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec load(const float* at) { return _mm512_loadu_ps(at); }
  // Elements [i, i + 16) of a cached row of `Kind` as fp32 (exact widenings).
  template <KvKind Kind>
  static Vec load_kv(const void* row, int64_t i) {
    if constexpr (Kind == KvKind::f32) return _mm512_loadu_ps(static_cast<const float*>(row) + i);
    if constexpr (Kind == KvKind::f16)
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(row) + i)));
    if constexpr (Kind == KvKind::i8)
      return _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(row) + i))));
  }
  static Vec set1(float w) { return _mm512_set1_ps(w); }
  static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  static void store(float* at, Vec v) { _mm512_storeu_ps(at, v); }
  // 16 x 16 floats transposed: r[i] lane j <- r[j] lane i. First each 4 x 4 block inside the 128-bit lanes (s[4g + c],
  // 128-bit lane l: rows 4g .. 4g + 3 at column 4l + c), then the 4 x 4 blocks of 128-bit lanes.
  static void transpose(Vec r[16]) {
    Vec t[16], s[16];
#pragma GCC unroll 8
    for (int i = 0; i < 16; i += 2)
      t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
#pragma GCC unroll 4
    for (int i = 0; i < 16; i += 4)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        s[i + 2 * h] = _mm512_shuffle_ps(t[i + h], t[i + h + 2], 0x44);
        s[i + 2 * h + 1] = _mm512_shuffle_ps(t[i + h], t[i + h + 2], 0xee);
      }
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const Vec ab_low = _mm512_shuffle_f32x4(s[c], s[4 + c], 0x44), ab_high = _mm512_shuffle_f32x4(s[c], s[4 + c], 0xee);
      const Vec cd_low = _mm512_shuffle_f32x4(s[8 + c], s[12 + c], 0x44);
      const Vec cd_high = _mm512_shuffle_f32x4(s[8 + c], s[12 + c], 0xee);
      r[c] = _mm512_shuffle_f32x4(ab_low, cd_low, 0x88), r[4 + c] = _mm512_shuffle_f32x4(ab_low, cd_low, 0xdd);
      r[8 + c] = _mm512_shuffle_f32x4(ab_high, cd_high, 0x88), r[12 + c] = _mm512_shuffle_f32x4(ab_high, cd_high, 0xdd);
    }
  }
};

}  // namespace

extern const MicroKernel kAvx512VnniKernel;  // external linkage: the registry refers to it
const MicroKernel kAvx512VnniKernel = {
    /*name=*/"avx512_vnni",
    /*required_features=*/kFeatAvx2 | kFeatAvx512Vnni,
    /*geometry=*/fixed_geometry<kNr, 4, kMr, 1, kWidePanels, kWideMr>,
    /*reads_any_layout=*/false,
    pack_rows_one_by_one<pack_a_row_biased_u8>,
    vnni_tile,
    avx2_row_absmax_bits,
    avx2_quantize_row,
    /*thread_enter=*/nullptr,
    /*thread_leave=*/nullptr,
    /*a_excludes_int8_min=*/false,
    vnni_int4_tile,
    silu_mul_row,
    softmax_numerators_row,
    attend_key_block_vectors<Avx512Ops>,
    scale_tile,
    vnni_two_panel_rows,
    vnni_int4_two_panel_rows,
    /*a_row_small=*/nullptr,
    /*tile_small=*/nullptr,
    vnni_wide_tile,
};

}  // namespace w8a8_cpu
