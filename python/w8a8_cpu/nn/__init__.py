"""Module-level API: W8A8Linear and quantize_model."""
from __future__ import annotations

import contextlib
import fnmatch
import warnings
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

from .. import _autograd  # the submodule: nn depends on the package's modules, never on its __init__
from .._functions import (MAX_K_ZERO_POINT, _gather_rows, _verified_blob, _verified_panels,
                          check_static_activation_params, fused_experts, int4_weight_values,
                          int8_scaled_mm_with_activations, int8_scaled_mm_with_quant, pack_experts_int4,
                          pack_moe_weights, pack_weight, pack_weight_int4, unpack_weight, weight_channel_sums,
                          weight_scheme)
from .._loader import ops as _ops
from .._packed_weight import header_scheme, header_sizes
from ..quant import gptq_layers
from ..quant.calibration import Calibration
from ..quant.weights import quantize_weight, quantize_weight_int4
from ..scheme import (DYNAMIC, GROUP_SIZE, ActivationScheme, QuantScheme, WeightScheme, check_bool, W4A8 as _W4A8,
                      W8A8 as _W8A8)

SkipSpec = Union[None, Iterable[str], Callable[[str, torch.nn.Module], bool]]


class _Fp32Scales(torch.nn.Module):
    """Keeps the quantization scales fp32 through model.half() / .to(torch.bfloat16): the ops take fp32 scales,
    and rounding a scale to 16 bits would silently shift every output of its channel. Device moves still apply."""

    _fp32_buffers: tuple = ()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # weight-side values loaded into a built layer: refused as at construction (_finite_fp32), before any is set
        for name in (*self._fp32_buffers, "bias"):
            value = state_dict.get(prefix + name)
            if isinstance(value, torch.Tensor) and value.is_floating_point() and not torch.isfinite(value).all():
                raise ValueError(f"{prefix}{name}: contains NaN or Inf")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn, *args, **kwargs):
        before = {name: getattr(self, name) for name in self._fp32_buffers}
        super()._apply(fn, *args, **kwargs)
        for name, scale in before.items():
            after = getattr(self, name)
            if after is not None and after.dtype != torch.float32:
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

    def __init__(self, w_q: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                 input_scale: Optional[torch.Tensor] = None, input_zero_point: Optional[torch.Tensor] = None,
                 symmetric_activations: bool = True):
        super().__init__()
        if w_q.dtype != torch.int8 or w_q.dim() != 2:
            raise ValueError(f"w_q: expected int8 [N, K], got {w_q.dtype} {tuple(w_q.shape)}")
        self.out_features, self.in_features = w_q.shape
        self.register_buffer("weight_packed", pack_weight(w_q.contiguous()))
        self.register_buffer("w_scale", _finite_fp32(w_scale, "w_scale").reshape(-1))
        self.register_buffer("bias", None if bias is None else _finite_fp32(bias, "bias"))
        self.set_activations(input_scale, input_zero_point, symmetric_activations, _w_q=w_q)

    def set_activations(self, input_scale: Optional[torch.Tensor] = None,
                        input_zero_point: Optional[torch.Tensor] = None, symmetric: bool = True, *,
                        _w_q: Optional[torch.Tensor] = None) -> None:
        """Set how forward quantizes its input (activation_scheme): input_scale fp32 [1] when static,
        input_zero_point int32 [1] when static and asymmetric (both saved with the layer), and for asymmetric
        activations the weight's channel sums w_sum (int32 [N], derived from the weight, so not saved)."""
        if not isinstance(symmetric, bool):
            raise ValueError(f"symmetric_activations: expected a bool, got {symmetric!r}")
        if input_scale is not None:
            check_static_activation_params(input_scale, input_zero_point, symmetric)
        elif input_zero_point is not None:
            raise ValueError("input_zero_point: given without input_scale (dynamic activations compute their own)")
        if not symmetric and self.in_features > MAX_K_ZERO_POINT:
            raise ValueError(f"w_q: K = {self.in_features} exceeds {MAX_K_ZERO_POINT}, beyond which asymmetric "
                             f"activations' int32 accumulators could overflow")
        self.symmetric_activations = symmetric
        self.register_buffer("input_scale", None if input_scale is None else
                             input_scale.detach().to(torch.float32).reshape(1).clone())
        self.register_buffer("input_zero_point", None if input_zero_point is None else
                             input_zero_point.detach().to(torch.int32).reshape(1).clone())
        if not symmetric and _w_q is None:
            _w_q = self.int8_weight()
        self.register_buffer("w_sum", None if symmetric else _w_q.sum(dim=1, dtype=torch.int32), persistent=False)
        self._fp32_buffers = ("w_scale",) if input_scale is None else ("w_scale", "input_scale")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        blob = state_dict.get(prefix + "weight_packed")
        if isinstance(blob, torch.Tensor):  # (a missing one is load_state_dict's to report)
            self._check_blob(blob, prefix + "weight_packed")
            if blob.numel() != self.weight_packed.numel():
                # the same weight description (checked), its int4 scales stored in the other width (fp16 or fp32:
                # pack_weight_int4's half_scales): load_state_dict copies into a buffer of the incoming size
                self.weight_packed = self.weight_packed.new_empty(blob.shape)
        if self.input_scale is not None:  # a static scale loaded into a built layer: checked as at construction
            check_static_activation_params(state_dict.get(prefix + "input_scale", self.input_scale),
                                           state_dict.get(prefix + "input_zero_point", self.input_zero_point),
                                           self.symmetric_activations)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self.w_sum is not None:  # derived from the weight, which may just have been replaced
            self.w_sum = weight_channel_sums(self.weight_packed)

    def _check_blob(self, blob: torch.Tensor, name: str) -> None:
        """A blob loaded into this layer must hold what its own does: the same N, K, scheme (int8; int4, with or
        without minimums) and int4 group size. load_state_dict checks only the byte count, which blobs of other
        shapes can share ([32, 132] and [64, 64] int8; int4 g0 [64, 128] and int8 [64, 64]): such a blob loaded,
        and failed only at forward, or for another group size ran as the donor layer under this one's group_size."""
        try:
            raw = _verified_blob(blob, "blob", "pack_weight or pack_weight_int4")
        except ValueError as error:  # the ops' message names "blob", not which of the model's
            raise ValueError(f"{name}: {error}") from error
        mine, theirs = (header_sizes(b)[2:4] + (header_scheme(b),)
                        for b in (self.weight_packed.detach().contiguous(), raw))
        if theirs != mine:
            raise ValueError(f"{name}: holds {_blob_description(*theirs)}; this {type(self).__name__} holds "
                             f"{_blob_description(*mine)} (load the layer's own blob, or build the layer from it)")

    @property
    def activation_scheme(self) -> str:
        """How forward quantizes its input: "token" (dynamic per token, symmetric: the fused op, the default),
        "token-asymmetric" (dynamic per token with a zero point), "tensor" (static: input_scale) or
        "tensor-asymmetric" (static: input_scale and input_zero_point); see quantize_activations."""
        return self.scheme.activations.label

    @property
    def scheme(self) -> QuantScheme:
        """What the layer holds and runs: int8 weights per channel, its input activations as set."""
        return QuantScheme(WeightScheme(), ActivationScheme(static=self.input_scale is not None,
                                                            symmetric=self.symmetric_activations))

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
        # The buffers from nn.Module's dict: attribute reads of buffers go through __getattr__ (~1-2 us each), and a
        # small decode GEMM takes tens of us (SmolLM2: ~120 calls per token).
        buffers = self._buffers
        weight_packed, w_scale, bias = buffers["weight_packed"], buffers["w_scale"], buffers["bias"]
        if buffers["input_scale"] is not None or not self.symmetric_activations:
            input_scale, input_zero_point = buffers["input_scale"], buffers["input_zero_point"]
            # straight-through w.r.t. x; a frozen tensor requiring grad raises at backward (no silent None)
            if _gradient_wanted(x, w_scale, bias, input_scale):
                return _autograd.StaticActivationsLinear.apply(x, weight_packed, w_scale, bias, input_scale,
                                                               input_zero_point, self.symmetric_activations,
                                                               buffers["w_sum"])
            return int8_scaled_mm_with_activations(  # the same outputs without an autograd node (~30 us a call)
                x, weight_packed, w_scale, bias, input_scale=input_scale, input_zero_point=input_zero_point,
                symmetric=self.symmetric_activations, w_sum=buffers["w_sum"])
        # under inference_mode autograd's dispatch keys are off: no Python kernel on the way (dynamo cannot trace the
        # check, hence compiling first)
        if not _is_compiling() and torch.is_inference_mode_enabled():
            return _ops.int8_scaled_mm_with_quant(x, weight_packed, w_scale, bias, None)
        if _below_autograd(x, w_scale, bias):
            with torch._C._AutoDispatchBelowAutograd():  # the op validates its inputs
                return _ops.int8_scaled_mm_with_quant(x, weight_packed, w_scale, bias, None)
        return int8_scaled_mm_with_quant(x, weight_packed, w_scale, bias)

    def int8_weight(self) -> torch.Tensor:
        """The int8 [N, K] weight (unpacked from the packed buffer; used to save checkpoints)."""
        return unpack_weight(self.weight_packed)

    def extra_repr(self) -> str:
        activations = "" if self.activation_scheme == "token" else f", activations={self.activation_scheme}"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}" + \
            activations


class W4A8Linear(W8A8Linear):
    """Linear layer with int4 weights in groups along K (fp32 scale, optionally a minimum, per group) and per-token
    int8 activations: W8A8Linear's forward and op on a blob of the int4 scheme (pack_weight_int4: the scheme is the
    blob's, so every op, variant and the driver serve both). w_scale [N] multiplies each output channel on top (ones
    unless a checkpoint's layer has one). Each group's int32 products are exact; groups combine in fp32 in one
    fixed order (docs/ARCHITECTURE.md), identical on every variant."""

    _NO_FLOAT_WEIGHT = ("W4A8Linear has no float weight: it holds int4 weights with group scales, packed "
                        "(int4_weight() gives them back)")

    def __init__(self, q: torch.Tensor, group_scale: torch.Tensor, group_min: Optional[torch.Tensor], group_size: int,
                 bias: Optional[torch.Tensor] = None, w_scale: Optional[torch.Tensor] = None, *,
                 weights: Optional[WeightScheme] = None):
        """weights: how the values were made, reported by `scheme` (default: to nearest, with integer zero points
        when group_min is given); it must agree with group_size and group_min."""
        _Fp32Scales.__init__(self)
        if q.dtype != torch.int8 or q.dim() != 2:
            raise ValueError(f"q: expected int8 [N, K] holding [-8, 7], got {q.dtype} {tuple(q.shape)}")
        self.out_features, self.in_features = q.shape
        self.group_size = group_size
        self._weights = _int4_form(weights, group_size, group_min)
        self.register_buffer("weight_packed", pack_weight_int4(q.contiguous(), group_scale, group_min, group_size))
        scale = torch.ones(q.shape[0]) if w_scale is None else w_scale
        self.register_buffer("w_scale", _finite_fp32(scale, "w_scale").reshape(-1))
        self.register_buffer("bias", None if bias is None else _finite_fp32(bias, "bias"))
        super().set_activations()

    def set_activations(self, input_scale: Optional[torch.Tensor] = None,
                        input_zero_point: Optional[torch.Tensor] = None, symmetric: bool = True, **_) -> None:
        if input_scale is not None or input_zero_point is not None or symmetric is not True:
            raise ValueError("W4A8Linear takes dynamic per-token symmetric activations only (the int4 ops quantize "
                             "them); static or asymmetric activations need int8 weights (W8A8Linear)")

    @property
    def scheme(self) -> QuantScheme:
        return QuantScheme(self._weights, DYNAMIC)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, group_size: int = GROUP_SIZE, symmetric: bool = True,
                    min_max: bool = False) -> "W4A8Linear":
        """Round-to-nearest int4 of the float weight per group (quantize_weight_int4; quantize_model with calibration
        rounds with GPTQ)."""
        if not isinstance(linear, torch.nn.Linear):
            raise ValueError(f"linear: expected torch.nn.Linear, got {type(linear).__name__}")
        weights = QuantScheme(WeightScheme(4, group_size, symmetric, min_max)).validate().weights
        q, scale, minimum = quantize_weight_int4(linear.weight, group_size, symmetric, min_max)
        return cls(q, scale, minimum, group_size, linear.bias, weights=weights)

    def int8_weight(self) -> torch.Tensor:
        raise ValueError("W4A8Linear holds int4 weights with group scales, not an int8 weight with channel scales: "
                         "use int4_weight()")

    def int4_weight(self) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], int]:
        """(q int8 [N, K] in [-8, 7], group scales [N, groups], group minimums or None, group size) from the blob."""
        return int4_weight_values(self.weight_packed)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"int4 groups of {self.group_size or self.in_features}")


def _int4_form(weights: Optional[WeightScheme], group_size: int, group_min: Optional[torch.Tensor]) -> WeightScheme:
    """An int4 layer's weight scheme: `weights` as given (validated, agreeing with the values' group size and
    symmetry), or by default the one the values state (to nearest, integer zero points)."""
    held = WeightScheme(4, group_size, symmetric=group_min is None)
    if weights is None:
        return held
    QuantScheme(weights).validate()
    if (weights.bits, weights.group_size, weights.symmetric) != (4, group_size, group_min is None):
        raise ValueError(f"weights: {weights} does not describe int4 values in groups of {group_size}, "
                         f"{'symmetric' if group_min is None else 'with minimums'}")
    return weights


def _blob_description(n: int, k: int, weights: WeightScheme) -> str:
    """A packed weight's header values (header_sizes' n, k and header_scheme) in words."""
    if weights.bits == 8:
        return f"an int8 [{n}, {k}] weight"
    group = weights.group_size
    return (f"an int4 [{n}, {k}] weight {f'in groups of {group}' if group else 'per channel'}, "
            f"{'symmetric' if weights.symmetric else 'with group minimums'}")


def _rows_of(weight_packed: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor], begin: int,
             end: int) -> W8A8Linear:
    """Output channels [begin, end) of a packed weight (its scheme read from the blob) with its w_scale and bias, as
    a layer of its own: W8A8Linear, or W4A8Linear for an int4 blob."""
    bias = None if bias is None else bias[begin:end]
    if weight_scheme(weight_packed) == "int4":
        q, scale, minimum, group = int4_weight_values(weight_packed)
        return W4A8Linear(q[begin:end], scale[begin:end], None if minimum is None else minimum[begin:end], group, bias,
                          w_scale[begin:end])
    return W8A8Linear(unpack_weight(weight_packed)[begin:end], w_scale[begin:end], bias)


def _concatenated(parts: List[W8A8Linear]) -> W8A8Linear:
    """One layer over the parts' output channels, in order, of their scheme (all W8A8Linear, or all W4A8Linear of one
    group size and symmetry): its outputs are the parts' outputs side by side, bit for bit."""
    bias = torch.cat([p.bias for p in parts]) if parts[0].bias is not None else None
    w_scale = torch.cat([p.w_scale for p in parts])
    if type(parts[0]) is W8A8Linear:
        return W8A8Linear(torch.cat([p.int8_weight() for p in parts]), w_scale, bias)
    values = [p.int4_weight() for p in parts]
    mins = None if values[0][2] is None else torch.cat([v[2] for v in values])
    return W4A8Linear(torch.cat([v[0] for v in values]), torch.cat([v[1] for v in values]), mins, values[0][3], bias,
                      w_scale, weights=parts[0].scheme.weights)


def _same_scheme(parts) -> bool:
    """Whether the layers can be concatenated: one class, one input size, biases alike, and one scheme, with dynamic
    per-token symmetric activations (the fused ops quantize them so)."""
    kinds = {type(p) for p in parts}
    if len(kinds) != 1 or not kinds <= {W8A8Linear, W4A8Linear} or len({p.in_features for p in parts}) != 1 or \
            len({p.bias is None for p in parts}) != 1:
        return False
    schemes = {p.scheme for p in parts}
    return len(schemes) == 1 and schemes.pop().activations == DYNAMIC


def _below_autograd(x: torch.Tensor, *tracked) -> bool:
    """Whether a forward may call the op below the Python autograd kernel (~8 us per call there; a decoder LLM makes
    ~200 such calls per token): no gradient wanted and not tracing. Older torch (no Python autograd kernels,
    _autograd.AVAILABLE false) needs no detour, and its _AutoDispatchBelowAutograd is no context manager."""
    return _autograd.AVAILABLE and isinstance(x, torch.Tensor) and not _gradient_wanted(x, *tracked) and \
        not _is_compiling()


def _gradient_wanted(*tensors) -> bool:
    """Whether autograd is on and some of the tensors requires a gradient."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


class W8A8LinearSlice(torch.nn.Module):
    """Output channels [begin, end) of a W8A8Linear shared by several slices: q_proj, k_proj and v_proj of one
    attention layer as one GEMM over their concatenated channels (fuse_projections). Called with the same input
    tensor as the previous slice of its layer (the same object, unmodified: its version counter is unchanged), it
    returns its part of that call's output instead of running the GEMM again. Inference tensors have no version
    counter: for them the slices rely on what attention modules do, no in-place edit of the input between the q, k
    and v calls of one layer. Per-channel weights and per-token
    activations make the concatenation exact: each slice returns the bits its own W8A8Linear would.

    The last input and output of the shared layer are held until the next call (one entry, replaced atomically, so
    concurrent callers with other inputs only recompute). Under torch.compile every slice runs the GEMM itself."""

    def __init__(self, fused: W8A8Linear, begin: int, end: int, shared_cache: list):
        super().__init__()
        if not 0 <= begin < end <= fused.out_features:
            raise ValueError(f"begin, end: [{begin}, {end}) is not a channel range of a layer with "
                             f"{fused.out_features} output channels")
        self.fused, self.begin, self.end = fused, begin, end
        self.in_features, self.out_features = fused.in_features, end - begin
        self._cache = shared_cache  # [(input, its version, output)] or [], shared by the slices of one layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _is_compiling() or (torch.is_grad_enabled() and x.requires_grad):
            return self.fused(x)[..., self.begin:self.end]
        version = None if x.is_inference() else x._version
        entry = self._cache[0] if self._cache else None
        if entry is None or entry[0] is not x or entry[1] != version:
            entry = (x, version, self.fused(x))
            self._cache[:] = [entry]
        return entry[2][..., self.begin:self.end]

    @property
    def w_scale(self) -> torch.Tensor:
        return self.fused.w_scale[self.begin:self.end]

    @property
    def bias(self) -> Optional[torch.Tensor]:
        return None if self.fused.bias is None else self.fused.bias[self.begin:self.end]

    def int8_weight(self) -> torch.Tensor:
        """This slice's int8 [end - begin, K] weight (to save checkpoints with the unfused layer names)."""
        return self.fused.int8_weight()[self.begin:self.end]

    def layer(self) -> W8A8Linear:
        """This slice as a layer of its own (W8A8Linear or W4A8Linear: to save checkpoints with the unfused names)."""
        return _rows_of(self.fused.weight_packed, self.fused.w_scale, self.fused.bias, self.begin, self.end)

    def extra_repr(self) -> str:
        return f"channels [{self.begin}, {self.end}) of a fused {self.fused.out_features}-channel W8A8Linear"


class W8A8GatedMLP(_Fp32Scales):
    """A SwiGLU MLP (down(silu(gate(x)) * up(x)): Llama, Mistral, Qwen, ...) with the gate and up projections as one
    W8A8 GEMM, SiLU-and-multiply fused after its epilogue (int8_gated_mm_with_quant), then the W8A8 down projection.
    gate and up are bit for bit what separate W8A8Linear layers give; the SiLU is the fused MoE's (within a few ulp of
    torch's), so outputs differ from the unfused module in the last bits of the activation."""

    _fp32_buffers = ("gate_up_scale",)

    def __init__(self, gate_up: W8A8Linear, down_proj: W8A8Linear):
        """gate_up: one W8A8Linear (or W4A8Linear) over the gate's output channels, then the up's."""
        super().__init__()
        if not isinstance(gate_up, W8A8Linear) or gate_up.out_features % 2:
            raise ValueError(f"gate_up: expected a W8A8Linear or W4A8Linear of 2I output channels (gate rows, then up "
                             f"rows), got {type(gate_up).__name__} {getattr(gate_up, 'out_features', '')}")
        self.intermediate_size, self.hidden_size = gate_up.out_features // 2, gate_up.in_features
        if down_proj.in_features != self.intermediate_size:
            raise ValueError(f"down_proj: expects {down_proj.in_features} input features, the gate/up projection gives "
                             f"{self.intermediate_size}")
        self.register_buffer("gate_up_packed", gate_up.weight_packed)
        self.register_buffer("gate_up_scale", gate_up.w_scale)
        self.register_buffer("gate_up_bias", gate_up.bias)
        self.down_proj = down_proj

    @classmethod
    def from_mlp(cls, mlp: torch.nn.Module) -> "W8A8GatedMLP":
        """From a module with gate_proj / up_proj / down_proj (nn.Linear or W8A8Linear) and a SiLU act_fn."""
        parts = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(p, (torch.nn.Linear, W8A8Linear)) for p in parts) or not is_silu(
                getattr(mlp, "act_fn", None) or (lambda t: t)):
            raise ValueError(f"mlp: {type(mlp).__name__} is not a SiLU-gated MLP with gate_proj / up_proj / down_proj")
        gate, up, down = (p if isinstance(p, W8A8Linear) else W8A8Linear.from_linear(p) for p in parts)
        if (gate.bias is None) != (up.bias is None):
            raise ValueError("mlp: gate_proj and up_proj must both have a bias or neither")
        if not _same_scheme([gate, up]):
            raise ValueError("mlp: gate_proj and up_proj must have one weight scheme (W8A8, or W4A8 of one group size)")
        return cls(_concatenated([gate, up]), down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The op has no gradient: its autograd kernel raises at backward (without one, the MLP's branch dropped out of
        # a model's gradient silently). Below it when no gradient is wanted (see W8A8Linear.forward).
        buffers = self._buffers  # not through __getattr__ (see W8A8Linear.forward)
        args = (x, buffers["gate_up_packed"], buffers["gate_up_scale"], buffers["gate_up_bias"], None)
        if _below_autograd(x, *args[2:4]):
            with torch._C._AutoDispatchBelowAutograd():
                act = _ops.int8_gated_mm_with_quant(*args)
        else:
            act = _ops.int8_gated_mm_with_quant(*args)
        return self._modules["down_proj"](act)

    def projections(self) -> Dict[str, W8A8Linear]:
        """{"gate_proj" | "up_proj": the unfused layer (W8A8Linear or W4A8Linear)}, for checkpoints that keep the
        per-layer names."""
        i, parts = self.intermediate_size, (self.gate_up_packed, self.gate_up_scale, self.gate_up_bias)
        return {"gate_proj": _rows_of(*parts, 0, i), "up_proj": _rows_of(*parts, i, 2 * i)}

    def extra_repr(self) -> str:
        return f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, gate/up fused"


class ColumnScaledEmbedding(_Fp32Scales, torch.nn.Embedding):
    """A token embedding whose table holds each column c times s_c, read as table rows * column_scale (1 / s, fp32,
    then cast to the table's dtype): what SmoothQuant's fold into the output layer (smooth_quant(...,
    output_alpha=...)) leaves when that layer is tied to the embedding. The output layer's input channels are
    multiplied by s in the one shared table (the final norm's output divided by s), and the embedding reads it back
    unscaled, so the model keeps one table and its function."""

    _fp32_buffers = ("column_scale",)

    def __init__(self, embedding: torch.nn.Embedding, column_scale: torch.Tensor):
        if embedding.max_norm is not None:
            raise ValueError("embedding: an embedding with max_norm renormalizes the rows it reads; a column scale "
                             "cannot fold into it")
        super().__init__(embedding.num_embeddings, embedding.embedding_dim, embedding.padding_idx,
                         sparse=embedding.sparse, device="meta")
        self.weight = embedding.weight  # the same Parameter: a tie to the output layer stays a tie
        self.register_buffer("column_scale", _column_scale(column_scale, embedding.embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (super().forward(ids).float() * self.column_scale).to(self.weight.dtype)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", column-scaled"


def _column_scale(column_scale: torch.Tensor, embedding_dim: int) -> torch.Tensor:
    scale = _finite_fp32(column_scale, "column_scale").reshape(-1)
    if scale.numel() != embedding_dim or not (scale > 0).all():
        raise ValueError(f"column_scale: expected {embedding_dim} positive values, got {scale.numel()}"
                         f"{'' if scale.numel() != embedding_dim else ' with some <= 0'}")
    return scale


class W8A8Embedding(_Fp32Scales):
    """A token embedding held as an int8 [V, H] table with one fp32 scale per row (per-row symmetric, the weights'
    rounding rule), read by gathering rows and dequantizing (int8 * scale, fp32, cast to `dtype`); with a
    column_scale (from a ColumnScaledEmbedding), the fp32 rows are then multiplied by it.

    The table is a packed weight blob, so the same tensors can also serve a W8A8Linear lm_head tied to this
    embedding (quantize_model(..., quantize_embedding=True)): the model holds one int8 copy for both."""

    _fp32_buffers = ("w_scale", "column_scale")

    def __init__(self, weight_packed: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                 column_scale: Optional[torch.Tensor] = None):
        super().__init__()
        panels, self.num_embeddings, self.embedding_dim = _verified_panels(weight_packed, "weight_packed")
        self.register_buffer("weight_packed", weight_packed)
        self.register_buffer("w_scale", _finite_fp32(w_scale, "w_scale").reshape(-1))
        if self.w_scale.numel() != self.num_embeddings:
            raise ValueError(f"w_scale: expected {self.num_embeddings} row scales, got {self.w_scale.numel()}")
        self.register_buffer("column_scale", None if column_scale is None else
                             _column_scale(column_scale, self.embedding_dim))
        self.dtype = dtype
        self._panels = (weight_packed, panels)  # the checked view of the blob it was made from

    def _apply(self, fn, *args, **kwargs):
        # the output dtype follows the model's as a float table would (model.to(bfloat16) after quantize_model: it
        # stayed fp32, and so did every logit after it, silently)
        super()._apply(fn, *args, **kwargs)
        self.dtype = fn(torch.empty(0, dtype=self.dtype)).dtype
        return self

    def __getstate__(self):
        # not the int8 view of the blob: torch.save refuses two views of one storage as different dtypes (forward
        # checks the blob again and views it)
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        return {**state, "_panels": (None, None)}

    @classmethod
    def from_embedding(cls, embedding: torch.nn.Embedding) -> "W8A8Embedding":
        if getattr(embedding, "max_norm", None) is not None:  # a lookup that renormalizes rows: not a table read
            raise ValueError(f"embedding: max_norm={embedding.max_norm} renormalizes the rows it reads; W8A8Embedding "
                             f"reads a fixed table (keep this embedding float)")
        w_q, w_scale = quantize_weight(embedding.weight)
        return cls(pack_weight(w_q), w_scale, embedding.weight.dtype, getattr(embedding, "column_scale", None))

    @classmethod
    def sharing(cls, lm_head: W8A8Linear, dtype: torch.dtype,
                column_scale: Optional[torch.Tensor] = None) -> "W8A8Embedding":
        """The embedding read from a W8A8Linear's own int8 weight and scales (one copy for both)."""
        if lm_head.bias is not None:
            raise ValueError("lm_head: a layer with a bias cannot double as an embedding table")
        embedding = cls(lm_head.weight_packed, lm_head.w_scale, dtype, column_scale)
        embedding.w_scale = lm_head.w_scale  # the same tensor, not a checked copy of it: one table, one set of scales
        return embedding

    def _scaled(self, rows: torch.Tensor) -> torch.Tensor:
        return (rows if self.column_scale is None else rows * self.column_scale).to(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _ops._verify_packed_weight(self.weight_packed)  # cached per tensor version, as the GEMM ops do
        blob, panels = self._panels
        if blob is not self.weight_packed:  # replaced since (load_state_dict, to()): check the new blob
            panels = _verified_panels(self.weight_packed, "weight_packed")[0]
            self._panels = (self.weight_packed, panels)
        rows = _gather_rows(panels, self.num_embeddings, self.embedding_dim, ids, "ids")
        return self._scaled(rows * self.w_scale[ids].unsqueeze(-1))

    def dequantized(self) -> torch.Tensor:
        """The whole table as floats [V, H] in `dtype` (int8 * row scale in fp32, times the column scale, then cast):
        what checkpoints store, so that float readers (transformers, vLLM) read the model's embedding."""
        return self._scaled(unpack_weight(self.weight_packed).float() * self.w_scale.unsqueeze(1))

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, int8 rows"
                f"{'' if self.column_scale is None else ', column-scaled'}, dtype={self.dtype}")


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

    @staticmethod
    def _quantize_experts_int4(w: torch.Tensor, group_size: int, symmetric: bool, min_max: bool):
        """(q [E, N, K], group scales [E, N, groups], group minimums or None) of float experts [E, N, K]: each
        channel's groups along K as quantize_weight_int4 quantizes a Linear weight's."""
        e, n, k = w.shape
        values = quantize_weight_int4(w.reshape(e * n, k), group_size, symmetric, min_max)
        return tuple(None if v is None else v.reshape(e, n, -1) for v in values)

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


def _silu_expert_weights(experts: torch.nn.Module):
    """(gate_up_proj, down_proj) of a transformers fused-experts module that the fused experts can run (SiLU-gated,
    nothing more), else ValueError."""
    weights = _expert_weights(experts)
    if weights is None:
        raise ValueError(f"experts: {type(experts).__name__} has no 3-D gate_up_proj / down_proj parameters")
    gate_up, down = weights
    e, inter2, hidden = gate_up.shape
    # the probe runs [E, 2I, H] / [E, H, I] experts; another layout (Llama4's transposed [E, H, 2I]) is refused by
    # _take_shapes, with the shapes in the message
    if inter2 % 2 == 0 and down.shape == (e, hidden, inter2 // 2):
        _require_plain_silu_experts(experts, gate_up[0], down[0])
    return weights


def _require_plain_silu_experts(experts: torch.nn.Module, gate_up_e: torch.Tensor, down_e: torch.Tensor) -> None:
    """ValueError unless the fused experts can stand in for `experts`: a SiLU act_fn (is_silu) and a forward that
    computes down(silu(gate) * up) and nothing more (_computes_plain_silu_experts, on one expert's weights
    gate_up_e [2I, H] and down_e [H, I] of any dtype: the module's own, or the stored integer ones when its own are on
    the meta device, as in the checkpoint loader). The message names the module's class; callers prefix its name."""
    act = experts.act_fn
    if not is_silu(act):
        raise ValueError(f"experts: {type(experts).__name__} uses activation {type(act).__name__}; the fused "
                         f"W8A8 experts implement SiLU-gated experts only")
    if not _computes_plain_silu_experts(experts, gate_up_e, down_e):
        raise ValueError(f"experts: {type(experts).__name__} computes more than silu(gate) * up (a clamp or scale: "
                         f"DeepSeek-V4's swiglu_limit, Step3p7's limit), which the fused W8A8 experts would drop; keep "
                         f"it float: skip it in quantize_model (skip=[its name], or a glob such as '*.experts')")


class W8A8Experts(_Fp32Scales):
    """Drop-in for a transformers fused-experts module (MixtralExperts, Qwen2MoeExperts, Qwen3MoeExperts):
    forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H] through fused_experts.

    The model's own router stays in charge of routing (softmax, top-k and its renormalisation rule); only the
    expert GEMMs run in W8A8. w13 [E, 2I, H] holds gate rows then up rows, w2 [E, H, I]; SiLU-gated."""

    _fp32_buffers = ("w13_scale", "w2_scale")

    def __init__(self, w13_q: torch.Tensor, w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor):
        super().__init__()
        self._take_shapes(w13_q, w2_q)
        self._hold(*pack_moe_weights(w13_q, w2_q), w13_scale, w2_scale)

    def _take_shapes(self, w13_q: torch.Tensor, w2_q: torch.Tensor) -> None:
        """The experts' sizes from w13 [E, 2I, H] and w2 [E, H, I] (int8 values, int4 ones included)."""
        for name, w in (("w13_q", w13_q), ("w2_q", w2_q)):
            if w.dtype != torch.int8 or w.dim() != 3:
                raise ValueError(f"{name}: expected int8 [E, N, K], got {w.dtype} {tuple(w.shape)}")
        self.num_experts, inter2, self.hidden_dim = w13_q.shape
        if inter2 % 2 or w2_q.shape != (self.num_experts, self.hidden_dim, inter2 // 2):
            raise ValueError(f"w13_q {tuple(w13_q.shape)} and w2_q {tuple(w2_q.shape)}: expected [E, 2I, H] and "
                             f"[E, H, I]")
        self.intermediate_dim = inter2 // 2

    def _hold(self, w13_packed: torch.Tensor, w2_packed: torch.Tensor, w13_scale: torch.Tensor,
              w2_scale: torch.Tensor) -> None:
        self.register_buffer("w13_packed", w13_packed)
        self.register_buffer("w2_packed", w2_packed)
        self.register_buffer("w13_scale", _finite_fp32(w13_scale, "w13_scale").reshape(self.num_experts,
                                                                                        2 * self.intermediate_dim))
        self.register_buffer("w2_scale", _finite_fp32(w2_scale, "w2_scale").reshape(self.num_experts,
                                                                                     self.hidden_dim))

    @classmethod
    def from_experts(cls, experts: torch.nn.Module) -> "W8A8Experts":
        gate_up, down = _silu_expert_weights(experts)
        return cls(*W8A8MoE._quantize_experts(gate_up), *W8A8MoE._quantize_experts(down))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return fused_experts(hidden_states, self.w13_packed, self.w2_packed, top_k_weights.float(), top_k_index,
                             self.w13_scale, self.w2_scale)

    def int8_weights(self, experts: slice = slice(None)):
        """(w13 int8 [E, 2I, H], w2 int8 [E, H, I]) of `experts` (all by default), unpacked from the packed buffers
        (to save checkpoints, to shard)."""
        return (torch.stack([unpack_weight(b) for b in self.w13_packed[experts]]),
                torch.stack([unpack_weight(b) for b in self.w2_packed[experts]]))

    @property
    def scheme(self) -> QuantScheme:
        """What the experts hold and run: int8 weights per channel, dynamic per-token symmetric activations."""
        return _W8A8

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden_dim}, intermediate={self.intermediate_dim}"


class W4A8Experts(W8A8Experts):
    """W8A8Experts with int4 experts (W4A8: int4 weights in groups along K with fp32 group scales, optionally
    minimums, per-token int8 activations): each expert's w13 and w2 one blob of the int4 scheme (pack_experts_int4),
    run by the same forward and op; each projection is bit for bit what W4A8Linear computes for it. w13_scale /
    w2_scale [E, N] multiply on top (ones unless given)."""

    def __init__(self, w13_q: torch.Tensor, w13_group_scale: torch.Tensor, w13_group_min: Optional[torch.Tensor],
                 w2_q: torch.Tensor, w2_group_scale: torch.Tensor, w2_group_min: Optional[torch.Tensor],
                 group_size: int, w13_scale: Optional[torch.Tensor] = None, w2_scale: Optional[torch.Tensor] = None,
                 *, weights: Optional[WeightScheme] = None):
        """w13_q [E, 2I, H] and w2_q [E, H, I] int8 holding [-8, 7]; group scales / minimums [E, N, groups] per group
        of group_size k (0: per channel), as _quantize_experts_int4 gives them; weights: as W4A8Linear's."""
        _Fp32Scales.__init__(self)
        self._take_shapes(w13_q, w2_q)
        self.group_size = group_size
        self._weights = _int4_form(weights, group_size, w13_group_min)
        self._hold(pack_experts_int4(w13_q, w13_group_scale, w13_group_min, group_size),
                   pack_experts_int4(w2_q, w2_group_scale, w2_group_min, group_size),
                   torch.ones(w13_q.shape[:2]) if w13_scale is None else w13_scale,
                   torch.ones(w2_q.shape[:2]) if w2_scale is None else w2_scale)

    @classmethod
    def from_experts(cls, experts: torch.nn.Module, group_size: int = GROUP_SIZE, symmetric: bool = True,
                     min_max: bool = False) -> "W4A8Experts":
        """Round-to-nearest int4 of the float experts per group (quantize_weight_int4's rules)."""
        weights = QuantScheme(WeightScheme(4, group_size, symmetric, min_max)).validate().weights
        gate_up, down = _silu_expert_weights(experts)
        return cls(*W8A8MoE._quantize_experts_int4(gate_up, group_size, symmetric, min_max),
                   *W8A8MoE._quantize_experts_int4(down, group_size, symmetric, min_max), group_size, weights=weights)

    @property
    def scheme(self) -> QuantScheme:
        return QuantScheme(self._weights, DYNAMIC)

    def int8_weights(self, experts: slice = slice(None)):
        raise ValueError("W4A8Experts holds int4 experts with group scales, not int8 ones with channel scales: use "
                         "int4_weights()")

    def int4_weights(self, experts: slice = slice(None)):
        """Per projection (w13, then w2), the int4 values of `experts` (all by default) from the blobs: (q int8 [E, N,
        K] in [-8, 7], group scales [E, N, groups], group minimums or None, group size)."""
        def stacked(blobs: torch.Tensor):
            values = [int4_weight_values(blob) for blob in blobs[experts]]
            mins = None if values[0][2] is None else torch.stack([v[2] for v in values])
            return torch.stack([v[0] for v in values]), torch.stack([v[1] for v in values]), mins, values[0][3]

        return stacked(self.w13_packed), stacked(self.w2_packed)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, int4 groups of {self.group_size or 'a whole channel'}"


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


SCHEMES = {"w8a8": _W8A8, "w4a8": _W4A8}  # quantize_model's scheme names (the keyword form)


def quantize_model(model: torch.nn.Module, skip: SkipSpec = None, *, quantize_embedding: bool = False,
                   fuse: bool = False, scheme: Union[str, QuantScheme] = "w8a8", group_size: Optional[int] = None,
                   symmetric: Optional[bool] = None, min_max: Optional[bool] = None,
                   calibration: Optional[Calibration] = None,
                   on_layer: Optional[Callable[[int, int], None]] = None) -> torch.nn.Module:
    """Replace every nn.Linear in `model` (in place) with W8A8Linear, and every transformers fused-experts module
    (Mixtral / Qwen2-MoE / Qwen3-MoE `experts`) with W8A8Experts; return the model.

    scheme: a QuantScheme (w8a8_cpu.scheme: W8A8, W8A8_STATIC, W4A8, W4A8_GPTQ, ... or one of your own), or the
    keyword form: "w8a8" (default) or "w4a8" with group_size (default 32), symmetric and min_max changing its int4
    weights (under "w8a8" they must stay unset or at int8's values) and calibration rounding them with GPTQ.
    int4 weights: the Linear layers become W4A8Linear and the fused-experts modules W4A8Experts instead
    (int4 per group of group_size k, 0: per channel; symmetric, or asymmetric with an integer zero point, or min_max:
    quantize_weight_int4; the experts' w13 and w2 alike, always rounded to nearest), except an output layer that
    shares its table with the int8 embedding (quantize_embedding=True), which stays W8A8. Static activations
    (W8A8_STATIC, W8A8_STATIC_ASYMMETRIC): each W8A8Linear then gets its scale (and zero point) from its input's range
    on the calibration inputs (calibrate_static_activations; fused layers stay dynamic); dynamic asymmetric
    activations: each W8A8Linear quantizes each token with a zero point. layer.scheme reports what each layer holds.

    calibration: the inputs of the scheme's calibrated steps (required by GPTQ rounding and static activations,
    refused otherwise). Model inputs (token ids [B, T], checked against config.vocab_size when the model has one), an
    iterable of such batches, or (GPTQ only) a callable(model) that runs the model (inputs of another form); a batch
    the model cannot run is a ValueError naming it. GPTQ: one run of the float model records each int4 layer's input
    second moment (its Hessian), and each layer is then rounded by quantize_weight_int4 with it, to minimize its
    output error on those inputs. on_layer(i, n) is called after each of the n layers GPTQ rounds (a progress bar:
    SmolLM2-135M takes ~40 s on 2 threads, its calibration run included).

    skip: module-name glob patterns (e.g. ["lm_head", "*.gate"]) or a callable(name, module) -> bool
    selecting layers to keep in floating point. What quantize_model cannot run in W8A8 is refused (ValueError naming
    the layer, before any layer is replaced) unless skipped, so that no layer is left float silently: transformers'
    Conv1D (GPT-2), and experts that compute more than silu(gate) * up (DeepSeek-V4's clamp).

    quantize_embedding: also hold the input token embedding (model.get_input_embeddings(), a transformers model's)
    as an int8 table with per-row scales (W8A8Embedding). When the output layer is tied to it and not skipped, both
    share one int8 table: the lm_head GEMM and the embedding lookup read the same tensors, one copy; a tied output
    layer kept float (skipped) is refused: the int8 embedding would untie it.

    fuse: also fuse each attention layer's q_proj / k_proj / v_proj into one GEMM (W8A8LinearSlice) and each SwiGLU
    MLP's gate_proj / up_proj into one GEMM with SiLU-and-multiply after it (W8A8GatedMLP); see fuse_projections.

    A module used at several places (one nn.Linear instance applied twice) is quantized once and the same
    replacement is installed at every place, so they stay shared; it is kept float if any of its names is skipped.
    A parameter tied to another module's (a transformers lm_head whose weight is the input embedding's, with
    tie_word_embeddings) cannot stay tied to an int8 copy: without quantize_embedding, quantizing that layer unties
    them, with a warning; the other module (the embedding) keeps the float tensor unchanged. Skip the layer
    (skip=["lm_head"]) to keep the float tie. Once quantized, model.get_output_embeddings() returns the W8A8Linear,
    which has no float `weight`: reading it raises AttributeError and assigning one (model.tie_weights(),
    resize_token_embeddings) raises ValueError."""
    scheme = _model_scheme(scheme, group_size, symmetric, min_max, calibration)
    weights, activations = scheme.weights, scheme.activations
    group_size, symmetric, min_max = weights.group_size, weights.symmetric, weights.min_max
    check_bool("quantize_embedding", quantize_embedding)
    check_bool("fuse", fuse)
    if isinstance(skip, str):
        skip = [skip]
    embedding = _input_embedding(model) if quantize_embedding else None
    places: Dict[torch.nn.Module, List[str]] = {}  # module -> every name it is used under (modules hash by identity)
    transposed: Dict[torch.nn.Module, List[str]] = {}  # the same for GPT-2's Conv1D layers, which are not supported
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, torch.nn.Linear) or _expert_weights(module) is not None:
            places.setdefault(module, []).append(name)
        elif type(module).__name__ == "Conv1D":  # transformers.pytorch_utils.Conv1D: weight [in, out], no nn.Linear
            transposed.setdefault(module, []).append(name)
    for module, names in transposed.items():
        if not any(_skipped(skip, name, module) for name in names):  # left float, the model "W8A8" in name only
            raise ValueError(f"{names[0]}: {type(module).__name__} (transformers' transposed linear of GPT-2 and its "
                             f"kin, weight [in, out]) is not supported by quantize_model; skip these layers to keep "
                             f"them float (skip=['{names[0]}', ...] or a callable)")
    holders: Dict[int, List[str]] = {}
    for name, p in _all_named_parameters(model):
        holders.setdefault(id(p), []).append(name)
    shares_embedding = None  # the W8A8Linear tied to the embedding, which the int8 embedding reads
    chosen: Dict[torch.nn.Module, Tuple[List[str], bool]] = {}  # what is quantized: its names, tied to the embedding
    int4: Dict[torch.nn.Linear, str] = {}  # the Linear layers that become W4A8Linear, by their first name
    for module, names in places.items():
        if any(_skipped(skip, name, module) for name in names):
            continue
        if "" in names:
            raise ValueError("model: is itself a Linear / experts module; use W8A8Linear.from_linear or "
                             "W8A8Experts.from_experts instead")
        if not isinstance(module, torch.nn.Linear):  # refused before any layer is replaced: the model stays whole
            try:
                _silu_expert_weights(module)
            except ValueError as error:
                raise ValueError(f"{names[0]}: {error}") from error
        tied_to_embedding = embedding is not None and getattr(module, "weight", None) is embedding.weight
        for tied, other in _tied_elsewhere(holders, names, module):
            if not tied_to_embedding:
                warnings.warn(f"quantize_model: {tied} is tied to {other}; quantizing {names[0]} unties them: it gets "
                              f"an int8 copy, {other} keeps the float tensor. Skip {names[0]} to keep the tie, or "
                              f"pass quantize_embedding=True to share one int8 table.", stacklevel=2)
        chosen[module] = names, tied_to_embedding
        if weights.bits == 4 and not tied_to_embedding and isinstance(module, torch.nn.Linear):
            int4[module] = names[0]
    if embedding is not None:
        _check_table_shared(model, embedding, holders, chosen)
    # GPTQ measures on the float model, before any layer is replaced
    gptq = gptq_layers.round_with_gptq(model, int4, calibration, group_size, symmetric, min_max, on_layer) \
        if weights.rounding == "gptq" else {}
    for module, (names, tied_to_embedding) in chosen.items():
        try:  # the layer's name in the error (a NaN weight): "w: ..." alone does not say which of hundreds
            if not isinstance(module, torch.nn.Linear):
                replacement = W4A8Experts.from_experts(module, group_size, symmetric, min_max) \
                    if weights.bits == 4 else W8A8Experts.from_experts(module)
            elif module in gptq:
                replacement = W4A8Linear(*gptq.pop(module), group_size, module.bias, weights=weights)
            elif module in int4:
                replacement = W4A8Linear.from_linear(module, group_size, symmetric, min_max)
            else:
                replacement = W8A8Linear.from_linear(module)
        except ValueError as error:
            raise ValueError(f"{names[0]}: {error}") from error
        if tied_to_embedding:
            shares_embedding = replacement
        for name in names:
            _replace_module(model, name, replacement)
    if embedding is not None:
        model.set_input_embeddings(W8A8Embedding.sharing(shares_embedding, embedding.weight.dtype,
                                                         getattr(embedding, "column_scale", None))
                                   if shares_embedding is not None else W8A8Embedding.from_embedding(embedding))
    if fuse:
        fuse_projections(model)
    if activations.static:
        from ..quant.static_activations import calibrate_static_activations  # lazily: it builds on nn

        calibrate_static_activations(model, calibration, symmetric=activations.symmetric)
    elif not activations.symmetric:
        for layer in activation_layers(model).values():
            layer.set_activations(symmetric=False)
    return model


def _model_scheme(scheme: Union[str, QuantScheme], group_size: Optional[int], symmetric: Optional[bool],
                  min_max: Optional[bool], calibration) -> QuantScheme:
    """quantize_model's scheme: a QuantScheme as given, or the one its keyword form builds (calibration given: GPTQ
    rounding), validated; calibration given where the scheme has no use for it, or missing where it needs it, is an
    error."""
    if isinstance(scheme, QuantScheme):
        given = [name for name, value in (("group_size", group_size), ("symmetric", symmetric), ("min_max", min_max))
                 if value is not None]
        if given:
            raise ValueError(f"{given[0]}: the QuantScheme given as scheme states it; pass one or the other")
    elif isinstance(scheme, str) and scheme in SCHEMES:
        base = SCHEMES[scheme].weights
        scheme = QuantScheme(WeightScheme(base.bits, base.group_size if group_size is None else group_size,
                                          base.symmetric if symmetric is None else symmetric,
                                          base.min_max if min_max is None else min_max,
                                          "gptq" if calibration is not None else "nearest"))
    else:
        raise ValueError(f"scheme: expected one of {', '.join(SCHEMES)} or a QuantScheme, got {scheme!r}")
    scheme.validate()
    calibrated = [step for step, used in (("GPTQ rounding", scheme.weights.rounding == "gptq"),
                                          ("static activations", scheme.activations.static)) if used]
    if calibrated and calibration is None:
        raise ValueError(f"calibration: the scheme's {' and '.join(calibrated)} need calibration inputs")
    if calibration is not None and not calibrated:
        raise ValueError("calibration: the scheme rounds to nearest and quantizes activations dynamically: nothing "
                         "would use it")
    return scheme


def activation_layers(model: torch.nn.Module) -> Dict[str, W8A8Linear]:
    """The W8A8Linear layers (by name) whose input activations a scheme sets: int4 layers run dynamic symmetric ones,
    and the layer behind fused q/k/v slices runs one dynamic quantization for all three (checkpoints store it per
    slice without activation parameters: a static scale there would change the model and be lost on save)."""
    behind_slices = {id(m.fused) for m in model.modules() if isinstance(m, W8A8LinearSlice)}
    return {name: m for name, m in model.named_modules() if type(m) is W8A8Linear and id(m) not in behind_slices}


def _check_table_shared(model: torch.nn.Module, embedding: torch.nn.Embedding, holders: Dict[int, List[str]],
                        chosen: Dict[torch.nn.Module, Tuple[List[str], bool]]) -> None:
    """quantize_embedding: every other holder of the embedding's float table (a tied lm_head) must be quantized with
    it, to share the int8 table. One kept float (skipped) was untied silently: the model then held the table twice
    (int8 and float), and its config still said tied."""
    own = {f"{name}.weight" for name, m in model.named_modules(remove_duplicate=False) if m is embedding}
    sharing = {f"{name}.weight" for names, tied in chosen.values() if tied for name in names}
    kept = [name for name in holders.get(id(embedding.weight), []) if name not in own | sharing]
    if kept:
        layer = kept[0].rpartition(".")[0]
        raise ValueError(f"quantize_embedding: {layer} is tied to the input embedding ({kept[0]} is its table) and is "
                         f"kept float (skipped); an int8 embedding would untie them and hold the table twice. Quantize "
                         f"{layer} too (drop it from skip: both share one int8 table), or pass "
                         f"quantize_embedding=False to keep both float and tied")


def _input_embedding(model: torch.nn.Module) -> torch.nn.Embedding:
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    if not isinstance(embedding, torch.nn.Embedding) or not hasattr(model, "set_input_embeddings"):
        raise ValueError(f"quantize_embedding: {type(model).__name__} has no nn.Embedding input embedding "
                         f"(get_input_embeddings / set_input_embeddings, as transformers models have)")
    if not _is_table_lookup(embedding):
        raise ValueError(f"quantize_embedding: {type(model).__name__}'s input embedding ({type(embedding).__name__}) "
                         f"computes more than a row lookup (a scale after it, max_norm), which the int8 table would "
                         f"drop")
    return embedding


def _is_table_lookup(embedding: torch.nn.Embedding) -> bool:
    """Whether the embedding's output is its table's rows (times a column scale): the forward of nn.Embedding or of
    ColumnScaledEmbedding, not a subclass's own (Gemma's multiplies by sqrt(hidden)), and no max_norm (which
    renormalizes the rows it reads)."""
    return type(embedding).forward in (torch.nn.Embedding.forward, ColumnScaledEmbedding.forward) and \
        getattr(embedding, "max_norm", None) is None


_QKV = ("q_proj", "k_proj", "v_proj")


def fuse_projections(model: torch.nn.Module) -> Dict[str, List[str]]:
    """Fuse the projections that read the same input into one W8A8 GEMM each, in place: every module whose q_proj,
    k_proj and v_proj are W8A8Linear layers of one input size (attention) gets W8A8LinearSlice views of one W8A8Linear
    over their concatenated output channels (one activation quantization, one weight stream); every SiLU-gated MLP
    with W8A8Linear gate_proj / up_proj / down_proj becomes a W8A8GatedMLP. The q, k, v, gate and up outputs are bit
    for bit those of the separate layers (per-channel weights, per-token activations); only the SiLU differs from
    torch's in the last bits. Returns {"attention": [names], "mlp": [names]} of what was fused."""
    fused: Dict[str, List[str]] = {"attention": [], "mlp": []}
    for name, module in list(model.named_modules()):
        parts = [getattr(module, p, None) for p in _QKV]
        if all(isinstance(p, W8A8Linear) for p in parts) and _same_scheme(parts):
            whole = _concatenated(parts)
            cache: list = []
            begin = 0
            for pname, p in zip(_QKV, parts):
                setattr(module, pname, W8A8LinearSlice(whole, begin, begin + p.out_features, cache))
                begin += p.out_features
            fused["attention"].append(name)
        elif all(isinstance(getattr(module, p, None), W8A8Linear) for p in ("gate_proj", "up_proj", "down_proj")) \
                and _same_scheme([module.gate_proj, module.up_proj]) \
                and callable(getattr(module, "act_fn", None)) and is_silu(module.act_fn) and name \
                and _computes_plain_gated_mlp(module):
            _replace_module(model, name, W8A8GatedMLP.from_mlp(module))
            fused["mlp"].append(name)
    return fused


# the probe rows' scales: large enough to reach any clamp, each with both signs (a one-sided clamp, gate.clamp(max=l),
# is reached by one of x and -x: the projections are linear)
_PROBE_MAGNITUDES = (1.0, -1.0, 10.0, -10.0, 100.0, -100.0, 1000.0, -1000.0)


def _computes_plain_gated_mlp(mlp: torch.nn.Module) -> bool:
    """Whether mlp's own forward is down(act(gate(x)) * up(x)) and nothing more, checked bit for bit on probe rows of
    growing magnitude through its own layers: some models' MLPs look the same and scale or clamp too (Falcon-H1's
    mlp_multipliers, DeepSeek-V4's swiglu_limit), and fusing those gave outputs 2x and 8x off, silently. One that
    does not (or whose forward needs more than x) stays unfused. The probe is [1, 8, K], as transformers passes
    hidden states; forward hooks on mlp and its layers see it."""
    gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
    probe = torch.randn(1, len(_PROBE_MAGNITUDES), gate.in_features, generator=torch.Generator().manual_seed(0)) * \
        torch.tensor(_PROBE_MAGNITUDES).view(1, -1, 1)
    try:
        with torch.no_grad():
            own = mlp(probe)
            plain = down(mlp.act_fn(gate(probe)) * up(probe))
    except Exception:  # a forward that needs other arguments or shapes: not the plain form
        return False
    return isinstance(own, torch.Tensor) and own.shape == plain.shape and own.dtype == plain.dtype and \
        torch.equal(own, plain)


def _computes_plain_silu_experts(experts: torch.nn.Module, gate_up_e: torch.Tensor, down_e: torch.Tensor) -> bool:
    """Whether a fused-experts module's own forward is down(act_fn(gate) * up) per expert and nothing more, checked
    bit for bit (fp32) on probe rows of growing magnitude, all routed to expert 0 with weight 1, against F.linear as
    transformers' experts compute it: some look like Mixtral's and clamp too (DeepSeek-V4's swiglu_limit clamps gate
    and up in _apply_gate), and the fused experts dropped that, silently (output error 0.78 instead of 0.02).

    The forward runs through functional_call with gate_up_proj / down_proj replaced by one intermediate channel of the
    one expert's weights gate_up_e [2I, H], down_e [H, I] (any dtype) expanded to every expert (stride 0: no memory for E copies, and parameters on
    the meta device are never read). transformers' other experts backends (grouped_mm, batched_mm) apply the same
    class gate and differ from its eager loop only in their GEMMs' rounding (bmm), so the probe runs the eager loop.
    A forward that fails (other arguments, other layouts, its other parameters on meta) is not the plain form."""
    inter = gate_up_e.shape[0] // 2
    # one intermediate channel is enough to see a clamp or scale (they act per element): the probe's weights are
    # [2, H] and [H, 1], not a float copy of the expert
    gate_up = gate_up_e.detach()[[0, inter]].to(torch.float32)
    down = down_e.detach()[:, :1].to(torch.float32)
    try:
        num_experts = experts.gate_up_proj.shape[0]
        params = {"gate_up_proj": gate_up.expand(num_experts, *gate_up.shape),
                  "down_proj": down.expand(num_experts, *down.shape)}
        probe = torch.randn(len(_PROBE_MAGNITUDES), gate_up.shape[1], generator=torch.Generator().manual_seed(0))
        probe = (probe * torch.tensor(_PROBE_MAGNITUDES).view(-1, 1)).to(gate_up.device)
        ids = torch.zeros(len(_PROBE_MAGNITUDES), 1, dtype=torch.int64, device=gate_up.device)
        weights = torch.ones(len(_PROBE_MAGNITUDES), 1, device=gate_up.device)
        with torch.no_grad(), _eager_experts(experts):
            own = _functional_call(experts, params, (probe, ids, weights))
            gate, up = torch.nn.functional.linear(probe, gate_up).chunk(2, dim=-1)
            plain = torch.nn.functional.linear(experts.act_fn(gate) * up, down)
    except Exception:  # see above: not the plain form
        return False
    return isinstance(own, torch.Tensor) and own.shape == plain.shape and own.dtype == plain.dtype and \
        torch.equal(own, plain)


# torch.func arrived in torch 2.0 (the older name warns there); the ppc64le CI runs torch 1.13
_functional_call = torch.func.functional_call if hasattr(torch, "func") else torch.nn.utils.stateless.functional_call


@contextlib.contextmanager
def _eager_experts(experts: torch.nn.Module):
    """transformers' experts dispatch on config._experts_implementation; within, `experts` runs the eager loop. Set
    on the internal attribute, as transformers' set_experts_implementation does per module: the property's setter
    would also overwrite the sub-configs' choices."""
    config = getattr(experts, "config", None)
    if "_experts_implementation_internal" not in getattr(config, "__dict__", {}):
        yield
        return
    before = config._experts_implementation_internal
    config._experts_implementation_internal = "eager"
    try:
        yield
    finally:
        config._experts_implementation_internal = before


def _replace_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    """Put `module` at the dotted path `name` of `model` (torch.nn.Module.set_submodule, which torch 1.13 lacks)."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


__all__ = ["W8A8Linear", "W4A8Linear", "W8A8LinearSlice", "W8A8GatedMLP", "W8A8Embedding", "ColumnScaledEmbedding",
           "W8A8MoE", "W8A8Experts", "W4A8Experts", "quantize_model", "fuse_projections"]
