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

Variants of the rotated path (``act_quant_triton(rotate_impl=..., split=...)``; the defaults were
chosen by ``tests/gpu/bench_act_quant.py`` on an H200, see ``DEFAULT_ROTATE_IMPL``;
``tests/gpu/sass_act_quant.py`` shows their sm_90 registers and instructions without a GPU; the
device functions they share are in ``triton_act_quant_parts.py``):

* ``rotate_impl`` "batched": each 256-wide super-block scaled by its own power of two (accuracy
  relative to the super-block's maximum, at most the row's), the ``P`` stage a batched ``P^T W``
  product with ``P`` broadcast per super-block (no permutes); "tf32": the same with tf32 operands
  (fp32 range, so no scaling at all; bf16 / fp16 input is exact in tf32, anything else and the ``P``
  stage's operand are rounded to tf32 – 11 significant bits, as fp16); "dense": one 256×256 product.
* ``split`` "pieces" (``triton_act_quant_split.py``): whole rows as up to four power-of-two pieces over
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

from .backend import interpreting
from .launcher import TritonLauncher
from .prologue import PROLOGUES, GeluPrologue, SwigluPrologue
from .reference import FP8
from .triton_act_quant_parts import (GELU_APPROXIMATIONS, ROTATE_IMPLS, SRC_ROUNDING, _dot_fp16, _no_mean,
                                     _permute_codes,
                                     _pow2_at_least, _prologue_rows, _rotate_superblocks, _rotation_operands, _round_in,
                                     _round_to_e4m3, _rint, _row_scales)
from .triton_act_quant_split import act_quant_split, check_permutation

MAX_BLOCK_K = 32768  # rows wider than this use the eager reference
TILE_ELEMENTS = 8192  # BLOCK_M * BLOCK_K per program (registers: 8192 fp32 over 4-16 warps)
# Rotated rows, measured on an H200 (tests/gpu/bench_act_quant.py, M = 4096, INT8 codes, regular 256):
# "batched" with "pieces" took 20.2 / 73.3 us at K = 3072 / 12288 (the original 23.7 / 91.1), but
# 117 us at K = 15360 (four pieces), where "batched" over the padded row took 84 us (original 93).
DEFAULT_ROTATE_IMPL = "batched"
ROW_SPLITS = ("pow2", "pieces", "chunks")  # how a program holds its rows (see act_quant_triton)
# Rows of at most two power-of-two pieces (3072 = 2048 + 1024, 12288 = 8192 + 4096) go unpadded ("pieces"),
# rotated or not; wider ones (3+ pieces: slower) padded ("pow2"); outlier columns always "pow2". Rotated rows: measured
# on an H200 (tests/gpu/bench_act_quant.py). Rows without rotation since Session 44, on an H100
# (tests/gpu/probe_act_quant_small_m.py, CUDA-graph time, input warm in L2): the pieces at the default warps
# (triton_act_quant_split._pieces_launch_shape) took 2.5 / 3.6 / 4.6 / 10.0 us at K = 3072 and M = 256 / 1024 /
# 2048 / 4096 against 2.6 / 4.1 / 6.0 / 11.7 for the padded row, and 3.8 / 10.3 / 26.5 / 52.1 against 4.4 / 14.1 /
# 30.3 / 55.6 at K = 12288. (At M = 4096, K = 3072 on an H200 with the input read from memory, Session 10's pieces at
# 4 warps were 5 % slower than the padded row.)
DEFAULT_SPLIT = "pieces"


def default_split(k: int) -> str:
    """The row split used when none is asked for: :data:`DEFAULT_SPLIT` for rows of at most two power-of-two
    pieces, rotated or not, else the padded row (``"pow2"``)."""
    return DEFAULT_SPLIT if bin(k).count("1") <= 2 else "pow2"


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, scale_ptr, mean_ptr, smooth_ptr, pmat_ptr, qmat_ptr, hmat_ptr, outlier_ptr, aux_ptr, shift_ptr,
    nw_ptr, M, K, R, stride_xm, stride_qm, qmax, rot_norm, KA, stride_am, rows_per_batch, stride_mb, stride_sb, eps,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_SMOOTH: tl.constexpr, CENTER: tl.constexpr, ROTATE: tl.constexpr, TWO_STAGE: tl.constexpr,
    ROT_IMPL: tl.constexpr, PRECISE: tl.constexpr, ROUND_IN: tl.constexpr,
    OUT_FP8: tl.constexpr, PERM_BLOCK: tl.constexpr, PERM_RUN: tl.constexpr, R_BLOCK: tl.constexpr,
    HW_FP8_CAST: tl.constexpr,
    PROLOGUE: tl.constexpr, APPROX: tl.constexpr, HAS_A: tl.constexpr, HAS_MULT: tl.constexpr,
    HAS_SHIFT: tl.constexpr, SRC_ROUND: tl.constexpr, NORM_RMS: tl.constexpr, HAS_NW: tl.constexpr,
    TWO_STEP: tl.constexpr, NW_ROUNDED: tl.constexpr, PTX: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < K
    mask = row_ok[:, None] & col_ok[None, :]
    if PROLOGUE == 0:
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
    else:  # the input computed from its sources (kernels/prologue.py), never stored
        x = _prologue_rows(x_ptr, aux_ptr, shift_ptr, nw_ptr, rows, cols, row_ok, K, KA, stride_xm, stride_am,
                           rows_per_batch, stride_mb, stride_sb, eps, PROLOGUE, APPROX, HAS_A, HAS_MULT, HAS_SHIFT,
                           SRC_ROUND, NORM_RMS, HAS_NW, TWO_STEP, NW_ROUNDED, PTX)
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
    inv = _row_scales(tl.max(tl.abs(x), axis=1), qmax, scale_ptr, rows, row_ok, BLOCK_M)
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
        if PERM_BLOCK > 0:  # even runs, then odd runs, within each PERM_BLOCK columns
            q = _permute_codes(q, BLOCK_M, BLOCK_K, PERM_BLOCK, PERM_RUN)
        tl.store(q_ptrs, q, mask=mask)


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


@functools.lru_cache(maxsize=256)  # on every rotated call (the default is a variant): checked once per combination
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
                     precise_fp8: bool = True, max_registers: int | None = None, perm_run: int = 1,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton version of :func:`lowbit.kernels.reference.act_quant_reference` for a 2-D ``x``.

    ``x`` may instead be a prologue (``kernels/prologue.py``: ``[a | gelu(b)]``, ``[a | silu(gate) * up]`` or
    ``shift + layer_norm(x) * mult``): the rows are computed from its sources in registers and quantized as
    ``prologue.materialize()`` would be (the ``"pow2"`` split, no outlier columns).

    ``perm_block`` (INT8 codes): the columns of every ``perm_block`` come reordered as
    ``ops.permute_columns(codes, perm_block, perm_run)`` (the order a W4 GEMM's planes take).

    ``out`` (tests: a poisoned buffer) receives the codes when given; ``tile_elements`` and
    ``num_warps`` override the program size (benchmark sweeps). ``outlier_index`` (int32 ``[r]``,
    FP8 without pre-processing only): the codes are ``[M, K + 2r]`` as
    :func:`lowbit.kernels.reference.act_quant_outliers_reference` (``None``: no extra work).

    Variants (benchmark sweeps; every one meets the same accuracy contract), ``None`` = the defaults
    :data:`DEFAULT_ROTATE_IMPL` and :func:`default_split` (``"pow2"`` with outlier columns, which only that
    kernel writes):

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
    prologue = x if isinstance(x, PROLOGUES) else None
    m, k = x.shape
    if prologue is not None:
        x = prologue.source
        if split not in (None, "pow2") or outlier_index is not None:
            raise ValueError("a prologue input is quantized by the split='pow2' kernel, without outlier columns")
        split = "pow2"
    if x.stride(-1) != 1:
        x = x.contiguous()
    rotate = rotation != "none"
    if tile_elements is None:  # measured on H200: 4096-element programs of 4 warps, rotated or not
        tile_elements = TILE_ELEMENTS // 2
    rotate_impl = DEFAULT_ROTATE_IMPL if rotate_impl is None else rotate_impl
    if split is None:
        split = "pow2" if outlier_index is not None else default_split(k)
    if rotate_impl != "permute" or split != "pow2":
        _check_variant(rotate_impl, split, chunk, rotate, perm_block, outlier_index is not None)
    if split != "pow2":
        return act_quant_split(x, out_dtype, qmax, rotation, group_size, smooth, center, perm_block, out,
                                tile_elements, num_warps, rotate_impl, split, chunk, num_stages, precise_fp8,
                                max_registers, perm_run)
    block_m, block_k, num_warps, programs = _launch_shape(m, k, rotate, tile_elements, num_warps)
    if rotate_impl == "dense" and rotate and block_m * block_k < 4096:
        raise ValueError(f"rotate_impl='dense' needs at least 16 super-blocks a program (tile_elements >= 4096), "
                         f"got {block_m} rows of {block_k}")
    check_permutation(k, perm_block, perm_run, out_dtype)
    r = 0 if outlier_index is None else outlier_index.numel()
    if r and (out_dtype != FP8 or rotate or center or smooth is not None or perm_block):
        raise ValueError("outlier columns are for FP8 codes without smoothing, centring, rotation or permutation")
    if r and (outlier_index.dtype != torch.int32 or outlier_index.device != x.device):
        raise ValueError(f"outlier_index must be int32 on {x.device}, got {outlier_index.dtype} on {outlier_index.device}")
    q = torch.empty((m, k + 2 * r), dtype=out_dtype, device=x.device) if out is None else out
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    mean = torch.empty((m, 1), dtype=torch.float32, device=x.device) if center else _no_mean(x.device, m)
    if m == 0:
        return q, scale, mean
    pmat, qmat, hmat, norm, two_stage = _rotation_operands(rotation, group_size, rotate_impl, x.device, scale)
    pro_args, pro_flags = _prologue_arguments(prologue, scale)
    _LAUNCHER.launch(
        (programs,),
        (x, q, scale, mean, smooth if smooth is not None else scale, pmat, qmat, hmat,
         outlier_index if r else scale, *pro_args[:3], m, k, r, x.stride(0), q.stride(0), float(qmax), float(norm),
         *pro_args[3:]),
        dict(BLOCK_M=block_m, BLOCK_K=block_k, HAS_SMOOTH=smooth is not None, CENTER=center, ROTATE=rotate,
             TWO_STAGE=two_stage, ROT_IMPL=ROTATE_IMPLS[rotate_impl], PRECISE=out_dtype == FP8 and precise_fp8,
             ROUND_IN=_round_in(x, smooth, center), OUT_FP8=out_dtype == FP8, PERM_BLOCK=perm_block,
             PERM_RUN=perm_run, R_BLOCK=max(16, _pow2_at_least(r)) if r else 0,
             HW_FP8_CAST=x.is_cuda and not interpreting(),
             **pro_flags, PTX=x.is_cuda and not interpreting() and torch.version.hip is None),
        **(dict(num_warps=num_warps) if max_registers is None else dict(num_warps=num_warps, maxnreg=max_registers)),
    )
    return q, scale, mean


def _src_rounding(t: torch.Tensor) -> int:
    if t.dtype == torch.bfloat16:
        return SRC_ROUNDING["bf16" if t.is_cuda and not interpreting() else "bf16_by_hand"]
    return SRC_ROUNDING["fp16" if t.dtype == torch.float16 else "fp32"]


def _unit_columns(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _prologue_arguments(prologue, unused: torch.Tensor) -> tuple[tuple, dict]:
    """The kernel's prologue arguments: ``(aux, shift, norm weight, KA, stride_am, rows_per_batch, stride_mb,
    stride_sb, eps)`` and the constexpr flags (all off without a prologue)."""
    flags = dict(PROLOGUE=0, APPROX=0, HAS_A=False, HAS_MULT=False, HAS_SHIFT=False, SRC_ROUND=0, NORM_RMS=False,
                 HAS_NW=False, TWO_STEP=False, NW_ROUNDED=False)
    if prologue is None:
        return (unused, unused, unused, 0, 0, 1, 0, 0, 0.0), flags
    if isinstance(prologue, (GeluPrologue, SwigluPrologue)):  # [a | gelu(b)] or [a | silu(gate) * up]
        a = _unit_columns(prologue.a)
        gelu = isinstance(prologue, GeluPrologue)
        up = None if gelu else _unit_columns(prologue.up)  # a SwiGLU's up given apart: the shift slot (PROLOGUE 4)
        flags.update(PROLOGUE=1 if gelu else 3 if up is None else 4,
                     APPROX=GELU_APPROXIMATIONS[prologue.approximate] if gelu else 0,
                     HAS_A=a is not None, SRC_ROUND=_src_rounding(prologue.source))
        return ((unused if a is None else a, unused if up is None else up, unused, 0 if a is None else a.shape[1],
                 0 if a is None else a.stride(0), 1, 0, 0 if up is None else up.stride(0), 0.0), flags)
    mult, shift, weight = _unit_columns(prologue.mult), _unit_columns(prologue.shift), prologue.weight

    def batch_stride(t):
        return 0 if t is None or t.shape[0] == 1 else t.stride(0)
    flags.update(PROLOGUE=2, HAS_MULT=mult is not None, HAS_SHIFT=shift is not None,
                 SRC_ROUND=_src_rounding(prologue.x), NORM_RMS=bool(prologue.rms), HAS_NW=weight is not None,
                 TWO_STEP=bool(prologue.two_step) and mult is not None and shift is not None,
                 NW_ROUNDED=bool(prologue.round_before_weight) and weight is not None)
    return ((unused if mult is None else mult, unused if shift is None else shift,
             unused if weight is None else weight, 0, 0, max(1, prologue.rows_per_batch), batch_stride(mult),
             batch_stride(shift), float(prologue.eps)), flags)


_LAUNCHER = TritonLauncher(_act_quant_kernel)
