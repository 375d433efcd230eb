"""Triton: fused per-token activation quantization (INT8 or FP8), one read of the activation.

One program owns ``BLOCK_M`` whole rows (``BLOCK_K`` = ``K`` rounded up to a power of two, at
least 256) in registers and does, in order: optional column smoothing, optional centring (the
row mean is written out), optional block Hadamard rotation, the row abs-max, and the quantized
store. Only ``x`` is read from memory and only the codes, scales and means are written.

The rotation by ``H_G`` (``G`` = 16…256, regular or Sylvester) uses ``H_G = P ⊗ H16``: each
256-wide super-block is viewed as a 16×16 matrix ``V`` and becomes ``Pfull^T V H16`` with
``Pfull = I_(256/G) ⊗ P`` – two 16×16 tensor-core products instead of a ``G×G`` one. The ±1
matrices are exact in fp16. Each row is first scaled by a power of two to below 2 in magnitude
(exact), so the fp16 operands keep 11 significant bits: the rotated values are accurate to about
2^-12 of the row maximum – 1/30 of an INT8 step, and 8× tighter than rotating in bf16 as
comfy-kitchen does. The 1/sqrt(G) normalization and the power of two are one fp32 multiply at the
end. (fp16, not bf16: the CPU interpreter mis-multiplies bf16 operands.)

Variants of the rotated path (``act_quant_triton(rotate_impl=..., split=...)``; the original is the
default until ``tests/gpu/bench_act_quant.py`` has timed them on a GPU; ``tests/gpu/sass_act_quant.py``
shows their sm_90 registers and instructions without one):

* ``rotate_impl`` "batched": each 256-wide super-block scaled by its own power of two (accuracy
  relative to the super-block's maximum, at most the row's), the ``P`` stage a batched ``P^T W``
  product with ``P`` broadcast per super-block (no permutes); "tf32": the same with tf32 operands
  (fp32 range, so no scaling at all; bf16 / fp16 input is exact in tf32, anything else and the ``P``
  stage's operand are rounded to tf32 – 11 significant bits, as fp16); "dense": one 256×256 product.
* ``split`` "pieces" (``_act_quant_pieces_kernel``): whole rows as up to four power-of-two pieces over
  the real ``K`` (3072 = 2048 + 1024: no padding), one read of ``x``; its store has no clamp (every
  value is at most the abs-max it was scaled by), rounds with the GPU's ``rint`` and, for tf32,
  folds 1/sqrt(G) into the abs-max and the inverse scale. "chunks" (``_act_quant_chunked_kernel``):
  ``chunk``-wide pieces in a loop, a pass for the abs-max and one that recomputes and stores (the
  second read of ``x`` finds it in L2): few registers, twice the rotation work.

``PERM_BLOCK`` > 0 stores the codes with the columns of every ``PERM_BLOCK``-wide block reordered
evens first, then odds – the order in which the 4-bit-weight GEMM consumes the two nibble planes
of a packed byte tile (``kernels/triton_w4_gemm.py``).

``R_BLOCK`` > 0 (FP8 only, no smoothing / centring / rotation) appends the outlier columns of
``reference.act_quant_outliers_reference``: after the row's codes, ``x[row, O]`` is gathered again
with the int32 index vector ``O`` (``r`` entries, one L2-resident read of ``r`` values per row), and
the low (residual) and high codes are written at columns ``K .. K + 2r`` on the row's own scale.

FP8 codes: on a GPU the hardware cast rounds to nearest-even; elsewhere (the CPU interpreter, whose
own float8 cast drops mantissa carries) they are rounded by hand first, so the cast is exact. The
hand rounding cost 3 µs of 14 at M = 4096, K = 3072 on an H200.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .backend import interpreting
from .hadamard import hadamard_matrix
from .launcher import TritonLauncher
from .reference import FP8

MAX_BLOCK_K = 32768  # rows wider than this use the eager reference
TILE_ELEMENTS = 8192  # BLOCK_M * BLOCK_K per program (registers: 8192 fp32 over 4-16 warps)
ROTATE_IMPLS = {"permute": 0, "batched": 1, "dense": 2, "tf32": 3}  # the kernels' ROT_IMPL
# Rotated rows, measured on an H200 (tests/gpu/bench_act_quant.py, M = 4096, INT8 codes, regular 256):
# "batched" with "pieces" took 20.2 / 73.3 us at K = 3072 / 12288 (the original 23.7 / 91.1), but
# 117 us at K = 15360 (four pieces), where "batched" over the padded row took 84 us (original 93).
DEFAULT_ROTATE_IMPL = "batched"
ROW_SPLITS = ("pow2", "pieces", "chunks")  # how a program holds its rows (see act_quant_triton)
DEFAULT_SPLIT = "pieces"  # rotated rows whose width is at most two powers of two (else "pow2")
DEFAULT_PLAIN_SPLIT = "pow2"  # rows without rotation (already at memory speed); outlier columns always "pow2"


def default_split(k: int, rotate: bool) -> str:
    """The row split used when none is asked for: :data:`DEFAULT_SPLIT` for rotated rows of at most two
    power-of-two pieces, else the padded row (``"pow2"``); :data:`DEFAULT_PLAIN_SPLIT` without rotation."""
    if not rotate:
        return DEFAULT_PLAIN_SPLIT
    return DEFAULT_SPLIT if bin(k).count("1") <= 2 else "pow2"


@triton.jit
def _rint(y):
    # 1.5 * 2^23: (y + c) - c rounds |y| < 2^22 to nearest-even in fp32 (the interpreter lacks libdevice)
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _round_to_e4m3(y):
    """Round fp32 ``y`` (already clamped to ±448) to the nearest-even e4m3 value, as fp32."""
    bits = y.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    exponent = tl.maximum(exponent, 121)  # below 2^-6 the e4m3 grid is uniform (subnormals)
    inv_ulp = ((257 - exponent) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e)
    ulp = ((exponent - 3) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3)
    return _rint(y * inv_ulp) * ulp


@triton.jit
def _dot_fp16(v, h, PRECISE: tl.constexpr):
    """``v @ h`` for fp32 ``|v| < 2`` and a ±1 fp16 matrix ``h``, fp32 accumulation. ``v`` is rounded
    to fp16 (2^-12 of the row maximum), or with ``PRECISE`` split into fp16 hi + lo (~2^-22)."""
    hi = v.to(tl.float16)
    out = tl.dot(hi, h, out_dtype=tl.float32)
    if PRECISE:
        out += tl.dot((v - hi.to(tl.float32)).to(tl.float16), h, out_dtype=tl.float32)
    return out


@triton.jit
def _dot_fp16_left(h, v, PRECISE: tl.constexpr):
    """``h @ v`` (batched: ``[B, 16, 16]``) for a ±1 fp16 ``h`` and fp32 ``|v| < 2``, rounded as :func:`_dot_fp16`."""
    hi = v.to(tl.float16)
    out = tl.dot(h, hi, out_dtype=tl.float32)
    if PRECISE:
        out += tl.dot(h, (v - hi.to(tl.float32)).to(tl.float16), out_dtype=tl.float32)
    return out


@triton.jit
def _round_tf32(v):
    """fp32 ``v`` rounded to tf32 (10 mantissa bits, ties away from zero): exact in a tf32 product,
    on the GPU (whose tensor cores drop the low 13 bits) as in the interpreter (which keeps them)."""
    return ((v.to(tl.int32, bitcast=True) + 4096) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def _dot_tf32(v, h, ROUND: tl.constexpr, PRECISE: tl.constexpr):
    """``v @ h`` for a ±1 fp32 ``h``: ``v`` rounded to tf32 (``ROUND``; else it is exact already),
    plus the product of the rounding residual (``PRECISE``)."""
    if ROUND:
        hi = _round_tf32(v)
        out = tl.dot(hi, h, input_precision="tf32", out_dtype=tl.float32)
        if PRECISE:
            out += tl.dot(_round_tf32(v - hi), h, input_precision="tf32", out_dtype=tl.float32)
    else:
        out = tl.dot(v, h, input_precision="tf32", out_dtype=tl.float32)
    return out


@triton.jit
def _dot_tf32_left(h, v, PRECISE: tl.constexpr):
    """``h @ v`` (batched) for a ±1 fp32 ``h``, ``v`` rounded to tf32 (+ the residual's product: ``PRECISE``)."""
    hi = _round_tf32(v)
    out = tl.dot(h, hi, input_precision="tf32", out_dtype=tl.float32)
    if PRECISE:
        out += tl.dot(h, _round_tf32(v - hi), input_precision="tf32", out_dtype=tl.float32)
    return out


@triton.jit
def _rotate_superblocks(x, pmat_ptr, qmat_ptr, hmat_ptr, rot_norm, SB: tl.constexpr, TWO_STAGE: tl.constexpr,
                        ROT_IMPL: tl.constexpr, PRECISE: tl.constexpr, ROUND_IN: tl.constexpr):
    """fp32 ``[SB, 256]`` rows of 256-wide super-blocks times ``blockdiag(H_G)``, normalized.

    ``ROT_IMPL`` 1 and 2 (fp16 operands): each super-block is scaled by its own power of two to below
    2 (exact, undone at the end), so the fp16 operands hold 11 significant bits of the super-block's
    maximum; 1: the ``P^T W`` stage is a batched product with ``P^T`` broadcast per super-block (no
    layout permutes), 2: one dense 256×256 product with ``Pfull ⊗ H16`` (16× the FLOPs, no second
    stage). 3 (tf32 operands, fp32 range: no scaling): as 1; the input is used as is (a bf16 or fp16
    ``x`` is exact in tf32) unless ``ROUND_IN`` (smoothed, centred or fp32 input), and the ``P``
    stage's operand is rounded to tf32 – 11 significant bits, as fp16.
    """
    r16 = tl.arange(0, 16)
    if ROT_IMPL == 3:
        qmat = tl.load(qmat_ptr + r16[:, None] * 16 + r16[None, :]).to(tl.float32)  # ±1 H16 (low index)
        w = _dot_tf32(tl.reshape(x, (SB * 16, 16)), qmat, ROUND_IN, PRECISE)  # rows (super-block, a), cols d
        if TWO_STAGE:
            pt = tl.load(pmat_ptr + r16[None, :] * 16 + r16[:, None]).to(tl.float32)  # P^T: rows c, cols a
            pt = tl.broadcast_to(pt[None, :, :], (SB, 16, 16))
            w = _dot_tf32_left(pt, tl.reshape(w, (SB, 16, 16)), PRECISE)  # rows (super-block, c), cols d
        w = tl.reshape(w, (SB, 256)) * rot_norm
    else:
        sb_exp = tl.maximum((tl.max(tl.abs(x), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF, 1)
        x = x * ((254 - sb_exp) << 23).to(tl.float32, bitcast=True)[:, None]
        if ROT_IMPL == 2:
            r256 = tl.arange(0, 256)
            hmat = tl.load(hmat_ptr + r256[:, None] * 256 + r256[None, :])  # ±1 fp16 Pfull ⊗ H16
            w = _dot_fp16(x, hmat, PRECISE)
        else:
            qmat = tl.load(qmat_ptr + r16[:, None] * 16 + r16[None, :])  # ±1 fp16 H16 (acts on the low index)
            w = _dot_fp16(tl.reshape(x, (SB * 16, 16)), qmat, PRECISE)  # rows (super-block, a), cols d
            if TWO_STAGE:
                w3 = tl.reshape(w, (SB, 16, 16))
                if ROT_IMPL == 1:
                    pt = tl.load(pmat_ptr + r16[None, :] * 16 + r16[:, None])  # P^T: rows c, cols a
                    pt = tl.broadcast_to(pt[None, :, :], (SB, 16, 16))
                    w = _dot_fp16_left(pt, w3, PRECISE)  # rows (super-block, c), cols d
                else:
                    pmat = tl.load(pmat_ptr + r16[:, None] * 16 + r16[None, :])
                    wt = tl.reshape(tl.permute(w3, (0, 2, 1)), (SB * 16, 16))
                    z = _dot_fp16(wt, pmat, PRECISE)
                    w = tl.permute(tl.reshape(z, (SB, 16, 16)), (0, 2, 1))
            w = tl.reshape(w, (SB, 256))
        w = w * ((sb_exp << 23).to(tl.float32, bitcast=True) * rot_norm)[:, None]
    return w


@triton.jit
def _store_codes(q_ptrs, y, mask, OUT_FP8: tl.constexpr, PERM_BLOCK: tl.constexpr, HW_FP8_CAST: tl.constexpr,
                 BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """Store ``y`` (code units, within qmax) as FP8 or INT8 codes, ``PERM_BLOCK``-permuted for INT8.
    ``HW_FP8_CAST`` (on a GPU): the hardware rounds, to nearest even as the hand rounding does."""
    if OUT_FP8:
        if HW_FP8_CAST:
            tl.store(q_ptrs, y.to(tl.float8e4nv), mask=mask)
        else:
            tl.store(q_ptrs, _round_to_e4m3(y).to(tl.float8e4nv), mask=mask)
    else:
        if HW_FP8_CAST:
            q = libdevice.rint(y).to(tl.int8)
        else:
            q = _rint(y).to(tl.int8)
        if PERM_BLOCK > 0:
            q = tl.reshape(q, (BLOCK_M, WIDTH // PERM_BLOCK, PERM_BLOCK // 2, 2))
            q = tl.reshape(tl.permute(q, (0, 1, 3, 2)), (BLOCK_M, WIDTH))
        tl.store(q_ptrs, q, mask=mask)


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, scale_ptr, mean_ptr, smooth_ptr, pmat_ptr, qmat_ptr, hmat_ptr, outlier_ptr,
    M, K, R, stride_xm, stride_qm, qmax, rot_norm,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_SMOOTH: tl.constexpr, CENTER: tl.constexpr, ROTATE: tl.constexpr, TWO_STAGE: tl.constexpr,
    ROT_IMPL: tl.constexpr, PRECISE: tl.constexpr, ROUND_IN: tl.constexpr,
    OUT_FP8: tl.constexpr, PERM_BLOCK: tl.constexpr, R_BLOCK: tl.constexpr, HW_FP8_CAST: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < K
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_SMOOTH:
        smooth = tl.load(smooth_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        x = x * smooth[None, :]
    if CENTER:
        mean = tl.sum(x, axis=1) / K
        x = tl.where(mask, x - mean[:, None], 0.0)
        tl.store(mean_ptr + rows, mean, mask=row_ok)
    if ROTATE and ROT_IMPL > 0:  # per-super-block scaling, batched or dense products
        SB_TILE: tl.constexpr = BLOCK_M * BLOCK_K // 256
        x = tl.reshape(x, (SB_TILE, 256))
        x = _rotate_superblocks(x, pmat_ptr, qmat_ptr, hmat_ptr, rot_norm, SB_TILE, TWO_STAGE, ROT_IMPL, PRECISE,
                                ROUND_IN)
        x = tl.reshape(x, (BLOCK_M, BLOCK_K))
    if ROTATE and ROT_IMPL == 0:  # the original path: one power of two per row, permutes around the P stage
        SB: tl.constexpr = BLOCK_M * BLOCK_K // 256  # 256-wide super-blocks in the tile
        # scale each row by 2^-e (exact) so |x| < 2 fits fp16; undone with the normalization below
        row_exp = tl.maximum((tl.max(tl.abs(x), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF, 1)
        x = x * ((254 - row_exp) << 23).to(tl.float32, bitcast=True)[:, None]
        r16 = tl.arange(0, 16)
        qmat = tl.load(qmat_ptr + r16[:, None] * 16 + r16[None, :])  # ±1 fp16 H16 (acts on the low index)
        v = tl.reshape(x, (SB * 16, 16))
        w = _dot_fp16(v, qmat, PRECISE)  # rows (super-block, a), cols d
        if TWO_STAGE:
            pmat = tl.load(pmat_ptr + r16[:, None] * 16 + r16[None, :])  # ±1 fp16 I ⊗ P (high index)
            wt = tl.reshape(tl.permute(tl.reshape(w, (SB, 16, 16)), (0, 2, 1)), (SB * 16, 16))
            z = _dot_fp16(wt * 0.0625, pmat, PRECISE)  # rows (super-block, d), cols c; /16 keeps |.| < 2
            w = tl.reshape(tl.permute(tl.reshape(z, (SB, 16, 16)), (0, 2, 1)), (SB * 16, 16)) * 16.0
        row_pow2 = (row_exp << 23).to(tl.float32, bitcast=True)  # 2^(e-127)
        x = tl.reshape(w, (BLOCK_M, BLOCK_K)) * (row_pow2 * rot_norm)[:, None]
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-30)  # reference.ABSMAX_FLOOR
    inv = tl.math.div_rn(tl.full((BLOCK_M,), 1.0, tl.float32) * qmax, amax)
    scale = tl.math.div_rn(amax, tl.full((BLOCK_M,), 1.0, tl.float32) * qmax)
    tl.store(scale_ptr + rows, scale, mask=row_ok)
    y = tl.minimum(tl.maximum(x * inv[:, None], -qmax), qmax)
    q_ptrs = q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :]
    if OUT_FP8:
        if HW_FP8_CAST:  # the GPU's own cast rounds to nearest-even (saturating; y is already clamped)
            tl.store(q_ptrs, y.to(tl.float8e4nv), mask=mask)
        else:
            tl.store(q_ptrs, _round_to_e4m3(y).to(tl.float8e4nv), mask=mask)
        if R_BLOCK > 0:  # outlier columns: the plain path compiles without this block
            r_cols = tl.arange(0, R_BLOCK)
            r_ok = r_cols < R
            channel = tl.load(outlier_ptr + r_cols, mask=r_ok, other=0)
            o_mask = row_ok[:, None] & r_ok[None, :]
            xo = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + channel[None, :], mask=o_mask, other=0.0)
            yo = tl.minimum(tl.maximum(xo.to(tl.float32) * inv[:, None], -qmax), qmax)
            hi = _round_to_e4m3(yo)
            o_ptrs = q_ptr + rows[:, None].to(tl.int64) * stride_qm + K + r_cols[None, :]
            lo = yo - hi  # exact in fp32; rounded to nearest with the sign of a zero kept, as torch's cast
            lo = tl.where(_round_to_e4m3(lo) == 0.0, lo * 0.0, _round_to_e4m3(lo))
            tl.store(o_ptrs, lo.to(tl.float8e4nv), mask=o_mask)
            tl.store(o_ptrs + R, hi.to(tl.float8e4nv), mask=o_mask)
    else:
        q = _rint(y).to(tl.int8)
        if PERM_BLOCK > 0:  # evens, then odds, within each PERM_BLOCK columns (in registers: stores stay wide)
            q = tl.reshape(q, (BLOCK_M, BLOCK_K // PERM_BLOCK, PERM_BLOCK // 2, 2))
            q = tl.reshape(tl.permute(q, (0, 1, 3, 2)), (BLOCK_M, BLOCK_K))
        tl.store(q_ptrs, q, mask=mask)


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
    PERM_BLOCK: tl.constexpr, HW_FP8_CAST: tl.constexpr,
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
    amax = tl.maximum(amax, 1e-30)  # reference.ABSMAX_FLOOR
    inv = tl.math.div_rn(tl.full((BLOCK_M,), 1.0, tl.float32) * qmax, amax)
    scale = tl.math.div_rn(amax, tl.full((BLOCK_M,), 1.0, tl.float32) * qmax)
    tl.store(scale_ptr + rows, scale, mask=row_ok)
    for k0 in range(0, K, CHUNK):
        y = _chunk_values(x_rows, smooth_ptr, pmat_ptr, qmat_ptr, hmat_ptr, row_ok, k0 + cols, K, mean, rot_norm,
                          BLOCK_M, CHUNK, HAS_SMOOTH, CENTER, ROTATE, TWO_STAGE, ROT_IMPL, PRECISE,
                          ROUND_IN)
        y = tl.minimum(tl.maximum(y * inv[:, None], -qmax), qmax)
        mask = row_ok[:, None] & (k0 + cols < K)[None, :]
        _store_codes(q_rows[:, None] + (k0 + cols)[None, :], y, mask, OUT_FP8, PERM_BLOCK, HW_FP8_CAST, BLOCK_M, CHUNK)


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
                 OUT_FP8: tl.constexpr, PERM_BLOCK: tl.constexpr, HW_FP8_CAST: tl.constexpr):
    # no clamp: |y| <= amax of these very values, so |y * inv| <= qmax (1 + 2^-23), which rounds to qmax
    cols = OFF + tl.arange(0, W)
    y = y * inv[:, None]
    _store_codes(q_rows[:, None] + cols[None, :], y, row_ok[:, None] & (cols < K)[None, :], OUT_FP8, PERM_BLOCK,
                 HW_FP8_CAST, BLOCK_M, W)


@triton.jit
def _act_quant_pieces_kernel(
    x_ptr, q_ptr, scale_ptr, mean_ptr, smooth_ptr, pmat_ptr, qmat_ptr, hmat_ptr,
    M, K, stride_xm, stride_qm, qmax, rot_norm,
    BLOCK_M: tl.constexpr, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr,
    HAS_SMOOTH: tl.constexpr, CENTER: tl.constexpr, ROTATE: tl.constexpr, TWO_STAGE: tl.constexpr,
    ROT_IMPL: tl.constexpr, PRECISE: tl.constexpr, ROUND_IN: tl.constexpr, OUT_FP8: tl.constexpr,
    PERM_BLOCK: tl.constexpr, HW_FP8_CAST: tl.constexpr,
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
    amax = tl.maximum(amax, 1e-30)  # reference.ABSMAX_FLOOR
    inv = tl.math.div_rn(tl.full((BLOCK_M,), 1.0, tl.float32) * qmax, amax)
    scale = tl.math.div_rn(amax, tl.full((BLOCK_M,), 1.0, tl.float32) * qmax)
    tl.store(scale_ptr + rows, scale, mask=row_ok)
    if ROTATE:
        if ROT_IMPL == 3:
            inv = inv * rot_norm  # one multiply per element: unnormalized value times 1/sqrt(G) / scale
    _store_piece(q_rows, x0, inv, row_ok, K, 0, W0, BLOCK_M, OUT_FP8, PERM_BLOCK, HW_FP8_CAST)
    if W1 > 0:
        _store_piece(q_rows, x1, inv, row_ok, K, O1, W1, BLOCK_M, OUT_FP8, PERM_BLOCK, HW_FP8_CAST)
    if W2 > 0:
        _store_piece(q_rows, x2, inv, row_ok, K, O2, W2, BLOCK_M, OUT_FP8, PERM_BLOCK, HW_FP8_CAST)
    if W3 > 0:
        _store_piece(q_rows, x3, inv, row_ok, K, O3, W3, BLOCK_M, OUT_FP8, PERM_BLOCK, HW_FP8_CAST)


@functools.lru_cache(maxsize=16)
def _rotation_factors(kind: str, group_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, float, bool]:
    """(±1 ``I ⊗ P`` 16×16, ±1 H16, 1/sqrt(G), whether the P stage is needed) as fp16 on ``device``."""
    if group_size < 16 or group_size > 256 or group_size & (group_size - 1):
        raise ValueError(f"the fused rotation supports Hadamard groups of 16..256 (a power of two), got {group_size}")
    q16 = hadamard_matrix(kind, 16) * 4.0
    outer = group_size // 16
    p = torch.ones(1, 1) if outer == 1 else hadamard_matrix(kind, outer) * outer**0.5
    pfull = torch.kron(torch.eye(256 // group_size), p)
    return (pfull.round().to(device=device, dtype=torch.float16).contiguous(),
            q16.round().to(device=device, dtype=torch.float16).contiguous(),
            1.0 / group_size**0.5, outer > 1)


@functools.lru_cache(maxsize=16)
def _dense_rotation(kind: str, group_size: int, device: torch.device) -> torch.Tensor:
    """±1 fp16 ``Pfull ⊗ H16`` (256×256): one super-block's whole rotation, for ``rotate_impl="dense"``."""
    pmat, qmat, _, _ = _rotation_factors(kind, group_size, device)
    return torch.kron(pmat.float(), qmat.float()).to(torch.float16).contiguous()


def _pow2_at_least(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


@functools.lru_cache(maxsize=1024)
def _launch_shape(m: int, k: int, rotate: bool, tile_elements: int, num_warps: int | None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_K, num_warps, programs) – computed once per shape (launch overhead matters)."""
    block_k = max(_pow2_at_least(k), 256 if rotate else 16)
    block_m = max(1, min(16, tile_elements // block_k, _pow2_at_least(m)))
    tile = block_m * block_k
    if num_warps is None:
        # 16 warps were slower everywhere on an H200 (a 16384-wide rotated row: 136 us against 90 us with 8)
        num_warps = 4 if tile <= 4096 else 8
    return block_m, block_k, num_warps, -(-m // block_m)


@functools.lru_cache(maxsize=1024)
def _chunked_launch_shape(m: int, chunk: int, tile_elements: int, num_warps: int | None) -> tuple[int, int, int]:
    """(BLOCK_M, num_warps, programs) of the chunked kernel."""
    block_m = max(1, min(16, tile_elements // chunk, _pow2_at_least(m)))
    if num_warps is None:
        num_warps = 4 if block_m * chunk <= 4096 else 8
    return block_m, num_warps, -(-m // block_m)


@functools.lru_cache(maxsize=1024)
def _pieces_launch_shape(m: int, k: int, unit: int, tile_elements: int,
                         num_warps: int | None) -> tuple[int, tuple[int, int, int, int], int, int]:
    """(BLOCK_M, the four piece widths (0: absent), num_warps, programs) of the pieces kernel.

    The row's ``ceil(k / unit)`` units are split into at most four powers of two, largest first,
    exactly when they have at most four set bits (3072 / 256 = 8 + 4), else the last piece is rounded up.
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
        num_warps = 4 if block_m * row <= 4096 else 8
    return block_m, tuple(widths), num_warps, -(-m // block_m)


def _check_variant(rotate_impl: str, split: str, chunk: int, rotate: bool, perm_block: int, outliers: bool) -> None:
    if rotate_impl not in ROTATE_IMPLS:
        raise ValueError(f"rotate_impl must be one of {sorted(ROTATE_IMPLS)}, got {rotate_impl!r}; "
                         "use 'permute' (the original path) unless a measurement says otherwise")
    if split not in ROW_SPLITS:
        raise ValueError(f"split must be one of {ROW_SPLITS}, got {split!r}")
    if split != "pow2" and outliers:
        raise ValueError(f"outlier columns are written by the split='pow2' kernel only, got split={split!r}")
    if split == "chunks":
        if chunk & (chunk - 1) or chunk < (256 if rotate else 16):
            raise ValueError(f"chunk must be a power of two of at least {256 if rotate else 16} "
                             f"(whole 256-wide rotation super-blocks), got {chunk}")
        if perm_block > chunk:
            raise ValueError(f"perm_block {perm_block} is wider than the {chunk}-wide chunk; use a chunk of at least "
                             f"{perm_block}")


def act_quant_problem(k: int, rotation: str, group_size: int) -> str | None:
    """Why the Triton kernel cannot take rows of ``k`` features (``None`` when it can)."""
    if _pow2_at_least(k) > MAX_BLOCK_K:
        return f"rows of {k} features exceed the register-resident limit of {MAX_BLOCK_K}"
    if rotation != "none" and not (16 <= group_size <= 256 and group_size & (group_size - 1) == 0):
        return f"the fused rotation needs a power-of-two group of 16..256, got {group_size}"
    return None


def act_quant_triton(x: torch.Tensor, out_dtype: torch.dtype, qmax: float, rotation: str, group_size: int,
                     smooth: torch.Tensor | None, center: bool, perm_block: int = 0, out: torch.Tensor | None = None,
                     tile_elements: int | None = None, num_warps: int | None = None,
                     outlier_index: torch.Tensor | None = None, rotate_impl: str | None = None,
                     split: str | None = None, chunk: int = 1024, num_stages: int | None = None,
                     precise_fp8: bool = True, max_registers: int | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of :func:`lowbit.kernels.reference.act_quant_reference` for a 2-D ``x``.

    ``out`` (tests: a poisoned buffer) receives the codes when given; ``tile_elements`` and
    ``num_warps`` override the program size (benchmark sweeps). ``outlier_index`` (int32 ``[r]``,
    FP8 without pre-processing only): the codes are ``[M, K + 2r]`` as
    :func:`lowbit.kernels.reference.act_quant_outliers_reference` (``None``: no extra work).

    Variants (benchmark sweeps; every one meets the same accuracy contract), ``None`` = the defaults
    :data:`DEFAULT_ROTATE_IMPL` and :data:`DEFAULT_SPLIT` (:data:`DEFAULT_PLAIN_SPLIT` without rotation;
    ``"pow2"`` with outlier columns, which only that kernel writes):

    * ``rotate_impl``: ``"permute"`` (the original: one power of two per row, layout permutes around
      the ``P`` stage), ``"batched"`` (one power of two per 256-wide super-block, the ``P`` stage a
      batched product), ``"dense"`` (one 256×256 product per super-block), ``"tf32"`` (as batched
      with tf32 operands: fp32 range, so no scaling, and bf16 / fp16 input enters as is);
    * ``split``: ``"pow2"`` (the original: whole rows in registers, ``K`` padded to a power of two),
      ``"pieces"`` (whole rows as up to four power-of-two pieces over the real ``K``, one pass),
      ``"chunks"`` (``chunk``-wide pieces in a loop: a pass for the abs-max, one that recomputes and
      stores – three when centring; few registers; ``num_stages`` is the loop's pipelining depth);
    * ``precise_fp8`` (FP8 codes of a rotation): fp16 hi + lo operands (rotated values to ~2^-22 of
      the maximum, FP8 codes as the fp32 reference's but for rare ties); ``False``: hi only, one
      product a stage (2^-12, as INT8 – codes of values near zero may move a few e4m3 steps);
    * ``max_registers``: the compiler's register cap per thread (``maxnreg``: more programs per SM,
      perhaps spills).
    """
    m, k = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    rotate = rotation != "none"
    if tile_elements is None:  # measured on H200: 4096-element programs of 4 warps, rotated or not
        tile_elements = TILE_ELEMENTS // 2
    rotate_impl = DEFAULT_ROTATE_IMPL if rotate_impl is None else rotate_impl
    if split is None:
        split = "pow2" if outlier_index is not None else default_split(k, rotate)
    if rotate_impl != "permute" or split != "pow2":
        _check_variant(rotate_impl, split, chunk, rotate, perm_block, outlier_index is not None)
    if split != "pow2":
        return _act_quant_split(x, out_dtype, qmax, rotation, group_size, smooth, center, perm_block, out,
                                tile_elements, num_warps, rotate_impl, split, chunk, num_stages, precise_fp8,
                                max_registers)
    block_m, block_k, num_warps, programs = _launch_shape(m, k, rotate, tile_elements, num_warps)
    if rotate_impl == "dense" and rotate and block_m * block_k < 4096:
        raise ValueError(f"rotate_impl='dense' needs at least 16 super-blocks a program (tile_elements >= 4096), "
                         f"got {block_m} rows of {block_k}")
    if perm_block and (k % perm_block or perm_block % 2 or perm_block & (perm_block - 1) or out_dtype == FP8):
        raise ValueError(f"perm_block {perm_block} must be a power of two dividing the {k} features (INT8 codes only)")
    r = 0 if outlier_index is None else outlier_index.numel()
    if r and (out_dtype != FP8 or rotate or center or smooth is not None or perm_block):
        raise ValueError("outlier columns are for FP8 codes without smoothing, centring, rotation or permutation")
    if r and (outlier_index.dtype != torch.int32 or outlier_index.device != x.device):
        raise ValueError(f"outlier_index must be int32 on {x.device}, got {outlier_index.dtype} on {outlier_index.device}")
    q = torch.empty((m, k + 2 * r), dtype=out_dtype, device=x.device) if out is None else out
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    mean = torch.empty((m, 1), dtype=torch.float32, device=x.device) if center else _no_mean(x.device, m)
    pmat, qmat, hmat, norm, two_stage = _rotation_operands(rotation, group_size, rotate_impl, x.device, scale)
    _LAUNCHER.launch(
        (programs,),
        (x, q, scale, mean, smooth if smooth is not None else scale, pmat, qmat, hmat,
         outlier_index if r else scale, m, k, r, x.stride(0), q.stride(0), float(qmax), float(norm)),
        dict(BLOCK_M=block_m, BLOCK_K=block_k, HAS_SMOOTH=smooth is not None, CENTER=center, ROTATE=rotate,
             TWO_STAGE=two_stage, ROT_IMPL=ROTATE_IMPLS[rotate_impl], PRECISE=out_dtype == FP8 and precise_fp8,
             ROUND_IN=_round_in(x, smooth, center), OUT_FP8=out_dtype == FP8, PERM_BLOCK=perm_block,
             R_BLOCK=max(16, _pow2_at_least(r)) if r else 0, HW_FP8_CAST=x.is_cuda and not interpreting()),
        **(dict(num_warps=num_warps) if max_registers is None else dict(num_warps=num_warps, maxnreg=max_registers)),
    )
    return q, scale, mean


def _round_in(x: torch.Tensor, smooth: torch.Tensor | None, center: bool) -> bool:
    """Whether the rotation's input must be rounded to tf32 (``rotate_impl="tf32"``): bf16 and fp16
    activations are exact in tf32, smoothed / centred / fp32 ones are not."""
    return smooth is not None or center or x.dtype not in (torch.bfloat16, torch.float16)


def _rotation_operands(rotation: str, group_size: int, rotate_impl: str, device: torch.device,
                       unused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, bool]:
    """(P, H16, dense 256×256 or ``unused``, 1/sqrt(G), two-stage) for the kernels' rotation arguments."""
    if rotation == "none":
        return unused, unused, unused, 1.0, False
    pmat, qmat, norm, two_stage = _rotation_factors(rotation, group_size, device)
    hmat = _dense_rotation(rotation, group_size, device) if rotate_impl == "dense" else unused
    return pmat, qmat, hmat, norm, two_stage


def _act_quant_split(x, out_dtype, qmax, rotation, group_size, smooth, center, perm_block, out, tile_elements,
                     num_warps, rotate_impl, split, chunk, num_stages, precise_fp8, max_registers):
    """:func:`act_quant_triton` through the pieces or the chunked kernel (variant already checked)."""
    m, k = x.shape
    rotate = rotation != "none"
    if perm_block and (k % perm_block or perm_block % 2 or perm_block & (perm_block - 1) or out_dtype == FP8):
        raise ValueError(f"perm_block {perm_block} must be a power of two dividing the {k} features (INT8 codes only)")
    if split == "chunks":
        block_m, num_warps, programs = _chunked_launch_shape(m, chunk, tile_elements, num_warps)
        launcher, widths, narrowest = _CHUNKED_LAUNCHER, dict(CHUNK=chunk), chunk
    else:
        unit = max(256 if rotate else 16, perm_block)
        block_m, pieces, num_warps, programs = _pieces_launch_shape(m, k, unit, tile_elements, num_warps)
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
             HW_FP8_CAST=x.is_cuda and not interpreting()),
        **options,
    )
    return q, scale, mean


_LAUNCHER = TritonLauncher(_act_quant_kernel)
_CHUNKED_LAUNCHER = TritonLauncher(_act_quant_chunked_kernel)
_PIECES_LAUNCHER = TritonLauncher(_act_quant_pieces_kernel)


@functools.lru_cache(maxsize=64)
def _no_mean(device: torch.device, m: int) -> torch.Tensor:
    """The ``[m, 0]`` mean of an uncentred call (no data: cached instead of allocated per call)."""
    return torch.empty((m, 0), dtype=torch.float32, device=device)
