#include "gemm_driver.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "activation.h"
#include "float_convert.h"
#include "ref_kernel.h"

namespace w8a8_cpu {

namespace {

constexpr int64_t kAlign = 64;
static_assert(kMaxPanelWidth <= kScaleRowCols, "a tile row must fit scale_row");

bool holds_int8_min(const int8_t* a, int64_t m, int64_t lda, int64_t k) {
  for (int64_t r = 0; r < m; ++r)
    if (std::memchr(a + r * lda, 0x80, static_cast<size_t>(k)) != nullptr) return true;
  return false;
}

enum class RowQuantized { ok, non_finite, amax_below_row };

// One row of quantize_rows. amax_given (may be null): the absmax to quantize with instead of the row's own, which is
// read either way: a NaN/Inf row stays non-finite whatever the caller's amax (a finite one turned it into +-127
// codes: finite outputs, silently), and an amax below the row's own would saturate the row (silently). A NaN or
// +Inf amax marks the row non-finite (the maximum over ranks of which one holds a NaN/Inf).
RowQuantized quantize_row_checked(const MicroKernel& kernel, const void* row, FloatKind kind, int64_t k,
                                  const float* amax_given, int8_t* q, float* scale) {
  uint32_t amax_bits = kernel.row_absmax_bits(row, kind, k);
  if (amax_given && amax_bits < 0x7f800000u) {
    float own;
    std::memcpy(&own, &amax_bits, 4);
    if (*amax_given < own) return RowQuantized::amax_below_row;  // (a negative amax too; NaN compares false)
    std::memcpy(&amax_bits, amax_given, 4), amax_bits &= 0x7fffffffu;  // (-0 for an all-zero row)
  }
  if (amax_bits >= 0x7f800000u) {
    *scale = std::numeric_limits<float>::quiet_NaN();
    std::memset(q, 0, static_cast<size_t>(k));
    return RowQuantized::non_finite;
  }
  float amax;
  std::memcpy(&amax, &amax_bits, 4);
  amax = std::max(amax, kAmaxEps);
  *scale = amax / 127.f;
  kernel.quantize_row(row, kind, k, 127.f / amax, q);
  return RowQuantized::ok;
}

// The lowest row of each failure that any thread saw (m when none).
struct RowFailures {
  explicit RowFailures(int64_t m) : non_finite(m), amax_below_row(m) {}
  std::atomic<int64_t> non_finite, amax_below_row;

  static void note(std::atomic<int64_t>& lowest, int64_t r) {
    int64_t seen = lowest.load();
    while (r < seen && !lowest.compare_exchange_weak(seen, r)) {
    }
  }
};

// Rows [r0, r1) of quantize_rows / linear: row r from x + r * ldx into q + r * ldq and scales[r].
void quantize_row_range(const MicroKernel& kernel, const void* x, FloatKind kind, int64_t ldx, int64_t k,
                        const float* row_amax, int8_t* q, int64_t ldq, float* scales, int64_t r0, int64_t r1,
                        RowFailures& failures) {
  for (int64_t r = r0; r < r1; ++r) {
    const RowQuantized result = quantize_row_checked(kernel, element_at(x, kind, r * ldx), kind, k,
                                                     row_amax ? row_amax + r : nullptr, q + r * ldq, scales + r);
    if (result != RowQuantized::ok)
      RowFailures::note(result == RowQuantized::non_finite ? failures.non_finite : failures.amax_below_row, r);
  }
}

// After the quantization region: throws std::invalid_argument naming amax for the lowest row whose given absmax is
// below its own; else returns the first non-finite row or -1.
int64_t checked_rows(const RowFailures& failures, int64_t m, const MicroKernel& kernel, const void* x, FloatKind kind,
                     int64_t ldx, int64_t k, const float* row_amax) {
  const int64_t below = failures.amax_below_row.load();
  if (below < m) {
    const uint32_t own_bits = kernel.row_absmax_bits(element_at(x, kind, below * ldx), kind, k);
    float own;
    std::memcpy(&own, &own_bits, 4);
    char message[160];
    std::snprintf(message, sizeof message, "amax: row %lld's amax %.9g is below the row's own absolute maximum %.9g "
                  "(amax must be >= max|x| of its row)", static_cast<long long>(below), row_amax[below], own);
    throw std::invalid_argument(message);
  }
  const int64_t bad = failures.non_finite.load();
  return bad < m ? bad : -1;
}

// Rows per claim of the row passes (quantize, pack): about 64 KiB of input each; below that, one claim (no region).
int64_t rows_per_claim(int64_t k) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(k, 1)); }

}  // namespace

int64_t quantize_rows(const MicroKernel& kernel, const void* x, FloatKind kind, int64_t m, int64_t k, int64_t ldx,
                      int8_t* q, int64_t ldq, float* scales, const ParallelFor& parallel_for, const float* row_amax) {
  RowFailures failures(m);
  dynamic_for(m, rows_per_claim(k), parallel_for, [&](int64_t r0, int64_t r1) {
    quantize_row_range(kernel, x, kind, ldx, k, row_amax, q, ldq, scales, r0, r1, failures);
  });
  return checked_rows(failures, m, kernel, x, kind, ldx, k, row_amax);
}

int64_t gemm_scratch_nbytes(const MicroKernel& kernel, int64_t m, int64_t k_padded) {
  // The packed rows (the reference tile's, for a caller's A holding -128).
  const int64_t packed = m * packed_a_stride(kernel, k_padded);
  return kernel.a_excludes_int8_min ? std::max(packed, m * packed_a_stride(kRefKernel, k_padded)) : packed;
}

int64_t linear_scratch_nbytes(const MicroKernel& kernel, int64_t m, int64_t k, int64_t k_padded, int64_t groups) {
  // quantized rows, their int4 group sums, which rows are small (MicroKernel::a_row_small), then the packed rows
  return round_up(m * k, kAlign) + round_up(m * groups * 4, kAlign) + round_up(m, kAlign) +
         m * packed_a_stride(kernel, k_padded);
}

void check_kernel_reads(const MicroKernel& kernel, const PackedWeightView& w, const char* arg) {
  const TileGeometry g = kernel.geometry();
  if (!kernel_reads_layout(kernel, w.layout))
    throw std::invalid_argument(std::string(arg) + ": weight was packed by the '" + packed_by_name(w.header) +
                                "' variant (panel " + std::to_string(w.layout.nr) + "x" + std::to_string(w.layout.kr) +
                                "), which the active '" + kernel.name + "' variant cannot read (it reads " +
                                std::to_string(g.layout.nr) + "x" + std::to_string(g.layout.kr) +
                                "); re-pack the raw weight under the active variant");
  const bool wide_fits = !kernel.wide_tile || (g.wide_panels >= 1 && g.wide_mr >= 1 &&
                                               g.wide_mr * g.wide_panels * w.layout.nr <= kMaxTileInt32);
  if (g.mr < 1 || g.mr * w.layout.nr > kMaxTileInt32 || !wide_fits)
    throw std::logic_error("micro-kernel tile larger than the driver's tile buffer");
}

int64_t packed_a_stride(const MicroKernel& kernel, int64_t k_padded) {
  // An odd number of cache lines: a tile reads mr rows in lockstep, and rows a power-of-two multiple of 4 KiB
  // apart (K = 4096) would all map to one L1 set and evict each other (measured: -25% at M = 16).
  const int64_t lines = round_up(k_padded * static_cast<int64_t>(kernel.geometry().a_elem_bytes), kAlign) / kAlign;
  return (lines | 1) * kAlign;
}

const MicroKernel& a_packer_for(const MicroKernel& kernel, const PackedWeightView& w) {
  return w.int4() && kernel.int4_tile ? kRefKernel : kernel;
}

int64_t packed_a_stride(const MicroKernel& kernel, const PackedWeightView& w) {
  return packed_a_stride(a_packer_for(kernel, w), w.header.k_padded);
}

int64_t a_group_sums_nbytes(const PackedWeightView& w, int64_t m) { return w.int4() ? m * w.groups * 4 : 0; }

void int4_group_sums(const int8_t* row, const PackedWeightView& w, int32_t* sums) {
  const int64_t k = w.header.k;
  for (int64_t g = 0; g < w.groups; ++g) {
    int32_t sum = 0;
    for (int64_t kk = g * w.group; kk < std::min(k, (g + 1) * w.group); ++kk) sum += row[kk];
    sums[g] = sum;
  }
}

void pack_a_rows(const MicroKernel& kernel, const int8_t* a, int64_t m, int64_t lda, int64_t k, int64_t k_padded,
                 uint8_t* dst, const ParallelFor& parallel_for) {
  const int64_t stride = packed_a_stride(kernel, k_padded);
  dynamic_for(m, rows_per_claim(k_padded), parallel_for, [&](int64_t r0, int64_t r1) {
    pack_rows_via(kernel, r0, r1, [&](int64_t r) { return a + r * lda; }, k, k_padded, dst, stride);
  });
}

namespace {

// k per widened block of an int4 panel in the generic path: the int8 copy (kInt4Block x nr bytes) stays in L1 on the
// stack. A multiple of 32 (every group size, every panel depth, whole nibble chunks).
constexpr int64_t kInt4Block = 256;

// t (rows [r0, r1) x nr, at most mr rows) of one int4 panel without an int4 tile: each block of k widened to int8 once
// (and summed per column for the biased-A tiles), the variant's int8 tile over each group of it, the group's int32
// products added up (exact), the groups combined in fp32 in GemmOutput's order.
void int4_rows_via_int8_tile(const MicroKernel& kernel, const uint8_t* a_packed, int64_t a_stride, int rows,
                             const int32_t* a_group_sums, const PackedWeightView& w, const uint8_t* panel, float* t) {
  const int nr = w.layout.nr;
  const int64_t elem = static_cast<int64_t>(kernel.geometry().a_elem_bytes);
  const uint8_t* scales = panel + w.nibble_bytes;
  const uint8_t* mins = scales + w.scale_bytes;
  const bool half_scales = w.int4_groups().half_scales;
  int8_t block[kInt4Block * kMaxPanelWidth];
  int32_t sums[kMaxPanelWidth], c[kMaxTileInt32], group_acc[kMaxTileInt32];
  std::fill(t, t + rows * nr, 0.f);
  for (int64_t g = 0; g < w.groups; ++g) {
    std::fill(group_acc, group_acc + rows * nr, 0);
    for (int64_t k0 = g * w.group; k0 < (g + 1) * w.group; k0 += kInt4Block) {
      const int64_t len = std::min(kInt4Block, (g + 1) * w.group - k0);
      std::fill(sums, sums + nr, 0);
      widen_int4(panel + k0 * nr / 2, len * nr, w.layout, block, sums);
      kernel.tile(a_packed + k0 * elem, static_cast<size_t>(a_stride), rows, block, sums, w.layout, len, c);
      for (int64_t i = 0; i < rows * nr; ++i) group_acc[i] += c[i];
    }
    for (int i = 0; i < rows; ++i) {
      float* ti = t + i * nr;
      const int32_t* cg = group_acc + i * nr;
      for (int j = 0; j < nr; ++j)
        ti[j] = ti[j] + static_cast<float>(cg[j]) * load_group_scale(scales, half_scales, g * nr + j);
      if (w.has_mins()) {
        const float a_sum = static_cast<float>(a_group_sums[i * w.groups + g]);
        for (int j = 0; j < nr; ++j) ti[j] = ti[j] + a_sum * load_group_scale(mins, false, g * nr + j);
      }
    }
  }
}

// Rows [r0, r1) of A times one int4 panel: t per tile of rows (the variant's int4 tile on plain int8 rows, or the int8
// tile path above on the variant's packed rows), then the epilogue.
void compute_int4_rows(const MicroKernel& kernel, const uint8_t* a_packed, int64_t a_stride, int64_t r0, int64_t r1,
                       const PackedWeightView& w, int64_t panel, const GemmOutput& o) {
  const int nr = w.layout.nr, mr = kernel.geometry().mr;
  const int64_t n0 = panel * nr, cols = std::min<int64_t>(nr, w.header.n - n0);
  const auto* panel_data = reinterpret_cast<const uint8_t*>(w.panels) + panel * w.panel_bytes;
  float t[kMaxTileInt32];
  for (int64_t r = r0; r < r1; r += mr) {
    const int rows = static_cast<int>(std::min<int64_t>(mr, r1 - r));
    const int32_t* sums = o.a_group_sums + r * w.groups;
    if (kernel.int4_tile)
      kernel.int4_tile(reinterpret_cast<const int8_t*>(a_packed + r * a_stride), static_cast<size_t>(a_stride), rows,
                       panel_data, w.layout, w.int4_groups(), sums, t);
    else
      int4_rows_via_int8_tile(kernel, a_packed + r * a_stride, a_stride, rows, sums, w, panel_data, t);
    for (int i = 0; i < rows; ++i) scale_row(t + i * nr, r + i, n0, cols, o);
  }
}

using ScaleTileFn = decltype(MicroKernel::scale_tile);

// The variant's int8 epilogue where it has one, else the shared scale_tile (the same bits).
ScaleTileFn scale_tile_of(const MicroKernel& kernel) { return kernel.scale_tile ? kernel.scale_tile : scale_tile; }

}  // namespace

void compute_panel_rows(const MicroKernel& kernel, const uint8_t* a_packed, int64_t a_stride, int64_t r0, int64_t r1,
                        const PackedWeightView& w, int64_t panel, const GemmOutput& o) {
  if (w.int4()) return compute_int4_rows(kernel, a_packed, a_stride, r0, r1, w, panel, o);
  const int nr = w.layout.nr;
  const int64_t k_padded = w.header.k_padded;
  const int8_t* panel_data = w.panels + panel * w.panel_bytes;
  int32_t sums[kMaxPanelWidth];  // aligned copy: the blob's sums may sit at any address
  load_col_sums(w, panel * nr, nr, sums);
  const int64_t n0 = panel * nr, cols = std::min<int64_t>(nr, w.header.n - n0);
  const int mr = kernel.geometry().mr;
  const ScaleTileFn scale = scale_tile_of(kernel);
  int32_t c[kMaxTileInt32];
  for (int64_t r = r0; r < r1; r += mr) {
    const int rows = static_cast<int>(std::min<int64_t>(mr, r1 - r));
    const bool small = o.a_rows_small && std::all_of(o.a_rows_small + r, o.a_rows_small + r + rows,
                                                     [](uint8_t row_small) { return row_small != 0; });
    (small ? kernel.tile_small : kernel.tile)(a_packed + r * a_stride, static_cast<size_t>(a_stride), rows, panel_data,
                                              sums, w.layout, k_padded, c);
    scale(c, rows, nr, r, n0, cols, o);
  }
}

namespace {

// A task's panels (consecutive ones) and the rows of each tile call in it: the variant's wide tile for rows of tiles
// of int8 weights, else one panel through `tile`.
struct TaskShape {
  int panels, mr;
  bool wide;
};

TaskShape task_shape(const MicroKernel& kernel, const PackedWeightView& w, int64_t m) {
  const TileGeometry g = kernel.geometry();
  if (kernel.wide_tile && !w.int4() && m > kTwoPanelMaxRows) return {g.wide_panels, g.wide_mr, true};
  return {1, g.mr, false};
}

// Rows [r0, r1) of panels [panel, panel + count): with a wide shape and count == its panels, the wide tile (all count
// panels at once, their epilogue a row at a time), else compute_panel_rows panel by panel. The same int32 either way.
void compute_task_rows(const MicroKernel& kernel, const uint8_t* a_packed, int64_t a_stride, int64_t r0, int64_t r1,
                       const PackedWeightView& w, int64_t panel, int64_t count, const TaskShape& shape,
                       const GemmOutput& o) {
  if (!shape.wide || count < shape.panels) {
    for (int64_t p = panel; p < panel + count; ++p) compute_panel_rows(kernel, a_packed, a_stride, r0, r1, w, p, o);
    return;
  }
  const int width = shape.panels * w.layout.nr;
  int32_t sums[kMaxTileInt32];
  load_col_sums(w, panel * w.layout.nr, width, sums);
  const int64_t n0 = panel * w.layout.nr, cols = std::min<int64_t>(width, w.header.n - n0);
  const ScaleTileFn scale = scale_tile_of(kernel);
  int32_t c[kMaxTileInt32];
  for (int64_t r = r0; r < r1; r += shape.mr) {
    const int rows = static_cast<int>(std::min<int64_t>(shape.mr, r1 - r));
    kernel.wide_tile(a_packed + r * a_stride, static_cast<size_t>(a_stride), rows, w.panels + panel * w.panel_bytes,
                     w.panel_bytes, sums, w.layout, w.header.k_padded, c);
    scale(c, rows, width, r, n0, cols, o);
  }
}

// m <= kTwoPanelMaxRows rows against panels p and p + 1 (p + 1 < the panel count) in one call of the variant's
// two_panel_rows (int8) or int4_two_panel_rows, then the epilogue of each row of each panel.
void compute_two_panels(const MicroKernel& kernel, const uint8_t* a_packed, int64_t a_stride, int m,
                        const PackedWeightView& w, int64_t panel, const GemmOutput& o) {
  const int nr = w.layout.nr;
  const auto* panels = reinterpret_cast<const uint8_t*>(w.panels) + panel * w.panel_bytes;
  float t[kTwoPanelMaxRows * 2 * kMaxPanelWidth];
  int32_t c[kTwoPanelMaxRows * 2 * kMaxPanelWidth];
  if (w.int4()) {
    kernel.int4_two_panel_rows(reinterpret_cast<const int8_t*>(a_packed), static_cast<size_t>(a_stride), m, panels,
                               w.panel_bytes, w.layout, w.int4_groups(), o.a_group_sums, t);
  } else {
    int32_t sums[2 * kMaxPanelWidth];
    load_col_sums(w, panel * nr, 2 * nr, sums);
    kernel.two_panel_rows(a_packed, static_cast<size_t>(a_stride), m, reinterpret_cast<const int8_t*>(panels),
                          w.panel_bytes, sums, w.layout, w.header.k_padded, c);
  }
  for (int i = 0; i < m; ++i)
    for (int half = 0; half < 2; ++half) {
      const int64_t n0 = (panel + half) * nr, cols = std::min<int64_t>(nr, w.header.n - n0);
      const int64_t at = (i * 2 + half) * nr;
      if (w.int4())
        scale_row(t + at, i, n0, cols, o);
      else
        scale_tile_of(kernel)(c + at, 1, nr, i, n0, cols, o);
    }
}

}  // namespace

void scale_accumulators(const int32_t* acc, int64_t m, int64_t n, int64_t lda, const GemmOutput& o,
                        const ParallelFor& parallel_for) {
  dynamic_for(m, rows_per_claim(n * 4), parallel_for, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t n0 = 0; n0 < n; n0 += kScaleRowCols)
        scale_row(acc + r * lda + n0, r, n0, std::min(kScaleRowCols, n - n0), o);
  });
}

namespace {

// Most rows of a task of gemm_packed: 8 tiles' worth.
constexpr int kRowBlockTiles = 8;
// Decode claims per thread at the least, where gemm_packed makes them larger (a slowed thread holds up at most an
// eighth of its share).
constexpr int64_t kDecodeClaimsPerThread = 8;

// Rows [r0, r1) (at most kRowBlockTiles * shape.mr) of the gated product's columns [n0, n0 + count nr), n0 = panel *
// nr < I: the gate panels' and the up panels' (panel + I / nr on) epilogues into fp32 blocks of this task (the bits of
// separate layers), silu(gate) * up on them while they are in L1, each row cast once into o. Instead of all 2I
// channels of every row written to memory and read back by a pass of their own (SmolLM2's prefill: 6 MiB a layer).
void compute_gated_rows(const MicroKernel& kernel, const uint8_t* a_packed, int64_t a_stride, int64_t r0, int64_t r1,
                        const PackedWeightView& w, int64_t panel, int64_t count, const TaskShape& shape, int64_t inter,
                        const GemmOutput& o) {
  const int nr = w.layout.nr;
  const int64_t width = count * nr;
  float gate[kRowBlockTiles * kMaxTileInt32], up[kRowBlockTiles * kMaxTileInt32];
  GemmOutput block = o;
  block.out_kind = FloatKind::f32, block.ldo = width, block.raw_int32 = false, block.first_row = r0;
  for (const auto& [half, values] : {std::pair<int64_t, float*>{0, gate}, {inter / nr, up}}) {
    block.out = values, block.first_col = (panel + half) * nr;
    compute_task_rows(kernel, a_packed, a_stride, r0, r1, w, panel + half, count, shape, block);
  }
  const int64_t n0 = panel * nr, cols = std::min<int64_t>(width, inter - n0);
  for (int64_t r = r0; r < r1; ++r) {
    float* row = gate + (r - r0) * width;
    silu_mul(kernel, row, up + (r - r0) * width, cols);
    store_row_from_float(o.at(r, n0), o.out_kind, row, cols);
  }
}

// Tasks are (panels, block of rows), panel-major: a claim of consecutive tasks is a contiguous slice of the weight,
// streamed once (decode), reused from cache across its row blocks (prefill). A task's panels are task_shape's (the
// last ones of the weight may be fewer). Every output element is produced by one tile call over the full K, so results
// do not depend on how tasks are split among threads. gated_inter > 0: o is gated_linear's output of that many
// columns, a task's panels are gate panels (with their up panels: compute_gated_rows).
void gemm_packed(const MicroKernel& kernel, const uint8_t* a_packed, int64_t a_stride, int64_t m,
                 const PackedWeightView& w, const GemmOutput& o, const ParallelFor& parallel_for,
                 int64_t gated_inter = 0) {
  const PackedWeightHeader& h = w.header;
  const TaskShape shape = task_shape(kernel, w, m);
  const int64_t rows_per_block = std::min<int64_t>(round_up(m, shape.mr), kRowBlockTiles * shape.mr);
  const int64_t row_blocks = (m + rows_per_block - 1) / rows_per_block;
  const int64_t panels = gated_inter > 0 ? gated_inter / w.layout.nr : h.n_padded / w.layout.nr;
  const int64_t panel_groups = (panels + shape.panels - 1) / shape.panels;
  const int64_t macs_per_task = rows_per_block * h.k_padded * w.layout.nr * shape.panels * (gated_inter > 0 ? 2 : 1);
  // Decode (m <= kTwoPanelMaxRows, a task per panel): panels two by two where the variant has a two-panel tile for the
  // weight's scheme (a claim of an even number of panels; an odd last one alone).
  const bool two_panels = m <= kTwoPanelMaxRows && row_blocks == 1 && gated_inter == 0 &&
                          (w.int4() ? kernel.int4_two_panel_rows != nullptr : kernel.two_panel_rows != nullptr);
  // About 2^20 multiply-adds (~15 us) per claim: few claims, yet a slow thread holds up little.
  int64_t chunk = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(macs_per_task, 1));
  if (two_panels) {
    // Decode streams each panel once from memory: where few threads share the panels, claims up to 4x larger while
    // each thread still gets kDecodeClaimsPerThread claims' worth of int8 panel bytes (2 threads, Zen3, M = 1, 4096 k,
    // in a layer stack: W8A8 90-104% -> 94-109% of the read bandwidth, W4A8 82-99% -> 89-106%; 1 thread: no change).
    // Many threads keep the claims above. The thread bound is rounded down to an even count, the claims above up. An
    // int4 panel holds about half an int8 panel's bytes, so its claims take twice the panels and as long from memory
    // (each thread gets half as many; 2 threads, M = 1, Xeon, in a layer stack, three runs each side: W4A8 / W8A8 time
    // 0.58-0.63 -> 0.58-0.60; 1 thread: no change).
    const int64_t panels_per_int8_panel = w.int4() ? 2 : 1;
    const int64_t per_thread_bound =
        panels * panels_per_int8_panel / (kDecodeClaimsPerThread * parallel_for.threads) / 2 * 2;
    chunk = std::max(round_up(chunk, 2), std::min(4 * panels_per_int8_panel * chunk, per_thread_bound));
  }
  dynamic_for(panel_groups * row_blocks, chunk, parallel_for, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1;) {
      if (two_panels && t + 1 < t1) {
        compute_two_panels(kernel, a_packed, a_stride, static_cast<int>(m), w, t, o);
        t += 2;
        continue;
      }
      const int64_t p = t / row_blocks * shape.panels, count = std::min<int64_t>(shape.panels, panels - p);
      const int64_t r0 = t % row_blocks * rows_per_block, r1 = std::min(m, r0 + rows_per_block);
      if (gated_inter > 0)
        compute_gated_rows(kernel, a_packed, a_stride, r0, r1, w, p, count, shape, gated_inter, o);
      else
        compute_task_rows(kernel, a_packed, a_stride, r0, r1, w, p, count, shape, o);
      ++t;
    }
  }, kernel.thread_enter, kernel.thread_leave);
}

}  // namespace

void gemm(const MicroKernel& kernel, const int8_t* a, int64_t m, int64_t lda, const PackedWeightView& w,
          const GemmOutput& o, void* scratch, const ParallelFor& parallel_for) {
  check_kernel_reads(kernel, w, "w");
  const PackedWeightHeader& h = w.header;
  if (w.int4())
    throw std::invalid_argument("w: int4 weights are computed by the linear ops (int8_scaled_mm_with_quant): their "
                                "epilogue needs the activations' group sums");
  if (m == 0 || h.n == 0) return;
  if (kernel.a_excludes_int8_min && holds_int8_min(a, m, lda, h.k))
    return gemm(kRefKernel, a, m, lda, w, o, scratch, parallel_for);
  // Pack A once: each row in the variant's own element representation, zero-padded to k_padded.
  auto* a_packed = static_cast<uint8_t*>(scratch);
  pack_a_rows(kernel, a, m, lda, h.k, h.k_padded, a_packed, parallel_for);
  gemm_packed(kernel, a_packed, packed_a_stride(kernel, h.k_padded), m, w, o, parallel_for);
}

namespace {

// The linear layer (linear() when gated_inter is 0, else gated_linear's fused form). Quantize and pack each row in one
// pass (one region; none for decode-sized m), then the GEMM's region. int4 weights: A's sums per group too, and plain
// int8 rows (the reference packing) for a variant's int4 tile.
int64_t quantized_gemm(const MicroKernel& kernel, const void* x, FloatKind kind, int64_t m, int64_t ldx,
                       const float* row_amax, const PackedWeightView& w, GemmOutput o, float* a_scales_out,
                       void* scratch, const ParallelFor& parallel_for, int64_t gated_inter) {
  check_kernel_reads(kernel, w, "w");
  const PackedWeightHeader& h = w.header;
  if (m == 0) return -1;
  auto* q = static_cast<int8_t*>(scratch);
  auto* sums = reinterpret_cast<int32_t*>(static_cast<uint8_t*>(scratch) + round_up(m * h.k, kAlign));
  auto* small = reinterpret_cast<uint8_t*>(sums) + round_up(a_group_sums_nbytes(w, m), kAlign);
  auto* a_packed = small + round_up(m, kAlign);
  // int8 weights through the variant's own tiles (int4 ones have their own); decode rows take the two-panel tiles
  const bool ask_small = kernel.a_row_small && !w.int4() && m > kTwoPanelMaxRows;
  RowFailures failures(m);
  dynamic_for(m, rows_per_claim(h.k), parallel_for, [&](int64_t r0, int64_t r1) {
    quantize_row_range(kernel, x, kind, ldx, h.k, row_amax, q, h.k, a_scales_out, r0, r1, failures);
    prepare_rows_for(kernel, w, r0, r1, [&](int64_t r) { return q + r * h.k; }, a_packed, sums);
    if (ask_small)
      for (int64_t r = r0; r < r1; ++r) small[r] = kernel.a_row_small(q + r * h.k, h.k) ? 1 : 0;
  });
  const int64_t bad = checked_rows(failures, m, kernel, x, kind, ldx, h.k, row_amax);
  o.a_scales = a_scales_out;
  o.a_group_sums = sums;
  o.a_rows_small = ask_small ? small : nullptr;
  gemm_packed(kernel, a_packed, packed_a_stride(kernel, w), m, w, o, parallel_for, gated_inter);
  return bad;
}

}  // namespace

int64_t linear(const MicroKernel& kernel, const void* x, FloatKind kind, int64_t m, int64_t ldx,
               const float* row_amax, const PackedWeightView& w, GemmOutput o, float* a_scales_out, void* scratch,
               const ParallelFor& parallel_for) {
  return quantized_gemm(kernel, x, kind, m, ldx, row_amax, w, o, a_scales_out, scratch, parallel_for, 0);
}

void silu_mul(const MicroKernel& kernel, float* gate, const float* up, int64_t n) {
  (kernel.silu_mul ? kernel.silu_mul : silu_mul_row)(gate, up, n);
}

int64_t gated_linear_scratch_nbytes(const MicroKernel& kernel, int64_t m, int64_t k, int64_t k_padded, int64_t n,
                                    int64_t groups) {
  return round_up(m * n * 4, kAlign) + linear_scratch_nbytes(kernel, m, k, k_padded, groups);
}

int64_t gated_linear(const MicroKernel& kernel, const void* x, FloatKind kind, int64_t m, int64_t ldx,
                     const float* row_amax, const PackedWeightView& w, GemmOutput o, float* a_scales_out,
                     void* scratch, const ParallelFor& parallel_for) {
  const int64_t n = w.header.n, inter = n / 2;
  if (n % 2 != 0)
    throw std::invalid_argument("w: a gated linear needs an even number of output channels (gate rows, then up "
                                "rows), got " + std::to_string(n));
  // Rows of tiles (prefill) with whole gate panels: each task its gate and up panels (compute_gated_rows).
  if (m > kTwoPanelMaxRows && inter % w.layout.nr == 0)
    return quantized_gemm(kernel, x, kind, m, ldx, row_amax, w, o, a_scales_out,
                          static_cast<uint8_t*>(scratch) + round_up(m * n * 4, kAlign), parallel_for, inter);
  // Else (decode's rows, which the two-panel tiles stream, or a gate panel holding up channels) the GEMM writes both
  // halves in fp32 (the epilogue of linear(), so gate and up are bit for bit the outputs of separate layers), then
  // one pass per row applies silu(gate) * up and casts once to the output type.
  auto* gate_up = static_cast<float*>(scratch);
  GemmOutput both = o;
  both.out = gate_up, both.out_kind = FloatKind::f32, both.ldo = n, both.raw_int32 = false;
  const int64_t bad = linear(kernel, x, kind, m, ldx, row_amax, w, both, a_scales_out,
                             static_cast<uint8_t*>(scratch) + round_up(m * n * 4, kAlign), parallel_for);
  dynamic_for(m, rows_per_claim(inter), parallel_for, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = gate_up + r * n;
      silu_mul(kernel, row, row + inter, inter);
      store_row_from_float(o.at(r, 0), o.out_kind, row, inter);
    }
  });
  return bad;
}

}  // namespace w8a8_cpu
