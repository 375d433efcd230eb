"""Triton: the q, k and v of a joint (text + image) attention, made from the projections in one pass.

A dual-stream DiT (Qwen-Image) projects each stream to ``q``, ``k``, ``v`` of ``[B, S, H * D]``, then, per stream,
views them as heads (``[B, H, S, D]``, a copy for ``q`` and ``k``), applies a per-head RMSNorm to ``q`` and ``k``,
concatenates the streams along the sequence (a copy of each of the three), and rotates ``q`` and ``k`` (RoPE, a
read and a write more). This kernel reads each projection once and writes its heads into the joint tensors at
the stream's rows, normalized and rotated: one launch per stream instead of about a dozen, a read and a write per
element instead of three to five.

The definition is :func:`kernels.reference.joint_qkv_reference`. Per row of ``D``::

    y = rint_dtype(x * rsqrt(mean(x^2) + eps) * weight)    (norm in fp32, its weight where it has one, rounded)
    out[2i]   = f[i, 0, 0] * y[2i] + f[i, 0, 1] * y[2i + 1]      (RoPE: ``freqs[b, 0, row, i]``, in fp32)
    out[2i+1] = f[i, 1, 0] * y[2i] + f[i, 1, 1] * y[2i + 1]

``D`` must be a power of two from 16 to 256. Rows past the stream's length are neither read nor written.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .launcher import TritonLauncher
from .triton_act_quant import _src_rounding
from .triton_act_quant_parts import _round_to_src

BLOCK_S = 16  # token rows a program
HEADS_PER_PROGRAM = 4
NUM_WARPS = 8


@triton.jit
def _norm_rows(x, w_ptr, eps, NORM: tl.constexpr, AFFINE: tl.constexpr, D: tl.constexpr, ROUND: tl.constexpr):
    xf = x.to(tl.float32)
    if NORM:
        r = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / D + eps)
        xf = xf * r[:, None]
        if AFFINE:
            xf = xf * tl.load(w_ptr + tl.arange(0, D)).to(tl.float32)[None, :]
        xf = _round_to_src(xf, ROUND)
    return xf


@triton.jit
def _rotate_rows(y, f00, f01, f10, f11, BLOCK: tl.constexpr, D: tl.constexpr):
    even, odd = tl.split(tl.reshape(y, (BLOCK, D // 2, 2)))
    return tl.reshape(tl.join(f00 * even + f01 * odd, f10 * even + f11 * odd), (BLOCK, D))


@triton.jit
def _joint_qkv_kernel(q_in, k_in, v_in, q_w, k_w, freqs, q_out, k_out, v_out,
                      S, H, row0, stride_qb, stride_qs, stride_kb, stride_ks, stride_vb, stride_vs,
                      stride_ob, stride_oh, stride_os, stride_fb, stride_fs, eps_q, eps_k,
                      NORM_Q: tl.constexpr, NORM_K: tl.constexpr, AFFINE_Q: tl.constexpr, AFFINE_K: tl.constexpr,
                      ROPE: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, HEADS: tl.constexpr,
                      ROUND: tl.constexpr):
    b = tl.program_id(1)
    offs_s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = (offs_s < S)[:, None]
    rows = offs_s[:, None].to(tl.int64)
    offs_d = tl.arange(0, D)[None, :]
    f00 = 0.0
    f01 = 0.0
    f10 = 0.0
    f11 = 0.0
    if ROPE:
        fp = freqs + b.to(tl.int64) * stride_fb + (row0 + rows) * stride_fs + tl.arange(0, D // 2)[None, :] * 4
        f00 = tl.load(fp, mask=mask, other=0.0).to(tl.float32)
        f01 = tl.load(fp + 1, mask=mask, other=0.0).to(tl.float32)
        f10 = tl.load(fp + 2, mask=mask, other=0.0).to(tl.float32)
        f11 = tl.load(fp + 3, mask=mask, other=0.0).to(tl.float32)
    out_rows = b.to(tl.int64) * stride_ob + (row0 + rows) * stride_os + offs_d
    h0 = tl.program_id(2) * HEADS
    for h in range(h0, tl.minimum(h0 + HEADS, H)):
        cols = h * D + offs_d
        out = out_rows + h * stride_oh
        x = tl.load(q_in + b.to(tl.int64) * stride_qb + rows * stride_qs + cols, mask=mask, other=0.0)
        y = _norm_rows(x, q_w, eps_q, NORM_Q, AFFINE_Q, D, ROUND)
        if ROPE:
            y = _round_to_src(_rotate_rows(y, f00, f01, f10, f11, BLOCK, D), ROUND)
        tl.store(q_out + out, y.to(q_out.dtype.element_ty), mask=mask)
        x = tl.load(k_in + b.to(tl.int64) * stride_kb + rows * stride_ks + cols, mask=mask, other=0.0)
        y = _norm_rows(x, k_w, eps_k, NORM_K, AFFINE_K, D, ROUND)
        if ROPE:
            y = _round_to_src(_rotate_rows(y, f00, f01, f10, f11, BLOCK, D), ROUND)
        tl.store(k_out + out, y.to(k_out.dtype.element_ty), mask=mask)
        x = tl.load(v_in + b.to(tl.int64) * stride_vb + rows * stride_vs + cols, mask=mask, other=0.0)
        tl.store(v_out + out, x.to(v_out.dtype.element_ty), mask=mask)


_LAUNCHER = TritonLauncher(_joint_qkv_kernel)


def joint_qkv_part_triton(part, row0: int, heads: int, freqs, q_out, k_out, v_out) -> None:
    """Write one stream's ``part`` (a :class:`kernels.joint_heads.JointPart`) into the joint ``[B, H, S, D]``
    outputs at rows ``row0 ..``; ``freqs`` is ``[Bf, 1, Sf, D / 2, 2, 2]`` with ``Bf`` 1 or ``B`` and ``Sf`` 1 or at
    least the joint length, or ``None`` (no rotation). The caller has checked the shapes."""
    q, k, v = part.q, part.k, part.v
    batch, seq, _ = q.shape
    if seq == 0 or batch == 0:
        return
    d = q_out.shape[-1]
    rope = freqs is not None
    stride_fb = stride_fs = 0
    if rope:
        stride_fb = freqs.stride(0) if freqs.shape[0] > 1 else 0
        stride_fs = freqs.stride(2) if freqs.shape[2] > 1 else 0
    block, group = BLOCK_S, HEADS_PER_PROGRAM
    grid = (triton.cdiv(seq, block), batch, triton.cdiv(heads, group))
    _LAUNCHER.launch(grid,
                     (q, k, v, q if part.q_weight is None else part.q_weight,
                      k if part.k_weight is None else part.k_weight, freqs if rope else q,
                      q_out, k_out, v_out, seq, heads, row0,
                      q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                      q_out.stride(0), q_out.stride(1), q_out.stride(2), stride_fb, stride_fs,
                      float(part.q_eps), float(part.k_eps)),
                     dict(NORM_Q=part.q_norm, NORM_K=part.k_norm, AFFINE_Q=part.q_weight is not None,
                          AFFINE_K=part.k_weight is not None, ROPE=rope, D=d, BLOCK=block,
                          HEADS=group, ROUND=_src_rounding(q)),
                     num_warps=NUM_WARPS, num_stages=1)
