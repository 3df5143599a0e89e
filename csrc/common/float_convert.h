// Float <-> bf16 / fp16 conversions, round to nearest even, portable (no F16C / FEAT_FP16 / BFCVT needed): the one
// rule for every output row, cached K/V row and stored scale. Written as selects, not branches, and `static`: each TU
// (ISA-flagged variant TUs included) compiles its own copy and the compiler vectorizes the row loops with that TU's
// ISA; no TU's ISA can leak into another through a shared inline definition. (Out of line, a call an element: GEMMs
// with bf16 outputs took 1.25x, fp16 1.6x the time of fp32 outputs at M = 32..128, K = 576.)
#pragma once

#include <cstdint>
#include <cstring>

#include "microkernel.h"

namespace w8a8_cpu {

static inline uint32_t bits_of_float(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b;
}
static inline float float_of_bits(uint32_t b) {
  float v;
  std::memcpy(&v, &b, 4);
  return v;
}

// Round to nearest even; NaN stays NaN (quiet, its sign and top payload bits kept).
static inline uint16_t float_to_bf16_bits(float v) {
  const uint32_t b = bits_of_float(v);
  const uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (b >> 16) | 0x40u;
  return static_cast<uint16_t>((b & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// Round to nearest even; overflow -> Inf, NaN -> the quiet NaN 0x7e00 (with v's sign). The three cases are all
// computed and one is chosen.
static inline uint16_t float_to_f16_bits(float v) {
  const uint32_t all = bits_of_float(v);
  const uint32_t sign = all & 0x80000000u, f = all ^ sign;
  // >= 65536, Inf or NaN
  const uint32_t special = f > 0x7f800000u ? 0x7e00u : 0x7c00u;
  // below 2^-14: an fp16 subnormal or zero, rounded by the FP adder
  const float magic = float_of_bits(((127u - 15u) + (23u - 10u) + 1u) << 23);
  const uint32_t small = bits_of_float(float_of_bits(f) + magic) - bits_of_float(magic);
  // normal: exponent rebiased, mantissa rounded to nearest even (may carry into Inf)
  const uint32_t normal = (f + ((15u - 127u) << 23) + 0xfffu + ((f >> 13) & 1u)) >> 13;
  const uint32_t h = f >= (127u + 16u) << 23 ? special : f < 113u << 23 ? small : normal;
  return static_cast<uint16_t>(h | (sign >> 16));
}

static inline float bf16_bits_to_float(uint16_t h) { return float_of_bits(uint32_t{h} << 16); }

static inline float f16_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0x1f) return float_of_bits(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    const float v = static_cast<float>(mant) * float_of_bits(103u << 23);  // mant * 2^-24, exact
    return sign ? -v : v;
  }
  return float_of_bits(sign | ((exp + 112u) << 23) | (mant << 13));
}

static inline float load_as_float(const void* x, FloatKind kind, int64_t i) {
  switch (kind) {
    case FloatKind::f32: return static_cast<const float*>(x)[i];
    case FloatKind::bf16: return bf16_bits_to_float(static_cast<const uint16_t*>(x)[i]);
    case FloatKind::f16: return f16_bits_to_float(static_cast<const uint16_t*>(x)[i]);
  }
  return 0.f;
}

// y[i] = v[i] for i < n in `kind`: one dispatch per row, loops the compiler vectorizes.
static inline void store_row_from_float(void* y, FloatKind kind, const float* v, int64_t n) {
  switch (kind) {
    case FloatKind::f32: std::memcpy(y, v, static_cast<size_t>(n) * 4); break;
    case FloatKind::bf16: {
      auto* out = static_cast<uint16_t*>(y);
      for (int64_t i = 0; i < n; ++i) out[i] = float_to_bf16_bits(v[i]);
      break;
    }
    case FloatKind::f16: {
      auto* out = static_cast<uint16_t*>(y);
      for (int64_t i = 0; i < n; ++i) out[i] = float_to_f16_bits(v[i]);
      break;
    }
  }
}

}  // namespace w8a8_cpu
