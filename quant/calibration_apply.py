"""Write a calibrated policy into a checkpoint: formats from ``layer_formats``, static FP8 input scales.

:func:`convert_calibrated` is :func:`quant.convert.convert_file` plus, for every FP8 layer the
calibration gave a static scale, the native ``<layer>.input_scale`` (fp32 scalar) that stock
ComfyUI and LowBit quantize the layer's activations with. The header carries ``lowbit_policy``
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

from .calibration_measure import takes_input_scale
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
                       input_scales: Mapping[str, float] | None = None, calibration_summary: Mapping | None = None,
                       compute_dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                       overwrite: bool = False,
                       progress: Callable[[int, int], None] | None = None) -> ConversionReport:
    """Quantize ``src`` under ``policy`` into ``dst``, adding ``input_scales`` (layer names relative to the
    diffusion model, as in the policy) to the FP8 layers the plan quantizes."""
    with open_checkpoint(src) as reader:  # header only: the same plan convert_file makes
        shapes = dict(sorted(reader.shapes().items()))
    chosen = {d.name: d.format for d in policy.plan(shapes).quantized}
    scales = _scales_for(chosen, input_scales or {}, model_prefix(shapes))
    extra = None
    if calibration_summary is not None:
        extra = {LOWBIT_CALIBRATION_KEY: json.dumps(dict(calibration_summary), sort_keys=True)}

    def entries(layer: str, fmt: str) -> dict[str, torch.Tensor]:
        return input_scale_entry(layer, scales[layer]) if layer in scales else {}

    return convert_file(src, dst, policy, compute_dtype=compute_dtype, device=device, overwrite=overwrite,
                        progress=progress, extra_entries=entries, extra_metadata=extra)


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
