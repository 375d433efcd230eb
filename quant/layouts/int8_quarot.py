"""``int8_quarot``: INT8 W8A8 after a Sylvester-Hadamard rotation in groups of 128 (QuaRot).

Our own layout, registered with comfy-kitchen so kitchen's ``QuantizedTensor`` dispatch runs it.
The weight is stored rotated (``W H``) as INT8 with one fp32 scale per output row; at run time the
activation is rotated by the same ``H`` (``x H``), quantized per token and multiplied on the INT8
path. ``comfy_quant``: ``{"format": "lowbit_int8_quarot", "group_size": 128}``; tensors ``weight``
(int8 ``[N, K]``) and ``weight_scale`` (fp32 ``[N, 1]``). Stock ComfyUI cannot load it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from comfy_kitchen.tensor import BaseLayoutParams, QuantizedLayout, QuantizedTensor, register_layout_class

from ...kernels.hadamard import rotate_blocks, unrotate_blocks
from ...kernels.int8_gemm import int8_linear, quantize_int8_rowwise
from .base import (FormatCodec, FormatSpec, check_matrix, check_numel, conf_value, own_w8a8_form, register_linear_family,
                   require)

LAYOUT = "LowBitQuaRotINT8Layout"
GROUP = 128
HADAMARD = "sylvester"


class QuaRotINT8Layout(QuantizedLayout):
    """INT8 weight rotated by a block Sylvester-Hadamard matrix; per-row fp32 scale."""

    MIN_SM_VERSION = (7, 5)

    @dataclass(frozen=True)
    class Params(BaseLayoutParams):
        group_size: int = GROUP
        transposed: bool = False

        def _tensor_fields(self) -> list[str]:
            return ["scale"]

    @classmethod
    def quantize(cls, tensor, group_size: int = GROUP, stochastic_rounding: int = 0, **kwargs):
        rotated = rotate_blocks(tensor.float(), HADAMARD, group_size)
        qdata, scale = quantize_int8_rowwise(rotated, seed=stochastic_rounding)
        return qdata, cls.Params(scale=scale, orig_dtype=tensor.dtype, orig_shape=tuple(tensor.shape), group_size=group_size)

    @classmethod
    def dequantize(cls, qdata, params):
        rotated = qdata.float() * params.scale
        return unrotate_blocks(rotated, HADAMARD, params.group_size).to(params.orig_dtype)

    @classmethod
    def get_plain_tensors(cls, qtensor):
        return qtensor._qdata, qtensor._params.scale

    @classmethod
    def state_dict_tensors(cls, qdata, params):
        return {"": qdata, "_scale": params.scale}

    @classmethod
    def requantize_kwargs(cls, qtensor):
        return {"group_size": qtensor._params.group_size}


def quarot_linear(x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    params = weight._params
    # the rotation of x is fused into the activation-quantization kernel
    return int8_linear(x, weight._qdata, params.scale, bias, out_dtype=x.dtype, rotation=HADAMARD,
                       group_size=params.group_size)


register_layout_class(LAYOUT, QuaRotINT8Layout)
register_linear_family(QuaRotINT8Layout, LAYOUT, quarot_linear)


class QuaRotCodec(FormatCodec):
    spec = FormatSpec(
        name="int8_quarot",
        description="INT8 W8A8 after a Sylvester-Hadamard rotation in groups of 128 (QuaRot); LowBit layout",
        layout=LAYOUT, weight_bits=8, activation="int8 per-token (dynamic), rotated",
        native_format="lowbit_int8_quarot", stock_loadable=False, in_features_multiple=GROUP,
        fallback="int8", min_sm=(7, 5),
    )

    def _quantize(self, weight, *, seed):
        return QuaRotINT8Layout.quantize(weight, stochastic_rounding=seed)

    def w8a8_form(self, x, weight):
        return own_w8a8_form(x, weight, LAYOUT, rotation=HADAMARD, group_size=weight._params.group_size)

    def comfy_quant(self, qt):
        return {"format": self.spec.native_format, "group_size": qt._params.group_size}

    def from_state_dict(self, layer, tensors, conf, compute_dtype=torch.bfloat16):
        weight = require(layer, tensors, "weight", self.spec.name)
        scale = require(layer, tensors, "weight_scale", self.spec.name).float()
        check_matrix(layer, weight, self.spec.name, (torch.int8,))
        n, k = weight.shape
        check_numel(layer, scale, self.spec.name, "weight_scale", (n,))
        group = int(conf_value(conf, "group_size", GROUP))
        problem = dataclasses.replace(self.spec, in_features_multiple=group).shape_problem((n, k))
        if problem:
            from ..errors import CheckpointFormatError
            raise CheckpointFormatError(f"layer {layer!r}: {problem}")
        params = QuaRotINT8Layout.Params(scale=scale.reshape(n, 1), orig_dtype=compute_dtype, orig_shape=(n, k), group_size=group)
        return QuantizedTensor(weight, LAYOUT, params)


INT8_QUAROT = QuaRotCodec()
