"""Attention Backend (LowBit): run a model's attention on the fastest backend for each shape.

The node clones the model and sets ComfyUI's per-model ``optimized_attention_override`` (the key
ComfyUI 0.30 reads in ``wrap_attn``, and the one newer ComfyUI's own attention-backend node writes).
Nothing global changes: other models keep ComfyUI's attention. The override adapts ComfyUI's
attention call (``q, k, v, heads, mask, skip_reshape, skip_output_reshape, scale, enable_gqa``) to
``kernels.attention.AttentionChooser``; calls it cannot take (a batch above ComfyUI's SDPA batch
limit, grouped heads in the flat layout) go to ComfyUI's own attention unchanged.
"""

from __future__ import annotations

import logging

import torch
from comfy_api.latest import io

from . import CATEGORY
from ..kernels.attention import BACKEND_CHOICES, AttentionChooser, AttentionConfig, AttentionConfigError
from .common import NodeInputError

log = logging.getLogger(__name__)

OVERRIDE_KEY = "optimized_attention_override"
SDP_BATCH_LIMIT = 2 ** 15  # ComfyUI's attention_pytorch splits larger batches; those calls stay with it


class LowBitAttentionOverride:
    """ComfyUI's ``optimized_attention_override(func, q, k, v, heads, **kwargs)`` backed by a chooser."""

    def __init__(self, chooser: AttentionChooser):
        self.chooser = chooser

    def __call__(self, func, q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        def comfy(q=q, k=k, v=v, mask=mask):  # the call as it came, whatever is reshaped below
            return func(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                        skip_output_reshape=skip_output_reshape, **kwargs)

        enable_gqa = bool(kwargs.get("enable_gqa", False))
        b = q.shape[0]
        if b > SDP_BATCH_LIMIT or (enable_gqa and not skip_reshape) or q.dim() != (4 if skip_reshape else 3):
            return comfy()
        if skip_reshape:
            dim_head = q.shape[-1]
        else:
            dim_head = q.shape[-1] // heads
            q, k, v = (t.view(b, -1, heads, dim_head).transpose(1, 2) for t in (q, k, v))
        if mask is not None:
            if mask.dim() == 2:
                mask = mask.unsqueeze(0)
            if mask.dim() == 3:
                mask = mask.unsqueeze(1)
        extra = {name: kwargs[name] for name in ("scale", "enable_gqa") if name in kwargs}

        def finish(out: torch.Tensor) -> torch.Tensor:
            if skip_output_reshape:
                return out
            return out.transpose(1, 2).reshape(b, -1, heads * dim_head)

        return self.chooser.run(q, k, v, mask, comfy, finish, **extra)


def attention_override(model_patcher):
    """The LowBit override set on ``model_patcher`` (None when it has none)."""
    found = model_patcher.model_options.get("transformer_options", {}).get(OVERRIDE_KEY)
    return found if isinstance(found, LowBitAttentionOverride) else None


def apply_attention_backend(model_patcher, config: AttentionConfig):
    """A clone of ``model_patcher`` whose attention runs through a new :class:`AttentionChooser`."""
    clone = model_patcher.clone()
    options = clone.model_options.setdefault("transformer_options", {})
    previous = options.get(OVERRIDE_KEY)
    if previous is not None and not isinstance(previous, LowBitAttentionOverride):
        log.warning("LowBit attention: replacing another node's attention override (%r)", previous)
    if config.backend == "comfy":
        if isinstance(previous, LowBitAttentionOverride):
            del options[OVERRIDE_KEY]
        return clone
    options[OVERRIDE_KEY] = LowBitAttentionOverride(AttentionChooser(config))
    return clone


class LowBitAttentionBackend(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowBitAttentionBackend",
            display_name="Attention Backend (LowBit)",
            category=CATEGORY,
            description=(
                "Runs the model's attention on the fastest backend for each shape, measured on the first call: "
                "ComfyUI's own attention or one of PyTorch's (cuDNN, FlashAttention, memory-efficient). Exact "
                "backends only unless allow_lossy is on. On an H200 at Flux 1024x1024, cuDNN attention is 1.8x "
                "faster than the FlashAttention ComfyUI asks for. Works on any model, quantized or not."),
            inputs=[
                io.Model.Input("model", tooltip="Any diffusion model whose attention goes through ComfyUI's "
                               "optimized_attention (Flux, SD3, Wan, Qwen-Image, ...)."),
                io.Combo.Input("backend", options=list(BACKEND_CHOICES), default="auto",
                               tooltip="auto: time the candidates on the first call of each shape and keep the "
                               "fastest. comfy: remove a LowBit override (ComfyUI's attention). cudnn / flash / "
                               "efficient / math: that PyTorch backend (ComfyUI's attention where it cannot run). "
                               "kitchen_int8: comfy-kitchen's INT8 attention (>= 0.2.30; not exact)."),
                io.Boolean.Input("allow_lossy", default=False, optional=True,
                                 tooltip="auto only: also consider comfy-kitchen's INT8 attention, which is not "
                                 "exact (about 2-3 % error)."),
            ],
            outputs=[io.Model.Output(tooltip="The model with its attention backend set (the input is unchanged).")],
        )

    @classmethod
    def execute(cls, model, backend: str = "auto", allow_lossy: bool = False) -> io.NodeOutput:
        try:
            config = AttentionConfig(backend=backend, allow_lossy=bool(allow_lossy))
        except AttentionConfigError as err:
            raise NodeInputError(str(err)) from err
        return io.NodeOutput(apply_attention_backend(model, config))


__all__ = ["LowBitAttentionBackend", "LowBitAttentionOverride", "apply_attention_backend", "attention_override"]
