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
from comfy_kitchen.tensor import QuantizedTensor

#: ``grid(values [N, b], columns [b]) -> [N, b]``: the grid point of each value (same shape, fp32);
#: ``columns`` are the input-channel indices of the block (for per-group scales).
Grid = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class GPTQConfig:
    """How GPTQ rounds. ``damp``: added to the Hessian's diagonal as a fraction of its mean (keeps the
    inverse well conditioned when few rows were seen); ``block``: columns rounded between two updates
    of the rest of the weight (speed only: every block size gives the same result up to float
    rounding); ``act_order``: round the columns with the largest inputs first (``diag(H)`` descending),
    which leaves the small ones to absorb the error; ``backend``: how a block is rounded, ``"torch"`` (a loop
    over its columns, any device), ``"triton"`` (one kernel a block, ``kernels/triton_gptq.py``, row grids
    only; on the CPU it needs Triton's interpreter) or ``"auto"`` (Triton on a CUDA device for a row grid, else
    torch): the same bits either way for blocks of at most 128 columns."""

    damp: float = 0.01
    block: int = 128
    act_order: bool = True
    backend: str = "auto"
    version: int = 1

    def __post_init__(self):
        if not 0.0 < self.damp <= 1.0:
            raise ValueError(f"GPTQConfig.damp must be in (0, 1], got {self.damp}")
        if self.block < 1:
            raise ValueError(f"GPTQConfig.block must be >= 1, got {self.block}")
        if self.backend not in BACKENDS:
            raise ValueError(f"GPTQConfig.backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")

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


def check_gptq_call(fmt: str, hessian: torch.Tensor, in_features: int, seed: int) -> None:
    """Raise a ``ValueError`` unless a format's GPTQ call can run: a valid Hessian, and no stochastic rounding."""
    if seed:
        raise ValueError(f"{fmt}: GPTQ rounding (a hessian) and stochastic rounding (seed={seed}) exclude each "
                         f"other; give one of them")
    check_hessian(hessian, in_features, fmt)


def rotated_hessian(hessian: torch.Tensor, group: int, device: torch.device) -> torch.Tensor:
    """``R^T H R`` for the regular-Hadamard rotation ``R`` in groups of ``group`` (ConvRot; ``R`` is symmetric), in
    fp32 on ``device``: the Hessian of a weight quantized in the rotated basis ``W R``."""
    from ..kernels.hadamard import rotate_blocks

    h = hessian.to(device=device, dtype=torch.float32)
    return rotate_blocks(rotate_blocks(h, "regular", group).T.contiguous(), "regular", group)


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
    ``config.backend`` says how each block of columns is rounded (the same bits either way for blocks of at most
    128 columns; a wider block is rounded by the kernel 128 columns at a time, the same up to float rounding).
    """
    if weight.dim() != 2:
        raise ValueError(f"gptq_round takes a [N, K] weight, found shape {list(weight.shape)}")
    backend = config.backend
    n, k = weight.shape
    check_hessian(hessian, k)
    kernel_grid = isinstance(grid, (RowGrid, CodebookGrid))
    use_triton = backend == "triton" or (backend == "auto" and weight.is_cuda and kernel_grid
                                         and _triton_runs(weight.device))
    if use_triton and not kernel_grid:
        raise ValueError("gptq_round's triton backend takes a row grid (row_grid / fp8_row_grid) or a CodebookGrid")
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
        u_block = u[start:stop, start:stop]
        if use_triton:
            errors = torch.empty((n, stop - start), dtype=w.dtype, device=w.device)
            for part in range(start, stop, _TRITON_WIDTH):  # the kernel rounds at most 128 columns at a time
                end = min(part + _TRITON_WIDTH, stop)
                rounded[:, part:end], errors[:, part - start:end - start] = _triton_block(
                    w[:, part:end], u[part:end, part:end], grid, columns[part:end])
                w[:, end:stop] -= errors[:, part - start:end - start] @ u[part:end, end:stop]
        else:
            block = w[:, start:stop].clone()
            errors = torch.empty_like(block)
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


_TRITON_WIDTH = 128


def _triton_runs(device: torch.device) -> bool:
    from ..kernels.backend import triton_problem

    return triton_problem(device) is None


def _triton_block(block: torch.Tensor, u_block: torch.Tensor, grid: "RowGrid | CodebookGrid", columns: torch.Tensor):
    from ..kernels.triton_gptq import gptq_block

    if isinstance(grid, CodebookGrid):
        return gptq_block(block, u_block, grid.scale, levels=grid.levels, groups=columns // grid.group)
    return gptq_block(block, u_block, grid.scale, fp8=grid.fp8, lowest=grid.lowest, highest=grid.highest)


@dataclass(frozen=True)
class RowGrid:
    """One scale per row (``scale``: fp32 ``[N]``) times integer codes ``[lowest, highest]``, or (``fp8``) times
    e4m3 values (round to nearest even, saturated at 448). Called as a :data:`Grid`."""

    scale: torch.Tensor
    lowest: float = 0.0
    highest: float = 0.0
    fp8: bool = False

    def __call__(self, values: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        scale = self.scale.reshape(-1, 1)
        if self.fp8:
            limit = torch.finfo(torch.float8_e4m3fn).max
            return torch.clamp(values / scale, -limit, limit).to(torch.float8_e4m3fn).float() * scale
        return torch.clamp(torch.round(values / scale), self.lowest, self.highest) * scale


@dataclass(frozen=True)
class CodebookGrid:
    """Per row and group of ``group`` input columns, 16 levels (``levels``: fp32 ``[N, K / group, 16]``) times one
    scale per row (``scale``: fp32 ``[N]``): each value goes to the nearest level of its column's group (the first
    of equally near ones), measured as ``value / scale - level``. Called as a :data:`Grid`."""

    levels: torch.Tensor
    scale: torch.Tensor
    group: int

    def __post_init__(self):
        if self.levels.dim() != 3 or self.levels.shape[2] != 16 or self.scale.numel() != self.levels.shape[0]:
            raise ValueError(f"a CodebookGrid takes [N, groups, 16] levels and [N] scales, got "
                             f"{list(self.levels.shape)} and {self.scale.numel()}")
        object.__setattr__(self, "levels", self.levels.float().contiguous())
        object.__setattr__(self, "scale", self.scale.float().reshape(-1))

    def __call__(self, values: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        scale = self.scale.reshape(-1, 1, 1)
        candidates = self.levels[:, columns // self.group, :]  # [N, b, 16]
        code = (values.unsqueeze(-1) / scale - candidates).abs().argmin(dim=-1)
        return torch.gather(candidates, -1, code.unsqueeze(-1)).squeeze(-1) * scale[:, :, 0]


def row_grid(scale: torch.Tensor, lowest: float, highest: float) -> RowGrid:
    """Integer codes ``[lowest, highest]`` times one ``scale`` per row (``[N]``): INT8 and signed-INT4 rows."""
    return RowGrid(scale.float().reshape(-1), float(lowest), float(highest))


def fp8_row_grid(scale: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> RowGrid:
    """e4m3 values (round to nearest even, saturated) times one ``scale`` per row (``[N]``)."""
    if dtype != torch.float8_e4m3fn:
        raise ValueError(f"fp8_row_grid takes float8_e4m3fn, got {dtype}")
    return RowGrid(scale.float().reshape(-1), fp8=True)


class HessianRecorder:
    """``H = sum x^T x`` of the named modules' inputs, accumulated by forward pre-hooks while a ``with`` block
    runs the model (fp32, on ``device``, or on each input's own device when ``None``).

    ``hessian(name)`` is the layer's matrix and ``rows(name)`` how many input rows went into it. Only the
    modules given are hooked, so a caller bounds the memory (``K * K * 4`` bytes a layer) by recording the
    layers in groups (:func:`hessian_groups`) over replays of the same calls."""

    def __init__(self, modules: dict[str, torch.nn.Module], device: torch.device | str | None = None):
        self._modules = dict(modules)
        self._device = device
        self._hessians: dict[str, torch.Tensor] = {}
        self._rows: dict[str, int] = {}
        self._handles: list = []

    def __enter__(self) -> "HessianRecorder":
        for name, module in self._modules.items():
            self._handles.append(module.register_forward_pre_hook(self._hook(name)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, name: str):
        def hook(module, inputs):
            x = inputs[0]
            if isinstance(x, QuantizedTensor):
                x = x.dequantize()
            x = x.detach().reshape(-1, x.shape[-1])
            if self._device is not None:
                x = x.to(self._device)
            x = x.float()
            h = self._hessians.get(name)
            if h is None:
                self._hessians[name] = x.T @ x
            else:
                h.addmm_(x.T, x)
            self._rows[name] = self._rows.get(name, 0) + x.shape[0]
        return hook

    def hessian(self, name: str) -> torch.Tensor | None:
        """The layer's ``sum x^T x``, or ``None`` when it never ran."""
        return self._hessians.get(name)

    def rows(self, name: str) -> int:
        return self._rows.get(name, 0)


def hessian_groups(features: dict[str, int], budget_bytes: int) -> list[list[str]]:
    """The layers (``{name: input features}``, in order) in consecutive groups whose fp32 Hessians together take
    at most ``budget_bytes`` (a layer larger than the budget alone is a group of its own)."""
    groups: list[list[str]] = []
    used = budget_bytes + 1
    for name, k in features.items():
        size = k * k * 4
        if used + size > budget_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    return groups
