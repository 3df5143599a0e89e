"""Module-level API: W8A8Linear and quantize_model."""
from __future__ import annotations

import fnmatch
import warnings
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

from .. import _autograd  # the submodule: nn depends on the package's modules, never on its __init__
from .._functions import (fused_experts, int8_scaled_mm_with_quant, pack_moe_weights, pack_weight,
                          quantize_weight, unpack_weight)
from .._loader import ops as _ops

SkipSpec = Union[None, Iterable[str], Callable[[str, torch.nn.Module], bool]]


class _Fp32Scales(torch.nn.Module):
    """Keeps the quantization scales fp32 through model.half() / .to(torch.bfloat16): the ops take fp32 scales,
    and rounding a scale to 16 bits would silently shift every output of its channel. Device moves still apply."""

    _fp32_buffers: tuple = ()

    def _apply(self, fn, *args, **kwargs):
        before = {name: getattr(self, name) for name in self._fp32_buffers}
        super()._apply(fn, *args, **kwargs)
        for name, scale in before.items():
            after = getattr(self, name)
            if after.dtype != torch.float32:
                setattr(self, name, scale.to(device=after.device))
        return self


def _finite_fp32(t: torch.Tensor, name: str) -> torch.Tensor:
    """A weight-side tensor (scales, bias) as contiguous fp32; NaN/Inf there is a bug in the weights, rejected where
    the layer is built (non-finite activations follow nn.Linear instead: NaN rows out)."""
    t32 = t.detach().to(torch.float32).contiguous()
    if not torch.isfinite(t32).all():
        raise ValueError(f"{name}: contains NaN or Inf")
    return t32


class W8A8Linear(_Fp32Scales):
    """Linear layer with int8 weights (one fp32 scale per output channel) and per-token int8 activations.

    The weight is quantized and packed once (for the variant active at construction); forward runs the
    fused quantize + int8 matmul and returns the input's dtype. Gradients flow to the input (straight-through,
    see int8_scaled_mm_with_quant); the weight, w_scale and bias are frozen buffers.

    There is no float `weight`: reading it raises AttributeError (hasattr is False) and assigning one raises
    ValueError, so code that would tie it to another layer's float weight (transformers' tie_weights on a
    quantized lm_head) fails instead of attaching a tensor forward never reads. int8_weight() gives the weight."""

    _NO_FLOAT_WEIGHT = ("W8A8Linear has no float weight: it holds the int8 weight packed (int8_weight() unpacks it) "
                        "and fp32 w_scale. A layer whose weight is read or tied elsewhere (a tied lm_head) must stay "
                        "float: skip it in quantize_model")

    _fp32_buffers = ("w_scale",)

    def __init__(self, w_q: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor] = None):
        super().__init__()
        if w_q.dtype != torch.int8 or w_q.dim() != 2:
            raise ValueError(f"w_q: expected int8 [N, K], got {w_q.dtype} {tuple(w_q.shape)}")
        self.out_features, self.in_features = w_q.shape
        self.register_buffer("weight_packed", pack_weight(w_q.contiguous()))
        self.register_buffer("w_scale", _finite_fp32(w_scale, "w_scale").reshape(-1))
        self.register_buffer("bias", None if bias is None else _finite_fp32(bias, "bias"))

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> "W8A8Linear":
        if not isinstance(linear, torch.nn.Linear):
            raise ValueError(f"linear: expected torch.nn.Linear, got {type(linear).__name__}")
        w_q, w_scale = quantize_weight(linear.weight)
        return cls(w_q, w_scale, linear.bias)

    def __getattr__(self, name: str):
        if name == "weight":
            raise AttributeError(f"weight: {self._NO_FLOAT_WEIGHT}")
        return super().__getattr__(name)

    def __setattr__(self, name: str, value) -> None:
        if name == "weight":
            raise ValueError(f"weight: {self._NO_FLOAT_WEIGHT}")
        super().__setattr__(name, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tracked = [t for t in (x, self.w_scale, self.bias) if isinstance(t, torch.Tensor) and t.requires_grad]
        # Older torch (no Python autograd kernels, _autograd.AVAILABLE false) needs no detour, and its
        # _AutoDispatchBelowAutograd is no context manager.
        if _autograd.AVAILABLE and isinstance(x, torch.Tensor) and not (torch.is_grad_enabled() and tracked) \
                and not _is_compiling():
            # No gradient wanted (e.g. generation under no_grad): go below the Python autograd kernel, which costs
            # ~8 us per call there (a decoder LLM makes ~200 such calls per token). The op validates its inputs.
            with torch._C._AutoDispatchBelowAutograd():
                return _ops.int8_scaled_mm_with_quant(x, self.weight_packed, self.w_scale, self.bias, None)
        return int8_scaled_mm_with_quant(x, self.weight_packed, self.w_scale, self.bias)

    def int8_weight(self) -> torch.Tensor:
        """The int8 [N, K] weight (unpacked from the packed buffer; used to save checkpoints)."""
        return unpack_weight(self.weight_packed)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class W8A8MoE(_Fp32Scales):
    """Mixture of SiLU-gated experts with W8A8 weights: router logits -> softmax -> top-k -> fused_experts.

    w13 [E, 2I, H] holds each expert's gate rows then up rows; w2 [E, H, I] the down projection. Weights are
    quantized per output channel and packed once; forward(hidden [M, H], router_logits [M, E]) -> [M, H]."""

    _fp32_buffers = ("w13_scale", "w2_scale")

    def __init__(self, w13_q: torch.Tensor, w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor,
                 top_k: int, renormalize: bool = True):
        super().__init__()
        if not 1 <= top_k <= w13_q.shape[0]:
            raise ValueError(f"top_k: must be in [1, {w13_q.shape[0]}] (number of experts), got {top_k}")
        self.num_experts, inter2, self.hidden_size = w13_q.shape
        self.intermediate_size = inter2 // 2
        self.top_k, self.renormalize = top_k, renormalize
        w13_packed, w2_packed = pack_moe_weights(w13_q, w2_q)
        self.register_buffer("w13_packed", w13_packed)
        self.register_buffer("w2_packed", w2_packed)
        self.register_buffer("w13_scale", _finite_fp32(w13_scale, "w13_scale").reshape(self.num_experts, -1))
        self.register_buffer("w2_scale", _finite_fp32(w2_scale, "w2_scale").reshape(self.num_experts, -1))

    @staticmethod
    def _quantize_experts(w: torch.Tensor):
        e, n, k = w.shape
        w_q, w_scale = quantize_weight(w.reshape(e * n, k))
        return w_q.reshape(e, n, k), w_scale.reshape(e, n)

    @classmethod
    def from_float(cls, w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool = True) -> "W8A8MoE":
        if w13.dim() != 3 or w2.dim() != 3:
            raise ValueError(f"w13, w2: expected [E, 2I, H] and [E, H, I], got {tuple(w13.shape)}, {tuple(w2.shape)}")
        return cls(*cls._quantize_experts(w13), *cls._quantize_experts(w2), top_k=top_k, renormalize=renormalize)

    def route(self, router_logits: torch.Tensor):
        """Top-k experts per token: (weights fp32 [M, top_k], ids int64 [M, top_k])."""
        if router_logits.dim() != 2 or router_logits.shape[1] != self.num_experts:
            raise ValueError(f"router_logits: expected [M, {self.num_experts}], got {tuple(router_logits.shape)}")
        weights, ids = torch.topk(torch.softmax(router_logits.float(), dim=-1), self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(router_logits)
        return fused_experts(hidden, self.w13_packed, self.w2_packed, weights, ids, self.w13_scale, self.w2_scale)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"top_k={self.top_k}")


def _expert_weights(module: torch.nn.Module):
    """(gate_up_proj [E, 2I, H], down_proj [E, H, I]) of a transformers fused-experts module (MixtralExperts,
    Qwen2MoeExperts, Qwen3MoeExperts, ...: 3-D parameters, gate rows then up rows), else None."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3 \
            and down.dim() == 3 and hasattr(module, "act_fn"):
        return gate_up, down
    return None


def is_silu(act: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Whether an activation module computes SiLU, judged by behaviour: transformers wraps SiLU in classes of its
    own, and the fused experts implement SiLU-gated experts only."""
    probe = torch.linspace(-8.0, 8.0, 33)
    with torch.no_grad():
        return torch.allclose(act(probe), torch.nn.functional.silu(probe))


class W8A8Experts(_Fp32Scales):
    """Drop-in for a transformers fused-experts module (MixtralExperts, Qwen2MoeExperts, Qwen3MoeExperts):
    forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H] through fused_experts.

    The model's own router stays in charge of routing (softmax, top-k and its renormalisation rule); only the
    expert GEMMs run in W8A8. w13 [E, 2I, H] holds gate rows then up rows, w2 [E, H, I]; SiLU-gated."""

    _fp32_buffers = ("w13_scale", "w2_scale")

    def __init__(self, w13_q: torch.Tensor, w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor):
        super().__init__()
        for name, w in (("w13_q", w13_q), ("w2_q", w2_q)):
            if w.dtype != torch.int8 or w.dim() != 3:
                raise ValueError(f"{name}: expected int8 [E, N, K], got {w.dtype} {tuple(w.shape)}")
        self.num_experts, inter2, self.hidden_dim = w13_q.shape
        if inter2 % 2 or w2_q.shape != (self.num_experts, self.hidden_dim, inter2 // 2):
            raise ValueError(f"w13_q {tuple(w13_q.shape)} and w2_q {tuple(w2_q.shape)}: expected [E, 2I, H] and "
                             f"[E, H, I]")
        self.intermediate_dim = inter2 // 2
        w13_packed, w2_packed = pack_moe_weights(w13_q, w2_q)
        self.register_buffer("w13_packed", w13_packed)
        self.register_buffer("w2_packed", w2_packed)
        self.register_buffer("w13_scale", _finite_fp32(w13_scale, "w13_scale").reshape(self.num_experts, inter2))
        self.register_buffer("w2_scale", _finite_fp32(w2_scale, "w2_scale").reshape(self.num_experts,
                                                                                     self.hidden_dim))

    @classmethod
    def from_experts(cls, experts: torch.nn.Module) -> "W8A8Experts":
        weights = _expert_weights(experts)
        if weights is None:
            raise ValueError(f"experts: {type(experts).__name__} has no 3-D gate_up_proj / down_proj parameters")
        act = experts.act_fn
        if not is_silu(act):
            raise ValueError(f"experts: {type(experts).__name__} uses activation {type(act).__name__}; the fused "
                             f"W8A8 experts implement SiLU-gated experts only")
        return cls(*W8A8MoE._quantize_experts(weights[0]), *W8A8MoE._quantize_experts(weights[1]))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return fused_experts(hidden_states, self.w13_packed, self.w2_packed, top_k_weights.float(), top_k_index,
                             self.w13_scale, self.w2_scale)

    def int8_weights(self, experts: slice = slice(None)):
        """(w13 int8 [E, 2I, H], w2 int8 [E, H, I]) of `experts` (all by default), unpacked from the packed buffers
        (to save checkpoints, to shard)."""
        return (torch.stack([unpack_weight(b) for b in self.w13_packed[experts]]),
                torch.stack([unpack_weight(b) for b in self.w2_packed[experts]]))

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}"


def _skipped(skip: SkipSpec, name: str, module: torch.nn.Module) -> bool:
    if skip is None:
        return False
    if callable(skip):
        return bool(skip(name, module))
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in skip)


def _is_compiling() -> bool:
    compiler = getattr(torch, "compiler", None)  # torch < 2.1 has no torch.compiler (and compiles nothing of ours)
    return compiler is not None and compiler.is_compiling()


def _all_named_parameters(module: torch.nn.Module):
    """Every (name, parameter), a shared one under each of its names (named_parameters(remove_duplicate=False)
    needs torch >= 2.0; the ppc64le CI runs Debian's torch 1.13)."""
    for owner_name, owner in module.named_modules(remove_duplicate=False):
        for pname, p in owner._parameters.items():
            if p is not None:
                yield (f"{owner_name}.{pname}" if owner_name else pname), p


def _tied_elsewhere(holders: Dict[int, List[str]], names: List[str],
                    module: torch.nn.Module) -> List[Tuple[str, str]]:
    """(parameter of `module`, another name of the same tensor outside it) pairs: the ties replacing it breaks.
    holders: id(parameter) -> every name the model reaches it under."""
    own = {f"{name}.{pname}" for name in names for pname, _ in _all_named_parameters(module)}
    return [(f"{names[0]}.{pname}", other) for pname, p in module.named_parameters()
            for other in holders[id(p)] if other not in own]


def quantize_model(model: torch.nn.Module, skip: SkipSpec = None) -> torch.nn.Module:
    """Replace every nn.Linear in `model` (in place) with W8A8Linear, and every transformers fused-experts module
    (Mixtral / Qwen2-MoE / Qwen3-MoE `experts`) with W8A8Experts; return the model.

    skip: module-name glob patterns (e.g. ["lm_head", "*.gate"]) or a callable(name, module) -> bool
    selecting layers to keep in floating point.

    A module used at several places (one nn.Linear instance applied twice) is quantized once and the same
    replacement is installed at every place, so they stay shared; it is kept float if any of its names is skipped.
    A parameter tied to another module's (a transformers lm_head whose weight is the input embedding's, with
    tie_word_embeddings) cannot stay tied to an int8 copy: quantizing that layer unties them, with a warning; the
    other module (the embedding) keeps the float tensor unchanged. Skip the layer (skip=["lm_head"]) to keep the tie.
    Once untied, model.get_output_embeddings() returns the W8A8Linear, which has no float `weight`: reading it
    raises AttributeError and assigning one (model.tie_weights(), resize_token_embeddings) raises ValueError."""
    if isinstance(skip, str):
        skip = [skip]
    places: Dict[torch.nn.Module, List[str]] = {}  # module -> every name it is used under (modules hash by identity)
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, torch.nn.Linear) or _expert_weights(module) is not None:
            places.setdefault(module, []).append(name)
    holders: Dict[int, List[str]] = {}
    for name, p in _all_named_parameters(model):
        holders.setdefault(id(p), []).append(name)
    for module, names in places.items():
        if any(_skipped(skip, name, module) for name in names):
            continue
        if "" in names:
            raise ValueError("model: is itself a Linear / experts module; use W8A8Linear.from_linear or "
                             "W8A8Experts.from_experts instead")
        for tied, other in _tied_elsewhere(holders, names, module):
            warnings.warn(f"quantize_model: {tied} is tied to {other}; quantizing {names[0]} unties them: it gets an "
                          f"int8 copy, {other} keeps the float tensor. Skip {names[0]} to keep the tie.", stacklevel=2)
        replacement = (W8A8Linear.from_linear(module) if isinstance(module, torch.nn.Linear)
                       else W8A8Experts.from_experts(module))
        for name in names:
            _replace_module(model, name, replacement)
    return model


def _replace_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    """Put `module` at the dotted path `name` of `model` (torch.nn.Module.set_submodule, which torch 1.13 lacks)."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


__all__ = ["W8A8Linear", "W8A8MoE", "W8A8Experts", "quantize_model"]
