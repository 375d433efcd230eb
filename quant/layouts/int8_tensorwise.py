"""``int8`` and ``int8_convrot``: comfy-kitchen's native ``TensorWiseINT8Layout``.

W8A8: the weight is INT8 with one scale per output row; activations are quantized per token at run
time inside kitchen's ``int8_linear``. ``int8_convrot`` first rotates weight and activation in groups
of 256 with the regular Hadamard matrix (ConvRot), which spreads outlier channels over the group.
Native ``comfy_quant``: ``{"format": "int8_tensorwise"}`` (+ ``"convrot": true,
"convrot_groupsize": 256``); tensors ``weight`` (int8 ``[N, K]``) and ``weight_scale`` (fp32 ``[N, 1]``).
Stock ComfyUI loads and runs both.

Run time: :meth:`Int8TensorwiseCodec.linear` (what LowBit's Linear calls) runs LowBit's
``kernels.int8_gemm.int8_linear`` on the layout's tensors, with the ConvRot rotation fused into the
activation quantization; its dispatcher picks per shape among our Triton kernels, kitchen's
``int8_linear``, ``torch._int_mm`` and dequantize (on the CPU it tries kitchen first, so CPU results
are kitchen's bit for bit). A weight the kernels do not take runs kitchen's handler (``F.linear``).
Kitchen's global handlers are untouched: a model loaded by stock ComfyUI keeps kitchen's path.
"""

from __future__ import annotations

from typing import Mapping

import torch
from comfy_kitchen.tensor import QuantizedTensor, TensorWiseINT8Layout

from ...kernels.hadamard import rotate_blocks
from ...kernels.int8_gemm import int8_linear
from ..gptq import GPTQConfig, check_gptq_call, gptq_round, rotated_hessian, row_grid
from .base import FormatSpec, KitchenKernelCodec, W8A8Form, check_matrix, check_numel, conf_value, require

LAYOUT = "TensorWiseINT8Layout"
CONVROT_GROUP = 256


class Int8TensorwiseCodec(KitchenKernelCodec):
    kernel_layouts = (LAYOUT,)

    def __init__(self, spec: FormatSpec, convrot: bool):
        self.spec = spec
        self.convrot = convrot

    def quantize(self, weight: torch.Tensor, *, compute_dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 hessian: torch.Tensor | None = None, gptq: GPTQConfig | None = None) -> QuantizedTensor:
        """:meth:`FormatCodec.quantize`; ``hessian`` (``[K, K]``, ``sum x^T x`` over the layer's calibration
        inputs, in the layer's own basis) rounds the codes by GPTQ (``quant/gptq.py``, ``gptq`` its settings)
        instead of to nearest: the same per-row scales and layout, so stock ComfyUI loads the result as any
        ``int8_tensorwise`` weight."""
        if hessian is None:
            return super().quantize(weight, compute_dtype=compute_dtype, seed=seed)
        problem = self.spec.shape_problem(tuple(weight.shape))
        if problem:
            raise ValueError(problem)
        check_gptq_call(self.spec.name, hessian, weight.shape[1], seed)
        w = weight.float()
        if self.convrot:  # quantized in the rotated basis: W R, and the inputs' H becomes R^T H R
            w = rotate_blocks(w, "regular", CONVROT_GROUP)
            h = rotated_hessian(hessian, CONVROT_GROUP, w.device)
        else:
            h = hessian.to(device=w.device, dtype=torch.float32)
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)  # kitchen's row scales
        rounded = gptq_round(w, h, row_grid(scale, -127, 127), gptq or GPTQConfig())
        codes = torch.round(rounded / scale[:, None]).to(torch.int8)
        params = TensorWiseINT8Layout.Params(
            scale=scale[:, None].contiguous(), orig_dtype=compute_dtype, orig_shape=tuple(weight.shape),
            is_weight=True, convrot=self.convrot, convrot_groupsize=CONVROT_GROUP,
        )
        return QuantizedTensor(codes.contiguous(), LAYOUT, params)

    def _quantize(self, weight, *, seed):
        return TensorWiseINT8Layout.quantize(
            weight, is_weight=True, per_channel=True, convrot=self.convrot,
            convrot_groupsize=CONVROT_GROUP, stochastic_rounding=seed,
        )

    def _weight_problem(self, x, qdata, p) -> str | None:
        if qdata.dtype != torch.int8 or qdata.shape[1] != x.shape[-1]:
            return f"weight {qdata.dtype} {tuple(qdata.shape)} does not fit an input of {x.shape[-1]} features"
        if not getattr(p, "is_weight", True) or p.scale.numel() not in (1, qdata.shape[0]):
            return f"weight_scale has {p.scale.numel()} values, not 1 or one per output row"
        return None

    def _kernel_linear(self, x, weight, bias):
        """``x @ W.T + bias`` in ``x``'s dtype on LowBit's INT8 kernels (activations quantized per token)."""
        p = weight._params
        rotation, group = ("regular", p.convrot_groupsize) if p.convrot else ("none", 0)
        return int8_linear(x, weight._qdata, p.scale, bias, out_dtype=x.dtype, rotation=rotation, group_size=group)

    def may_be_plain_w8a8(self, values, tensor_fields):
        return not self.convrot and not values.get("convrot", False)

    def plain_w8a8(self, x, weight):
        if self.convrot or weight._params.convrot or self._kernel_problem(x, weight) is not None:
            return None
        return "int8", weight._qdata, weight._params.scale

    def w8a8_form(self, x, weight):
        if self._kernel_problem(x, weight) is not None:
            return None
        p = weight._params
        rotation, group = ("regular", p.convrot_groupsize) if p.convrot else ("none", 0)
        return W8A8Form("int8", weight._qdata, p.scale, rotation, group)

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
