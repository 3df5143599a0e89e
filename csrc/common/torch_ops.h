// The ops torch_binding.cpp registers as torch.ops.w8a8_cpu.*, by the file that implements them (each op documented
// there).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <tuple>

namespace w8a8_cpu {

// packed_weight_ops.cpp
at::Tensor pack_weight_op(const at::Tensor& w);
at::Tensor pack_weight_int4_op(const at::Tensor& q, const at::Tensor& scale, const c10::optional<at::Tensor>& minimum,
                               int64_t group_size, bool half_scales);
void verify_packed_weight_op(const at::Tensor& blob);

// gemm_ops.cpp
std::tuple<at::Tensor, at::Tensor> per_token_quant_int8_op(const at::Tensor& x, const c10::optional<at::Tensor>& amax);
at::Tensor int8_mm_op(const at::Tensor& x_q, const at::Tensor& w);
at::Tensor scale_accumulators_op(const at::Tensor& acc, const at::Tensor& x_scale, const at::Tensor& w_scale,
                                 const c10::optional<at::Tensor>& bias, c10::optional<at::ScalarType> out_dtype);
at::Tensor int8_scaled_mm_op(const at::Tensor& x_q, const at::Tensor& w, const at::Tensor& x_scale,
                             const at::Tensor& w_scale, const c10::optional<at::Tensor>& bias,
                             c10::optional<at::ScalarType> out_dtype);
at::Tensor int8_scaled_mm_with_quant_op(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                                        const c10::optional<at::Tensor>& bias,
                                        c10::optional<at::ScalarType> out_dtype, const c10::optional<at::Tensor>& amax);
at::Tensor int8_gated_mm_with_quant_op(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                                       const c10::optional<at::Tensor>& bias, c10::optional<at::ScalarType> out_dtype);

// norm_rotary_ops.cpp
at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor add_rms_norm_op(at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps);
void rotary_embedding_op(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads);

// attention_ops.cpp
at::Tensor causal_attention_op(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale);
at::Tensor decode_attention_op(const at::Tensor& qkv, at::Tensor& k_cache, at::Tensor& v_cache, int64_t position,
                               int64_t heads, double scale, const c10::optional<at::Tensor>& k_scale,
                               const c10::optional<at::Tensor>& v_scale);

// decode_step_ops.cpp
at::Tensor decode_step_op(at::Tensor& h, const c10::List<c10::optional<at::Tensor>>& weights, at::TensorList k_caches,
                          at::TensorList v_caches, const at::Tensor& cos, const at::Tensor& sin, int64_t position,
                          int64_t heads, double scale, double eps, c10::optional<at::TensorList> k_scales,
                          c10::optional<at::TensorList> v_scales);

// moe_ops.cpp
at::Tensor fused_experts_op(const at::Tensor& hidden, const at::Tensor& w13, const at::Tensor& w2,
                            const at::Tensor& topk_weights, const at::Tensor& topk_ids, const at::Tensor& w13_scale,
                            const at::Tensor& w2_scale, c10::string_view activation,
                            bool apply_router_weight_on_input);

// read_probe_ops.cpp
int64_t read_probe_op(const at::Tensor& buffer, const std::string& way);

// info_ops.cpp
std::string info_op();
std::string set_variant_op(const std::string& name);

}  // namespace w8a8_cpu
