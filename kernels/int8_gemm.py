"""W8A8 INT8 linear: per-token dynamic activation quantization × INT8 weight with per-row scale.

The reference path is comfy-kitchen's ``int8_linear`` (its eager backend on CPU, its CUDA/Triton
backends on GPU). Our own Triton kernels and the measured dispatcher plug in here.
"""

from __future__ import annotations

import torch

import comfy_kitchen as ck


def quantize_int8_rowwise(x: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """INT8 codes and fp32 ``[..., 1]`` scales, one scale per row (abs-max / 127)."""
    return ck.quantize_int8_rowwise(x, stochastic_rounding=seed)


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ (weight * weight_scale).T + bias`` with ``x`` quantized per token to INT8.

    ``x``: float ``[..., K]``; ``weight``: int8 ``[N, K]``; ``weight_scale``: fp32 ``[N, 1]`` or scalar.
    """
    out_dtype = out_dtype or x.dtype
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    out = ck.int8_linear(x2d, weight.contiguous(), weight_scale, bias, out_dtype)
    return out.reshape(*x.shape[:-1], weight.shape[0])
