// The attention ops: causal_attention (a prompt's) and decode_attention_ (one decode position's over a KV cache of
// fp32, fp16 or int8 rows, writing the caches).
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "binding_checks.h"
#include "layer_ops.h"
#include "registry.h"
#include "scratch_buffer.h"
#include "torch_ops.h"

namespace w8a8_cpu {

namespace {

// Query positions per block of causal_attention: a block's scores [positions x query heads of a KV head, keys] stay in
// L2 (64 KiB a position group at 512 keys).
constexpr int64_t kAttentionBlock = 32;

// A [rows, cols] fp32 matrix over raw memory with row stride ld (the attention's blocks, views for at::mm_out).
at::Tensor float_matrix(const float* data, int64_t rows, int64_t cols, int64_t ld) {
  return at::from_blob(const_cast<float*>(data), {rows, cols}, {ld, 1}, at::TensorOptions().dtype(at::kFloat));
}

}  // namespace

// Causal self-attention of a prompt: q [T, heads, d] (positions 0..T-1), k and v [kv_heads, T, d]; returns
// out [T, heads, d] = softmax(scale q k^T, causal) v per head, the query heads of one KV head sharing it (grouped-
// query attention). Tasks are (KV head, pair of query blocks), a block of positions with the keys up to its last
// position only: about half the work of a masked T x T product, and every task (block b with block B-1-b; the middle
// block alone when B is odd) the same size, so at::parallel_for's equal split of the tasks balances the threads. Its
// GEMMs run inside the parallel region, one thread each, so the bits do not depend on the thread count; a prompt
// that is a single task (one KV head, at most 64 positions) runs on the calling thread, whose at::mm may use
// torch's intra-op threads. Each block: its query rows (scaled) into a contiguous copy, the scores by at::mm (torch's
// fp32 GEMM), the causal softmax's numerators on them in place, at::mm with V, each output row divided by its
// row's softmax sum.
at::Tensor causal_attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  for (const auto& [t, arg] : {std::pair<const at::Tensor&, const char*>{q, "q"}, {k, "k"}, {v, "v"}}) {
    check_cpu(t, arg);
    TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat, arg, ": dtype must be float32, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.dim() == 3 && t.size(2) > 0 && t.stride(2) == 1 && t.stride(1) == t.size(2), arg,
                      ": expected [", std::string(arg) == "q" ? "positions, heads" : "kv_heads, positions",
                      ", head_dim] with contiguous heads (strides [any, head_dim, 1]), got shape ", t.sizes(),
                      " and strides ", t.strides());
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 == 0, arg, ": data must be aligned to 4 bytes");
  }
  const int64_t positions = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k.size(0);
  TORCH_CHECK_VALUE(k.sizes() == v.sizes(), "v: expected the shape of k, ", k.sizes(), ", got ", v.sizes());
  TORCH_CHECK_VALUE(k.size(1) == positions && k.size(2) == d, "k: expected [kv_heads, ", positions, ", ", d,
                    "] (q's positions and head_dim), got ", k.sizes());
  TORCH_CHECK_VALUE(heads > 0, "q: expected at least one head, got shape ", q.sizes());
  TORCH_CHECK_VALUE(kv_heads > 0 && heads % kv_heads == 0, "k: kv_heads (dim 0) must divide q's ", heads,
                    " heads, got ", kv_heads);
  TORCH_CHECK_VALUE(std::fabs(scale) <= std::numeric_limits<float>::max(), "scale: expected a finite float32 value, "
                    "got ", scale);
  auto out = at::empty({positions, heads, d}, q.options());
  const int64_t group = heads / kv_heads, blocks = (positions + kAttentionBlock - 1) / kAttentionBlock;
  const int64_t pairs = (blocks + 1) / 2, rows_max = kAttentionBlock * group;
  const auto* qp = q.data_ptr<float>();
  auto* op = out.data_ptr<float>();
  const MicroKernel& kernel = active_kernel();
  at::parallel_for(0, kv_heads * pairs, 1, [&](int64_t task0, int64_t task1) {
    std::vector<float> query(rows_max * d), scores(rows_max * positions), result(rows_max * d), sums(rows_max);
    for (int64_t task = task0; task < task1; ++task) {
      const int64_t g = task / pairs, pair = task % pairs;
      const float* kg = k.data_ptr<float>() + g * k.stride(0);
      const float* vg = v.data_ptr<float>() + g * v.stride(0);
      const int64_t pair_blocks[2] = {pair, blocks - 1 - pair};  // one block when blocks is odd: the middle one
      for (int which = 0; which < (pair_blocks[0] == pair_blocks[1] ? 1 : 2); ++which) {
        const int64_t b = pair_blocks[which];
        const int64_t p0 = b * kAttentionBlock, count = std::min(kAttentionBlock, positions - p0);
        const int64_t keys = p0 + count, rows = count * group;
        // row (i, j): position p0 + i, query head g * group + j
        for (int64_t i = 0; i < count; ++i) {
          const float* src = qp + (p0 + i) * q.stride(0) + g * group * d;
          for (int64_t e = 0; e < group * d; ++e) query[i * group * d + e] = src[e] * static_cast<float>(scale);
        }
        at::Tensor s = float_matrix(scores.data(), rows, keys, keys);
        at::mm_out(s, float_matrix(query.data(), rows, d, d), float_matrix(kg, keys, d, d).t());
        for (int64_t r = 0; r < rows; ++r)
          sums[r] = softmax_numerators(kernel, scores.data() + r * keys, p0 + r / group + 1, keys);
        at::Tensor o = float_matrix(result.data(), rows, d, d);
        at::mm_out(o, s, float_matrix(vg, keys, d, d));
        // row r (position p0 + r / group, head g * group + r % group) divided by its softmax sum
        for (int64_t r = 0; r < rows; ++r) {
          const float inv = 1.f / sums[r];
          float* dst = op + ((p0 + r / group) * heads + g * group + r % group) * d;
          for (int64_t e = 0; e < d; ++e) dst[e] = result[r * d + e] * inv;
        }
      }
    }
  });
  return out;
}

namespace {

// The KV cache's storage from a cache's dtype (fp32, fp16, int8: KvKind), naming arg otherwise.
KvKind kv_kind(at::ScalarType dtype, const char* arg) {
  if (dtype == at::kFloat) return KvKind::f32;
  if (dtype == at::kHalf) return KvKind::f16;
  TORCH_CHECK_VALUE(dtype == at::kChar, arg, ": dtype must be float32, float16 or int8 (the KV cache's storage), got ",
                    dtype);
  return KvKind::i8;
}

}  // namespace

// One decode step's attention, the position after those cached: qkv [heads + 2 kv_heads, d] fp32 is this position's
// query heads (rotated), key heads (rotated) and value heads, as the fused q/k/v GEMM and the rotary op leave them;
// k_cache and v_cache [kv_heads, length, d] of fp32, fp16 or int8 (then k_scale and v_scale [kv_heads, length] fp32,
// a row's scale). Stores the key and value heads at `position` of the caches (store_kv_row: fp16 rounded, int8 by the
// per-token rule), then returns out [heads, d]: per query head h, softmax(scale q_h . k[0..position]) v[0..position]
// of KV head h / (heads / kv_heads) (grouped-query attention) over the cache as stored, by decode_attention's rule
// (layer_ops.h: the same bits whatever the variant or thread count). One call instead of the cache writes, views and
// scaled_dot_product_attention of a Python step (~40 us a layer at SmolLM2's size, ~7% of its decode).
at::Tensor decode_attention_op(const at::Tensor& qkv, at::Tensor& k_cache, at::Tensor& v_cache, int64_t position,
                               int64_t heads, double scale, const c10::optional<at::Tensor>& k_scale,
                               const c10::optional<at::Tensor>& v_scale) {
  for (const auto& [t, arg] : {std::pair<const at::Tensor&, const char*>{qkv, "qkv"}, {k_cache, "k_cache"},
                               {v_cache, "v_cache"}})
    check_cpu(t, arg);
  TORCH_CHECK_VALUE(qkv.scalar_type() == at::kFloat, "qkv: dtype must be float32, got ", qkv.scalar_type());
  const KvKind kind = kv_kind(k_cache.scalar_type(), "k_cache");
  TORCH_CHECK_VALUE(v_cache.scalar_type() == k_cache.scalar_type(), "v_cache: expected the dtype of k_cache, ",
                    k_cache.scalar_type(), ", got ", v_cache.scalar_type());
  for (const auto& [t, arg] : {std::pair<const at::Tensor&, const char*>{qkv, "qkv"}, {k_cache, "k_cache"},
                               {v_cache, "v_cache"}}) {
    TORCH_CHECK_VALUE(t.is_contiguous() && t.numel() > 0, arg, ": expected a non-empty contiguous tensor, got shape ",
                      t.sizes(), " and strides ", t.strides());
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t.data_ptr()) % t.element_size() == 0, arg,
                      ": data must be aligned to its element size");
  }
  TORCH_CHECK_VALUE(k_cache.dim() == 3 && k_cache.size(2) <= kMaxHeadDim, "k_cache: expected [kv_heads, length, "
                    "head_dim] with head_dim <= ", kMaxHeadDim, ", got shape ", k_cache.sizes());
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), "v_cache: expected the shape of k_cache, ", k_cache.sizes(),
                    ", got ", v_cache.sizes());
  const int64_t kv_heads = k_cache.size(0), length = k_cache.size(1), d = k_cache.size(2);
  const at::Tensor* written[5] = {&qkv, &k_cache, &v_cache};  // and the scales: none may overlap another
  int operands = 3;
  for (const auto& [t, arg] : {std::pair<const c10::optional<at::Tensor>&, const char*>{k_scale, "k_scale"},
                               {v_scale, "v_scale"}}) {
    TORCH_CHECK_VALUE(kind == KvKind::i8 || !t.has_value(), arg, ": only an int8 cache has scales, got one with a ",
                      k_cache.scalar_type(), " cache");
    if (kind != KvKind::i8) continue;
    TORCH_CHECK_VALUE(t.has_value() && t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == kv_heads &&
                          t->size(1) == length && t->is_contiguous(),
                      arg, ": an int8 cache needs a contiguous float32 [", kv_heads, ", ", length,
                      "] scale per row (kv_heads, length), got ",
                      t.has_value() ? std::string(c10::toString(t->scalar_type())) + " of shape " +
                                          c10::str(t->sizes())
                                    : std::string("None"));
    check_cpu(*t, arg);
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t->data_ptr()) % 4 == 0, arg, ": data must be aligned to 4 bytes");
    written[operands++] = &*t;
  }
  TORCH_CHECK_VALUE(heads >= 1 && heads % kv_heads == 0 && heads <= std::numeric_limits<int32_t>::max(),
                    "heads: expected a positive multiple of the caches' ", kv_heads, " KV heads, got ", heads);
  TORCH_CHECK_VALUE(qkv.dim() == 2 && qkv.size(0) == heads + 2 * kv_heads && qkv.size(1) == d, "qkv: expected [",
                    heads + 2 * kv_heads, ", ", d, "] (", heads, " query, ", kv_heads, " key and ", kv_heads,
                    " value heads of the caches' head_dim), got ", qkv.sizes());
  TORCH_CHECK_VALUE(position >= 0 && position < length, "position: expected 0 <= position < ", length,
                    " (the caches' length), got ", position);
  TORCH_CHECK_VALUE(std::fabs(scale) <= std::numeric_limits<float>::max(), "scale: expected a finite float32 value, "
                    "got ", scale);
  for (int i = 0; i < operands; ++i)
    for (int j = i + 1; j < operands; ++j)
      TORCH_CHECK_VALUE(at::get_overlap_status(*written[i], *written[j]) == at::MemOverlapStatus::No,
                        "k_cache, v_cache, k_scale, v_scale: must not overlap each other or qkv (the caches are "
                        "written in place)");
  const float* rows = qkv.data_ptr<float>();
  float* k_scales = kind == KvKind::i8 ? k_scale->data_ptr<float>() : nullptr;
  float* v_scales = kind == KvKind::i8 ? v_scale->data_ptr<float>() : nullptr;
  const MicroKernel& kernel = active_kernel();
  for (int64_t g = 0; g < kv_heads; ++g) {
    const int64_t row = g * length + position;
    store_kv_row(kernel, rows + (heads + g) * d, d, kind, k_cache.data_ptr(), k_scales, row);
    store_kv_row(kernel, rows + (heads + kv_heads + g) * d, d, kind, v_cache.data_ptr(), v_scales, row);
  }
  auto out = at::empty({heads, d}, qkv.options());
  const int64_t keys = position + 1;
  const at::Tensor scratch = scratch_buffer(decode_attention_scratch_floats(heads, keys, d) * 4);
  const KvRows cache{k_cache.data_ptr(), v_cache.data_ptr(), k_scales, v_scales, kind};
  decode_attention(kernel, rows, heads, cache, kv_heads, length, keys, d, static_cast<float>(scale),
                   static_cast<float*>(scratch.data_ptr()), out.data_ptr<float>(), torch_parallel_for());
  return out;
}

}  // namespace w8a8_cpu
