"""The plugin's fused MoE: int8 per-channel experts with int8 dynamic per-token activations (vLLM's
CompressedTensorsW8A8Int8MoEMethod's checkpoints), SiLU-gated, run by w8a8_cpu.fused_experts on experts packed
once at load."""
from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe import (
    CompressedTensorsMoEMethod)
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w8a8_int8 import (  # noqa: E501
    CompressedTensorsW8A8Int8MoEMethod)
from vllm.model_executor.utils import replace_parameter

from ..._functions import pack_moe_weights
from ._hooks import announce

_ops = torch.ops.w8a8_cpu


def serves(moe_config, weight_quant, input_quant) -> str:
    """Why W8A8CpuMoE cannot serve an MoE layer ('' when it can)."""
    if weight_quant is None or input_quant is None or weight_quant.num_bits != 8 or weight_quant.strategy != "channel" \
            or not weight_quant.symmetric or input_quant.num_bits != 8 or input_quant.strategy != "token" \
            or not input_quant.dynamic or not input_quant.symmetric:
        return "not int8 per-channel weights with int8 dynamic per-token symmetric activations"
    if moe_config.activation != MoEActivation.SILU or not moe_config.is_act_and_mul:
        return f"activation {moe_config.activation} (SiLU-gated only)"
    if moe_config.has_bias or moe_config.swiglu_limit is not None:
        return "expert biases or a clamped SwiGLU"
    if moe_config.moe_parallel_config.use_ep:
        return "expert parallelism"
    return ""


class W8A8CpuMoE(CompressedTensorsW8A8Int8MoEMethod):
    """vLLM's int8 MoE method's weights (create_weights, its parameter names and loaders), w8a8_cpu's experts."""

    def __init__(self, weight_quant, input_quant, moe) -> None:
        CompressedTensorsMoEMethod.__init__(self, moe)  # not vLLM's int8 one: it picks (and may refuse) a backend
        self.weight_quant, self.input_quant = weight_quant, input_quant
        self.static_input_scales = False

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        w13, w2 = pack_moe_weights(layer.w13_weight.detach(), layer.w2_weight.detach())
        replace_parameter(layer, "w13_weight", w13)
        replace_parameter(layer, "w2_weight", w2)
        replace_parameter(layer, "w13_weight_scale", layer.w13_weight_scale.detach().float().flatten(1).contiguous())
        replace_parameter(layer, "w2_weight_scale", layer.w2_weight_scale.detach().float().flatten(1).contiguous())
        announce("int8 fused MoE experts")

    def get_fused_moe_quant_config(self, layer: torch.nn.Module):
        return None  # no modular kernel: apply() runs the whole MoE

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input) -> torch.Tensor:
        return _ops.fused_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                  layer.w13_weight_scale, layer.w2_weight_scale, "silu",
                                  layer.apply_router_weight_on_input)
