"""Fused projection layers (built by fuse_projections): W8A8LinearSlice, q_proj / k_proj / v_proj as slices of one
GEMM, and W8A8GatedMLP, a SwiGLU MLP's gate and up projections as one GEMM with SiLU-and-multiply after it."""
from __future__ import annotations

from typing import Dict, Optional

import torch

from .._loader import ops as _ops
from .linear import W8A8Linear, below_autograd, concatenated, is_compiling, rows_of, same_scheme
from .probes import is_silu
from .scales import Fp32Scales


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
        if is_compiling() or (torch.is_grad_enabled() and x.requires_grad):
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
        return rows_of(self.fused.weight_packed, self.fused.w_scale, self.fused.bias, self.begin, self.end)

    def extra_repr(self) -> str:
        return f"channels [{self.begin}, {self.end}) of a fused {self.fused.out_features}-channel W8A8Linear"


class W8A8GatedMLP(Fp32Scales):
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
        if not same_scheme([gate, up]):
            raise ValueError("mlp: gate_proj and up_proj must have one weight scheme (W8A8, or W4A8 of one group size)")
        return cls(concatenated([gate, up]), down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The op has no gradient: its autograd kernel raises at backward (without one, the MLP's branch dropped out of
        # a model's gradient silently). Below it when no gradient is wanted (see W8A8Linear.forward).
        buffers = self._buffers  # not through __getattr__ (see W8A8Linear.forward)
        args = (x, buffers["gate_up_packed"], buffers["gate_up_scale"], buffers["gate_up_bias"], None)
        if below_autograd(x, *args[2:4]):
            with torch._C._AutoDispatchBelowAutograd():
                act = _ops.int8_gated_mm_with_quant(*args)
        else:
            act = _ops.int8_gated_mm_with_quant(*args)
        return self._modules["down_proj"](act)

    def projections(self) -> Dict[str, W8A8Linear]:
        """{"gate_proj" | "up_proj": the unfused layer (W8A8Linear or W4A8Linear)}, for checkpoints that keep the
        per-layer names."""
        i, parts = self.intermediate_size, (self.gate_up_packed, self.gate_up_scale, self.gate_up_bias)
        return {"gate_proj": rows_of(*parts, 0, i), "up_proj": rows_of(*parts, i, 2 * i)}

    def extra_repr(self) -> str:
        return f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, gate/up fused"
