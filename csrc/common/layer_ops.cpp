#include "layer_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "activation.h"
#include "float_convert.h"
#include "gemm_driver.h"

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

int64_t decode_attention_scratch_floats(int64_t heads, int64_t keys, int64_t d) {
  const int64_t blocks = (keys + kDecodeKeyBlock - 1) / kDecodeKeyBlock;
  return heads * blocks * (d + 2);
}

// Multiply-adds (keys x head_dim) per region of the decode attention below which it runs on the calling thread
// (at::parallel_for's start costs more than their arithmetic).
constexpr int64_t kDecodeAttentionGrain = 1 << 15;

void decode_attention(const MicroKernel& kernel, const float* q, int64_t heads, const KvRows& cache, int64_t kv_heads,
                      int64_t length, int64_t keys, int64_t d, float scale, float* scratch, float* out,
                      const ParallelFor& parallel_for) {
  const auto attend_block = kernel.attend_key_block ? kernel.attend_key_block : attend_key_block_row;
  const int64_t group = heads / kv_heads, blocks = (keys + kDecodeKeyBlock - 1) / kDecodeKeyBlock;
  // head h's block b: o at partials[(h * blocks + b) * d], m and l at maxes / sums[h * blocks + b]
  float* partials = scratch;
  float* maxes = partials + heads * blocks * d;
  float* sums = maxes + heads * blocks;
  const int64_t task_work = std::min(keys, kDecodeKeyBlock) * d * group;
  parallel_for(0, kv_heads * blocks, std::max<int64_t>(1, kDecodeAttentionGrain / task_work), [&](int64_t t0,
                                                                                                  int64_t t1) {
    alignas(64) float queries[kMaxAttendHeads * kMaxHeadDim];
    alignas(64) float scores[kMaxAttendHeads * kDecodeKeyBlock];
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t g = task / blocks, b = task % blocks, j0 = b * kDecodeKeyBlock;
      const KvRows rows = kv_rows_from(cache, g * length + j0, d);
      for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += kMaxAttendHeads) {  // the group's heads share the rows
        const int n = static_cast<int>(std::min<int64_t>(kMaxAttendHeads, (g + 1) * group - h0));
        for (int64_t e = 0; e < n * d; ++e) queries[e] = q[h0 * d + e] * scale;
        const int64_t slot = h0 * blocks + b;
        attend_block(queries, n, rows, std::min(kDecodeKeyBlock, keys - j0), d, scores,
                     {partials + slot * d, blocks * d, maxes + slot, sums + slot, blocks});
      }
    }
  });
  parallel_for(0, heads, std::max<int64_t>(1, kDecodeAttentionGrain / (blocks * d)), [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h)
      combine_key_blocks(partials + h * blocks * d, maxes + h * blocks, sums + h * blocks, blocks, d, out + h * d);
  });
}

void store_kv_row(const MicroKernel& kernel, const float* x, int64_t d, KvKind kind, void* rows, float* scales,
                  int64_t j) {
  void* row = static_cast<char*>(rows) + j * d * kv_element_bytes(kind);
  if (kind == KvKind::f32) {
    std::memcpy(row, x, static_cast<size_t>(d) * 4);
  } else if (kind == KvKind::f16) {
    store_row_from_float(row, FloatKind::f16, x, d);
  } else {
    quantize_rows(kernel, x, FloatKind::f32, 1, d, d, static_cast<int8_t*>(row), d, scales + j, serial_for);
  }
}

float softmax_numerators(const MicroKernel& kernel, float* s, int64_t len, int64_t n) {
  return (kernel.softmax_numerators ? kernel.softmax_numerators : softmax_numerators_row)(s, len, n);
}

}  // namespace w8a8_cpu
