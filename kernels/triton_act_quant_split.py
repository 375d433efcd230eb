"""Triton: the act-quant kernels that hold a row in pieces instead of one padded power of two.

* ``_act_quant_pieces_kernel`` (``split="pieces"``): whole rows as up to four power-of-two pieces over
  the real ``K`` (3072 = 2048 + 1024: no padding), one read of ``x``; its store has no clamp (every
  value is at most the abs-max it was scaled by), rounds with the GPU's ``rint`` and, for tf32,
  folds 1/sqrt(G) into the abs-max and the inverse scale.
* ``_act_quant_chunked_kernel`` (``split="chunks"``): ``chunk``-wide pieces in a loop, a pass for the
  abs-max and one that recomputes and stores (the second read of ``x`` finds it in L2): few
  registers, twice the rotation work.

Both compute what ``triton_act_quant._act_quant_kernel`` computes (same rotation device functions,
``triton_act_quant_parts.py``); :func:`act_quant_split` is called by ``act_quant_triton`` with the
variant already checked.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .backend import interpreting
from .launcher import TritonLauncher
from .reference import FP8
from .triton_act_quant_parts import (ROTATE_IMPLS, _no_mean, _pow2_at_least, _rotate_superblocks, _rotation_operands,
                                     _round_in, _row_scales, _store_codes)


@triton.jit
def _chunk_values(x_rows, smooth_ptr, pmat_ptr, qmat_ptr, hmat_ptr, row_ok, cols, K, mean, rot_norm,
                  BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, HAS_SMOOTH: tl.constexpr, CENTER: tl.constexpr,
                  ROTATE: tl.constexpr, TWO_STAGE: tl.constexpr, ROT_IMPL: tl.constexpr, PRECISE: tl.constexpr,
                  ROUND_IN: tl.constexpr):
    """fp32 ``[BLOCK_M, CHUNK]``: columns ``cols`` of the rows, smoothed, centred on ``mean``, rotated
    (zero beyond ``K``). The same code on the same data in both passes, so both see the same values."""
    col_ok = cols < K
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_rows[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_SMOOTH:
        x = x * tl.load(smooth_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if CENTER:
        x = tl.where(mask, x - mean[:, None], 0.0)
    if ROTATE:
        SB: tl.constexpr = BLOCK_M * CHUNK // 256
        x = tl.reshape(x, (SB, 256))
        x = _rotate_superblocks(x, pmat_ptr, qmat_ptr, hmat_ptr, rot_norm, SB, TWO_STAGE, ROT_IMPL, PRECISE, ROUND_IN)
        x = tl.reshape(x, (BLOCK_M, CHUNK))
    return x


@triton.jit
def _act_quant_chunked_kernel(
    x_ptr, q_ptr, scale_ptr, mean_ptr, smooth_ptr, pmat_ptr, qmat_ptr, hmat_ptr,
    M, K, stride_xm, stride_qm, qmax, rot_norm,
    BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
    HAS_SMOOTH: tl.constexpr, CENTER: tl.constexpr, ROTATE: tl.constexpr, TWO_STAGE: tl.constexpr,
    ROT_IMPL: tl.constexpr, PRECISE: tl.constexpr, ROUND_IN: tl.constexpr, OUT_FP8: tl.constexpr,
    PERM_BLOCK: tl.constexpr, PERM_RUN: tl.constexpr, HW_FP8_CAST: tl.constexpr,
):
    """The rows in ``CHUNK``-wide pieces over the real ``K`` (no padding to a power of two, few
    registers): [a centring pass: the row sums], a pass for the row abs-max of the rotated values,
    and a pass that recomputes them and stores the codes. Only the first pass reads ``x`` from
    memory; the later ones find the program's rows in L2."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    x_rows = x_ptr + rows.to(tl.int64) * stride_xm
    q_rows = q_ptr + rows.to(tl.int64) * stride_qm
    cols = tl.arange(0, CHUNK)
    mean = tl.zeros((BLOCK_M,), tl.float32)
    if CENTER:
        total = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in range(0, K, CHUNK):
            total += tl.sum(_chunk_values(x_rows, smooth_ptr, pmat_ptr, qmat_ptr, hmat_ptr, row_ok, k0 + cols, K,
                                          mean, rot_norm, BLOCK_M, CHUNK, HAS_SMOOTH, False, False, TWO_STAGE,
                                          ROT_IMPL, PRECISE, ROUND_IN), axis=1)
        mean = total / K
        tl.store(mean_ptr + rows, mean, mask=row_ok)
    amax = tl.zeros((BLOCK_M,), tl.float32)
    for k0 in range(0, K, CHUNK):
        y = _chunk_values(x_rows, smooth_ptr, pmat_ptr, qmat_ptr, hmat_ptr, row_ok, k0 + cols, K, mean, rot_norm,
                          BLOCK_M, CHUNK, HAS_SMOOTH, CENTER, ROTATE, TWO_STAGE, ROT_IMPL, PRECISE,
                          ROUND_IN)
        amax = tl.maximum(amax, tl.max(tl.abs(y), axis=1))
    inv = _row_scales(amax, qmax, scale_ptr, rows, row_ok, BLOCK_M)
    for k0 in range(0, K, CHUNK):
        y = _chunk_values(x_rows, smooth_ptr, pmat_ptr, qmat_ptr, hmat_ptr, row_ok, k0 + cols, K, mean, rot_norm,
                          BLOCK_M, CHUNK, HAS_SMOOTH, CENTER, ROTATE, TWO_STAGE, ROT_IMPL, PRECISE,
                          ROUND_IN)
        y = tl.minimum(tl.maximum(y * inv[:, None], -qmax), qmax)
        mask = row_ok[:, None] & (k0 + cols < K)[None, :]
        _store_codes(q_rows[:, None] + (k0 + cols)[None, :], y, mask, OUT_FP8, PERM_BLOCK, PERM_RUN, HW_FP8_CAST,
                     BLOCK_M, CHUNK)


@triton.jit
def _load_piece(x_rows, smooth_ptr, row_ok, K, OFF: tl.constexpr, W: tl.constexpr, HAS_SMOOTH: tl.constexpr):
    """fp32 columns ``OFF .. OFF + W`` of the rows, smoothed, zero beyond ``K``."""
    cols = OFF + tl.arange(0, W)
    col_ok = cols < K
    x = tl.load(x_rows[:, None] + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    if HAS_SMOOTH:
        x = x * tl.load(smooth_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return x


@triton.jit
def _finish_piece(x, mean, row_ok, K, pmat_ptr, qmat_ptr, hmat_ptr, rot_norm, OFF: tl.constexpr, W: tl.constexpr,
                  BLOCK_M: tl.constexpr, CENTER: tl.constexpr, ROTATE: tl.constexpr, TWO_STAGE: tl.constexpr,
                  ROT_IMPL: tl.constexpr, PRECISE: tl.constexpr, ROUND_IN: tl.constexpr):
    """A loaded piece centred on ``mean`` (zero beyond ``K``) and rotated."""
    if CENTER:
        cols = OFF + tl.arange(0, W)
        x = tl.where(row_ok[:, None] & (cols < K)[None, :], x - mean[:, None], 0.0)
    if ROTATE:
        SB: tl.constexpr = BLOCK_M * W // 256
        x = tl.reshape(x, (SB, 256))
        if ROT_IMPL == 3:  # left unnormalized: the kernel folds 1/sqrt(G) into the row's abs-max and inverse
            x = _rotate_superblocks(x, pmat_ptr, qmat_ptr, hmat_ptr, 1.0, SB, TWO_STAGE, ROT_IMPL, PRECISE, ROUND_IN)
        else:
            x = _rotate_superblocks(x, pmat_ptr, qmat_ptr, hmat_ptr, rot_norm, SB, TWO_STAGE, ROT_IMPL, PRECISE,
                                    ROUND_IN)
        x = tl.reshape(x, (BLOCK_M, W))
    return x


@triton.jit
def _store_piece(q_rows, y, inv, row_ok, K, OFF: tl.constexpr, W: tl.constexpr, BLOCK_M: tl.constexpr,
                 OUT_FP8: tl.constexpr, PERM_BLOCK: tl.constexpr, PERM_RUN: tl.constexpr,
                 HW_FP8_CAST: tl.constexpr):
    # no clamp: |y| <= amax of these very values, so |y * inv| <= qmax (1 + 2^-23), which rounds to qmax
    cols = OFF + tl.arange(0, W)
    y = y * inv[:, None]
    _store_codes(q_rows[:, None] + cols[None, :], y, row_ok[:, None] & (cols < K)[None, :], OUT_FP8, PERM_BLOCK,
                 PERM_RUN, HW_FP8_CAST, BLOCK_M, W)


@triton.jit
def _act_quant_pieces_kernel(
    x_ptr, q_ptr, scale_ptr, mean_ptr, smooth_ptr, pmat_ptr, qmat_ptr, hmat_ptr,
    M, K, stride_xm, stride_qm, qmax, rot_norm,
    BLOCK_M: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr,
    HAS_SMOOTH: tl.constexpr, CENTER: tl.constexpr, ROTATE: tl.constexpr, TWO_STAGE: tl.constexpr,
    ROT_IMPL: tl.constexpr, PRECISE: tl.constexpr, ROUND_IN: tl.constexpr, OUT_FP8: tl.constexpr,
    PERM_BLOCK: tl.constexpr, PERM_RUN: tl.constexpr, HW_FP8_CAST: tl.constexpr,
):
    """Whole rows in registers as up to four power-of-two pieces ``W0 >= W1 >= W2 >= W3`` (0: absent)
    laid end to end over the real ``K`` (3072 = 2048 + 1024: no padding to 4096), one read of ``x``."""
    O1: tl.constexpr = W0
    O2: tl.constexpr = W0 + W1
    O3: tl.constexpr = W0 + W1 + W2
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    x_rows = x_ptr + rows.to(tl.int64) * stride_xm
    q_rows = q_ptr + rows.to(tl.int64) * stride_qm
    x0 = _load_piece(x_rows, smooth_ptr, row_ok, K, 0, W0, HAS_SMOOTH)
    total = tl.sum(x0, axis=1)
    if W1 > 0:
        x1 = _load_piece(x_rows, smooth_ptr, row_ok, K, O1, W1, HAS_SMOOTH)
        total += tl.sum(x1, axis=1)
    if W2 > 0:
        x2 = _load_piece(x_rows, smooth_ptr, row_ok, K, O2, W2, HAS_SMOOTH)
        total += tl.sum(x2, axis=1)
    if W3 > 0:
        x3 = _load_piece(x_rows, smooth_ptr, row_ok, K, O3, W3, HAS_SMOOTH)
        total += tl.sum(x3, axis=1)
    mean = total / K
    if CENTER:
        tl.store(mean_ptr + rows, mean, mask=row_ok)
    x0 = _finish_piece(x0, mean, row_ok, K, pmat_ptr, qmat_ptr, hmat_ptr, rot_norm, 0, W0, BLOCK_M, CENTER, ROTATE,
                       TWO_STAGE, ROT_IMPL, PRECISE, ROUND_IN)
    amax = tl.max(tl.abs(x0), axis=1)
    if W1 > 0:
        x1 = _finish_piece(x1, mean, row_ok, K, pmat_ptr, qmat_ptr, hmat_ptr, rot_norm, O1, W1, BLOCK_M, CENTER,
                           ROTATE, TWO_STAGE, ROT_IMPL, PRECISE, ROUND_IN)
        amax = tl.maximum(amax, tl.max(tl.abs(x1), axis=1))
    if W2 > 0:
        x2 = _finish_piece(x2, mean, row_ok, K, pmat_ptr, qmat_ptr, hmat_ptr, rot_norm, O2, W2, BLOCK_M, CENTER,
                           ROTATE, TWO_STAGE, ROT_IMPL, PRECISE, ROUND_IN)
        amax = tl.maximum(amax, tl.max(tl.abs(x2), axis=1))
    if W3 > 0:
        x3 = _finish_piece(x3, mean, row_ok, K, pmat_ptr, qmat_ptr, hmat_ptr, rot_norm, O3, W3, BLOCK_M, CENTER,
                           ROTATE, TWO_STAGE, ROT_IMPL, PRECISE, ROUND_IN)
        amax = tl.maximum(amax, tl.max(tl.abs(x3), axis=1))
    if ROTATE:
        if ROT_IMPL == 3:
            amax = amax * rot_norm  # the normalized rotation's abs-max (rounding is monotonic)
    inv = _row_scales(amax, qmax, scale_ptr, rows, row_ok, BLOCK_M)
    if ROTATE:
        if ROT_IMPL == 3:
            inv = inv * rot_norm  # one multiply per element: unnormalized value times 1/sqrt(G) / scale
    _store_piece(q_rows, x0, inv, row_ok, K, 0, W0, BLOCK_M, OUT_FP8, PERM_BLOCK, PERM_RUN, HW_FP8_CAST)
    if W1 > 0:
        _store_piece(q_rows, x1, inv, row_ok, K, O1, W1, BLOCK_M, OUT_FP8, PERM_BLOCK, PERM_RUN, HW_FP8_CAST)
    if W2 > 0:
        _store_piece(q_rows, x2, inv, row_ok, K, O2, W2, BLOCK_M, OUT_FP8, PERM_BLOCK, PERM_RUN, HW_FP8_CAST)
    if W3 > 0:
        _store_piece(q_rows, x3, inv, row_ok, K, O3, W3, BLOCK_M, OUT_FP8, PERM_BLOCK, PERM_RUN, HW_FP8_CAST)



@functools.lru_cache(maxsize=1024)
def _chunked_launch_shape(m: int, chunk: int, tile_elements: int, num_warps: int | None) -> tuple[int, int, int]:
    """(BLOCK_M, num_warps, programs) of the chunked kernel."""
    block_m = max(1, min(16, tile_elements // chunk, _pow2_at_least(m)))
    if num_warps is None:
        num_warps = 4 if block_m * chunk <= 4096 else 8
    return block_m, num_warps, -(-m // block_m)


# The pieces kernel's default warps (Session 44, an H100, tests/gpu/probe_act_quant_small_m.py, CUDA-graph time):
# * programs of at most 4096 elements: 2, but 4 for rotated rows below TWO_WARPS_MIN_M rows (256 programs, about
#   two an SM). Rotated, K = 3072: 5.4 / 8.8 / 15.8 us at M = 1024 / 2048 / 4096 against 5.9 / 9.4 / 17.2 with 4
#   warps; without rotation 2.5 / 3.6 / 4.6 / 10.0 at M = 256 / 1024 / 2048 / 4096 against 2.6 / 3.9 / 5.5 / 11.0;
# * wider programs: 4 rotated (K = 12288: 6.1 / 18.4 / 37.2 / 69.3 us at M = 256 / 1024 / 2048 / 4096 against
#   6.2 / 19.4 / 41.6 / 77.0 with 8), 8 without rotation (3.8 / 10.3 / 26.5 / 52.1, 4 warps no faster).
TWO_WARPS_MIN_M = 1024


@functools.lru_cache(maxsize=1024)
def _pieces_launch_shape(m: int, k: int, unit: int, tile_elements: int, num_warps: int | None,
                         rotate: bool) -> tuple[int, tuple[int, int, int, int], int, int]:
    """(BLOCK_M, the four piece widths (0: absent), num_warps, programs) of the pieces kernel.

    The row's ``ceil(k / unit)`` units are split into at most four powers of two, largest first,
    exactly when they have at most four set bits (3072 / 256 = 8 + 4), else the last piece is rounded up.
    Default warps (measured, see :data:`TWO_WARPS_MIN_M`): programs of at most 4096 elements 2 (rotated rows
    below :data:`TWO_WARPS_MIN_M` rows: 4), wider ones 4 rotated and 8 without rotation.
    """
    units, widths = -(-k // unit), []
    while units and len(widths) < 3:
        widths.append(1 << (units.bit_length() - 1))
        units -= widths[-1]
    if units:
        widths.append(_pow2_at_least(units))
    widths = [w * unit for w in widths] + [0] * (4 - len(widths))
    row = sum(widths)
    fit = tile_elements // row
    block_m = max(1, min(16, 1 << (fit.bit_length() - 1) if fit else 1, _pow2_at_least(m)))
    if num_warps is None:
        if block_m * row <= 4096:
            num_warps = 4 if rotate and m < TWO_WARPS_MIN_M else 2
        else:
            num_warps = 4 if rotate else 8
    return block_m, tuple(widths), num_warps, -(-m // block_m)


def check_permutation(k: int, perm_block: int, perm_run: int, out_dtype: torch.dtype) -> None:
    """Raise unless ``perm_block`` (0: none) is a power of two dividing the ``k`` features, of whole pairs of
    ``perm_run``-column runs (a power of two), on INT8 codes."""
    if perm_run < 1 or perm_run & (perm_run - 1):
        raise ValueError(f"perm_run must be a power of two, got {perm_run}")
    if perm_block and (k % perm_block or perm_block % (2 * perm_run) or perm_block & (perm_block - 1)
                       or out_dtype == FP8):
        raise ValueError(f"perm_block {perm_block} must be a power of two dividing the {k} features and a multiple "
                         f"of {2 * perm_run} (INT8 codes only)")


def act_quant_split(x, out_dtype, qmax, rotation, group_size, smooth, center, perm_block, out, tile_elements,
                     num_warps, rotate_impl, split, chunk, num_stages, precise_fp8, max_registers, perm_run=1):
    """:func:`act_quant_triton` through the pieces or the chunked kernel (variant already checked)."""
    m, k = x.shape
    rotate = rotation != "none"
    check_permutation(k, perm_block, perm_run, out_dtype)
    if split == "chunks":
        block_m, num_warps, programs = _chunked_launch_shape(m, chunk, tile_elements, num_warps)
        launcher, widths, narrowest = _CHUNKED_LAUNCHER, dict(CHUNK=chunk), chunk
    else:
        unit = max(256 if rotate else 16, perm_block)
        block_m, pieces, num_warps, programs = _pieces_launch_shape(m, k, unit, tile_elements, num_warps, rotate)
        launcher, widths = _PIECES_LAUNCHER, dict(zip(("W0", "W1", "W2", "W3"), pieces))
        narrowest = min(w for w in pieces if w)
    if rotate_impl == "dense" and rotate and block_m * narrowest < 4096:
        raise ValueError(f"rotate_impl='dense' needs at least 16 super-blocks in every product (tile_elements >= "
                         f"4096), got {block_m} rows of {narrowest}")
    q = torch.empty((m, k), dtype=out_dtype, device=x.device) if out is None else out
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    mean = torch.empty((m, 1), dtype=torch.float32, device=x.device) if center else _no_mean(x.device, m)
    pmat, qmat, hmat, norm, two_stage = _rotation_operands(rotation, group_size, rotate_impl, x.device, scale)
    options = dict(num_warps=num_warps)
    if num_stages is not None:
        options["num_stages"] = num_stages
    if max_registers is not None:
        options["maxnreg"] = max_registers
    launcher.launch(
        (programs,),
        (x, q, scale, mean, smooth if smooth is not None else scale, pmat, qmat, hmat,
         m, k, x.stride(0), q.stride(0), float(qmax), float(norm)),
        dict(BLOCK_M=block_m, **widths, HAS_SMOOTH=smooth is not None, CENTER=center, ROTATE=rotate,
             TWO_STAGE=two_stage, ROT_IMPL=ROTATE_IMPLS[rotate_impl], PRECISE=out_dtype == FP8 and precise_fp8,
             ROUND_IN=_round_in(x, smooth, center), OUT_FP8=out_dtype == FP8, PERM_BLOCK=perm_block,
             PERM_RUN=perm_run, HW_FP8_CAST=x.is_cuda and not interpreting()),
        **options,
    )
    return q, scale, mean


_CHUNKED_LAUNCHER = TritonLauncher(_act_quant_chunked_kernel)
_PIECES_LAUNCHER = TritonLauncher(_act_quant_pieces_kernel)
