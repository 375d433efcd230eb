"""Shared pieces of the act-quant Triton kernels (``triton_act_quant.py``, ``triton_act_quant_split.py``).

Device functions: round-to-nearest-even for fp32 (``_rint``) and to the e4m3 grid by hand
(``_round_to_e4m3``, for the CPU interpreter), the 16×16 tensor-core products of the block Hadamard
rotation in fp16 or tf32 (``_dot_*``), a whole super-block rotation (``_rotate_superblocks``) and the
code store (``_store_codes``). Host helpers: the ±1 rotation factors cached per device, and the small
shape and argument helpers both launchers use.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .hadamard import hadamard_matrix
from .launcher import constant_tensor

ROTATE_IMPLS = {"permute": 0, "batched": 1, "dense": 2, "tf32": 3}  # the kernels' ROT_IMPL


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


GELU_APPROXIMATIONS = {"none": 0, "tanh": 1}  # the kernels' APPROX
#: the kernels' SRC_ROUND: how a prologue rounds what it computes to the input dtype (see _round_to_src)
SRC_ROUNDING = {"fp32": 0, "bf16_by_hand": 1, "bf16": 2, "fp16": 3}


@triton.jit
def _gelu(x, APPROX: tl.constexpr):
    """GELU of fp32 ``x``: ``APPROX`` 1 is tanh's, as ``x * sigmoid(2u)``, ``u = sqrt(2/pi) (x + 0.044715 x^3)``
    (the same function as ``0.5 x (1 + tanh(u))``, one exponential); 0 is ``0.5 x (1 + erf(x / sqrt(2)))``."""
    if APPROX == 1:
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return x / (1.0 + tl.exp(tl.minimum(-2.0 * u, 80.0)))  # e^80: the quotient is 0 already
    return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))


@triton.jit
def _round_to_src(x, SRC_ROUND: tl.constexpr):
    """fp32 ``x`` rounded to the input dtype (nearest-even) and back: the value the unfused graph stores.
    1: bf16 by hand (the CPU interpreter's bf16 cast truncates); 2: bf16 cast; 3: fp16 cast; 0: as is."""
    if SRC_ROUND == 1:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    elif SRC_ROUND == 2:
        x = x.to(tl.bfloat16).to(tl.float32)
    elif SRC_ROUND == 3:
        x = x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _prologue_rows(x_ptr, aux_ptr, shift_ptr, nw_ptr, rows, cols, row_ok, K, KA, stride_xm, stride_am,
                   rows_per_batch, stride_mb, stride_sb, eps, PROLOGUE: tl.constexpr, APPROX: tl.constexpr,
                   HAS_A: tl.constexpr, HAS_MULT: tl.constexpr, HAS_SHIFT: tl.constexpr, SRC_ROUND: tl.constexpr,
                   NORM_RMS: tl.constexpr, HAS_NW: tl.constexpr, TWO_STEP: tl.constexpr, NW_ROUNDED: tl.constexpr,
                   PTX: tl.constexpr):
    """``[BLOCK_M, BLOCK_K]`` fp32 rows of a prologue input (``kernels/prologue.py``), zero outside ``K``.

    PROLOGUE 1 (``[a | gelu(b)]``): ``x_ptr`` is ``b`` (``K - KA`` columns), ``aux_ptr`` is ``a`` (``KA``).
    PROLOGUE 2 (``shift + layer_norm(x) * mult``): ``aux_ptr`` is ``mult``, ``shift_ptr`` is ``shift``,
    both one row per batch element of ``rows_per_batch`` rows (batch strides ``stride_mb``/``stride_sb``,
    0 for a single row shared by all). ``NORM_RMS``: ``rms_norm`` instead, times the weight at ``nw_ptr``
    (``HAS_NW``) before the rounding (``NW_ROUNDED``: after it too); ``TWO_STEP``: the product with ``mult``
    rounded before ``shift`` is added (``PTX``, compiled for an NVIDIA GPU: the product passes through an opaque
    move first, or the compiler narrows the product and the sum to the input's dtype and fuses them into one FMA,
    one rounding where the unfused graph has two: measured on an H200, 4-5 % of the codes moved).
    PROLOGUE 3 (``[a | silu(gate) * up]``): ``x_ptr`` is ``[gate | up]`` (``2 (K - KA)`` columns), ``aux_ptr``
    is ``a`` (``KA``). PROLOGUE 4: the same with the gate at ``x_ptr`` and ``up`` at ``shift_ptr`` (row stride
    ``stride_sb``), ``K - KA`` columns each."""
    col_ok = cols < K
    mask = row_ok[:, None] & col_ok[None, :]
    row_off = rows[:, None].to(tl.int64)
    if PROLOGUE == 1 or PROLOGUE == 3 or PROLOGUE == 4:
        in_b = (cols >= KA) & col_ok
        b_mask = row_ok[:, None] & in_b[None, :]
        xb = tl.load(x_ptr + row_off * stride_xm + (cols - KA)[None, :], mask=b_mask, other=0.0).to(tl.float32)
        if PROLOGUE == 1:
            x = _round_to_src(_gelu(xb, APPROX), SRC_ROUND)
        else:  # xb is the gate; the up half starts K - KA columns on (3), or is a tensor of its own (4)
            if PROLOGUE == 3:
                up = tl.load(x_ptr + row_off * stride_xm + (K - 2 * KA + cols)[None, :], mask=b_mask, other=0.0)
            else:
                up = tl.load(shift_ptr + row_off * stride_sb + (cols - KA)[None, :], mask=b_mask, other=0.0)
            # torch's SiLU, x / (1 + e^-x); e^80 keeps the exponential finite where the quotient is 0 already
            silu = _round_to_src(xb / (1.0 + tl.exp(tl.minimum(-xb, 80.0))), SRC_ROUND)
            x = _round_to_src(silu * up.to(tl.float32), SRC_ROUND)
        if HAS_A:
            in_a = cols < KA
            xa = tl.load(aux_ptr + row_off * stride_am + cols[None, :], mask=row_ok[:, None] & in_a[None, :],
                         other=0.0)
            x = tl.where(in_a[None, :], xa.to(tl.float32), x)
    else:
        x = tl.load(x_ptr + row_off * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if NORM_RMS:  # torch's rms_norm: x * rsqrt(mean(x^2) + eps) (* weight), in fp32
            d = x
            rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / K + eps)
        else:
            mean = tl.sum(x, axis=1) / K
            d = tl.where(mask, x - mean[:, None], 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(d * d, axis=1) / K + eps)
        x = d * rstd[:, None]
        if NW_ROUNDED:  # torch's composite rms_norm: the normalized row rounded before the weight
            x = _round_to_src(x, SRC_ROUND)
        if HAS_NW:
            x = x * tl.load(nw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        x = _round_to_src(x, SRC_ROUND)
        if HAS_MULT or HAS_SHIFT:
            batch = (rows // rows_per_batch).to(tl.int64)[:, None]
            if HAS_MULT:
                mult = tl.load(aux_ptr + batch * stride_mb + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                x = x * mult
                if TWO_STEP:
                    if PTX:
                        x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                                      is_pure=True, pack=1)
                    x = _round_to_src(x, SRC_ROUND)
            if HAS_SHIFT:
                shift = tl.load(shift_ptr + batch * stride_sb + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                x = x + shift
            x = _round_to_src(x, SRC_ROUND)
    return tl.where(mask, x, 0.0)


@triton.jit
def _row_scales(amax, qmax, scale_ptr, rows, row_ok, BLOCK_M: tl.constexpr):
    """Store each row's scale ``max(amax, floor) / qmax`` and return ``qmax / max(amax, floor)``, both
    correctly rounded, as the reference computes them (``reference.ABSMAX_FLOOR``)."""
    amax = tl.maximum(amax, 1e-30)
    inv = tl.math.div_rn(tl.full((BLOCK_M,), 1.0, tl.float32) * qmax, amax)
    tl.store(scale_ptr + rows, tl.math.div_rn(amax, tl.full((BLOCK_M,), 1.0, tl.float32) * qmax), mask=row_ok)
    return inv


@triton.jit
def _permute_codes(q, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr, PERM_BLOCK: tl.constexpr,
                   PERM_RUN: tl.constexpr):
    """``q`` (``[BLOCK_M, WIDTH]``) with the columns of every ``PERM_BLOCK`` reordered as
    ``ops.permute_columns``: the even runs of ``PERM_RUN`` columns first, then the odd runs (in registers:
    stores stay wide). Run 1 keeps its own 4-D form: the same order, the code the kernels were measured with."""
    if PERM_RUN == 1:
        q = tl.reshape(q, (BLOCK_M, WIDTH // PERM_BLOCK, PERM_BLOCK // 2, 2))
        q = tl.reshape(tl.permute(q, (0, 1, 3, 2)), (BLOCK_M, WIDTH))
    else:
        q = tl.reshape(q, (BLOCK_M, WIDTH // PERM_BLOCK, PERM_BLOCK // (2 * PERM_RUN), 2, PERM_RUN))
        q = tl.reshape(tl.permute(q, (0, 1, 3, 2, 4)), (BLOCK_M, WIDTH))
    return q


@triton.jit
def _store_codes(q_ptrs, y, mask, OUT_FP8: tl.constexpr, PERM_BLOCK: tl.constexpr, PERM_RUN: tl.constexpr,
                 HW_FP8_CAST: tl.constexpr, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr):
    """Store ``y`` (code units, within qmax) as FP8 or INT8 codes, permuted for INT8 (:func:`_permute_codes`).
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
            q = _permute_codes(q, BLOCK_M, WIDTH, PERM_BLOCK, PERM_RUN)
        tl.store(q_ptrs, q, mask=mask)


@functools.lru_cache(maxsize=16)
def _rotation_factors(kind: str, group_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, float, bool]:
    """(±1 ``I ⊗ P`` 16×16, ±1 H16, 1/sqrt(G), whether the P stage is needed) as fp16 on ``device``."""
    if group_size < 16 or group_size > 256 or group_size & (group_size - 1):
        raise ValueError(f"the fused rotation supports Hadamard groups of 16..256 (a power of two), got {group_size}")
    q16 = hadamard_matrix(kind, 16) * 4.0
    outer = group_size // 16
    p = torch.ones(1, 1) if outer == 1 else hadamard_matrix(kind, outer) * outer**0.5
    pfull = torch.kron(torch.eye(256 // group_size), p)
    return (constant_tensor(pfull.round().to(device=device, dtype=torch.float16).contiguous()),
            constant_tensor(q16.round().to(device=device, dtype=torch.float16).contiguous()),
            1.0 / group_size**0.5, outer > 1)


@functools.lru_cache(maxsize=16)
def _dense_rotation(kind: str, group_size: int, device: torch.device) -> torch.Tensor:
    """±1 fp16 ``Pfull ⊗ H16`` (256×256): one super-block's whole rotation, for ``rotate_impl="dense"``."""
    pmat, qmat, _, _ = _rotation_factors(kind, group_size, device)
    return constant_tensor(torch.kron(pmat.float(), qmat.float()).to(torch.float16).contiguous())


def _pow2_at_least(value: int) -> int:
    return 1 << max(0, value - 1).bit_length()


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



@functools.lru_cache(maxsize=64)
def _no_mean(device: torch.device, m: int) -> torch.Tensor:
    """The ``[m, 0]`` mean of an uncentred call (no data: cached instead of allocated per call)."""
    return constant_tensor(torch.empty((m, 0), dtype=torch.float32, device=device))
