"""FP8 (e4m3) row-wise W8A8 linear: per-token activation scale × per-channel weight scale.

On GPUs with FP8 tensor cores (sm_89+) the product runs through ``torch._scaled_mm`` with row-wise
scales; elsewhere it is emulated exactly (fp8 codes are exact in fp32, products accumulate in
fp32, then the same scale epilogue), so CPU results match the GPU up to accumulation order.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)


def quantize_fp8_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes and fp32 ``[..., 1]`` scales, one per row (abs-max / 448)."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    codes = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale


def _has_fp8_tensor_cores(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_rowwise_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ (weight * weight_scale).T + bias`` with ``x`` quantized per token to e4m3.

    ``weight``: float8_e4m3fn ``[N, K]``; ``weight_scale``: fp32 ``[N, 1]``.
    """
    out_dtype = out_dtype or x.dtype
    x2d = x.reshape(-1, x.shape[-1])
    codes, scale = quantize_fp8_rowwise(x2d)
    n = weight.shape[0]
    if _has_fp8_tensor_cores(x.device) and x2d.shape[-1] % 16 == 0 and n % 16 == 0:
        out = torch._scaled_mm(codes, weight.t(), scale_a=scale, scale_b=weight_scale.reshape(1, n).float(),
                               bias=None if bias is None else bias.to(out_dtype), out_dtype=out_dtype)
    else:
        acc = codes.float() @ weight.float().t()
        acc = acc * scale * weight_scale.reshape(1, n).float()
        if bias is not None:
            acc = acc + bias.float()
        out = acc.to(out_dtype)
    return out.reshape(*x.shape[:-1], n)
