"""Per-row weight scales that minimise the rounding error, for symmetric integer grids.

A row quantized as ``s * clamp(round(w / s), -qmax, qmax)`` with the abs-max scale ``s = max|w| / qmax``
never clips, but its step is set by the row's single largest value. With 4 bits that costs much: for a
Gaussian-like row of 3072 values (a weight after a Hadamard rotation), ``max|w|`` is about 3.6 standard
deviations, so 15 levels are spread over +-3.6 sigma, while the squared error is least with them over
about +-2.5 sigma (clipping the few larger values). :func:`mse_row_scales` finds each row's scale:

1. a grid of candidate ratios of the abs-max scale, the abs-max scale itself (ratio 1) included, so the
   result is never worse than it;
2. a few alternating refinements from the best candidate: with the codes fixed, the scale that minimises
   ``||w - s q||`` is ``<w, q> / <q, q>``; with the scale fixed, rounding to the nearest level is optimal.
   A row takes a refined scale only where its error goes down.

The search only chooses a scale; the codes and the stored format are those of the abs-max quantizer.
"""

from __future__ import annotations

import torch

#: candidate ratios of the abs-max scale (1.0 first: the abs-max scale itself)
DEFAULT_RATIOS = (1.0, 0.88, 0.78, 0.70, 0.63, 0.56, 0.50)
#: alternating least-squares / rounding steps after the grid
DEFAULT_REFINEMENTS = 3
#: rows per chunk: bounds the temporary memory to a few copies of ``ROWS x K`` fp32 values
ROWS_PER_CHUNK = 1024


def _codes(w: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
    return (w / scale).round_().clamp_(-qmax, qmax)


def _row_error(w: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
    return _codes(w, scale, qmax).mul_(scale).sub_(w).square_().sum(dim=1, keepdim=True)


def _chunk_scales(w: torch.Tensor, qmax: int, ratios: tuple[float, ...], refinements: int) -> torch.Tensor:
    absmax_scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-10) / qmax
    best = absmax_scale
    best_err = _row_error(w, best, qmax)
    for ratio in ratios:
        if ratio == 1.0:
            continue
        scale = absmax_scale * ratio
        err = _row_error(w, scale, qmax)
        better = err < best_err
        best, best_err = torch.where(better, scale, best), torch.where(better, err, best_err)
    for _ in range(refinements):
        q = _codes(w, best, qmax)
        qq = (q * q).sum(dim=1, keepdim=True)
        scale = torch.where(qq > 0, (w * q).sum(dim=1, keepdim=True) / qq.clamp(min=1), best).clamp(min=1e-10)
        err = _row_error(w, scale, qmax)
        better = err < best_err
        best, best_err = torch.where(better, scale, best), torch.where(better, err, best_err)
    return best.reshape(-1)


def mse_row_scales(weight: torch.Tensor, qmax: int, *, ratios: tuple[float, ...] = DEFAULT_RATIOS,
                   refinements: int = DEFAULT_REFINEMENTS) -> torch.Tensor:
    """fp32 ``[rows]`` scales for ``weight`` (``[rows, K]``) on the grid ``{-qmax .. qmax}``, each the one of
    the searched scales with the least squared rounding error over its row; never a larger error than the
    abs-max scale's. All-zero rows get the abs-max scale's floor (``1e-10 / qmax``)."""
    if weight.dim() != 2:
        raise ValueError(f"mse_row_scales takes a [rows, K] weight, got shape {tuple(weight.shape)}")
    if qmax < 1:
        raise ValueError(f"qmax must be at least 1, got {qmax}")
    if 1.0 not in ratios:
        raise ValueError("the candidate ratios must include 1.0 (the abs-max scale), so no row gets worse")
    w = weight.float()
    return torch.cat([_chunk_scales(w[start:start + ROWS_PER_CHUNK], qmax, ratios, refinements)
                      for start in range(0, w.shape[0], ROWS_PER_CHUNK)]) if w.shape[0] else w.new_zeros(0)
