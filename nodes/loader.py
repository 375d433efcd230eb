"""Load Diffusion Model (LowBit): load a diffusion model file, quantized as stored or quantized while loading.

``mode = native`` loads the file as it is: every quantized layer of any LowBit format (LowBit's own
layouts and the ComfyUI-native ones) is read through its codec and runs through LowBit's ops
(``nodes/comfy_ops.py``). Any other mode quantizes a bf16/fp16/fp32/fp8 file while loading: the model
is built from the file by ComfyUI with LowBit's ops, then its Linear layers are quantized in place
(one at a time, on the compute device). :func:`load_lowbit_diffusion_model` is the node's work
without the node, and is the ``cached_patcher_init`` of the MODEL it returns.
"""

from __future__ import annotations

import inspect
import logging
import os
from dataclasses import dataclass

import torch
from comfy_api.latest import io

from ..quant.errors import CheckpointFormatError, LowBitError
from ..quant.policy import W4A4_SCALE_CHOICES, Policy
from . import CATEGORY
from .comfy_ops import KERNEL_BACKENDS, LowBitOpsConfig, default_dequantize_formats, install_input_fusion, lowbit_ops
from .common import (AUTO, KEEP_FLOAT_TOOLTIP, MODE_TOOLTIP, NATIVE, PRESET_TOOLTIP, RATIO_TOOLTIP,
                     W4A4_SCALES_TOOLTIP, WEIGHT_DTYPES, NodeInputError, backend_options, make_policy, mode_options,
                     preset_options, progress_bar, weight_dtype)
from .input_act import route_input_act_calls
from .model_quant import (INFO_ATTR, LowBitModelInfo, NotADiffusionModelError, quantize_in_place,
                          quantized_layers)

log = logging.getLogger(__name__)

LOAD_SETTINGS_VERSION = 1


@dataclass(frozen=True)
class LoadSettings:
    """The loader node's options. Validates itself."""

    mode: str = NATIVE
    weight_dtype: str = "default"
    preset: str = AUTO
    int4_mixed_ratio: float = 0.2
    backend: str = AUTO
    version: int = LOAD_SETTINGS_VERSION
    keep_float: str = ""  # more keep-float regular expressions, one per line (as Quantize Model's input)
    w4a4_scales: str = "mse"  # as Quantize Model's input (``Policy.w4a4_scales``)

    def __post_init__(self):
        if self.version != LOAD_SETTINGS_VERSION:
            raise LowBitError(f"load settings version {self.version} is not supported (expected {LOAD_SETTINGS_VERSION})")
        if self.mode not in mode_options(with_native=True):
            raise NodeInputError(f"mode {self.mode!r} is not one of {', '.join(mode_options(with_native=True))}")
        weight_dtype(self.weight_dtype)
        if self.backend not in KERNEL_BACKENDS:
            raise NodeInputError(f"kernel_backend {self.backend!r} is not one of {', '.join(KERNEL_BACKENDS)}")
        self.policy()  # validates preset and ratio

    def policy(self) -> Policy | None:
        return None if self.mode == NATIVE else make_policy(self.mode, self.preset, self.int4_mixed_ratio,
                                                            self.keep_float, self.w4a4_scales)


def read_diffusion_state_dict(path: str) -> tuple[dict[str, torch.Tensor], dict | None]:
    """The file's tensors with a checkpoint prefix removed and legacy quantization forms converted,
    exactly as ComfyUI's ``load_diffusion_model_state_dict`` prepares them."""
    import comfy.model_detection
    import comfy.utils

    name = os.path.basename(path)
    if not os.path.isfile(path):
        raise NodeInputError(f"diffusion model file not found: {path}. Expected a file in models/diffusion_models; "
                             f"fix: put the file there (or in a folder extra_model_paths.yaml lists) and refresh.")
    try:
        sd, metadata = comfy.utils.load_torch_file(path, return_metadata=True)
    except Exception as err:
        raise CheckpointFormatError(f"{name} could not be read as a model file ({type(err).__name__}: {err}). "
                                    f"Expected a .safetensors (or torch) checkpoint; fix: re-download or re-export it.") from err
    sd, metadata = comfy.utils.convert_old_quants(sd, "", metadata=metadata)
    prefix = comfy.model_detection.unet_prefix_from_state_dict(sd)
    stripped = comfy.utils.state_dict_prefix_replace(sd, {prefix: ""}, filter_keys=True)
    if stripped:
        sd, metadata = comfy.utils.convert_old_quants(stripped, "", metadata=metadata)
    return sd, metadata


def _compute_dtype(sd, metadata, explicit: torch.dtype | None, load_device) -> torch.dtype | None:
    """The dtype ComfyUI would compute a quantized model of this architecture in on ``load_device``."""
    if explicit is not None:
        return explicit
    import comfy.model_detection
    import comfy.model_management

    try:
        model_config = comfy.model_detection.model_config_from_unet(sd, "", metadata=metadata)
    except Exception:  # detection of an unusual file: ComfyUI decides below, we only lose the hint
        model_config = None
    if model_config is None:
        return None
    return comfy.model_management.unet_manual_cast(None, load_device, model_config.supported_inference_dtypes)


def load_lowbit_diffusion_model(path: str, settings: LoadSettings, disable_dynamic: bool = False, *,
                                progress=None):
    """Load ``path`` as LowBit's loader node does; returns a ComfyUI ModelPatcher."""
    import comfy.model_management
    import comfy.sd

    name = os.path.basename(path)
    sd, metadata = read_diffusion_state_dict(path)
    stored_quantized = sum(1 for k in sd if k.endswith(".comfy_quant"))
    load_device = comfy.model_management.get_torch_device()
    explicit = weight_dtype(settings.weight_dtype)
    config = LowBitOpsConfig(compute_dtype=_compute_dtype(sd, metadata, explicit, load_device), backend=settings.backend,
                             dequantize_formats=default_dequantize_formats(load_device))
    model_options = {"custom_operations": lowbit_ops(config)}
    if explicit is not None:
        model_options["dtype"] = explicit
    kwargs = {"disable_dynamic": disable_dynamic} if disable_dynamic and _takes_disable_dynamic() else {}
    keys_seen = ", ".join(sorted(sd)[:5])
    try:
        model = comfy.sd.load_diffusion_model_state_dict(sd, model_options=model_options, metadata=metadata, **kwargs)
    except LowBitError:
        raise
    except Exception as err:
        raise NotADiffusionModelError(
            f"could not build a diffusion model from {name} ({type(err).__name__}: {err}). Expected a diffusion "
            f"model file ComfyUI supports; found keys like {keys_seen}.") from err
    if model is None:
        raise NotADiffusionModelError(
            f"{name} is not a diffusion model ComfyUI recognizes (keys like {keys_seen}). Expected a diffusion model "
            f"(Flux, SD3, Wan, ...) in models/diffusion_models; fix: load text encoders, VAEs and LoRAs with their own "
            f"loaders, and full checkpoints with Load Checkpoint.")

    policy = settings.policy()
    if policy is None:
        found = len(quantized_layers(model))
        if found:
            setattr(model.model, INFO_ATTR, LowBitModelInfo(source="loaded native file", ops=config.to_dict()))
            route_input_act_calls(model.model.diffusion_model, {})
            if config.fuse_inputs and config.backend == "auto":
                install_input_fusion(model.model.diffusion_model, {})
        else:
            log.warning("LowBit: %s holds no quantized layers and mode is 'native': loaded as float. Pick a mode "
                        "to quantize it while loading.", name)
        log.info("LowBit: loaded %s as stored (%d quantized layers)", name, found)
    else:
        if stored_quantized:
            log.warning("LowBit: %s is already quantized (%d layers); they are dequantized and quantized again as %s, "
                        "which adds the errors of both. Load it with mode 'native' to keep it as stored.",
                        name, stored_quantized, policy.mode)
        plan = quantize_in_place(model, policy, config, requantize=True, progress=progress)
        setattr(model.model, INFO_ATTR, LowBitModelInfo(source="converted while loading", plan=plan,
                                                         policy=policy.to_dict(), ops=config.to_dict()))
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(plan.counts().items()))
        log.info("LowBit: loaded %s and quantized it (mode=%s, preset=%s; %s)", name, plan.mode, plan.preset, counts)
    model.cached_patcher_init = (load_lowbit_diffusion_model, (path, settings))
    return model


def _takes_disable_dynamic() -> bool:
    import comfy.sd

    return "disable_dynamic" in inspect.signature(comfy.sd.load_diffusion_model_state_dict).parameters


class LowBitLoadDiffusionModel(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        import folder_paths

        return io.Schema(
            node_id="LowBitLoadDiffusionModel",
            display_name="Load Diffusion Model (LowBit)",
            category=CATEGORY,
            description=(
                "Load a diffusion model from models/diffusion_models. mode 'native' loads a quantized file as it is "
                "(every LowBit format, including int8_quarot / int8_hadanorm / fp8_rowwise that stock ComfyUI "
                "cannot load); any other mode quantizes a bf16/fp16/fp8 file while loading."),
            inputs=[
                io.Combo.Input("unet_name", options=folder_paths.get_filename_list("diffusion_models"),
                               tooltip="The diffusion model file (models/diffusion_models)."),
                io.Combo.Input("mode", options=mode_options(with_native=True), default=NATIVE,
                               tooltip="native: load the file as stored (quantized or not). Any other mode: quantize "
                               "the file's float weights while loading. " + MODE_TOOLTIP),
                io.Combo.Input("weight_dtype", options=list(WEIGHT_DTYPES), default="default", optional=True,
                               advanced=True, tooltip="Compute dtype of the model and dtype of the layers kept in "
                               "float. default: what ComfyUI picks for this GPU."),
                io.Combo.Input("preset", options=preset_options(), default=AUTO, optional=True,
                               tooltip=PRESET_TOOLTIP + " Ignored in native mode."),
                io.Float.Input("int4_mixed_ratio", default=0.2, min=0.0, max=1.0, step=0.01, optional=True,
                               tooltip=RATIO_TOOLTIP),
                io.Combo.Input("kernel_backend", options=backend_options(), default=AUTO, optional=True, advanced=True,
                               tooltip="Which kernels run the quantized layers. auto: the fastest available; "
                               "kitchen: comfy-kitchen's; eager: pure PyTorch (slow, for checking)."),
                io.String.Input("keep_float", default="", multiline=True, optional=True,
                                tooltip=KEEP_FLOAT_TOOLTIP + " Ignored in native mode."),
                io.Combo.Input("w4a4_scales", options=list(W4A4_SCALE_CHOICES), default="mse", optional=True,
                               advanced=True, tooltip=W4A4_SCALES_TOOLTIP + " Ignored in native mode."),
            ],
            outputs=[io.Model.Output(tooltip="The diffusion model, quantized layers running through LowBit.")],
        )

    @classmethod
    def execute(cls, unet_name: str, mode: str = NATIVE, weight_dtype: str = "default", preset: str = AUTO,
                int4_mixed_ratio: float = 0.2, kernel_backend: str = AUTO, keep_float: str = "",
                w4a4_scales: str = "mse") -> io.NodeOutput:
        import folder_paths

        path = folder_paths.get_full_path("diffusion_models", unet_name)
        if path is None:
            raise NodeInputError(f"diffusion model {unet_name!r} not found in models/diffusion_models; fix: put the "
                                 f"file there (or in a folder extra_model_paths.yaml lists) and refresh the node list.")
        settings = LoadSettings(mode=mode, weight_dtype=weight_dtype, preset=preset,
                                int4_mixed_ratio=int4_mixed_ratio, backend=kernel_backend, keep_float=keep_float,
                                w4a4_scales=w4a4_scales)
        model = load_lowbit_diffusion_model(path, settings, progress=progress_bar(f"quantizing {unet_name}"))
        return io.NodeOutput(model)
