"""Triton: one GPTQ block, the columns rounded one after another with each error spread over the rest.

GPTQ (``quant/gptq.py``) rounds a block of ``b`` columns of a ``[N, b]`` weight slab in order: column ``i``
goes to its grid point ``q``, its error ``e = (w_i - q) / U[i, i]`` is taken off the columns after it
(``w_j -= e * U[i, j]``). The rows are independent, so one program keeps ``BLOCK_R`` rows of the slab in
registers and walks the ``b`` columns, where the torch loop launches about ten kernels per column.

The grid is a row grid: integer codes ``[lo, hi]`` times one scale per row (``FP8=False``: INT8, signed INT4),
or e4m3 values times one scale per row (``FP8=True``), or (``CODEBOOK=True``, ``w4a8``) the nearest of 16 levels
of the column's group in each row (``levels``: ``[N, groups, 16]``, a group index per column) times the row's
scale, the first of equally near levels as ``torch.argmin`` picks it. Every operation is torch's, in torch's order and
rounding: IEEE division (``div_rn``), round-half-even, the product ``e * U[i, j]`` rounded before it is
subtracted (the launch turns FMA contraction off), so the result is the torch loop's bit for bit (a CPU
interpreter test checks it). ``gptq_block`` returns the rounded values and the errors, ``[N, b]`` each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_act_quant_parts import _rint, _round_to_e4m3

FP8_MAX = tl.constexpr(448.0)
_BLOCK_R = 16
_MAX_WIDTH = 128


@triton.jit
def _gptq_block_kernel(w_ptr, u_ptr, scale_ptr, q_ptr, e_ptr, levels_ptr, groups_ptr, n, width, stride_w, stride_u,
                       stride_q, stride_e, stride_levels, lo, hi, FP8: tl.constexpr, CODEBOOK: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_B)
    row_ok = rows < n
    col_ok = cols < width
    tile_ok = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    w = tl.load(w_ptr + rows64 * stride_w + cols[None, :], mask=tile_ok, other=0.0)
    scale = tl.load(scale_ptr + rows, mask=row_ok, other=1.0)
    rounded = tl.zeros((BLOCK_R, BLOCK_B), tl.float32)
    errors = tl.zeros((BLOCK_R, BLOCK_B), tl.float32)
    for i in range(0, width):
        here = (cols == i)[None, :]
        col = tl.sum(tl.where(here, w, 0.0), axis=1)
        y = tl.math.div_rn(col, scale)
        if CODEBOOK:
            slots = tl.arange(0, 16)
            group = tl.load(groups_ptr + i).to(tl.int64)
            levels = tl.load(levels_ptr + rows64 * stride_levels + group * 16 + slots[None, :], mask=row_ok[:, None],
                             other=0.0)
            code = tl.argmin(tl.abs(y[:, None] - levels), axis=1, tie_break_left=True)
            q = tl.sum(tl.where(slots[None, :] == code[:, None], levels, 0.0), axis=1) * scale
        elif FP8:
            q = _round_to_e4m3(tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)) * scale
        else:
            q = tl.minimum(tl.maximum(_rint(y), lo), hi) * scale
        err = tl.math.div_rn(col - q, tl.load(u_ptr + i * stride_u + i))
        u_row = tl.load(u_ptr + i * stride_u + cols, mask=col_ok & (cols >= i), other=0.0)
        w = w - err[:, None] * u_row[None, :]
        rounded = tl.where(here, q[:, None], rounded)
        errors = tl.where(here, err[:, None], errors)
    tl.store(q_ptr + rows64 * stride_q + cols[None, :], rounded, mask=tile_ok)
    tl.store(e_ptr + rows64 * stride_e + cols[None, :], errors, mask=tile_ok)


def gptq_block(block: torch.Tensor, u_block: torch.Tensor, scale: torch.Tensor, *, fp8: bool = False,
               lowest: float = 0.0, highest: float = 0.0, levels: torch.Tensor | None = None,
               groups: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Round the fp32 ``[N, b]`` slab ``block`` (``b <= 128``) under the upper-triangular ``[b, b]`` ``u_block``:
    the grid points and the errors, ``[N, b]`` fp32 each (``block`` is not changed). ``scale``: fp32 ``[N]``.
    A codebook grid gives ``levels`` (``[N, groups, 16]``) and ``groups`` (each column's group index, ``[b]``)."""
    n, width = block.shape
    if width > _MAX_WIDTH or tuple(u_block.shape) != (width, width) or scale.numel() != n:
        raise ValueError(f"gptq_block takes a [N, b <= {_MAX_WIDTH}] slab, a [b, b] factor and [N] scales; got "
                         f"{list(block.shape)}, {list(u_block.shape)}, {scale.numel()}")
    codebook = levels is not None
    if codebook and (fp8 or groups is None or levels.dim() != 3 or levels.shape[0] != n or levels.shape[2] != 16
                     or groups.numel() != width):
        raise ValueError(f"a codebook grid takes [N, groups, 16] levels and one group index per column (not fp8); "
                         f"got levels {None if levels is None else list(levels.shape)}, "
                         f"groups {None if groups is None else groups.numel()} for a {list(block.shape)} slab")
    if codebook:
        levels = levels.float().contiguous()
        groups = groups.to(device=block.device, dtype=torch.int32).contiguous()
        if groups.numel() and (int(groups.min()) < 0 or int(groups.max()) >= levels.shape[1]):
            raise ValueError(f"group indices must lie in [0, {levels.shape[1]}), got "
                             f"[{int(groups.min())}, {int(groups.max())}]")
    block = block.float().contiguous()
    u_block = u_block.float().contiguous()
    scale = scale.float().reshape(n).contiguous()
    rounded = torch.empty_like(block)
    errors = torch.empty_like(block)
    if n == 0 or width == 0:
        return rounded, errors
    _gptq_block_kernel[(triton.cdiv(n, _BLOCK_R),)](
        block, u_block, scale, rounded, errors, levels if codebook else scale, groups if codebook else scale, n,
        width, block.stride(0), u_block.stride(0), rounded.stride(0), errors.stride(0),
        levels.stride(0) if codebook else 0, float(lowest), float(highest), FP8=fp8, CODEBOOK=codebook,
        BLOCK_R=_BLOCK_R, BLOCK_B=_MAX_WIDTH, num_warps=4, enable_fp_fusion=False)
    return rounded, errors
