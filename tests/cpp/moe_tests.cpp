// MoE driver checks for the kernel test runner: every variant's fused_experts equals a plain scalar
// implementation of the same math bit for bit (int32 stages exact, same fp32 operation order).
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

// out = float(sum a*w) * (a_scale * w_scale[n]) for one row.
void matvec(const int8_t* a, float a_scale, const int8_t* w, const float* w_scale, int64_t n, int64_t k, float* out) {
  for (int64_t j = 0; j < n; ++j) {
    int64_t acc = 0;
    for (int64_t i = 0; i < k; ++i) acc += int64_t{a[i]} * w[j * k + i];
    out[j] = static_cast<float>(acc) * (a_scale * w_scale[j]);
  }
}

std::vector<float> scalar_moe(const MoeCase& c, const std::vector<float>& x, const std::vector<int8_t>& w13,
                              const std::vector<float>& s13, const std::vector<int8_t>& w2, const std::vector<float>& s2,
                              const std::vector<float>& weights, const std::vector<int64_t>& ids) {
  std::vector<float> out(c.m * c.h), gate_up(2 * c.inter), down(c.h);
  std::vector<int8_t> xq(c.h), aq(c.inter);
  for (int64_t t = 0; t < c.m; ++t) {
    float xs, as;
    quantize(x.data() + t * c.h, c.h, xq.data(), &xs);
    std::vector<float> acc(c.h, 0.f);
    for (int64_t k = 0; k < c.topk; ++k) {
      const int64_t e = ids[t * c.topk + k];
      matvec(xq.data(), xs, w13.data() + e * 2 * c.inter * c.h, s13.data() + e * 2 * c.inter, 2 * c.inter, c.h,
             gate_up.data());
      silu_mul(gate_up.data(), gate_up.data() + c.inter, c.inter);
      quantize(gate_up.data(), c.inter, aq.data(), &as);
      matvec(aq.data(), as, w2.data() + e * c.h * c.inter, s2.data() + e * c.h, c.h, c.inter, down.data());
      for (int64_t j = 0; j < c.h; ++j) acc[j] += weights[t * c.topk + k] * down[j];
    }
    std::copy(acc.begin(), acc.end(), out.begin() + t * c.h);
  }
  return out;
}

}  // namespace

int run_moe_tests(const std::vector<const MicroKernel*>& kernels, uint64_t seed) {
  const MoeCase cases[] = {{1, 64, 32, 4, 2, false}, {7, 100, 44, 5, 3, false}, {33, 96, 40, 16, 4, false},
                           {20, 80, 24, 8, 2, true},  {9, 48, 200, 3, 1, false}};
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::uniform_int_distribution<int> byte(-128, 127);
  int failures = 0;
  for (const MoeCase& c : cases) {
    std::vector<float> x(c.m * c.h), s13(c.experts * 2 * c.inter), s2(c.experts * c.h), weights(c.m * c.topk);
    std::vector<int8_t> w13(c.experts * 2 * c.inter * c.h), w2(c.experts * c.h * c.inter);
    std::vector<int64_t> ids(c.m * c.topk);
    for (auto& v : x) v = nd(rng);
    for (auto& v : w13) v = static_cast<int8_t>(byte(rng));
    for (auto& v : w2) v = static_cast<int8_t>(byte(rng));
    for (auto& v : s13) v = 1e-3f + std::abs(nd(rng)) * 1e-3f;
    for (auto& v : s2) v = 1e-3f + std::abs(nd(rng)) * 1e-3f;
    for (auto& v : weights) v = std::abs(nd(rng));
    for (int64_t t = 0; t < c.m; ++t)
      for (int64_t k = 0; k < c.topk; ++k)  // distinct experts per token
        ids[t * c.topk + k] = c.skew ? k : (t * 7 + k * (c.experts / c.topk)) % c.experts;
    const auto want = scalar_moe(c, x, w13, s13, w2, s2, weights, ids);
    for (const MicroKernel* kern : kernels) {
      const PanelLayout layout = kern->geometry().layout;
      const int64_t b13 = packed_weight_nbytes(2 * c.inter, c.h, layout, "w13"),
                    b2 = packed_weight_nbytes(c.h, c.inter, layout, "w2");
      std::vector<uint8_t> p13(c.experts * b13), p2(c.experts * b2);
      std::vector<PackedWeightView> v13, v2;
      for (int64_t e = 0; e < c.experts; ++e) {
        pack_weight(*kern, w13.data() + e * 2 * c.inter * c.h, 2 * c.inter, c.h, c.h, p13.data() + e * b13, serial_for);
        pack_weight(*kern, w2.data() + e * c.h * c.inter, c.h, c.inter, c.inter, p2.data() + e * b2, serial_for);
        v13.push_back(view_packed_weight(p13.data() + e * b13, b13, "w13"));
        v2.push_back(view_packed_weight(p2.data() + e * b2, b2, "w2"));
      }
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
                    " differs from the scalar implementation\n",
                    kern->name, c.m, c.h, c.inter, c.experts, c.topk);
      }
    }
  }
  std::printf("  MoE: %zu cases x %zu variants, %d differ from the scalar implementation\n",
              sizeof cases / sizeof cases[0], kernels.size(), failures);
  return failures;
}

}  // namespace w8a8_cpu
