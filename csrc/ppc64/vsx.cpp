// VSX variant for every ppc64le CPU (POWER8 and later, the ppc64le ABI baseline). Compiled with
// -mcpu=power8 -mvsx.
//
// vmsummbm (vec_msum on signed x unsigned bytes) multiplies signed bytes by unsigned bytes and adds each
// group of 4 products to an int32 lane, modulo 2^32, without saturation. A is packed as u8 = a + 128, so
// acc = sum (a + 128) * w = sum a * w + 128 * sum w; the per-channel weight sums of the packed blob remove
// the bias. Intermediate int32 values may wrap, but the corrected result is exact modulo 2^32 and the true
// result fits int32 for K <= kMaxK, so it is exact for every int8 input, -128 included (like vpdpbusd).
//
// Layout {16, 4}, the same as ref (blobs are interchangeable with ref and mma): one 16-byte load of a
// panel k group is 4 channels x 4 k, the signed operand of vmsummbm; the 4 A bytes of that k group are
// splatted to all four words. The tile is register-blocked 4 rows x 16 channels = 16 accumulators.
//
// This TU also holds the A packing and VSX quantization shared by both ppc64 variants (vsx_common.h).
#if !defined(__VSX__)
#error "vsx.cpp is a variant TU: build it with its ISA flags (-mcpu=power8 -mvsx), through w8a8_cpu_add_variant"
#endif
#include <altivec.h>

#include <cstring>

#include "../common/attention_vec4.h"
#include "../common/cpu_features.h"
#include "../common/ref_kernel.h"
#include "vsx_common.h"

namespace w8a8_cpu {
namespace {

using vu8 = __vector unsigned char;
using vs8 = __vector signed char;
using vu16 = __vector unsigned short;
using vs32 = __vector signed int;
using vu32 = __vector unsigned int;
using vf32 = __vector float;

constexpr int kNr = kPpc64PanelWidth;
constexpr int kMr = 4;

// Adds one k group (4 k) to the M x 16 accumulators: w points at the group's 64 panel bytes, a4[i] holds
// row i's 4 biased A bytes in every word.
template <int M>
inline void msum_group(vs32 (&acc)[M][4], const int8_t* w, const vu32 (&a4)[M]) {
  const vs8 w0 = vec_xl(0, w), w1 = vec_xl(16, w), w2 = vec_xl(32, w), w3 = vec_xl(48, w);
  for (int i = 0; i < M; ++i) {
    const vu8 a = reinterpret_cast<vu8>(a4[i]);
    acc[i][0] = vec_msum(w0, a, acc[i][0]);
    acc[i][1] = vec_msum(w1, a, acc[i][1]);
    acc[i][2] = vec_msum(w2, a, acc[i][2]);
    acc[i][3] = vec_msum(w3, a, acc[i][3]);
  }
}

template <int M>
void tile_rows(const uint8_t* a, size_t a_stride, const int8_t* panel, const int32_t* col_sums, int64_t k_padded,
               int32_t* c) {
  vs32 acc[M][4];
  for (int i = 0; i < M; ++i)
    for (int q = 0; q < 4; ++q) acc[i][q] = vec_splats(0);
  // One k group per step: a 4-byte load + splat per row (lxsiwzx + xxspltw). Loading 16 bytes of A and
  // splatting its words needs 4 more live registers per row and makes GCC spill accumulators.
  const int8_t* b = panel;
  for (int64_t k = 0; k < k_padded; k += 4, b += kNr * 4) {
    vu32 a4[M];
    for (int i = 0; i < M; ++i) {
      uint32_t bytes;
      std::memcpy(&bytes, a + i * a_stride + k, 4);
      a4[i] = vec_splats(bytes);
    }
    msum_group<M>(acc, b, a4);
  }
  const vu32 seven = vec_splats(7u);
  for (int q = 0; q < 4; ++q) {
    const vs32 correction = vec_sl(vec_xl(0, col_sums + 4 * q), seven);  // 128 * sum_k w, modulo 2^32
    for (int i = 0; i < M; ++i) vec_xst(vec_sub(acc[i][q], correction), 0, c + i * kNr + 4 * q);
  }
}

void vsx_tile(const void* a, size_t a_row_stride, int m, const int8_t* panel, const int32_t* col_sums, PanelLayout,
              int64_t k_padded, int32_t* c) {
  const auto* a8 = static_cast<const uint8_t*>(a);
  with_row_count<4>(m, [&](auto rows) {
    tile_rows<decltype(rows)::value>(a8, a_row_stride, panel, col_sums, k_padded, c);
  });
}

// Loads 8 elements as two fp32 vectors (elements i..i+3, i+4..i+7). bf16: the bits go to the high half
// of each word (exact); merging with zero on little-endian puts h in bits 16..31. f16 has no POWER8
// conversion instruction, so f16 rows take the scalar reference path (callers never pass f16 here).
inline void load8(const void* x, FloatKind kind, int64_t i, vf32& lo, vf32& hi) {
  if (kind == FloatKind::bf16) {
    const vu16 h = vec_xl(0, static_cast<const uint16_t*>(x) + i), zero = vec_splats(static_cast<unsigned short>(0));
    lo = reinterpret_cast<vf32>(vec_mergeh(zero, h));
    hi = reinterpret_cast<vf32>(vec_mergel(zero, h));
    return;
  }
  const float* f = static_cast<const float*>(x) + i;
  lo = vec_xl(0, f);
  hi = vec_xl(16, f);
}

}  // namespace

void vsx_pack_a_row_biased_u8(const int8_t* a, int64_t k, int64_t k_padded, void* dst) {
  auto* out = static_cast<uint8_t*>(dst);
  const vu8 bias = vec_splats(static_cast<unsigned char>(0x80));
  int64_t i = 0;
  for (; i + 16 <= k; i += 16)
    vec_xst(vec_xor(reinterpret_cast<vu8>(vec_xl(0, a + i)), bias), 0, out + i);
  for (; i < k; ++i) out[i] = static_cast<uint8_t>(a[i] ^ 0x80);
  // Zero weights pad K, so any value works here; 128 keeps "a = 0" for readability in dumps.
  for (; i < k_padded; ++i) out[i] = 0x80;
}

uint32_t vsx_row_absmax_bits(const void* x, FloatKind kind, int64_t k) {
  if (kind == FloatKind::f16) return ref_row_absmax_bits(x, kind, k);
  // Unsigned max of |x| bit patterns, like the reference: monotone for non-negative floats, and Inf/NaN
  // patterns lie above every finite one, so one pass also detects them.
  const vu32 abs_mask = vec_splats(0x7fffffffu);
  vu32 m = vec_splats(0u);
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    vf32 lo, hi;
    load8(x, kind, i, lo, hi);
    m = vec_max(m, vec_and(reinterpret_cast<vu32>(lo), abs_mask));
    m = vec_max(m, vec_and(reinterpret_cast<vu32>(hi), abs_mask));
  }
  uint32_t head = 0;
  for (int l = 0; l < 4; ++l) head = head > m[l] ? head : m[l];
  const uint32_t tail = ref_row_absmax_bits(element_at(x, kind, i), kind, k - i);
  return head > tail ? head : tail;
}

void vsx_quantize_row(const void* x, FloatKind kind, int64_t k, float inv_scale, int8_t* q) {
  if (kind == FloatKind::f16) return ref_quantize_row(x, kind, k, inv_scale, q);
  const vf32 inv = vec_splats(inv_scale), lo = vec_splats(-127.f), hi = vec_splats(127.f);
  // xvrspic rounds to an integer in the current mode, nearest-even by default: std::nearbyint in the
  // reference. The fp32 multiply is the reference's, unfused (-ffp-contract=off). Clamping in fp32
  // before the conversion keeps out-of-range values from depending on conversion saturation.
  auto quant4 = [&](vf32 v) { return vec_cts(vec_min(vec_max(vec_rint(vec_mul(v, inv)), lo), hi), 0); };
  int64_t i = 0;
  for (; i + 16 <= k; i += 16) {
    vf32 v0, v1, v2, v3;
    load8(x, kind, i, v0, v1);
    load8(x, kind, i + 8, v2, v3);
    // Values are already within [-127, 127], so modulo narrowing (vpkuwum, vpkuhum) is exact.
    const __vector signed short h0 = vec_pack(quant4(v0), quant4(v1)), h1 = vec_pack(quant4(v2), quant4(v3));
    vec_xst(vec_pack(h0, h1), 0, q + i);
  }
  ref_quantize_row(element_at(x, kind, i), kind, k - i, inv_scale, q + i);
}

void vsx_attend_key_block(const float* queries, int heads, const KvRows& rows, int64_t keys, int64_t d,
                          float* scores, const KeyBlockOutputs& outputs) {
  attend_key_block_vectors<Vec4Ops>(queries, heads, rows, keys, d, scores, outputs);
}

extern const MicroKernel kVsxKernel;  // external linkage: the registry refers to it
const MicroKernel kVsxKernel = {
    /*name=*/"vsx",
    /*required_features=*/kFeatVsx,
    /*geometry=*/fixed_geometry<kNr, 4, kMr, 1>,
    /*reads_any_layout=*/false,
    pack_rows_one_by_one<vsx_pack_a_row_biased_u8>,
    vsx_tile,
    vsx_row_absmax_bits,
    vsx_quantize_row,
    /*thread_enter=*/nullptr,
    /*thread_leave=*/nullptr,
    /*a_excludes_int8_min=*/false,
    /*int4_tile=*/nullptr,
    /*silu_mul=*/nullptr,
    /*softmax_numerators=*/nullptr,
    vsx_attend_key_block,
};

}  // namespace w8a8_cpu
