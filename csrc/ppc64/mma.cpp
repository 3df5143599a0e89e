// MMA variant (Power ISA 3.1 Matrix-Multiply Assist: POWER10 and later). Compiled with -mcpu=power10.
//
// xvi8ger4pp(acc, XA, XB) adds to the 4x4 int32 accumulator acc[i][j] the sum over 4 bytes of
// XA word i x XB word j, treating XA's bytes as SIGNED and XB's as UNSIGNED (checked under qemu: with
// 0xff bytes, XA gives -1 and XB gives 255). After __builtin_mma_disassemble_acc on little-endian,
// vector i holds acc[i][0..3] with i and j the vectors' element numbers. So the weights are XA (signed,
// 4 channels x 4 k: exactly one 16-byte load of a {16, 4} panel k group) and A is XB as u8 = a + 128
// (4 rows x 4 k); like vpdpbusd, acc = sum a * w + 128 * sum w, and the panel's weight sums remove the
// bias. int32 arithmetic wraps and the true result fits int32 for K <= kMaxK, so the result is exact.
//
// Layout {16, 4}, shared with ref and vsx (their blobs are interchangeable). The tile is 8 rows x 16
// channels = 2 row groups x 4 channel groups = all 8 accumulators; 1..4 rows use 4 of them. A rows are
// loaded 16 bytes (4 k groups) at a time and transposed into one XB vector per k group; the
// accumulators are disassembled once per tile, transposed back to row order and corrected.
//
// Only code that runs on POWER10 lives here; A packing and quantization are the POWER8 ones from vsx.cpp.
#if !defined(__MMA__)
#error "mma.cpp is a variant TU: build it with its ISA flags (-mcpu=power10 -mmma), through w8a8_cpu_add_variant"
#endif
#include <altivec.h>

#include <cstring>

#include "../common/cpu_features.h"
#include "vsx_common.h"

namespace w8a8_cpu {
namespace {

using vu8 = __vector unsigned char;
using vs32 = __vector signed int;
using vu32 = __vector unsigned int;
using vu64 = __vector unsigned long long;

constexpr int kNr = kPpc64PanelWidth;
constexpr int kMr = 8;

// 4x4 transpose of 32-bit elements: out[j][i] = in[i][j].
template <typename V>
inline void transpose4(const V (&in)[4], V (&out)[4]) {
  // m0 = [in0[0] in1[0] in0[1] in1[1]], m1 likewise for in2, in3; m2, m3 the same for elements 2, 3.
  const V m0 = vec_mergeh(in[0], in[1]), m1 = vec_mergeh(in[2], in[3]);
  const V m2 = vec_mergel(in[0], in[1]), m3 = vec_mergel(in[2], in[3]);
  out[0] = reinterpret_cast<V>(vec_mergeh(reinterpret_cast<vu64>(m0), reinterpret_cast<vu64>(m1)));
  out[1] = reinterpret_cast<V>(vec_mergel(reinterpret_cast<vu64>(m0), reinterpret_cast<vu64>(m1)));
  out[2] = reinterpret_cast<V>(vec_mergeh(reinterpret_cast<vu64>(m2), reinterpret_cast<vu64>(m3)));
  out[3] = reinterpret_cast<V>(vec_mergel(reinterpret_cast<vu64>(m2), reinterpret_cast<vu64>(m3)));
}

// The 4 accumulators of one row group (4 rows x 16 channels). Named members rather than an array:
// GCC 12 keeps an array of __vector_quad in memory too and stores every accumulator to it on each loop
// iteration.
struct RowGroupAcc {
  __vector_quad q0, q1, q2, q3;  // channel groups 0..3 (channels 4q..4q+3)
};

// Adds one k group to a row group: w0..w3 are the group's 4 channel groups (XA), xb its 4 rows (XB).
inline void ger_group(RowGroupAcc& acc, vu8 w0, vu8 w1, vu8 w2, vu8 w3, vu8 xb) {
  __builtin_mma_xvi8ger4pp(&acc.q0, w0, xb);
  __builtin_mma_xvi8ger4pp(&acc.q1, w1, xb);
  __builtin_mma_xvi8ger4pp(&acc.q2, w2, xb);
  __builtin_mma_xvi8ger4pp(&acc.q3, w3, xb);
}

// XB operands of rows 4g..4g+3 for the 4 k groups at k: 16 bytes of each row, transposed so that
// xb[l] = [row 0..3 of k group l]. Rows >= M are zeros whose results are dropped.
template <int M>
inline void load_xb16(const uint8_t* a, size_t a_stride, int g, int64_t k, vu8 (&xb)[4]) {
  vu32 rows[4], groups[4];
  for (int r = 0; r < 4; ++r)
    rows[r] = 4 * g + r < M ? reinterpret_cast<vu32>(vec_xl(0, a + (4 * g + r) * a_stride + k)) : vec_splats(0u);
  transpose4(rows, groups);
  for (int l = 0; l < 4; ++l) xb[l] = reinterpret_cast<vu8>(groups[l]);
}

// XB operand of rows 4g..4g+3 for the single k group at k.
template <int M>
inline vu8 load_xb4(const uint8_t* a, size_t a_stride, int g, int64_t k) {
  uint32_t bytes[4] = {0, 0, 0, 0};
  for (int r = 0; r < 4; ++r)
    if (4 * g + r < M) std::memcpy(&bytes[r], a + (4 * g + r) * a_stride + k, 4);
  return reinterpret_cast<vu8>(vec_xl(0, bytes));
}

// Writes channel group q of row group g: disassembles the accumulator (vector i = channel 4q+i over the
// 4 rows), transposes to row order and removes the 128 * sum_k w bias.
template <int M>
inline void store_group(__vector_quad* acc, int g, int q, const int32_t* col_sums, int32_t* c) {
  vs32 by_channel[4], by_row[4];
  __builtin_mma_disassemble_acc(by_channel, acc);
  transpose4(by_channel, by_row);
  const vs32 correction = vec_sl(vec_xl(0, col_sums + 4 * q), vec_splats(7u));  // modulo 2^32
  for (int r = 0; r < 4; ++r)
    if (4 * g + r < M) vec_xst(vec_sub(by_row[r], correction), 0, c + (4 * g + r) * kNr + 4 * q);
}

template <int M>
void tile_rows(const uint8_t* a, size_t a_stride, const int8_t* panel, const int32_t* col_sums, int64_t k_padded,
               int32_t* c) {
  constexpr bool kTwoGroups = M > 4;  // rows 4..7 use the other 4 accumulators
  RowGroupAcc g0, g1;
  __builtin_mma_xxsetaccz(&g0.q0);
  __builtin_mma_xxsetaccz(&g0.q1);
  __builtin_mma_xxsetaccz(&g0.q2);
  __builtin_mma_xxsetaccz(&g0.q3);
  if constexpr (kTwoGroups) {
    __builtin_mma_xxsetaccz(&g1.q0);
    __builtin_mma_xxsetaccz(&g1.q1);
    __builtin_mma_xxsetaccz(&g1.q2);
    __builtin_mma_xxsetaccz(&g1.q3);
  }
  const int8_t* b = panel;
  auto ger_k_group = [&](const int8_t* w, vu8 xb0, vu8 xb1) {
    const vu8 w0 = reinterpret_cast<vu8>(vec_xl(0, w)), w1 = reinterpret_cast<vu8>(vec_xl(16, w)),
              w2 = reinterpret_cast<vu8>(vec_xl(32, w)), w3 = reinterpret_cast<vu8>(vec_xl(48, w));
    ger_group(g0, w0, w1, w2, w3, xb0);
    if constexpr (kTwoGroups) ger_group(g1, w0, w1, w2, w3, xb1);
  };
  int64_t k = 0;
  // Main loop: 16 k per step. Loads stay within k_padded, the end of each A row.
  for (; k + 16 <= k_padded; k += 16, b += 4 * kNr * 4) {
    vu8 xb0[4], xb1[4];
    load_xb16<M>(a, a_stride, 0, k, xb0);
    if constexpr (kTwoGroups) load_xb16<M>(a, a_stride, 1, k, xb1);
    for (int l = 0; l < 4; ++l) ger_k_group(b + l * kNr * 4, xb0[l], kTwoGroups ? xb1[l] : xb0[l]);
  }
  // Remaining k groups of 4 (k_padded is a multiple of 4, not necessarily of 16).
  for (; k < k_padded; k += 4, b += kNr * 4) {
    const vu8 xb0 = load_xb4<M>(a, a_stride, 0, k);
    ger_k_group(b, xb0, kTwoGroups ? load_xb4<M>(a, a_stride, 1, k) : xb0);
  }
  store_group<M>(&g0.q0, 0, 0, col_sums, c);
  store_group<M>(&g0.q1, 0, 1, col_sums, c);
  store_group<M>(&g0.q2, 0, 2, col_sums, c);
  store_group<M>(&g0.q3, 0, 3, col_sums, c);
  if constexpr (kTwoGroups) {
    store_group<M>(&g1.q0, 1, 0, col_sums, c);
    store_group<M>(&g1.q1, 1, 1, col_sums, c);
    store_group<M>(&g1.q2, 1, 2, col_sums, c);
    store_group<M>(&g1.q3, 1, 3, col_sums, c);
  }
}

void mma_tile(const void* a, size_t a_row_stride, int m, const int8_t* panel, const int32_t* col_sums, PanelLayout,
              int64_t k_padded, int32_t* c) {
  const auto* a8 = static_cast<const uint8_t*>(a);
  with_row_count<8>(m, [&](auto rows) {
    tile_rows<decltype(rows)::value>(a8, a_row_stride, panel, col_sums, k_padded, c);
  });
}

}  // namespace

extern const MicroKernel kMmaKernel;  // external linkage: the registry refers to it
const MicroKernel kMmaKernel = {
    /*name=*/"mma",
    /*required_features=*/kFeatVsx | kFeatArch31 | kFeatMma,
    /*geometry=*/fixed_geometry<kNr, 4, kMr, 1>,
    /*reads_any_layout=*/false,
    pack_rows_one_by_one<vsx_pack_a_row_biased_u8>,
    mma_tile,
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
