// The one interface every ISA variant implements. Plain C++ on raw pointers: no torch, no threads,
// no allocation. The shared driver (gemm_driver.cpp) is written once over it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace w8a8_cpu {

// Element type of activations / outputs, independent of torch.
enum class FloatKind : int { f32 = 0, bf16 = 1, f16 = 2 };

// Packed weight layout: panels of `nr` output channels; inside a panel, groups of `kr` consecutive k of
// one channel are contiguous: panel[k / kr][n % nr][k % kr]. K is zero-padded to a multiple of kr and N
// to a multiple of nr. kr = 4 is the natural operand of vpdpbusd / sdot / vec_msum / xvi8ger4 (and of
// vpmaddwd after sign extension); kr = 8 gives smmla its 2-channel x 8-k blocks.
struct PanelLayout {
  int nr;
  int kr;
  int64_t index(int64_t k, int j) const { return (k / kr) * nr * kr + j * kr + k % kr; }
};

// Largest K for which an int32 accumulator cannot overflow: |a·w| <= 128·128 = 2^14 per product.
constexpr int64_t kMaxK = (int64_t{1} << 17) - 1;

// A variant's tile geometry, queried at run time: fixed-width ISAs return constants; an SME2 tile's width follows the
// streaming vector length, which only the running CPU knows. The driver queries it wherever it needs it (sizing
// scratch, packing, each task), so it must return the same value for the life of the process.
// The driver's int32 tile buffer (on the stack): mr * nr of any tile call fits it.
constexpr int kMaxTileInt32 = 1024;
// Largest attention head (MicroKernel::attend_key_block, the rotary embedding): head sizes of today's LLMs are
// <= 256; an fp32 copy of a head lives on the stack (4 KiB).
constexpr int64_t kMaxHeadDim = 1024;
// Keys of one block of the decode attention (activation.h: its rule): a fixed partition of the cache, whatever the
// thread count; a block's scores live on the stack (1 KiB), its int8 keys in L1 (16 KiB at head_dim 64) while the
// query heads that share them read them.
constexpr int64_t kDecodeKeyBlock = 256;
// Most query heads (of one KV head's group) one MicroKernel::attend_key_block call takes: its scores scratch is
// kMaxAttendHeads * kDecodeKeyBlock floats (8 KiB), the caller's scaled queries up to 32 KiB, both on the stack.
constexpr int kMaxAttendHeads = 8;
// Most rows of A a two-panel decode tile takes (MicroKernel::two_panel_rows).
constexpr int kTwoPanelMaxRows = 2;

struct TileGeometry {
  PanelLayout layout;   // packed weight layout this variant packs and reads
  int mr;               // rows of A per tile call (1..mr); mr * layout.nr <= kMaxTileInt32
  size_t a_elem_bytes;  // bytes per element of a packed A row
  // MicroKernel::wide_tile's panels and rows a call (0 without one); wide_mr * wide_panels * layout.nr <= kMaxTileInt32
  int wide_panels = 0, wide_mr = 0;
};

struct GemmOutput;  // epilogue.h

// The group structure of an int4 panel (packed_weight.h, WeightScheme / ScaleStorage): `groups` groups of `group` k
// per channel; after the nibbles the scales [groups][nr] (fp16 with half_scales, else fp32), then with has_mins the
// fp32 minimums [groups][nr].
struct Int4Groups {
  int64_t group, groups;
  bool has_mins, half_scales;
};
// Bytes of one stored group scale: the one place the storage's width is stated (sizes, packing, the tiles' streams).
static constexpr int64_t int4_scale_bytes(bool half_scales) { return half_scales ? 2 : 4; }

// How a cached row is stored (the Decoder's kv_cache): fp32, fp16, or int8 with one fp32 scale a row (a token's head,
// quantized by per_token_quant_int8's rule: gemm_driver.h's quantize_rows).
enum class KvKind : int { f32 = 0, f16 = 1, i8 = 2 };

// One KV head's cached keys and values from some position on: rows of d elements of `kind`, row j at j * d; int8:
// row j's scales at k_scale[j] and v_scale[j] (null otherwise).
struct KvRows {
  const void* k;
  const void* v;
  const float* k_scale;
  const float* v_scale;
  KvKind kind;
};

// Where MicroKernel::attend_key_block writes query head i's results over its block (activation.h's rule): o at
// out + i * out_stride (d floats), m at max[i * stat_stride], l at sum[i * stat_stride].
struct KeyBlockOutputs {
  float* out;
  int64_t out_stride;
  float* max;
  float* sum;
  int64_t stat_stride;
};

// Bytes of a cached element; the rows of `rows` from row j on (d elements a row). `static`, as element_bytes below.
static inline int64_t kv_element_bytes(KvKind kind) { return kind == KvKind::f32 ? 4 : kind == KvKind::f16 ? 2 : 1; }
static inline KvRows kv_rows_from(const KvRows& rows, int64_t j, int64_t d) {
  const int64_t bytes = j * d * kv_element_bytes(rows.kind);
  const bool scaled = rows.kind == KvKind::i8;
  return {static_cast<const char*>(rows.k) + bytes, static_cast<const char*>(rows.v) + bytes,
          scaled ? rows.k_scale + j : nullptr, scaled ? rows.v_scale + j : nullptr, rows.kind};
}

struct MicroKernel {
  const char* name;            // "ref", "avx2", "avx512_vnni", ...
  uint64_t required_features;  // CpuFeature bits the CPU must have
  TileGeometry (*geometry)();
  bool reads_any_layout;  // true for the reference tile, which reads weights packed by any variant

  // Packs m rows of A, row i read from rows[i] (k int8; a pointer list, so a driver can gather rows, e.g. the
  // tokens routed to one expert, without copying them first), into dst, row i at dst + i * stride bytes: k_padded
  // elements in the variant's own representation (e.g. uint8 a + 128 for vnni). Padding elements must contribute 0
  // against a zero weight. A block at once lets a variant pack across rows (AMX / SME tiles hold several rows).
  void (*pack_a_rows)(const int8_t* const* rows, int64_t m, int64_t k, int64_t k_padded, void* dst, size_t stride);

  // c[i * nr + j] = sum_k a_i[k] * w[panel col j][k] as exact int32 for i < m (m <= mr).
  // a: m packed rows, a_row_stride bytes apart. panel: one packed weight panel in `layout` (the variant's
  // own layout unless reads_any_layout). col_sums: the panel's per-channel weight sums over k, for
  // variants that bias A by +128 to use an unsigned x signed instruction (an aligned copy of the blob's, which
  // verify_packed_weight checked against the panel). c has layout.nr columns.
  void (*tile)(const void* a, size_t a_row_stride, int m, const int8_t* panel, const int32_t* col_sums,
               PanelLayout layout, int64_t k_padded, int32_t* c);

  // Largest |x| of a row as IEEE bits (the int32 max of abs bit patterns; >= 0x7f800000 means Inf/NaN).
  uint32_t (*row_absmax_bits)(const void* x, FloatKind kind, int64_t k);

  // q[k] = clamp(round_half_even(x[k] * inv_scale), -127, 127). Identical in every variant.
  void (*quantize_row)(const void* x, FloatKind kind, int64_t k, float inv_scale, int8_t* q);

  // Per-thread hooks (null: none), called on each thread of a parallel region before its first tile call and after
  // its last: state a tile needs that lives in the thread (AMX: the tile configuration and Linux's one-time
  // arch_prctl permission for the AMX state; SME: smstart / smstop of streaming mode).
  void (*thread_enter)() = nullptr;
  void (*thread_leave)() = nullptr;

  // True when the tile is exact only for A in [-127, 127] (every weight allowed): quantize_rows never produces -128,
  // and gemm() sends a caller's A that holds -128 to the reference tile instead (exact, slower).
  bool a_excludes_int8_min = false;

  // Optional W4A8 tile (null: the driver widens int4 panels to int8 blocks and runs `tile` on each group). For m <= mr
  // rows of plain int8 A (values in [-127, 127], zero-padded to the panel's k, rows a_row_stride bytes apart) and one
  // int4 panel (Int4Groups: nibbles, scales, minimums; any alignment): t[i * nr + j] = the fp32 group sum in
  // GemmOutput's fixed order (epilogue.h) over exact int32 group products, a_group_sums[i * groups.groups + g] being
  // row i's sum over group g.
  void (*int4_tile)(const int8_t* a, size_t a_row_stride, int m, const uint8_t* panel, PanelLayout layout,
                    const Int4Groups& groups, const int32_t* a_group_sums, float* t) = nullptr;

  // Optional: activation.h's silu_mul_row and softmax_numerators_row compiled in the variant's TU, with its ISA (null:
  // the driver's copies, in the baseline ISA). The same operations in the same order: the same bits either way.
  void (*silu_mul)(float* gate, const float* up, int64_t n) = nullptr;
  float (*softmax_numerators)(float* s, int64_t len, int64_t n) = nullptr;
  // Optional: activation.h's attend_key_block_row (1 <= heads <= kMaxAttendHeads query heads that share one block of
  // the decode attention's keys: queries [heads][d]) in the variant's ISA, or a copy of it that reorders nothing but
  // the independent work (attention_key_block.h's attend_key_block_vectors): likewise the same bits.
  void (*attend_key_block)(const float* queries, int heads, const KvRows& rows, int64_t keys, int64_t d,
                           float* scores, const KeyBlockOutputs& outputs) = nullptr;

  // Optional: epilogue.h's scale_tile compiled in the variant's TU, with its ISA (null: the driver's copy). The same
  // bits either way.
  void (*scale_tile)(const int32_t* c, int rows, int nr, int64_t r0, int64_t n0, int64_t cols,
                     const GemmOutput& o) = nullptr;

  // Optional decode tiles (null: `tile` / `int4_tile` panel by panel): m <= kTwoPanelMaxRows packed rows of A against
  // two consecutive panels, the second panel_bytes after the first, in one pass: c[i * 2 nr + j] of the first panel's
  // nr channels, c[i * 2 nr + nr + j] of the second's, the exact int32 of two `tile` calls (col_sums: both panels',
  // 2 nr); for int4 panels, int4_tile's t likewise. A decode row does little work per weight byte, and two weight
  // streams in flight keep more of the memory system busy than one (avx2 on Zen3: M = 1 at ~80-85% of a streaming
  // sum's bandwidth panel by panel, ~90-100% two at a time; M = 2 +15-20%).
  void (*two_panel_rows)(const void* a, size_t a_row_stride, int m, const int8_t* panel, int64_t panel_bytes,
                         const int32_t* col_sums, PanelLayout layout, int64_t k_padded, int32_t* c) = nullptr;
  void (*int4_two_panel_rows)(const int8_t* a, size_t a_row_stride, int m, const uint8_t* panel, int64_t panel_bytes,
                              PanelLayout layout, const Int4Groups& groups, const int32_t* a_group_sums,
                              float* t) = nullptr;

  // Optional, both or neither (null: `tile` for every row): `tile` for rows of A whose values keep a cheaper
  // accumulation exact, the same int32 c. a_row_small(row, k) says whether one quantized row (k int8, as linear()
  // made it, before packing) is such a row; the driver asks once a row (linear()) and calls tile_small for a tile whose
  // rows all are (AVX2: two k steps' int16 pair sums added before widening, when no four |a| of one int16 lane's
  // terms exceed 255: one multiply in four fewer; true of ~95% of SmolLM2's prefill rows).
  bool (*a_row_small)(const int8_t* row, int64_t k) = nullptr;
  void (*tile_small)(const void* a, size_t a_row_stride, int m, const int8_t* panel, const int32_t* col_sums,
                     PanelLayout layout, int64_t k_padded, int32_t* c) = nullptr;

  // Optional prefill tile (null: `tile` panel by panel; a variant has it or tile_small, not both): m <=
  // geometry().wide_mr packed rows of A against P = geometry().wide_panels consecutive panels of int8 weights, panel p
  // p * panel_bytes after the first, in one pass: c[i * P nr + p nr + j], the exact int32 of P `tile` calls (col_sums:
  // the P panels', P nr). The driver gives it the rows of tiles (m > kTwoPanelMaxRows): each value of A is loaded
  // once for P panels' multiply-adds, where `tile` loads it once a panel (avx512_vnni, 6 rows x 4 panels: 10 loads a
  // 24 vpdpbusd instead of 9 a 8).
  void (*wide_tile)(const void* a, size_t a_row_stride, int m, const int8_t* panel, int64_t panel_bytes,
                    const int32_t* col_sums, PanelLayout layout, int64_t k_padded, int32_t* c) = nullptr;
};

// The geometry function of a fixed-width variant. `static` (as the helpers below): each TU, ISA-flagged ones
// included, gets its own copy of every instantiation, so no TU's ISA can leak into another through a shared one.
template <int Nr, int Kr, int Mr, size_t AElemBytes, int WidePanels = 0, int WideMr = 0>
static TileGeometry fixed_geometry() {
  static_assert(Mr >= 1 && Mr * Nr <= kMaxTileInt32, "tile larger than the driver's tile buffer");
  static_assert(WideMr * WidePanels * Nr <= kMaxTileInt32, "wide tile larger than the driver's tile buffer");
  return {{Nr, Kr}, Mr, AElemBytes, WidePanels, WideMr};
}

// pack_a_rows of a variant that packs row by row.
template <void (*PackRow)(const int8_t* a, int64_t k, int64_t k_padded, void* dst)>
static void pack_rows_one_by_one(const int8_t* const* rows, int64_t m, int64_t k, int64_t k_padded, void* dst,
                                 size_t stride) {
  for (int64_t i = 0; i < m; ++i) PackRow(rows[i], k, k_padded, static_cast<char*>(dst) + i * stride);
}

// Bytes per element of `kind`, and the address of element i. `static`: every TU, ISA-flagged ones included, gets
// its own copy, so no TU's ISA can leak into another through a shared inline definition.
static inline int64_t element_bytes(FloatKind kind) { return kind == FloatKind::f32 ? 4 : 2; }
static inline const void* element_at(const void* x, FloatKind kind, int64_t i) {
  return static_cast<const char*>(x) + i * element_bytes(kind);
}

// Calls f(std::integral_constant<int, M>{}) with M = min(m, MaxM), m >= 1: lets each variant write its tile
// once as a template over a compile-time row count (register blocking) and pick it from the driver's m.
template <int MaxM, typename F>
inline void with_row_count(int m, F&& f) {
  if constexpr (MaxM > 1) {
    if (m < MaxM) return with_row_count<MaxM - 1>(m, std::forward<F>(f));
  }
  f(std::integral_constant<int, MaxM>{});
}

}  // namespace w8a8_cpu
