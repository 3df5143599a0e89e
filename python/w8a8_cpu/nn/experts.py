"""Mixture-of-experts layers over fused_experts: W8A8MoE (its own router), W8A8Experts and W4A8Experts (drop-ins for
transformers' fused-experts modules, which the model's router drives), and how such a module is recognised
(expert_weights) and accepted (require_plain_silu_experts)."""
from __future__ import annotations

from typing import Optional

import torch

from .._functions import fused_experts, int4_weight_values, pack_experts_int4, pack_moe_weights, unpack_weight
from ..quant.weights import quantize_weight, quantize_weight_int4
from ..scheme import DYNAMIC, GROUP_SIZE, QuantScheme, WeightScheme, W8A8 as _W8A8
from .linear import int4_form
from .probes import computes_plain_silu_experts, is_silu
from .scales import Fp32Scales, finite_fp32


def quantize_experts(w: torch.Tensor):
    """(q int8 [E, N, K], scales [E, N]) of float experts [E, N, K]: each channel as quantize_weight quantizes a Linear
    weight's."""
    e, n, k = w.shape
    w_q, w_scale = quantize_weight(w.reshape(e * n, k))
    return w_q.reshape(e, n, k), w_scale.reshape(e, n)


def quantize_experts_int4(w: torch.Tensor, group_size: int, symmetric: bool, min_max: bool):
    """(q [E, N, K], group scales [E, N, groups], group minimums or None) of float experts [E, N, K]: each
    channel's groups along K as quantize_weight_int4 quantizes a Linear weight's."""
    e, n, k = w.shape
    values = quantize_weight_int4(w.reshape(e * n, k), group_size, symmetric, min_max)
    return tuple(None if v is None else v.reshape(e, n, -1) for v in values)


class W8A8MoE(Fp32Scales):
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
        self.register_buffer("w13_scale", finite_fp32(w13_scale, "w13_scale").reshape(self.num_experts, -1))
        self.register_buffer("w2_scale", finite_fp32(w2_scale, "w2_scale").reshape(self.num_experts, -1))

    @classmethod
    def from_float(cls, w13: torch.Tensor, w2: torch.Tensor, top_k: int, renormalize: bool = True) -> "W8A8MoE":
        if w13.dim() != 3 or w2.dim() != 3:
            raise ValueError(f"w13, w2: expected [E, 2I, H] and [E, H, I], got {tuple(w13.shape)}, {tuple(w2.shape)}")
        return cls(*quantize_experts(w13), *quantize_experts(w2), top_k=top_k, renormalize=renormalize)

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


def expert_weights(module: torch.nn.Module):
    """(gate_up_proj [E, 2I, H], down_proj [E, H, I]) of a transformers fused-experts module (MixtralExperts,
    Qwen2MoeExperts, Qwen3MoeExperts, ...: 3-D parameters, gate rows then up rows), else None."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == 3 \
            and down.dim() == 3 and hasattr(module, "act_fn"):
        return gate_up, down
    return None


def silu_expert_weights(experts: torch.nn.Module):
    """(gate_up_proj, down_proj) of a transformers fused-experts module that the fused experts can run (SiLU-gated,
    nothing more), else ValueError."""
    weights = expert_weights(experts)
    if weights is None:
        raise ValueError(f"experts: {type(experts).__name__} has no 3-D gate_up_proj / down_proj parameters")
    gate_up, down = weights
    e, inter2, hidden = gate_up.shape
    # the probe runs [E, 2I, H] / [E, H, I] experts; another layout (Llama4's transposed [E, H, 2I]) is refused by
    # _take_shapes, with the shapes in the message
    if inter2 % 2 == 0 and down.shape == (e, hidden, inter2 // 2):
        require_plain_silu_experts(experts, gate_up[0], down[0])
    return weights


def require_plain_silu_experts(experts: torch.nn.Module, gate_up_e: torch.Tensor, down_e: torch.Tensor) -> None:
    """ValueError unless the fused experts can stand in for `experts`: a SiLU act_fn (is_silu) and a forward that
    computes down(silu(gate) * up) and nothing more (computes_plain_silu_experts, on one expert's weights
    gate_up_e [2I, H] and down_e [H, I] of any dtype: the module's own, or the stored integer ones when its own are on
    the meta device, as in the checkpoint loader). The message names the module's class; callers prefix its name."""
    act = experts.act_fn
    if not is_silu(act):
        raise ValueError(f"experts: {type(experts).__name__} uses activation {type(act).__name__}; the fused "
                         f"W8A8 experts implement SiLU-gated experts only")
    if not computes_plain_silu_experts(experts, gate_up_e, down_e):
        raise ValueError(f"experts: {type(experts).__name__} computes more than silu(gate) * up (a clamp or scale: "
                         f"DeepSeek-V4's swiglu_limit, Step3p7's limit), which the fused W8A8 experts would drop; keep "
                         f"it float: skip it in quantize_model (skip=[its name], or a glob such as '*.experts')")


class W8A8Experts(Fp32Scales):
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
        self.register_buffer("w13_scale", finite_fp32(w13_scale, "w13_scale").reshape(self.num_experts,
                                                                                        2 * self.intermediate_dim))
        self.register_buffer("w2_scale", finite_fp32(w2_scale, "w2_scale").reshape(self.num_experts,
                                                                                     self.hidden_dim))

    @classmethod
    def from_experts(cls, experts: torch.nn.Module) -> "W8A8Experts":
        gate_up, down = silu_expert_weights(experts)
        return cls(*quantize_experts(gate_up), *quantize_experts(down))

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
        of group_size k (0: per channel), as quantize_experts_int4 gives them; weights: as W4A8Linear's."""
        Fp32Scales.__init__(self)
        self._take_shapes(w13_q, w2_q)
        self.group_size = group_size
        self._weights = int4_form(weights, group_size, w13_group_min)
        self._hold(pack_experts_int4(w13_q, w13_group_scale, w13_group_min, group_size),
                   pack_experts_int4(w2_q, w2_group_scale, w2_group_min, group_size),
                   torch.ones(w13_q.shape[:2]) if w13_scale is None else w13_scale,
                   torch.ones(w2_q.shape[:2]) if w2_scale is None else w2_scale)

    @classmethod
    def from_experts(cls, experts: torch.nn.Module, group_size: int = GROUP_SIZE, symmetric: bool = True,
                     min_max: bool = False) -> "W4A8Experts":
        """Round-to-nearest int4 of the float experts per group (quantize_weight_int4's rules)."""
        weights = QuantScheme(WeightScheme(4, group_size, symmetric, min_max)).validate().weights
        gate_up, down = silu_expert_weights(experts)
        return cls(*quantize_experts_int4(gate_up, group_size, symmetric, min_max),
                   *quantize_experts_int4(down, group_size, symmetric, min_max), group_size, weights=weights)

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
