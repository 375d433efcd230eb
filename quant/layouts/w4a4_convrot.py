"""``w4a4``: comfy-kitchen's native ConvRot W4A4 layout (``convrot_w4a4``).

Weights and activations are rotated with the regular Hadamard matrix in groups of 256 and both are
quantized to 4 bits (weights offline, activations per token at run time). Storage: ``weight`` (int8
``[N, K/2]``, two signed nibbles a byte) and ``weight_scale``; ``comfy_quant``
``{"format": "convrot_w4a4", "convrot_groupsize": 256}``.

Stock ComfyUI 0.30 lists the format but cannot run it on CPU; LowBit runs it through kitchen's layout.
On GPUs without INT4 tensor cores (Hopper) kitchen computes it through INT8.
"""

from __future__ import annotations


import torch
from comfy_kitchen.tensor import QuantizedTensor, TensorCoreConvRotW4A4Layout

from .base import FormatCodec, FormatSpec, check_matrix, conf_value, require

LAYOUT = "TensorCoreConvRotW4A4Layout"
CONVROT_GROUP = 256
QUANT_GROUP = 64  # what ComfyUI's loader assumes for this format


class W4A4ConvRotCodec(FormatCodec):
    spec = FormatSpec(
        name="w4a4",
        description="ConvRot W4A4: 4-bit weights and 4-bit per-token activations after a Hadamard rotation (256)",
        layout=LAYOUT, weight_bits=4, activation="int4 per-token (dynamic), rotated",
        native_format="convrot_w4a4", stock_loadable=True, in_features_multiple=CONVROT_GROUP,
        fallback="int8_convrot", min_sm=(7, 5),
    )

    def _quantize(self, weight, *, seed):
        return TensorCoreConvRotW4A4Layout.quantize(
            weight, convrot_groupsize=CONVROT_GROUP, quant_group_size=QUANT_GROUP, stochastic_rounding=seed,
        )

    def comfy_quant(self, qt):
        conf = {"format": self.spec.native_format, "convrot_groupsize": qt._params.convrot_groupsize}
        if qt._params.linear_dtype != "int4":
            conf["linear_dtype"] = qt._params.linear_dtype
        return conf

    def from_state_dict(self, layer, tensors, conf, compute_dtype=torch.bfloat16):
        weight = require(layer, tensors, "weight", self.spec.name)
        scale = require(layer, tensors, "weight_scale", self.spec.name)
        check_matrix(layer, weight, self.spec.name, (torch.int8,))
        n, half_k = weight.shape
        params = TensorCoreConvRotW4A4Layout.Params(
            scale=scale.float() if scale.dtype != torch.float32 else scale,
            orig_dtype=compute_dtype, orig_shape=(n, 2 * half_k),
            convrot_groupsize=int(conf_value(conf, "convrot_groupsize", CONVROT_GROUP)),
            quant_group_size=QUANT_GROUP,
            linear_dtype=str(conf_value(conf, "linear_dtype", "int4")),
        )
        return QuantizedTensor(weight, LAYOUT, params)


W4A4 = W4A4ConvRotCodec()
