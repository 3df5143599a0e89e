"""Fake (meta) kernels: output shapes/dtypes without computing, for torch.compile and opcheck.

Each fake kernel first validates its inputs the way the C++ op does (the torch binding's op files and
binding_checks.cpp in csrc/common; the helpers below mirror its helpers and messages), so tracing raises the same
ValueError as running would, instead of inventing an output for inputs the op rejects. Only what the metadata shows
can be checked here: dtypes, shapes, strides, devices. Checks that read data (NaN/Inf activations in strict mode,
topk_ids in range, a packed blob's header: its magic, N and K) are the real op's alone."""
from __future__ import annotations

import torch

from ._packed_weight import HEADER_BYTES, packed_weight_nbytes
from .scheme import INT4_GROUPS, is_int4_group

_MAX_K = (1 << 17) - 1  # kMaxK in csrc/common/microkernel.h
_MAX_NORM_ROW, _MAX_HEAD_DIM = 16384, 1024  # kMaxNormRow (layer_ops.h), kMaxHeadDim (microkernel.h)
_FLOAT32_MAX = 3.4028234663852886e38
_DECODE_STEP_WEIGHTS = 14  # kWeightsPerLayer (DecodeStepWeight in csrc/common/decode_step_ops.cpp)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KV_CACHE_DTYPES = (torch.float32, torch.float16, torch.int8)  # KvKind (csrc/common/microkernel.h)


def _check_same_device(first, **tensors):
    # The real kernels only take CPU tensors; a fake call mixing devices would otherwise "succeed". All-meta
    # inputs are shape inference and pass.
    for name, t in tensors.items():
        if t is not None and t.device != first.device:
            raise ValueError(f"{name}: expected a CPU tensor on the same device as the activations, got {t.device}")


# ---- the C++ checks: its helpers (named where ours differ), in its order, with its messages -------------------

def _check_float(dtype, arg):  # float_kind
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{arg}: dtype must be float32, bfloat16 or float16, got {dtype}")


def _check_last_dim_contiguous(t, arg):
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{arg}: last dimension must be contiguous (stride 1), got strides {list(t.stride())}; "
                         f"call .contiguous() first")


def _check_rows(t, arg):
    if t.dim() != 2:
        raise ValueError(f"{arg}: expected a 2-D tensor, got shape {list(t.shape)}")
    _check_last_dim_contiguous(t, arg)


def _check_n_positive(w):
    if w.shape[0] <= 0:
        raise ValueError("w: N (dim 0) must be > 0")


def _check_k(k, arg):
    if k <= 0:
        raise ValueError(f"{arg}: K (last dim) must be > 0")
    if k > _MAX_K:
        raise ValueError(f"{arg}: K = {k} exceeds {_MAX_K}, the largest K whose int32 accumulation cannot overflow")


def _check_scales(s, rows, arg, what):  # checked_scales
    if s.dtype != torch.float32:
        raise ValueError(f"{arg}: dtype must be float32, got {s.dtype}")
    if not ((s.dim() == 1 and s.shape[0] == rows) or (s.dim() == 2 and s.shape[0] == rows and s.shape[1] == 1)):
        raise ValueError(f"{arg}: expected shape [{rows}] or [{rows}, 1] (one scale per {what}), got {list(s.shape)}")


def _check_blob_length(nbytes, arg):  # the part of view_packed_weight that needs no data
    if nbytes < HEADER_BYTES:
        raise ValueError(f"{arg}: a 1-D uint8 tensor of {nbytes} bytes is too short to be a packed weight (expected "
                         f"the output of pack_weight)")


def _weight_rows(w, k, w_scale):  # weight_view; returns N
    if w.dim() == 1 and w.dtype == torch.uint8:
        if not w.is_contiguous():
            raise ValueError("w: packed weight must be contiguous")
        _check_blob_length(w.numel(), "w")
        # N and K are in the blob's header (data): take N from w_scale; "N" makes its shape check fail, with
        # the real op's message, when w_scale is not [N] or [N, 1] at all.
        return w_scale.shape[0] if w_scale.dim() in (1, 2) else "N"
    if w.dtype != torch.int8:
        raise ValueError(f"w: expected a raw int8 [N, K] weight or a packed weight (1-D uint8 from pack_weight), got "
                         f"dtype {w.dtype} and shape {list(w.shape)}")
    _check_rows(w, "w")
    if w.shape[1] != k:
        raise ValueError(f"w: K mismatch: weight has K = {w.shape[1]} but the activations have K = {k}")
    _check_n_positive(w)
    return w.shape[0]


def _check_bias(bias, n):  # checked_bias
    if bias is None:
        return
    _check_float(bias.dtype, "bias")
    if bias.dim() != 1 or bias.shape[0] != n:
        raise ValueError(f"bias: expected shape [{n}], got {list(bias.shape)}")


def _scaled_mm_columns(k, w, w_scale, bias, out_dtype):  # scaled_mm; returns N
    _check_float(out_dtype, "out_dtype")
    n = _weight_rows(w, k, w_scale)
    _check_scales(w_scale, n, "w_scale", "output channel")
    _check_bias(bias, n)
    return n


def _check_activation_rows(x):  # activation_rows
    _check_float(x.dtype, "x")
    if x.dim() < 1:
        raise ValueError("x: expected at least 1 dimension [..., K], got a scalar")
    _check_k(x.shape[-1], "x")
    _check_last_dim_contiguous(x, "x")


def _check_expert_weight(w, experts, n, k, arg):  # expert_views
    if w.dtype == torch.int8:
        if w.dim() != 3 or list(w.shape) != [experts, n, k]:
            raise ValueError(f"{arg}: expected a raw int8 weight of shape [{experts}, {n}, {k}], got {list(w.shape)}")
        return
    if w.dtype != torch.uint8 or w.dim() != 2 or w.shape[0] != experts:
        raise ValueError(f"{arg}: expected a raw int8 [{experts}, {n}, {k}] weight or packed experts (uint8 [E, bytes] "
                         f"from pack_moe_weights or pack_experts_int4), got dtype {w.dtype} and shape "
                         f"{list(w.shape)}")
    if not w.is_contiguous():
        raise ValueError(f"{arg}: packed experts must be contiguous")
    _check_blob_length(w.shape[1], arg)


def _expert_scale_rows(s, arg):  # checked_expert_scales; returns [E, N] as a shape
    if s.dtype != torch.float32:
        raise ValueError(f"{arg}: dtype must be float32, got {s.dtype}")
    if not (s.dim() == 2 or (s.dim() == 3 and s.shape[2] == 1)):
        raise ValueError(f"{arg}: expected shape [E, N] or [E, N, 1], got {list(s.shape)}")
    return s.shape[0], s.shape[1]


# ---- fake kernels ----------------------------------------------------------------------------------------------

_meta_library = None  # torch < 2.1 only: keeps the Meta registrations alive


def _layer_row_length(x, arg, max_n):  # layer_row_length; returns N
    _check_float(x.dtype, arg)
    if x.dim() < 1 or x.shape[-1] <= 0:
        raise ValueError(f"{arg}: expected a tensor [..., N] with N > 0, got shape {list(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{arg}: must be contiguous, got strides {list(x.stride())}; call .contiguous() first")
    if max_n is not None and x.shape[-1] > max_n:
        raise ValueError(f"{arg}: last dimension {x.shape[-1]} exceeds {max_n}, the longest row the layer ops take")
    return x.shape[-1]


def _rms_norm_rows(x, delta, weight, eps):  # rms_norm_rows
    n = _layer_row_length(x, "x", _MAX_NORM_ROW)
    if delta is not None:
        _layer_row_length(delta, "delta", _MAX_NORM_ROW)
        if delta.shape != x.shape or delta.dtype != x.dtype:
            raise ValueError(f"delta: expected the shape and dtype of x, {list(x.shape)} {x.dtype}, got "
                             f"{list(delta.shape)} {delta.dtype}")
    _check_float(weight.dtype, "weight")
    if weight.dim() != 1 or weight.shape[0] != n:
        raise ValueError(f"weight: expected shape [{n}] (the last dimension of x), got {list(weight.shape)}")
    if not 0 <= eps <= _FLOAT32_MAX:
        raise ValueError(f"eps: expected a finite float32 value >= 0, got {eps}")
    return x.new_empty(x.shape)


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
    def _per_token_quant_int8(x, amax=None):
        if x.dim() != 2:
            raise ValueError(f"x: expected a 2-D [M, K] tensor, got shape {list(x.shape)}")
        _check_activation_rows(x)
        if amax is not None:
            _check_scales(amax, x.shape[0], "amax", "row")
        return x.new_empty(x.shape, dtype=torch.int8), x.new_empty((x.shape[0], 1), dtype=torch.float32)

    @register_fake("w8a8_cpu::int8_mm")
    def _int8_mm(x_q, w):
        _check_same_device(x_q, w=w)
        if x_q.dtype != torch.int8:
            raise ValueError(f"x_q: dtype must be int8, got {x_q.dtype}")
        _check_rows(x_q, "x_q")
        _check_k(x_q.shape[1], "x_q")
        if w.dim() == 1 and w.dtype == torch.uint8:  # N is in the blob's header (data), and no scales give it here
            _weight_rows(w, x_q.shape[1], x_q.new_empty(0))
            n = torch.library.get_ctx().new_dynamic_size()
        else:
            n = _weight_rows(w, x_q.shape[1], None)
        return x_q.new_empty((x_q.shape[0], n), dtype=torch.int32)

    @register_fake("w8a8_cpu::scale_accumulators")
    def _scale_accumulators(acc, x_scale, w_scale, bias=None, out_dtype=None):
        _check_same_device(acc, x_scale=x_scale, w_scale=w_scale, bias=bias)
        if acc.dtype != torch.int32:
            raise ValueError(f"acc: dtype must be int32, got {acc.dtype}")
        _check_rows(acc, "acc")
        out_dtype = out_dtype or torch.float32
        _check_float(out_dtype, "out_dtype")
        _check_scales(x_scale, acc.shape[0], "x_scale", "row of acc")
        _check_scales(w_scale, acc.shape[1], "w_scale", "output channel")
        _check_bias(bias, acc.shape[1])
        return acc.new_empty(acc.shape, dtype=out_dtype)

    @register_fake("w8a8_cpu::int8_scaled_mm")
    def _int8_scaled_mm(x_q, w, x_scale, w_scale, bias=None, out_dtype=None):
        _check_same_device(x_q, w=w, x_scale=x_scale, w_scale=w_scale, bias=bias)
        if x_q.dtype != torch.int8:
            raise ValueError(f"x_q: dtype must be int8, got {x_q.dtype}")
        _check_rows(x_q, "x_q")
        _check_k(x_q.shape[1], "x_q")
        _check_scales(x_scale, x_q.shape[0], "x_scale", "row of x_q")
        out_dtype = out_dtype or torch.float32
        n = _scaled_mm_columns(x_q.shape[1], w, w_scale, bias, out_dtype)
        return x_q.new_empty((x_q.shape[0], n), dtype=out_dtype)

    @register_fake("w8a8_cpu::int8_scaled_mm_with_quant")
    def _int8_scaled_mm_with_quant(x, w, w_scale, bias=None, out_dtype=None, amax=None):
        _check_same_device(x, w=w, w_scale=w_scale, bias=bias, amax=amax)
        _check_activation_rows(x)
        if amax is not None:
            _check_scales(amax, x.numel() // x.shape[-1], "amax", "row")
        out_dtype = out_dtype or x.dtype
        n = _scaled_mm_columns(x.shape[-1], w, w_scale, bias, out_dtype)
        return x.new_empty((*x.shape[:-1], n), dtype=out_dtype)

    @register_fake("w8a8_cpu::int8_gated_mm_with_quant")
    def _int8_gated_mm_with_quant(x, w, w_scale, bias=None, out_dtype=None):
        _check_same_device(x, w=w, w_scale=w_scale, bias=bias)
        _check_activation_rows(x)
        out_dtype = out_dtype or x.dtype
        n = _scaled_mm_columns(x.shape[-1], w, w_scale, bias, out_dtype)
        if n % 2:
            raise ValueError(f"w: the gated linear needs an even number of output channels (gate rows, then up rows), "
                             f"got N = {n}")
        return x.new_empty((*x.shape[:-1], n // 2), dtype=out_dtype)

    @register_fake("w8a8_cpu::fused_experts")
    def _fused_experts(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, activation="silu",
                       apply_router_weight_on_input=False):
        if activation != "silu":
            raise ValueError(f"activation: only 'silu' is supported, got '{activation}'")
        _check_same_device(hidden, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids,
                           w13_scale=w13_scale, w2_scale=w2_scale)
        _check_float(hidden.dtype, "hidden")
        _check_rows(hidden, "hidden")
        m, h = hidden.shape
        _check_k(h, "hidden")
        experts, inter2 = _expert_scale_rows(w13_scale, "w13_scale")
        w2_scale_rows = _expert_scale_rows(w2_scale, "w2_scale")
        if experts <= 0:
            raise ValueError("w13_scale: number of experts (dim 0) must be > 0")
        if inter2 <= 0 or inter2 % 2:
            raise ValueError(f"w13_scale: dim 1 must be 2 * intermediate size (gate rows then up rows), got {inter2}")
        if w2_scale_rows != (experts, h):
            raise ValueError(f"w2_scale: expected shape [{experts}, {h}] (experts x hidden size), got "
                             f"{list(w2_scale.shape)}")
        _check_k(inter2 // 2, "w2")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"topk_ids: dtype must be int32 or int64, got {topk_ids.dtype}")
        if topk_ids.dim() != 2 or topk_ids.shape[0] != m:
            raise ValueError(f"topk_ids: expected shape [{m}, topk], got {list(topk_ids.shape)}")
        topk = topk_ids.shape[1]
        if topk <= 0:
            raise ValueError("topk_ids: topk (dim 1) must be > 0")
        _check_float(topk_weights.dtype, "topk_weights")
        if list(topk_weights.shape) != [m, topk]:
            raise ValueError(f"topk_weights: expected shape [{m}, {topk}] like topk_ids, got "
                             f"{list(topk_weights.shape)}")
        _check_expert_weight(w13, experts, inter2, h, "w13")
        _check_expert_weight(w2, experts, h, inter2 // 2, "w2")
        # The op returns before this check when there are no tokens.
        if m > 0 and apply_router_weight_on_input and topk != 1:
            raise ValueError(f"apply_router_weight_on_input: requires topk == 1, got topk = {topk}")
        return hidden.new_empty(hidden.shape)

    @register_fake("w8a8_cpu::pack_weight_int4")
    def _pack_weight_int4(q, scale, minimum=None, group_size=0, half_scales=False):
        _check_same_device(q, scale=scale, minimum=minimum)
        if q.dtype != torch.int8:
            raise ValueError(f"q: dtype must be int8 holding int4 values in [-8, 7] ([N, K]), got {q.dtype}")
        _check_rows(q, "q")
        if q.shape[0] <= 0:
            raise ValueError("q: N (dim 0) must be > 0")
        _check_k(q.shape[1], "q")
        if not is_int4_group(group_size):
            raise ValueError(f"group_size: expected {INT4_GROUPS}, got {group_size}")
        n, k = q.shape
        groups = (k + group_size - 1) // group_size if group_size else 1
        for t, arg in ((scale, "scale"), (minimum, "minimum")):
            if t is not None and (t.dtype != torch.float32 or list(t.shape) != [n, groups]):
                raise ValueError(f"{arg}: expected float32 [{n}, {groups}], got {t.dtype} {list(t.shape)}")
        return q.new_empty((packed_weight_nbytes(n, k, group_size, minimum is not None, half_scales),),
                           dtype=torch.uint8)

    @register_fake("w8a8_cpu::rms_norm")
    def _rms_norm(x, weight, eps):
        _check_same_device(x, weight=weight)
        return _rms_norm_rows(x, None, weight, eps)

    @register_fake("w8a8_cpu::add_rms_norm_")
    def _add_rms_norm_(x, delta, weight, eps):
        _check_same_device(x, delta=delta, weight=weight)
        return _rms_norm_rows(x, delta, weight, eps)

    @register_fake("w8a8_cpu::rotary_embedding_")
    def _rotary_embedding_(x, cos, sin, heads):
        _check_same_device(x, cos=cos, sin=sin)
        n = _layer_row_length(x, "x", None)
        for t, arg in ((cos, "cos"), (sin, "sin")):
            if t.dtype != torch.float32:
                raise ValueError(f"{arg}: dtype must be float32, got {t.dtype}")
            if t.dim() != 2 or not t.is_contiguous():
                raise ValueError(f"{arg}: expected a contiguous [positions, head_dim] tensor, got shape "
                                 f"{list(t.shape)} and strides {list(t.stride())}")
        if sin.shape != cos.shape:
            raise ValueError(f"sin: expected the shape of cos, {list(cos.shape)}, got {list(sin.shape)}")
        positions, d = cos.shape
        if d < 2 or d % 2 or d > _MAX_HEAD_DIM:
            raise ValueError(f"cos: head_dim (dim 1) must be even and in [2, {_MAX_HEAD_DIM}], got {d}")
        if positions != x.numel() // n:
            raise ValueError(f"cos: expected one row per row of x ({x.numel() // n} positions), got {positions}")
        if not 1 <= heads <= n // d:
            raise ValueError(f"heads: expected 1 <= heads <= {n // d} (heads of {d} in a row of {n}), got {heads}")

    @register_fake("w8a8_cpu::causal_attention")
    def _causal_attention(q, k, v, scale):
        _check_same_device(q, k=k, v=v)
        for t, arg in ((q, "q"), (k, "k"), (v, "v")):
            if t.dtype != torch.float32:
                raise ValueError(f"{arg}: dtype must be float32, got {t.dtype}")
            if t.dim() != 3 or t.shape[2] <= 0 or t.stride(2) != 1 or t.stride(1) != t.shape[2]:
                layout = "positions, heads" if arg == "q" else "kv_heads, positions"
                raise ValueError(f"{arg}: expected [{layout}, head_dim] with contiguous heads (strides [any, head_dim, "
                                 f"1]), got shape {list(t.shape)} and strides {list(t.stride())}")
        positions, heads, d = q.shape
        if k.shape != v.shape:
            raise ValueError(f"v: expected the shape of k, {list(k.shape)}, got {list(v.shape)}")
        if k.shape[1] != positions or k.shape[2] != d:
            raise ValueError(f"k: expected [kv_heads, {positions}, {d}] (q's positions and head_dim), got "
                             f"{list(k.shape)}")
        if heads <= 0:
            raise ValueError(f"q: expected at least one head, got shape {list(q.shape)}")
        if k.shape[0] <= 0 or heads % k.shape[0]:
            raise ValueError(f"k: kv_heads (dim 0) must divide q's {heads} heads, got {k.shape[0]}")
        if not abs(scale) <= _FLOAT32_MAX:
            raise ValueError(f"scale: expected a finite float32 value, got {scale}")
        return q.new_empty((positions, heads, d))

    @register_fake("w8a8_cpu::decode_attention_")
    def _decode_attention_(qkv, k_cache, v_cache, position, heads, scale, k_scale=None, v_scale=None):
        _check_same_device(qkv, k_cache=k_cache, v_cache=v_cache, k_scale=k_scale, v_scale=v_scale)
        if qkv.dtype != torch.float32:
            raise ValueError(f"qkv: dtype must be float32, got {qkv.dtype}")
        if k_cache.dtype not in _KV_CACHE_DTYPES:
            raise ValueError(f"k_cache: dtype must be float32, float16 or int8 (the KV cache's storage), got "
                             f"{k_cache.dtype}")
        if v_cache.dtype != k_cache.dtype:
            raise ValueError(f"v_cache: expected the dtype of k_cache, {k_cache.dtype}, got {v_cache.dtype}")
        for t, arg in ((qkv, "qkv"), (k_cache, "k_cache"), (v_cache, "v_cache")):
            if not t.is_contiguous() or t.numel() == 0:
                raise ValueError(f"{arg}: expected a non-empty contiguous tensor, got shape {list(t.shape)} and "
                                 f"strides {list(t.stride())}")
        if k_cache.dim() != 3 or k_cache.shape[2] > _MAX_HEAD_DIM:
            raise ValueError(f"k_cache: expected [kv_heads, length, head_dim] with head_dim <= {_MAX_HEAD_DIM}, got "
                             f"shape {list(k_cache.shape)}")
        if v_cache.shape != k_cache.shape:
            raise ValueError(f"v_cache: expected the shape of k_cache, {list(k_cache.shape)}, got "
                             f"{list(v_cache.shape)}")
        kv_heads, length, d = k_cache.shape
        int8 = k_cache.dtype == torch.int8
        for t, arg in ((k_scale, "k_scale"), (v_scale, "v_scale")):
            if not int8 and t is not None:
                raise ValueError(f"{arg}: only an int8 cache has scales, got one with a {k_cache.dtype} cache")
            if int8 and (t is None or t.dtype != torch.float32 or tuple(t.shape) != (kv_heads, length) or
                         not t.is_contiguous()):
                got = "None" if t is None else f"{t.dtype} of shape {list(t.shape)}"
                raise ValueError(f"{arg}: an int8 cache needs a contiguous float32 [{kv_heads}, {length}] scale per "
                                 f"row (kv_heads, length), got {got}")
        if not 1 <= heads <= 2 ** 31 - 1 or heads % kv_heads:
            raise ValueError(f"heads: expected a positive multiple of the caches' {kv_heads} KV heads, got {heads}")
        if qkv.dim() != 2 or tuple(qkv.shape) != (heads + 2 * kv_heads, d):
            raise ValueError(f"qkv: expected [{heads + 2 * kv_heads}, {d}] ({heads} query, {kv_heads} key and "
                             f"{kv_heads} value heads of the caches' head_dim), got {list(qkv.shape)}")
        if not 0 <= position < length:
            raise ValueError(f"position: expected 0 <= position < {length} (the caches' length), got {position}")
        if not abs(scale) <= _FLOAT32_MAX:
            raise ValueError(f"scale: expected a finite float32 value, got {scale}")
        return qkv.new_empty((heads, d))

    @register_fake("w8a8_cpu::decode_step_")
    def _decode_step_(h, weights, k_caches, v_caches, cos, sin, position, heads, scale, eps, k_scales=None,
                      v_scales=None):
        # the shapes decode_step_ checks before its layers; each layer's ops check theirs (their fakes above)
        layers = len(k_caches)
        if layers < 1 or len(v_caches) != layers:
            raise ValueError(f"v_caches: expected one cache per layer of k_caches ({layers}), got {len(v_caches)}")
        for arg, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
            if scales and len(scales) != layers:
                raise ValueError(f"{arg}: expected none or one per layer of k_caches ({layers}), got {len(scales)}")
        if len(weights) != _DECODE_STEP_WEIGHTS * layers + 1:
            raise ValueError(f"weights: expected {_DECODE_STEP_WEIGHTS} a layer ({layers} layers) and the final "
                             f"norm's, {_DECODE_STEP_WEIGHTS * layers + 1} in all, got {len(weights)}")
        if h.dtype != torch.float32 or h.dim() < 1 or h.numel() != h.shape[-1]:
            raise ValueError(f"h: expected one fp32 row [..., H] (a decode step's embedding), got {h.dtype} "
                             f"{list(h.shape)}")
        if not 1 <= heads <= 2 ** 31 - 1:
            raise ValueError(f"heads: expected 1 <= heads <= {2 ** 31 - 1}, got {heads}")
        if cos.dim() != 2 or not 0 <= position < cos.shape[0]:
            raise ValueError(f"position: expected 0 <= position < {cos.shape[0] if cos.dim() == 2 else 0} (the rows "
                             f"of cos [positions, head_dim]), got {position} with cos of shape {list(cos.shape)}")
        if sin.shape != cos.shape:
            raise ValueError(f"sin: expected the shape of cos, {list(cos.shape)}, got {list(sin.shape)}")
        for layer, (k_cache, v_cache) in enumerate(zip(k_caches, v_caches)):
            if (k_cache.dtype == torch.int8) != bool(k_scales) or (k_cache.dtype == torch.int8) != bool(v_scales):
                raise ValueError(f"layer {layer}, k_cache: k_scales, v_scales: expected one per layer with int8 "
                                 f"caches and none otherwise, got {len(k_scales or ())} and {len(v_scales or ())} with a "
                                 f"{k_cache.dtype} cache")
            if k_cache.dim() != 3 or k_cache.numel() == 0 or k_cache.shape[0] > 2 ** 31 - 1 or \
                    not k_cache.is_contiguous() or not v_cache.is_contiguous():
                raise ValueError(f"layer {layer}, k_cache: expected contiguous, non-empty caches [kv_heads, length, "
                                 f"head_dim] (kv_heads < 2^31), got k_cache of shape {list(k_cache.shape)} and "
                                 f"strides {list(k_cache.stride())}")
        return h.new_empty(h.shape)

    @register_fake("w8a8_cpu::pack_weight")
    def _pack_weight(w):
        if w.dtype != torch.int8:
            raise ValueError(f"w: dtype must be int8 (a raw [N, K] weight), got {w.dtype}")
        _check_rows(w, "w")
        _check_n_positive(w)
        _check_k(w.shape[1], "w")
        return w.new_empty((packed_weight_nbytes(w.shape[0], w.shape[1]),), dtype=torch.uint8)
