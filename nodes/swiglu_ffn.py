"""Gated MLPs written as three linears in one ``forward``, ``down(silu(gate(x)) * up(x))``, whose SwiGLU the
down-projection computes inside its activation quantization.

HiDream's ``FeedForwardSwiGLU`` (its shared and routed experts and its text MLP), Krea 2's ``SwiGLU``, SeedVR's
``SwiGLUMLP`` and the MMDiT ``SwiGLUFeedForward`` (SD 3's SwiGLU variant) compute their whole MLP in ``forward``,
with no gating method of their own to override (Lumina's ``FeedForward`` has one: ``DeferredGatedFeedForwardMixin``
in ``nodes/comfy_ops.py``). :func:`install_input_fusion` swaps such modules, per model, to a subclass whose
``forward`` calls the same three linears in the same order and hands the down-projection
``defer_swiglu_pair(gate(x), up(x))`` (``quant/deferred.py``): a LowBit linear computes the product inside its
act-quant kernel, anything else gets the computed tensor. Where it cannot defer (no rows, CPU tensors outside
Triton's interpreter, ``torch.compile`` tracing, autograd, two outputs of different shapes) the product is computed
as the class computes it. :func:`swiglu_feed_forward_classes` finds the classes this ComfyUI has and checks once, on small
instances holding torch Linears, that each one's ``forward`` computes exactly that product in fp32, bf16 and fp16;
a class that computes anything else (a newer ComfyUI's clamp, bias, dropout) keeps its own ``forward``.
"""

from __future__ import annotations

import functools
import importlib

import torch

from ..quant.deferred import defer_swiglu_pair

#: ComfyUI's three-linear SwiGLU MLPs: (module, class name, (gate, up, down) attribute names)
SWIGLU_FEED_FORWARDS = (
    ("comfy.ldm.hidream.model", "FeedForwardSwiGLU", ("w1", "w3", "w2")),
    ("comfy.ldm.krea2.model", "SwiGLU", ("gate", "up", "down")),
    ("comfy.ldm.seedvr.model", "SwiGLUMLP", ("proj_in_gate", "proj_in", "proj_out")),
    ("comfy.ldm.modules.diffusionmodules.mmdit", "SwiGLUFeedForward", ("w1", "w3", "w2")),
)


class DeferredSwiGLUFeedForwardMixin:
    """A three-linear SwiGLU MLP whose down-projection may take ``silu(gate(x)) * up(x)`` as a deferred input.
    ``lowbit_swiglu_linears`` names its (gate, up, down) linears (set by :func:`swiglu_mixin`)."""

    lowbit_swiglu_linears: tuple[str, str, str]

    def forward(self, x):
        gate_name, up_name, down_name = self.lowbit_swiglu_linears
        gate = getattr(self, gate_name)(x)
        up = getattr(self, up_name)(x)
        hidden = defer_swiglu_pair(gate, up)
        if hidden is None:
            hidden = torch.nn.functional.silu(gate) * up
        return getattr(self, down_name)(hidden)


@functools.lru_cache(maxsize=None)
def swiglu_mixin(linears: tuple[str, str, str]) -> type:
    """The :class:`DeferredSwiGLUFeedForwardMixin` of MLPs whose (gate, up, down) linears are named ``linears``."""
    return type(f"DeferredSwiGLUFeedForward_{'_'.join(linears)}", (DeferredSwiGLUFeedForwardMixin,),
                {"__module__": __name__, "lowbit_swiglu_linears": linears})


def _computes_swiglu(cls: type, linears: tuple[str, str, str]) -> bool:
    """Whether ``cls.forward`` on an instance holding three small torch Linears under ``linears`` returns exactly
    ``down(silu(gate(x)) * up(x))``, in fp32, bf16 and fp16 (``False`` where it needs anything else: it raises)."""
    gen = torch.Generator().manual_seed(0)
    module = cls.__new__(cls)
    torch.nn.Module.__init__(module)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for name, (fan_in, fan_out) in zip(linears, ((8, 16), (8, 16), (16, 8))):
            setattr(module, name, torch.nn.Linear(fan_in, fan_out, bias=False))
    gate, up, down = (getattr(module, name) for name in linears)
    x = torch.randn(3, 8, generator=gen) * 4
    try:
        with torch.no_grad():
            for dtype in (torch.float32, torch.bfloat16, torch.float16):
                m, xd = module.to(dtype), x.to(dtype)
                if not torch.equal(cls.forward(m, xd), down(torch.nn.functional.silu(gate(xd)) * up(xd))):
                    return False
    except Exception:  # a forward that reads more than the three linears, or takes other arguments
        return False
    return True


@functools.lru_cache(maxsize=None)
def swiglu_feed_forward_classes() -> dict[type, type]:
    """Those of :data:`SWIGLU_FEED_FORWARDS` this ComfyUI has and whose ``forward`` computes the SwiGLU of their
    linears (checked once), each with its deferring mixin."""
    found = {}
    for module_name, name, linears in SWIGLU_FEED_FORWARDS:
        try:
            cls = getattr(importlib.import_module(module_name), name)
        except (ImportError, AttributeError):  # not in this ComfyUI
            continue
        if _computes_swiglu(cls, linears):
            found[cls] = swiglu_mixin(linears)
    return found
