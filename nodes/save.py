"""Save Quantized Model (LowBit): write a quantized MODEL as a ComfyUI-native ``.safetensors`` file.

The file holds each quantized layer in the native per-layer form (``<layer>.weight`` + scales +
``<layer>.comfy_quant``) and every other tensor as stored, so stock ``UNETLoader`` (formats that
stock ComfyUI runs) and LowBit's loader read it back without quantizing again. Like stock
``ModelSave`` it writes ``output/<filename_prefix>_NNNNN_.safetensors`` and stores the workflow in the
file's metadata unless ComfyUI runs with ``--disable-metadata``.
"""

from __future__ import annotations

import json
import logging
import os

from comfy_api.latest import io, ui

from ..quant.errors import LowBitError
from . import CATEGORY

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "diffusion_models/LowBit"


class RuntimeStateError(LowBitError):
    """The model carries state that only exists at run time and would be lost in a saved file."""


def runtime_state(model) -> list[str]:
    """What on ``model`` (a ComfyUI ``ModelPatcher``) a saved file could not hold; empty when savable.

    Pending weight patches (a LoRA connected after quantization, hooks) and injections (LowBit's
    stochastic / dynamic LoRA modes) would be silently dropped. Object patches (model sampling
    settings, attention replacements...) are not weights: they are listed by :func:`unsaved_settings`
    and logged, not refused, as stock ComfyUI's model save does.
    """
    found = []
    patches = getattr(model, "patches", None) or {}
    if patches:
        found.append(f"{len(patches)} pending weight patch(es) (e.g. a LoRA applied after quantization), "
                     f"first: {next(iter(patches))}")
    hook_patches = getattr(model, "hook_patches", None) or {}
    if hook_patches:
        found.append(f"{len(hook_patches)} hook patch group(s) (scheduled LoRA / hook keyframes)")
    wrapper_patches = getattr(model, "weight_wrapper_patches", None) or {}
    if wrapper_patches:
        found.append(f"{len(wrapper_patches)} weight wrapper patch(es)")
    injections = {key: found for key, found in (getattr(model, "injections", None) or {}).items() if found}
    if injections:
        found.append(f"patcher injections {sorted(injections)} (e.g. a LowBit LoRA in stochastic or dynamic mode, "
                     f"applied when the model loads)")
    return found


def unsaved_settings(model) -> list[str]:
    """Run-time settings on ``model`` that a checkpoint does not carry (saved without them)."""
    return sorted(getattr(model, "object_patches", None) or {})


def check_savable(model) -> None:
    problems = runtime_state(model)
    if problems:
        raise RuntimeStateError(
            "Save Quantized Model: this model carries run-time-only state that a checkpoint cannot hold: "
            + "; ".join(problems)
            + ". Expected: a model straight from Quantize Model (LowBit) or Load Diffusion Model (LowBit). "
            "Fix: connect LoRA loaders and model patches *before* Quantize Model (LowBit) so they are baked "
            "into the weights, or save the model before applying them."
        )


LOWBIT_GPTQ_KEY = "lowbit_gptq"


def checkpoint_metadata(model, workflow: dict[str, str] | None) -> dict[str, str] | None:
    """The header metadata of a saved model: the workflow's (unless disabled) plus, for a model LowBit
    quantized, its version, policy and plan (what the file holds, so kept even with --disable-metadata),
    for a model quantized under a calibrated policy the ``lowbit_calibration`` summary the CLI's
    ``quantize --policy`` writes (``CalibrationResult.metadata_summary``, JSON with sorted keys), and for a
    model GPTQ Quantize Model rounded, ``lowbit_gptq`` (its settings and how many layers it rounded)."""
    from ..quant.calibration_apply import LOWBIT_CALIBRATION_KEY
    from ..quant.checkpoint import lowbit_metadata
    from ..quant.policy import Policy
    from .model_quant import model_info

    info = model_info(model)
    if info is None or info.policy is None or info.plan is None:
        return workflow
    metadata = lowbit_metadata(workflow or {}, Policy.from_dict(info.policy), info.plan)
    if info.calibration is not None:
        metadata[LOWBIT_CALIBRATION_KEY] = json.dumps(info.calibration.summary, sort_keys=True)
    if info.gptq is not None:
        metadata[LOWBIT_GPTQ_KEY] = json.dumps(info.gptq, sort_keys=True)
    return metadata


def workflow_metadata(prompt, extra_pnginfo) -> dict[str, str] | None:
    """The safetensors metadata stock save nodes write: the prompt and each ``extra_pnginfo`` entry as JSON.

    ``None`` when ComfyUI runs with ``--disable-metadata``.
    """
    from comfy.cli_args import args

    if args.disable_metadata:
        return None
    metadata = {"prompt": json.dumps(prompt) if prompt is not None else ""}
    for key, value in (extra_pnginfo or {}).items():
        metadata[key] = json.dumps(value)
    return metadata


def write_checkpoint(state_dict, path: str, metadata, progress=None) -> int:
    """Stream ``state_dict`` into ``path`` atomically (never overwriting); returns the tensor count.

    Tensors are moved to the CPU one at a time, so weights that live off-device or are materialized
    lazily (Dynamic VRAM) never need to be resident all at once.
    """
    from ..quant.checkpoint import CheckpointWriter
    from ..quant.safetensors_file import check_metadata, header_size_bound

    reserve = header_size_bound(((k, tuple(v.shape)) for k, v in state_dict.items()), check_metadata(metadata))
    with CheckpointWriter(path, metadata=metadata, overwrite=False, header_reserve=reserve) as writer:
        for i, (key, tensor) in enumerate(state_dict.items()):
            writer.add(key, tensor.detach().to("cpu"))
            if progress is not None:
                progress(i + 1)
    return len(state_dict)


class LowBitSaveQuantizedModel(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowBitSaveQuantizedModel",
            display_name="Save Quantized Model (LowBit)",
            category=CATEGORY,
            description=(
                "Save a quantized model as a ComfyUI-native .safetensors file (per-layer comfy_quant + scales) "
                "in the output folder. Load it later with Load Diffusion Model (LowBit), or with stock "
                "Load Diffusion Model for formats stock ComfyUI runs (int8, int8_convrot, fp8)."),
            inputs=[
                io.Model.Input("model", tooltip="A model from Quantize Model (LowBit) or Load Diffusion Model "
                               "(LowBit). Apply LoRAs before quantizing: they are baked in then."),
                io.String.Input("filename_prefix", default=DEFAULT_PREFIX,
                                tooltip="Path under ComfyUI's output folder; _00001_.safetensors is appended. "
                                "The default lands in output/diffusion_models/, which you can add to "
                                "extra_model_paths.yaml to load the file back."),
            ],
            outputs=[],
            hidden=[io.Hidden.prompt, io.Hidden.extra_pnginfo],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, model, filename_prefix: str) -> io.NodeOutput:
        import comfy.utils
        import folder_paths

        from .model_quant import native_state_dict, quantized_layers

        check_savable(model)
        settings = unsaved_settings(model)
        if settings:
            log.info("Save Quantized Model: saving the weights without the run-time settings %s "
                     "(not part of a checkpoint; set them again after loading)", settings)
        output_dir = folder_paths.get_output_directory()
        folder, filename, counter, subfolder, _ = folder_paths.get_save_image_path(filename_prefix, output_dir)
        name = f"{filename}_{counter:05}_.safetensors"
        path = os.path.join(folder, name)

        state_dict = native_state_dict(model)
        bar = comfy.utils.ProgressBar(max(len(state_dict), 1))
        metadata = checkpoint_metadata(model, workflow_metadata(cls.hidden.prompt, cls.hidden.extra_pnginfo))
        count = write_checkpoint(state_dict, path, metadata, progress=bar.update_absolute)

        n_quantized = len(quantized_layers(model))
        size_mb = os.path.getsize(path) / 2**20
        summary = f"saved {os.path.join(subfolder, name)}: {size_mb:.1f} MiB, {n_quantized} quantized layers, " \
                  f"{count} tensors"
        log.info("LowBit: %s", summary)
        saved = ui.PreviewText(summary).as_dict()
        saved["models"] = [{"filename": name, "subfolder": subfolder, "type": "output"}]
        return io.NodeOutput(ui=saved)
