"""``w4a4``: comfy-kitchen's native ConvRot W4A4 layout (``convrot_w4a4``).

Weights and activations are rotated with the regular Hadamard matrix in groups of 256 and both are
quantized to 4 bits (weights offline, activations per token at run time). Storage: ``weight`` (int8
``[N, K/2]``, two signed nibbles a byte) and ``weight_scale``; ``comfy_quant``
``{"format": "convrot_w4a4", "convrot_groupsize": 256}``.

Stock ComfyUI 0.30 lists the format but cannot run it on CPU; LowBit runs it through kitchen's layout.

Quantization (:meth:`W4A4ConvRotCodec.quantize`): kitchen's rotation and packing, with each row's scale
chosen by search (``quant/scale_search.py``) instead of kitchen's ``max|row| / 7``: the same tensors and
format, less error (``docs/formats.md``, "w4a4 weight scales"). ``scales="absmax"`` is kitchen's quantizer.

Run time: :meth:`W4A4ConvRotCodec.linear` runs LowBit's ``kernels.w4_linear.w4a4_linear`` on the
layout's tensors (the weight stays packed; our Triton kernel decodes it in registers), with the
activation bits comfy-kitchen itself uses for this weight on this device (:func:`act_bits`):
4 on the CPU and on GPUs with INT4 tensor cores (Turing, Ampere, Ada), 8 on Hopper and newer, where
kitchen runs the format through INT8, and 8 on any GPU for a weight stored with
``linear_dtype: "int8"``. On the CPU the dispatcher tries kitchen's ``convrot_w4a4_linear`` first,
so CPU results are kitchen's bit for bit. A weight the kernels do not take runs kitchen's handler
(``F.linear``).
"""

from __future__ import annotations

import torch
from comfy_kitchen.tensor import QuantizedTensor, TensorCoreConvRotW4A4Layout

from ...kernels.backend import capability
from ...kernels.hadamard import rotate_blocks
from ...kernels.reference import pack_int4_signed
from ...kernels.w4_linear import w4a4_linear
from ..gptq import GPTQConfig, check_gptq_call, gptq_round, rotated_hessian, row_grid
from ..scale_search import mse_row_scales
from .base import FormatSpec, KitchenKernelCodec, W4Form, check_matrix, conf_value, require

LAYOUT = "TensorCoreConvRotW4A4Layout"
CONVROT_GROUP = 256
QUANT_GROUP = 64  # what ComfyUI's loader assumes for this format
INT4_MAX = 7  # kitchen's signed 4-bit codes: -7 .. 7
SCALE_CHOICES = ("mse", "absmax")


class W4A4ConvRotCodec(KitchenKernelCodec):
    kernel_layouts = (LAYOUT,)

    spec = FormatSpec(
        name="w4a4",
        description="ConvRot W4A4: 4-bit weights and 4-bit per-token activations after a Hadamard rotation (256)",
        layout=LAYOUT, weight_bits=4, activation="int4 per-token (dynamic), rotated",
        native_format="convrot_w4a4", stock_loadable=True, in_features_multiple=CONVROT_GROUP,
        fallback="int8_convrot", min_sm=(7, 5),
    )

    def quantize(self, weight: torch.Tensor, *, compute_dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 scales: str = "mse", hessian: torch.Tensor | None = None,
                 gptq: GPTQConfig | None = None) -> QuantizedTensor:
        """Quantize a float ``[out, in]`` weight. ``scales``: how each row's scale is chosen, after the rotation:

        * ``"mse"`` (the default): the scale with the least squared rounding error over the row
          (:func:`~lowbit.quant.scale_search.mse_row_scales`; the abs-max scale is one of the candidates,
          so no row is worse than with it). Same tensors and format, so stock ComfyUI loads it as any
          ``convrot_w4a4`` file;
        * ``"absmax"``: comfy-kitchen's own quantizer, bit for bit (``max|row| / 7``).

        ``seed > 0`` (stochastic rounding) always takes kitchen's quantizer, with its abs-max scales.
        ``hessian`` (``[K, K]``, ``sum x^T x`` over the layer's calibration inputs) keeps those scales and
        chooses the codes by GPTQ (``quant/gptq.py``, ``gptq`` its settings) in the rotated basis."""
        if scales not in SCALE_CHOICES:
            raise ValueError(f"w4a4 scales must be one of {', '.join(SCALE_CHOICES)}, got {scales!r}")
        if hessian is not None:
            check_gptq_call(self.spec.name, hessian, weight.shape[1], seed)
        if hessian is None and (scales == "absmax" or seed):
            return super().quantize(weight, compute_dtype=compute_dtype, seed=seed)
        problem = self.spec.shape_problem(tuple(weight.shape))
        if problem:
            raise ValueError(problem)
        rotated = rotate_blocks(weight.float(), "regular", CONVROT_GROUP)
        if scales == "mse":
            scale = mse_row_scales(rotated, INT4_MAX)
        else:  # kitchen's abs-max scales (quantize_signed_int4_rowwise)
            scale = rotated.abs().amax(dim=1).clamp(min=1e-10) / INT4_MAX
        if hessian is not None:
            rotated = gptq_round(rotated, rotated_hessian(hessian, CONVROT_GROUP, rotated.device),
                                 row_grid(scale, -INT4_MAX, INT4_MAX), gptq or GPTQConfig())
        codes = torch.clamp(torch.round(rotated / scale[:, None]), -INT4_MAX, INT4_MAX).to(torch.int8)
        params = TensorCoreConvRotW4A4Layout.Params(
            scale=scale, orig_dtype=compute_dtype, orig_shape=tuple(weight.shape), convrot_groupsize=CONVROT_GROUP,
            quant_group_size=QUANT_GROUP, linear_dtype="int4")
        return QuantizedTensor(pack_int4_signed(codes), self.spec.layout, params)

    def _quantize(self, weight, *, seed):
        return TensorCoreConvRotW4A4Layout.quantize(
            weight, convrot_groupsize=CONVROT_GROUP, quant_group_size=QUANT_GROUP, stochastic_rounding=seed,
        )

    def _weight_problem(self, x, qdata, p) -> str | None:
        if qdata.dtype != torch.int8 or 2 * qdata.shape[1] != x.shape[-1]:
            return f"packed weight {qdata.dtype} {tuple(qdata.shape)} does not fit an input of {x.shape[-1]} features"
        if p.scale.numel() != qdata.shape[0]:
            return f"weight_scale has {p.scale.numel()} values, not one per output row"
        if p.quant_group_size != QUANT_GROUP:
            return f"quant_group_size {p.quant_group_size} (kitchen's kernels take {QUANT_GROUP} only)"
        return None

    def _kernel_linear(self, x, weight, bias):
        """``x @ W.T + bias`` in ``x``'s dtype on LowBit's W4 kernel."""
        p = weight._params
        return w4a4_linear(x, weight._qdata, p.scale, bias, p.convrot_groupsize, out_dtype=x.dtype,
                           act_bits=act_bits(p.linear_dtype, x.device))

    def prologue_form(self, x, weight):
        if self._kernel_problem(x, weight) is not None:
            return None
        p = weight._params
        fmt = "w4a4/a8" if act_bits(p.linear_dtype, x.device) == 8 else "w4a4/a4"
        return W4Form(fmt, weight._qdata, p.scale, p.convrot_groupsize)

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


def act_bits(linear_dtype: str, device: torch.device) -> int:
    """The activation bits comfy-kitchen uses for a ``convrot_w4a4`` weight on ``device``.

    Kitchen's CUDA backend quantizes activations to INT4 where it has an INT4 product (compute
    capability 7.5 and 8.x) and to INT8 where it runs the format through INT8 (Hopper and newer,
    or a weight stored with ``linear_dtype: "int8"``); its CPU reference always uses INT4. LowBit
    matches it, so switching to LowBit's kernels changes the speed, not the format's numerics.
    """
    if device.type == "cuda" and (linear_dtype == "int8" or capability(device) >= (9, 0)):
        return 8
    return 4


W4A4 = W4A4ConvRotCodec()
