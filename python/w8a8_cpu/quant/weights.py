"""Weight quantization, the package's public entry points: int8 per channel (quantize_weight) and int4 per group
(quantize_weight_int4: round-to-nearest, or GPTQ given the inputs' second moment)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .._loader import ops
from ..scheme import INT4_GROUPS, is_int4_group
from .gptq import gptq_int4
from .grid import Int4Grid, fp16_step


def quantize_weight(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric quantization of a float [N, K] weight -> (w_q int8 [N, K], w_scale fp32 [N]).

    The activations' quantizer (per_token_quant_int8) applied to the weight's rows in fp32, so weights and
    activations share one rounding rule: q = clamp(round_half_even(w * (127 / amax)), -127, 127)."""
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise ValueError(f"w: expected a floating-point tensor, got {getattr(w, 'dtype', type(w))}")
    if w.dim() != 2 or w.numel() == 0:
        raise ValueError(f"w: expected a non-empty 2-D [N, K] weight, got shape {tuple(w.shape)}")
    w32 = w.detach().to(torch.float32).contiguous()
    if not torch.isfinite(w32).all():  # the op would give the row a NaN scale; a weight must not have one
        raise ValueError("w: weight contains NaN or Inf")
    w_q, w_scale = ops.per_token_quant_int8(w32, None)
    return w_q, w_scale.reshape(-1)


def quantize_weight_int4(w: torch.Tensor, group_size: int = 32, symmetric: bool = True, min_max: bool = False,
                         hessian: Optional[torch.Tensor] = None, damping: float = 0.1
                         ) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """int4 quantization of a float [N, K] weight per group of group_size consecutive k (0: one group per channel) ->
    (q int8 [N, K] in [-8, 7], scale fp32 [N, groups], min fp32 [N, groups] or None), such that w ~ scale * q + min per
    group (the form pack_weight_int4's ops compute; K is padded to whole groups with zeros).

    symmetric: scale = absmax / 7.5, q = clamp(round(w / scale), -8, 7) (compressed-tensors' symmetric int4 rule),
    min None. Otherwise asymmetric, with an integer zero point (GPTQ / AWQ / compressed-tensors): the group's range
    widened to include 0, scale = (max - min) / 15, z = clamp(round(-min / scale), 0, 15), u = clamp(round(w / scale)
    + z, 0, 15), w ~ scale * (u - z): 0 stays exactly 0; stored as q = u - 8 with minimum scale * (8 - z). With
    min_max (llama.cpp Q4_1's rule): scale = (max - min) / 15 over the group as it is, u = clamp(round((w - min) /
    scale), 0, 15), minimum min + 8 * scale: a finer grid when a group's values sit away from 0, but 0 is not on it
    (a row with one outlier turns its small weights into a bias: MiniLM per channel loses its embeddings). Each scale
    is then rounded to the nearest fp16 value where it lies in fp16's normal range (2^-14 .. 65504; it moves by at most
    2^-11 of itself; the minimum follows it), so pack_weight_int4 stores the scales in 2 bytes, not 4 (llama.cpp's Q4
    blocks hold theirs so).

    hessian None: round-to-nearest. hessian [K, K] (the layer inputs' sum of x x^T over calibration rows x; any
    positive multiple gives the same result): GPTQ, which minimizes the layer's output error on those inputs instead
    of the weight's: each column rounded on its group's grid, its error fed into the columns after it; H is divided
    by its mean diagonal, then damping (in (0, 1e6]) times the mean diagonal is added. The grid is fixed when the
    group starts, from the weights as GPTQ has updated them: the rule above over the group's range times the factor
    (1.0, 0.95, ..., 0.6) with the least error weighted by H's diagonal (clipping a group's extreme weights where that
    makes the others' steps finer). Once every column is rounded, each row's scales are refitted to its codes by least
    squares on the output error (refit_scales). The default damping 0.1 is 10x GPTQ's usual 1%: with the few thousand
    calibration tokens a small model gets, 1% fits the calibration text and loses on other text (SmolLM2-135M, g32
    symmetric after SmoothQuant, 1024 tokens: +30% perplexity with 1%, +21% with 10%, +32% round-to-nearest)."""
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() != 2 or w.numel() == 0:
        raise ValueError(f"w: expected a non-empty 2-D floating-point [N, K] weight, got "
                         f"{getattr(w, 'dtype', type(w))} {tuple(getattr(w, 'shape', ()))}")
    n, k = w.shape
    if not is_int4_group(group_size):
        raise ValueError(f"group_size: expected {INT4_GROUPS}, got {group_size!r}")
    w32 = w.detach().to(torch.float32)
    if not torch.isfinite(w32).all():
        raise ValueError("w: weight contains NaN or Inf")
    group = group_size or k
    k_padded = (k + group - 1) // group * group
    padded = torch.nn.functional.pad(w32, (0, k_padded - k))
    grouped = padded.view(n, k_padded // group, group)
    grid = Int4Grid.of(grouped, symmetric, min_max)  # (refuses a group whose range overflows float32, also for GPTQ)
    if hessian is None:
        q = grid.quantize(grouped)
        grid = Int4Grid(*(field.squeeze(-1) for field in grid))
    else:
        if not isinstance(hessian, torch.Tensor) or not hessian.is_floating_point() or hessian.shape != (k, k):
            raise ValueError(f"hessian: expected a floating-point [{k}, {k}] tensor (K of w), got "
                             f"{getattr(hessian, 'dtype', type(hessian))} {tuple(getattr(hessian, 'shape', ()))}")
        q, grid = gptq_int4(padded, hessian.detach().to(torch.float64), group, symmetric, min_max, damping)
    # the codes are chosen on the fp32 steps; the steps stored as fp16 values after (rounding them before moved
    # GPTQ's codes: MiniLM's zero-point row 0.9802 -> 0.9798), the minimums following them (a zero point stays one)
    grid = grid._replace(scale=fp16_step(grid.scale))
    scale, minimum = grid.scale, grid.minimum()
    q = q.reshape(n, k_padded)[:, :k].to(torch.int8).contiguous()
    return q, scale.contiguous(), None if symmetric else minimum.contiguous()
