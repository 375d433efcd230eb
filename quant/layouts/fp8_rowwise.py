"""``fp8_rowwise``: FP8 e4m3 W8A8 with a per-output-channel weight scale and per-token activation scale.

Our own layout, registered with comfy-kitchen. More accurate than the per-tensor ``fp8`` format when
rows or tokens differ in range; runs on FP8 tensor cores with row-wise ``_scaled_mm`` scales.
``comfy_quant``: ``{"format": "lowbit_fp8_rowwise"}``; tensors ``weight`` (float8_e4m3fn ``[N, K]``)
and ``weight_scale`` (fp32 ``[N, 1]``). Stock ComfyUI cannot load it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from comfy_kitchen.tensor import BaseLayoutParams, QuantizedLayout, QuantizedTensor, register_layout_class

from ...kernels.fp8_gemm import FP8, fp8_rowwise_linear, quantize_fp8_rowwise
from .base import FormatCodec, FormatSpec, check_matrix, check_numel, register_linear_family, require

LAYOUT = "LowBitFP8RowwiseLayout"


class FP8RowwiseLayout(QuantizedLayout):
    """e4m3 weight with one fp32 scale per output row."""

    MIN_SM_VERSION = (8, 9)

    @dataclass(frozen=True)
    class Params(BaseLayoutParams):
        transposed: bool = False

        def _tensor_fields(self) -> list[str]:
            return ["scale"]

    @classmethod
    def quantize(cls, tensor, stochastic_rounding: int = 0, **kwargs):
        if stochastic_rounding > 0:
            import comfy_kitchen as ck
            scale = tensor.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / torch.finfo(FP8).max
            generator = torch.Generator(device=tensor.device).manual_seed(int(stochastic_rounding))
            noise = torch.randint(0, 256, tensor.shape, generator=generator, device=tensor.device, dtype=torch.uint8)
            qdata = ck.stochastic_rounding_fp8(tensor.float() / scale, noise, FP8)
        else:
            qdata, scale = quantize_fp8_rowwise(tensor)
        return qdata, cls.Params(scale=scale, orig_dtype=tensor.dtype, orig_shape=tuple(tensor.shape))

    @classmethod
    def dequantize(cls, qdata, params):
        return (qdata.float() * params.scale).to(params.orig_dtype)

    @classmethod
    def get_plain_tensors(cls, qtensor):
        return qtensor._qdata, qtensor._params.scale

    @classmethod
    def state_dict_tensors(cls, qdata, params):
        return {"": qdata, "_scale": params.scale}


def _linear(x, weight, bias):
    return fp8_rowwise_linear(x, weight._qdata, weight._params.scale, bias, out_dtype=x.dtype)


register_layout_class(LAYOUT, FP8RowwiseLayout)
register_linear_family(FP8RowwiseLayout, LAYOUT, _linear)


class FP8RowwiseCodec(FormatCodec):
    spec = FormatSpec(
        name="fp8_rowwise",
        description="W8A8 FP8 e4m3, per-output-channel weight scale, per-token activation scale; LowBit layout",
        layout=LAYOUT, weight_bits=8, activation="fp8 e4m3 per-token (dynamic)",
        native_format="lowbit_fp8_rowwise", stock_loadable=False, min_sm=(8, 9),
    )

    def _quantize(self, weight, *, seed):
        return FP8RowwiseLayout.quantize(weight, stochastic_rounding=seed)

    def from_state_dict(self, layer, tensors, conf, compute_dtype=torch.bfloat16):
        weight = require(layer, tensors, "weight", self.spec.name)
        if weight.dtype == torch.uint8:
            weight = weight.view(FP8)
        check_matrix(layer, weight, self.spec.name, (FP8,))
        n, k = weight.shape
        scale = require(layer, tensors, "weight_scale", self.spec.name).float()
        check_numel(layer, scale, self.spec.name, "weight_scale", (n,))
        params = FP8RowwiseLayout.Params(scale=scale.reshape(n, 1), orig_dtype=compute_dtype, orig_shape=(n, k))
        return QuantizedTensor(weight, LAYOUT, params)


FP8_ROWWISE = FP8RowwiseCodec()
