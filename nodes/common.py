"""Shared pieces of LowBit's nodes: option lists, dtype names, progress bars, input errors."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from ..quant.errors import LowBitError
from ..quant.errors import PolicyError
from ..quant.policy import Policy, all_modes, compile_pattern
from ..quant.presets import preset_names
from .comfy_ops import KERNEL_BACKENDS

log = logging.getLogger(__name__)

NATIVE = "native"
AUTO = "auto"
#: the weight_dtype choices of the loader and what they mean
WEIGHT_DTYPES: dict[str, torch.dtype | None] = {
    "default": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
}
DEFAULT_MODE = "int8_convrot"
MODE_TOOLTIP = (
    "Quantization format. int8 / int8_convrot / fp8 / w4a4 / w4a8 are ComfyUI-native (stock ComfyUI loads "
    "saved files); int8_quarot / int8_hadanorm / fp8_rowwise are LowBit layouts; int4_mixed puts the most "
    "sensitive layers in int8_convrot and the rest in w4a4; int4_full puts every layer in w4a4.")
PRESET_TOOLTIP = ("Which layers stay in float and which are most sensitive. auto detects the architecture "
                  "from the model; pick one to override.")
RATIO_TOOLTIP = ("int4_mixed only: the share of quantized parameters kept in INT8 (the most sensitive "
                 "layers first). 0 = all 4-bit, 1 = all INT8.")

W4A4_SCALES_TOOLTIP = ("How w4a4 weights' per-row scales are chosen (w4a4, int4_mixed, int4_full). mse: searched "
                       "per row for the least rounding error (about 2.7 dB less weight error). absmax: comfy-kitchen's "
                       "own quantizer, bit for bit. Both give files stock ComfyUI loads.")


class NodeInputError(LowBitError):
    """A node input that cannot work (a missing file, a bad combination of options)."""


def mode_options(*, with_native: bool = False) -> list[str]:
    modes = list(all_modes())
    return [NATIVE, *modes] if with_native else modes


def preset_options() -> list[str]:
    return [AUTO, *preset_names()]


def backend_options() -> list[str]:
    return list(KERNEL_BACKENDS)


KEEP_FLOAT_TOOLTIP = (
    "More layers to keep in float, added to the preset's: regular expressions searched in the layer names "
    "(e.g. double_blocks.0.img_attn.qkv), one per line. Example: (_mod|modulation)\\.lin$ keeps Flux's "
    "per-block modulation linears in float (more accurate, about a quarter more weight memory). Empty: the preset's "
    "choice.")


def keep_float_patterns(text: str) -> tuple[str, ...]:
    """The ``keep_float`` input's regular expressions: one per non-empty line, each checked."""
    patterns = tuple(line.strip() for line in str(text or "").splitlines() if line.strip())
    for pattern in patterns:
        try:
            compile_pattern(pattern, "keep_float")
        except PolicyError as err:
            raise NodeInputError(f"{err}; write one regular expression per line, e.g. _mod\\.lin$") from None
    return patterns


def make_policy(mode: str, preset: str, int4_mixed_ratio: float, keep_float: str = "",
                w4a4_scales: str = "mse") -> Policy:
    """The policy of a node's inputs (validation errors name the bad input)."""
    return Policy(mode=mode, preset=preset, int4_mixed_ratio=float(int4_mixed_ratio),
                  extra_keep_float=keep_float_patterns(keep_float), w4a4_scales=w4a4_scales)


def weight_dtype(name: str) -> torch.dtype | None:
    try:
        return WEIGHT_DTYPES[name]
    except KeyError:
        raise NodeInputError(f"weight_dtype {name!r} is not one of {', '.join(WEIGHT_DTYPES)}") from None


def progress_bar(label: str) -> Callable[[int, int], None]:
    """A ``progress(done, total)`` callback driving ComfyUI's progress bar and logging every 10 %."""
    import comfy.utils

    state: dict = {}

    def progress(done: int, total: int) -> None:
        bar = state.get("bar")
        if bar is None:
            bar = state["bar"] = comfy.utils.ProgressBar(max(total, 1))
        bar.update_absolute(done, total)
        step = max(total // 10, 1)
        if done == total or done % step == 0:
            log.info("LowBit: %s %d/%d layers", label, done, total)

    return progress
