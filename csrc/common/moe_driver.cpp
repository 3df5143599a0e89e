#include "moe_driver.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "float_convert.h"

namespace w8a8_cpu {
namespace {

struct Layout {  // byte offsets of the scratch regions
  int64_t order, hq, hs, a1, g1, s1, gate_up, aq, s2, a2, g2, down, total;
};

Layout scratch_layout(const MicroKernel& kernel, const MoeProblem& p) {
  const int64_t pairs = p.tokens * p.topk, inter2 = 2 * p.intermediate;
  Layout l{};
  int64_t at = 0;
  auto take = [&](int64_t bytes) {
    const int64_t here = at;
    at += round_up(bytes, 64);
    return here;
  };
  l.order = take(pairs * 8);
  l.hq = take(p.tokens * p.hidden);
  l.hs = take(p.tokens * 4);
  l.a1 = take(pairs * packed_a_stride(kernel, p.w13[0]));
  l.g1 = take(a_group_sums_nbytes(p.w13[0], pairs));
  l.s1 = take(pairs * 4);
  l.gate_up = take(pairs * inter2 * 4);
  l.aq = take(pairs * p.intermediate);
  l.s2 = take(pairs * 4);
  l.a2 = take(pairs * packed_a_stride(kernel, p.w2[0]));
  l.g2 = take(a_group_sums_nbytes(p.w2[0], pairs));
  l.down = take(pairs * p.hidden * 4);
  l.total = at;
  return l;
}

struct Task {  // rows [r0, r1) of expert e's block (sorted pair positions) times one weight panel
  int64_t e, r0, r1, panel;
};

// Tasks over (expert, panel, row block): many experts with one token each and one expert with many
// tokens both give every thread work.
std::vector<Task> expert_tasks(const MicroKernel& kernel, const std::vector<int64_t>& offsets,
                               const PackedWeightView* w) {
  std::vector<Task> tasks;
  const int64_t rows_per_block = 8 * kernel.geometry().mr;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(offsets.size()); ++e) {
    const int64_t panels = w[e].header.n_padded / w[e].layout.nr;
    for (int64_t panel = 0; panel < panels; ++panel)
      for (int64_t r = offsets[e]; r < offsets[e + 1]; r += rows_per_block)
        tasks.push_back({e, r, std::min(offsets[e + 1], r + rows_per_block), panel});
  }
  return tasks;
}

// The driver prepares A once per projection for all its experts: each must read A as expert 0 does.
void check_like_first(const PackedWeightView* w, int64_t e, const char* arg) {
  const PackedWeightView &first = w[0], &v = w[e];
  if (v.layout.nr != first.layout.nr || v.layout.kr != first.layout.kr || v.header.k_padded != first.header.k_padded ||
      v.format.scheme != first.format.scheme || v.format.group_log2 != first.format.group_log2)
    throw std::invalid_argument(std::string(arg) + ": expert " + std::to_string(e) + " is packed in another layout or "
                                "weight format (scheme, group size) than expert 0; pack all experts alike");
}

void throw_non_finite(int64_t row, const char* what) {
  throw std::invalid_argument(std::string(what) + std::to_string(row) +
                              " contains NaN or Inf; per-token int8 quantization needs finite values");
}

}  // namespace

int64_t moe_scratch_nbytes(const MicroKernel& kernel, const MoeProblem& p) { return scratch_layout(kernel, p).total; }

namespace {

// The scratch regions of one call, as typed pointers (scratch_layout's offsets).
struct MoeScratch {
  int64_t* order;  // sorted position -> pair index t * topk + k
  int8_t* hq;      // quantized tokens [tokens, hidden]
  float* hs;       // their scales
  uint8_t* a1;     // packed gate/up input, one row per sorted position
  int32_t* g1;     // int4 w13: its sums per scale group, one row per sorted position
  float* s1;
  float* gate_up;  // [pairs, 2 * intermediate] fp32
  int8_t* aq;      // quantized activations [pairs, intermediate]
  float* s2;
  uint8_t* a2;     // packed down input
  int32_t* g2;     // int4 w2: its group sums
  float* down;     // [pairs, hidden] fp32
};

MoeScratch scratch_regions(const MicroKernel& kernel, const MoeProblem& p, void* scratch) {
  const Layout l = scratch_layout(kernel, p);
  auto* base = static_cast<uint8_t*>(scratch);
  return {reinterpret_cast<int64_t*>(base + l.order), reinterpret_cast<int8_t*>(base + l.hq),
          reinterpret_cast<float*>(base + l.hs),      base + l.a1,
          reinterpret_cast<int32_t*>(base + l.g1),    reinterpret_cast<float*>(base + l.s1),
          reinterpret_cast<float*>(base + l.gate_up), reinterpret_cast<int8_t*>(base + l.aq),
          reinterpret_cast<float*>(base + l.s2),      base + l.a2,
          reinterpret_cast<int32_t*>(base + l.g2),    reinterpret_cast<float*>(base + l.down)};
}

// Stage 1, route: counting sort of (token, slot) pairs by expert; within an expert, pairs stay in token order.
// Returns the experts' offsets into the sorted positions; position[i] is pair i's sorted position.
std::vector<int64_t> route(const MoeProblem& p, int64_t* order, std::vector<int64_t>& position) {
  const int64_t pairs = p.tokens * p.topk;
  std::vector<int64_t> offsets(p.experts + 1, 0);
  for (int64_t i = 0; i < pairs; ++i) {
    const int64_t e = p.topk_ids[i];
    if (e < 0 || e >= p.experts)
      throw std::invalid_argument("topk_ids: value " + std::to_string(e) + " at [" + std::to_string(i / p.topk) +
                                  ", " + std::to_string(i % p.topk) + "] is outside [0, " +
                                  std::to_string(p.experts) + ")");
    ++offsets[e + 1];
  }
  for (int64_t e = 0; e < p.experts; ++e) offsets[e + 1] += offsets[e];
  position.assign(pairs, 0);
  std::vector<int64_t> next(offsets.begin(), offsets.end() - 1);
  for (int64_t i = 0; i < pairs; ++i) {
    position[i] = next[p.topk_ids[i]]++;
    order[position[i]] = i;
  }
  return offsets;
}

// Stage 2, gather: quantize each token once and prepare its row (packed; int4 w13: and its group sums) at every
// sorted position routed to it (a pointer list: no copy of the token per position first).
void quantize_and_gather(const MicroKernel& kernel, const MoeProblem& p, const MoeScratch& s,
                         const ParallelFor& parallel_for) {
  const int64_t pairs = p.tokens * p.topk;
  const int64_t bad = quantize_rows(kernel, p.x, p.x_kind, p.tokens, p.hidden, p.ldx, s.hq, p.hidden, s.hs,
                                    parallel_for);
  if (bad >= 0 && p.reject_non_finite) throw_non_finite(bad, "hidden: row ");
  const int64_t stride = packed_a_stride(kernel, p.w13[0]);
  dynamic_for(pairs, std::max<int64_t>(1, 65536 / stride), parallel_for, [&](int64_t q0, int64_t q1) {
    prepare_rows_for(kernel, p.w13[0], q0, q1, [&](int64_t q) { return s.hq + s.order[q] / p.topk * p.hidden; },
                     s.a1, s.g1);
    for (int64_t q = q0; q < q1; ++q) s.s1[q] = s.hs[s.order[q] / p.topk];
  });
}

// Stages 3 and 5, the expert projections: out[q] = a[q] . w[e]^T in fp32 for every sorted position q of expert e
// (int4 experts: through the int4 epilogue with a_group_sums, the rows' group sums).
void project(const MicroKernel& kernel, const std::vector<int64_t>& offsets, const PackedWeightView* w,
             const float* w_scales, int64_t n, const uint8_t* a, const int32_t* a_group_sums, const float* a_scales,
             float* out, const ParallelFor& parallel_for) {
  const int64_t stride = packed_a_stride(kernel, w[0]);
  const std::vector<Task> tasks = expert_tasks(kernel, offsets, w);
  dynamic_for(static_cast<int64_t>(tasks.size()), 1, parallel_for, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Task& t = tasks[i];
      compute_panel_rows(kernel, a, stride, t.r0, t.r1, w[t.e], t.panel,
                         {a_scales, w_scales + t.e * n, nullptr, out, FloatKind::f32, n, false, a_group_sums});
    }
  }, kernel.thread_enter, kernel.thread_leave);
}

// Stage 4, activation: act = silu(gate) * up in place over the gate half, re-quantized per row and prepared for the
// down projection.
void activate(const MicroKernel& kernel, const MoeProblem& p, const MoeScratch& s, const ParallelFor& parallel_for) {
  const int64_t pairs = p.tokens * p.topk, inter = p.intermediate;
  dynamic_for(pairs, std::max<int64_t>(1, 16384 / inter), parallel_for, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q)
      silu_mul(kernel, s.gate_up + q * 2 * inter, s.gate_up + q * 2 * inter + inter, inter);
  });
  const int64_t bad = quantize_rows(kernel, s.gate_up, FloatKind::f32, pairs, inter, 2 * inter, s.aq, inter, s.s2,
                                    parallel_for);
  if (bad >= 0 && p.reject_non_finite) throw_non_finite(s.order[bad] / p.topk, "intermediate activation of token ");
  dynamic_for(pairs, std::max<int64_t>(1, 65536 / inter), parallel_for, [&](int64_t q0, int64_t q1) {
    prepare_rows_for(kernel, p.w2[0], q0, q1, [&](int64_t q) { return s.aq + q * inter; }, s.a2, s.g2);
  });
}

// Stage 6, combine: out[t] = sum over k in slot order of topk_weights[t, k] * down[position of (t, k)], cast once.
void combine(const MoeProblem& p, const float* down, const std::vector<int64_t>& position,
             const ParallelFor& parallel_for) {
  constexpr int64_t kChunk = 256;
  dynamic_for(p.tokens, std::max<int64_t>(1, 4096 / p.hidden), parallel_for, [&](int64_t t0, int64_t t1) {
    float acc[kChunk];
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h0 = 0; h0 < p.hidden; h0 += kChunk) {
        const int64_t len = std::min(kChunk, p.hidden - h0);
        std::fill(acc, acc + len, 0.f);
        for (int64_t k = 0; k < p.topk; ++k) {
          const float weight = p.topk_weights[t * p.topk + k];
          const float* row = down + position[t * p.topk + k] * p.hidden + h0;
          for (int64_t h = 0; h < len; ++h) acc[h] += weight * row[h];
        }
        store_row_from_float(static_cast<char*>(p.out) + (t * p.hidden + h0) * element_bytes(p.out_kind), p.out_kind,
                             acc, len);
      }
  });
}

}  // namespace

void fused_experts(const MicroKernel& kernel, const MoeProblem& p, void* scratch, const ParallelFor& parallel_for) {
  for (int64_t e = 0; e < p.experts; ++e) {
    check_kernel_reads(kernel, p.w13[e], "w13");
    check_kernel_reads(kernel, p.w2[e], "w2");
    check_like_first(p.w13, e, "w13");
    check_like_first(p.w2, e, "w2");
  }
  if (p.tokens * p.topk == 0) return;
  const MoeScratch s = scratch_regions(kernel, p, scratch);
  std::vector<int64_t> position;
  const std::vector<int64_t> offsets = route(p, s.order, position);
  quantize_and_gather(kernel, p, s, parallel_for);
  project(kernel, offsets, p.w13, p.w13_scales, 2 * p.intermediate, s.a1, s.g1, s.s1, s.gate_up, parallel_for);
  activate(kernel, p, s, parallel_for);
  project(kernel, offsets, p.w2, p.w2_scales, p.hidden, s.a2, s.g2, s.s2, s.down, parallel_for);
  combine(p, s.down, position, parallel_for);
}

}  // namespace w8a8_cpu
