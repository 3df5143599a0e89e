// silu(gate) * up: the one definition of the gated MLPs' activation (gated_linear, the fused MoE). `static` (as
// microkernel.h's helpers): the driver and each ISA-flagged variant TU compile their own copy, which the compiler
// vectorizes with that TU's ISA (SmolLM2's prefill: 512 x 1536 elements a layer, 1.0 ms with the baseline ISA,
// 0.24 ms with AVX-512). Plain IEEE operations in a fixed order, no library call and no FMA (-ffp-contract=off):
// every copy gives the same bits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace w8a8_cpu {

// exp(x) for x in [-87, 88] without a library call, so the loop below vectorizes:
// x = n ln2 + r, |r| <= ln2/2, exp(r) by a degree-6 polynomial (rel. error < 2e-7), 2^n via the exponent bits.
// n is rounded by adding and subtracting 1.5 * 2^23 (plain IEEE adds, no rounding instruction needed).
static inline float exp_poly(float x) {
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

// gate[j] = silu(gate[j]) * up[j] for j < n, in place.
static void silu_mul_row(float* gate, const float* up, int64_t n) {
  for (int64_t j = 0; j < n; ++j) gate[j] = gate[j] / (1.f + exp_poly(-gate[j])) * up[j];
}

}  // namespace w8a8_cpu
