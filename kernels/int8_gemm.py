"""W8A8 INT8 linear: per-token dynamic activation quantization × INT8 weight with per-row scale.

:func:`int8_linear` runs through the measured dispatcher (``kernels/dispatch.py``), which picks
per shape among our fused Triton kernels, comfy-kitchen's ``int8_linear``, ``torch._int_mm`` and
dequantize + float matmul. The rotation formats pass their pre-processing as keywords, so the
rotation (and HadaNorm's smoothing and centring) is fused into the activation-quantization kernel
instead of running as separate torch ops.
"""

from __future__ import annotations

import torch

import comfy_kitchen as ck

from .w8a8_linear import w8a8_linear_fast


def quantize_int8_rowwise(x: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """INT8 codes and fp32 ``[..., 1]`` scales, one scale per row (abs-max / 127)."""
    return ck.quantize_int8_rowwise(x, stochastic_rounding=seed)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, *,
                rotation: str = "none", group_size: int = 0, smooth: torch.Tensor | None = None,
                center_rowsum: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight * weight_scale).T + bias`` with ``x`` quantized per token to INT8.

    ``x``: float ``[..., K]``; ``weight``: int8 ``[N, K]``; ``weight_scale``: fp32 ``[N, 1]`` or scalar.

    Keywords (default: none of them) describe how the weight was made, and are applied to ``x``
    inside the fused quantization kernel: ``rotation`` ``"regular"`` (ConvRot) or ``"sylvester"``
    (QuaRot) in groups of ``group_size``; ``smooth`` (``[K]``) multiplies ``x``; ``center_rowsum``
    (``[N]``, the row sums of the smoothed weight) centres each token and adds ``mean * rowsum``
    back (HadaNorm).
    """
    out_dtype = out_dtype or x.dtype
    if x.dim() == 2:
        return w8a8_linear_fast("int8", x, weight, weight_scale, bias, out_dtype, rotation, group_size, smooth,
                                center_rowsum)
    out = w8a8_linear_fast("int8", x.reshape(-1, x.shape[-1]), weight, weight_scale, bias, out_dtype, rotation,
                           group_size, smooth, center_rowsum)
    return out.reshape(*x.shape[:-1], weight.shape[0])
