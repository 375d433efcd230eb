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
import time
from pathlib import Path
from typing import Callable, Mapping

import torch

from .calibration_measure import takes_input_scale
from .checkpoint import CheckpointWriter, lowbit_metadata, open_checkpoint
from .convert import ConversionReport, _header_reserve, _refuse_quantized, _release_freed_memory, _warn_lossy_sources
from .errors import LowBitError, PolicyError
from .policy import Policy
from .presets import model_prefix
from .quantize import quantize_layer
from .safetensors_file import check_output_path

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
    started = time.perf_counter()
    src, dst = Path(src), Path(dst)
    with open_checkpoint(src) as reader:
        check_output_path(dst, overwrite=overwrite, protect=(src,))
        _refuse_quantized(reader)
        plan = policy.plan(dict(sorted(reader.shapes().items())))
        chosen = {d.name: d.format for d in plan.quantized}
        prefix = model_prefix(reader.shapes())
        scales = _scales_for(chosen, input_scales or {}, prefix)
        _warn_lossy_sources(reader, chosen)
        metadata = lowbit_metadata(reader.metadata, policy, plan)
        if calibration_summary is not None:
            metadata[LOWBIT_CALIBRATION_KEY] = json.dumps(dict(calibration_summary), sort_keys=True)
        reserve = _header_reserve(reader, chosen, metadata)
        total = len(reader.tensors)
        try:
            with CheckpointWriter(dst, metadata=metadata, overwrite=overwrite, protect=(src,),
                                  header_reserve=reserve) as writer:
                for done, key in enumerate(reader.tensors, start=1):
                    layer = key[: -len(".weight")] if key.endswith(".weight") else None
                    fmt = chosen.get(layer) if layer is not None else None
                    tensor = reader.read(key)
                    if fmt is None:
                        writer.add(key, tensor)
                    else:
                        if tensor.is_floating_point() and (device is None or tensor.element_size() == 1):
                            tensor = tensor.float()
                        writer.update(quantize_layer(layer, tensor, fmt, compute_dtype=compute_dtype, device=device))
                        if layer in scales:
                            writer.update(input_scale_entry(layer, scales[layer]))
                    del tensor
                    _release_freed_memory()
                    if progress is not None:
                        progress(done, total)
        except LowBitError as err:
            raise type(err)(f"{err} [converting {src}; nothing was written to {dst}]") from err
    return ConversionReport(source=src, output=dst, plan=plan, layer_counts=plan.counts(),
                            bytes_in=src.stat().st_size, bytes_out=dst.stat().st_size,
                            seconds=time.perf_counter() - started)


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
