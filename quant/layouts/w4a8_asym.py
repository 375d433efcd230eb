"""``w4a8``: comfy-kitchen's native grouped W4A8 layout (``asym_w4a8_int8``).

4-bit weight codes (a Lloyd-Max codebook by default) in groups of 16 with fp8 group scales and an
fp32 per-channel scale, after a ConvRot rotation (256); activations run as INT8 per token, so the
product is an INT8 GEMM. Storage: ``weight`` (int8 ``[N, K/2]``), ``weight_s_rel`` (fp8
``[N, K/16]``), ``weight_s_channel`` (fp32 ``[N]``), optional ``weight_codebook`` (``[16]``) and
``weight_correction``; ``comfy_quant`` ``{"format": "asym_w4a8_int8", "group_size": 16,
"convrot_groupsize": 256}``.

Run time: :meth:`W4A8AsymCodec.linear` runs LowBit's ``kernels.w4_linear.w4a8_linear`` on the
layout's tensors (codes, group scales and codebook decoded in registers by our Triton kernel; an
asymmetric weight with a ``correction`` runs kitchen's or the dequantized product). On the CPU the
dispatcher tries kitchen's ``w4a8_int8_linear`` first, so CPU results are kitchen's bit for bit.
Weights the kernels do not take run kitchen's handler (``F.linear``): comfy-kitchen's 6-bit rows
(since 0.2.36) and MMA-packed weights (since 0.2.38), a transposed weight.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import inspect

import torch
from comfy_kitchen.tensor import AsymW4A8Int8Layout, QuantizedTensor

from ...kernels.hadamard import rotate_blocks
from ...kernels.w4_linear import w4a8_linear
from ..gptq import CodebookGrid, GPTQConfig, check_gptq_call, gptq_round, rotated_hessian
from .base import FormatSpec, KitchenKernelCodec, W4Form, check_matrix, conf_value, require

LAYOUT = "AsymW4A8Int8Layout"
CONVROT_GROUP = 256
GROUP = 16
_SUPPORTS_SEED = "stochastic_rounding" in inspect.signature(AsymW4A8Int8Layout.quantize).parameters


class W4A8AsymCodec(KitchenKernelCodec):
    kernel_layouts = (LAYOUT,)

    spec = FormatSpec(
        name="w4a8",
        description="W4A8: 4-bit codebook weights (groups of 16, fp8 group scales) x INT8 per-token activations",
        layout=LAYOUT, weight_bits=4, activation="int8 per-token (dynamic), rotated",
        native_format="asym_w4a8_int8", stock_loadable=True, in_features_multiple=CONVROT_GROUP,
        fallback="int8_convrot", min_sm=(8, 0),
    )
    tensor_keys = ("weight", "weight_s_rel", "weight_s_channel", "weight_codebook", "weight_correction")

    def quantize(self, weight: torch.Tensor, *, compute_dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 hessian: torch.Tensor | None = None, gptq: GPTQConfig | None = None) -> QuantizedTensor:
        """:meth:`FormatCodec.quantize`; ``hessian`` (``[K, K]``, ``sum x^T x`` over the layer's calibration
        inputs) keeps comfy-kitchen's group scales, channel scales and codebook, and chooses each code by GPTQ
        (``quant/gptq.py``) among its group's 16 levels, in the rotated basis, instead of the nearest level."""
        if hessian is None:
            return super().quantize(weight, compute_dtype=compute_dtype, seed=seed)
        check_gptq_call(self.spec.name, hessian, weight.shape[1], seed)
        nearest = super().quantize(weight, compute_dtype=compute_dtype)
        p = nearest._params
        if p.codebook is None or p.correction is not None or nearest._qdata.shape[1] * 2 != weight.shape[1]:
            raise ValueError("w4a8: GPTQ rounds the symmetric codebook weights comfy-kitchen makes by default; this "
                             "weight came out in another form (no codebook, asymmetric, or not 4-bit codes)")
        rotated = rotate_blocks(weight.float(), "regular", CONVROT_GROUP)
        h = rotated_hessian(hessian, CONVROT_GROUP, rotated.device)
        levels = (p.codebook.float().view(1, 1, 16) * p.scale.float().unsqueeze(-1)).round_().clamp_(-127, 127)
        s_channel = p.s_channel.float().reshape(-1, 1)
        group = p.group_size
        # the nearest of the column's group's levels, measured as kitchen's _assign_grid measures it
        grid = CodebookGrid(levels, s_channel, group)
        rounded = gptq_round(rotated, h, grid, gptq or GPTQConfig())
        target = (rounded / s_channel).view(rounded.shape[0], -1, group, 1)
        codes = (target - levels.unsqueeze(2)).abs().argmin(dim=-1).view(rounded.shape).to(torch.int32)
        packed = ((codes[:, 0::2] & 0xF) | ((codes[:, 1::2] & 0xF) << 4)).to(torch.int8).contiguous()
        return QuantizedTensor(packed, LAYOUT, p)

    def _quantize(self, weight, *, seed):
        kwargs = {"group_size": GROUP, "convrot_groupsize": CONVROT_GROUP}
        if seed > 0:
            if not _SUPPORTS_SEED:
                raise ValueError(
                    f"stochastic rounding (seed={seed}) of w4a8 weights needs comfy-kitchen >= 0.2.28, found "
                    f"comfy-kitchen {_kitchen_version()}; upgrade comfy-kitchen or quantize with seed=0")
            kwargs["stochastic_rounding"] = seed
        return AsymW4A8Int8Layout.quantize(weight, **kwargs)

    def _weight_problem(self, x, qdata, p) -> str | None:
        if getattr(p, "mma_packed", False):  # comfy-kitchen >= 0.2.38 only
            return "the weight is packed for kitchen's small-M MMA kernel"
        if qdata.dtype not in (torch.int8, torch.uint8) or 2 * qdata.shape[1] != x.shape[-1]:
            # also kitchen's 6-bit rows (3K/4 bytes, kitchen >= 0.2.36), which our kernel does not decode
            return f"packed weight {qdata.dtype} {tuple(qdata.shape)} is not 4-bit codes for {x.shape[-1]} features"
        if p.s_channel is None or p.s_channel.numel() != qdata.shape[0]:
            return "the weight has no per-channel scale for every output row"
        return None

    def _kernel_linear(self, x, weight, bias):
        """``x @ W.T + bias`` in ``x``'s dtype on LowBit's W4 kernel."""
        p = weight._params
        return w4a8_linear(x, weight._qdata, p.scale, p.s_channel, p.codebook, p.correction, bias, p.group_size,
                           p.convrot_groupsize, out_dtype=x.dtype)

    def prologue_form(self, x, weight):
        if self._kernel_problem(x, weight) is not None:
            return None
        p = weight._params
        return W4Form("w4a8", weight._qdata, p.s_channel, p.convrot_groupsize, p.scale, p.codebook, p.correction,
                      p.group_size)

    def _kitchen_linear(self, x, weight, bias, input_scale):
        # kitchen's W4A8 handler returns the weight's dtype, not the input's: give the weight the
        # input's dtype (metadata only, no copy) so the output follows x like every other format.
        if isinstance(weight, QuantizedTensor) and weight.dtype != x.dtype:
            weight = QuantizedTensor(weight._qdata, LAYOUT, dataclasses.replace(weight._params, orig_dtype=x.dtype))
        return torch.nn.functional.linear(x, weight, bias)

    def comfy_quant(self, qt):
        return {"format": self.spec.native_format, "group_size": qt._params.group_size,
                "convrot_groupsize": qt._params.convrot_groupsize}

    def from_state_dict(self, layer, tensors, conf, compute_dtype=torch.bfloat16):
        weight = require(layer, tensors, "weight", self.spec.name)
        s_rel = require(layer, tensors, "weight_s_rel", self.spec.name)
        s_channel = require(layer, tensors, "weight_s_channel", self.spec.name)
        check_matrix(layer, weight, self.spec.name, (torch.int8,))
        if s_rel.dtype == torch.uint8:
            s_rel = s_rel.view(torch.float8_e4m3fn)
        n, row_bytes = weight.shape
        group = int(conf_value(conf, "group_size", GROUP))
        # K from the group scales ([N, K / group_size]), not the row bytes: 4-bit rows hold K / 2
        # bytes, comfy-kitchen >= 0.2.36's 6-bit rows 3K / 4
        k = s_rel.shape[1] * group if s_rel.dim() == 2 and s_rel.shape[1] > 0 else 2 * row_bytes
        try:
            params = AsymW4A8Int8Layout.Params(
                scale=s_rel, s_channel=s_channel.float(), codebook=tensors.get("weight_codebook"),
                correction=tensors.get("weight_correction"),
                orig_dtype=compute_dtype, orig_shape=(n, k),
                group_size=group,
                convrot_groupsize=int(conf_value(conf, "convrot_groupsize", CONVROT_GROUP)),
            )
        except ValueError as err:  # kitchen validates shapes; say which layer
            from ..errors import CheckpointFormatError
            raise CheckpointFormatError(f"layer {layer!r} ({self.spec.name}): {err}") from err
        return QuantizedTensor(weight, LAYOUT, params)


def _kitchen_version() -> str:
    try:
        return importlib.metadata.version("comfy-kitchen")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


W4A8 = W4A8AsymCodec()
