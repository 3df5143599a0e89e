"""Module-level API: W8A8Linear and quantize_model."""
from __future__ import annotations

import fnmatch
from typing import Callable, Iterable, Optional, Union

import torch

from .. import int8_scaled_mm_with_quant, pack_weight, quantize_weight

SkipSpec = Union[None, Iterable[str], Callable[[str, torch.nn.Module], bool]]


class W8A8Linear(torch.nn.Module):
    """Linear layer with int8 weights (one fp32 scale per output channel) and per-token int8 activations.

    The weight is quantized and packed once (for the variant active at construction); forward runs the
    fused quantize + int8 matmul and returns the input's dtype."""

    def __init__(self, w_q: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor] = None):
        super().__init__()
        if w_q.dtype != torch.int8 or w_q.dim() != 2:
            raise ValueError(f"w_q: expected int8 [N, K], got {w_q.dtype} {tuple(w_q.shape)}")
        self.out_features, self.in_features = w_q.shape
        self.register_buffer("weight_packed", pack_weight(w_q.contiguous()))
        self.register_buffer("w_scale", w_scale.detach().to(torch.float32).reshape(-1).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.float32).contiguous())

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> "W8A8Linear":
        if not isinstance(linear, torch.nn.Linear):
            raise ValueError(f"linear: expected torch.nn.Linear, got {type(linear).__name__}")
        w_q, w_scale = quantize_weight(linear.weight)
        return cls(w_q, w_scale, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_scaled_mm_with_quant(x, self.weight_packed, self.w_scale, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _skipped(skip: SkipSpec, name: str, module: torch.nn.Module) -> bool:
    if skip is None:
        return False
    if callable(skip):
        return bool(skip(name, module))
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in skip)


def quantize_model(model: torch.nn.Module, skip: SkipSpec = None) -> torch.nn.Module:
    """Replace every nn.Linear in `model` (in place) with W8A8Linear and return the model.

    skip: module-name glob patterns (e.g. ["lm_head", "*.gate"]) or a callable(name, module) -> bool
    selecting Linear layers to keep in floating point."""
    if isinstance(skip, str):
        skip = [skip]
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and not _skipped(skip, name, module)
    ]
    for name, module in targets:
        replacement = W8A8Linear.from_linear(module)
        if not name:
            raise ValueError("model: is itself an nn.Linear; use W8A8Linear.from_linear(model) instead")
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)
    return model


__all__ = ["W8A8Linear", "quantize_model"]
