"""FP8 (e4m3) row-wise W8A8 linear: per-token activation scale × per-channel weight scale.

:func:`fp8_rowwise_linear` runs through the measured dispatcher: our fused Triton act-quant +
FP8 GEMM, or our act-quant + ``torch._scaled_mm`` with row-wise scales, whichever is faster per
shape on this GPU. Without FP8 tensor cores (CPU, sm < 8.9) the product is emulated exactly (fp8
codes are exact in fp32), so CPU results match the GPU up to accumulation order.
"""

from __future__ import annotations

import torch

from .reference import FP8, FP8_MAX
from .w8a8_linear import w8a8_linear_fast

__all__ = ["FP8", "FP8_MAX", "quantize_fp8_rowwise", "fp8_rowwise_linear"]


def quantize_fp8_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes and fp32 ``[..., 1]`` scales, one per row (abs-max / 448)."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    codes = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale


def _has_fp8_tensor_cores(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_rowwise_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, *,
                       rotation: str = "none", group_size: int = 0) -> torch.Tensor:
    """``x @ (weight * weight_scale).T + bias`` with ``x`` quantized per token to e4m3.

    ``weight``: float8_e4m3fn ``[N, K]``; ``weight_scale``: fp32 ``[N, 1]``. ``rotation`` /
    ``group_size`` as in :func:`lowbit.kernels.int8_gemm.int8_linear` (default: none).
    """
    out_dtype = out_dtype or x.dtype
    if x.dim() == 2:
        return w8a8_linear_fast("fp8_rowwise", x, weight, weight_scale, bias, out_dtype, rotation, group_size)
    out = w8a8_linear_fast("fp8_rowwise", x.reshape(-1, x.shape[-1]), weight, weight_scale, bias, out_dtype,
                           rotation, group_size)
    return out.reshape(*x.shape[:-1], weight.shape[0])
