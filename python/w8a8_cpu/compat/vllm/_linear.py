"""The plugin's linear layers: W8A8CpuInt8Kernel (vLLM's Int8ScaledMMLinearKernel interface: every int8 W8A8
scheme of vLLM's) and W8A8CpuW4A8 (a compressed-tensors scheme: pack-quantized symmetric int4 weights, int8 dynamic
per-token activations). Both pack the loaded weight once into a w8a8_cpu blob and keep what each call needs as the
layer's parameters, under vLLM's own names; every call is then w8a8_cpu's op (exactly W8A8Linear / W4A8Linear on the
same tensors)."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch
from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (Int8ScaledMMLinearKernel,
                                                                                Int8ScaledMMLinearLayerConfig)
from vllm.model_executor.layers.quantization.compressed_tensors.schemes import CompressedTensorsScheme
from vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w8a8_int8 import (
    CompressedTensorsW8A8Int8)
from vllm.model_executor.parameter import (BasevLLMParameter, ChannelQuantScaleParameter, GroupQuantScaleParameter,
                                           PackedvLLMParameter, PerTensorScaleParameter)
from vllm.model_executor.utils import replace_parameter
from vllm.platforms import current_platform
from vllm.platforms.interface import CpuArchEnum

from ..._functions import (MAX_K_ZERO_POINT, check_static_activation_params, pack_weight, pack_weight_int4,
                           traced_mm_with_activations)
from ..._untrusted import check_weight_scales
from ...llm.pack_quantized import unpack_int4_rows
from ...scheme import is_int4_group
from . import mode
from ._hooks import announce

_ops = torch.ops.w8a8_cpu


def leaves_to_vllm_amx() -> bool:
    """Whether the layers vLLM runs with AMX kernels stay with vLLM: W8A8_CPU_VLLM=1 on x86 with AMX tiles, where
    vLLM's CPU int8 linear (sgl-kernel's int8_scaled_mm_with_quant, bf16 / fp16 activations; it ignores a static input
    scale there and quantizes each token instead), int4 linear (CPUWNA16's AMX path) and int8 MoE run on AMX."""
    return (mode() != "all" and current_platform.get_cpu_architecture() == CpuArchEnum.X86
            and torch.cpu._is_amx_tile_supported())


def int4_group(weight_quant) -> int:
    """The int4 group size of compressed-tensors weight arguments (0: per channel)."""
    return (weight_quant.group_size or 0) if weight_quant.strategy == "group" else 0


FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # a checkpoint's scales (load_quantized's)


def layer_name(layer: torch.nn.Module) -> str:
    """The name vLLM gave a layer (model.layers.1.mlp.down_proj), for errors."""
    return getattr(layer, "prefix", None) or getattr(layer, "layer_name", None) or type(layer).__name__


@contextlib.contextmanager
def naming_the_layer(layer: torch.nn.Module):
    """A ValueError raised inside (by a check of the checkpoint's tensors, or by the packer) names the layer."""
    try:
        yield
    except ValueError as e:
        if str(e).startswith(layer_name(layer)):
            raise
        raise ValueError(f"{layer_name(layer)}: {e}") from e


def linear_part(*args, **kwargs):
    """Which part of a linear layer a vLLM weight loader call loads (its shard id: "q" / "k" / "v", 0 / 1, or None)."""
    return args[0] if args else kwargs.get("loaded_shard_id")


def refuse_at_load(layer: torch.nn.Module, checks: dict, parts: dict, part_of=linear_part) -> None:
    """Wraps the weight loaders of the layer's parameters named in `checks` (name -> check(tensor, *args, **kwargs) of
    the checkpoint's tensor and the loader's other arguments, returning why it is refused, or None), and records which
    of each one's `parts[name]` parts (part_of(*args, **kwargs): a shard id, an expert's) came from the checkpoint
    (all_loaded checks them). vLLM's loaders copy a checkpoint tensor into the parameter's dtype, so that an int16 or
    float "int8" weight or a float zero point would be converted without a word; a fused layer keeps one value of what
    each part stores (weight_shape); and vLLM counts a fused parameter loaded when one of its parts is, leaving the
    others as allocated (whatever the memory held)."""
    layer.w8a8_cpu_loaded = {}
    for name, check in checks.items():
        param = getattr(layer, name, None)
        if param is None:
            continue
        loaded = layer.w8a8_cpu_loaded[name] = (set(), parts[name])

        def load(param, loaded_weight, *args, _load=param.weight_loader, _name=name, _check=check, _loaded=loaded[0],
                 **kwargs):
            why = _check(loaded_weight, *args, **kwargs)
            if why:
                raise ValueError(f"{layer_name(layer)}.{_name}: the checkpoint's tensor is {why}")
            _loaded.add(part_of(*args, **kwargs))
            return _load(param, loaded_weight, *args, **kwargs)
        param.weight_loader = load


def all_loaded(layer: torch.nn.Module) -> None:
    """Every part of each parameter refuse_at_load watches came from the checkpoint (ValueError naming it else)."""
    for name, (loaded, parts) in layer.w8a8_cpu_loaded.items():
        if len(loaded) != parts:
            raise ValueError(f"{name}: the checkpoint holds {len(loaded)} of its {parts} parts "
                             f"({sorted(map(str, loaded))}); a tensor is missing")


def of_dtype(*dtypes: torch.dtype):
    """A refuse_at_load check: the checkpoint's tensor has one of `dtypes`."""
    def check(tensor: torch.Tensor, *args, **kwargs) -> Optional[str]:
        if tensor.dtype not in dtypes:
            return f"{str(tensor.dtype).removeprefix('torch.')}; expected " + \
                " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        return None
    return check


def positive_scales(layer: torch.nn.Module, name: str, scale: torch.Tensor, largest_code: int) -> torch.Tensor:
    """A layer's loaded weight scales in fp32, each finite and > 0, and the weights they describe (codes up to
    largest_code in magnitude times the scale) finite in fp32, as load_quantized requires (an untrusted checkpoint's:
    ValueError naming the layer and the parameter otherwise, before anything is packed)."""
    scale = scale.detach().to(torch.float32)
    check_weight_scales(scale, largest_code, f"{layer_name(layer)}.{name}:", what="weight scale")
    return scale


def _fp32_bias(layer: torch.nn.Module) -> None:
    """The layer's bias once in fp32 as `bias_fp32` (the op's epilogue adds fp32; vLLM keeps it in the model dtype)."""
    bias = getattr(layer, "bias", None)
    if bias is not None:
        layer.register_parameter("bias_fp32", torch.nn.Parameter(bias.detach().float(), requires_grad=False))


def _call_bias(layer: torch.nn.Module, bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """vLLM passes layer.bias, or None where the layer adds it elsewhere (skip_bias_add, ranks but the first)."""
    return None if bias is None else layer.bias_fp32


class W8A8CpuInt8Kernel(Int8ScaledMMLinearKernel):
    """int8 weights (per channel, or per tensor of each fused part), int8 activations dynamic per token or static per
    tensor, symmetric or with a zero point."""

    @classmethod
    def is_supported(cls, compute_capability: Optional[int] = None):
        return (True, None) if current_platform.is_cpu() else (False, "requires CPU.")

    @classmethod
    def can_implement(cls, c: Int8ScaledMMLinearLayerConfig):
        # vLLM's AMX kernel takes bf16 / fp16 activations only (an fp32 model fails there at its first step)
        half_model = torch.get_default_dtype() in (torch.bfloat16, torch.float16)  # the model's, while vLLM builds it
        if c.input_symmetric and not c.is_static_input_scheme and half_model and leaves_to_vllm_amx():
            return False, ("leaves dynamic symmetric int8 layers to vLLM's AMX kernel on this CPU (W8A8_CPU_VLLM=all "
                           "takes them)")
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        with naming_the_layer(layer):
            all_loaded(layer)
            self._pack(layer)
        announce("W8A8 int8 linear layers (" + ("dynamic" if not self.config.is_static_input_scheme else "static")
                 + (" symmetric" if self.config.input_symmetric else " asymmetric") + " activations)")

    def _pack(self, layer: torch.nn.Module) -> None:
        w_name, scale_name, input_scale_name, zero_point_name, w_sum_name = self.layer_param_names
        weight = getattr(layer, w_name).detach()
        n, k = weight.shape
        symmetric = self.config.input_symmetric
        if not symmetric and k > MAX_K_ZERO_POINT:
            raise ValueError(f"{w_name}: K = {k} exceeds {MAX_K_ZERO_POINT}, beyond which asymmetric activations' "
                             f"int32 accumulators could overflow")
        scale = positive_scales(layer, scale_name, getattr(layer, scale_name), 128)
        if not self.config.is_channelwise:  # one scale per fused part (q, k, v): repeated over its channels
            widths = torch.tensor(layer.logical_widths)
            scale = scale.reshape(-1).repeat_interleave(widths)
        scale = scale.reshape(-1)
        if scale.numel() != n:
            raise ValueError(f"{scale_name}: {scale.numel()} scales for {n} output channels")
        replace_parameter(layer, w_name, pack_weight(weight.contiguous()))
        replace_parameter(layer, scale_name, scale.contiguous())
        if self.config.is_static_input_scheme:
            input_scale, zero_point = _one_static_activation(
                getattr(layer, input_scale_name), None if symmetric else getattr(layer, zero_point_name), symmetric)
            replace_parameter(layer, input_scale_name, input_scale)
            if zero_point is not None:
                replace_parameter(layer, zero_point_name, zero_point)
        replace_parameter(layer, w_sum_name, None if symmetric else weight.sum(dim=1, dtype=torch.int32))
        _fp32_bias(layer)
        self.dynamic_symmetric = symmetric and not self.config.is_static_input_scheme

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None):
        w, w_scale, input_scale, zero_point, w_sum = self._get_layer_params(layer)
        if self.dynamic_symmetric:
            return _ops.int8_scaled_mm_with_quant(x, w, w_scale, _call_bias(layer, bias), None)
        return traced_mm_with_activations(x, w, w_scale, _call_bias(layer, bias), input_scale, zero_point,
                                          self.config.input_symmetric, w_sum)


def _one_static_activation(input_scale: torch.Tensor, zero_point: Optional[torch.Tensor], symmetric: bool):
    """A layer's static activation scale [1] fp32 (and zero point [1] int32) from one value per fused part
    (W8A8CpuInt8Scheme), each checked; the parts' must be equal: the layer's input is quantized once for all of them,
    and a part quantized with other parameters would be computed with the wrong ones."""
    scales = input_scale.detach().to(torch.float32).reshape(-1)
    points = None if zero_point is None else zero_point.detach().to(torch.int32).reshape(-1)
    for part in range(scales.numel()):
        check_static_activation_params(scales[part:part + 1], None if points is None else points[part:part + 1],
                                       symmetric)
    if not (scales == scales[0]).all() or (points is not None and not (points == points[0]).all()):
        raise ValueError(f"input_scale / input_zero_point: the fused parts' static activation parameters differ "
                         f"({scales.tolist()}{'' if points is None else ', ' + str(points.tolist())}): one "
                         f"quantization of the layer's input cannot serve them")
    return scales[:1].clone(), None if points is None else points[:1].clone()


class W8A8CpuInt8Scheme(CompressedTensorsW8A8Int8):
    """vLLM's W8A8 int8 scheme (chosen for every W8A8 int8 layer), whose checkpoint tensors are checked at load where
    w8a8_cpu's kernel serves the layer: dtypes as load_quantized reads them, and static activations loaded one value
    per fused part (vLLM's scheme keeps one for the fused layer: the last part's, silently wrong for the others when
    they differ), so that W8A8CpuInt8Kernel can refuse parts that differ; and the layer refused where load_quantized
    would refuse its scheme (`unread`: why, else "")."""

    def __init__(self, strategy: str, is_static_input_scheme: bool, input_symmetric: bool, unread: str):
        super().__init__(strategy, is_static_input_scheme, input_symmetric)
        self.unread = unread

    def create_weights(self, layer: torch.nn.Module, output_partition_sizes, input_size_per_partition: int,
                       params_dtype: torch.dtype, weight_loader, **kwargs) -> None:
        super().create_weights(layer, output_partition_sizes, input_size_per_partition, params_dtype, weight_loader,
                               **kwargs)
        if not isinstance(self.kernel, W8A8CpuInt8Kernel):
            return
        if self.unread:
            raise ValueError(self.unread)
        parts = len(output_partition_sizes)
        if self.is_static_input_scheme:  # unloaded parts stay NaN / out of range: refused
            layer.register_parameter("input_scale", PerTensorScaleParameter(
                data=torch.full((parts,), float("nan"), dtype=torch.float32), weight_loader=weight_loader))
            if not self.input_symmetric:
                layer.register_parameter("input_zero_point", PerTensorScaleParameter(
                    data=torch.full((parts,), 1 << 30, dtype=torch.int32), weight_loader=weight_loader))
        checks = {"weight": of_dtype(torch.int8), "weight_scale": of_dtype(*FLOATS), "input_scale": of_dtype(*FLOATS),
                  "input_zero_point": of_dtype(torch.int8, torch.int32)}
        refuse_at_load(layer, checks, dict.fromkeys(checks, parts))


class W8A8CpuW4A8(CompressedTensorsScheme):
    """pack-quantized int4 weights, symmetric, per group (a power of two in [32, 65536]) or per channel; int8 dynamic
    per-token symmetric activations. The group scales load in fp32 (vLLM's own scheme keeps them in the model dtype,
    which can round a checkpoint's fp16 scales)."""

    def __init__(self, group_size: Optional[int]):
        self.group_size = group_size or 0  # 0: per channel

    @staticmethod
    def implements(weight_quant, input_quant) -> bool:
        """Whether this scheme serves a layer whose compressed-tensors arguments vLLM gives CompressedTensorsWNA8Int."""
        return (weight_quant.num_bits == 4 and weight_quant.symmetric and is_int4_group(int4_group(weight_quant))
                and weight_quant.strategy in ("group", "channel") and input_quant is not None
                and input_quant.num_bits == 8 and input_quant.symmetric and input_quant.dynamic
                and input_quant.strategy == "token")

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    def create_weights(self, layer: torch.nn.Module, output_size: int, input_size: int, output_partition_sizes,
                       input_size_per_partition: int, params_dtype: torch.dtype, weight_loader, **kwargs) -> None:
        n, k = sum(output_partition_sizes), input_size_per_partition
        self.in_features = k
        if self.group_size and k % self.group_size:
            raise ValueError(f"{layer_name(layer)}.weight_packed: K = {k} on this rank is not a multiple of the group "
                             f"size {self.group_size}")
        layer.register_parameter("weight_packed", PackedvLLMParameter(
            data=torch.empty(n, -(-k // 8), dtype=torch.int32), input_dim=1, output_dim=0, packed_dim=1,
            packed_factor=8, weight_loader=weight_loader))
        if self.group_size:
            scale = GroupQuantScaleParameter(data=torch.empty(n, k // self.group_size, dtype=torch.float32),
                                             output_dim=0, input_dim=1, weight_loader=weight_loader)
        else:  # one scale per channel: the same on every rank of a row-parallel layer
            scale = ChannelQuantScaleParameter(data=torch.empty(n, 1, dtype=torch.float32), output_dim=0,
                                               weight_loader=weight_loader)
        layer.register_parameter("weight_scale", scale)
        layer.register_parameter("weight_shape", BasevLLMParameter(data=torch.empty(2, dtype=torch.int64),
                                                                    weight_loader=weight_loader))
        ranks = output_size // n  # a column-parallel layer's parts are split over the ranks, their weight_shape not
        parts = {None: output_size, **{i: ranks * w for i, w in enumerate(output_partition_sizes)},
                 **{c: ranks * w for c, w in zip("qkv", output_partition_sizes)}}

        def weight_shape(tensor: torch.Tensor, shard=None, *args, **kwargs) -> Optional[str]:  # each part's [N, K]
            want = [parts.get(shard, -1), input_size]
            if tensor.dtype not in (torch.int32, torch.int64) or tensor.tolist() != want:
                return f"{str(tensor.dtype).removeprefix('torch.')} {tensor.tolist()}; expected int64 or int32 {want}"
            return None
        checks = {"weight_packed": of_dtype(torch.int32), "weight_scale": of_dtype(*FLOATS),
                  "weight_shape": weight_shape}
        refuse_at_load(layer, checks, dict.fromkeys(checks, len(output_partition_sizes)))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        with naming_the_layer(layer):
            all_loaded(layer)
            q = unpack_int4_rows(layer.weight_packed.detach(), self.in_features)
            blob = pack_weight_int4(q, positive_scales(layer, "weight_scale", layer.weight_scale, 15), None,
                                    self.group_size)
        replace_parameter(layer, "weight_packed", blob)
        # the op's per-channel factor on top of the blob's group scales
        replace_parameter(layer, "weight_scale", torch.ones(q.shape[0], dtype=torch.float32))
        layer.weight_shape = None  # the blob's header holds the shape
        _fp32_bias(layer)
        announce(f"W4A8 linear layers (int4 {f'groups of {self.group_size}' if self.group_size else 'per channel'})")

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return _ops.int8_scaled_mm_with_quant(x, layer.weight_packed, layer.weight_scale, _call_bias(layer, bias),
                                              None)
