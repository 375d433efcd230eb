"""Triton: an INT8 or FP8 weight times a bf16 / fp16 activation, for few rows (W8A16).

With a few rows (Flux's, Qwen-Image's and Z-Image's per-block modulation linears see one a call at batch
1) a linear is bound by its weight's bytes: quantizing the activation saves nothing there, and its rounding
is most of such a layer's error. This kernel reads the activation as it is, converts each weight tile to the
activation's dtype in registers (exact: INT8 and e4m3 values are bf16 and fp16 values) and multiplies on the
tensor cores with fp32 sums::

    x'[m]     = rot(x[m] * smooth - mu[m])           (each step optional; mu[m] = mean_k(x[m, k] * smooth[k]))
    out[m, n] = sum_k round_in(x'[m, k]) * w[n, k] * w_scale[n] (+ mu[m] * rowsum[n]) (+ bias[n])

where the weight was quantized after a block Hadamard rotation (ConvRot, QuaRot), a first small launch
(``_rotate_rows_kernel``) rotates the activation (``_rotate_superblocks``, the act-quant kernel's own, with its
fp16 operands split in two: about 2^-22 of each super-block's maximum) and rounds it back to its dtype, to
nearest even. (Rotating inside the product, each program its own copy, took 2.5x as long at 3072 x 3072 on an
H200.) HadaNorm's column smoothing and per-token centring happen in the same launch, in fp32 before the
rotation, as the act-quant kernel does them; every program of a row sums the whole row for its mean (in one
order: the same bits in each), and the first writes it out for the product's epilogue, which adds the mean
back through the weight's stored row sums (``mu * rowsum``), as the quantized path's does.

This is what the ``dequant`` backend computes (the weight rounded as stored, the activation not quantized;
``reference.weight_only_reference``), without a dequantized copy of the weight; the scale is applied to the
fp32 sums instead of to each weight. One program owns ``BLOCK_M`` rows and ``BLOCK_N`` output channels and
loops over K in ``BLOCK_K`` steps. Products of e4m3 weights and a bf16 activation run in fp16 (``_dot_kind``):
each row of the activation tile is scaled by a power of two that puts its maximum in [2^14, 2^15), exact in
fp16 down to 2^-39 of that maximum, and the tile's fp32 sums are scaled back. On the CPU interpreter, whose bf16
products are wrong, INT8 products are formed in fp32 instead. Each product of an activation value and a weight
value is exact in fp32 on every path.

Not here: FP8 outlier columns, 4-bit weights (their linears keep their other candidates).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import interpreting
from .gemm_config import GemmConfig
from .launcher import TritonLauncher
from .reference import FP8
from .triton_act_quant_parts import ROTATE_IMPLS, SRC_ROUNDING, _rotate_superblocks, _rotation_operands, _round_to_src

INPUT_DTYPES = (torch.bfloat16, torch.float16)
WEIGHT_DTYPES = (torch.int8, FP8)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROTATE_SUPER_BLOCKS = 2  # 512 columns a program of the rotation kernel


@triton.jit
def _rotate_rows_kernel(x_ptr, y_ptr, smooth_ptr, mean_ptr, pmat_ptr, qmat_ptr, K, stride_xm, stride_ym, rot_norm,
                        SB: tl.constexpr, TWO_STAGE: tl.constexpr, ROT_IMPL: tl.constexpr, SRC_ROUND: tl.constexpr,
                        HAS_SMOOTH: tl.constexpr, CENTER: tl.constexpr, ROTATE: tl.constexpr,
                        ROUND_IN: tl.constexpr):
    """``SB`` 256-wide super-blocks of one row: smoothed, centred, rotated (each if asked), rounded to the output's
    dtype; with ``CENTER`` the row's mean of the smoothed values goes to ``mean_ptr[row]``."""
    CHUNK: tl.constexpr = SB * 256
    row = tl.program_id(1)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    cols = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ok = cols < K
    x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_SMOOTH:
        x = x * tl.load(smooth_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if CENTER:
        total = tl.zeros((CHUNK,), dtype=tl.float32)
        for k0 in range(0, K, CHUNK):  # the whole row, in the same order in every program of it
            ks = k0 + tl.arange(0, CHUNK)
            v = tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32)
            if HAS_SMOOTH:
                v = v * tl.load(smooth_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)
            total += v
        mean = tl.sum(total, axis=0) / K
        x = x - mean  # columns past K (whole rotation groups of their own) are never stored
        one = tl.arange(0, 1)
        tl.store(mean_ptr + row + one, tl.zeros((1,), dtype=tl.float32) + mean, mask=(one + tl.program_id(0)) == 0)
    if ROTATE:
        x = tl.reshape(_rotate_superblocks(tl.reshape(x, (SB, 256)), pmat_ptr, qmat_ptr, qmat_ptr, rot_norm, SB,
                                           TWO_STAGE, ROT_IMPL, True, ROUND_IN), (CHUNK,))
    y = _round_to_src(x, SRC_ROUND)  # exact in the output's dtype
    tl.store(y_ptr + row.to(tl.int64) * stride_ym + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, w_scale_ptr, bias_ptr, mean_ptr, rowsum_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
                  stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SCALE_PER_N: tl.constexpr, HAS_BIAS: tl.constexpr, SHIFT: tl.constexpr, DOT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT == 0:  # fp32 products (the interpreter)
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        elif DOT == 1:  # in the activation's dtype
            acc += tl.dot(x, tl.trans(w.to(x_ptr.dtype.element_ty)))
        else:  # fp16: each row scaled by a power of two to below 2^15 (exact), undone on the tile's fp32 sums
            xf = x.to(tl.float32)
            e = (tl.max(tl.abs(xf), axis=1).to(tl.int32, bitcast=True) >> 23) & 0xFF
            e = tl.minimum(tl.maximum(e, 15), 254)
            up = ((268 - e) << 23).to(tl.float32, bitcast=True)  # 2^(14 - E): the row maximum in [2^14, 2^15)
            down = ((e - 14) << 23).to(tl.float32, bitcast=True)  # 2^(E - 14)
            part = tl.dot((xf * up[:, None]).to(tl.float16), tl.trans(w.to(tl.float16)), out_dtype=tl.float32)
            acc += part * down[:, None]
    if SCALE_PER_N:
        acc = acc * tl.load(w_scale_ptr + cols, mask=col_ok, other=0.0)[None, :]
    else:
        acc = acc * tl.load(w_scale_ptr)
    if SHIFT:  # the centred-out mean, added back through the weight's row sums
        mean = tl.load(mean_ptr + rows, mask=row_ok, other=0.0)
        acc = acc + mean[:, None] * tl.load(rowsum_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def w8a16_problem(x2d: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype, rotation: str,
                  group_size: int, smooth: torch.Tensor | None = None,
                  center_rowsum: torch.Tensor | None = None) -> str | None:
    """Why :func:`w8a16_mm_triton` cannot take this call (``None`` when it can)."""
    if x2d.dtype not in INPUT_DTYPES:
        return f"the weight-only kernel takes bf16 or fp16 activations, got {x2d.dtype}"
    if weight.dtype not in WEIGHT_DTYPES:
        return f"the weight-only kernel takes INT8 or FP8 weights, got {weight.dtype}"
    if out_dtype not in OUT_DTYPES:
        return f"the weight-only kernel writes bf16, fp16 or fp32, not {out_dtype}"
    if rotation != "none" and not (16 <= group_size <= 256 and group_size & (group_size - 1) == 0):
        return f"the weight-only kernel rotates in Hadamard groups of 16..256 (a power of two), got {group_size}"
    for what, t, want in (("smoothing multiplier", smooth, x2d.shape[1]), ("centring row sums", center_rowsum,
                                                                           weight.shape[0])):
        if t is not None and (t.numel() != want or not t.is_contiguous()):
            return f"the weight-only kernel needs the {what} as {want} contiguous values, got {tuple(t.shape)}"
    return None


def w8a16_mm_triton(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                    out_dtype: torch.dtype, config: GemmConfig, rotation: str = "none", group_size: int = 0,
                    out: torch.Tensor | None = None, smooth: torch.Tensor | None = None,
                    center_rowsum: torch.Tensor | None = None) -> torch.Tensor:
    """``[M, K]`` bf16/fp16 ``x`` times an INT8 / e4m3 ``weight`` ``[N, K]`` with fp32 ``w_scale`` ``[N]`` or one
    value: ``[M, N]`` in ``out_dtype`` (see the module docstring). ``x`` and ``weight`` need unit column strides.
    ``smooth`` (fp32 ``[K]``) and ``center_rowsum`` (fp32 ``[N]``: centre each row, add its mean back times these)
    are HadaNorm's. ``out`` (tests: a poisoned buffer) receives the result when given."""
    return w8a16_launches(x, weight, w_scale, bias, out_dtype, config, rotation, group_size, out, smooth,
                          center_rowsum)[-1]


def w8a16_launches(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                   out_dtype: torch.dtype, config: GemmConfig, rotation: str = "none", group_size: int = 0,
                   out: torch.Tensor | None = None, smooth: torch.Tensor | None = None,
                   center_rowsum: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """:func:`w8a16_mm_triton`'s launches; the tensors they allocated, in order: the prepared activation (rotated,
    smoothed or centred products only), the row means (centred products only), then the output."""
    m, k = x.shape
    n = weight.shape[0]
    center = center_rowsum is not None
    made, mean = (), None
    if (rotation != "none" or smooth is not None or center) and m and k:
        x, mean = prepare_rows_triton(x, rotation, group_size, smooth, center)
        made = (x,) if mean is None else (x, mean)
    out = torch.empty((m, n), dtype=out_dtype, device=x.device) if out is None else out
    if m == 0 or n == 0:
        return (*made, out)
    grid = (-(-n // config.block_n), -(-m // config.block_m))
    _KERNEL.launch(grid, (x, weight, w_scale, bias if bias is not None else w_scale,
                          mean if center else w_scale, center_rowsum if center else w_scale, out, m, n, k,
                          x.stride(0), weight.stride(0), out.stride(0)),
                   dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                        SCALE_PER_N=w_scale.numel() != 1, HAS_BIAS=bias is not None, SHIFT=center,
                        DOT=_dot_kind(x, weight)),
                   num_warps=config.num_warps, num_stages=config.num_stages)
    return (*made, out)


def rotate_rows_triton(x: torch.Tensor, rotation: str, group_size: int, super_blocks: int = ROTATE_SUPER_BLOCKS
                       ) -> torch.Tensor:
    """``x`` ``[M, K]`` (unit column stride) times ``blockdiag(H_G)``, rounded to ``x``'s dtype to nearest even:
    a new ``[M, K]`` tensor. ``super_blocks`` 256-wide super-blocks a program (a power of two)."""
    return prepare_rows_triton(x, rotation, group_size, super_blocks=super_blocks)[0]


def prepare_rows_triton(x: torch.Tensor, rotation: str, group_size: int, smooth: torch.Tensor | None = None,
                        center: bool = False, super_blocks: int = ROTATE_SUPER_BLOCKS
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``rot(x * smooth - mu)`` (each step optional; ``rotation`` ``"none"`` skips the rotation), computed in fp32 and
    rounded to ``x``'s dtype to nearest even, and the fp32 row means ``mu`` ``[M]`` (``None`` without ``center``)."""
    m, k = x.shape
    y = torch.empty((m, k), dtype=x.dtype, device=x.device)
    mean = torch.empty((m,), dtype=torch.float32, device=x.device) if center else None
    rotate = rotation != "none"
    if rotate:
        pmat, qmat, _, rot_norm, two_stage = _rotation_operands(rotation, group_size, "batched", x.device, x)
    else:  # unused operands
        pmat = qmat = x
        rot_norm, two_stage = 1.0, False
    _ROTATE.launch((-(-k // (256 * super_blocks)), m),
                   (x, y, smooth if smooth is not None else x, mean if center else x, pmat, qmat, k, x.stride(0),
                    y.stride(0), rot_norm),
                   dict(SB=super_blocks, TWO_STAGE=two_stage, ROT_IMPL=ROTATE_IMPLS["batched"],
                        SRC_ROUND=_src_rounding(x), HAS_SMOOTH=smooth is not None, CENTER=center, ROTATE=rotate,
                        ROUND_IN=smooth is not None or center),
                   num_warps=4)
    return y, mean


def _dot_kind(x: torch.Tensor, weight: torch.Tensor) -> int:
    """The kernel's ``DOT``: 2 (fp16 operands, rows scaled) for e4m3 weights and a bf16 activation, whose products
    in bf16 would first convert the weight through fp16 (the H200 took a quarter longer than for INT8 weights);
    else 0 (fp32 products) in the interpreter, 1 (the activation's dtype) on a GPU."""
    if weight.dtype == FP8 and x.dtype == torch.bfloat16:
        return 2
    return 0 if interpreting() else 1


def _src_rounding(x: torch.Tensor) -> int:
    """How the kernel rounds the rotated activation back to ``x``'s dtype (the interpreter's bf16 cast truncates)."""
    if x.dtype == torch.float16:
        return SRC_ROUNDING["fp16"]
    return SRC_ROUNDING["bf16" if x.is_cuda and not interpreting() else "bf16_by_hand"]


_KERNEL = TritonLauncher(_w8a16_kernel)
_ROTATE = TritonLauncher(_rotate_rows_kernel)
