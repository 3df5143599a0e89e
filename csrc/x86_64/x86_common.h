// What every x86 variant shares: the panel geometry and prefetch distance, the int4 panel stream, the AVX2 vector
// operations of the decode attention's key blocks (attention_key_block.h: fp32, fp16 and int8 caches), and the AVX2
// per-token quantization (defined in avx2.cpp; every x86 variant requires AVX2).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "../common/attention_key_block.h"
#include "../common/microkernel.h"

namespace w8a8_cpu {
// The x86 panel width: one zmm of vpdpbusd (16 channels x 4 k) in the VNNI variant, two ymm in the AVX2 one. Both
// pack the same [k/4][16][4] layout, so a blob packed by either is read by the other.
constexpr int kX86PanelWidth = 16;
// Software prefetch into L2, 8 KiB ahead in the weight panel: when weights come from DRAM the hardware prefetcher
// alone stays too close (measured with the VNNI tile: decode M = 1 14336x4096 +9-16%, MoE experts +13-26%, 4096x4096
// at M = 16 up to +35%; 1-4 KiB ahead into L1 lost ~8% at M = 1, 16 KiB and L3 hints measured no better).
constexpr int kX86PrefetchBytes = 8192;

// An int4 panel (packed_weight.h, WeightScheme) as the x86 int4 tiles stream it from memory: the nibbles, then the
// scales [groups][16] (fp32, or fp16 widened by F16C's vcvtph2ps), then with minimums those [groups][16] (fp32). The
// tiles prefetch into L2 one line per line they read (a burst of a group's lines at its start measured slower),
// kX86PrefetchBytes ahead in the nibbles and as many groups ahead in the scales and minimums (a second and third
// stream; without them every small group waits on its scales), running on into the same region of the panel the tile
// reads next: panels lie back to back, and without that each panel started on demand misses (decode M = 1 g32:
// 4096x4096 at ~1.0x W8A8's time, not ~0.8x). The methods return addresses and the tiles issue the prefetches: GCC (12)
// deletes a call to a function whose only effect is a prefetch. In an unnamed namespace, as `static` elsewhere: each
// ISA-flagged TU keeps its own copy.
namespace {
struct Int4PanelStream {
  const uint8_t* panel;
  int64_t nibble_bytes, scale_size, scale_bytes, min_bytes, panel_bytes;  // scale_size: bytes of one scale
  int64_t lead;       // groups ahead: kX86PrefetchBytes of nibbles
  int64_t next_bytes;  // past a region's end: into the same region this many bytes on (the panel this tile reads
                       // next, decode), or 0: on into this panel's next region (see int4_panel_stream)

  // Group g's scales (channels 0-15) and minimums.
  const uint8_t* scales(int64_t g) const { return panel + nibble_bytes + g * kX86PanelWidth * scale_size; }
  const float* mins(int64_t g) const {
    return reinterpret_cast<const float*>(panel + nibble_bytes + scale_bytes) + g * kX86PanelWidth;
  }

  // The address `offset` bytes into the region at region_offset (region_bytes long); past its end, into the next
  // panel's (next_bytes) or on into this panel's next region.
  const char* ahead(int64_t region_offset, int64_t region_bytes, int64_t offset) const {
    const int64_t wrap = next_bytes == 0 ? 0 : next_bytes - region_bytes;
    return reinterpret_cast<const char*>(panel + region_offset + offset + (offset < region_bytes ? 0 : wrap));
  }
  // The line of group g + lead's scales, and of its minimums.
  const char* scales_ahead(int64_t g) const {
    return ahead(nibble_bytes, scale_bytes, (g + lead) * kX86PanelWidth * scale_size);
  }
  const char* mins_ahead(int64_t g) const {
    return ahead(nibble_bytes + scale_bytes, min_bytes, (g + lead) * kX86PanelWidth * 4);
  }
  // kX86PrefetchBytes past `nibbles` (in this panel's nibbles). 32 k of nibbles (256 bytes) never straddle the
  // region's end (it is whole groups), so one address serves their four lines.
  const char* nibbles_ahead(const uint8_t* nibbles) const {
    return ahead(0, nibble_bytes, nibbles - panel + kX86PrefetchBytes);
  }
};

// decode: for tiles of few rows (decode, where each panel is read once, from memory), the prefetches run on into the
// panel this tile reads next: `panels` on, for a tile reading that many side by side (the panels lie back to back).
// A tile of many rows (prefill) re-reads its panel from cache for every block of rows, and running on into the next
// panel measured ~5-10% slower.
Int4PanelStream int4_panel_stream(const uint8_t* panel, const Int4Groups& f, bool decode, int panels) {
  const int64_t group_nibble_bytes = f.group * kX86PanelWidth / 2, scale_size = int4_scale_bytes(f.half_scales);
  const int64_t nibble_bytes = f.groups * group_nibble_bytes, scale_bytes = f.groups * kX86PanelWidth * scale_size;
  const int64_t min_bytes = f.has_mins ? f.groups * kX86PanelWidth * 4 : 0;
  const int64_t panel_bytes = nibble_bytes + scale_bytes + min_bytes;
  return {panel, nibble_bytes, scale_size, scale_bytes, min_bytes, panel_bytes,
          std::max<int64_t>(1, kX86PrefetchBytes / group_nibble_bytes), decode ? panels * panel_bytes : 0};
}

// Calls body(std::bool_constant<half_scales>, std::bool_constant<has_mins>) for f's int4 storage: a tile's group loop
// compiled per storage, without a branch per group.
template <typename F>
inline void with_int4_storage(const Int4Groups& f, F&& body) {
  if (f.half_scales) {
    if (f.has_mins) return body(std::true_type{}, std::true_type{});
    return body(std::true_type{}, std::false_type{});
  }
  if (f.has_mins) return body(std::false_type{}, std::true_type{});
  body(std::false_type{}, std::false_type{});
}

// Eight group scales from `at` as fp32: the same values either way (fp16 storage holds only fp16 values).
inline __m256 load_scales8(const uint8_t* at, bool half) {
  return half ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)))
              : _mm256_loadu_ps(reinterpret_cast<const float*>(at));
}

// attention_key_block.h's vector operations in AVX2 (F16C's widening for fp16 caches).
struct Avx2Ops {
  using Vec = __m256;
  static constexpr int kWidth = 8;
  static constexpr int kRegisters = 16;

  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec load(const float* at) { return _mm256_loadu_ps(at); }
  // Elements [i, i + 8) of a cached row of `Kind` as fp32 (exact: F16C's widening, int8 through int32).
  template <KvKind Kind>
  static Vec load_kv(const void* row, int64_t i) {
    if constexpr (Kind == KvKind::f32) return _mm256_loadu_ps(static_cast<const float*>(row) + i);
    if constexpr (Kind == KvKind::f16)
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + i)));
    if constexpr (Kind == KvKind::i8)
      return _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(row) + i))));
  }
  static Vec set1(float w) { return _mm256_set1_ps(w); }
  static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  static void store(float* at, Vec v) { _mm256_storeu_ps(at, v); }
  // 8 x 8 floats transposed: r[i] lane j <- r[j] lane i.
  static void transpose(Vec r[8]) {
    Vec t[8], s[8];
#pragma GCC unroll 4
    for (int i = 0; i < 8; i += 2)
      t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]), t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
#pragma GCC unroll 2
    for (int i = 0; i < 8; i += 4)
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        s[i + 2 * h] = _mm256_shuffle_ps(t[i + h], t[i + h + 2], 0x44);
        s[i + 2 * h + 1] = _mm256_shuffle_ps(t[i + h], t[i + h + 2], 0xee);
      }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      r[i] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x20);
      r[i + 4] = _mm256_permute2f128_ps(s[i], s[i + 4], 0x31);
    }
  }
};

}  // namespace

uint32_t avx2_row_absmax_bits(const void* x, FloatKind kind, int64_t k);
void avx2_quantize_row(const void* x, FloatKind kind, int64_t k, float inv_scale, int8_t* q);
}  // namespace w8a8_cpu
