// MoE driver checks for the kernel test runner: every variant's fused_experts equals a plain scalar
// implementation of the same math bit for bit (int32 stages exact, same fp32 operation order), with int8 experts and
// with int4 experts (exact int32 per group, the groups combined in GemmOutput's fp32 order).
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "moe_driver.h"
#include "ref_kernel.h"

namespace w8a8_cpu {
namespace {

struct MoeCase {
  int64_t m, h, inter, experts, topk;
  bool skew;  // every token to experts 0..topk-1
  int int4_group_log2 = -1;  // -1: int8 experts; else int4 experts, WeightFormat::group_log2 (0: per channel)
  bool mins = false;         // int4: with group minimums
};

// Each projection's weights as the scalar implementation reads them: int8 q, or int4 q with group scales and
// minimums [n][groups] (mins empty without) in groups of `group` k.
struct Projection {
  const int8_t* q;
  const float* group_scales;
  const float* group_mins;
  int64_t group;
};

// Per-token quantization exactly as the driver specifies it (scale = max(amax, eps) / 127).
void quantize(const float* x, int64_t k, int8_t* q, float* scale) {
  const uint32_t bits = ref_row_absmax_bits(x, FloatKind::f32, k);
  float amax;
  std::memcpy(&amax, &bits, 4);
  amax = std::max(amax, kAmaxEps);
  *scale = amax / 127.f;
  ref_quantize_row(x, FloatKind::f32, k, 127.f / amax, q);
}

// One row: int8, out = float(sum a*w) * (a_scale * w_scale[n]); int4, t = 0, per group g t = t + float(acc_g) *
// scale_g (then t = t + float(sum_g a) * min_g), out = t * (a_scale * w_scale[n]).
void matvec(const int8_t* a, float a_scale, const Projection& w, const float* w_scale, int64_t n, int64_t k,
            float* out) {
  for (int64_t j = 0; j < n; ++j) {
    if (!w.group_scales) {
      int64_t acc = 0;
      for (int64_t i = 0; i < k; ++i) acc += int64_t{a[i]} * w.q[j * k + i];
      out[j] = static_cast<float>(acc) * (a_scale * w_scale[j]);
      continue;
    }
    const int64_t groups = (k + w.group - 1) / w.group;
    float t = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      int64_t acc = 0, a_sum = 0;
      for (int64_t i = g * w.group; i < std::min(k, (g + 1) * w.group); ++i)
        acc += int64_t{a[i]} * w.q[j * k + i], a_sum += a[i];
      t = t + static_cast<float>(acc) * w.group_scales[j * groups + g];
      if (w.group_mins) t = t + static_cast<float>(a_sum) * w.group_mins[j * groups + g];
    }
    out[j] = t * (a_scale * w_scale[j]);
  }
}

// Expert e's part of a projection held for all experts ([experts][n][k] weights, [experts][n][groups] scales).
Projection expert(const Projection& all, int64_t e, int64_t n, int64_t k) {
  const int64_t groups = (k + all.group - 1) / all.group;
  return {all.q + e * n * k, all.group_scales ? all.group_scales + e * n * groups : nullptr,
          all.group_mins ? all.group_mins + e * n * groups : nullptr, all.group};
}

std::vector<float> scalar_moe(const MoeCase& c, const std::vector<float>& x, const Projection& w13,
                              const std::vector<float>& s13, const Projection& w2, const std::vector<float>& s2,
                              const std::vector<float>& weights, const std::vector<int64_t>& ids) {
  std::vector<float> out(c.m * c.h), gate_up(2 * c.inter), down(c.h);
  std::vector<int8_t> xq(c.h), aq(c.inter);
  for (int64_t t = 0; t < c.m; ++t) {
    float xs, as;
    quantize(x.data() + t * c.h, c.h, xq.data(), &xs);
    std::vector<float> acc(c.h, 0.f);
    for (int64_t k = 0; k < c.topk; ++k) {
      const int64_t e = ids[t * c.topk + k];
      matvec(xq.data(), xs, expert(w13, e, 2 * c.inter, c.h), s13.data() + e * 2 * c.inter, 2 * c.inter, c.h,
             gate_up.data());
      silu_mul(kRefKernel, gate_up.data(), gate_up.data() + c.inter, c.inter);
      quantize(gate_up.data(), c.inter, aq.data(), &as);
      matvec(aq.data(), as, expert(w2, e, c.h, c.inter), s2.data() + e * c.h, c.h, c.inter, down.data());
      for (int64_t j = 0; j < c.h; ++j) acc[j] += weights[t * c.topk + k] * down[j];
    }
    std::copy(acc.begin(), acc.end(), out.begin() + t * c.h);
  }
  return out;
}

// Every expert's part of a projection packed for `kern` (int8, or int4 in c's format) into blobs; their views.
std::vector<PackedWeightView> pack_experts(const MicroKernel& kern, const MoeCase& c, const Projection& w, int64_t n,
                                           int64_t k, std::vector<uint8_t>& blobs) {
  const bool int4 = c.int4_group_log2 >= 0;
  const WeightFormat format =
      int4 ? WeightFormat{c.mins ? WeightScheme::int4_min : WeightScheme::int4, c.int4_group_log2} : WeightFormat{};
  const int64_t nbytes = packed_weight_nbytes(n, k, kern.geometry().layout, "w", format);
  blobs.assign(c.experts * nbytes, 0);
  std::vector<PackedWeightView> views;
  for (int64_t e = 0; e < c.experts; ++e) {
    const Projection pe = expert(w, e, n, k);
    uint8_t* blob = blobs.data() + e * nbytes;
    if (int4)
      pack_weight_int4(kern, pe.q, n, k, k, pe.group_scales, pe.group_mins, format, blob, serial_for);
    else
      pack_weight(kern, pe.q, n, k, k, blob, serial_for);
    views.push_back(view_packed_weight(blob, nbytes, "w"));
  }
  return views;
}

}  // namespace

int run_moe_tests(const std::vector<const MicroKernel*>& kernels, uint64_t seed) {
  const MoeCase cases[] = {{1, 64, 32, 4, 2, false},          {7, 100, 44, 5, 3, false},
                           {33, 96, 40, 16, 4, false},        {20, 80, 24, 8, 2, true},
                           {9, 48, 200, 3, 1, false},         {7, 100, 44, 5, 3, false, 5, false},
                           {33, 96, 40, 16, 4, false, 5, true}, {20, 128, 64, 8, 2, true, 6, true},
                           {9, 48, 200, 3, 1, false, 0, true}, {5, 256, 96, 4, 2, false, 7, false}};
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> byte(-128, 127), nibble(-8, 7);
  int failures = 0;
  for (const MoeCase& c : cases) {
    const bool int4 = c.int4_group_log2 >= 0;
    const int64_t group13 = int4 && c.int4_group_log2 ? int64_t{1} << c.int4_group_log2 : c.h,
                  group2 = int4 && c.int4_group_log2 ? int64_t{1} << c.int4_group_log2 : c.inter;
    const int64_t groups13 = int4 ? (c.h + group13 - 1) / group13 : 0,
                  groups2 = int4 ? (c.inter + group2 - 1) / group2 : 0;
    std::vector<float> x(c.m * c.h), s13(c.experts * 2 * c.inter), s2(c.experts * c.h), weights(c.m * c.topk);
    std::vector<int8_t> w13(c.experts * 2 * c.inter * c.h), w2(c.experts * c.h * c.inter);
    std::vector<float> gs13(c.experts * 2 * c.inter * groups13), gs2(c.experts * c.h * groups2);
    std::vector<float> gm13(c.mins ? gs13.size() : 0), gm2(c.mins ? gs2.size() : 0);
    std::vector<int64_t> ids(c.m * c.topk);
    for (auto& v : x) v = nd(rng);
    for (auto* w : {&w13, &w2})
      for (auto& v : *w) v = static_cast<int8_t>(int4 ? nibble(rng) : byte(rng));
    for (auto* g : {&gs13, &gs2, &gm13, &gm2})
      for (auto& v : *g) v = nd(rng) * 0.05f;
    for (auto& v : s13) v = 1e-3f + std::abs(nd(rng)) * 1e-3f;
    for (auto& v : s2) v = 1e-3f + std::abs(nd(rng)) * 1e-3f;
    for (auto& v : weights) v = std::abs(nd(rng));
    for (int64_t t = 0; t < c.m; ++t)
      for (int64_t k = 0; k < c.topk; ++k)  // distinct experts per token
        ids[t * c.topk + k] = c.skew ? k : (t * 7 + k * (c.experts / c.topk)) % c.experts;
    const Projection p13{w13.data(), int4 ? gs13.data() : nullptr, c.mins ? gm13.data() : nullptr, group13},
                     p2{w2.data(), int4 ? gs2.data() : nullptr, c.mins ? gm2.data() : nullptr, group2};
    const auto want = scalar_moe(c, x, p13, s13, p2, s2, weights, ids);
    for (const MicroKernel* kern : kernels) {
      std::vector<uint8_t> b13, b2;
      const std::vector<PackedWeightView> v13 = pack_experts(*kern, c, p13, 2 * c.inter, c.h, b13),
                                          v2 = pack_experts(*kern, c, p2, c.h, c.inter, b2);
      std::vector<float> out(c.m * c.h);
      const MoeProblem p{c.m,          c.h,        c.inter,   c.experts, c.topk,    x.data(),
                         FloatKind::f32, c.h,      weights.data(), ids.data(), v13.data(), s13.data(),
                         v2.data(),    s2.data(),  out.data(), FloatKind::f32, true};
      std::vector<uint8_t> scratch(moe_scratch_nbytes(*kern, p));
      fused_experts(*kern, p, scratch.data(), serial_for);
      const bool same = std::memcmp(out.data(), want.data(), out.size() * 4) == 0;
      if (!same) {
        ++failures;
        std::printf("FAIL %s: MoE M=%" PRId64 " H=%" PRId64 " I=%" PRId64 " E=%" PRId64 " topk=%" PRId64
                    " int4 group_log2=%d mins=%d differs from the scalar implementation\n",
                    kern->name, c.m, c.h, c.inter, c.experts, c.topk, c.int4_group_log2, int{c.mins});
      }
    }
  }
  std::printf("  MoE: %zu cases x %zu variants, %d differ from the scalar implementation\n",
              sizeof cases / sizeof cases[0], kernels.size(), failures);
  return failures;
}

}  // namespace w8a8_cpu
