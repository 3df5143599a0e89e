// The fused MoE op, fused_experts, on moe_driver.h.
#include <string>
#include <vector>

#include "binding_checks.h"
#include "moe_driver.h"
#include "registry.h"
#include "scratch_buffer.h"
#include "torch_ops.h"
#include "verified_blobs.h"

namespace w8a8_cpu {

namespace {

// Per-expert packed views of an MoE weight: raw int8 [E, n, k] (packed here into `storage` for this call)
// or the output of pack_moe_weights / pack_experts_int4, uint8 [E, bytes] with one packed blob per expert (int8 or
// int4 weights; the driver checks that the experts share one format).
std::vector<PackedWeightView> expert_views(const at::Tensor& w, int64_t experts, int64_t n, int64_t k, const char* arg,
                                           at::Tensor& storage) {
  check_cpu(w, arg);
  const bool raw = w.scalar_type() == at::kChar;  // packed here for this call, else packed by the caller
  if (raw) {
    TORCH_CHECK_VALUE(w.dim() == 3 && w.size(0) == experts && w.size(1) == n && w.size(2) == k, arg,
                      ": expected a raw int8 weight of shape [", experts, ", ", n, ", ", k, "], got ", w.sizes());
    const MicroKernel& kernel = active_kernel();
    const at::Tensor wc = w.contiguous();
    const int64_t nbytes = as_value_errors([&] { return packed_weight_nbytes(n, k, kernel.geometry().layout, arg); });
    storage = at::empty({experts, nbytes}, w.options().dtype(at::kByte));
    for (int64_t e = 0; e < experts; ++e)
      pack_weight(kernel, wc.data_ptr<int8_t>() + e * n * k, n, k, k, storage.data_ptr<uint8_t>() + e * nbytes,
                  torch_parallel_for());
  } else {
    TORCH_CHECK_VALUE(w.scalar_type() == at::kByte && w.dim() == 2 && w.size(0) == experts, arg,
                      ": expected a raw int8 [", experts, ", ", n, ", ", k,
                      "] weight or packed experts (uint8 [E, bytes] from pack_moe_weights or pack_experts_int4), "
                      "got dtype ",
                      w.scalar_type(), " and shape ", w.sizes());
    TORCH_CHECK_VALUE(w.is_contiguous(), arg, ": packed experts must be contiguous");
    storage = w;
  }
  std::vector<PackedWeightView> views;
  for (int64_t e = 0; e < experts; ++e) {
    views.push_back(as_value_errors([&] {
      return view_packed_weight(storage.data_ptr<uint8_t>() + e * storage.size(1), storage.size(1), arg);
    }));
    const PackedWeightHeader& h = views.back().header;
    TORCH_CHECK_VALUE(h.n == n && h.k == k, arg, ": expert ", e, " was packed with shape [", h.n, ", ", h.k,
                      "], expected [", n, ", ", k, "]");
    // The driver packs A once for all experts, so every expert must share one panel layout.
    TORCH_CHECK_VALUE(views.back().layout.nr == views[0].layout.nr && views.back().layout.kr == views[0].layout.kr,
                      arg, ": expert ", e, " was packed by '", packed_by_name(h), "', expert 0 by '",
                      packed_by_name(views[0].header), "'; pack all experts with one variant");
  }
  if (!raw)  // verified once per tensor version, like a packed linear weight
    as_value_errors([&] {
      verified_blobs().ensure(w, [&] {
        for (int64_t e = 0; e < experts; ++e)
          verify_packed_weight(views[e], (std::string(arg) + " (expert " + std::to_string(e) + ")").c_str());
      });
      return 0;
    });
  return views;
}

// [E, rows] or [E, rows, 1] fp32 scales; returns rows.
at::Tensor checked_expert_scales(const at::Tensor& s, const char* arg) {
  check_cpu(s, arg);
  TORCH_CHECK_VALUE(s.scalar_type() == at::kFloat, arg, ": dtype must be float32, got ", s.scalar_type());
  TORCH_CHECK_VALUE(s.dim() == 2 || (s.dim() == 3 && s.size(2) == 1), arg,
                    ": expected shape [E, N] or [E, N, 1], got ", s.sizes());
  return aligned(s.reshape({s.size(0), s.size(1)}).contiguous());
}

}  // namespace

at::Tensor fused_experts_op(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                            const at::Tensor& topk_weights, const at::Tensor& topk_ids, const at::Tensor& w13_scale,
                            const at::Tensor& w2_scale, c10::string_view activation,
                            bool apply_router_weight_on_input) {
  TORCH_CHECK_VALUE(activation == "silu", "activation: only 'silu' is supported, got '", std::string(activation), "'");
  check_cpu(hidden, "hidden");
  const FloatKind kind = float_kind(hidden.scalar_type(), "hidden");
  check_rows(hidden, "hidden");
  const int64_t m = hidden.size(0), h = hidden.size(1);
  check_k(h, "hidden");
  const at::Tensor s13 = checked_expert_scales(w13_scale, "w13_scale");
  const at::Tensor s2 = checked_expert_scales(w2_scale, "w2_scale");
  check_finite_weight_side(s13, "w13_scale");
  check_finite_weight_side(s2, "w2_scale");
  const int64_t experts = s13.size(0), inter2 = s13.size(1);
  TORCH_CHECK_VALUE(experts > 0, "w13_scale: number of experts (dim 0) must be > 0");
  TORCH_CHECK_VALUE(inter2 > 0 && inter2 % 2 == 0, "w13_scale: dim 1 must be 2 * intermediate size (gate rows then "
                    "up rows), got ", inter2);
  TORCH_CHECK_VALUE(s2.size(0) == experts && s2.size(1) == h, "w2_scale: expected shape [", experts, ", ", h,
                    "] (experts x hidden size), got ", w2_scale.sizes());
  check_k(inter2 / 2, "w2");
  check_cpu(topk_ids, "topk_ids");
  TORCH_CHECK_VALUE(topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong,
                    "topk_ids: dtype must be int32 or int64, got ", topk_ids.scalar_type());
  TORCH_CHECK_VALUE(topk_ids.dim() == 2 && topk_ids.size(0) == m, "topk_ids: expected shape [", m,
                    ", topk], got ", topk_ids.sizes());
  const int64_t topk = topk_ids.size(1);
  TORCH_CHECK_VALUE(topk > 0, "topk_ids: topk (dim 1) must be > 0");
  check_cpu(topk_weights, "topk_weights");
  float_kind(topk_weights.scalar_type(), "topk_weights");
  TORCH_CHECK_VALUE(topk_weights.dim() == 2 && topk_weights.size(0) == m && topk_weights.size(1) == topk,
                    "topk_weights: expected shape [", m, ", ", topk, "] like topk_ids, got ", topk_weights.sizes());
  at::Tensor w13_storage, w2_storage;
  const std::vector<PackedWeightView> v13 = expert_views(w13, experts, inter2, h, "w13", w13_storage);
  const std::vector<PackedWeightView> v2 = expert_views(w2, experts, h, inter2 / 2, "w2", w2_storage);

  auto out = at::empty({m, h}, hidden.options());
  if (m == 0) return out;
  at::Tensor x = aligned(hidden), weights = aligned(topk_weights.to(at::kFloat).contiguous());
  if (apply_router_weight_on_input) {
    // The router weight scales the expert's input instead of its output (sglang's convention: topk == 1).
    TORCH_CHECK_VALUE(topk == 1, "apply_router_weight_on_input: requires topk == 1, got topk = ", topk);
    x = hidden.to(at::kFloat) * weights;
    weights = at::ones_like(weights);
  }
  const at::Tensor ids = aligned(topk_ids.to(at::kLong).contiguous());
  const MicroKernel& kernel = active_kernel();
  MoeProblem p{m, h, inter2 / 2, experts, topk, x.data_ptr(), float_kind(x.scalar_type(), "hidden"), x.stride(0),
               weights.data_ptr<float>(), ids.data_ptr<int64_t>(), v13.data(), s13.data_ptr<float>(), v2.data(),
               s2.data_ptr<float>(), out.data_ptr(), kind, reject_non_finite()};
  as_value_errors([&] {
    fused_experts(kernel, p, scratch_buffer(moe_scratch_nbytes(kernel, p)).data_ptr(), torch_parallel_for());
    return 0;
  });
  return out;
}

}  // namespace w8a8_cpu
