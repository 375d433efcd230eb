"""Rounding onto quantization grids, to nearest or stochastically, and the scale-growth rule.

Stochastic rounding of a real value ``v`` lying between two neighbouring grid points ``lo <= v < hi``
picks ``hi`` with probability ``(v - lo) / (hi - lo)``, so its mean is exactly ``v``: a LoRA delta
smaller than one grid step survives on average instead of being rounded away, and many small
deltas do not drift. A value already on the grid stays where it is, so merging a delta into an
existing quantized weight (whose codes are grid points) only randomises the delta's part.

Grids: the integer grid ``[-qmax, qmax]`` times a scale (int8: 127, int4: 7) and the
float8 e4m3fn grid (3 mantissa bits, max 448). Pure torch; generators make every draw reproducible.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
_FP8_MANTISSA_BITS = 3
_FP8_MIN_NORMAL_EXP = -6  # smallest normal e4m3fn is 2^-6; below it the step is 2^-9


def uniform_noise(shape, generator: torch.Generator, device) -> torch.Tensor:
    """``U[0, 1)`` noise of ``shape`` drawn from ``generator`` (fp32)."""
    return torch.rand(shape, generator=generator, device=device, dtype=torch.float32)


def round_to_int_grid(values: torch.Tensor, qmax: int, generator: torch.Generator | None) -> torch.Tensor:
    """Integer codes in ``[-qmax, qmax]`` (int8) for ``values`` already divided by their scale.

    ``generator`` None rounds to nearest; otherwise stochastically (``floor(v + U)``).
    """
    v = values.float()
    if generator is None:
        codes = torch.round(v)
    else:
        codes = torch.floor(v + uniform_noise(v.shape, generator, v.device))
    return codes.clamp_(-qmax, qmax).to(torch.int8)


def fp8_step(values: torch.Tensor) -> torch.Tensor:
    """The e4m3fn grid spacing at each value (fp32): ``2^(floor(log2|v|) - 3)``, ``2^-9`` when subnormal."""
    magnitude = values.float().abs()
    _, exponent = torch.frexp(magnitude)  # |v| = m * 2^e, m in [0.5, 1): floor(log2|v|) = e - 1
    exponent = torch.where(magnitude > 0, exponent - 1, _FP8_MIN_NORMAL_EXP).clamp(min=_FP8_MIN_NORMAL_EXP)
    return torch.ldexp(torch.ones_like(values, dtype=torch.float32), exponent - _FP8_MANTISSA_BITS)


def round_to_fp8(values: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """``values`` (already divided by their scale, within +-448) as float8_e4m3fn codes.

    ``generator`` None rounds to nearest (ties to even, torch's cast); otherwise stochastically
    between the two neighbouring e4m3fn values, computed exactly in fp32.
    """
    v = values.float().clamp(-FP8_MAX, FP8_MAX)
    if generator is None:
        return v.to(FP8)
    step = fp8_step(v)
    scaled = v / step  # exact: step is a power of two
    low = torch.floor(scaled)
    up = uniform_noise(v.shape, generator, v.device) < (scaled - low)
    rounded = (low + up.float()) * step
    return rounded.clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def grown_scale(merged: torch.Tensor, scale: torch.Tensor, grid_max: float) -> tuple[torch.Tensor, int]:
    """The scale to store ``merged`` with, and how many scale entries had to grow.

    ``scale`` is one value (per-tensor) or one per output row (``[N]`` or ``[N, 1]``). An entry
    keeps its value unless ``|merged| / scale`` would pass ``grid_max`` somewhere in its row (or in
    the tensor), in which case it becomes ``absmax / grid_max`` - so nothing saturates, and rows a
    LoRA does not push past the grid keep their codes' exact meaning.
    """
    old = scale.float()
    if old.numel() == 1:
        needed = merged.abs().amax() / grid_max
    else:
        needed = merged.abs().amax(dim=-1).reshape(old.shape) / grid_max
    grow = needed > old
    return torch.where(grow, needed, old).to(scale.dtype), int(grow.sum())


