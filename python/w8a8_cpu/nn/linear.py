"""The quantized Linear layers: W8A8Linear (int8 weights per channel, int8 activations as set) and W4A8Linear (int4
weights in groups, dynamic int8 activations), and what the layers built from their blobs share: a blob's channel range
as a layer (rows_of), layers concatenated over their output channels (concatenated, same_scheme), and when a forward may
call the op below the Python autograd kernel (below_autograd)."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .. import _autograd  # the submodule: nn depends on the package's modules, never on its __init__
from .._functions import (MAX_K_ZERO_POINT, _verified_blob, check_static_activation_params, int4_weight_values,
                          int8_scaled_mm_with_activations, int8_scaled_mm_with_quant, pack_weight, pack_weight_int4,
                          unpack_weight, weight_channel_sums, weight_scheme)
from .._loader import ops as _ops
from .._packed_weight import header_scheme, header_sizes
from ..quant.weights import quantize_weight, quantize_weight_int4
from ..scheme import DYNAMIC, GROUP_SIZE, ActivationScheme, QuantScheme, WeightScheme
from .scales import Fp32Scales, finite_fp32


class W8A8Linear(Fp32Scales):
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
        self.register_buffer("w_scale", finite_fp32(w_scale, "w_scale").reshape(-1))
        self.register_buffer("bias", None if bias is None else finite_fp32(bias, "bias"))
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
            if gradient_wanted(x, w_scale, bias, input_scale):
                return _autograd.StaticActivationsLinear.apply(x, weight_packed, w_scale, bias, input_scale,
                                                               input_zero_point, self.symmetric_activations,
                                                               buffers["w_sum"])
            return int8_scaled_mm_with_activations(  # the same outputs without an autograd node (~30 us a call)
                x, weight_packed, w_scale, bias, input_scale=input_scale, input_zero_point=input_zero_point,
                symmetric=self.symmetric_activations, w_sum=buffers["w_sum"])
        # under inference_mode autograd's dispatch keys are off: no Python kernel on the way (dynamo cannot trace the
        # check, hence compiling first)
        if not is_compiling() and torch.is_inference_mode_enabled():
            return _ops.int8_scaled_mm_with_quant(x, weight_packed, w_scale, bias, None)
        if below_autograd(x, w_scale, bias):
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
        Fp32Scales.__init__(self)
        if q.dtype != torch.int8 or q.dim() != 2:
            raise ValueError(f"q: expected int8 [N, K] holding [-8, 7], got {q.dtype} {tuple(q.shape)}")
        self.out_features, self.in_features = q.shape
        self.group_size = group_size
        self._weights = int4_form(weights, group_size, group_min)
        self.register_buffer("weight_packed", pack_weight_int4(q.contiguous(), group_scale, group_min, group_size))
        scale = torch.ones(q.shape[0]) if w_scale is None else w_scale
        self.register_buffer("w_scale", finite_fp32(scale, "w_scale").reshape(-1))
        self.register_buffer("bias", None if bias is None else finite_fp32(bias, "bias"))
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


def int4_form(weights: Optional[WeightScheme], group_size: int, group_min: Optional[torch.Tensor]) -> WeightScheme:
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


def rows_of(weight_packed: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor], begin: int,
             end: int) -> W8A8Linear:
    """Output channels [begin, end) of a packed weight (its scheme read from the blob) with its w_scale and bias, as
    a layer of its own: W8A8Linear, or W4A8Linear for an int4 blob."""
    bias = None if bias is None else bias[begin:end]
    if weight_scheme(weight_packed) == "int4":
        q, scale, minimum, group = int4_weight_values(weight_packed)
        return W4A8Linear(q[begin:end], scale[begin:end], None if minimum is None else minimum[begin:end], group, bias,
                          w_scale[begin:end])
    return W8A8Linear(unpack_weight(weight_packed)[begin:end], w_scale[begin:end], bias)


def concatenated(parts: List[W8A8Linear]) -> W8A8Linear:
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


def same_scheme(parts) -> bool:
    """Whether the layers can be concatenated: one class, one input size, biases alike, and one scheme, with dynamic
    per-token symmetric activations (the fused ops quantize them so)."""
    kinds = {type(p) for p in parts}
    if len(kinds) != 1 or not kinds <= {W8A8Linear, W4A8Linear} or len({p.in_features for p in parts}) != 1 or \
            len({p.bias is None for p in parts}) != 1:
        return False
    schemes = {p.scheme for p in parts}
    return len(schemes) == 1 and schemes.pop().activations == DYNAMIC


def below_autograd(x: torch.Tensor, *tracked) -> bool:
    """Whether a forward may call the op below the Python autograd kernel (~8 us per call there; a decoder LLM makes
    ~200 such calls per token): no gradient wanted and not tracing. Older torch (no Python autograd kernels,
    _autograd.AVAILABLE false) needs no detour, and its _AutoDispatchBelowAutograd is no context manager."""
    return _autograd.AVAILABLE and isinstance(x, torch.Tensor) and not gradient_wanted(x, *tracked) and \
        not is_compiling()


def gradient_wanted(*tensors) -> bool:
    """Whether autograd is on and some of the tensors requires a gradient."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def is_compiling() -> bool:
    compiler = getattr(torch, "compiler", None)  # torch < 2.1 has no torch.compiler (and compiles nothing of ours)
    return compiler is not None and compiler.is_compiling()
