"""``int8`` and ``int8_convrot``: comfy-kitchen's native ``TensorWiseINT8Layout``.

W8A8: the weight is INT8 with one scale per output row; activations are quantized per token at run
time inside kitchen's ``int8_linear``. ``int8_convrot`` first rotates weight and activation in groups
of 256 with the regular Hadamard matrix (ConvRot), which spreads outlier channels over the group.
Native ``comfy_quant``: ``{"format": "int8_tensorwise"}`` (+ ``"convrot": true,
"convrot_groupsize": 256``); tensors ``weight`` (int8 ``[N, K]``) and ``weight_scale`` (fp32 ``[N, 1]``).
Stock ComfyUI loads and runs both.
"""

from __future__ import annotations

from typing import Mapping

import torch
from comfy_kitchen.tensor import QuantizedTensor, TensorWiseINT8Layout

from .base import FormatCodec, FormatSpec, check_matrix, check_numel, conf_value, require

LAYOUT = "TensorWiseINT8Layout"
CONVROT_GROUP = 256


class Int8TensorwiseCodec(FormatCodec):
    def __init__(self, spec: FormatSpec, convrot: bool):
        self.spec = spec
        self.convrot = convrot

    def _quantize(self, weight, *, seed):
        return TensorWiseINT8Layout.quantize(
            weight, is_weight=True, per_channel=True, convrot=self.convrot,
            convrot_groupsize=CONVROT_GROUP, stochastic_rounding=seed,
        )

    def comfy_quant(self, qt):
        conf = {"format": self.spec.native_format}
        if self.convrot:
            conf.update(convrot=True, convrot_groupsize=qt._params.convrot_groupsize)
        return conf

    def matches(self, conf: Mapping) -> bool:
        return conf.get("format") == self.spec.native_format and bool(conf_value(conf, "convrot", False)) == self.convrot

    def from_state_dict(self, layer, tensors, conf, compute_dtype=torch.bfloat16):
        weight = require(layer, tensors, "weight", self.spec.name)
        scale = require(layer, tensors, "weight_scale", self.spec.name).float()
        group = int(conf_value(conf, "convrot_groupsize", CONVROT_GROUP))
        check_matrix(layer, weight, self.spec.name, (torch.int8,))
        check_numel(layer, scale, self.spec.name, "weight_scale", (1, weight.shape[0]))
        params = TensorWiseINT8Layout.Params(
            scale=scale, orig_dtype=compute_dtype, orig_shape=tuple(weight.shape),
            is_weight=True, convrot=self.convrot, convrot_groupsize=group,
        )
        return QuantizedTensor(weight, LAYOUT, params)


INT8 = Int8TensorwiseCodec(FormatSpec(
    name="int8",
    description="W8A8 INT8, per-output-row weight scale, per-token dynamic activation scale",
    layout=LAYOUT, weight_bits=8, activation="int8 per-token (dynamic)",
    native_format="int8_tensorwise", stock_loadable=True, min_sm=(7, 5),
), convrot=False)

INT8_CONVROT = Int8TensorwiseCodec(FormatSpec(
    name="int8_convrot",
    description="INT8 W8A8 after a regular-Hadamard rotation in groups of 256 (ConvRot)",
    layout=LAYOUT, weight_bits=8, activation="int8 per-token (dynamic), rotated",
    native_format="int8_tensorwise", stock_loadable=True, in_features_multiple=CONVROT_GROUP,
    fallback="int8", min_sm=(7, 5),
), convrot=True)
