#include "moe_driver.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace w8a8_cpu {
namespace {

constexpr int64_t kAlign = 64;

int64_t align(int64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// exp(x) for x in [-87, 88] without a library call, so the loop below vectorizes with the baseline ISA:
// x = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-6 polynomial (rel. error < 2e-7), 2^n via the exponent bits.
// n is rounded by adding and subtracting 1.5 * 2^23 (plain IEEE adds, no rounding instruction needed).
inline float exp_poly(float x) {
  x = std::min(88.f, std::max(-87.f, x));
  const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

struct Layout {  // byte offsets of the scratch regions
  int64_t counts, order, hq, hs, a1, s1, gate_up, aq, s2, a2, down, total;
};

Layout scratch_layout(const MicroKernel& kernel, const MoeProblem& p) {
  const int64_t pairs = p.tokens * p.topk, inter2 = 2 * p.intermediate;
  Layout l{};
  int64_t at = 0;
  auto take = [&](int64_t bytes) {
    const int64_t here = at;
    at += align(bytes);
    return here;
  };
  l.counts = take((p.experts + 1) * 8);
  l.order = take(pairs * 8);
  l.hq = take(p.tokens * p.hidden);
  l.hs = take(p.tokens * 4);
  l.a1 = take(pairs * packed_a_stride(kernel, p.w13[0].header.k_padded));
  l.s1 = take(pairs * 4);
  l.gate_up = take(pairs * inter2 * 4);
  l.aq = take(pairs * p.intermediate);
  l.s2 = take(pairs * 4);
  l.a2 = take(pairs * packed_a_stride(kernel, p.w2[0].header.k_padded));
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
  const int64_t rows_per_block = 8 * kernel.mr;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(offsets.size()); ++e) {
    const int64_t panels = w[e].header.n_padded / w[e].layout.nr;
    for (int64_t panel = 0; panel < panels; ++panel)
      for (int64_t r = offsets[e]; r < offsets[e + 1]; r += rows_per_block)
        tasks.push_back({e, r, std::min(offsets[e + 1], r + rows_per_block), panel});
  }
  return tasks;
}

void throw_non_finite(int64_t row, const char* what) {
  throw std::invalid_argument(std::string(what) + std::to_string(row) +
                              " contains NaN or Inf; per-token int8 quantization needs finite values");
}

}  // namespace

void silu_mul(float* gate, const float* up, int64_t n) {
  for (int64_t j = 0; j < n; ++j) gate[j] = gate[j] / (1.f + exp_poly(-gate[j])) * up[j];
}

int64_t moe_scratch_nbytes(const MicroKernel& kernel, const MoeProblem& p) { return scratch_layout(kernel, p).total; }

void fused_experts(const MicroKernel& kernel, const MoeProblem& p, void* scratch, const ParallelFor& parallel_for) {
  for (int64_t e = 0; e < p.experts; ++e) {
    check_kernel_reads(kernel, p.w13[e], "w13");
    check_kernel_reads(kernel, p.w2[e], "w2");
  }
  const int64_t pairs = p.tokens * p.topk, inter = p.intermediate;
  if (pairs == 0) return;
  const Layout l = scratch_layout(kernel, p);
  auto* base = static_cast<uint8_t*>(scratch);
  auto* order = reinterpret_cast<int64_t*>(base + l.order);  // sorted position -> pair index t * topk + k
  auto* hq = reinterpret_cast<int8_t*>(base + l.hq);
  auto* hs = reinterpret_cast<float*>(base + l.hs);
  auto* a1 = base + l.a1;
  auto* s1 = reinterpret_cast<float*>(base + l.s1);
  auto* gate_up = reinterpret_cast<float*>(base + l.gate_up);
  auto* aq = reinterpret_cast<int8_t*>(base + l.aq);
  auto* s2 = reinterpret_cast<float*>(base + l.s2);
  auto* a2 = base + l.a2;
  auto* down = reinterpret_cast<float*>(base + l.down);

  // Route: counting sort of (token, slot) pairs by expert; within an expert, pairs stay in token order.
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
  std::vector<int64_t> position(pairs), next(offsets.begin(), offsets.end() - 1);
  for (int64_t i = 0; i < pairs; ++i) {
    position[i] = next[p.topk_ids[i]]++;
    order[position[i]] = i;
  }

  // Quantize each token once; gather its packed A row to every position routed to it.
  const int64_t bad = quantize_rows(kernel, p.x, p.x_kind, p.tokens, p.hidden, p.ldx, hq, p.hidden, hs, parallel_for);
  if (bad >= 0 && p.reject_non_finite) throw_non_finite(bad, "hidden: row ");
  const PackedWeightView& w13_any = p.w13[0];
  const int64_t a1_stride = packed_a_stride(kernel, w13_any.header.k_padded);
  parallel_for(0, pairs, std::max<int64_t>(1, 65536 / a1_stride), [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t t = order[q] / p.topk;
      kernel.pack_a_row(hq + t * p.hidden, p.hidden, w13_any.header.k_padded, a1 + q * a1_stride);
      s1[q] = hs[t];
    }
  });

  // gate_up[q] = hq[t] . w13[e]^T, fp32, for every sorted position q.
  const std::vector<Task> up_tasks = expert_tasks(kernel, offsets, p.w13);
  dynamic_for(static_cast<int64_t>(up_tasks.size()), 1, parallel_for, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Task& t = up_tasks[i];
      compute_panel_rows(kernel, a1, a1_stride, t.r0, t.r1, p.w13[t.e], t.panel,
                         {s1, p.w13_scales + t.e * 2 * inter, nullptr, gate_up, FloatKind::f32, 2 * inter});
    }
  });

  // act = silu(gate) * up, in place over the gate half; re-quantize per row; pack for the down projection.
  parallel_for(0, pairs, std::max<int64_t>(1, 16384 / inter), [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) silu_mul(gate_up + q * 2 * inter, gate_up + q * 2 * inter + inter, inter);
  });
  const int64_t bad_act = quantize_rows(kernel, gate_up, FloatKind::f32, pairs, inter, 2 * inter, aq, inter, s2,
                                        parallel_for);
  if (bad_act >= 0 && p.reject_non_finite) throw_non_finite(order[bad_act] / p.topk, "intermediate activation of token ");
  const int64_t a2_stride = packed_a_stride(kernel, p.w2[0].header.k_padded);
  pack_a_rows(kernel, aq, pairs, inter, inter, p.w2[0].header.k_padded, a2, parallel_for);

  // down[q] = act_q[q] . w2[e]^T, fp32.
  const std::vector<Task> down_tasks = expert_tasks(kernel, offsets, p.w2);
  dynamic_for(static_cast<int64_t>(down_tasks.size()), 1, parallel_for, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const Task& t = down_tasks[i];
      compute_panel_rows(kernel, a2, a2_stride, t.r0, t.r1, p.w2[t.e], t.panel,
                         {s2, p.w2_scales + t.e * p.hidden, nullptr, down, FloatKind::f32, p.hidden});
    }
  });

  // out[t] = sum over k in slot order of topk_weights[t, k] * down[position of (t, k)], cast once.
  constexpr int64_t kChunk = 256;
  parallel_for(0, p.tokens, std::max<int64_t>(1, 4096 / p.hidden), [&](int64_t t0, int64_t t1) {
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

}  // namespace w8a8_cpu
