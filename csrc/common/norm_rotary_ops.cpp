// The layer ops between a decoder layer's GEMMs (layer_ops.h): rms_norm, add_rms_norm_ and rotary_embedding_, rows of
// x [..., N], one row per task of at::parallel_for.
#include "norm_rotary_ops.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <utility>

#include "binding_checks.h"
#include "layer_ops.h"
#include "torch_ops.h"

namespace w8a8_cpu {

namespace {

// x [..., N] for a layer op: a CPU float tensor, contiguous (read as rows, or written in place); returns N.
int64_t layer_row_length(const at::Tensor& x, const char* arg, int64_t max_n) {
  check_cpu(x, arg);
  float_kind(x.scalar_type(), arg);
  TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(-1) > 0, arg, ": expected a tensor [..., N] with N > 0, got shape ",
                    x.sizes());
  TORCH_CHECK_VALUE(x.is_contiguous(), arg, ": must be contiguous, got strides ", x.strides(),
                    "; call .contiguous() first");
  TORCH_CHECK_VALUE(x.size(-1) <= max_n, arg, ": last dimension ", x.size(-1), " exceeds ", max_n,
                    ", the longest row the layer ops take");
  return x.size(-1);
}

// Rows [0, m) of n elements each through body(r), in chunks of about 16384 elements (decode's single row: inline).
void for_each_row(int64_t m, int64_t n, const std::function<void(int64_t)>& body) {
  at::parallel_for(0, m, std::max<int64_t>(1, 16384 / n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) body(r);
  });
}

}  // namespace

at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor* delta, const at::Tensor& weight, double eps) {
  const int64_t n = layer_row_length(x, "x", kMaxNormRow);
  if (delta) {
    layer_row_length(*delta, "delta", kMaxNormRow);
    TORCH_CHECK_VALUE(delta->sizes() == x.sizes() && delta->scalar_type() == x.scalar_type(),
                      "delta: expected the shape and dtype of x, ", x.sizes(), " ", x.scalar_type(), ", got ",
                      delta->sizes(), " ", delta->scalar_type());
    // x is written row by row while delta is read: delta may be x itself, not a shifted view of it
    TORCH_CHECK_VALUE(at::get_overlap_status(x, *delta) != at::MemOverlapStatus::Partial,
                      "delta: overlaps x in part (x is updated in place); pass a copy");
  }
  check_cpu(weight, "weight");
  float_kind(weight.scalar_type(), "weight");
  TORCH_CHECK_VALUE(weight.dim() == 1 && weight.size(0) == n, "weight: expected shape [", n,
                    "] (the last dimension of x), got ", weight.sizes());
  // A contiguous fp32 weight is read in place, by every thread, while the rows of x are written: one overlapping x
  // gave outputs that depended on the thread count. (Any other weight is copied to fp32 first: no overlap possible;
  // for it get_overlap_status would also answer TooHard.)
  TORCH_CHECK_VALUE(!delta || weight.scalar_type() != at::kFloat || !weight.is_contiguous() ||
                        at::get_overlap_status(x, weight) == at::MemOverlapStatus::No,
                    "weight: overlaps x (x is updated in place); pass a copy");
  TORCH_CHECK_VALUE(eps >= 0 && eps <= std::numeric_limits<float>::max(), "eps: expected a finite float32 value >= 0, "
                    "got ", eps);
  const at::Tensor w = aligned(weight.to(at::kFloat).contiguous());
  const at::Tensor xs = aligned(x), ds = delta ? aligned(*delta) : at::Tensor();
  const FloatKind kind = float_kind(x.scalar_type(), "x");
  const int64_t bytes = element_bytes(kind);
  auto out = at::empty_like(xs);
  const auto* src = static_cast<const char*>(xs.data_ptr());
  auto* dst = static_cast<char*>(out.data_ptr());
  for_each_row(xs.numel() / n, n, [&](int64_t r) {
    const int64_t at = r * n * bytes;
    const bool add = delta != nullptr;
    rms_norm_row(src + at, add ? static_cast<const char*>(ds.data_ptr()) + at : nullptr,
                 add ? const_cast<char*>(src) + at : nullptr, kind, w.data_ptr<float>(), static_cast<float>(eps), n,
                 dst + at);
  });
  if (delta && !xs.is_same(x)) x.copy_(xs);  // x was not aligned: the sums went to the copy
  return out;
}

at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm_rows(x, nullptr, weight, eps);
}

// x += delta (in place: the residual stream), then RMSNorm of the sum.
at::Tensor add_rms_norm_op(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  return rms_norm_rows(x, &delta, weight, eps);
}

void rotary_embedding_op(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads) {
  const int64_t n = layer_row_length(x, "x", std::numeric_limits<int64_t>::max());
  for (const auto& [t, arg] : {std::pair<const at::Tensor&, const char*>{cos, "cos"}, {sin, "sin"}}) {
    check_cpu(t, arg);
    TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat, arg, ": dtype must be float32, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.dim() == 2 && t.is_contiguous(), arg, ": expected a contiguous [positions, head_dim] "
                      "tensor, got shape ", t.sizes(), " and strides ", t.strides());
  }
  TORCH_CHECK_VALUE(sin.sizes() == cos.sizes(), "sin: expected the shape of cos, ", cos.sizes(), ", got ",
                    sin.sizes());
  const int64_t positions = cos.size(0), d = cos.size(1);
  TORCH_CHECK_VALUE(d >= 2 && d % 2 == 0 && d <= kMaxHeadDim, "cos: head_dim (dim 1) must be even and in [2, ",
                    kMaxHeadDim, "], got ", d);
  TORCH_CHECK_VALUE(positions == x.numel() / n, "cos: expected one row per row of x (", x.numel() / n,
                    " positions), got ", positions);
  TORCH_CHECK_VALUE(heads >= 1 && heads <= n / d, "heads: expected 1 <= heads <= ", n / d, " (heads of ", d,
                    " in a row of ", n, "), got ", heads);
  for (const auto& [t, arg] : {std::pair<const at::Tensor&, const char*>{cos, "cos"}, {sin, "sin"}})
    TORCH_CHECK_VALUE(at::get_overlap_status(x, t) == at::MemOverlapStatus::No, arg,
                      ": overlaps x (x is rotated in place); pass a copy");
  const at::Tensor c = aligned(cos), s = aligned(sin);
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(x.data_ptr()) % x.element_size() == 0,
                    "x: data must be aligned to its element size (rotated in place)");
  const FloatKind kind = float_kind(x.scalar_type(), "x");
  auto* rows = static_cast<char*>(x.data_ptr());
  for_each_row(positions, heads * d, [&](int64_t r) {
    rotary_row(rows + r * n * element_bytes(kind), kind, heads, d, c.data_ptr<float>() + r * d,
               s.data_ptr<float>() + r * d);
  });
}

}  // namespace w8a8_cpu
