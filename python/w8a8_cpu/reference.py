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


def _f32(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The ops' silu(gate) * up in fp32, operation for operation (csrc/common/gemm_driver.cpp, exp_poly and silu_mul):
    gate / (1 + exp(-gate)) * up with exp by a degree-6 polynomial and 2^n from the exponent bits. Each torch op on
    fp32 tensors rounds once, as the kernels' plain IEEE operations (no FMA contraction) do."""
    x = (-gate).clamp(-87.0, 88.0)
    magic = _f32(12582912.0)
    n = (x * _f32(1.44269504) + magic) - magic
    r = (x - n * _f32(0.693145752)) - n * _f32(1.42860677e-6)
    one = _f32(1.0)
    p = one / _f32(720.0)
    for divisor in (120.0, 24.0, 6.0, 2.0):
        p = p * r + one / _f32(divisor)
    p = p * r + one
    p = p * r + one
    two_n = ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    return gate / (one + p * two_n) * up


def _expert_mm(x_q, x_scale, w, e, w_scale):
    """Expert e's projection: int8_scaled_mm of int8 experts w [E, N, K], or int4_scaled_mm of int4 experts w = (q [E,
    N, K], group scales [E, N, groups], group minimums [E, N, groups] or None, group size)."""
    if isinstance(w, torch.Tensor):
        return int8_scaled_mm(x_q, w[e], x_scale, w_scale)
    q, group_scale, group_min, group_size = w
    return int4_scaled_mm(x_q, q[e], x_scale, w_scale, group_scale[e], None if group_min is None else group_min[e],
                          group_size)


def fused_experts(hidden, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, apply_router_weight_on_input=False):
    """The op's exact result by a per-expert loop in torch (fp32 stages, exact integer matmuls, the ops' SiLU, the
    slots added in order). w13 / w2: int8 experts [E, N, K], or int4 experts (q, group scales, group minimums or None,
    group size) as _expert_mm takes them."""
    m, h = hidden.shape
    inter = w13_scale.shape[1] // 2
    x = hidden.float()
    weights = topk_weights.float()
    if apply_router_weight_on_input:
        x, weights = x * weights, torch.ones_like(weights)
    x_q, x_scale = per_token_quant_int8(x)
    ids = topk_ids.long()
    down = torch.zeros(m, ids.shape[1], h, dtype=torch.float32)
    for e in ids.unique().tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        gate_up = _expert_mm(x_q[tokens], x_scale[tokens], w13, e, w13_scale[e].reshape(-1))
        a_q, a_scale = per_token_quant_int8(silu_mul(gate_up[:, :inter], gate_up[:, inter:]))
        down[tokens, slots] = _expert_mm(a_q, a_scale, w2, e, w2_scale[e].reshape(-1))
    out = torch.zeros(m, h, dtype=torch.float32)
    for k in range(ids.shape[1]):
        out = out + weights[:, k:k + 1] * down[:, k]
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
