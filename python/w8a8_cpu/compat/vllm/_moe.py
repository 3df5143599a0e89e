"""The plugin's fused MoE methods, SiLU-gated experts with int8 dynamic per-token symmetric activations, run by
w8a8_cpu.fused_experts on experts packed once at load:
- W8A8CpuMoE: int8 per-channel experts (the checkpoints of vLLM's CompressedTensorsW8A8Int8MoEMethod);
- W8A8CpuW4A8MoE: pack-quantized symmetric int4 experts per group (32 .. 65536) or channel, which vLLM 0.32 hands
  to a KleidiAI (Arm-only) method expecting int4 values stored one per int8, so it cannot load them on x86."""
from __future__ import annotations

from typing import Optional

import torch
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe import (
    CompressedTensorsMoEMethod)
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe.compressed_tensors_moe_w8a8_int8 import (  # noqa: E501
    CompressedTensorsW8A8Int8MoEMethod)
from vllm.model_executor.utils import replace_parameter, set_weight_attrs

from ..._functions import pack_experts_int4, pack_moe_weights
from ...llm.pack_quantized import unpack_int4_rows
from ...scheme import is_int4_group
from ._hooks import announce
from ._linear import FLOATS, all_loaded, int4_group, naming_the_layer, positive_scales, refuse_at_load

_ops = torch.ops.w8a8_cpu


def method_for(moe_config, weight_quant, input_quant, checkpoint_format):
    """(our method's class, '') for an MoE layer the plugin serves, else (None, why not)."""
    if input_quant is None or input_quant.num_bits != 8 or input_quant.strategy != "token" \
            or not input_quant.dynamic or not input_quant.symmetric or weight_quant is None \
            or not weight_quant.symmetric:
        return None, "not symmetric weights with int8 dynamic per-token symmetric activations"
    if weight_quant.num_bits == 8 and weight_quant.strategy == "channel":
        method = W8A8CpuMoE
    elif (weight_quant.num_bits == 4 and checkpoint_format == "pack-quantized"
          and is_int4_group(int4_group(weight_quant))):
        method = W8A8CpuW4A8MoE
    else:
        return None, f"{weight_quant.num_bits}-bit {weight_quant.strategy} weights ({checkpoint_format})"
    if moe_config.activation != MoEActivation.SILU or not moe_config.is_act_and_mul:
        return None, f"activation {moe_config.activation} (SiLU-gated only)"
    if moe_config.has_bias or moe_config.swiglu_limit is not None:
        return None, "expert biases or a clamped SwiGLU"
    if moe_config.moe_parallel_config.use_ep:
        return None, "expert parallelism"
    return method, ""


def expert_part(weight_name=None, shard_id=None, expert_id=None, *args, **kwargs):
    """Which part of an MoE layer's parameter a vLLM weight loader call loads: (expert, "w1" / "w2" / "w3")."""
    return expert_id, shard_id


def of_part_shape(dtypes, shapes: dict):
    """A refuse_at_load check of an expert's tensor: one of `dtypes`, and one of shapes[its shard id ("w1", "w2",
    "w3")] (vLLM's MoE loaders copy what fits of another shape: a narrower tensor left the rest unloaded)."""
    def check(tensor: torch.Tensor, weight_name=None, shard_id=None, *args, **kwargs) -> Optional[str]:
        want = shapes.get(shard_id, [])
        if tensor.dtype not in dtypes or list(tensor.shape) not in want:
            return (f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}; expected "
                    f"{' or '.join(str(d).removeprefix('torch.') for d in dtypes)} {' or '.join(map(str, want))}")
        return None
    return check


def expert_shapes(inter: int, hidden: int, columns) -> dict:
    """Each projection's shape [N, columns(K)] in a checkpoint, by shard id (inter: all ranks' intermediate size)."""
    return {"w1": [inter, columns(hidden)], "w3": [inter, columns(hidden)], "w2": [hidden, columns(inter)]}


def expert_parts(experts: int, names) -> dict:
    """How many parts each of an MoE layer's parameters `names` loads: w13 two an expert (w1, w3), w2 one."""
    return {name: experts * (2 if name.startswith("w13") else 1) for name in names}


class W8A8CpuMoE(CompressedTensorsW8A8Int8MoEMethod):
    """vLLM's int8 MoE method's weights (create_weights, its parameter names and loaders), w8a8_cpu's experts."""

    def __init__(self, weight_quant, input_quant, moe) -> None:
        CompressedTensorsMoEMethod.__init__(self, moe)  # not vLLM's int8 one: it picks (and may refuse) a backend
        self.weight_quant, self.input_quant = weight_quant, input_quant
        self.static_input_scales = False

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, *args, **kwargs):
        super().create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, *args, **kwargs)
        weights = expert_shapes(intermediate_size_per_partition * self.moe.tp_size, hidden_size, lambda k: k)
        checks = {f"{name}_weight": of_part_shape((torch.int8,), {s: [weights[s]] for s in shards})
                  for name, shards in (("w13", ("w1", "w3")), ("w2", ("w2",)))}
        checks.update({f"{name}_weight_scale": of_part_shape(FLOATS, {s: [[weights[s][0], 1], [weights[s][0]]]
                                                                      for s in shards})
                       for name, shards in (("w13", ("w1", "w3")), ("w2", ("w2",)))})
        refuse_at_load(layer, checks, expert_parts(num_experts, checks), expert_part)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        with naming_the_layer(layer):
            all_loaded(layer)
            w13, w2 = pack_moe_weights(layer.w13_weight.detach(), layer.w2_weight.detach())
            scales = {name: positive_scales(layer, name, getattr(layer, name), 128).flatten(1).contiguous()
                      for name in ("w13_weight_scale", "w2_weight_scale")}
        replace_parameter(layer, "w13_weight", w13)
        replace_parameter(layer, "w2_weight", w2)
        for name, scale in scales.items():
            replace_parameter(layer, name, scale)
        announce("int8 fused MoE experts")

    def get_fused_moe_quant_config(self, layer: torch.nn.Module):
        return None  # no modular kernel: apply() runs the whole MoE

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input) -> torch.Tensor:
        return _ops.fused_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                                  layer.w13_weight_scale, layer.w2_weight_scale, "silu",
                                  layer.apply_router_weight_on_input)


class W8A8CpuW4A8MoE(W8A8CpuMoE):
    """pack-quantized int4 experts: int32 words of 8 values [E, N, K / 8] and fp32 group scales [E, N, groups] per
    projection, under the names vLLM's pack-quantized MoE methods load (w13_weight_packed, w13_weight_scale, ...,
    quant_method "group" or "channel"); the scales in fp32, so that a checkpoint's fp16 scales load exactly."""

    def __init__(self, weight_quant, input_quant, moe) -> None:
        super().__init__(weight_quant, input_quant, moe)
        self.group_size = int4_group(weight_quant)

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        inter = intermediate_size_per_partition
        for k in (hidden_size, inter):
            if self.group_size and k % self.group_size:
                raise ValueError(f"{layer.layer_name}.w13/w2_weight_packed: K = {k} is not a multiple of the group "
                                 f"size {self.group_size}")
        extra_weight_attrs.update({"is_transposed": False, "quant_method": "group" if self.group_size else "channel"})
        shapes = {"w13": (num_experts, 2 * inter, hidden_size), "w2": (num_experts, hidden_size, inter)}
        for name, (e, n, k) in shapes.items():
            groups = k // self.group_size if self.group_size else 1
            for suffix, shape, dtype in (("weight_packed", (e, n, -(-k // 8)), torch.int32),
                                         ("weight_scale", (e, n, groups), torch.float32),
                                         ("weight_shape", (e, 2), torch.float32)):
                parameter = torch.nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
                layer.register_parameter(f"{name}_{suffix}", parameter)
                set_weight_attrs(parameter, extra_weight_attrs)
        layer.w8a8_cpu_shapes = shapes
        inter_all = inter * self.moe.tp_size  # each expert's tensors in the checkpoint: the whole [N, K]
        parts = expert_shapes(inter_all, hidden_size, lambda k: k)

        def weight_shape(tensor: torch.Tensor, weight_name=None, shard_id=None, *args, **kwargs) -> Optional[str]:
            want = parts.get(shard_id)
            if tensor.dtype not in (torch.int32, torch.int64) or tensor.tolist() != want:
                return f"{str(tensor.dtype).removeprefix('torch.')} {tensor.tolist()}; expected int64 or int32 {want}"
            return None
        packed = expert_shapes(inter_all, hidden_size, lambda k: -(-k // 8))
        groups = expert_shapes(inter_all, hidden_size, lambda k: k // self.group_size if self.group_size else 1)
        checks = {}
        for name, shards in (("w13", ("w1", "w3")), ("w2", ("w2",))):
            checks[f"{name}_weight_packed"] = of_part_shape((torch.int32,), {s: [packed[s]] for s in shards})
            checks[f"{name}_weight_scale"] = of_part_shape(FLOATS, {s: [groups[s]] for s in shards})
            checks[f"{name}_weight_shape"] = weight_shape
        refuse_at_load(layer, checks, expert_parts(num_experts, checks), expert_part)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        with naming_the_layer(layer):
            all_loaded(layer)
        for name, (e, n, k) in layer.w8a8_cpu_shapes.items():
            with naming_the_layer(layer):
                packed = getattr(layer, f"{name}_weight_packed").detach()
                q = unpack_int4_rows(packed.reshape(e * n, -1), k).reshape(e, n, k)
                scale = positive_scales(layer, f"{name}_weight_scale", getattr(layer, f"{name}_weight_scale"), 15)
                blob = pack_experts_int4(q, scale, None, self.group_size)
            replace_parameter(layer, f"{name}_weight_packed", blob)
            replace_parameter(layer, f"{name}_weight_scale", torch.ones(e, n, dtype=torch.float32))
            setattr(layer, f"{name}_weight_shape", None)  # each blob's header holds its shape
        announce(f"int4 fused MoE experts ({f'groups of {self.group_size}' if self.group_size else 'per channel'})")

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input) -> torch.Tensor:
        return _ops.fused_experts(x, layer.w13_weight_packed, layer.w2_weight_packed, topk_weights, topk_ids,
                                  layer.w13_weight_scale, layer.w2_weight_scale, "silu",
                                  layer.apply_router_weight_on_input)
