"""Calibrate Policy (LowBit) and Quantize with Policy (LowBit).

**Calibrate Policy** runs a few real denoising steps of the user's MODEL (ComfyUI's own sampler,
euler/simple, cfg 1, on the connected conditioning, or on a seeded stand-in text embedding when
none is connected), records a bounded sample of every planned Linear's inputs
(``quant/calibration_samples.py``) and the denoiser calls themselves, then measures each layer
under each candidate format: its own output error on the recorded inputs and (objective
``model_output``, the default) the model-output error when the recorded denoiser calls are replayed
with only that layer quantized. It chooses the formats that fit the budget at the least summed
error (``quant/calibrate.py``) and outputs the policy file's JSON and a markdown report; the input
model is not changed.

**Quantize with Policy** quantizes a MODEL in memory under such a policy (``layer_formats``), and
gives every FP8 layer its calibrated static ``input_scale`` (a parameter LowBit's forward and
ComfyUI's both use, and that Save Quantized Model writes natively), and every layer the
calibration smoothed its ``pre_quant_scale`` (stored weight ``W diag(1 / pre_quant_scale)``).

Which formats may carry a ``pre_quant_scale`` is decided against the running ComfyUI
(:func:`pre_quant_formats`: the native formats whose loader applies it; LowBit's own formats
always), when calibrating and again when applying: on stock ComfyUI 0.30 only LowBit's own
formats (int8_quarot, int8_hadanorm, fp8_rowwise) get one (see ``quant/calibration_pre_quant.py``).

``calibrate_model`` and ``apply_policy`` are the same work without the node wrappers (the CLI
uses ``calibrate_model``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator, Mapping
from typing import Callable

import torch

import comfy.model_management
import comfy.sample
from comfy_api.latest import io, ui

from ..quant.calibrate import OBJECTIVES, SMOOTHING_MODES, CalibrationConfig, CalibrationResult, calibrate, parse_policy
from ..quant.calibration_measure import takes_input_scale
from ..quant.calibration_outliers import FP8_ROWWISE
from ..quant.calibration_pre_quant import PRE_QUANT_SCALE, carries_pre_quant_scale
from ..quant.calibration_samples import record_linear_inputs
from ..quant.errors import LowBitError
from ..quant.policy import Policy
from . import CATEGORY
from .comfy_ops import module_codec
from .common import AUTO, PRESET_TOOLTIP, NodeInputError, preset_options, progress_bar
from .model_quant import (INFO_ATTR, CalibrationRecord, diffusion_model_of, linear_layers, model_info, plan_for,
                          quantize_model)

log = logging.getLogger(__name__)

SAMPLER, SCHEDULER, CFG = "euler", "simple", 1.0  # cfg 1: only the positive conditioning runs
DEFAULT_RESOLUTION = 512  # pixels of the stand-in latent when no latent is connected
DEFAULT_TOKENS = 128  # tokens of the stand-in text embedding
#: unet_config keys holding the width of the text embedding (cross-attention context), and of the
#: pooled vector, for the stand-in conditioning; checked in this order
CONTEXT_WIDTH_KEYS = ("context_in_dim", "context_dim", "text_dim", "joint_attention_dim", "cap_feat_dim",
                      "caption_channels", "crossattn_emb_channels", "text_states_dim")
POOLED_WIDTH_KEYS = ("vec_in_dim", "pooled_projection_dim")
BUDGET_TOOLTIP = ("Size the diffusion model may take: bytes ('7 GB', '<= 6.5 GiB', '7000000000'), or 'ratio:R' = "
                  "the size of int4_mixed with a share R of the quantized parameters in INT8.")
CANDIDATES_TOOLTIP = ("Formats each layer may take, comma separated: any of the quantization formats, or 'float'. "
                      "Default 'w4a4, int8_convrot' (int4_mixed's pair); e.g. add 'fp8' or 'float'.")


class _CalibrationWeights(Mapping):
    """Each planned layer's weight as the loaded model computes with it (pending weight patches, e.g.
    a LoRA, applied, as Quantize Model bakes them), in fp32, made one at a time when asked for."""

    def __init__(self, diffusion_model: torch.nn.Module, names):
        self._dm, self._names = diffusion_model, list(names)

    def __getitem__(self, name):
        module = self._dm.get_submodule(name)
        weight = module._parameters["weight"].detach().to(dtype=torch.float32, copy=True)
        for patch in getattr(module, "weight_function", ()):  # patches a partial (lowvram) load applies per call
            weight = patch(weight)
        return weight

    def __iter__(self):
        return iter(self._names)

    def __len__(self):
        return len(self._names)


class _ModelOutputProbe:
    """Replays the denoiser calls recorded while sampling, with one layer's product replaced, and
    measures the relative error of the model output against the float run (all calls together)."""

    def __init__(self, diffusion_model: torch.nn.Module, calls: list[tuple[tuple, dict]]):
        self._dm, self._calls = diffusion_model, calls
        self._references = self._run()

    def _run(self) -> list[torch.Tensor]:
        with torch.no_grad():
            return [self._dm(*args, **kwargs).float() for args, kwargs in self._calls]

    def for_layer(self, name: str):
        module = self._dm.get_submodule(name)

        def replace(module, args, output, replacement):
            out = replacement(args[0])
            if module.bias is not None:
                out = out + comfy.model_management.cast_to_device(module.bias, out.device, out.dtype)
            return out.to(output.dtype)

        def probe(replacement) -> float:
            handle = module.register_forward_hook(lambda m, args, output: replace(m, args, output, replacement))
            try:
                outputs = self._run()
            finally:
                handle.remove()
            noise = sum(float((o - r).double().pow(2).sum()) for o, r in zip(outputs, self._references))
            power = sum(float(r.double().pow(2).sum()) for r in self._references)
            return (noise / power) ** 0.5 if power > 0 else 0.0

        return probe


def default_conditioning(model_patcher, *, seed: int = 0, tokens: int = DEFAULT_TOKENS,
                         node: str = "Calibrate Policy"):
    """A seeded unit-variance stand-in text embedding of the model's context width (no text encoder runs);
    ``node`` names the node in the error raised when the width is unknown."""
    config = getattr(getattr(model_patcher.model, "model_config", None), "unet_config", {}) or {}
    width = next((config[k] for k in CONTEXT_WIDTH_KEYS if isinstance(config.get(k), int)), None)
    if width is None:
        raise NodeInputError(
            f"{node}: cannot tell the text-embedding width of this {type(model_patcher.model).__name__} "
            f"model (none of {', '.join(CONTEXT_WIDTH_KEYS)} in its config). Connect a CONDITIONING, e.g. from "
            f"CLIP Text Encode of a typical prompt.")
    gen = torch.Generator().manual_seed(seed)
    extra = {}
    pooled = next((config[k] for k in POOLED_WIDTH_KEYS if isinstance(config.get(k), int)), None)
    if pooled is not None:
        extra["pooled_output"] = torch.randn(1, pooled, generator=gen)
    return [[torch.randn(1, tokens, width, generator=gen), extra]]


def default_latent(model_patcher, resolution: int = DEFAULT_RESOLUTION) -> dict:
    latent_format = model_patcher.get_model_object("latent_format")
    ratio = getattr(latent_format, "spacial_downscale_ratio", 8)
    side = max(1, resolution // ratio)
    return {"samples": torch.zeros(1, latent_format.latent_channels, side, side)}


@contextlib.contextmanager
def recorded_calls(diffusion_model: torch.nn.Module) -> Iterator[list[tuple[tuple, dict]]]:
    """The ``(args, kwargs)`` of every call of ``diffusion_model`` inside the ``with`` block, for replays."""
    calls: list[tuple[tuple, dict]] = []
    handle = diffusion_model.register_forward_pre_hook(lambda _m, args, kwargs: calls.append((args, kwargs)),
                                                       with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


def sample_for_calibration(model_patcher, positive, latent: dict, steps: int, seed: int, *, stand_in: bool,
                           node: str) -> None:
    """:func:`run_denoising`; on the stand-in conditioning a failure says to connect the model's own."""
    try:
        run_denoising(model_patcher, positive, latent, steps, seed)
    except (RuntimeError, ValueError, KeyError, TypeError) as err:
        if not stand_in:
            raise
        raise NodeInputError(f"{node}: the model did not run on the stand-in conditioning ({err}); connect a "
                             f"CONDITIONING from this model's text encoder") from err


def run_denoising(model_patcher, positive, latent: dict, steps: int, seed: int) -> None:
    """``steps`` real denoising steps of ComfyUI's sampler from noise on ``latent``'s shape."""
    latent_image = comfy.sample.fix_empty_latent_channels(model_patcher, latent["samples"],
                                                          latent.get("downscale_ratio_spacial"),
                                                          latent.get("downscale_ratio_temporal"))
    noise = comfy.sample.prepare_noise(latent_image, seed, latent.get("batch_index"))
    comfy.sample.sample(model_patcher, noise, steps, CFG, SAMPLER, SCHEDULER, positive, positive, latent_image,
                        denoise=1.0, disable_pbar=True, seed=seed)


def pre_quant_formats() -> frozenset[str]:
    """The ``comfy_quant`` formats whose loader in the running ComfyUI applies a ``pre_quant_scale``
    (``comfy.quant_ops.QUANT_ALGOS[format]["parameters"]``; stock 0.30: ``nvfp4`` only)."""
    from comfy.quant_ops import QUANT_ALGOS

    return frozenset(fmt for fmt, algo in QUANT_ALGOS.items() if PRE_QUANT_SCALE in algo.get("parameters", ()))


def calibrate_model(model_patcher, config: CalibrationConfig, *, preset: str = AUTO, positive=None,
                    latent: dict | None = None, steps: int = 4, resolution: int = DEFAULT_RESOLUTION,
                    objective: str = "model_output",
                    progress: Callable[[int, int], None] | None = None) -> CalibrationResult:
    """Calibrate ``model_patcher`` (see the module docstring); the model itself is not changed.

    ``objective``: ``model_output`` replays the recorded denoiser calls once per layer and candidate
    with only that layer quantized, and minimises the sum of the squared model-output errors; ``layer_output``
    skips the replays and minimises the layers' own errors (faster, blind to how far a layer's
    error travels). ``config.pre_quant_formats`` is replaced by what this ComfyUI applies
    (:func:`pre_quant_formats`).
    """
    config = dataclasses.replace(config, pre_quant_formats=pre_quant_formats())
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise NodeInputError(f"steps must be a positive integer, got {steps!r}")
    if objective not in OBJECTIVES:
        raise NodeInputError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    base = Policy(mode="int4_mixed", preset=preset)  # decides which layers are quantizable at all
    plan = plan_for(model_patcher, base)
    base = dataclasses.replace(base, preset=plan.preset)
    names = [d.name for d in plan.quantized]
    if not names:
        raise NodeInputError(f"Calibrate Policy: the {plan.preset} preset leaves no float Linear layer to quantize "
                             f"in this model; connect a float (bf16/fp16/fp32) diffusion model")
    dm = diffusion_model_of(model_patcher)
    modules = {name: dm.get_submodule(name) for name in names}
    stand_in = positive is None
    positive = default_conditioning(model_patcher, seed=config.seed) if stand_in else positive
    latent = latent if latent is not None else default_latent(model_patcher, resolution)
    log.info("LowBit: calibrating %d layers on %d denoising steps (%s conditioning)", len(names), steps,
             "stand-in" if stand_in else "the connected")
    with recorded_calls(dm) as calls, record_linear_inputs(modules, max_rows=config.rows_per_layer,
                                                          seed=config.seed) as samplers:
        sample_for_calibration(model_patcher, positive, latent, steps, config.seed, stand_in=stand_in,
                               node="Calibrate Policy")
    samples = {name: s.sample() for name, s in samplers.items() if s.calls}
    skipped = [name for name in names if name not in samples]
    if skipped:
        log.warning("LowBit: %d planned layers never ran while calibrating (e.g. %s); they keep the int4_mixed "
                    "choice", len(skipped), skipped[0])
    comfy.model_management.load_models_gpu([model_patcher])  # still loaded after sampling, unless evicted
    probe = _ModelOutputProbe(dm, calls) if objective == "model_output" else None
    itemsize = next(iter(modules.values()))._parameters["weight"].element_size()
    source = {"steps": steps, "sampler": f"{SAMPLER}/{SCHEDULER}", "cfg": CFG, "denoiser_calls": len(calls),
              "conditioning": "stand-in (seeded random embedding)" if stand_in else "connected",
              "latent_shape": list(latent["samples"].shape), "model": type(model_patcher.model).__name__}
    return calibrate(_CalibrationWeights(dm, samples), samples, config, policy=base,
                     fixed_bytes=_other_bytes(dm, set(samples)), float_itemsize=itemsize, source=source,
                     device=model_patcher.load_device, output_error=probe.for_layer if probe else None,
                     progress=progress)


def _other_bytes(dm: torch.nn.Module, calibrated: set[str]) -> int:
    """Bytes of the diffusion model's tensors other than the calibrated layers' weights."""
    total = 0
    for name, tensor in [*dm.named_parameters(), *dm.named_buffers()]:
        if name.endswith(".weight") and name[: -len(".weight")] in calibrated:
            continue
        total += tensor.numel() * tensor.element_size()
    return total


def apply_policy(model_patcher, policy: Policy, input_scales: dict[str, float] | None = None, *,
                 pre_quant_scales: Mapping[str, torch.Tensor] | None = None,
                 outlier_channels: Mapping[str, torch.Tensor] | None = None,
                 calibration: CalibrationResult | None = None,
                 progress: Callable[[int, int], None] | None = None):
    """A quantized copy of ``model_patcher`` under ``policy``, FP8 layers carrying their static input scales
    and the layers in ``pre_quant_scales`` stored smoothed with theirs, where this ComfyUI allows it for
    the layer's format (else that layer is quantized unsmoothed, without its input scale, and a warning logged),
    and the ``fp8_rowwise`` layers in ``outlier_channels`` (``CalibrationResult.outlier_channels()``) quantized
    with theirs (a layer the plan does not quantize as ``fp8_rowwise``: not used, a warning logged).

    ``calibration``: the calibration behind ``policy``; its per-layer errors and checkpoint summary are
    recorded on the result's ``lowbit_info`` (a :class:`CalibrationRecord`, for the Report and Save nodes)."""
    named = set(policy.layer_format_map)
    if named:
        known = set(linear_layers(diffusion_model_of(model_patcher)))
        if not named & known:
            raise NodeInputError(
                f"the policy names {len(named)} layers (e.g. {min(named)!r}) and none is a Linear of this "
                f"{type(model_patcher.model).__name__} model: it was calibrated for another model. Calibrate this one.")
        if named - known:
            log.warning("LowBit: %d layers of the policy are not in this model (e.g. %s); ignored",
                        len(named - known), min(named - known))
    input_scales = dict(input_scales or {})
    smoothing = _carried_pre_quant_scales(model_patcher, policy, pre_quant_scales or {}, input_scales)
    outliers = _planned_outlier_channels(model_patcher, policy, outlier_channels or {})
    result = quantize_model(model_patcher, policy, progress=progress, pre_quant_scales=smoothing,
                            outlier_channels=outliers)
    record = CalibrationRecord.from_result(calibration) if calibration is not None else None
    _set_input_scales(result, input_scales)
    _record_calibration(result, record)
    recipe = getattr(result, "cached_patcher_init", None)
    if recipe is not None:  # a reload (ComfyUI's cached_patcher_init) must bring the scales back too
        result.cached_patcher_init = (_reload_with_scales, (recipe, input_scales, record))
    return result


def _record_calibration(model_patcher, record: CalibrationRecord | None) -> None:
    if record is None:
        return
    info = model_info(model_patcher)
    setattr(model_patcher.model, INFO_ATTR, dataclasses.replace(info, calibration=record))


def _carried_pre_quant_scales(model_patcher, policy: Policy, pre_quant_scales: Mapping[str, torch.Tensor],
                              input_scales: dict[str, float]) -> dict[str, torch.Tensor]:
    """The scales whose layer's planned format this ComfyUI applies a pre_quant_scale to; drops the
    input scales of the others (calibrated on smoothed inputs, they do not fit an unsmoothed layer)."""
    if not pre_quant_scales:
        return {}
    formats = {d.name: d.format for d in plan_for(model_patcher, policy).quantized}
    allowed = pre_quant_formats()
    out, refused = {}, []
    for name, scale in pre_quant_scales.items():
        fmt = formats.get(name)
        if fmt is not None and carries_pre_quant_scale(fmt, allowed):
            out[name] = scale
        else:
            refused.append(name)
            input_scales.pop(name, None)
    if refused:
        log.warning("LowBit: %d layer(s) of the policy carry a pre_quant_scale that this ComfyUI would not apply to "
                    "their format, or are not quantized (e.g. %s as %s); quantized unsmoothed", len(refused),
                    refused[0], formats.get(refused[0], "float"))
    return out


def _planned_outlier_channels(model_patcher, policy: Policy,
                              outlier_channels: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The outlier channels of the layers the plan quantizes as ``fp8_rowwise`` (the others are warned about)."""
    if not outlier_channels:
        return {}
    formats = {d.name: d.format for d in plan_for(model_patcher, policy).quantized}
    out = {name: index for name, index in outlier_channels.items() if formats.get(name) == FP8_ROWWISE}
    unused = sorted(set(outlier_channels) - set(out))
    if unused:
        log.warning("LowBit: %d outlier-channel set(s) name layers this plan does not quantize as fp8_rowwise "
                    "(e.g. %s as %s); not used", len(unused), unused[0], formats.get(unused[0], "float"))
    return out


def _set_input_scales(model_patcher, input_scales: dict[str, float]) -> None:
    layers = linear_layers(diffusion_model_of(model_patcher))
    for name, scale in input_scales.items():
        module = layers.get(name)
        codec = module_codec(module) if module is not None else None
        if codec is None or not takes_input_scale(codec.spec.name):
            log.warning("LowBit: input_scale for %s ignored: not an FP8 layer of this model", name)
            continue
        module.register_parameter("input_scale", torch.nn.Parameter(
            torch.tensor(float(scale), dtype=torch.float32, device=module.weight.device), requires_grad=False))


def _reload_with_scales(recipe, input_scales, record: CalibrationRecord | None = None,
                        disable_dynamic: bool = False):
    kwargs = {"disable_dynamic": True} if disable_dynamic else {}
    model = recipe[0](*recipe[1], **kwargs)
    _set_input_scales(model, input_scales)
    _record_calibration(model, record)
    return model


def policy_and_scales(text: str) -> tuple[Policy, dict[str, float], CalibrationResult | None]:
    """Parse a policy (file JSON, calibrated or bare) into the policy, its input scales and calibration."""
    if not isinstance(text, str) or not text.strip():
        raise NodeInputError("policy is empty: connect the policy output of Calibrate Policy (LowBit), or paste a "
                             "policy file's JSON")
    try:
        policy, calibration = parse_policy(text)
    except LowBitError as err:
        raise NodeInputError(f"policy: {err}") from None
    return policy, (calibration.input_scales() if calibration is not None else {}), calibration


class LowBitCalibratePolicy(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowBitCalibratePolicy",
            display_name="Calibrate Policy (LowBit)",
            category=CATEGORY,
            description=(
                "Run a few real denoising steps of the model, measure each layer's output error under each "
                "candidate format, and choose the formats that fit the budget at the least total error. Outputs a "
                "policy for Quantize with Policy (LowBit) or 'python -m lowbit quantize --policy'."),
            inputs=[
                io.Model.Input("model", tooltip="A float (bf16/fp16/fp32) diffusion model; it is not changed."),
                io.String.Input("budget", default="ratio:0.2", tooltip=BUDGET_TOOLTIP),
                io.String.Input("candidates", default="w4a4, int8_convrot", tooltip=CANDIDATES_TOOLTIP),
                io.Conditioning.Input("positive", optional=True,
                                      tooltip="The conditioning to calibrate on (your typical prompt). Without it, a "
                                      "seeded random embedding of the model's text width stands in."),
                io.Latent.Input("latent", optional=True,
                                tooltip="Its shape sets the calibration resolution (its content is ignored: the "
                                "steps start from noise). Without it: a square latent of 'resolution' pixels."),
                io.Int.Input("steps", default=4, min=1, max=50, optional=True,
                             tooltip="Denoising steps recorded (euler, simple schedule, cfg 1)."),
                io.Combo.Input("preset", options=preset_options(), default=AUTO, optional=True,
                               tooltip=PRESET_TOOLTIP),
                io.Combo.Input("smoothing", options=list(SMOOTHING_MODES), default="write", optional=True,
                               tooltip="write: measure SmoothQuant smoothing per layer and store a pre_quant_scale "
                               "where it lowers the layer's error and its format may carry one (LowBit's own "
                               "formats; a native format only if this ComfyUI's loader applies it: stock applies it "
                               "to nvfp4 only). measure: report the gain only. off: skip it (faster)."),
                io.Combo.Input("objective", options=list(OBJECTIVES), default="model_output", optional=True,
                               tooltip="model_output: replay the recorded steps once per layer and candidate with only "
                               "that layer quantized, and minimise the sum of squared model-output errors (slower, "
                               "measures how far each layer's error travels). layer_output: minimise the layers' own "
                               "errors."),
                io.Int.Input("resolution", default=DEFAULT_RESOLUTION, min=64, max=4096, step=64, optional=True,
                             advanced=True, tooltip="Side in pixels of the calibration latent when none is connected."),
                io.Int.Input("rows_per_layer", default=256, min=16, max=8192, optional=True, advanced=True,
                             tooltip="Input rows kept per layer (a uniform sample over all steps) to measure on."),
                io.Int.Input("calibration_seed", default=0, min=0, max=2**31 - 1, optional=True, advanced=True,
                             tooltip="Seed of the noise, the stand-in embedding and the row sample."),
            ],
            outputs=[
                io.String.Output("policy", tooltip="The calibrated policy file (JSON): connect it to Quantize with "
                                 "Policy (LowBit), or save it for 'python -m lowbit quantize --policy'."),
                io.String.Output("report", tooltip="The chosen format and measured errors of every layer (markdown)."),
            ],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, model, budget: str, candidates: str, positive=None, latent=None, steps: int = 4,
                preset: str = AUTO, smoothing: str = "write", objective: str = "model_output",
                resolution: int = DEFAULT_RESOLUTION, rows_per_layer: int = 256,
                calibration_seed: int = 0) -> io.NodeOutput:
        try:
            config = CalibrationConfig(budget=budget, candidates=candidates, smoothing=smoothing,
                                       rows_per_layer=rows_per_layer, seed=calibration_seed)
        except LowBitError as err:
            raise NodeInputError(f"Calibrate Policy: {err}") from None
        result = calibrate_model(model, config, preset=preset, positive=positive, latent=latent, steps=steps,
                                 resolution=resolution, objective=objective, progress=progress_bar("calibrating"))
        report = result.table()
        log.info("LowBit: %s", result.summary())
        return io.NodeOutput(result.to_json(), report, ui=ui.PreviewText(report))


class LowBitApplyPolicy(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowBitApplyPolicy",
            display_name="Quantize with Policy (LowBit)",
            category=CATEGORY,
            description=("Quantize a model in memory under a policy from Calibrate Policy (LowBit) (or a policy "
                         "file's JSON): each layer in its chosen format, FP8 layers with their calibrated input "
                         "scale, smoothed layers with their pre_quant_scale. The input model is not changed."),
            inputs=[
                io.Model.Input("model", tooltip="The float model the policy was calibrated on."),
                io.String.Input("policy", multiline=True, force_input=True,
                                tooltip="The policy output of Calibrate Policy (LowBit), or a policy file's JSON."),
            ],
            outputs=[io.Model.Output(tooltip="The quantized model (a new MODEL; the input is unchanged).")],
        )

    @classmethod
    def execute(cls, model, policy: str) -> io.NodeOutput:
        parsed, scales, calibration = policy_and_scales(policy)
        smoothing = calibration.pre_quant_scales() if calibration is not None else {}
        outliers = calibration.outlier_channels() if calibration is not None else {}
        return io.NodeOutput(apply_policy(model, parsed, scales, pre_quant_scales=smoothing,
                                          outlier_channels=outliers, calibration=calibration,
                                          progress=progress_bar("quantizing with policy")))
