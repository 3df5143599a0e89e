"""w8a8-cpu: exact W8A8 int8 CPU kernels for PyTorch with run-time ISA dispatch.

Quantization convention (every ISA variant produces identical int8 values):
symmetric per-token int8 in [-127, 127]; amax = max |x| over the row, clamped to >= 1e-10;
scale = amax / 127; q = clamp(round_half_to_even(x * (127 / amax)), -127, 127), computed in fp32.
Matmul: out = float32(x_q @ w.T as exact int32) * (x_scale * w_scale) + bias, cast once to out_dtype.
W4A8 (int4 weights in groups along K): each group's int32 products exact, the groups combined in fp32 in one fixed
order (t += float(acc_g) * scale_g, t += float(sum_g x_q) * min_g), out = t * (x_scale * w_scale) + bias.
Static / asymmetric activations (checkpoints that carry them): quantize_activations, q = clamp(round(x / s) + zp,
-128, 127); out = float32(x_q @ w.T - zp * sum_k w, exact int32) * (s * w_scale) + bias.
"""
from ._functions import (dequantized_weight, fused_experts, info, int4_weight_values, int8_gated_mm_with_quant, int8_mm,
                         int8_scaled_mm, int8_scaled_mm_with_quant, pack_experts_int4, pack_moe_weights, pack_weight,
                         pack_weight_int4, packed_rows, per_token_quant_int8, quantize_activations, scale_accumulators,
                         unpack_weight, use_variant)
from .quant.weights import quantize_weight, quantize_weight_int4
from . import _autograd, _fake, nn

__version__ = "0.1.0"

_fake.register()  # fake kernels for torch.compile / opcheck
_autograd.register()

__all__ = [
    "info",
    "use_variant",
    "per_token_quant_int8",
    "quantize_activations",
    "int8_scaled_mm",
    "int8_scaled_mm_with_quant",
    "int8_gated_mm_with_quant",
    "int8_mm",
    "scale_accumulators",
    "pack_weight",
    "pack_weight_int4",
    "int4_weight_values",
    "dequantized_weight",
    "unpack_weight",
    "packed_rows",
    "quantize_weight",
    "quantize_weight_int4",
    "pack_moe_weights",
    "pack_experts_int4",
    "fused_experts",
    "nn",
]
