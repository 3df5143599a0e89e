"""GPTQ (Frantar et al., 2023) on one weight matrix: its columns rounded on int4 grids in turn, each column's rounding
error fed into the columns after it through the inputs' second moment H (quantize_weight_int4 with a hessian)."""
from __future__ import annotations

from typing import Tuple

import torch

from .grid import Int4Grid
from .refit import refit_scales

# The largest damping taken: H normalised to a unit mean diagonal then has diagonal entries below K + damping, so its
# inverse factor, the grid search's weights and the refit's products stay far inside float32's range (the column loop
# runs in fp32) for any K; a damping that large already makes GPTQ round to nearest on the searched grids.
MAX_DAMPING = 1e6


def dampened_hessian(hessian: torch.Tensor, k_padded: int, damping: float) -> torch.Tensor:
    """GPTQ's H fp64 [K_padded, K_padded] from the inputs' second moment hessian (fp64 [K, K]): its symmetric part
    divided by its mean diagonal, a unit diagonal for padded columns and for inputs without curvature, then damping
    times the mean diagonal added. Normalised before anything else, H is the same (to fp64 rounding, far below the
    fp32 steps after) for any positive multiple of hessian, and its values fit float32 whatever the hessian's scale
    (1e100 times a second moment gave NaN scales; 1e40 other codes). ValueError naming hessian or damping for what
    gives no such H."""
    if not torch.isfinite(hessian).all():
        raise ValueError("hessian: contains NaN or Inf")
    if not (isinstance(damping, (int, float)) and 0 < damping <= MAX_DAMPING):
        raise ValueError(f"damping: expected a positive number up to {MAX_DAMPING:g}, got {damping!r}")
    k = hessian.shape[0]
    h = torch.eye(k_padded, dtype=torch.float64)  # padded columns: no cross terms, they stay 0 and take no error
    largest = hessian.abs().max()
    if largest > 0:  # (all 0: no input reached the layer; each column gets the unit diagonal below)
        # only H's symmetric part defines the output error; the factorization reads one triangle, the refit both.
        # Over the largest entry first (exact for a power of two): the sums below cannot overflow.
        scaled = hessian / largest
        symmetric = (scaled + scaled.T) / 2
        diagonal = symmetric.diagonal()
        if bool((diagonal < 0).any()) or not bool((diagonal > 0).any()):
            raise ValueError("hessian: not positive semi-definite (a negative diagonal entry, or cross terms without "
                             "a diagonal)")
        h[:k, :k] = symmetric / diagonal.mean()
        if not bool(torch.isfinite(h).all()):  # cross terms ~1e300 times the diagonal's size
            raise ValueError("hessian: not positive semi-definite (cross terms far larger than the diagonal)")
    diagonal = h.diagonal()
    # An input that is 0 in every calibration row has no curvature: a unit diagonal (no cross terms) rounds its
    # column to nearest and feeds it no error, instead of GPTQ's zeroing of the weight an unseen input would need.
    diagonal[diagonal == 0] = 1.0
    diagonal += damping * diagonal.mean()  # keeps H invertible and the updates bounded
    return h


def _singular(detail: str, damping: float) -> ValueError:
    return ValueError(f"hessian: not positive semi-definite, or too near singular for damping {damping:g} (raise "
                      f"damping): {detail}")


def gptq_int4(w: torch.Tensor, hessian: torch.Tensor, group: int, symmetric: bool, min_max: bool,
              damping: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ (Frantar et al., 2023) on fp32 w [N, K_padded] (K padded to whole groups with zeros) with the inputs'
    second moment hessian fp64 [K, K] (made GPTQ's H by dampened_hessian): columns left to right, each rounded on its
    group's grid, its rounding error spread over the columns not yet rounded through the upper Cholesky factor of
    H^-1, in blocks of >= 128 columns (lazy batch updates). Each group's grid is fixed when its first column comes,
    from the error-updated weights; the scales are refitted to the codes at the end (refit_scales).
    -> (q [N, K_padded] float in [-8, 7], the groups' grids, fields [N, groups])."""
    n, k_padded = w.shape
    k = hessian.shape[0]
    h = dampened_hessian(hessian, k_padded, damping)
    try:
        # H = R R^T with R upper triangular (the Cholesky factor of H with rows and columns reversed, reversed back),
        # so H^-1 = U^T U with U = R^-1: GPTQ's upper Cholesky factor of H^-1 without forming H^-1 first
        # (cholesky_inverse and a second factorization take ~10x longer)
        r = torch.linalg.cholesky(h.flip((0, 1))).flip((0, 1))
    except RuntimeError as e:  # torch.linalg.LinAlgError
        raise _singular(f"no Cholesky factor after dampening: {e}", damping) from None
    u = torch.linalg.solve_triangular(r, torch.eye(k_padded, dtype=torch.float64), upper=True).to(torch.float32)
    del r
    if not bool(torch.isfinite(u).all()) or not bool((u.diagonal() > 0).all()):
        raise _singular("the inverse's factor overflows float32", damping)
    importance = h.diagonal().to(torch.float32)  # each input's (dampened) second moment: the grid search's weights
    # Columns as contiguous rows: each step reads one row and updates whole rows (~25% less time per column than on
    # strided column slices). A copy even where w.T is already contiguous (one row): the updates must not reach w,
    # which the refit reads.
    t = w.T.clone(memory_format=torch.contiguous_format)
    q = torch.empty_like(t)
    grids = []
    block = max(128, group)  # a multiple of the (power-of-two) group: no group straddles two blocks
    for begin in range(0, k_padded, block):
        end = min(begin + block, k_padded)
        panel = t[begin:end]  # a view: the updates below land in t
        errors = torch.empty(end - begin, n)
        for j in range(end - begin):
            column = begin + j
            if column % group == 0:
                try:
                    grid = Int4Grid.searched(panel[j:j + group].T, symmetric, min_max,
                                             importance[column:column + group])
                except ValueError:  # a range past float32: w's own fit (quantize_weight_int4), the updates grew it
                    raise _singular("GPTQ's updates overflow float32", damping) from None
                minimum = grid.minimum()
                grids.append(grid)
            # in place, into rows of q and errors (the same arithmetic as the expressions, ~30% less time per column)
            error = torch.mul(grid.quantize(panel[j], out=q[column]), grid.scale, out=errors[j]).add_(minimum)
            error.neg_().add_(panel[j]).div_(u[column, column])  # (w - dequantized) / u_jj
            panel[j:].addr_(u[column, column:end], error, alpha=-1)
        t[end:].addmm_(u[begin:end, end:].T, errors, alpha=-1)
    del t, u
    grid = Int4Grid(*(torch.stack(field, dim=1) for field in zip(*grids)))
    q = q.T.contiguous()
    grid = grid._replace(scale=refit_scales(w, h, q, grid, group, k))
    if not all(bool(torch.isfinite(values).all()) for values in (q, *grid)):  # updates past float32: a near-singular H
        raise _singular("GPTQ's updates overflow float32", damping)
    return q, grid
