#include "gemm_driver.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <stdexcept>
#include <string>

namespace w8a8_cpu {
namespace {

constexpr int64_t kAlign = 64;
constexpr int kMaxTileElems = 64 * 16;  // mr * nr bound for the int32 tile on the stack

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }


}  // namespace

void serial_for(int64_t begin, int64_t end, int64_t, const std::function<void(int64_t, int64_t)>& body) {
  if (begin < end) body(begin, end);
}

int64_t packed_weight_nbytes(int64_t n, int64_t k, PanelLayout layout) {
  const int64_t n_padded = round_up(n, layout.nr), k_padded = round_up(k, layout.kr);
  return static_cast<int64_t>(sizeof(PackedWeightHeader)) + n_padded * k_padded + n_padded * 4;
}

bool kernel_reads_layout(const MicroKernel& kernel, PanelLayout layout) {
  return kernel.reads_any_layout || (kernel.layout.nr == layout.nr && kernel.layout.kr == layout.kr);
}

void pack_weight(const MicroKernel& kernel, const int8_t* w, int64_t n, int64_t k, int64_t ldw, uint8_t* blob,
                 const ParallelFor& parallel_for) {
  const PanelLayout layout = kernel.layout;
  const int nr = layout.nr;
  PackedWeightHeader header{};
  std::memcpy(header.magic, kPackedMagic, sizeof kPackedMagic);
  header.version = kPackedVersion;
  header.nr = static_cast<uint16_t>(nr);
  header.kr = static_cast<uint16_t>(layout.kr);
  header.n = n;
  header.k = k;
  header.n_padded = round_up(n, nr);
  header.k_padded = round_up(k, layout.kr);
  std::strncpy(header.packed_by, kernel.name, sizeof header.packed_by - 1);
  std::memcpy(blob, &header, sizeof header);
  auto* panels = reinterpret_cast<int8_t*>(blob + sizeof header);
  auto* col_sums = reinterpret_cast<int32_t*>(panels + header.n_padded * header.k_padded);
  const int64_t panel_bytes = header.k_padded * nr;
  parallel_for(0, header.n_padded / nr, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      int8_t* panel = panels + p * panel_bytes;
      for (int j = 0; j < nr; ++j) {
        const int64_t row = p * nr + j;
        int32_t sum = 0;
        for (int64_t kk = 0; kk < header.k_padded; ++kk) {
          const int8_t v = (row < n && kk < k) ? w[row * ldw + kk] : 0;
          panel[layout.index(kk, j)] = v;
          sum += v;
        }
        col_sums[row] = sum;
      }
    }
  });
}

PackedWeightView view_packed_weight(const uint8_t* blob, int64_t nbytes, const char* arg) {
  const std::string name(arg);
  PackedWeightHeader h;
  if (nbytes < static_cast<int64_t>(sizeof h))
    throw std::invalid_argument(name + ": a 1-D uint8 tensor of " + std::to_string(nbytes) +
                                " bytes is too short to be a packed weight (expected the output of pack_weight)");
  std::memcpy(&h, blob, sizeof h);
  if (std::memcmp(h.magic, kPackedMagic, sizeof kPackedMagic) != 0)
    throw std::invalid_argument(name + ": 1-D uint8 tensor is not a packed weight (bad magic); pass the output of "
                                "pack_weight or a raw int8 [N, K] weight");
  if (h.version != kPackedVersion)
    throw std::invalid_argument(name + ": packed weight format version " + std::to_string(h.version) +
                                " is not supported (this build reads version " + std::to_string(kPackedVersion) +
                                "); re-pack the raw weight with pack_weight");
  const PanelLayout layout{h.nr, h.kr};
  if (h.nr == 0 || h.kr == 0 || h.n < 0 || h.k < 0 || h.n_padded != round_up(h.n, h.nr) ||
      h.k_padded != round_up(h.k, h.kr) || nbytes != packed_weight_nbytes(h.n, h.k, layout))
    throw std::invalid_argument(name + ": packed weight header is inconsistent with its size (corrupted or "
                                "truncated blob)");
  const auto* panels = reinterpret_cast<const int8_t*>(blob + sizeof h);
  return {reinterpret_cast<const PackedWeightHeader*>(blob), layout, panels,
          reinterpret_cast<const int32_t*>(panels + h.n_padded * h.k_padded)};
}

int64_t quantize_rows(const MicroKernel& kernel, const void* x, FloatKind kind, int64_t m, int64_t k, int64_t ldx,
                      int8_t* q, int64_t ldq, float* scales, const ParallelFor& parallel_for) {
  std::atomic<int64_t> first_bad{m};
  parallel_for(0, m, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const void* row = element_at(x, kind, r * ldx);
      const uint32_t amax_bits = kernel.row_absmax_bits(row, kind, k);
      if (amax_bits >= 0x7f800000u) {
        int64_t seen = first_bad.load();
        while (r < seen && !first_bad.compare_exchange_weak(seen, r)) {
        }
        continue;
      }
      float amax;
      std::memcpy(&amax, &amax_bits, 4);
      amax = std::max(amax, kAmaxEps);
      scales[r] = amax / 127.f;
      kernel.quantize_row(row, kind, k, 127.f / amax, q + r * ldq);
    }
  });
  const int64_t bad = first_bad.load();
  return bad < m ? bad : -1;
}

int64_t gemm_scratch_nbytes(const MicroKernel& kernel, int64_t m, int64_t k_padded) {
  return m * packed_a_stride(kernel, k_padded);
}

void check_kernel_reads(const MicroKernel& kernel, const PackedWeightView& w, const char* arg) {
  if (!kernel_reads_layout(kernel, w.layout))
    throw std::invalid_argument(std::string(arg) + ": weight was packed by the '" + w.header->packed_by +
                                "' variant (panel " + std::to_string(w.layout.nr) + "x" + std::to_string(w.layout.kr) +
                                "), which the active '" + kernel.name + "' variant cannot read (it reads " +
                                std::to_string(kernel.layout.nr) + "x" + std::to_string(kernel.layout.kr) +
                                "); re-pack the raw weight under the active variant");
  if (kernel.mr * w.layout.nr > kMaxTileElems)
    throw std::logic_error("micro-kernel tile larger than the driver's tile buffer");
}

int64_t packed_a_stride(const MicroKernel& kernel, int64_t k_padded) {
  // An odd number of cache lines: a tile reads mr rows in lockstep, and rows a power-of-two multiple of 4 KiB
  // apart (K = 4096) would all map to one L1 set and evict each other (measured: -25% at M = 16).
  const int64_t lines = round_up(k_padded * static_cast<int64_t>(kernel.a_elem_bytes), kAlign) / kAlign;
  return (lines | 1) * kAlign;
}

void pack_a_rows(const MicroKernel& kernel, const int8_t* a, int64_t m, int64_t lda, int64_t k, int64_t k_padded,
                 uint8_t* dst, const ParallelFor& parallel_for) {
  const int64_t stride = packed_a_stride(kernel, k_padded);
  parallel_for(0, m, std::max<int64_t>(1, 65536 / std::max<int64_t>(k_padded, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) kernel.pack_a_row(a + r * lda, k, k_padded, dst + r * stride);
  });
}

void compute_panel_rows(const MicroKernel& kernel, const uint8_t* a_packed, int64_t a_stride, int64_t r0, int64_t r1,
                        const float* a_scales, const PackedWeightView& w, int64_t panel, const float* w_scales,
                        const float* bias, void* out, FloatKind out_kind, int64_t ldo) {
  const int nr = w.layout.nr;
  const int64_t k_padded = w.header->k_padded;
  const int8_t* panel_data = w.panels + panel * k_padded * nr;
  const int32_t* sums = w.col_sums + panel * nr;
  const int64_t n0 = panel * nr, cols = std::min<int64_t>(nr, w.header->n - n0);
  int32_t c[kMaxTileElems];
  float v[kMaxTileElems];
  const float* ws = w_scales + n0;
  for (int64_t r = r0; r < r1; r += kernel.mr) {
    const int rows = static_cast<int>(std::min<int64_t>(kernel.mr, r1 - r));
    kernel.tile(a_packed + r * a_stride, static_cast<size_t>(a_stride), rows, panel_data, sums, w.layout, k_padded, c);
    for (int i = 0; i < rows; ++i) {
      const float a_scale = a_scales[r + i];
      const int32_t* ci = c + i * nr;
      void* dst = static_cast<char*>(out) + ((r + i) * ldo + n0) * element_bytes(out_kind);
      // fp32 rows go straight to the output (the MoE's intermediates: a 64-byte memcpy call per row was ~8% of it).
      float* vi = out_kind == FloatKind::f32 ? static_cast<float*>(dst) : v;
      // Fixed operation order (no FMA contraction, see CMakeLists) so every variant agrees bit for bit.
      for (int64_t j = 0; j < cols; ++j) vi[j] = static_cast<float>(ci[j]) * (a_scale * ws[j]);
      if (bias)
        for (int64_t j = 0; j < cols; ++j) vi[j] += bias[n0 + j];
      if (vi == v) store_row_from_float(dst, out_kind, v, cols);
    }
  }
}

void gemm(const MicroKernel& kernel, const int8_t* a, int64_t m, int64_t lda, const float* a_scales,
          const PackedWeightView& w, const float* w_scales, const float* bias, void* out, FloatKind out_kind,
          int64_t ldo, void* scratch, const ParallelFor& parallel_for) {
  check_kernel_reads(kernel, w, "w");
  const PackedWeightHeader& h = *w.header;
  if (m == 0 || h.n == 0) return;

  // Pack A once: each row in the variant's own element representation, zero-padded to k_padded.
  auto* a_packed = static_cast<uint8_t*>(scratch);
  pack_a_rows(kernel, a, m, lda, h.k, h.k_padded, a_packed, parallel_for);
  const int64_t a_stride = packed_a_stride(kernel, h.k_padded);

  // Tasks are (panel, block of rows), panel-major: a thread's contiguous share of tasks is a contiguous
  // slice of the weight, streamed once (decode), reused from cache across its row blocks (prefill).
  // Every output element is produced by one tile call over the full K, so results do not depend on
  // how tasks are split among threads.
  const int64_t rows_per_block = std::min<int64_t>(round_up(m, kernel.mr), 8 * kernel.mr);
  const int64_t row_blocks = (m + rows_per_block - 1) / rows_per_block;
  const int64_t panels = h.n_padded / w.layout.nr;
  const int64_t macs_per_task = rows_per_block * h.k_padded * w.layout.nr;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 18) / std::max<int64_t>(macs_per_task, 1));
  parallel_for(0, panels * row_blocks, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t p = t / row_blocks, rb = t % row_blocks;
      compute_panel_rows(kernel, a_packed, a_stride, rb * rows_per_block, std::min(m, (rb + 1) * rows_per_block),
                         a_scales, w, p, w_scales, bias, out, out_kind, ldo);
    }
  });
}

}  // namespace w8a8_cpu
