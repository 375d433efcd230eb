"""``int8_hadanorm``: INT8 W8A8 with column smoothing, Hadamard rotation and mean centring.

Our own layout (HadaNorm-style). Offline, weight column ``j`` is divided by
``a_j = colmax_j(|W|)^(1-alpha)`` (alpha = 0.5, ``a`` normalised to mean 1), rotated by a block
Sylvester-Hadamard matrix (groups of 128) and stored as INT8 with a per-row scale. At run time the
activation is multiplied by ``a`` (``x' = x a``), centred per token (``x' - mu``; the mean
``mu`` is added back exactly as ``mu * rowsum(W / a)``), rotated, quantized per token and multiplied
on the INT8 path:

    y = Q(rot(x a - mu)) · Q(rot(W / a))^T + mu · rowsum(W / a) + bias

``comfy_quant``: ``{"format": "lowbit_int8_hadanorm", "group_size": 128, "alpha": 0.5}``; tensors
``weight`` (int8 ``[N, K]``), ``weight_scale`` (fp32 ``[N, 1]``), ``weight_smooth`` (fp32 ``[K]``, the
activation multiplier ``a``) and ``weight_rowsum`` (fp32 ``[N]``). Stock ComfyUI cannot load it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from comfy_kitchen.tensor import BaseLayoutParams, QuantizedLayout, QuantizedTensor, register_layout_class

from ...kernels.hadamard import rotate_blocks, unrotate_blocks
from ...kernels.int8_gemm import int8_linear, quantize_int8_rowwise
from ..errors import CheckpointFormatError
from .base import (FormatCodec, FormatSpec, check_matrix, check_numel, conf_value, own_w8a8_form, register_linear_family,
                   require)

LAYOUT = "LowBitHadaNormINT8Layout"
GROUP = 128
ALPHA = 0.5
HADAMARD = "sylvester"


def smoothing_factors(weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per-input-channel activation multiplier ``a = colmax(|W|)^(1-alpha)``, normalised to mean 1."""
    colmax = weight.float().abs().amax(dim=0)
    floor = colmax.max().clamp(min=1e-12) * 1e-4  # all-zero columns must not make a zero divisor
    factors = colmax.clamp(min=floor).pow(1.0 - alpha)
    return factors / factors.mean()


class HadaNormINT8Layout(QuantizedLayout):
    """INT8 weight, smoothed and rotated; carries the activation multiplier and the row sums."""

    MIN_SM_VERSION = (7, 5)

    @dataclass(frozen=True)
    class Params(BaseLayoutParams):
        smooth: torch.Tensor = None  # [K] activation multiplier a
        rowsum: torch.Tensor = None  # [N] rowsum(W / a), fp32
        group_size: int = GROUP
        alpha: float = ALPHA
        transposed: bool = False

        def _tensor_fields(self) -> list[str]:
            return ["scale", "smooth", "rowsum"]

    @classmethod
    def quantize(cls, tensor, group_size: int = GROUP, alpha: float = ALPHA, stochastic_rounding: int = 0, **kwargs):
        weight = tensor.float()
        smooth = smoothing_factors(weight, alpha)
        smoothed = weight / smooth
        qdata, scale = quantize_int8_rowwise(rotate_blocks(smoothed, HADAMARD, group_size), seed=stochastic_rounding)
        params = cls.Params(scale=scale, orig_dtype=tensor.dtype, orig_shape=tuple(tensor.shape), smooth=smooth,
                            rowsum=smoothed.sum(dim=1), group_size=group_size, alpha=alpha)
        return qdata, params

    @classmethod
    def dequantize(cls, qdata, params):
        smoothed = unrotate_blocks(qdata.float() * params.scale, HADAMARD, params.group_size)
        return (smoothed * params.smooth).to(params.orig_dtype)

    @classmethod
    def get_plain_tensors(cls, qtensor):
        p = qtensor._params
        return qtensor._qdata, p.scale, p.smooth, p.rowsum

    @classmethod
    def state_dict_tensors(cls, qdata, params):
        return {"": qdata, "_scale": params.scale, "_smooth": params.smooth, "_rowsum": params.rowsum}

    @classmethod
    def requantize_kwargs(cls, qtensor):
        return {"group_size": qtensor._params.group_size, "alpha": qtensor._params.alpha}


def hadanorm_linear(x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor:
    p = weight._params
    # smoothing, centring (mean * rowsum added back in the epilogue) and rotation are fused into the
    # activation-quantization kernel (few rows on a GPU: into the weight-only kernel's pre-pass, kernels/w8a8_linear.py)
    return int8_linear(x, weight._qdata, p.scale, bias, out_dtype=x.dtype, rotation=HADAMARD,
                       group_size=p.group_size, smooth=p.smooth, center_rowsum=p.rowsum)


register_layout_class(LAYOUT, HadaNormINT8Layout)
register_linear_family(HadaNormINT8Layout, LAYOUT, hadanorm_linear)


class HadaNormCodec(FormatCodec):
    spec = FormatSpec(
        name="int8_hadanorm",
        description="INT8 W8A8 with column smoothing (alpha 0.5), Hadamard rotation (128) and per-token mean "
                    "centring (HadaNorm); LowBit layout",
        layout=LAYOUT, weight_bits=8, activation="int8 per-token (dynamic), smoothed, centred, rotated",
        native_format="lowbit_int8_hadanorm", stock_loadable=False, in_features_multiple=GROUP,
        fallback="int8", min_sm=(7, 5),
    )
    tensor_keys = ("weight", "weight_scale", "weight_smooth", "weight_rowsum")

    def _quantize(self, weight, *, seed):
        return HadaNormINT8Layout.quantize(weight, stochastic_rounding=seed)

    def w8a8_form(self, x, weight):
        p = weight._params
        return own_w8a8_form(x, weight, LAYOUT, rotation=HADAMARD, group_size=p.group_size, smooth=p.smooth,
                             center_rowsum=p.rowsum)

    def comfy_quant(self, qt):
        return {"format": self.spec.native_format, "group_size": qt._params.group_size, "alpha": qt._params.alpha}

    def from_state_dict(self, layer, tensors, conf, compute_dtype=torch.bfloat16):
        weight = require(layer, tensors, "weight", self.spec.name)
        check_matrix(layer, weight, self.spec.name, (torch.int8,))
        n, k = weight.shape
        scale = require(layer, tensors, "weight_scale", self.spec.name).float()
        smooth = require(layer, tensors, "weight_smooth", self.spec.name).float()
        rowsum = require(layer, tensors, "weight_rowsum", self.spec.name).float()
        check_numel(layer, scale, self.spec.name, "weight_scale", (n,))
        check_numel(layer, smooth, self.spec.name, "weight_smooth", (k,))
        check_numel(layer, rowsum, self.spec.name, "weight_rowsum", (n,))
        group = int(conf_value(conf, "group_size", GROUP))
        if k % group:
            raise CheckpointFormatError(f"layer {layer!r} ({self.spec.name}): in_features {k} is not a multiple "
                                        f"of the stored group_size {group}")
        params = HadaNormINT8Layout.Params(
            scale=scale.reshape(n, 1), orig_dtype=compute_dtype, orig_shape=(n, k), smooth=smooth.reshape(k),
            rowsum=rowsum.reshape(n), group_size=group, alpha=float(conf_value(conf, "alpha", ALPHA)),
        )
        return QuantizedTensor(weight, LAYOUT, params)


INT8_HADANORM = HadaNormCodec()
