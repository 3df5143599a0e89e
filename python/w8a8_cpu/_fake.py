"""Fake (meta) kernels: output shapes/dtypes without computing, for torch.compile and opcheck."""
from __future__ import annotations

import json

import torch

_HEADER_BYTES = 64  # PackedWeightHeader in csrc/common/gemm_driver.h


def _packed_weight_nbytes(n, k):
    info = json.loads(torch.ops.w8a8_cpu._info())
    nr, kr = info["panel_width"], info["panel_depth"]  # PanelLayout of the active variant
    n_padded = (n + nr - 1) // nr * nr
    k_padded = (k + kr - 1) // kr * kr
    return _HEADER_BYTES + n_padded * k_padded + 4 * n_padded


def _check_same_device(first, **tensors):
    # The real kernels only take CPU tensors; a fake call mixing devices would otherwise "succeed".
    for name, t in tensors.items():
        if t is not None and t.device != first.device:
            raise ValueError(f"{name}: expected a CPU tensor on the same device as the activations, got {t.device}")


_meta_library = None  # torch < 2.1 only: keeps the Meta registrations alive


def _register_meta(qualname):
    """torch < 2.1 (e.g. Debian's 1.13 on ppc64le) has no fake-kernel API: register the same function as the
    op's Meta-dispatch kernel instead, so meta tensors still get shape inference and mixed devices still fail
    (torch.compile / opcheck, the other users of fake kernels, do not exist there)."""
    global _meta_library
    if _meta_library is None:
        _meta_library = torch.library.Library("w8a8_cpu", "IMPL")

    def decorate(fn):
        # AutogradMeta too: torch 1.13 has no autograd fallthrough for Meta (it has one for CPU).
        for key in ("Meta", "AutogradMeta"):
            _meta_library.impl(qualname.split("::")[-1], fn, key)
        return fn

    return decorate


def register() -> None:
    # torch >= 2.4 has register_fake; 2.1-2.3 call it impl_abstract; older torch gets Meta kernels.
    register_fake = (getattr(torch.library, "register_fake", None) or getattr(torch.library, "impl_abstract", None)
                     or _register_meta)

    @register_fake("w8a8_cpu::per_token_quant_int8")
    def _per_token_quant_int8(x):
        return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((x.shape[0], 1), dtype=torch.float32)

    @register_fake("w8a8_cpu::int8_scaled_mm")
    def _int8_scaled_mm(x_q, w, x_scale, w_scale, bias=None, out_dtype=None):
        _check_same_device(x_q, w=w, x_scale=x_scale, w_scale=w_scale, bias=bias)
        # N comes from w_scale: a packed weight is a 1-D blob whose length does not give N.
        return x_q.new_empty((x_q.shape[0], w_scale.shape[0]), dtype=out_dtype or torch.float32)

    @register_fake("w8a8_cpu::int8_scaled_mm_with_quant")
    def _int8_scaled_mm_with_quant(x, w, w_scale, bias=None, out_dtype=None):
        _check_same_device(x, w=w, w_scale=w_scale, bias=bias)
        return x.new_empty((*x.shape[:-1], w_scale.shape[0]), dtype=out_dtype or x.dtype)

    @register_fake("w8a8_cpu::fused_experts")
    def _fused_experts(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, activation="silu",
                       apply_router_weight_on_input=False):
        _check_same_device(hidden, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids,
                           w13_scale=w13_scale, w2_scale=w2_scale)
        return hidden.new_empty(hidden.shape)

    @register_fake("w8a8_cpu::pack_weight")
    def _pack_weight(w):
        return w.new_empty((_packed_weight_nbytes(w.shape[0], w.shape[1]),), dtype=torch.uint8)
