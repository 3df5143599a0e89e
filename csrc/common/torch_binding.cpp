// Registration of torch.ops.w8a8_cpu.*: each op's schema and its CPU implementation (torch_ops.h). The ops live in a
// file per topic beside this one; they check inputs, allocate and parallelise with at::parallel_for, and all arithmetic
// lives in the drivers and the micro-kernels.
#include <torch/library.h>

#include "torch_ops.h"

TORCH_LIBRARY(w8a8_cpu, m) {
  m.def("per_token_quant_int8(Tensor x, Tensor? amax=None) -> (Tensor, Tensor)");
  m.def("int8_mm(Tensor x_q, Tensor w) -> Tensor");
  m.def(
      "scale_accumulators(Tensor acc, Tensor x_scale, Tensor w_scale, Tensor? bias=None, ScalarType? out_dtype=None) "
      "-> Tensor");
  m.def(
      "int8_scaled_mm(Tensor x_q, Tensor w, Tensor x_scale, Tensor w_scale, Tensor? bias=None, "
      "ScalarType? out_dtype=None) -> Tensor");
  m.def(
      "int8_scaled_mm_with_quant(Tensor x, Tensor w, Tensor w_scale, Tensor? bias=None, "
      "ScalarType? out_dtype=None, Tensor? amax=None) -> Tensor");
  m.def(
      "int8_gated_mm_with_quant(Tensor x, Tensor w, Tensor w_scale, Tensor? bias=None, ScalarType? out_dtype=None) "
      "-> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("rotary_embedding_(Tensor(a!) x, Tensor cos, Tensor sin, int heads) -> ()");
  m.def("causal_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  m.def("decode_attention_(Tensor qkv, Tensor(a!) k_cache, Tensor(b!) v_cache, int position, int heads, float scale, "
        "Tensor(c!)? k_scale=None, Tensor(d!)? v_scale=None) -> Tensor");
  m.def("decode_step_(Tensor(a!) h, Tensor?[] weights, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor cos, "
        "Tensor sin, int position, int heads, float scale, float eps, Tensor(d!)[]? k_scales=None, "
        "Tensor(e!)[]? v_scales=None) -> Tensor");
  m.def("pack_weight(Tensor w) -> Tensor");
  m.def("pack_weight_int4(Tensor q, Tensor scale, Tensor? minimum=None, int group_size=0, bool half_scales=False) "
        "-> Tensor");
  m.def(
      "fused_experts(Tensor hidden, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, Tensor w13_scale, "
      "Tensor w2_scale, str activation='silu', bool apply_router_weight_on_input=False) -> Tensor");
  m.def("_verify_packed_weight(Tensor blob) -> ()");
  m.def("_read_probe(Tensor buffer, str way) -> int");
  m.def("_info() -> str", &w8a8_cpu::info_op);
  m.def("_set_variant(str name) -> str", &w8a8_cpu::set_variant_op);
}

TORCH_LIBRARY_IMPL(w8a8_cpu, CPU, m) {
  m.impl("per_token_quant_int8", &w8a8_cpu::per_token_quant_int8_op);
  m.impl("int8_mm", &w8a8_cpu::int8_mm_op);
  m.impl("scale_accumulators", &w8a8_cpu::scale_accumulators_op);
  m.impl("int8_scaled_mm", &w8a8_cpu::int8_scaled_mm_op);
  m.impl("int8_scaled_mm_with_quant", &w8a8_cpu::int8_scaled_mm_with_quant_op);
  m.impl("int8_gated_mm_with_quant", &w8a8_cpu::int8_gated_mm_with_quant_op);
  m.impl("rms_norm", &w8a8_cpu::rms_norm_op);
  m.impl("add_rms_norm_", &w8a8_cpu::add_rms_norm_op);
  m.impl("rotary_embedding_", &w8a8_cpu::rotary_embedding_op);
  m.impl("causal_attention", &w8a8_cpu::causal_attention_op);
  m.impl("decode_attention_", &w8a8_cpu::decode_attention_op);
  m.impl("decode_step_", &w8a8_cpu::decode_step_op);
  m.impl("pack_weight", &w8a8_cpu::pack_weight_op);
  m.impl("pack_weight_int4", &w8a8_cpu::pack_weight_int4_op);
  m.impl("fused_experts", &w8a8_cpu::fused_experts_op);
  m.impl("_verify_packed_weight", &w8a8_cpu::verify_packed_weight_op);
  m.impl("_read_probe", &w8a8_cpu::read_probe_op);
}
