#include "layer_ops.h"

#include <algorithm>
#include <cmath>

#include "activation.h"

namespace w8a8_cpu {

namespace {

// Elements [0, n) of a bf16 / fp16 row into fp32 (fp32 rows are used in place).
void load_row_as_float(const void* x, FloatKind kind, int64_t n, float* v) {
  for (int64_t i = 0; i < n; ++i) v[i] = load_as_float(x, kind, i);
}

}  // namespace

void rms_norm_row(const void* x, const void* delta, void* sum_out, FloatKind kind, const float* weight, float eps,
                  int64_t n, void* y) {
  // fp32 rows are read and written in place; other kinds through an fp32 copy.
  float copy[kMaxNormRow];
  const float* v = static_cast<const float*>(delta ? sum_out : x);
  if (kind != FloatKind::f32) {
    load_row_as_float(x, kind, n, copy);
    if (delta) {
      for (int64_t i = 0; i < n; ++i) copy[i] += load_as_float(delta, kind, i);
      store_row_from_float(sum_out, kind, copy, n);
      load_row_as_float(sum_out, kind, n, copy);  // the norm reads the stream as stored
    }
    v = copy;
  } else if (delta) {
    const auto* a = static_cast<const float*>(x);
    const auto* b = static_cast<const float*>(delta);
    auto* sum = static_cast<float*>(sum_out);
    for (int64_t i = 0; i < n; ++i) sum[i] = a[i] + b[i];
  }
  const float inv = 1.f / std::sqrt(lane_dot(v, v, n) / static_cast<float>(n) + eps);
  float* out = kind == FloatKind::f32 ? static_cast<float*>(y) : copy;
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (v[i] * inv);
  if (out != y) store_row_from_float(y, kind, out, n);
}

void rotary_row(void* x, FloatKind kind, int64_t heads, int64_t d, const float* cos, const float* sin) {
  // fp32 heads are rotated in place; other kinds through an fp32 copy of the head.
  float copy[kMaxHeadDim];
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    void* head = static_cast<char*>(x) + h * d * element_bytes(kind);
    float* v = kind == FloatKind::f32 ? static_cast<float*>(head) : copy;
    if (v == copy) load_row_as_float(head, kind, d, copy);
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = v[i], x2 = v[i + half];
      v[i] = x1 * cos[i] + (-x2) * sin[i];
      v[i + half] = x2 * cos[i + half] + x1 * sin[i + half];
    }
    if (v == copy) store_row_from_float(head, kind, copy, d);
  }
}

void attend_one_position(const MicroKernel& kernel, const float* q, const float* k, const float* v, int64_t keys,
                         int64_t d, float scale, float* scores, float* out) {
  (kernel.attend_one_position ? kernel.attend_one_position : attend_one_position_row)(q, k, v, keys, d, scale, scores,
                                                                                     out);
}

float softmax_numerators(const MicroKernel& kernel, float* s, int64_t len, int64_t n) {
  return (kernel.softmax_numerators ? kernel.softmax_numerators : softmax_numerators_row)(s, len, n);
}

}  // namespace w8a8_cpu
