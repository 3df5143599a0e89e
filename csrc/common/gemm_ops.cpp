// The GEMM ops: per_token_quant_int8, int8_mm, scale_accumulators, int8_scaled_mm and the fused linear ops
// (int8_scaled_mm_with_quant, int8_gated_mm_with_quant), on gemm_driver.h.
#include "gemm_ops.h"

#include <vector>

#include "binding_checks.h"
#include "gemm_driver.h"
#include "packed_weight_ops.h"
#include "registry.h"
#include "scratch_buffer.h"
#include "torch_ops.h"

namespace w8a8_cpu {

namespace {

at::Tensor checked_bias(const c10::optional<at::Tensor>& bias, int64_t n) {
  if (!bias) return {};
  check_cpu(*bias, "bias");
  float_kind(bias->scalar_type(), "bias");
  TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == n, "bias: expected shape [", n, "], got ", bias->sizes());
  return aligned(bias->to(at::kFloat).contiguous());
}

// A GEMM op's weight operand, checked: its packed view (a raw int8 [N, K] weight is packed into `storage` for this
// call) and, for ops with an epilogue, the per-output-channel scales and the bias as contiguous fp32.
struct WeightOperand {
  at::Tensor storage;  // declared before view: weight_view fills it first
  PackedWeightView view;
  at::Tensor scales, bias;

  WeightOperand(const at::Tensor& w, int64_t k) : view(weight_view(w, k, storage)) {}
  WeightOperand(const at::Tensor& w, int64_t k, const at::Tensor& w_scale, const c10::optional<at::Tensor>& b)
      : WeightOperand(w, k) {
    scales = checked_scales(w_scale, n(), "w_scale", "output channel");
    bias = checked_bias(b, n());
    check_finite_weight_side(scales, "w_scale");
    if (bias.defined()) check_finite_weight_side(bias, "bias");
  }
  int64_t n() const { return view.header.n; }
};

// The epilogue's operands for `out` [M, N] (row scales may be null where linear() computes them itself).
GemmOutput epilogue(const float* x_scales, const at::Tensor& w_scales, const at::Tensor& bias, at::Tensor& out,
                    FloatKind out_kind) {
  return {x_scales, w_scales.data_ptr<float>(), bias.defined() ? bias.data_ptr<float>() : nullptr, out.data_ptr(),
          out_kind, out.size(1)};
}

// Core: x_q int8 [M, K] (validated) times the weight into a new [M, N] tensor, through the epilogue or, when
// x_scale is undefined, as the raw int32 accumulators.
at::Tensor scaled_mm(const at::Tensor& x_q, const at::Tensor& x_scale, const WeightOperand& w,
                     at::ScalarType out_dtype) {
  const MicroKernel& kernel = active_kernel();
  const bool raw = !x_scale.defined();
  const FloatKind out_kind = raw ? FloatKind::f32 : float_kind(out_dtype, "out_dtype");
  const int64_t m = x_q.size(0);
  auto out = at::empty({m, w.n()}, x_q.options().dtype(raw ? at::kInt : out_dtype));
  if (m == 0) return out;
  const at::Tensor scratch = scratch_buffer(gemm_scratch_nbytes(kernel, m, w.view.header.k_padded));
  GemmOutput o{nullptr, nullptr, nullptr, out.data_ptr(), out_kind, w.n()};
  if (raw) {
    o.raw_int32 = true;
  } else {
    o = epilogue(x_scale.data_ptr<float>(), w.scales, w.bias, out, out_kind);
  }
  as_value_errors([&] {
    gemm(kernel, x_q.data_ptr<int8_t>(), m, x_q.stride(0), w.view, o, scratch.data_ptr(), torch_parallel_for());
    return 0;
  });
  return out;
}

// Per-row absmax given by the caller ([M] or [M, 1] fp32), or undefined.
at::Tensor checked_amax(const c10::optional<at::Tensor>& amax, int64_t m) {
  if (!amax) return {};
  return checked_scales(*amax, m, "amax", "row");
}

std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& x2d, const at::Tensor& amax) {
  const FloatKind kind = float_kind(x2d.scalar_type(), "x");
  const int64_t m = x2d.size(0), k = x2d.size(1);
  auto q = at::empty({m, k}, x2d.options().dtype(at::kChar));
  auto scales = at::empty({m, 1}, x2d.options().dtype(at::kFloat));
  const int64_t bad = as_value_errors([&] {
    return quantize_rows(active_kernel(), x2d.data_ptr(), kind, m, k, x2d.stride(0), q.data_ptr<int8_t>(), k,
                         scales.data_ptr<float>(), torch_parallel_for(), amax.defined() ? amax.data_ptr<float>() : nullptr);
  });
  check_finite_rows(bad, "x");
  return {q, scales};
}

// Activations x [..., K] as a 2-D [M, K] operand.
at::Tensor activation_rows(const at::Tensor& x) {
  check_cpu(x, "x");
  float_kind(x.scalar_type(), "x");
  TORCH_CHECK_VALUE(x.dim() >= 1, "x: expected at least 1 dimension [..., K], got a scalar");
  check_k(x.size(-1), "x");
  TORCH_CHECK_VALUE(x.size(-1) == 1 || x.stride(-1) == 1, "x: last dimension must be contiguous (stride 1), got strides ",
                    x.strides(), "; call .contiguous() first");
  return aligned(x.dim() == 2 ? x : x.reshape({-1, x.size(-1)}));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> per_token_quant_int8_op(const at::Tensor& x, const c10::optional<at::Tensor>& amax) {
  check_cpu(x, "x");
  TORCH_CHECK_VALUE(x.dim() == 2, "x: expected a 2-D [M, K] tensor, got shape ", x.sizes());
  const at::Tensor rows = activation_rows(x);
  return quantize(rows, checked_amax(amax, rows.size(0)));
}

// Exact int32 accumulators x_q . w^T: partial products that callers add (tensor parallelism) before one epilogue.
at::Tensor int8_mm_op(const at::Tensor& x_q, const at::Tensor& w) {
  check_cpu(x_q, "x_q");
  TORCH_CHECK_VALUE(x_q.scalar_type() == at::kChar, "x_q: dtype must be int8, got ", x_q.scalar_type());
  check_rows(x_q, "x_q");
  check_k(x_q.size(1), "x_q");
  return scaled_mm(x_q, at::Tensor(), WeightOperand(w, x_q.size(1)), at::kInt);
}

// The epilogue of int8_scaled_mm on int32 accumulators [M, N] computed elsewhere (int8_mm, then summed): same bits.
at::Tensor scale_accumulators_op(const at::Tensor& acc, const at::Tensor& x_scale, const at::Tensor& w_scale,
                                 const c10::optional<at::Tensor>& bias, c10::optional<at::ScalarType> out_dtype) {
  check_cpu(acc, "acc");
  TORCH_CHECK_VALUE(acc.scalar_type() == at::kInt, "acc: dtype must be int32, got ", acc.scalar_type());
  check_rows(acc, "acc");
  const int64_t m = acc.size(0), n = acc.size(1);
  const FloatKind out_kind = float_kind(out_dtype.value_or(at::kFloat), "out_dtype");
  const at::Tensor xs = checked_scales(x_scale, m, "x_scale", "row of acc");
  const at::Tensor ws = checked_scales(w_scale, n, "w_scale", "output channel");
  check_finite_weight_side(ws, "w_scale");
  const at::Tensor b = checked_bias(bias, n);
  auto out = at::empty({m, n}, acc.options().dtype(out_dtype.value_or(at::kFloat)));
  const at::Tensor acc_rows = aligned(acc);  // (a copy keeps acc's row stride only when it is contiguous)
  scale_accumulators(acc_rows.data_ptr<int32_t>(), m, n, acc_rows.stride(0),
                     epilogue(xs.data_ptr<float>(), ws, b, out, out_kind), torch_parallel_for());
  return out;
}

at::Tensor int8_scaled_mm_op(const at::Tensor& x_q, const at::Tensor& w, const at::Tensor& x_scale,
                             const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias,
                             c10::optional<at::ScalarType> out_dtype) {
  check_cpu(x_q, "x_q");
  TORCH_CHECK_VALUE(x_q.scalar_type() == at::kChar, "x_q: dtype must be int8, got ", x_q.scalar_type());
  check_rows(x_q, "x_q");
  check_k(x_q.size(1), "x_q");
  const at::Tensor xs = checked_scales(x_scale, x_q.size(0), "x_scale", "row of x_q");
  return scaled_mm(x_q, xs, WeightOperand(w, x_q.size(1), w_scale, bias), out_dtype.value_or(at::kFloat));
}

at::Tensor quantized_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                            const c10::optional<at::Tensor>& bias, c10::optional<at::ScalarType> out_dtype,
                            const c10::optional<at::Tensor>& amax, bool gated) {
  const at::Tensor rows = activation_rows(x);
  const FloatKind kind = float_kind(rows.scalar_type(), "x");
  const at::ScalarType dtype = out_dtype.value_or(x.scalar_type());
  const FloatKind out_kind = float_kind(dtype, "out_dtype");
  const MicroKernel& kernel = active_kernel();
  const WeightOperand weight(w, rows.size(1), w_scale, bias);
  const int64_t m = rows.size(0);
  TORCH_CHECK_VALUE(!gated || weight.n() % 2 == 0, "w: the gated linear needs an even number of output channels "
                    "(gate rows, then up rows), got N = ", weight.n());
  const int64_t n = gated ? weight.n() / 2 : weight.n();
  const at::Tensor row_amax = checked_amax(amax, m);
  auto out = at::empty({m, n}, rows.options().dtype(dtype));
  if (m > 0) {
    // Scratch: the per-row scales (a whole number of cache lines), then the driver's.
    const int64_t scales_bytes = round_up(4 * m, 64);
    const PackedWeightHeader& shape = weight.view.header;
    const int64_t groups = weight.view.int4() ? weight.view.groups : 0;  // the activations' int4 group sums
    const int64_t driver_bytes = gated
                                     ? gated_linear_scratch_nbytes(kernel, m, shape.k, shape.k_padded, shape.n, groups)
                                     : linear_scratch_nbytes(kernel, m, shape.k, shape.k_padded, groups);
    const at::Tensor scratch = scratch_buffer(scales_bytes + driver_bytes);
    auto* base = static_cast<uint8_t*>(scratch.data_ptr());
    const int64_t bad = as_value_errors([&] {
      const auto run = gated ? gated_linear : linear;
      return run(kernel, rows.data_ptr(), kind, m, rows.stride(0),
                 row_amax.defined() ? row_amax.data_ptr<float>() : nullptr, weight.view,
                 epilogue(nullptr, weight.scales, weight.bias, out, out_kind), reinterpret_cast<float*>(base),
                 base + scales_bytes, torch_parallel_for());
    });
    check_finite_rows(bad, "x");
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return out.view(shape);
}

at::Tensor int8_scaled_mm_with_quant_op(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                                        const c10::optional<at::Tensor>& bias,
                                        c10::optional<at::ScalarType> out_dtype, const c10::optional<at::Tensor>& amax) {
  return quantized_linear(x, w, w_scale, bias, out_dtype, amax, false);
}

at::Tensor int8_gated_mm_with_quant_op(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                                       const c10::optional<at::Tensor>& bias, c10::optional<at::ScalarType> out_dtype) {
  return quantized_linear(x, w, w_scale, bias, out_dtype, c10::nullopt, true);
}

}  // namespace w8a8_cpu
