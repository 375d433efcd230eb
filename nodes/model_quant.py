"""Quantize a loaded MODEL in memory, and read a quantized MODEL back out.

Stable API (the Quantize, Load, Save and Report nodes use it):

``quantize_model(model_patcher, policy, *, compute_dtype=None, progress=None, backend="auto",
pre_quant_scales=None, outlier_channels=None) -> ModelPatcher``
    A new ModelPatcher over a new model; ``model_patcher`` and its model are not changed. Weight
    patches pending on the input (a stock LoRA) are baked into the weights first, each exactly once,
    and dropped from the result, so the result carries no patches of its own. Each Linear the plan
    quantizes holds the format's ``QuantizedTensor`` and runs LowBit's forward (its class is swapped
    to a per-model subclass of its own class; nothing global is patched). Raises
    :class:`NothingToQuantizeError` when no float layer is left to quantize.
``quantize_in_place(model_patcher, policy, config, ...)``
    The same on a model the caller owns (the loader's freshly built model); returns the plan.
``native_state_dict(model_patcher) -> dict[str, Tensor]``
    The diffusion model in ComfyUI's native checkpoint form, keyed as a ``diffusion_models`` file
    (no ``model.diffusion_model.`` prefix): per quantized layer ``<layer>.comfy_quant`` and the
    codec's tensors (``quant/native.py`` ``layer_tensors``), every other tensor as stored. Pending
    weight patches are NOT applied (callers refuse or bake them first).
``quantized_layers(model_patcher) -> list[(layer, format_name, QuantizedTensor)]``
    Every Linear of the diffusion model whose weight LowBit can run, in model order; ``layer`` is
    relative to the diffusion model, ``format_name`` a ``quant.formats.FORMATS`` key.
``is_quantized(model_patcher) -> bool`` and ``model_info(model_patcher) -> LowBitModelInfo | None``
    Whether the model already holds quantized weights; what LowBit recorded when it made it (with
    the :class:`CalibrationRecord` when Quantize with Policy applied a calibrated policy).
"""

from __future__ import annotations

import copy
import logging
import uuid
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

import comfy.lora
import comfy.model_management
import comfy.utils
from comfy_kitchen.tensor import QuantizedTensor

from ..quant import presets
from ..quant.calibration_measure import smoothed_weight
from ..quant.calibration_pre_quant import check_pre_quant_scale
from ..quant.errors import LowBitError
from ..quant.formats import FormatCodec, format_for_comfy_quant, get_format
from ..quant.native import COMFY_QUANT, decode_comfy_quant
from ..quant.policy import Plan, Policy
from ..quant.quantize import check_quantize_options, quantize_weight
from .comfy_ops import (COMPUTE_DTYPES, PRE_QUANT_SCALE, LowBitOpsConfig, default_dequantize_formats,
                        install_input_fusion, lowbit_linear_class, mark_quantized, module_codec, set_pre_quant_scale)
from .input_act import route_input_act_calls

log = logging.getLogger(__name__)

DIFFUSION_PREFIX = "diffusion_model."
INFO_ATTR = "lowbit_info"
#: per-module attributes that only describe a model's current load state (never copied)
#: (Dynamic VRAM's vbar allocation and pinned host buffers above all: sharing them corrupts both models)
_RUNTIME_ATTRS = ("_v", "_v_signature", "_v_weight", "_v_bias", "_prefetch", "_pin_state", "_pins", "seed_key",
                  "weight_lowvram_function", "bias_lowvram_function", "comfy_patched_weights",
                  "forward",  # an instance forward is a hook's leftover (a bypass eject), bound to the source module
                  # newer ComfyUI (Dynamic VRAM by blocks, allocation graphs): a block's vbar slot and CUDA graph
                  "_v_block", "_v_block_faulted", "_comfy_graph", "_compiled_prefetch_ring", "_comfy_cross_step_state")
#: model-level load bookkeeping reset on a copy (ModelPatcher.__init__ recreates the dynamic ones);
#: ``current_patcher`` is the patcher a sampler runs the model with (ModelPatcher.pre_run sets it, cleanup
#: clears it; BaseModel.apply_model turns Dynamic VRAM prefetching on from it): a copy has none yet
_MODEL_STATE = {"model_loaded_weight_memory": 0, "lowvram_patch_counter": 0, "model_lowvram": False,
                "current_weight_patches_uuid": None, "model_offload_buffer_memory": 0, "current_patcher": None}
_MODEL_DYNAMIC_ATTRS = ("dynamic_vbars", "dynamic_pins", "dynamic_patchers")


class NotADiffusionModelError(LowBitError):
    """The MODEL (or file) has no diffusion model LowBit can quantize."""


class NothingToQuantizeError(LowBitError):
    """The policy leaves no float Linear layer to quantize."""


@dataclass(frozen=True)
class CalibratedLayer:
    """What Calibrate Policy measured on one layer, as the Quantization Report shows it.

    Errors are relative errors under the calibration's objective (``CalibrationRecord.objective``):
    the model-output error with only this layer in that format (``model_output``), or the layer's own
    output error (``layer_output``); each format as it runs (smoothed where the calibration smoothed it).
    """

    name: str  # relative to the diffusion model
    format: str  # the chosen format, or "float"
    errors: tuple[tuple[str, float], ...]  # (format, error) of every measured format, the chosen one first
    #: the layer's own error (with, without) its pre_quant_scale, when the chosen format runs smoothed
    pre_quant_errors: tuple[float, float] | None = None

    @property
    def error(self) -> float:
        """The chosen format's error (what the calibration's choice minimised, summed over layers)."""
        return dict(self.errors)[self.format]

    @property
    def alternatives(self) -> tuple[tuple[str, float], ...]:
        return tuple((fmt, error) for fmt, error in self.errors if fmt != self.format)


@dataclass(frozen=True)
class CalibrationRecord:
    """The calibration a model was quantized under (Quantize with Policy): per-layer errors and the
    ``lowbit_calibration`` summary a saved checkpoint carries (``CalibrationResult.metadata_summary``)."""

    objective: str  # "model_output" or "layer_output"
    summary: dict  # CalibrationResult.metadata_summary(), JSON-ready
    layers: tuple[CalibratedLayer, ...]

    @classmethod
    def from_result(cls, result) -> "CalibrationRecord":
        """From a ``quant.calibrate.CalibrationResult``."""
        layers = []
        for layer in result.layers:
            chosen = layer.chosen
            errors = [(layer.format, layer.cost(layer.format, result.objective))]
            errors += [(m.format, layer.cost(m.format, result.objective)) for m in layer.measured
                       if m.format != layer.format]
            smoothed = (chosen.smoothed_error, chosen.error) if chosen.smoothed else None
            layers.append(CalibratedLayer(layer.name, layer.format, tuple(errors), smoothed))
        return cls(objective=result.objective, summary=result.metadata_summary(), layers=tuple(layers))

    def by_layer(self) -> dict[str, CalibratedLayer]:
        return {layer.name: layer for layer in self.layers}


@dataclass(frozen=True)
class LowBitModelInfo:
    """What LowBit recorded on a model it quantized or loaded (``model.lowbit_info``)."""

    source: str  # "quantized in memory", "converted while loading", "loaded native file"
    plan: Plan | None = None
    policy: dict | None = None
    ops: dict = field(default_factory=dict)
    baked_patches: int = 0
    calibration: CalibrationRecord | None = None  # set by Quantize with Policy from a calibrated policy
    gptq: dict | None = None  # set by GPTQ Quantize Model: how its layers were rounded (``lowbit_gptq`` in a file)


# ---- queries ------------------------------------------------------------------------------------

def diffusion_model_of(model_patcher) -> torch.nn.Module:
    model = getattr(model_patcher, "model", None)
    dm = getattr(model, "diffusion_model", None)
    if not isinstance(dm, torch.nn.Module):
        raise NotADiffusionModelError(
            f"expected a diffusion MODEL (a ComfyUI ModelPatcher with model.diffusion_model), found "
            f"{type(model_patcher).__name__} wrapping {type(model).__name__}. Connect the MODEL output of a "
            f"diffusion model loader.")
    return dm


def model_info(model_patcher) -> LowBitModelInfo | None:
    return getattr(getattr(model_patcher, "model", None), INFO_ATTR, None)


def linear_layers(diffusion_model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Every Linear-like module (``in_features``/``out_features`` and a ``[out, in]`` weight)."""
    out = {}
    for name, module in diffusion_model.named_modules():
        weight = module._parameters.get("weight") if name else None
        if weight is None or not hasattr(module, "in_features") or not hasattr(module, "out_features"):
            continue
        if tuple(weight.shape) == (module.out_features, module.in_features):
            out[name] = module
    return out


def _codec_of(name: str, module: torch.nn.Module) -> FormatCodec | None:
    """The codec that describes ``module``'s quantized weight (LowBit-run or loaded by stock ComfyUI)."""
    codec = module_codec(module)
    if codec is not None:
        return codec
    sd = module.state_dict(prefix=f"{name}.")
    raw = sd.get(f"{name}.{COMFY_QUANT}")
    if raw is None:
        return None
    try:
        return format_for_comfy_quant(decode_comfy_quant(name, raw))
    except LowBitError:
        return None  # a format only ComfyUI knows (nvfp4, mxfp8)


def quantized_layers(model_patcher) -> list[tuple[str, str, QuantizedTensor]]:
    """``(layer, format_name, weight)`` for each Linear whose quantized weight LowBit can run."""
    layers = []
    for name, module in linear_layers(diffusion_model_of(model_patcher)).items():
        weight = module._parameters["weight"]
        if not isinstance(weight, QuantizedTensor):
            continue
        codec = _codec_of(name, module)
        if codec is None:
            log.info("LowBit: layer %s holds a %s weight LowBit does not read; not listed", name, weight._layout_cls)
            continue
        layers.append((name, codec.spec.name, weight))
    return layers


def is_quantized(model_patcher) -> bool:
    """Whether the model is already quantized: LowBit made it, or a Linear holds a quantized weight."""
    if model_info(model_patcher) is not None:
        return True
    return any(isinstance(m._parameters["weight"], QuantizedTensor)
               for m in linear_layers(diffusion_model_of(model_patcher)).values())


def native_state_dict(model_patcher) -> dict[str, torch.Tensor]:
    """The diffusion model's weights in native checkpoint form (see the module docstring)."""
    dm = diffusion_model_of(model_patcher)
    ensure_unpatched(model_patcher)
    sd = dm.state_dict()  # LowBit and ComfyUI quantized Linears write their native form themselves
    return {k: v.detach() for k, v in sd.items()}


# ---- quantization -------------------------------------------------------------------------------

def ensure_unpatched(model_patcher, *, offloaded: bool = False) -> None:
    """Make the model's parameters hold its unpatched weights (unloading it if patches are applied).

    ``offloaded``: also unload it when any weight sits on the compute device, so every parameter is
    on the offload device (where a copy's weights must live).
    """
    model = model_patcher.model
    loaded = getattr(model, "model_loaded_weight_memory", 0) > 0
    if model_patcher.backup or (offloaded and loaded):
        log.info("LowBit: unloading %s to read its unpatched weights", type(model).__name__)
        comfy.model_management.unload_model_and_clones(model_patcher)
    if model_patcher.backup:  # patched outside the model manager: restore the originals ourselves
        model_patcher.unpatch_model(model_patcher.offload_device)


def resolve_preset(policy: Policy, model_patcher, shapes) -> presets.Preset:
    """The preset a policy uses on this model: the named one, or detected from the model's ComfyUI
    classes (``presets.detect_preset_from_classes``, where present) and then its state-dict shapes."""
    if policy.preset != "auto":
        return presets.get_preset(policy.preset)
    by_classes = getattr(presets, "detect_preset_from_classes", None)
    if by_classes is None:
        return presets.detect_preset(shapes)
    model = model_patcher.model
    classes = [_qualname(getattr(model, "model_config", None)), _qualname(getattr(model, "diffusion_model", None))]
    return by_classes([c for c in classes if c], shapes)


def _qualname(obj) -> str | None:
    return None if obj is None else f"{type(obj).__module__}.{type(obj).__qualname__}"


def plan_for(model_patcher, policy: Policy, *, requantize: bool = False) -> Plan:
    """The policy's plan over the diffusion model's Linear weights (quantized ones only if ``requantize``)."""
    dm = diffusion_model_of(model_patcher)
    linears = linear_layers(dm)
    shapes = {f"{name}.weight": tuple(m._parameters["weight"].shape) for name, m in linears.items()
              if requantize or not isinstance(m._parameters["weight"], QuantizedTensor)}
    all_shapes = {name: tuple(p.shape) for name, p in dm.named_parameters()}
    return policy.plan(shapes, preset=resolve_preset(policy, model_patcher, all_shapes))


def _nothing_to_quantize(model_patcher, plan: Plan) -> NothingToQuantizeError:
    already = quantized_layers(model_patcher)
    kept = plan.counts().get("float", 0)
    found = f"{len(already)} Linear layers already quantized" if already else "no quantized layers"
    return NothingToQuantizeError(
        f"nothing to quantize: the policy (mode={plan.mode}, preset={plan.preset}) leaves no float Linear layer "
        f"to quantize; found {found} and {kept} kept in float by the preset. Expected a float (bf16/fp16/fp32) "
        f"diffusion model. Fix: quantize the float model (load it with stock Load Diffusion Model), or pass an "
        f"already quantized model straight on (Quantize Model enable=as_needed does that).")


def model_compute_dtype(model) -> torch.dtype:
    """The dtype ComfyUI computes this model in (its manual-cast dtype, else its weight dtype)."""
    dtype = getattr(model, "manual_cast_dtype", None)
    if dtype is None and hasattr(model, "get_dtype"):
        dtype = model.get_dtype()
    return dtype if dtype in COMPUTE_DTYPES else torch.bfloat16


def quantize_in_place(model_patcher, policy: Policy, config: LowBitOpsConfig, *, plan: Plan | None = None,
                      requantize: bool = False, bake_patches: bool = False,
                      pre_quant_scales: Mapping[str, torch.Tensor] | None = None,
                      outlier_channels: Mapping[str, torch.Tensor] | None = None,
                      prequantized: Mapping[str, QuantizedTensor] | None = None,
                      progress: Callable[[int, int], None] | None = None) -> Plan:
    """Quantize the Linears of ``model_patcher``'s own model as the plan says (the caller owns the model).

    ``requantize``: dequantize already quantized layers and quantize them again (file conversion;
    a layer's old ``pre_quant_scale`` is multiplied back in first). ``bake_patches``: merge
    ``model_patcher.patches`` of the quantized layers into their weights (the caller then drops
    them). ``pre_quant_scales``: ``{layer: [K] scale}`` (names relative to the diffusion model): those
    layers store ``W diag(1 / scale)`` and carry the scale (the caller checked their formats may).
    ``outlier_channels``: ``{layer: int32 [r] channels}`` for ``fp8_rowwise`` layers (calibrated, see
    ``quant/calibration_outliers.py``): those layers are quantized with them (weight ``[N, K + 2r]``);
    a layer the plan does not quantize as ``fp8_rowwise`` raises a :class:`LowBitError`. Every layer also
    gets the policy's options for its format (:meth:`Policy.codec_options`). ``prequantized``: ``{layer:
    QuantizedTensor}`` made already from this model's weights with its patches baked (GPTQ, ``nodes/gptq.py``):
    those layers take them as they are, in the plan's format (checked), instead of being quantized here.
    Returns the plan used.
    """
    pre_quant_scales = dict(pre_quant_scales or {})
    prequantized = dict(prequantized or {})
    plan = plan or plan_for(model_patcher, policy, requantize=requantize)
    if not plan.quantized:
        raise _nothing_to_quantize(model_patcher, plan)
    outlier_channels = dict(outlier_channels or {})
    _check_outlier_layers(plan, outlier_channels)
    _check_prequantized(plan, prequantized, set(pre_quant_scales) | set(outlier_channels))
    dm = model_patcher.model.diffusion_model
    device = model_patcher.load_device
    compute_dtype = config.compute_dtype or model_compute_dtype(model_patcher.model)
    patches = model_patcher.patches if bake_patches else {}
    classes: dict[type, type] = {}
    total = len(plan.quantized)
    for done, decision in enumerate(plan.quantized, 1):
        module = dm.get_submodule(decision.name)
        stored = module._parameters["weight"]
        home = stored.device
        ready = prequantized.get(decision.name)
        if ready is not None:
            module.__class__ = lowbit_linear_class(type(module), classes)
            mark_quantized(module, get_format(decision.format), ready.to(device=home), config)
            if progress is not None:
                progress(done, total)
            continue
        if isinstance(stored, QuantizedTensor):
            weight = stored.to(device=device, dtype=torch.float32).dequantize()  # dequantized in fp32
            old_scale = module._parameters.get(PRE_QUANT_SCALE)
            if old_scale is not None:  # the stored weight is smoothed: back to the layer's own weight
                weight = weight * old_scale.to(device=device, dtype=torch.float32)
        else:
            weight = stored.to(device=device, dtype=torch.float32, copy=True)
        key = f"{DIFFUSION_PREFIX}{decision.name}.weight"
        if key in patches:
            weight = comfy.lora.calculate_weight(patches[key], weight, key, intermediate_dtype=torch.float32)
        scale = pre_quant_scales.get(decision.name)
        if scale is not None:
            check_pre_quant_scale(decision.name, scale, weight.shape[1])
            weight = smoothed_weight(weight, scale.to(device))
        options = policy.codec_options(decision.format)
        channels = outlier_channels.get(decision.name)
        if channels is not None:
            options["outlier_channels"] = channels
        qt = quantize_weight(weight, decision.format, name=decision.name, compute_dtype=compute_dtype, options=options)
        del weight
        module.__class__ = lowbit_linear_class(type(module), classes)
        mark_quantized(module, get_format(decision.format), qt.to(device=home), config)
        set_pre_quant_scale(module, scale, layer=decision.name, device=home)
        if progress is not None:
            progress(done, total)
    route_input_act_calls(dm, {})
    if config.fuse_inputs and config.backend == "auto":
        install_input_fusion(dm, classes)
    return plan


def _check_prequantized(plan: Plan, prequantized: Mapping[str, QuantizedTensor], other: set[str]) -> None:
    """Every prequantized layer must be one the plan quantizes, in that format's layout and shape, and take no
    pre_quant_scale or outlier channels besides (checked before any weight is touched)."""
    planned = {d.name: d for d in plan.quantized}
    for name, qt in prequantized.items():
        decision = planned.get(name)
        if decision is None:
            raise LowBitError(f"a quantized weight was given for {name!r}, a layer the plan does not quantize; give "
                              f"only the plan's layers (names relative to the diffusion model)")
        codec = get_format(decision.format)
        if not isinstance(qt, QuantizedTensor) or qt._layout_cls != codec.spec.layout:
            found = qt._layout_cls if isinstance(qt, QuantizedTensor) else type(qt).__name__
            raise LowBitError(f"layer {name!r}: the quantized weight given is {found}, but the plan quantizes the "
                              f"layer as {decision.format} ({codec.spec.layout}); quantize it with the plan's format")
        if tuple(qt.shape) != tuple(decision.shape):
            raise LowBitError(f"layer {name!r}: the quantized weight given is {list(qt.shape)}, the layer's weight "
                              f"{list(decision.shape)}; it belongs to another model")
        if name in other:
            raise LowBitError(f"layer {name!r} was given a quantized weight and a pre_quant_scale or outlier "
                              f"channels; a prequantized weight carries what it was made with, give one of them")


def _check_outlier_layers(plan: Plan, outlier_channels: Mapping[str, torch.Tensor]) -> None:
    """Every layer given outlier channels must be one the plan quantizes in a format that takes them
    (checked before any weight is touched)."""
    planned = {d.name: d.format for d in plan.quantized}
    missing = sorted(set(outlier_channels) - set(planned))
    if missing:
        raise LowBitError(
            f"outlier channels were given for {len(missing)} layer(s) the plan does not quantize (e.g. "
            f"{missing[0]!r}); expected fp8_rowwise layers of this model's plan (names relative to the diffusion "
            f"model). Pass only the plan's fp8_rowwise layers (a calibrated policy's outlier_channels() are).")
    for name, channels in outlier_channels.items():
        check_quantize_options(name, planned[name], {"outlier_channels": channels})


def quantize_model(model_patcher, policy: Policy, *, compute_dtype: torch.dtype | None = None,
                   progress: Callable[[int, int], None] | None = None, backend: str = "auto",
                   pre_quant_scales: Mapping[str, torch.Tensor] | None = None,
                   outlier_channels: Mapping[str, torch.Tensor] | None = None, fuse_inputs: bool = True,
                   prequantized: Mapping[str, QuantizedTensor] | None = None):
    """A quantized copy of ``model_patcher`` (see the module docstring); the input is not changed.

    ``pre_quant_scales``: layers stored smoothed with a ``pre_quant_scale``; ``outlier_channels``:
    ``fp8_rowwise`` layers quantized with their calibrated outlier channels; ``prequantized``: layers whose
    quantized weight was made already (GPTQ) (all as :func:`quantize_in_place`). ``fuse_inputs``:
    ``LowBitOpsConfig.fuse_inputs`` (the norms, GELUs and SwiGLUs feeding quantized linears computed inside their
    activation quantization)."""
    diffusion_model_of(model_patcher)
    plan = plan_for(model_patcher, policy)
    if not plan.quantized:
        raise _nothing_to_quantize(model_patcher, plan)
    _check_outlier_layers(plan, outlier_channels or {})
    _check_prequantized(plan, prequantized or {}, set(pre_quant_scales or {}) | set(outlier_channels or {}))
    ensure_unpatched(model_patcher, offloaded=True)
    source = model_patcher.model
    config = LowBitOpsConfig(compute_dtype=compute_dtype or model_compute_dtype(source), backend=backend,
                             dequantize_formats=default_dequantize_formats(model_patcher.load_device),
                             fuse_inputs=fuse_inputs)
    new_model = copy_model(source, model_patcher.offload_device)
    patched = model_patcher.clone(model_override=(new_model, ({}, {}, {}, set())))
    patched.patches = {k: list(v) for k, v in model_patcher.patches.items()}  # read by quantize_in_place only
    quantize_in_place(patched, policy, config, plan=plan, bake_patches=True, pre_quant_scales=pre_quant_scales,
                      outlier_channels=outlier_channels, prequantized=prequantized, progress=progress)
    baked = _bake_remaining_patches(model_patcher, new_model, plan)
    _finish_copy(patched, model_patcher)
    new_model.lowbit_info = LowBitModelInfo(source="quantized in memory", plan=plan, policy=policy.to_dict(),
                                            ops=config.to_dict(), baked_patches=baked)
    patched.cached_patcher_init = _reload_recipe(model_patcher, policy, compute_dtype, backend, pre_quant_scales,
                                                 outlier_channels, fuse_inputs, prequantized)
    counts = ", ".join(f"{k}: {v}" for k, v in sorted(plan.counts().items()))
    log.info("LowBit: quantized %s in memory (mode=%s, preset=%s; %s; %d LoRA/weight patches baked)",
             type(source).__name__, plan.mode, plan.preset, counts, baked)
    return patched


def _bake_remaining_patches(model_patcher, new_model, plan: Plan) -> int:
    """Apply the input's patches of weights the plan did not quantize (biases, float layers)."""
    quantized = {f"{DIFFUSION_PREFIX}{d.name}.weight" for d in plan.quantized}
    device = model_patcher.load_device
    for key in model_patcher.patches:
        if key in quantized:
            continue
        home = comfy.utils.get_attr(new_model, key).device
        value = model_patcher.patch_weight_to_device(key, device_to=device, return_weight=True)
        comfy.utils.set_attr_param(new_model, key, value.to(device=home))
    return len(model_patcher.patches)


def _finish_copy(patched, source_patcher) -> None:
    """Make the clone a patcher of its own model: no patches, no parent, fresh sizes and hook caches."""
    patched.patches = {}
    patched.patches_uuid = uuid.uuid4()
    patched.parent = None  # ComfyUI's model manager would otherwise fall back to the float model's patcher
    # other weights: not one of the float model's clones to unload_model_and_clones (which ensure_unpatched
    # calls on the float model) or to the multi-GPU clone matching (clone_has_same_weights)
    patched.clone_base_uuid = uuid.uuid4()
    patched.size = 0
    patched.hook_backup = {}
    patched.cached_hook_patches = {}


def _reload_recipe(model_patcher, policy: Policy, compute_dtype, backend: str, pre_quant_scales=None,
                   outlier_channels=None, fuse_inputs: bool = True, prequantized=None):
    """``cached_patcher_init`` for the quantized patcher: rebuild the source, re-apply patches, quantize (the
    ``prequantized`` weights, kept by the recipe, as they are: a GPTQ rounding is not made again)."""
    source_init = getattr(model_patcher, "cached_patcher_init", None)
    if source_init is None:
        return None
    patches = {k: list(v) for k, v in model_patcher.patches.items()}
    return (reload_quantized, (source_init, policy, compute_dtype, backend, patches, dict(pre_quant_scales or {}),
                               dict(outlier_channels or {}), fuse_inputs, dict(prequantized or {})))


def reload_quantized(source_init, policy: Policy, compute_dtype, backend: str, patches: dict,
                     pre_quant_scales: dict | None = None, outlier_channels: dict | None = None,
                     fuse_inputs: bool = True, prequantized: dict | None = None, disable_dynamic: bool = False):
    """Rebuild a model :func:`quantize_model` made (ComfyUI's ``cached_patcher_init`` protocol)."""
    kwargs = {"disable_dynamic": True} if disable_dynamic else {}
    source = source_init[0](*source_init[1], **kwargs)
    if len(source_init) > 2:
        source = source[source_init[2]]
    if patches:
        source = source.clone()
        source.patches = {k: list(v) for k, v in patches.items()}
        source.patches_uuid = uuid.uuid4()
    return quantize_model(source, policy, compute_dtype=compute_dtype, backend=backend,
                          pre_quant_scales=pre_quant_scales, outlier_channels=outlier_channels, fuse_inputs=fuse_inputs,
                          prequantized=prequantized)


# ---- copying a model without copying its weights ------------------------------------------------

def copy_model(model: torch.nn.Module, offload_device=None) -> torch.nn.Module:
    """A new module tree over the same weight storage: new modules and Parameter objects, no tensor copies.

    Replacing a weight on the copy (or moving the copy between devices) never touches ``model``.
    Load-state bookkeeping (lowvram functions, Dynamic VRAM allocations) is not carried over.
    """
    new = _copy_module(model, {})
    for name, value in _MODEL_STATE.items():
        if name in new.__dict__:
            setattr(new, name, value)
    for name in _MODEL_DYNAMIC_ATTRS + (INFO_ATTR,):
        new.__dict__.pop(name, None)
    if offload_device is not None and "device" in new.__dict__:
        new.device = offload_device
    return new


def _copy_module(module: torch.nn.Module, memo: dict[int, torch.nn.Module]) -> torch.nn.Module:
    if id(module) in memo:
        return memo[id(module)]
    new = copy.copy(module)
    memo[id(module)] = new
    state = new.__dict__
    for name in _RUNTIME_ATTRS:
        state.pop(name, None)
    if "prev_comfy_cast_weights" in state:
        state["comfy_cast_weights"] = state.pop("prev_comfy_cast_weights")
    for name in ("weight_function", "bias_function"):
        if name in state:
            state[name] = []
    for name, value in list(state.items()):
        if isinstance(value, (dict, list, set)) and name not in ("_parameters", "_modules"):
            state[name] = copy.copy(value)
    state["_parameters"] = type(module._parameters)(
        (k, None if p is None else torch.nn.Parameter(p.detach(), requires_grad=p.requires_grad))
        for k, p in module._parameters.items())
    state["_modules"] = type(module._modules)(
        (k, None if c is None else _copy_module(c, memo)) for k, c in module._modules.items())
    return new
