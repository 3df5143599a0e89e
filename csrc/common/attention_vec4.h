// The decode attention's key block (attention_key_block.h) for 128-bit vector ISAs, in GCC's generic vectors of 4
// floats: one source that compiles to NEON in neon.cpp and to VSX in vsx.cpp (their baseline TUs; the dotprod / i8mm
// and MMA variants use those). In an unnamed namespace, as `static` elsewhere: each TU that includes it keeps its own
// copy, in its own ISA.
#pragma once

#include <cstdint>
#include <cstring>

#include "attention_key_block.h"
#include "float_convert.h"
#include "microkernel.h"

namespace w8a8_cpu {
namespace {

typedef float Float4 __attribute__((vector_size(16)));
typedef int8_t Int8x4 __attribute__((vector_size(4)));

// attention_key_block.h's vector operations.
struct Vec4Ops {
  using Vec = Float4;
  static constexpr int kWidth = 4;
  static constexpr int kRegisters = 32;  // NEON; VSX has 64

  static Vec zero() { return Vec{}; }
  static Vec load(const float* at) {
    Vec v;
    std::memcpy(&v, at, sizeof v);
    return v;
  }
  // Elements [i, i + 4) of a cached row of `Kind` as fp32 (exact; fp16 widened one by one).
  template <KvKind Kind>
  static Vec load_kv(const void* row, int64_t i) {
    if constexpr (Kind == KvKind::f32) return load(static_cast<const float*>(row) + i);
    if constexpr (Kind == KvKind::i8) {
      Int8x4 q;
      std::memcpy(&q, static_cast<const int8_t*>(row) + i, sizeof q);
      return __builtin_convertvector(q, Vec);
    }
    if constexpr (Kind == KvKind::f16) {
      const auto* h = static_cast<const uint16_t*>(row) + i;
      return Vec{f16_bits_to_float(h[0]), f16_bits_to_float(h[1]), f16_bits_to_float(h[2]), f16_bits_to_float(h[3])};
    }
  }
  static Vec set1(float w) { return Vec{w, w, w, w}; }
  static Vec add(Vec a, Vec b) { return a + b; }
  static Vec mul(Vec a, Vec b) { return a * b; }
  static void store(float* at, Vec v) { std::memcpy(at, &v, sizeof v); }
  // 4 x 4 floats transposed: r[i] lane j <- r[j] lane i.
  static void transpose(Vec r[4]) {
    const Vec t0 = __builtin_shufflevector(r[0], r[1], 0, 4, 1, 5);
    const Vec t1 = __builtin_shufflevector(r[0], r[1], 2, 6, 3, 7);
    const Vec t2 = __builtin_shufflevector(r[2], r[3], 0, 4, 1, 5);
    const Vec t3 = __builtin_shufflevector(r[2], r[3], 2, 6, 3, 7);
    r[0] = __builtin_shufflevector(t0, t2, 0, 1, 4, 5), r[1] = __builtin_shufflevector(t0, t2, 2, 3, 6, 7);
    r[2] = __builtin_shufflevector(t1, t3, 0, 1, 4, 5), r[3] = __builtin_shufflevector(t1, t3, 2, 3, 6, 7);
  }
};

}  // namespace
}  // namespace w8a8_cpu
