"""GPTQ Quantize Model (LowBit): quantize a MODEL with GPTQ rounding, calibrated on a few real denoising steps.

Round-to-nearest rounds every weight on its own; GPTQ (``quant/gptq.py``) chooses each layer's codes against
what the layer's inputs look like, the Hessian ``H = sum x^T x`` of its inputs. This node

1. runs ``steps`` real denoising steps of the float model (ComfyUI's sampler, as Calibrate Policy does: on the
   connected conditioning, or on each of ``prompts`` seeded stand-in text embeddings) and records the denoiser
   calls;
2. replays them with the planned layers hooked, a group at a time (their fp32 Hessians together within
   ``hessian_budget``: ``K * K * 4`` bytes a layer), and rounds each layer of a format that takes GPTQ
   (``int8``, ``int8_convrot``, ``fp8_rowwise``, ``w4a4``, ``w4a8``) against its Hessian;
3. builds the quantized model as Quantize Model does, with those weights (the other layers round to nearest).

The weights keep their format's scales, tensors and ``comfy_quant``: Save Quantized Model writes an ordinary
file of those formats (stock ComfyUI loads the native ones), and nothing changes at run time.
``gptq_quantize_model`` is the same work without the node.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

import comfy.model_management
from comfy_api.latest import io

from ..quant.gptq import GPTQConfig, HessianRecorder, hessian_groups
from ..quant.policy import W4A4_SCALE_CHOICES, Policy
from ..quant.quantize import format_options, gptq_problem, quantize_weight
from . import CATEGORY
from .calibrate import (DEFAULT_RESOLUTION, _CalibrationWeights, default_conditioning, default_latent, recorded_calls,
                        sample_for_calibration)
from .common import (AUTO, DEFAULT_MODE, KEEP_FLOAT_TOOLTIP, MODE_TOOLTIP, PRESET_TOOLTIP, RATIO_TOOLTIP,
                     W4A4_SCALES_TOOLTIP, NodeInputError, make_policy, mode_options, preset_options, progress_bar)
from .model_quant import INFO_ATTR, diffusion_model_of, model_compute_dtype, model_info, plan_for, quantize_model

log = logging.getLogger(__name__)

NODE = "GPTQ Quantize Model"
DEFAULT_STEPS = 4
DEFAULT_PROMPTS = 4  # stand-in embeddings when no conditioning is connected (one fits that prompt: see the docs)
DEFAULT_DAMP = 0.1  # the node's and the CLI's; more robust across prompts than GPTQ's usual 0.01 (docs)
DEFAULT_HESSIAN_BUDGET_GB = 4.0


def gptq_quantize_model(model_patcher, policy: Policy, *, positive=None, latent: dict | None = None,
                        steps: int = DEFAULT_STEPS, prompts: int = DEFAULT_PROMPTS, resolution: int = DEFAULT_RESOLUTION,
                        seed: int = 0, gptq: GPTQConfig = GPTQConfig(damp=DEFAULT_DAMP),
                        hessian_budget_bytes: int = int(DEFAULT_HESSIAN_BUDGET_GB * 2**30),
                        progress: Callable[[int, int], None] | None = None):
    """A quantized copy of ``model_patcher`` under ``policy``, its GPTQ formats' layers rounded by GPTQ (see the
    module docstring); the input model is not changed. ``steps`` denoising steps are recorded for the connected
    ``positive`` conditioning, or for each of ``prompts`` seeded stand-in embeddings when none is connected."""
    for value, what in ((steps, "steps"), (prompts, "prompts")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise NodeInputError(f"{what} must be a positive integer, got {value!r}")
    if isinstance(hessian_budget_bytes, bool) or hessian_budget_bytes < 1:
        raise NodeInputError(f"the Hessian budget must be a positive number of bytes, got {hessian_budget_bytes!r}")
    plan = plan_for(model_patcher, policy)
    rounded = {d.name: d for d in plan.quantized if "hessian" in format_options(d.format)}
    problem = gptq_problem(d.format for d in plan.quantized)
    if problem:
        raise NodeInputError(f"{NODE}: {problem}")
    prequantized: dict = {}
    if rounded:
        prequantized = _gptq_weights(model_patcher, policy, rounded, positive=positive, latent=latent, steps=steps,
                                     prompts=prompts, resolution=resolution, seed=seed, gptq=gptq,
                                     budget=hessian_budget_bytes, progress=progress)
    result = quantize_model(model_patcher, policy, prequantized=prequantized)
    info = model_info(result)
    if info is not None:
        source = (f"quantized in memory, {len(prequantized)} of {len(plan.quantized)} layers rounded by GPTQ on "
                  f"{steps} denoising steps (damp {gptq.damp}, act order {'on' if gptq.act_order else 'off'})")
        record = {**gptq.to_dict(), "steps": steps, "layers": len(prequantized),
                  "conditioning": f"{prompts} stand-in (seeded random) embeddings" if positive is None else "connected"}
        setattr(result.model, INFO_ATTR, dataclasses.replace(info, source=source, gptq=record))
    return result


def _gptq_weights(model_patcher, policy: Policy, rounded: dict, *, positive, latent, steps: int, prompts: int,
                  resolution: int, seed: int, gptq: GPTQConfig, budget: int, progress) -> dict:
    """``{layer: QuantizedTensor}`` of the ``rounded`` layers (plan decisions by name), on the offload device."""
    dm = diffusion_model_of(model_patcher)
    stand_in = positive is None
    conditionings = ([default_conditioning(model_patcher, seed=seed + i, node=NODE) for i in range(prompts)]
                     if stand_in else [positive])
    latent = latent if latent is not None else default_latent(model_patcher, resolution)
    log.info("LowBit: GPTQ, recording %d denoising steps of %d %s for %d layers", steps, len(conditionings),
             "stand-in prompts" if stand_in else "connected conditioning", len(rounded))
    with recorded_calls(dm) as calls:
        for i, conditioning in enumerate(conditionings):
            sample_for_calibration(model_patcher, conditioning, latent, steps, seed + i, stand_in=stand_in, node=NODE)
    comfy.model_management.load_models_gpu([model_patcher])  # still loaded after sampling, unless evicted
    device = model_patcher.load_device
    compute_dtype = model_compute_dtype(model_patcher.model)
    weights = _CalibrationWeights(dm, rounded)
    out, done = {}, 0
    groups = hessian_groups({name: d.shape[1] for name, d in rounded.items()}, budget)
    for group in groups:
        with HessianRecorder({name: dm.get_submodule(name) for name in group}, device) as recorder, torch.no_grad():
            for args, kwargs in calls:
                dm(*args, **kwargs)
        for name in group:
            hessian = recorder.hessian(name)
            if hessian is None:
                log.warning("LowBit: %s never ran while recording; it is rounded to nearest", name)
            else:
                fmt = rounded[name].format
                options = {**policy.codec_options(fmt), "hessian": hessian, "gptq": gptq}
                qt = quantize_weight(weights[name].to(device), fmt, name=name, compute_dtype=compute_dtype,
                                     options=options)
                out[name] = qt.to(device=model_patcher.offload_device)
            done += 1
            if progress is not None:
                progress(done, len(rounded))
        del recorder
    log.info("LowBit: GPTQ rounded %d layers (%d Hessian group(s), %d replayed calls each)", len(out), len(groups),
             len(calls))
    return out


class LowBitGPTQQuantizeModel(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowBitGPTQQuantizeModel",
            display_name="GPTQ Quantize Model (LowBit)",
            category=CATEGORY,
            description=(
                "Quantize a loaded diffusion model in memory like Quantize Model, with each layer's codes chosen by "
                "GPTQ against its inputs on a few real denoising steps instead of rounded to nearest: less error, "
                "the same formats, files and speed. Takes minutes on large models."),
            inputs=[
                io.Model.Input("model", tooltip="A float (bf16/fp16/fp32) diffusion model; it is not changed. LoRAs "
                               "applied to it are baked in."),
                io.Combo.Input("mode", options=mode_options(), default=DEFAULT_MODE,
                               tooltip=MODE_TOOLTIP + " GPTQ rounds the int8, int8_convrot, fp8_rowwise, w4a4 and w4a8 "
                               "layers; other formats round to nearest."),
                io.Conditioning.Input("positive", optional=True,
                                      tooltip="Your typical prompt. Without it, a seeded random embedding of the "
                                      "model's text width stands in (no text encoder runs)."),
                io.Latent.Input("latent", optional=True,
                                tooltip="Its shape sets the calibration resolution; its content is ignored."),
                io.Int.Input("steps", default=DEFAULT_STEPS, min=1, max=64, optional=True,
                             tooltip="Denoising steps recorded (euler, simple, cfg 1): more steps, more input rows "
                             "per layer and more timesteps covered."),
                io.Int.Input("prompts", default=DEFAULT_PROMPTS, min=1, max=64, optional=True,
                             tooltip="With no conditioning connected: how many seeded stand-in embeddings the steps "
                             "run on (GPTQ fitted to one prompt can do worse on others). Ignored when a "
                             "conditioning is connected."),
                io.Combo.Input("preset", options=preset_options(), default=AUTO, optional=True, tooltip=PRESET_TOOLTIP),
                io.Float.Input("int4_mixed_ratio", default=0.2, min=0.0, max=1.0, step=0.01, optional=True,
                               tooltip=RATIO_TOOLTIP),
                io.String.Input("keep_float", default="", multiline=True, optional=True, tooltip=KEEP_FLOAT_TOOLTIP),
                io.Combo.Input("w4a4_scales", options=list(W4A4_SCALE_CHOICES), default="mse", optional=True,
                               advanced=True, tooltip=W4A4_SCALES_TOOLTIP),
                io.Int.Input("resolution", default=DEFAULT_RESOLUTION, min=64, max=4096, step=16, optional=True,
                             advanced=True, tooltip="Side in pixels of the calibration latent when no latent is "
                             "connected."),
                io.Float.Input("damp", default=DEFAULT_DAMP, min=0.0001, max=1.0, step=0.001, optional=True,
                               advanced=True, tooltip="Added to each Hessian's diagonal, as a share of its mean: "
                               "larger is closer to round-to-nearest and safer on prompts the steps did not run "
                               "(GPTQ's usual value is 0.01)."),
                io.Float.Input("hessian_budget_gb", default=DEFAULT_HESSIAN_BUDGET_GB, min=0.01, max=1024.0,
                               step=0.25, optional=True, advanced=True,
                               tooltip="GPU memory the layers' Hessians may take at once (K x K x 4 bytes a layer); "
                               "the recorded steps are replayed once per group of layers that fits."),
                io.Int.Input("calibration_seed", default=0, min=0, max=2**31 - 1, optional=True, advanced=True,
                             tooltip="Seed of the noise and of the stand-in embedding."),
            ],
            outputs=[io.Model.Output(tooltip="The quantized model (a new MODEL; the input is unchanged).")],
        )

    @classmethod
    def execute(cls, model, mode: str, positive=None, latent=None, steps: int = DEFAULT_STEPS,
                prompts: int = DEFAULT_PROMPTS, preset: str = AUTO, int4_mixed_ratio: float = 0.2, keep_float: str = "",
                w4a4_scales: str = "mse", resolution: int = DEFAULT_RESOLUTION, damp: float = DEFAULT_DAMP,
                hessian_budget_gb: float = DEFAULT_HESSIAN_BUDGET_GB, calibration_seed: int = 0) -> io.NodeOutput:
        policy = make_policy(mode, preset, int4_mixed_ratio, keep_float, w4a4_scales)
        try:
            config = GPTQConfig(damp=float(damp))
        except ValueError as err:
            raise NodeInputError(f"damp: {err}") from None
        result = gptq_quantize_model(model, policy, positive=positive, latent=latent, steps=steps, prompts=prompts,
                                     resolution=resolution, seed=calibration_seed, gptq=config,
                                     hessian_budget_bytes=int(float(hessian_budget_gb) * 2**30),
                                     progress=progress_bar(f"GPTQ rounding to {mode}"))
        return io.NodeOutput(result)
