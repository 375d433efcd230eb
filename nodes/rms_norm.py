"""The RMSNorms in front of a DiT block's attention and MLP, computed inside the next LowBit linear's act-quant.

Lumina 2's and Z-Image's ``JointTransformerBlock`` feed ``attention_norm1(x) * (1 + scale)`` to the attention's
``qkv`` and ``ffn_norm1(x) * (1 + scale)`` to the MLP's ``w1`` and ``w3`` (ComfyUI's ``RMSNorm`` with a weight);
Krea 2's blocks feed ``(1 + scale) * prenorm(x) + shift`` to ``wq``, ``wk``, ``wv`` and the attention gate, and the
same of ``postnorm`` to the MLP's ``gate`` and ``up`` (Krea 2's own ``RMSNorm``, in fp32 with the weight
``1 + scale``). Unfused, each norm and each modulation op writes the whole activation in bf16 for the act-quant
to read back. :func:`block_norm_sites` names those norms; :func:`install_input_fusion` (``nodes/comfy_ops.py``)
swaps each one, per model, to a subclass whose output is a deferred ``rms_norm`` (``quant/deferred.py``): the
modulation's ``*`` and ``+`` extend it, and the linears that take it share one act-quant pass that computes the
rows in registers (``kernels/prologue.NormModPrologue``). Only these norms are swapped: the per-head q/k norms,
the post-attention norms and a final layer's norm feed no quantized linear.

A norm defers only where its output is exactly what the prologue computes: ComfyUI's ``RMSNorm`` (its class's
forward, no weight patches, the weight already on the input's device in its dtype, and torch's ``rms_norm``
rounding the weighted row on that device one of the two ways the kernel knows: ``rms_norm_weight_rounding``);
Krea 2's ``RMSNorm`` where its forward,
checked once on small instances in fp32, bf16 and fp16, computes ``F.rms_norm(x.float(), ..., scale + 1,
eps).to(dtype)``. Anything else runs the class's own forward.
"""

from __future__ import annotations

import functools
import importlib

import comfy.model_management
import torch

from ..quant.deferred import can_defer, defer_rms_norm
from .joint_attention import norm_eps, norm_forwards, run_every_op

#: blocks whose norms feed quantized linears: (module, class name, norm attribute names)
BLOCK_NORMS = (
    ("comfy.ldm.lumina.model", "JointTransformerBlock", ("attention_norm1", "ffn_norm1")),
    ("comfy.ldm.krea2.model", "SingleStreamBlock", ("prenorm", "postnorm")),
    ("comfy.ldm.krea2.model", "TextFusionBlock", ("prenorm", "postnorm")),
)


def _plain_call(norm, input, args, kwargs) -> bool:
    return (not args and not kwargs and isinstance(input, torch.Tensor) and input.dim() >= 2
            and "_v" not in norm.__dict__  # Dynamic VRAM: the weight comes from ComfyUI's cast on every call
            and not getattr(norm, "weight_function", None) and not getattr(norm, "bias_function", None))


class DeferredRMSNormMixin:
    """ComfyUI's (or torch's) ``RMSNorm`` whose output may be a deferred input; otherwise its class's own."""

    def forward(self, input, *args, **kwargs):
        if _plain_call(self, input, args, kwargs) and tuple(self.normalized_shape) == (input.shape[-1],):
            w = self.weight
            if w is None or (w.device == input.device and w.dtype == input.dtype):
                out = defer_rms_norm(input, None if w is None else w.detach(), norm_eps(self, input))
                if out is not None:
                    run_every_op()  # what ComfyUI's RMSNorm.forward calls first
                    return out
        return super().forward(input, *args, **kwargs)


class DeferredScaleRMSNormMixin:
    """Krea 2's ``RMSNorm`` (``rms_norm`` in fp32 with the weight ``1 + scale``) whose output may be a deferred
    input; otherwise its class's own."""

    def forward(self, x):
        if _plain_call(self, x, (), {}) and self.scale.shape == (x.shape[-1],) and can_defer(x):
            # the weight only where the norm defers (else the class's forward makes it itself)
            weight = comfy.model_management.cast_to(self.scale, dtype=torch.float32, device=x.device) + 1.0
            out = defer_rms_norm(x, weight, self.eps)
            if out is not None:
                return out
        return super().forward(x)


def _computes_scale_rms_norm(cls: type) -> bool:
    """Whether ``cls.forward`` on a small instance (``scale`` ``[K]``, ``eps``) returns exactly
    ``F.rms_norm(x.float(), (K,), scale.float() + 1, eps).to(x.dtype)`` in fp32, bf16 and fp16."""
    gen = torch.Generator().manual_seed(0)
    module = cls.__new__(cls)
    torch.nn.Module.__init__(module)
    module.eps = 1e-5
    module.scale = torch.nn.Parameter(torch.randn(16, generator=gen) * 0.3, requires_grad=False)
    x = torch.randn(3, 5, 16, generator=gen) * 4
    try:
        with torch.no_grad():
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                xd = x.to(dtype)
                want = torch.nn.functional.rms_norm(xd.float(), (16,), module.scale.float() + 1, 1e-5).to(dtype)
                if not torch.equal(cls.forward(module, xd), want):
                    return False
    except Exception:  # another signature, or a forward that reads more than scale and eps
        return False
    return True


@functools.lru_cache(maxsize=None)
def _scale_rms_norm_class() -> type | None:
    try:
        cls = importlib.import_module("comfy.ldm.krea2.model").RMSNorm
    except (ImportError, AttributeError):
        return None
    return cls if _computes_scale_rms_norm(cls) else None


@functools.lru_cache(maxsize=None)
def block_norm_sites() -> dict[type, tuple[str, ...]]:
    """Those of :data:`BLOCK_NORMS` this ComfyUI has: block class -> its norms' attribute names."""
    found = {}
    for module_name, name, norms in BLOCK_NORMS:
        try:
            found[getattr(importlib.import_module(module_name), name)] = norms
        except (ImportError, AttributeError):  # not in this ComfyUI
            continue
    return found


def norm_mixin(norm: torch.nn.Module) -> type | None:
    """The deferring mixin for ``norm`` (a block's norm named in :data:`BLOCK_NORMS`), or ``None`` where its class
    computes anything the prologue does not."""
    cls = type(norm)
    if isinstance(norm, (DeferredRMSNormMixin, DeferredScaleRMSNormMixin)):
        return None  # already swapped
    if isinstance(norm, torch.nn.RMSNorm) and cls.forward in norm_forwards(torch.nn.RMSNorm) \
            and len(norm.normalized_shape) == 1:
        return DeferredRMSNormMixin
    if cls is _scale_rms_norm_class():
        return DeferredScaleRMSNormMixin
    return None


__all__ = ["BLOCK_NORMS", "DeferredRMSNormMixin", "DeferredScaleRMSNormMixin", "block_norm_sites", "norm_mixin"]
