"""``fp8_rowwise``: FP8 e4m3 W8A8 with a per-output-channel weight scale and per-token activation scale.

Our own layout, registered with comfy-kitchen. More accurate than the per-tensor ``fp8`` format when
rows or tokens differ in range; runs on FP8 tensor cores with row-wise ``_scaled_mm`` scales.
``comfy_quant``: ``{"format": "lowbit_fp8_rowwise"}``; tensors ``weight`` (float8_e4m3fn ``[N, K]``)
and ``weight_scale`` (fp32 ``[N, 1]``). Stock ComfyUI cannot load it.

**Outlier channels** (optional, from calibration: ``quant/calibration_outliers.py``): for ``r``
input channels ``O`` both operands get a second e4m3 term (the residual of their first code, on the
same scale), run as ``2r`` extra K columns of the same FP8 GEMM (``kernels/fp8_gemm.py``). The
layer then stores ``weight`` as ``[N, K + 2r]`` (``[w | w[:, O] | w_lo[:, O]]``) and
``weight_outlier_index`` (int32 ``[r]``, distinct channels in ``[0, K)``); its logical shape stays
``[N, K]`` and :meth:`FP8RowwiseLayout.dequantize` returns the exact ``hi + lo`` weight. Files
without ``weight_outlier_index`` load as plain ``fp8_rowwise`` layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from comfy_kitchen.tensor import BaseLayoutParams, QuantizedLayout, QuantizedTensor, register_layout_class

from ...kernels.fp8_gemm import (FP8, dequantize_fp8_rowwise, fp8_rowwise_linear, quantize_fp8_rowwise,
                                 quantize_fp8_rowwise_outliers)
from ..errors import CheckpointFormatError
from ..gptq import GPTQConfig, check_hessian, fp8_row_grid, gptq_round
from .base import (FormatCodec, FormatSpec, plain_call, check_matrix, check_numel, register_linear_family,
                   require)

LAYOUT = "LowBitFP8RowwiseLayout"
OUTLIER_INDEX = "weight_outlier_index"


def outlier_index_problem(index, in_features: int) -> str | None:
    """Why ``index`` is not a valid outlier-channel index of a layer with ``in_features`` inputs (``None``: it is)."""
    if not isinstance(index, torch.Tensor) or index.dim() != 1 or index.dtype != torch.int32:
        found = f"{type(index).__name__} {tuple(getattr(index, 'shape', ()))} {getattr(index, 'dtype', '')}"
        return f"it must be a 1-D int32 tensor, found {found}"
    if index.numel() == 0:
        return "it is empty (a layer without outlier channels stores no index)"
    if index.numel() * 2 > in_features:
        return f"it names {index.numel()} channels, more than half of the {in_features} input features"
    values = index.detach().to("cpu", torch.long)
    if int(values.min()) < 0 or int(values.max()) >= in_features:
        return f"its channels must lie in [0, {in_features}), found {int(values.min())}..{int(values.max())}"
    if values.unique().numel() != values.numel():
        return "it names a channel twice"
    return None


class FP8RowwiseLayout(QuantizedLayout):
    """e4m3 weight with one fp32 scale per output row (and optional outlier-channel columns)."""

    MIN_SM_VERSION = (8, 9)

    @dataclass(frozen=True)
    class Params(BaseLayoutParams):
        transposed: bool = False
        outlier_index: torch.Tensor | None = None  # int32 [r]: qdata is [N, K + 2r] (see the module docstring)

        def _tensor_fields(self) -> list[str]:
            return ["scale"] if self.outlier_index is None else ["scale", "outlier_index"]

    @classmethod
    def quantize(cls, tensor, stochastic_rounding: int = 0, outlier_index: torch.Tensor | None = None, **kwargs):
        if stochastic_rounding > 0:
            import comfy_kitchen as ck
            scale = tensor.float().abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / torch.finfo(FP8).max
            generator = torch.Generator(device=tensor.device).manual_seed(int(stochastic_rounding))
            noise = torch.randint(0, 256, tensor.shape, generator=generator, device=tensor.device, dtype=torch.uint8)
            qdata = ck.stochastic_rounding_fp8(tensor.float() / scale, noise, FP8)
        else:
            qdata, scale = quantize_fp8_rowwise(tensor)
        if outlier_index is not None:
            outlier_index = outlier_index.to(device=tensor.device, dtype=torch.int32)
            qdata, scale = quantize_fp8_rowwise_outliers(tensor, outlier_index, qdata, scale)
        return qdata, cls.Params(scale=scale, orig_dtype=tensor.dtype, orig_shape=tuple(tensor.shape),
                                 outlier_index=outlier_index)

    @classmethod
    def dequantize(cls, qdata, params):
        return dequantize_fp8_rowwise(qdata, params.scale, params.outlier_index).to(params.orig_dtype)

    @classmethod
    def get_plain_tensors(cls, qtensor):
        return qtensor._qdata, qtensor._params.scale

    @classmethod
    def state_dict_tensors(cls, qdata, params):
        out = {"": qdata, "_scale": params.scale}
        if params.outlier_index is not None:
            out["_outlier_index"] = params.outlier_index
        return out

    @classmethod
    def requantize_kwargs(cls, qtensor):
        """A requantized weight (a merged LoRA) keeps its outlier channels."""
        index = qtensor._params.outlier_index
        return {} if index is None else {"outlier_index": index}


def _linear(x, weight, bias):
    return fp8_rowwise_linear(x, weight._qdata, weight._params.scale, bias, out_dtype=x.dtype,
                              outlier_index=weight._params.outlier_index)


register_layout_class(LAYOUT, FP8RowwiseLayout)
register_linear_family(FP8RowwiseLayout, LAYOUT, _linear)


class FP8RowwiseCodec(FormatCodec):
    spec = FormatSpec(
        name="fp8_rowwise",
        description="W8A8 FP8 e4m3, per-output-channel weight scale, per-token activation scale; LowBit layout",
        layout=LAYOUT, weight_bits=8, activation="fp8 e4m3 per-token (dynamic)",
        native_format="lowbit_fp8_rowwise", stock_loadable=False, min_sm=(8, 9),
    )
    tensor_keys = ("weight", "weight_scale", OUTLIER_INDEX)

    def quantize(self, weight: torch.Tensor, *, compute_dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 outlier_channels: torch.Tensor | None = None, hessian: torch.Tensor | None = None,
                 gptq: GPTQConfig | None = None) -> QuantizedTensor:
        """:meth:`FormatCodec.quantize`; ``outlier_channels`` (int32 ``[r]``, e.g. from
        ``quant.calibration_outliers.select_outlier_channels``) gives those input channels a second
        e4m3 term on both operands (see the module docstring); ``None``: a plain layer. ``hessian``
        (``[K, K]``, ``sum x^T x`` over the layer's calibration inputs) rounds the e4m3 codes by GPTQ
        (``quant/gptq.py``, ``gptq`` its settings) on the same row scales, instead of to nearest."""
        if hessian is not None:
            return self._quantize_gptq(weight, hessian, gptq or GPTQConfig(), compute_dtype, seed, outlier_channels)
        if outlier_channels is None:
            return super().quantize(weight, compute_dtype=compute_dtype, seed=seed)
        problem = self.spec.shape_problem(tuple(weight.shape)) or outlier_index_problem(outlier_channels,
                                                                                       weight.shape[-1])
        if problem:
            raise ValueError(f"fp8_rowwise outlier channels: {problem}")
        qdata, params = FP8RowwiseLayout.quantize(weight.float(), stochastic_rounding=seed,
                                                  outlier_index=outlier_channels)
        params = FP8RowwiseLayout.Params(scale=params.scale, orig_dtype=compute_dtype, orig_shape=tuple(weight.shape),
                                         outlier_index=params.outlier_index)
        return QuantizedTensor(qdata, self.spec.layout, params)

    def _quantize_gptq(self, weight, hessian, config, compute_dtype, seed, outlier_channels) -> QuantizedTensor:
        problem = self.spec.shape_problem(tuple(weight.shape))
        if problem:
            raise ValueError(problem)
        if seed or outlier_channels is not None:
            raise ValueError("fp8_rowwise: GPTQ rounding (a hessian) takes neither stochastic rounding nor outlier "
                             "channels; give one of them")
        check_hessian(hessian, weight.shape[1])
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / torch.finfo(FP8).max  # quantize_fp8_rowwise's scales
        rounded = gptq_round(w, hessian.to(device=w.device, dtype=torch.float32), fp8_row_grid(scale, FP8), config)
        codes = (rounded / scale[:, None]).clamp(-torch.finfo(FP8).max, torch.finfo(FP8).max).to(FP8)
        params = FP8RowwiseLayout.Params(scale=scale[:, None].contiguous(), orig_dtype=compute_dtype,
                                         orig_shape=tuple(weight.shape), outlier_index=None)
        return QuantizedTensor(codes.contiguous(), self.spec.layout, params)

    def _quantize(self, weight, *, seed):
        return FP8RowwiseLayout.quantize(weight, stochastic_rounding=seed)

    def may_be_plain_w8a8(self, values, tensor_fields):
        return "outlier_index" not in tensor_fields and values.get("outlier_index") is None

    def plain_w8a8(self, x, weight):
        qdata, p = weight._qdata, weight._params
        if (not plain_call(x, weight) or weight._layout_cls != LAYOUT or p.outlier_index is not None
                or getattr(p, "transposed", False) or qdata.device != x.device or not qdata.is_contiguous()
                or qdata.dtype != FP8 or qdata.dim() != 2 or qdata.shape[1] != x.shape[-1]):
            return None
        return "fp8_rowwise", qdata, p.scale

    def from_state_dict(self, layer, tensors, conf, compute_dtype=torch.bfloat16):
        weight = require(layer, tensors, "weight", self.spec.name)
        if weight.dtype == torch.uint8:
            weight = weight.view(FP8)
        check_matrix(layer, weight, self.spec.name, (FP8,))
        n, width = weight.shape
        index = tensors.get(OUTLIER_INDEX)
        k = width
        if index is not None:
            k = width - 2 * (index.numel() if isinstance(index, torch.Tensor) else 0)
            problem = outlier_index_problem(index, k) if k > 0 else "it names more channels than the weight has"
            if problem is None and not _repeats_indexed_columns(weight, index, k):
                problem = f"columns {k}..{width - index.numel()} do not repeat the codes of the indexed channels"
            if problem:
                raise CheckpointFormatError(
                    f"layer {layer!r} ({self.spec.name}): {OUTLIER_INDEX!r} is not a valid outlier-channel index "
                    f"of a [{n}, {width}] weight ({problem}); expected distinct int32 channels in [0, K) with the "
                    f"weight stored as [N, K + 2r]. Re-export the layer, or remove {OUTLIER_INDEX!r} and its "
                    f"columns.")
        scale = require(layer, tensors, "weight_scale", self.spec.name).float()
        check_numel(layer, scale, self.spec.name, "weight_scale", (n,))
        params = FP8RowwiseLayout.Params(scale=scale.reshape(n, 1), orig_dtype=compute_dtype, orig_shape=(n, k),
                                         outlier_index=None if index is None else index.to(weight.device))
        return QuantizedTensor(weight, LAYOUT, params)


def _repeats_indexed_columns(weight: torch.Tensor, index: torch.Tensor, k: int) -> bool:
    """Whether the stored ``[w | w[:, O] | w_lo[:, O]]`` has ``w[:, O]`` where ``index`` says (a cheap
    check that the index belongs to this weight: ``N * r`` bytes compared)."""
    r = index.numel()
    copies = weight[:, k:k + r].view(torch.uint8)
    return bool(torch.equal(copies, weight[:, :k].view(torch.uint8)[:, index.to(weight.device, torch.long)]))


FP8_ROWWISE = FP8RowwiseCodec()
