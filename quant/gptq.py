"""GPTQ rounding: a weight's grid points chosen with the layer's inputs in mind.

Round-to-nearest (RTN) rounds every weight on its own. GPTQ (Frantar et al., "OPTQ: Accurate
Quantization for Generative Pre-trained Transformers", ICLR 2023) rounds the columns (input channels)
one after another and spreads each column's rounding error over the columns not yet rounded, in the
proportions that minimise the error of the layer's *output* ``x W^T`` on the inputs it saw: the
layer's Hessian ``H = sum x^T x`` over calibration rows.

The format decides the grid before GPTQ runs (its scales, per row or per group, are the RTN ones);
GPTQ decides only which grid point each weight takes. So the stored tensors are the format's own,
bit-compatible with every loader and kernel of that format (stock ComfyUI included for the native
ones): nothing at run time changes, only which codes are stored.

``gptq_round`` is the algorithm on its own: a float ``[N, K]`` weight, its ``[K, K]`` Hessian and a
``grid(values, columns)`` function that rounds a block of columns to the format's grid.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch

#: ``grid(values [N, b], columns [b]) -> [N, b]``: the grid point of each value (same shape, fp32);
#: ``columns`` are the input-channel indices of the block (for per-group scales).
Grid = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class GPTQConfig:
    """How GPTQ rounds. ``damp``: added to the Hessian's diagonal as a fraction of its mean (keeps the
    inverse well conditioned when few rows were seen); ``block``: columns rounded between two updates
    of the rest of the weight (speed only: every block size gives the same result up to float
    rounding); ``act_order``: round the columns with the largest inputs first (``diag(H)`` descending),
    which leaves the small ones to absorb the error."""

    damp: float = 0.01
    block: int = 128
    act_order: bool = True
    version: int = 1

    def __post_init__(self):
        if not 0.0 < self.damp <= 1.0:
            raise ValueError(f"GPTQConfig.damp must be in (0, 1], got {self.damp}")
        if self.block < 1:
            raise ValueError(f"GPTQConfig.block must be >= 1, got {self.block}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "GPTQConfig":
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"GPTQConfig: unknown field(s) {', '.join(unknown)}")
        return cls(**data)


def check_hessian(hessian: torch.Tensor, in_features: int, layer: str = "weight") -> None:
    """Raise a ``ValueError`` unless ``hessian`` is a finite ``[K, K]`` float matrix for ``K`` inputs."""
    if not isinstance(hessian, torch.Tensor) or not hessian.is_floating_point():
        raise ValueError(f"{layer}: the GPTQ Hessian must be a float tensor, found {type(hessian).__name__}")
    if tuple(hessian.shape) != (in_features, in_features):
        raise ValueError(f"{layer}: the GPTQ Hessian must be [{in_features}, {in_features}] (the layer's input "
                         f"features), found {list(hessian.shape)}; it belongs to another layer")
    if not torch.isfinite(hessian).all():
        raise ValueError(f"{layer}: the GPTQ Hessian has NaN or Inf values; record the layer's inputs again")


def _inverse_cholesky(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1`` (fp64 on the CPU, fp32 elsewhere).
    Inputs that were always zero (``diag H == 0``) get a unit diagonal: their weights round on their own."""
    dtype = torch.float64 if hessian.device.type == "cpu" else torch.float32
    h = hessian.to(dtype).clone()
    diag = h.diagonal()
    dead = diag <= 0
    diag[dead] = 1.0
    mean = diag.mean()
    for attempt in range(6):  # raise the damping until the factorisation holds (rank-deficient H)
        step = damp * mean * (10.0 ** attempt)
        factor, info = torch.linalg.cholesky_ex(h + step * torch.eye(h.shape[0], dtype=dtype, device=h.device))
        if int(info) == 0:
            break
    else:
        raise ValueError("the GPTQ Hessian is not positive definite even with 1e5x its damping")
    inverse = torch.cholesky_inverse(factor)
    return torch.linalg.cholesky(inverse, upper=True).float()


def gptq_round(weight: torch.Tensor, hessian: torch.Tensor, grid: Grid,
               config: GPTQConfig = GPTQConfig()) -> torch.Tensor:
    """The grid points GPTQ gives ``weight`` (float ``[N, K]``) under ``hessian`` (``[K, K]``,
    ``sum x^T x`` over the layer's input rows, in the basis the weight is quantized in).

    Returns the rounded weight, fp32 ``[N, K]``: every value is ``grid``'s output for its column, so
    the format turns it into codes exactly. With ``H = I`` (and no act order) this is round-to-nearest.
    """
    if weight.dim() != 2:
        raise ValueError(f"gptq_round takes a [N, K] weight, found shape {list(weight.shape)}")
    n, k = weight.shape
    check_hessian(hessian, k)
    w = weight.float().clone()
    h = hessian.to(device=w.device)
    order = None
    if config.act_order:
        order = torch.argsort(h.diagonal(), descending=True)
        w = w[:, order]
        h = h[order][:, order]
    columns = torch.arange(k, device=w.device) if order is None else order
    u = _inverse_cholesky(h, config.damp)
    del h
    rounded = torch.empty_like(w)
    for start in range(0, k, config.block):
        stop = min(start + config.block, k)
        block = w[:, start:stop].clone()
        errors = torch.empty_like(block)
        u_block = u[start:stop, start:stop]
        for i in range(stop - start):
            q = grid(block[:, i:i + 1], columns[start + i:start + i + 1])[:, 0]
            rounded[:, start + i] = q
            err = (block[:, i] - q) / u_block[i, i]
            block[:, i:] -= err[:, None] * u_block[i, i:][None, :]
            errors[:, i] = err
        w[:, stop:] -= errors @ u[start:stop, stop:]
    if order is not None:
        rounded = rounded[:, torch.argsort(order)]
    return rounded


def row_grid(scale: torch.Tensor, lowest: float, highest: float) -> Grid:
    """Integer codes ``[lowest, highest]`` times one ``scale`` per row (``[N]``): INT8 and signed-INT4 rows."""
    scale = scale.float().reshape(-1, 1)

    def grid(values: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        return torch.clamp(torch.round(values / scale), lowest, highest) * scale

    return grid


def fp8_row_grid(scale: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> Grid:
    """FP8 values (round to nearest even, saturated) times one ``scale`` per row (``[N]``)."""
    scale = scale.float().reshape(-1, 1)
    limit = torch.finfo(dtype).max

    def grid(values: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        return torch.clamp(values / scale, -limit, limit).to(dtype).float() * scale

    return grid
