"""Write a calibrated policy into a checkpoint: formats from ``layer_formats``, static FP8 input
scales, SmoothQuant ``pre_quant_scale``.

:func:`convert_calibrated` is :func:`quant.convert.convert_file` plus, for every FP8 layer the
calibration gave a static scale, the native ``<layer>.input_scale`` (fp32 scalar) that stock
ComfyUI and LowBit quantize the layer's activations with, and for every layer the calibration
smoothed, ``<layer>.pre_quant_scale`` next to the weight ``W diag(1 / pre_quant_scale)`` quantized
in the layer's format (see ``calibration_pre_quant.py``; a native-format layer only when
``pre_quant_formats`` says the target ComfyUI applies the scale to that format), and for every
``fp8_rowwise`` layer with calibrated outlier channels, its weight quantized with them
(``[N, K + 2r]`` plus ``<layer>.weight_outlier_index``, see ``calibration_outliers.py``). The header carries ``lowbit_policy``
(the policy, with its ``layer_formats``), ``lowbit_plan`` and ``lowbit_calibration`` (a summary:
budget, bytes, total error, formats, how the inputs were recorded). Streaming, atomic, and
refusing the same inputs as ``convert_file`` (it uses that module's checks).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Callable, Mapping

import torch

from .calibration_measure import smoothed_weight, takes_input_scale
from .calibration_outliers import FP8_ROWWISE
from .calibration_pre_quant import carries_pre_quant_scale, check_pre_quant_scale, pre_quant_entry
from .checkpoint import open_checkpoint
from .convert import ConversionReport, convert_file
from .errors import PolicyError
from .policy import Policy
from .presets import model_prefix

log = logging.getLogger(__name__)

LOWBIT_CALIBRATION_KEY = "lowbit_calibration"
INPUT_SCALE = "input_scale"


def input_scale_entry(layer: str, scale: float) -> dict[str, torch.Tensor]:
    """The native ``<layer>.input_scale`` entry (fp32 scalar, as ComfyUI's FP8 checkpoints store it)."""
    if not scale > 0:
        raise PolicyError(f"layer {layer!r}: input_scale must be positive, got {scale!r}")
    return {f"{layer}.{INPUT_SCALE}": torch.tensor(float(scale), dtype=torch.float32)}


def convert_calibrated(src: str | os.PathLike, dst: str | os.PathLike, policy: Policy, *,
                       input_scales: Mapping[str, float] | None = None,
                       pre_quant_scales: Mapping[str, torch.Tensor] | None = None,
                       pre_quant_formats: frozenset[str] = frozenset(),
                       outlier_channels: Mapping[str, torch.Tensor] | None = None,
                       calibration_summary: Mapping | None = None,
                       compute_dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                       overwrite: bool = False,
                       progress: Callable[[int, int], None] | None = None) -> ConversionReport:
    """Quantize ``src`` under ``policy`` into ``dst``, adding ``input_scales`` to the FP8 layers the plan
    quantizes and ``pre_quant_scales`` (``CalibrationResult.pre_quant_scales()``) to the layers whose
    format may carry one (``pre_quant_formats``: the native formats the target ComfyUI applies it to;
    LowBit's own formats always), and quantizes the ``fp8_rowwise`` layers of ``outlier_channels``
    (``CalibrationResult.outlier_channels()``) with theirs. Layer names are relative to the diffusion
    model, as in the policy.
    """
    with open_checkpoint(src) as reader:  # header only: the same plan convert_file makes
        shapes = dict(sorted(reader.shapes().items()))
    chosen = {d.name: d.format for d in policy.plan(shapes).quantized}
    prefix = model_prefix(shapes)
    scales = _scales_for(chosen, input_scales or {}, prefix)
    smoothing, refused = _pre_quant_for(chosen, pre_quant_scales or {}, prefix, frozenset(pre_quant_formats))
    for layer, scale in smoothing.items():  # before anything is written
        check_pre_quant_scale(layer, scale, shapes[f"{layer}.weight"][1])
    for layer in refused:  # an FP8 scale calibrated on smoothed inputs does not fit the unsmoothed layer
        if scales.pop(layer, None) is not None:
            log.warning("LowBit: %s runs unsmoothed, so its calibrated input_scale is dropped (dynamic scale)", layer)
    outliers = _outliers_for(chosen, outlier_channels or {}, prefix)
    options = {}
    if outliers:
        options["quantize_options"] = lambda layer, fmt: ({"outlier_channels": outliers[layer]}
                                                           if layer in outliers else {})
    extra = None
    if calibration_summary is not None:
        extra = {LOWBIT_CALIBRATION_KEY: json.dumps(dict(calibration_summary), sort_keys=True)}

    def entries(layer: str, fmt: str) -> dict[str, torch.Tensor]:
        out = input_scale_entry(layer, scales[layer]) if layer in scales else {}
        if layer in smoothing:
            out.update(pre_quant_entry(layer, smoothing[layer]))
        return out

    def transform_weight(layer: str, fmt: str, weight: torch.Tensor) -> torch.Tensor:
        """The weight the smoothed layer stores: ``W diag(1 / pre_quant_scale)`` (fp32), as the node path."""
        scale = smoothing.get(layer)
        return weight if scale is None else smoothed_weight(weight, scale.to(weight.device))

    return convert_file(src, dst, policy, compute_dtype=compute_dtype, device=device, overwrite=overwrite,
                        progress=progress, extra_entries=entries, extra_metadata=extra,
                        transform_weight=transform_weight if smoothing else None, **options)


def _outliers_for(chosen: Mapping[str, str], outlier_channels: Mapping[str, torch.Tensor],
                  prefix: str) -> dict[str, torch.Tensor]:
    """Full layer name -> outlier channels, for the ``fp8_rowwise`` layers of the plan that have them."""
    out = {}
    for layer, fmt in chosen.items():
        relative = layer[len(prefix):] if layer.startswith(prefix) else layer
        if relative in outlier_channels and fmt == FP8_ROWWISE:
            out[layer] = outlier_channels[relative]
    unused = sorted(set(outlier_channels) - {l[len(prefix):] if l.startswith(prefix) else l for l in out})
    if unused:
        log.warning("LowBit: %d outlier-channel set(s) name layers this plan does not quantize as fp8_rowwise "
                    "(e.g. %s); not used", len(unused), unused[0])
    return out


def _pre_quant_for(chosen: Mapping[str, str], pre_quant_scales: Mapping[str, torch.Tensor], prefix: str,
                   native_formats: frozenset[str]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(full layer name -> pre_quant_scale for the layers of the plan whose format may carry one,
    the full names of those whose format may not)."""
    out, refused = {}, []
    for layer, fmt in chosen.items():
        relative = layer[len(prefix):] if layer.startswith(prefix) else layer
        if relative not in pre_quant_scales:
            continue
        if carries_pre_quant_scale(fmt, native_formats):
            out[layer] = pre_quant_scales[relative]
        else:
            refused.append(layer)
    if refused:
        log.warning("LowBit: %d layer(s) were calibrated with a pre_quant_scale, but their format's loader would not "
                    "apply it (e.g. %s as %s); they are written unsmoothed", len(refused), refused[0],
                    chosen[refused[0]])
    unused = sorted(set(pre_quant_scales) - {l[len(prefix):] if l.startswith(prefix) else l for l in chosen})
    if unused:
        log.warning("LowBit: %d pre_quant_scale(s) name layers this plan does not quantize (e.g. %s); not written",
                    len(unused), unused[0])
    return out, refused


def _scales_for(chosen: Mapping[str, str], input_scales: Mapping[str, float], prefix: str) -> dict[str, float]:
    """Full layer name -> input scale, for the FP8 layers of the plan that have one."""
    out = {}
    for layer, fmt in chosen.items():
        relative = layer[len(prefix):] if layer.startswith(prefix) else layer
        if relative in input_scales and takes_input_scale(fmt):
            out[layer] = float(input_scales[relative])
    unused = sorted(set(input_scales) - {l[len(prefix):] if l.startswith(prefix) else l for l in out})
    if unused:
        log.warning(
            "LowBit: %d input scale(s) name layers this plan does not quantize as FP8 (e.g. %s); not written",
            len(unused), unused[0])
    return out
