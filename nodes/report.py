"""Quantization Report (LowBit): what a quantized MODEL holds, layer by layer.

A markdown table of each quantized layer's format, shape, bytes as bf16 and bytes as stored, with
totals for the quantized layers and for the whole diffusion model. With ``measure_error`` on, each
layer also gets the relative error of its quantized linear (the format's activation quantization
and kernel) against ``F.linear`` with the dequantized weight, on a seeded random probe input: it
isolates what the run-time path adds on top of the weight rounding.

Layers that carry a SmoothQuant ``pre_quant_scale`` (written by calibration where it lowers the
layer's error) get a ``pre_quant_scale`` column (shown when any layer has one); their stored bytes
include the scale, and their probe input is multiplied by it, as the layer runs. What smoothing
changed in each layer's error is measured on real inputs by Calibrate Policy (its report).

Above the table, the policy the model was quantized with (mode, preset, how many layers a
calibration chose, from ``model.lowbit_info``), and per layer the policy rule that chose its format.
A model from Quantize with Policy carries its calibration (``lowbit_info.calibration``): each layer
then gets its *calibrated error*, the error Calibrate Policy measured for the chosen format on the
recorded denoising steps (under the calibration's objective), the errors of the other formats it
measured, and for smoothed layers the layer's own error with / without its ``pre_quant_scale``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch
from comfy_api.latest import io, ui

from ..quant.calibration_pre_quant import PRE_QUANT_SCALE
from ..quant.formats import get_format
from . import CATEGORY

BF16_BYTES = 2
PREFIX = "diffusion_model."


@dataclass(frozen=True)
class LayerRow:
    layer: str
    format: str
    shape: tuple[int, int]
    bf16_bytes: int
    stored_bytes: int
    rel_error: float | None = None  # ||linear_q - linear_deq|| / ||linear_deq||
    pre_quant_scale: bool = False  # the layer runs with a SmoothQuant pre_quant_scale


def relative_output_error(codec, qtensor, *, probe_tokens: int, seed: int, pre_quant_scale=None) -> float:
    """``||codec.linear(x, W_q) - F.linear(x, dequant(W_q))|| / ||F.linear(x, dequant(W_q))||``
    (``x`` multiplied by ``pre_quant_scale`` in its dtype first when given, as the layer runs)."""
    weight = qtensor.dequantize()
    n, k = weight.shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(probe_tokens, k, generator=gen).to(device=weight.device, dtype=weight.dtype)
    if pre_quant_scale is not None:
        x = x * pre_quant_scale.to(device=x.device, dtype=x.dtype)
    with torch.no_grad():
        reference = torch.nn.functional.linear(x.float(), weight.float())
        quantized = codec.linear(x, qtensor).float()
    denom = reference.norm()
    return float((quantized - reference).norm() / denom) if denom > 0 else 0.0


def layer_rows(layers: Iterable[tuple[str, str, object]], *, measure_error: bool = False,
               probe_tokens: int = 64, seed: int = 0,
               pre_quant_scales: Mapping[str, torch.Tensor] | None = None) -> list[LayerRow]:
    """One :class:`LayerRow` per ``(layer, format_name, qtensor)``; ``pre_quant_scales``: ``{layer: scale}``
    of the layers that carry one."""
    rows = []
    for i, (layer, fmt, qtensor) in enumerate(layers):
        codec = get_format(fmt)
        shape = tuple(int(d) for d in qtensor.shape)
        scale = (pre_quant_scales or {}).get(layer)
        stored = sum(t.numel() * t.element_size() for t in codec.state_dict(qtensor).values())
        stored += 0 if scale is None else scale.numel() * scale.element_size()
        error = relative_output_error(codec, qtensor, probe_tokens=probe_tokens, seed=seed + i,
                                      pre_quant_scale=scale) if measure_error else None
        rows.append(LayerRow(_strip(layer), fmt, shape, math.prod(shape) * BF16_BYTES, stored, error, scale is not None))
    return rows


def pre_quant_scales_of(model) -> dict[str, torch.Tensor]:
    """``{layer: pre_quant_scale}`` of the diffusion model's Linears that carry one."""
    from .model_quant import diffusion_model_of, linear_layers

    out = {}
    for name, module in linear_layers(diffusion_model_of(model)).items():
        scale = module._parameters.get(PRE_QUANT_SCALE)
        if scale is not None:
            out[name] = scale.detach()
    return out


def other_tensor_bytes(model, quantized: set[str], exclude: Mapping[str, object] | None = None) -> int:
    """Bytes of the diffusion model's tensors that are not quantized weights (kept float, biases...);
    ``exclude``: layers whose ``pre_quant_scale`` is counted with the layer instead."""
    diffusion_model = model.model.diffusion_model
    total = 0
    for name, tensor in list(diffusion_model.named_parameters()) + list(diffusion_model.named_buffers()):
        layer, _, suffix = name.rpartition(".")
        if (layer in quantized and suffix == "weight") or (layer in (exclude or {}) and suffix == PRE_QUANT_SCALE):
            continue
        total += tensor.numel() * tensor.element_size()
    return total


#: what a calibrated error is, per calibration objective
OBJECTIVE_ERRORS = {"model_output": "model-output error with only that layer in that format",
                    "layer_output": "the layer's own output error"}


def policy_line(info) -> str:
    """One line naming the policy of a model's ``lowbit_info`` (``None``: not quantized by a LowBit policy)."""
    if info is None or info.policy is None:
        return f"**policy:** none recorded ({info.source if info is not None else 'not quantized by LowBit'})"
    preset = info.plan.preset if info.plan is not None else info.policy.get("preset")
    line = f"**policy:** mode {info.policy.get('mode')}, preset {preset} ({info.source})"
    calibrated = info.policy.get("layer_formats") or {}
    record = info.calibration
    if calibrated and record is None:
        line += (f"; {len(calibrated)} layer(s) in calibrated formats (`layer_formats`; each format's measured error: "
                 f"Calibrate Policy's report)")
    elif record is not None:
        summary = record.summary
        line += (f"; {len(record.layers)} layer(s) calibrated to {summary.get('config', {}).get('budget')} "
                 f"(objective {record.objective}, summed error {summary.get('total_error', 0.0):.4g}); "
                 f"*calibrated error*: the relative {OBJECTIVE_ERRORS.get(record.objective, record.objective)}, "
                 f"measured by Calibrate Policy on the recorded denoising steps")
    return line


def format_table(rows: list[LayerRow], other_bytes: int, *, measured: bool,
                 reasons: Mapping[str, str] | None = None, calibrated: Mapping[str, object] | None = None) -> str:
    """The report as a markdown table, with totals; ``reasons``: ``{layer: policy rule}`` (a "chosen by" column);
    ``calibrated``: ``{layer: model_quant.CalibratedLayer}`` ("calibrated error" and "other formats" columns, and
    the error with / without ``pre_quant_scale`` where a layer was calibrated smoothed)."""
    smoothed = any(r.pre_quant_scale for r in rows)
    calibrated = calibrated or {}
    with_calibration = any(r.layer in calibrated for r in rows)
    smoothing_measured = any(calibrated[r.layer].pre_quant_errors for r in rows if r.layer in calibrated)
    header = ["layer", "format", "shape", "bf16", "stored", "ratio"] + (["rel. output error", "SQNR dB"] if measured else [])
    header += ["pre_quant_scale"] if smoothed else []
    header += ["calibrated error", "other formats (calibrated)"] if with_calibration else []
    header += ["pre_quant_scale: error with / without (calibrated)"] if smoothing_measured else []
    header += ["chosen by"] if reasons else []
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [r.layer, r.format, "x".join(map(str, r.shape)), _size(r.bf16_bytes), _size(r.stored_bytes),
                 f"{r.stored_bytes / r.bf16_bytes:.3f}"]
        if measured:
            cells += [f"{r.rel_error:.2e}", _sqnr(r.rel_error)]
        if smoothed:
            cells.append("yes" if r.pre_quant_scale else "-")
        if with_calibration:
            cells += _calibrated_cells(r, calibrated.get(r.layer), smoothing_measured)
        elif smoothing_measured:
            cells.append("-")
        if reasons:
            cells.append(reasons.get(r.layer, "-").replace("|", "\\|"))  # a regex alternation, escaped for markdown
        lines.append("| " + " | ".join(cells) + " |")
    before = sum(r.bf16_bytes for r in rows)
    after = sum(r.stored_bytes for r in rows)
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.format] = counts.get(r.format, 0) + 1
    summary = [
        "",
        f"**quantized layers:** {len(rows)} ({', '.join(f'{k}: {v}' for k, v in sorted(counts.items())) or 'none'})",
        f"**quantized weights:** {_size(before)} as bf16 -> {_size(after)} stored"
        + (f" ({after / before:.3f}x)" if before else ""),
        f"**other tensors (float, as stored):** {_size(other_bytes)}",
        f"**whole diffusion model:** {_size(before + other_bytes)} -> {_size(after + other_bytes)}"
        + (f" ({(after + other_bytes) / (before + other_bytes):.3f}x)" if before + other_bytes else ""),
    ]
    if measured and rows:
        worst = max(rows, key=lambda r: r.rel_error)
        summary.append(f"**largest relative output error:** {worst.rel_error:.2e} ({worst.layer}, {worst.format})")
    if smoothed:
        where = "the calibrated column above" if smoothing_measured else "Calibrate Policy's report"
        summary.append(f"**layers with a SmoothQuant pre_quant_scale:** {sum(r.pre_quant_scale for r in rows)} "
                       f"(their error with and without it: {where})")
    if with_calibration:
        worst = max((r for r in rows if r.layer in calibrated), key=lambda r: calibrated[r.layer].error)
        summary.append(f"**largest calibrated error:** {calibrated[worst.layer].error:.3e} ({worst.layer}, "
                       f"{calibrated[worst.layer].format})")
    return "\n".join(lines + summary)


def _calibrated_cells(row: LayerRow, layer, smoothing_measured: bool) -> list[str]:
    """The calibration columns of one row (``layer``: its ``CalibratedLayer``, ``None``: not calibrated)."""
    if layer is None:
        return ["-", "-"] + (["-"] if smoothing_measured else [])
    error = f"{layer.error:.3e}"
    if layer.format != row.format:  # the model holds another format than the calibration chose (a shape fallback)
        error += f" (calibrated as {layer.format})"
    others = ", ".join(f"{fmt} {value:.3e}" for fmt, value in layer.alternatives) or "-"
    cells = [error, others]
    if smoothing_measured:
        cells.append("-" if layer.pre_quant_errors is None else
                     "{:.3e} / {:.3e}".format(*layer.pre_quant_errors))
    return cells


def _strip(layer: str) -> str:
    return layer[len(PREFIX):] if layer.startswith(PREFIX) else layer


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _sqnr(rel_error: float) -> str:
    return "inf" if rel_error <= 0 else f"{-20 * math.log10(rel_error):.1f}"


class LowBitQuantizationReport(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowBitQuantizationReport",
            display_name="Quantization Report (LowBit)",
            category=CATEGORY,
            description="Show which format each layer of a quantized model uses, its size before and after, the "
                        "policy behind it, each layer's calibrated error (a model from Quantize with Policy), and "
                        "optionally the measured error of each quantized linear.",
            inputs=[
                io.Model.Input("model", tooltip="A model from Quantize Model (LowBit) or Load Diffusion Model (LowBit)."),
                io.Boolean.Input("measure_error", default=False,
                                 tooltip="Also run each quantized layer on a random probe input and report its "
                                 "relative output error against the dequantized float weight (slower)."),
                io.Int.Input("probe_tokens", default=64, min=1, max=4096, optional=True, advanced=True,
                             tooltip="Rows of the random probe input used by measure_error."),
                io.Int.Input("probe_seed", default=0, min=0, max=2**31 - 1, optional=True, advanced=True,
                             tooltip="Seed of the random probe input."),
            ],
            outputs=[io.String.Output("report", tooltip="The same table as markdown text.")],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, model, measure_error: bool, probe_tokens: int = 64, probe_seed: int = 0) -> io.NodeOutput:
        from .model_quant import model_info, quantized_layers

        info = model_info(model)
        reasons = {d.name: d.reason for d in info.plan.layers} if info is not None and info.plan is not None else None
        layers = quantized_layers(model)
        scales = pre_quant_scales_of(model)
        rows = layer_rows(layers, measure_error=measure_error, probe_tokens=probe_tokens, seed=probe_seed,
                          pre_quant_scales=scales)
        other = other_tensor_bytes(model, {_strip(layer) for layer, _, _ in layers}, exclude=scales)
        calibrated = info.calibration.by_layer() if info is not None and info.calibration is not None else None
        table = policy_line(info) + "\n\n" + format_table(rows, other, measured=measure_error, reasons=reasons,
                                                          calibrated=calibrated)
        return io.NodeOutput(table, ui=ui.PreviewText(table))
