"""vLLM's compressed-tensors quantization config, with w8a8_cpu's W4A8 scheme and MoE method chosen where they apply
(registered under vLLM's own name, "compressed-tensors"); every other layer gets vLLM's choice unchanged."""
from __future__ import annotations

import logging

from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig
from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (CompressedTensorsW8A8Int8,
                                                                                CompressedTensorsWNA8Int)

from ...llm.checkpoint.scheme import read_scheme
from ._linear import W8A8CpuInt8Scheme, W8A8CpuW4A8, int4_group, leaves_to_vllm_amx
from ._moe import W8A8CpuMoE, method_for

logger = logging.getLogger("vllm.plugins.w8a8_cpu")
VLLM_ADDED = ("total_num_heads", "total_num_kv_heads")  # what vLLM's get_quant_config adds to a checkpoint's dict


class W8A8CpuCompressedTensorsConfig(CompressedTensorsConfig):
    """A checkpoint whose quantization_config load_quantized refuses (a format or type w8a8_cpu does not read, a
    group's field out of its range, even in a group vLLM never applies) has no layer served by the plugin: each one it
    would serve raises that refusal, naming the layer (`unread`); vLLM's own layers are left as they are."""

    @classmethod
    def from_config(cls, config: dict):
        try:  # before vLLM's from_config, which drops some groups from the dict
            read_scheme({"quantization_config": {k: v for k, v in config.items() if k not in VLLM_ADDED}},
                        "config.json")
            refusal = ""
        except ValueError as e:
            refusal = str(e)
        made = super().from_config(config)
        made.w8a8_cpu_refusal = refusal
        return made

    def unread(self, layer_name: str) -> str:
        """Why a layer the plugin would serve is refused (load_quantized's reason), or ""."""
        refusal = getattr(self, "w8a8_cpu_refusal", "")
        return f"{layer_name}: load_quantized refuses this checkpoint: {refusal}" if refusal else ""

    def get_scheme(self, layer, layer_name=None):
        scheme = super().get_scheme(layer, layer_name)
        if type(scheme) is CompressedTensorsW8A8Int8:  # the same, its tensors checked where our kernel serves it
            return W8A8CpuInt8Scheme(scheme.strategy, scheme.is_static_input_scheme, scheme.input_symmetric,
                                     self.unread(layer_name))
        if isinstance(scheme, CompressedTensorsWNA8Int):
            parts = self.get_scheme_dict(layer, layer_name)
            weight_quant, input_quant = parts.get("weights"), parts.get("input_activations")
            if not W8A8CpuW4A8.implements(weight_quant, input_quant):
                logger.info("w8a8_cpu: %s stays with vLLM's %s (not symmetric int4 per group or channel with int8 "
                            "dynamic per-token activations)", layer_name, type(scheme).__name__)
            elif not leaves_to_vllm_amx():
                if self.unread(layer_name):
                    raise ValueError(self.unread(layer_name))
                return W8A8CpuW4A8(int4_group(weight_quant))
        return scheme

    def get_quant_method(self, layer, prefix):
        if isinstance(layer, RoutedExperts):
            parts = self._moe_scheme(layer, prefix)
            if parts is not None:
                weight_quant, input_quant = parts.get("weights"), parts.get("input_activations")
                method, why_not = method_for(layer.moe_config, weight_quant, input_quant, parts.get("format"))
                if method is W8A8CpuMoE and leaves_to_vllm_amx():  # vLLM's int8 MoE runs on AMX here
                    method, why_not = None, "AMX"
                if method is not None:
                    if self.unread(prefix):
                        raise ValueError(self.unread(prefix))
                    return method(weight_quant, input_quant, layer.moe_config)
                logger.info("w8a8_cpu: MoE %s stays with vLLM's method (%s)", prefix, why_not)
        return super().get_quant_method(layer, prefix)

    def _moe_scheme(self, layer, prefix):
        """The compressed-tensors scheme of an MoE layer's experts, as vLLM's own MoE method reads it: the first
        expert's projections, which must agree (None: no scheme, or the projections differ: vLLM decides)."""
        self._add_fused_moe_to_target_scheme_map()
        names = [f"{prefix}.0.{p}" for p in (layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name,
                                              layer.ckpt_down_proj_name)]
        schemes = [self.get_scheme_dict(layer, name) for name in names]
        return schemes[0] if schemes[0] is not None and all(s == schemes[0] for s in schemes) else None
