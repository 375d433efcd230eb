"""A W8A8 linear written as plain torch ops, for ``torch.compile`` to trace and fuse.

:func:`w8a8_linear_traced` quantizes the activation per token with the arithmetic of
``reference.act_quant_reference`` (no rotation, smoothing or centring) as ordinary torch ops, and
leaves only the GEMM opaque: ``lowbit::w8a8_mm`` with ``impl="auto"`` (``kernels/gemm_auto.py``).
Inside a compiled graph, inductor then fuses the abs-max and the quantization into the kernel that
produced the activation (LayerNorm + modulation, GELU, a cat...), which writes the codes and the
per-token scales directly instead of a bf16 activation that a separate act-quant kernel re-reads.

Only for use while tracing: in eager mode these ops would be slower than the fused act-quant kernel.
The codes are those of the reference (INT8: round half to even; FP8: e4m3 round-to-nearest-even),
so a traced layer computes what the eager one computes up to how its compiler evaluates the same
fp32 expressions.
"""

from __future__ import annotations

import torch

from . import ops
from .reference import ABSMAX_FLOOR, FP8, FP8_MAX, INT8_MAX


def act_quant_traced(x2d: torch.Tensor, code_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token codes ``[M, K]`` (int8 or float8_e4m3fn) and fp32 scales ``[M, 1]`` of ``x2d``, as
    ``act_quant_reference(x2d, code_dtype)`` computes them, in ops a compiler can fuse."""
    if code_dtype not in (torch.int8, FP8):
        raise ValueError(f"act_quant_traced makes int8 or float8_e4m3fn codes, got {code_dtype}")
    qmax = FP8_MAX if code_dtype == FP8 else INT8_MAX
    xf = x2d.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=ABSMAX_FLOOR)
    # a true division, as the reference (``qmax / amax`` is a reciprocal times qmax: another rounding)
    inv = torch.full_like(amax, qmax) / amax
    scale = amax / qmax
    y = xf * inv
    if code_dtype == FP8:
        q = y.clamp(-qmax, qmax).to(FP8)
    else:
        q = torch.round(y).clamp(-qmax, qmax).to(torch.int8)
    return q, scale


def w8a8_linear_traced(x2d: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``x2d @ (weight * weight_scale).T + bias`` ``[M, N]`` with ``x2d`` ``[M, K]`` quantized per token
    to ``weight``'s code dtype by traceable ops, and the GEMM as ``lowbit::w8a8_mm(impl="auto")``.

    ``weight``: int8 or float8_e4m3fn ``[N, K]`` (e4m3 may come as its ``uint8`` bytes: torch's CPU
    kernels cannot compare or copy float8 tensors, which custom-op checks do); ``weight_scale``: fp32
    ``[N]``, ``[N, 1]`` or one value. FP8 codes go to the op as bytes too.
    """
    code_dtype = FP8 if weight.dtype in (FP8, torch.uint8) else weight.dtype
    if code_dtype not in (torch.int8, FP8):
        raise ValueError(f"w8a8_linear_traced: the weight must be int8 or float8_e4m3fn codes, got {weight.dtype}")
    if x2d.shape[-1] != weight.shape[1]:
        raise ValueError(f"w8a8_linear_traced: input has {x2d.shape[-1]} features but the weight expects "
                         f"{weight.shape[1]}")
    q, scale = act_quant_traced(x2d, code_dtype)
    if code_dtype == FP8:
        q, weight = q.view(torch.uint8), weight.view(torch.uint8)
    return ops.w8a8_mm(q, weight, scale, weight_scale.reshape(-1).float(), bias, None, None, out_dtype, "auto")
