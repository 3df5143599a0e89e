"""Pure-torch reference of the ops' exact semantics (integer matmul in fp64, which is exact for |sum| < 2^53).

Used by the self-check (`python -m w8a8_cpu`) and the tests; slow, but independent of every kernel."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

AMAX_EPS = 1e-10


def per_token_quant_int8(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    x32 = x.to(torch.float32)
    amax = x32.abs().amax(dim=-1, keepdim=True).clamp_min(AMAX_EPS)
    inv_scale = torch.full_like(amax, 127.0) / amax  # fp32 division, as in the kernels
    x_q = torch.round(x32 * inv_scale).clamp_(-127, 127).to(torch.int8)  # torch.round: half to even
    return x_q, amax / 127.0


def int8_matmul(x_q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """Exact x_q @ w_q.T as float64 (integers, exactly representable)."""
    return x_q.to(torch.float64) @ w_q.to(torch.float64).T


def int8_scaled_mm(
    x_q: torch.Tensor,
    w_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_scale: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The kernels' fp32 epilogue, operation for operation: float32(acc) * (x_scale * w_scale) + bias."""
    acc = int8_matmul(x_q, w_q).to(torch.float32)
    out = acc * (x_scale.reshape(-1, 1).to(torch.float32) * w_scale.reshape(1, -1).to(torch.float32))
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def int8_scaled_mm_fp64(x_q, w_q, x_scale, w_scale, bias=None) -> torch.Tensor:
    """Same math with an fp64 epilogue: the ideal result the fp32 kernels approximate."""
    out = int8_matmul(x_q, w_q) * (x_scale.reshape(-1, 1).double() * w_scale.reshape(1, -1).double())
    return out if bias is None else out + bias.double()


def fused_experts(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, apply_router_weight_on_input=False):
    """Per-expert loop with the op's math in torch (fp32 stages, exact integer matmuls, torch's silu)."""
    m, h = hidden.shape
    inter = w13.shape[1] // 2
    x = hidden.float()
    weights = topk_weights.float()
    if apply_router_weight_on_input:
        x, weights = x * weights, torch.ones_like(weights)
    x_q, x_scale = per_token_quant_int8(x)
    out = torch.zeros(m, h, dtype=torch.float32)
    ids = topk_ids.long()
    for e in ids.unique().tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        gate_up = int8_scaled_mm(x_q[tokens], w13[e], x_scale[tokens], w13_scale[e].reshape(-1))
        act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        a_q, a_scale = per_token_quant_int8(act)
        down = int8_scaled_mm(a_q, w2[e], a_scale, w2_scale[e].reshape(-1))
        out.index_add_(0, tokens, weights[tokens, slots][:, None] * down)
    return out.to(hidden.dtype)


def int4_scaled_mm(x_q: torch.Tensor, w_q: torch.Tensor, x_scale: torch.Tensor, w_scale: torch.Tensor,
                   group_scale: torch.Tensor, group_min: Optional[torch.Tensor], group_size: int,
                   bias: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The W4A8 ops' exact result: w_q int8 [N, K] in [-8, 7], group_scale / group_min fp32 [N, groups] (group_size
    0: one group), w_scale fp32 [N]. Each group's int32 products (exact, in fp64), combined in fp32 in the ops' order:
    t = 0; per group t = t + float(acc_g) * scale_g, then t = t + float(sum_g x_q) * min_g; out = t * (x_scale *
    w_scale) (+ bias), cast once."""
    n, k = w_q.shape
    group = group_size or k
    groups = (k + group - 1) // group
    t = torch.zeros(x_q.shape[0], n, dtype=torch.float32)
    for g in range(groups):
        cols = slice(g * group, min(k, (g + 1) * group))
        acc = (x_q[:, cols].double() @ w_q[:, cols].double().T).to(torch.float32)
        t = t + acc * group_scale[:, g]
        if group_min is not None:
            t = t + x_q[:, cols].double().sum(dim=1, keepdim=True).to(torch.float32) * group_min[:, g]
    out = t * (x_scale.reshape(-1, 1).to(torch.float32) * w_scale.reshape(1, -1).to(torch.float32))
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)
