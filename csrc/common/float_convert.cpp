// Portable float <-> bf16/fp16 conversions (no F16C / FEAT_FP16 / BFCVT needed), round to nearest even.
#include <cstring>

#include "microkernel.h"

namespace w8a8_cpu {
namespace {
uint32_t bits_of(float v) {
  uint32_t b;
  std::memcpy(&b, &v, 4);
  return b;
}
float float_of(uint32_t b) {
  float v;
  std::memcpy(&v, &b, 4);
  return v;
}
}  // namespace

uint16_t float_to_bf16_bits(float v) {
  const uint32_t b = bits_of(v);
  if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40);  // quiet NaN
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

uint16_t float_to_f16_bits(float v) {
  uint32_t f = bits_of(v);
  const uint32_t sign = f & 0x80000000u;
  f ^= sign;
  uint32_t h;
  if (f >= (127u + 16u) << 23) {  // >= 65536, Inf or NaN
    h = f > 0x7f800000u ? 0x7e00u : 0x7c00u;
  } else if (f < 113u << 23) {  // below 2^-14: fp16 subnormal or zero; let the FP adder round
    const float magic = float_of(((127u - 15u) + (23u - 10u) + 1u) << 23);
    h = bits_of(float_of(f) + magic) - bits_of(magic);
  } else {  // normal: rebias exponent, round mantissa to nearest even (may carry into Inf)
    f += ((15u - 127u) << 23) + 0xfffu + ((f >> 13) & 1u);
    h = f >> 13;
  }
  return static_cast<uint16_t>(h | (sign >> 16));
}

float bf16_bits_to_float(uint16_t h) { return float_of(uint32_t{h} << 16); }

float f16_bits_to_float(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0x1f) return float_of(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    const float v = static_cast<float>(mant) * float_of(103u << 23);  // mant * 2^-24, exact
    return sign ? -v : v;
  }
  return float_of(sign | ((exp + 112u) << 23) | (mant << 13));
}

float load_as_float(const void* x, FloatKind kind, int64_t i) {
  switch (kind) {
    case FloatKind::f32: return static_cast<const float*>(x)[i];
    case FloatKind::bf16: return bf16_bits_to_float(static_cast<const uint16_t*>(x)[i]);
    case FloatKind::f16: return f16_bits_to_float(static_cast<const uint16_t*>(x)[i]);
  }
  return 0.f;
}

void store_row_from_float(void* y, FloatKind kind, const float* v, int64_t n) {
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
