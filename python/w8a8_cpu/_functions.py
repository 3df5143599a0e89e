"""The package's op functions (w8a8_cpu re-exports them): dispatch report and control, the op wrappers and weight
packing. The quantization convention is in the package docstring; weight quantization is in quant/."""
from __future__ import annotations

import contextlib
import json
import math
import os
from typing import Iterator, Optional, Tuple

import torch

from ._loader import ops
from ._packed_weight import HEADER_BYTES, header_half_scales, header_scheme, header_sizes, int4_panels


def info() -> dict:
    """CPU/dispatch report: arch, detected features, compiled/runnable variants, selected variant,
    torch version and thread count."""
    report = json.loads(ops._info())
    report["torch_version"] = torch.__version__
    report["threads"] = torch.get_num_threads()
    report["isa_override"] = os.environ.get("W8A8_CPU_ISA") or None
    return report


@contextlib.contextmanager
def use_variant(name: str) -> Iterator[None]:
    """Run ops called from this thread on variant `name` ("ref", "avx2", ...) inside the block, then restore the
    thread's previous choice. Thread-local: other threads keep their own variant; blocks nest."""
    previous = ops._set_variant(name)
    try:
        yield
    finally:
        ops._set_variant(previous)


def _require_tensors(**tensors: object) -> None:
    # The dispatcher's own error for a None / non-tensor argument does not name it ("tensor does not have a device").
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")


def per_token_quant_int8(x: torch.Tensor, amax: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """x bf16/fp16/fp32 [M, K] -> (x_q int8 [M, K], x_scale fp32 [M, 1]). A NaN/Inf row gets scale NaN and q = 0
    (so its matmul output row is NaN), or raises ValueError under W8A8_CPU_CHECK_FINITE=1.

    amax (fp32 [M] or [M, 1]): quantize row i with this absmax instead of its own, e.g. the maximum over the ranks
    holding slices of one row: each rank then quantizes its slice exactly as the whole row would be. It must be >=
    the row's own absmax (ValueError naming amax otherwise: the row would saturate); a NaN/Inf row, or a NaN/+Inf
    amax, gives that row scale NaN and q = 0 as above. No gradient: backward through x_scale raises (int8_scaled_mm_with_quant has one)."""
    _require_tensors(x=x)
    return ops.per_token_quant_int8(x, amax)


def int8_mm(x_q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Exact int32 accumulators x_q int8 [M, K] @ w.T (w int8 [N, K] or packed) -> int32 [M, N].

    With scale_accumulators (after summing partial products, e.g. over ranks) it gives int8_scaled_mm's bits."""
    _require_tensors(x_q=x_q, w=w)
    return ops.int8_mm(x_q, w)


def scale_accumulators(acc: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                       bias: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """int8_scaled_mm's epilogue on int32 accumulators [M, N]: float32(acc) * (x_scale * w_scale) + bias, then one
    cast to out_dtype (default float32). Bit-identical to int8_scaled_mm on the same accumulators."""
    _require_tensors(acc=acc, x_scale=x_scale, w_scale=w_scale)
    return ops.scale_accumulators(acc, x_scale, w_scale, bias, out_dtype)


def int8_scaled_mm(
    x_q: torch.Tensor,
    w: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """(x_q int8 [M, K]) x (w int8 [N, K] or packed) -> [M, N] in out_dtype (default float32).

    out = float32(x_q @ w.T, exact int32) * (x_scale * w_scale) + bias, then one cast to out_dtype.
    No gradient: backward through it raises (int8_scaled_mm_with_quant has one)."""
    _require_tensors(x_q=x_q, w=w, x_scale=x_scale, w_scale=w_scale)
    return ops.int8_scaled_mm(x_q, w, x_scale, w_scale, bias, out_dtype)


def int8_scaled_mm_with_quant(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
    amax: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Fused per-token quantization of x [..., K] and int8_scaled_mm -> [..., N] (default dtype: x.dtype).
    amax: per-row absmax to quantize with, as in per_token_quant_int8.

    W4A8: w packed by pack_weight_int4 (int4 weights with their group scales and minimums inside the blob); w_scale
    [N] then multiplies each output channel on top (ones for a plain W4A8 layer). Each group's int32 products are
    exact; the groups combine in fp32 in one fixed order shared by every variant (docs/ARCHITECTURE.md).

    Differentiable w.r.t. x (torch >= 2.4), straight-through: grad_x = grad_out @ (the dequantized weight, e.g.
    w_int8 * w_scale[:, None]) in fp32 (dequantized_weight), cast to x.dtype, as if the activations were not rounded to int8. w, w_scale and bias are frozen: one
    that requires grad makes backward raise ValueError naming it."""
    _require_tensors(x=x, w=w, w_scale=w_scale)
    return ops.int8_scaled_mm_with_quant(x, w, w_scale, bias, out_dtype, amax)


def int8_gated_mm_with_quant(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """A SwiGLU MLP's gate and up projections as one op: w holds 2I output channels, the gate's rows then the up's
    (int8 [2I, K], or packed: int8, or int4 as in int8_scaled_mm_with_quant), w_scale fp32 [2I], bias [2I] or None. x [..., K] is quantized per token once, one GEMM
    gives gate and up exactly as int8_scaled_mm_with_quant would for each half (bit for bit), then
    silu(gate) * up in fp32 (the fused MoE's SiLU, identical on every variant), cast once -> [..., I] in out_dtype
    (default x.dtype). No gradient: backward through it raises."""
    _require_tensors(x=x, w=w, w_scale=w_scale)
    return ops.int8_gated_mm_with_quant(x, w, w_scale, bias, out_dtype)


# Largest K of a layer with asymmetric activations: |x_q . w - zp * sum(w)| <= 2 * 128 * 128 * K must fit int32.
MAX_K_ZERO_POINT = 65535


def _strict_finite() -> bool:
    """W8A8_CPU_CHECK_FINITE=1: a NaN/Inf activation row raises instead of giving a NaN output row (as in the ops)."""
    return os.environ.get("W8A8_CPU_CHECK_FINITE") == "1"


def check_static_activation_params(input_scale: torch.Tensor, input_zero_point: Optional[torch.Tensor],
                                   symmetric: bool) -> None:
    """A static activation scale: one finite value > 0; a zero point (asymmetric only, then required): one integer
    in [-128, 127]. ValueError naming the argument otherwise."""
    one_float = isinstance(input_scale, torch.Tensor) and input_scale.numel() == 1 and input_scale.is_floating_point()
    if not one_float or not (math.isfinite(float(input_scale)) and float(input_scale) > 0):
        raise ValueError(f"input_scale: expected one finite float > 0, got "
                         f"{float(input_scale) if one_float else type(input_scale).__name__}")
    if (input_zero_point is None) != symmetric:
        raise ValueError("input_zero_point: static activations take one exactly when they are asymmetric")
    if input_zero_point is not None and (
            not isinstance(input_zero_point, torch.Tensor) or input_zero_point.numel() != 1
            or input_zero_point.is_floating_point() or input_zero_point.is_complex()
            or not -128 <= int(input_zero_point) <= 127):
        raise ValueError("input_zero_point: expected one integer in [-128, 127]")


def asymmetric_activation_params(low: torch.Tensor, high: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The int8 grid over [low, high] widened to include 0 (so 0 is exact): scale = max((high - low) / 255, 1e-10)
    fp32 and zero point clamp(-128 - round(low / scale), -128, 127) int32, elementwise."""
    low, high = low.to(torch.float32).clamp(max=0.0), high.to(torch.float32).clamp(min=0.0)
    scale = ((high - low) / 255).clamp_min(1e-10)
    return scale, (-128 - torch.round(low / scale)).clamp(-128, 127).to(torch.int32)


def quantize_activations(x: torch.Tensor, input_scale: Optional[torch.Tensor] = None,
                         input_zero_point: Optional[torch.Tensor] = None, symmetric: bool = True
                         ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """The activation schemes besides the default (per_token_quant_int8: dynamic per token, symmetric, [-127, 127]):
    x float [M, K] -> (x_q int8 [M, K], x_scale fp32 [M], x_zero_point int32 [M] or None for symmetric).

    Static (input_scale fp32, one value, from a checkpoint; input_zero_point one integer in [-128, 127] when
    asymmetric): q = clamp(round_half_even(x / s) + zp, -128, 127) in fp32, the full int8 range as compressed-tensors
    and vLLM quantize. Dynamic asymmetric per token (input_scale None, symmetric False): the row's range widened to
    include 0, lo = min(min x, 0), hi = max(max x, 0), s = max((hi - lo) / 255, 1e-10), zp = clamp(-128 - round(lo /
    s), -128, 127), then the same rule. A row holding NaN/Inf gets scale NaN and q = 0 (its output row is NaN), or
    raises ValueError under W8A8_CPU_CHECK_FINITE=1."""
    _require_tensors(x=x)
    if not x.is_floating_point() or x.dim() != 2:
        raise ValueError(f"x: expected a floating-point [M, K] tensor, got {x.dtype} {tuple(x.shape)}")
    if input_scale is None and (symmetric or input_zero_point is not None):
        raise ValueError("input_scale: None means dynamic per-token activations, which take no zero point here and "
                         "are asymmetric (symmetric ones: per_token_quant_int8)")
    if input_scale is not None:
        check_static_activation_params(input_scale, input_zero_point, symmetric)
    x32 = x.detach().to(torch.float32)
    bad = ~torch.isfinite(x32).all(dim=1)
    if _strict_finite() and bool(bad.any()):
        raise ValueError(f"x: row {int(bad.nonzero()[0])} contains NaN or Inf (W8A8_CPU_CHECK_FINITE=1)")
    return _quantized_rows(x32, bad, input_scale, input_zero_point, symmetric)


def _quantized_rows(x32: torch.Tensor, bad: torch.Tensor, input_scale: Optional[torch.Tensor],
                    input_zero_point: Optional[torch.Tensor], symmetric: bool
                    ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """quantize_activations' arithmetic on fp32 rows [M, K] whose non-finite rows `bad` [M] are marked, its arguments
    already checked: torch ops only, so that torch.compile(fullgraph=True) traces it (the vLLM plugin checks a
    layer's static parameters once, at load)."""
    x32 = x32.masked_fill(bad[:, None], 0.0)
    if input_scale is None:
        scale, zero_point = asymmetric_activation_params(x32.amin(dim=1), x32.amax(dim=1))
    else:
        scale = input_scale.reshape(1).to(torch.float32).expand(x32.shape[0]).clone()
        zero_point = None if symmetric else input_zero_point.reshape(1).to(torch.int32).expand(x32.shape[0])
    q = torch.round(x32 / scale[:, None])
    if zero_point is not None:
        q = q + zero_point[:, None]
    x_q = q.clamp_(-128, 127).to(torch.int8).masked_fill_(bad[:, None], 0)
    return x_q, scale.masked_fill(bad, float("nan")), zero_point


def int8_scaled_mm_with_activations(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                                    bias: Optional[torch.Tensor] = None, *, input_scale: Optional[torch.Tensor] = None,
                                    input_zero_point: Optional[torch.Tensor] = None, symmetric: bool = True,
                                    w_sum: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int8_scaled_mm_with_quant for static and/or asymmetric activations (quantize_activations' schemes) -> [..., N]
    in x.dtype: out = float32(x_q . w - zp * sum_k w, exact in int32) * (x_scale * w_scale) + bias, the same epilogue
    (scale_accumulators). w: an int8 packed blob; w_sum int32 [N] its channel sums (computed when None). No gradient
    here (the int8 rounding cuts it); W8A8Linear wraps it in the straight-through one
    (_autograd.StaticActivationsLinear)."""
    _require_tensors(x=x, w=w, w_scale=w_scale)
    k = x.shape[-1]
    if not symmetric and k > MAX_K_ZERO_POINT:
        raise ValueError(f"x: K = {k} exceeds {MAX_K_ZERO_POINT}, beyond which asymmetric activations' int32 "
                         f"accumulators could overflow")
    if not symmetric and w_sum is None:
        w_sum = weight_channel_sums(w)
    x_q, x_scale, zero_point = quantize_activations(x.reshape(-1, k), input_scale, input_zero_point, symmetric)
    return _scaled_mm_of_rows(x, x_q, x_scale, zero_point, w, w_scale, bias, w_sum)


def _scaled_mm_of_rows(x: torch.Tensor, x_q: torch.Tensor, x_scale: torch.Tensor, zero_point: Optional[torch.Tensor],
                       w: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor],
                       w_sum: Optional[torch.Tensor]) -> torch.Tensor:
    """int8_scaled_mm_with_activations after quantization: x_q [M, K] of x [..., K] -> [..., N] in x.dtype."""
    acc = ops.int8_mm(x_q, w)
    if zero_point is not None:
        acc = acc - zero_point[:, None] * w_sum[None, :]
    out = ops.scale_accumulators(acc, x_scale, w_scale, bias, x.dtype)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def traced_mm_with_activations(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor],
                               input_scale: Optional[torch.Tensor], input_zero_point: Optional[torch.Tensor],
                               symmetric: bool, w_sum: Optional[torch.Tensor]) -> torch.Tensor:
    """int8_scaled_mm_with_activations' outputs for arguments checked once beforehand (check_static_activation_params,
    MAX_K_ZERO_POINT, w_sum given when asymmetric), in torch ops that torch.compile(fullgraph=True) traces: no
    W8A8_CPU_CHECK_FINITE refusal here (a non-finite row gives a NaN output row)."""
    x32 = x.reshape(-1, x.shape[-1]).to(torch.float32)
    x_q, x_scale, zero_point = _quantized_rows(x32, ~torch.isfinite(x32).all(dim=1), input_scale, input_zero_point,
                                               symmetric)
    return _scaled_mm_of_rows(x, x_q, x_scale, zero_point, w, w_scale, bias, w_sum)


def pack_weight(w: torch.Tensor) -> torch.Tensor:
    """Reorder an int8 [N, K] weight once into the layout the active variant reads fastest.

    Returns a self-describing 1-D uint8 blob (see docs/ARCHITECTURE.md); the matmul ops accept it in place
    of the raw weight. A blob packed for another panel layout is rejected with an error naming both."""
    _require_tensors(w=w)
    return ops.pack_weight(w)


def pack_weight_int4(q: torch.Tensor, scale: torch.Tensor, minimum: Optional[torch.Tensor] = None,
                     group_size: int = 32, half_scales: Optional[bool] = None) -> torch.Tensor:
    """Pack W4A8 weights (quantize_weight_int4's output): q int8 [N, K] holding values in [-8, 7], scale fp32 [N,
    groups] and minimum None or fp32 [N, groups] per group of group_size consecutive k (a power of two in [32, 65536]; 0:
    one group per channel), w = scale * q (+ minimum). One blob in the active variant's panel layout: two weights per
    byte, each panel followed by its group scales (and minimums), K padded to whole groups; the header names the
    scheme and group size. The linear ops take it like an int8 blob, with w_scale [N] multiplying on top (ones).

    half_scales: store the scales as fp16, which holds the same values in half the bytes when every scale is an fp16
    value (ValueError naming `scale` otherwise); the results are the same bits either way, a decode reads fewer bytes
    (groups of 32: 0.5625 of an int8 weight's, not 0.625). None (default): fp16 exactly when every scale is one
    (quantize_weight_int4 rounds its scales so; checkpoints' fp16 and most bf16 scales are)."""
    _require_tensors(q=q, scale=scale)
    if not isinstance(group_size, int) or isinstance(group_size, bool):
        raise ValueError(f"group_size: expected an int, got {group_size!r}")
    if half_scales is None:
        half_scales = fp16_values(scale)
    elif not isinstance(half_scales, bool):
        raise ValueError(f"half_scales: expected None or a bool, got {half_scales!r}")
    return ops.pack_weight_int4(q, scale, minimum, group_size, half_scales)


def fp16_values(t: torch.Tensor) -> bool:
    """Whether every element of a float tensor is an fp16 value (converts to fp16 and back unchanged; NaN never)."""
    return t.dtype == torch.float32 and bool((t.to(torch.float16).to(torch.float32) == t).all())


def _verified_blob(blob: torch.Tensor, arg: str = "blob", packers: str = "pack_weight") -> torch.Tensor:
    """The contiguous bytes of a packed blob after verifying it as the ops do (header bounds, checksum, channel sums;
    a bad one raises ValueError): from here on its header's sizes are bounded and describe it."""
    if not isinstance(blob, torch.Tensor) or blob.dtype != torch.uint8 or blob.dim() != 1:
        raise ValueError(f"{arg}: expected the 1-D uint8 output of {packers}, got "
                         f"{getattr(blob, 'dtype', type(blob))} {tuple(getattr(blob, 'shape', ()))}")
    raw = blob.detach().contiguous()
    ops._verify_packed_weight(raw)
    return raw


def int4_weight_values(blob: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], int]:
    """(q int8 [N, K] in [-8, 7], scale fp32 [N, groups], minimum fp32 [N, groups] or None, group size (0: per
    channel)) of a verified W4A8 blob: pack_weight_int4's inputs back (to save checkpoints)."""
    q = unpack_weight(blob)  # verifies the blob as the ops do
    raw = blob.detach().contiguous()
    nr, kr, n, k, n_padded, k_padded = header_sizes(raw)
    weights = header_scheme(raw)
    if weights.bits == 8:
        raise ValueError("blob: holds int8 weights (pack_weight); int4_weight_values reads pack_weight_int4's blobs")
    body, nibble_bytes, scales_end, groups = int4_panels(raw)
    panels = n_padded // nr

    def per_channel(values: torch.Tensor) -> torch.Tensor:  # [panels, groups, nr] -> fp32 [N, groups]
        return values.permute(0, 2, 1).reshape(n_padded, groups)[:n].to(torch.float32).contiguous()

    scales = body[:, nibble_bytes:scales_end].contiguous().view(torch.float16 if header_half_scales(raw) else
                                                                torch.float32)
    scale = per_channel(scales.view(panels, groups, nr))
    if weights.symmetric:
        return q, scale, None, weights.group_size
    minimum = per_channel(body[:, scales_end:].contiguous().view(torch.float32).view(panels, groups, nr))
    return q, scale, minimum, weights.group_size


def weight_scheme(blob: torch.Tensor) -> str:
    """"int8" or "int4": the weight scheme of a packed blob, verified first as the ops verify it (ValueError)."""
    raw = _verified_blob(blob, packers="pack_weight or pack_weight_int4")
    return f"int{header_scheme(raw).bits}"


def dequantized_weight(blob: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] float weight a packed blob stands for in the linear ops, times w_scale [N]: int8 q * w_scale, or
    for int4 (q * group scale (+ group minimum)) * w_scale."""
    if weight_scheme(blob) == "int8":
        weight = unpack_weight(blob).float()
    else:
        q, scale, minimum, group = int4_weight_values(blob)
        which = torch.arange(q.shape[1]) // (group or q.shape[1])  # each k's group
        weight = q.float() * scale[:, which]
        if minimum is not None:
            weight = weight + minimum[:, which]
    return weight * w_scale.float().reshape(-1, 1)


def _verified_panels(blob: torch.Tensor, arg: str = "blob") -> Tuple[torch.Tensor, int, int]:
    """(panels int8 [N_padded / nr, K_padded / kr, nr, kr], n, k) of a blob, after verifying it as the ops do
    (header bounds, checksum, channel sums; a bad one raises ValueError): panel[k / kr][n % nr][k % kr]. int4
    panels come widened to int8 (values -8..7)."""
    raw = _verified_blob(blob, arg)
    nr, kr, n, k, n_padded, k_padded = header_sizes(raw)
    if header_scheme(raw).bits == 4:  # int4: nibbles u = q + 8, 32 bytes hold 64 elements: low nibbles, then high
        body, nibble_bytes, _, _ = int4_panels(raw)
        chunks = body[:, :nibble_bytes].reshape(-1, 32).to(torch.int16)
        panels = (torch.cat([chunks & 0x0F, chunks >> 4], dim=1) - 8).to(torch.int8).reshape(-1)
    else:
        panels = raw[HEADER_BYTES:HEADER_BYTES + n_padded * k_padded].view(torch.int8)
    return panels.view(n_padded // nr, k_padded // kr, nr, kr), n, k


def weight_channel_sums(blob: torch.Tensor) -> torch.Tensor:
    """int32 [N]: each output channel's sum of an int8 packed weight over k, read from the blob (which stores them for
    the biased-A tiles; verified against the panels as the ops verify a blob) instead of unpacking it: the weight's
    side of asymmetric activations' correction, zp * sum_k w."""
    raw = _verified_blob(blob)
    if header_scheme(raw).bits == 4:
        raise ValueError("blob: holds int4 weights, which store no channel sums (asymmetric activations are for int8 "
                         "weights)")
    _, _, n, _, n_padded, k_padded = header_sizes(raw)
    start = HEADER_BYTES + n_padded * k_padded
    # host byte order, as the ops read them; a copy first: the blob's slice may sit at any byte address
    return raw[start:start + 4 * n_padded].clone().view(torch.int32)[:n]


def unpack_weight(blob: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_weight: a packed 1-D uint8 blob -> the int8 [N, K] weight it was packed from.

    Reads the blob's own layout (any variant's), so weights packed here can be saved in a portable format. The blob
    is first verified exactly as the ops verify it (header bounds, checksum, channel sums); a bad one raises
    ValueError."""
    panels, n, k = _verified_panels(blob)
    p, groups, nr, kr = panels.shape
    return panels.permute(0, 2, 1, 3).reshape(p * nr, groups * kr)[:n, :k].contiguous()


def _gather_rows(panels: torch.Tensor, n: int, k: int, rows: torch.Tensor, arg: str) -> torch.Tensor:
    """Rows `rows` (int64, any shape, checked against [0, n): IndexError naming `arg`) of the int8 [n, k] weight whose
    verified panels _verified_panels gave -> int8 [*rows.shape, k]."""
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n):
        raise IndexError(f"{arg}: indices must be in [0, {n}), got [{int(rows.min())}, {int(rows.max())}]")
    nr = panels.shape[2]
    picked = panels[rows // nr, :, rows % nr, :]  # [*rows.shape, K_padded / kr, kr]
    return picked.reshape(*rows.shape, -1)[..., :k]


def packed_rows(blob: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Rows of the int8 [N, K] weight a packed blob holds, gathered without unpacking the rest: int64 `rows` of any
    shape -> int8 [*rows.shape, K] (an int8 embedding table that is also the packed lm_head reads token rows so).
    Indices are checked against [0, N) (IndexError otherwise); the blob is verified as in unpack_weight."""
    _require_tensors(rows=rows)
    panels, n, k = _verified_panels(blob)
    return _gather_rows(panels, n, k, rows, "rows")


def pack_moe_weights(w13: torch.Tensor, w2: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pack MoE expert weights once: w13 int8 [E, 2I, H], w2 int8 [E, H, I] -> two uint8 [E, bytes] tensors
    (one pack_weight blob per expert) that fused_experts accepts in place of the raw weights."""
    for name, w in (("w13", w13), ("w2", w2)):
        if not isinstance(w, torch.Tensor) or w.dtype != torch.int8 or w.dim() != 3 or w.shape[0] == 0:
            raise ValueError(f"{name}: expected a non-empty int8 [E, N, K] tensor, got "
                             f"{getattr(w, 'dtype', type(w))} {tuple(getattr(w, 'shape', ()))}")
    return (torch.stack([ops.pack_weight(w) for w in w13.contiguous()]),
            torch.stack([ops.pack_weight(w) for w in w2.contiguous()]))


def pack_experts_int4(q: torch.Tensor, scale: torch.Tensor, minimum: Optional[torch.Tensor] = None,
                      group_size: int = 32) -> torch.Tensor:
    """pack_weight_int4 for MoE experts: q int8 [E, N, K] in [-8, 7], scale fp32 [E, N, groups], minimum None or fp32
    [E, N, groups] (quantize_weight_int4's output per expert, e.g. of w.reshape(E * N, K) reshaped back) -> uint8
    [E, bytes], one W4A8 blob per expert, that fused_experts takes in place of int8 experts (pack w13 and w2 each
    so; their w13_scale / w2_scale [E, N] then multiply on top, ones for plain W4A8)."""
    _require_tensors(q=q, scale=scale)
    if q.dim() != 3 or q.shape[0] == 0:
        raise ValueError(f"q: expected a non-empty int8 [E, N, K] tensor, got {q.dtype} {tuple(q.shape)}")
    for name, t in (("scale", scale), ("minimum", minimum)):
        if t is not None and (not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[0] != q.shape[0]):
            raise ValueError(f"{name}: expected [{q.shape[0]}, N, groups] (one row of group values per expert), got "
                             f"{tuple(getattr(t, 'shape', ()))}")
    half = fp16_values(scale)  # one storage for every expert: their blobs stack into one tensor
    blobs = []
    for e in range(q.shape[0]):
        try:
            blobs.append(pack_weight_int4(q[e], scale[e], None if minimum is None else minimum[e], group_size, half))
        except ValueError as error:
            raise ValueError(f"expert {e}: {error}") from None
    return torch.stack(blobs)


def fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    """Fused W8A8 / W4A8 MoE (sglang's CPU W8A8 semantics) -> [M, H] in hidden's dtype.

    hidden [M, H] float; w13 int8 [E, 2I, H] (gate rows, then up rows) and w2 int8 [E, H, I], raw or from
    pack_moe_weights; topk_weights [M, topk] float; topk_ids [M, topk] int32/int64 in [0, E);
    w13_scale fp32 [E, 2I] or [E, 2I, 1]; w2_scale fp32 [E, H] or [E, H, 1]. Per (token, k): per-token int8
    quant of hidden, gate_up = int8 mm with w13, act = silu(gate) * up re-quantized per row, down = int8 mm
    with w2, out[token] += topk_weight * down (slots summed in order), one cast at the end.
    apply_router_weight_on_input (topk == 1 only) scales the input by the weight instead of the output.

    W4A8 experts: w13 and/or w2 from pack_experts_int4 (int4 weights with their group scales and minimums in each
    expert's blob; the experts of one projection packed alike); each projection is then int8_scaled_mm_with_quant's
    W4A8 GEMM (exact int32 per group, the fixed fp32 group order) with w13_scale / w2_scale on top (ones for plain
    W4A8); the routing, SiLU and combine are the same.

    Differentiable w.r.t. hidden and topk_weights (torch >= 2.4), straight-through: the gradient of the same MoE
    computed in fp32 with the dequantized experts (dequantized_weight), as if neither the input nor the SiLU-gated
    activations were rounded to int8. It is recomputed expert by expert in backward (slower than the forward);
    weights and scales are frozen: one that requires grad makes backward raise ValueError naming it."""
    _require_tensors(hidden=hidden, w13=w13, w2=w2, topk_weights=topk_weights, topk_ids=topk_ids,
                     w13_scale=w13_scale, w2_scale=w2_scale)
    return ops.fused_experts(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, activation,
                              apply_router_weight_on_input)
