"""The quantized layers and the model transform: `from w8a8_cpu import nn as w8nn; w8nn.quantize_model(model)`.

    linear.py     W8A8Linear, W4A8Linear
    fused.py      W8A8LinearSlice, W8A8GatedMLP (fused projections)
    embedding.py  ColumnScaledEmbedding, W8A8Embedding
    experts.py    W8A8MoE, W8A8Experts, W4A8Experts, expert discovery (expert_weights)
    transform.py  quantize_model, fuse_projections, activation_layers, replace_module
    probes.py     checks by behaviour that a module computes what its fused replacement does (is_silu, ...)
    scales.py     the layers' shared base: fp32 scales that stay fp32 (Fp32Scales)"""
from .embedding import ColumnScaledEmbedding, W8A8Embedding
from .experts import W4A8Experts, W8A8Experts, W8A8MoE
from .fused import W8A8GatedMLP, W8A8LinearSlice
from .linear import W4A8Linear, W8A8Linear
from .probes import is_silu  # noqa: F401 (public outside __all__, as before the split)
from .transform import (SCHEMES, SkipSpec, activation_layers, fuse_projections,  # noqa: F401 (as is_silu)
                        quantize_model)

__all__ = ["W8A8Linear", "W4A8Linear", "W8A8LinearSlice", "W8A8GatedMLP", "W8A8Embedding", "ColumnScaledEmbedding",
           "W8A8MoE", "W8A8Experts", "W4A8Experts", "quantize_model", "fuse_projections"]
