"""Round-to-nearest int4 grids: the rule each group's weights are rounded on (Int4Grid), the range search GPTQ
picks a group's grid with, and the fp16 rounding of the steps (quantize_weight_int4 in weights.py uses them)."""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

# Range factors GPTQ tries for each group's grid (Int4Grid.searched), 1.0 down to 0.6. SmolLM2-135M g32 after
# SmoothQuant (the job's harness): GPTQ's perplexity +15.9% -> +10.1% (symmetric), +9.7% -> +8.0% (zero point); an
# unweighted error gave +13.0% / +6.4%, factors down to 0.5 or in steps of 0.025 no better. MiniLM's mean cosine:
# 0.9689 -> 0.9714 (symmetric), 0.9773 -> 0.9796 (zero point).
CLIP_FACTORS = tuple(1.0 - 0.05 * i for i in range(9))


def finite_range_scale(scale: torch.Tensor) -> torch.Tensor:
    """A zero-point grid's step, (max - min) / 15: finite weights whose range overflows fp32 (beyond ~3.4e38) gave an
    inf step, refused only later at packing (naming scale)."""
    if not bool(torch.isfinite(scale).all()):
        raise ValueError("w: a group's range (max - min) overflows float32; scale the weight down or quantize it "
                         "symmetrically")
    return scale.clamp_min(1e-10)


# fp16's normal range: a step inside it is stored in fp16 with a relative change <= 2^-11 (below it fp16 keeps fewer
# bits, so such a step stays fp32, and so does its layer's blob)
FP16_NORMAL = (2.0 ** -14, 65504.0)


def fp16_step(scale: torch.Tensor) -> torch.Tensor:
    """An int4 grid's steps (fp32), each rounded to the nearest fp16 value where it lies in fp16's normal range: a layer
    whose steps all are fp16 values packs them as fp16 (pack_weight_int4's half_scales: the same values in half the
    bytes, ~10% fewer bytes per decoded token in groups of 32). A step moves by at most 2^-11 of itself, a weight by
    at most 8 * 2^-12 steps, far inside int4's own rounding (+-1/2 step); the nearest, not the next one up, keeps a
    grid that already is one of fp16 steps (llama.cpp's Q4 blocks, which SmolLM2's weights came from) where it is."""
    normal = (scale >= FP16_NORMAL[0]) & (scale <= FP16_NORMAL[1])
    return torch.where(normal, scale.to(torch.float16).to(scale.dtype), scale)


class Int4Grid(NamedTuple):
    """One int4 rounding rule per group (fields broadcast against the group's weights): q = clamp(round((w - origin) /
    scale) + shift, -8, 7), w ~ scale * q + minimum with minimum = origin - shift * scale. Round-to-nearest and GPTQ
    both round through it, so the three forms below are stated once."""

    scale: torch.Tensor
    origin: torch.Tensor
    shift: torch.Tensor

    @classmethod
    def of(cls, grouped: torch.Tensor, symmetric: bool, min_max: bool, keepdim: bool = True) -> "Int4Grid":
        """The grid of each group of `grouped` [..., group] (fields [..., 1], or [...] without keepdim); see
        quantize_weight_int4."""
        if symmetric:
            scale = (grouped.abs().amax(dim=-1, keepdim=keepdim) / 7.5).clamp_min(1e-10)
            return cls(scale, torch.zeros_like(scale), torch.zeros_like(scale))
        if min_max:
            low = grouped.amin(dim=-1, keepdim=keepdim)
            scale = finite_range_scale((grouped.amax(dim=-1, keepdim=keepdim) - low) / 15)
            return cls(scale, low, torch.full_like(scale, -8.0))
        low = grouped.amin(dim=-1, keepdim=keepdim).clamp(max=0.0)
        high = grouped.amax(dim=-1, keepdim=keepdim).clamp(min=0.0)
        scale = finite_range_scale((high - low) / 15)
        zero = torch.round(-low / scale).clamp(0, 15)
        return cls(scale, torch.zeros_like(scale), zero - 8)

    @classmethod
    def searched(cls, grouped: torch.Tensor, symmetric: bool, min_max: bool,
                 importance: torch.Tensor) -> "Int4Grid":
        """The grid of `of` (keepdim=False) over each group's values scaled by the factor among CLIP_FACTORS whose
        rounding of the group's own values has the least squared error weighted by importance [group] (the inputs'
        second moments: an activation-aware error); the first factor, 1.0 (`of` itself), wins ties, so a group
        already on a grid keeps it. Shrinking the range clips the extreme weights to make the other steps finer."""
        # every factor at once, along a new leading dimension
        factors = torch.tensor(CLIP_FACTORS, dtype=grouped.dtype).view(-1, *[1] * grouped.dim())
        grids = cls.of(grouped * factors, symmetric, min_max, keepdim=True)  # fields [factors, ..., 1]
        weighted = (grids.scale * grids.quantize(grouped) + grids.minimum() - grouped).square() * importance
        # summed one factor at a time: each sum then reduces in one order at any thread count (a parallel reduction of
        # the whole could split a group's sum and flip a near tie)
        error = torch.stack([per_factor.sum(-1) for per_factor in weighted])
        best = error.argmin(0, keepdim=True)  # the first of equal errors: 1.0 wins ties
        return cls(*(field.squeeze(-1).gather(0, best).squeeze(0) for field in grids))

    def quantize(self, w: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The codes of w, into `out` when given (GPTQ's column loop: no allocation)."""
        # the shift is an integer added after rounding: round((w - origin) / scale + shift) would round ties
        # differently for odd shifts (half to even)
        return torch.sub(w, self.origin, out=out).div_(self.scale).round_().add_(self.shift).clamp_(-8, 7)

    def minimum(self) -> torch.Tensor:
        return self.origin - self.shift * self.scale
