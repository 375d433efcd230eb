"""Quantize Model (LowBit): quantize a loaded MODEL in memory (``nodes/model_quant.py`` does the work).

``enable``: ``as_needed`` quantizes a float model and passes an already quantized one through
unchanged; ``always`` quantizes whatever float Linear layers the policy selects and fails when
there are none; ``bypass`` passes the model through. Results are cached per input model (its
identity and its patches' uuid) and settings, through weak references, so re-running a graph does
not quantize again and the cache never keeps a model alive.
"""

from __future__ import annotations

import logging
import weakref

from comfy_api.latest import io

from ..quant.policy import W4A4_SCALE_CHOICES, Policy
from . import CATEGORY
from .common import (AUTO, DEFAULT_MODE, KEEP_FLOAT_TOOLTIP, MODE_TOOLTIP, PRESET_TOOLTIP, RATIO_TOOLTIP,
                     W4A4_SCALES_TOOLTIP, NodeInputError, make_policy, mode_options, preset_options, progress_bar)
from .model_quant import is_quantized, quantize_model

log = logging.getLogger(__name__)

ENABLE_OPTIONS = ("as_needed", "always", "bypass")


class QuantizeCache:
    """Quantized models keyed weakly by their input model, then by its patches' uuid and the settings.

    The input model is a weak key and the result a weak value: an entry lives only while ComfyUI
    (or anyone) still holds both.
    """

    def __init__(self):
        self._by_input: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @staticmethod
    def key(model, policy: Policy) -> tuple:
        settings = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in policy.to_dict().items()))
        return (getattr(model, "patches_uuid", None), settings)

    def get(self, model, policy: Policy):
        ref = self._by_input.get(model, {}).get(self.key(model, policy))
        return ref() if ref is not None else None

    def put(self, model, policy: Policy, result) -> None:
        self._by_input.setdefault(model, {})[self.key(model, policy)] = weakref.ref(result)

    def __len__(self) -> int:
        return sum(1 for entries in self._by_input.values() for ref in entries.values() if ref() is not None)


CACHE = QuantizeCache()


def quantize_node(model, mode: str, preset: str = AUTO, int4_mixed_ratio: float = 0.2, enable: str = "as_needed",
                  keep_float: str = "", w4a4_scales: str = "mse", *, cache: QuantizeCache = CACHE, progress=None):
    """The node's work: the model to pass on, quantized as the inputs ask."""
    if enable not in ENABLE_OPTIONS:
        raise NodeInputError(f"enable {enable!r} is not one of {', '.join(ENABLE_OPTIONS)}")
    if enable == "bypass":
        return model
    if enable == "as_needed" and is_quantized(model):
        log.info("LowBit: the model is already quantized; passing it on unchanged (enable=as_needed)")
        return model
    policy = make_policy(mode, preset, int4_mixed_ratio, keep_float, w4a4_scales)
    cached = cache.get(model, policy)
    if cached is not None:
        log.info("LowBit: reusing the model quantized earlier with the same input and settings")
        return cached
    result = quantize_model(model, policy, progress=progress)
    cache.put(model, policy, result)
    return result


class LowBitQuantizeModel(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowBitQuantizeModel",
            display_name="Quantize Model (LowBit)",
            category=CATEGORY,
            description=(
                "Quantize a loaded diffusion model in memory. LoRAs applied before this node are baked into the "
                "weights (once); the input model is not changed."),
            inputs=[
                io.Model.Input("model", tooltip="A float (bf16/fp16/fp32) diffusion model, e.g. from Load Diffusion "
                               "Model; LoRAs applied to it are baked in."),
                io.Combo.Input("mode", options=mode_options(), default=DEFAULT_MODE, tooltip=MODE_TOOLTIP),
                io.Combo.Input("preset", options=preset_options(), default=AUTO, optional=True, tooltip=PRESET_TOOLTIP),
                io.Float.Input("int4_mixed_ratio", default=0.2, min=0.0, max=1.0, step=0.01, optional=True,
                               tooltip=RATIO_TOOLTIP),
                io.Combo.Input("enable", options=list(ENABLE_OPTIONS), default="as_needed", optional=True,
                               tooltip="as_needed: quantize a float model, pass an already quantized one on unchanged. "
                               "always: quantize, and fail if no float layer is left to quantize. bypass: pass the "
                               "model on unchanged."),
                io.String.Input("keep_float", default="", multiline=True, optional=True, tooltip=KEEP_FLOAT_TOOLTIP),
                io.Combo.Input("w4a4_scales", options=list(W4A4_SCALE_CHOICES), default="mse", optional=True,
                               advanced=True, tooltip=W4A4_SCALES_TOOLTIP),
            ],
            outputs=[io.Model.Output(tooltip="The quantized model (a new MODEL; the input is unchanged).")],
        )

    @classmethod
    def execute(cls, model, mode: str, preset: str = AUTO, int4_mixed_ratio: float = 0.2,
                enable: str = "as_needed", keep_float: str = "", w4a4_scales: str = "mse") -> io.NodeOutput:
        return io.NodeOutput(quantize_node(model, mode, preset, int4_mixed_ratio, enable, keep_float, w4a4_scales,
                                           progress=progress_bar(f"quantizing to {mode}")))
