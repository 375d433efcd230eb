"""FP8 (e4m3) row-wise W8A8 linear: per-token activation scale × per-channel weight scale.

:func:`fp8_rowwise_linear` runs through the measured dispatcher: our fused Triton act-quant +
FP8 GEMM, or our act-quant + ``torch._scaled_mm`` with row-wise scales, whichever is faster per
shape on this GPU. Without FP8 tensor cores (CPU, sm < 8.9) the product is emulated exactly (fp8
codes are exact in fp32), so CPU results match the GPU up to accumulation order.

Outlier channels (``outlier_index``, int32 ``[r]``): the weight is stored ``[N, K + 2r]`` as
``[w | w[:, O] | w_lo[:, O]]`` (:func:`quantize_fp8_rowwise_outliers`) and the activation codes get
``[x | x_lo[:, O] | x[:, O]]`` from the fused act-quant kernel, so the same FP8 GEMM over ``K + 2r``
columns gives both operands a second e4m3 term on those channels (see ``reference.py``).
"""

from __future__ import annotations

import torch

from .reference import FP8, FP8_MAX, fp8_outlier_split
from .w8a8_linear import w8a8_linear_fast

__all__ = ["FP8", "FP8_MAX", "quantize_fp8_rowwise", "quantize_fp8_rowwise_outliers", "dequantize_fp8_rowwise",
           "fp8_rowwise_linear"]


def quantize_fp8_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes and fp32 ``[..., 1]`` scales, one per row (abs-max / 448)."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    codes = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale


def quantize_fp8_rowwise_outliers(x: torch.Tensor, outlier_index: torch.Tensor,
                                  codes: torch.Tensor | None = None,
                                  scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_fp8_rowwise` with the outlier columns appended: codes ``[N, K + 2r]``
    (``[w | w[:, O] | w_lo[:, O]]``, ``w_lo`` the round-to-nearest residual on the same row scale).
    ``codes`` / ``scale``: the row codes and scales already made (e.g. stochastically rounded)."""
    if codes is None or scale is None:
        codes, scale = quantize_fp8_rowwise(x)
    y = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX)
    return fp8_outlier_split(y, codes, outlier_index, low_first=False), scale


def dequantize_fp8_rowwise(codes: torch.Tensor, scale: torch.Tensor,
                           outlier_index: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 ``[N, K]`` weight of row codes ``[N, K]`` (or ``[N, K + 2r]`` with ``outlier_index``):
    ``(w + w_lo scattered to O) * scale``, exactly the weight the GEMM multiplies."""
    if outlier_index is None or outlier_index.numel() == 0:
        return codes.float() * scale
    r = outlier_index.numel()
    k = codes.shape[1] - 2 * r
    weight = codes[:, :k].float()
    weight.index_add_(1, outlier_index.to(device=codes.device, dtype=torch.long), codes[:, k + r:].float())
    return weight * scale


def _has_fp8_tensor_cores(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_rowwise_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None, *,
                       rotation: str = "none", group_size: int = 0,
                       outlier_index: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight * weight_scale).T + bias`` with ``x`` quantized per token to e4m3.

    ``weight``: float8_e4m3fn ``[N, K]``; ``weight_scale``: fp32 ``[N, 1]``. ``rotation`` /
    ``group_size`` as in :func:`lowbit.kernels.int8_gemm.int8_linear` (default: none).
    ``outlier_index`` (int32 ``[r]``, no rotation): ``weight`` is ``[N, K + 2r]`` from
    :func:`quantize_fp8_rowwise_outliers` and ``x`` gets the matching outlier columns.
    """
    out_dtype = out_dtype or x.dtype
    if x.dim() == 2:
        return w8a8_linear_fast("fp8_rowwise", x, weight, weight_scale, bias, out_dtype, rotation, group_size,
                                outlier_index=outlier_index)
    out = w8a8_linear_fast("fp8_rowwise", x.reshape(-1, x.shape[-1]), weight, weight_scale, bias, out_dtype,
                           rotation, group_size, outlier_index=outlier_index)
    return out.reshape(*x.shape[:-1], weight.shape[0])
