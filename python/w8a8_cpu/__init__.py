"""w8a8-cpu: exact W8A8 int8 CPU kernels for PyTorch with run-time ISA dispatch.

Quantization convention (every ISA variant produces identical int8 values):
symmetric per-token int8 in [-127, 127]; amax = max |x| over the row, clamped to >= 1e-10;
scale = amax / 127; q = clamp(round_half_to_even(x * (127 / amax)), -127, 127), computed in fp32.
Matmul: out = float32(x_q @ w.T as exact int32) * (x_scale * w_scale) + bias, cast once to out_dtype.
"""
from ._functions import (fused_experts, info, int8_gated_mm_with_quant, int8_mm, int8_scaled_mm,
                         int8_scaled_mm_with_quant, pack_moe_weights, pack_weight, packed_rows, per_token_quant_int8,
                         quantize_weight, scale_accumulators, unpack_weight, use_variant)
from . import _autograd, _fake, nn

__version__ = "0.1.0"

_fake.register()  # fake kernels for torch.compile / opcheck
_autograd.register()

__all__ = [
    "info",
    "use_variant",
    "per_token_quant_int8",
    "int8_scaled_mm",
    "int8_scaled_mm_with_quant",
    "int8_gated_mm_with_quant",
    "int8_mm",
    "scale_accumulators",
    "pack_weight",
    "unpack_weight",
    "packed_rows",
    "quantize_weight",
    "pack_moe_weights",
    "fused_experts",
    "nn",
]
