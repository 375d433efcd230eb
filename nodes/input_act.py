"""ComfyUI's fused ``comfy.ops.linear_input_act`` calls, routed through the layer where LowBit must see them.

Some of ComfyUI's model code computes an MLP's down-projection as ``comfy.ops.linear_input_act(linear, h,
"gelu_tanh")`` (Wan, LTX-Video, MiniMax in ComfyUI 0.30; newer versions add ``"rms_norm"`` and a fused
residual). For a weight in comfy-kitchen's ``TensorWiseINT8Layout`` (LowBit's ``int8`` and ``int8_convrot``)
that function reads ``linear.weight`` and runs kitchen's INT8 linear itself: the layer's own forward never
runs, nor the forward hooks on it. So such a layer would skip LowBit's kernels, its backend and dequantize
settings, and the run-time LoRA terms of LowBit's ``dynamic`` mode (a forward hook) and of ComfyUI's bypass
adapters (a replaced ``forward``).

:func:`route_input_act_calls` gives every module whose class's ``forward`` calls ``linear_input_act`` a
per-model subclass (its ``__class__`` is swapped, nothing global changes) whose ``forward`` is the same code
reading ``comfy.ops.linear_input_act`` as :func:`linear_input_act` below. That calls the layer as a module,
``linear(act(h))``, where the layer is one LowBit runs or has hooks or a replaced forward, and ComfyUI's
own function (looked up at call time) everywhere else, so other layers keep ComfyUI's fused kernel.
"""

from __future__ import annotations

import importlib
import logging
import types

import torch

import comfy.ops

from ..quant.deferred import defer_gelu, defer_swiglu
from .comfy_ops import CONFIG_ATTR, LowBitOpsConfig, is_lowbit_linear

log = logging.getLogger(__name__)

ROUTED_ATTR = "_lowbit_routes_input_act"  # set on the per-model subclasses this module makes
_NAME = "linear_input_act"
_warned: set[str] = set()  # activations already warned about (once per process)


def _has_hooks(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` does more than its class's forward: hooks, or a forward set on the instance."""
    return bool(module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


def runs_as_module(linear: torch.nn.Module) -> bool:
    """Whether :func:`linear_input_act` calls ``linear`` as a module rather than ComfyUI's fused function."""
    return is_lowbit_linear(linear) or _has_hooks(linear)


def _fuses_inputs(linear: torch.nn.Module) -> bool:
    config = linear.__dict__.get(CONFIG_ATTR) or LowBitOpsConfig()
    return config.fuse_inputs and config.backend == "auto"


def _eager_act(x: torch.Tensor, input_act, act_weight, act_eps):
    """``act(x)`` as ComfyUI's eager fallback computes it, or ``None`` for an activation LowBit does not know."""
    if input_act is None:
        return x
    if input_act == "rms_norm":
        return importlib.import_module("comfy.rmsnorm").rms_norm(x, act_weight, act_eps)
    eager = getattr(comfy.ops, "INPUT_ACT_EAGER", {}).get(input_act)
    return None if eager is None else eager(x)


def linear_input_act(linear, x, input_act, act_weight=None, act_eps=0.0, residual=None, residual_scale=None):
    """``linear(act(x))`` (``residual + residual_scale * linear(act(x))`` with a residual), as ComfyUI's
    ``comfy.ops.linear_input_act`` computes it, with ``linear`` called as a module where :func:`runs_as_module`."""
    extra = {}
    if act_weight is not None or act_eps != 0.0:
        extra.update(act_weight=act_weight, act_eps=act_eps)
    if residual is not None or residual_scale is not None:
        extra.update(residual=residual, residual_scale=residual_scale)
    lowbit, hooked = is_lowbit_linear(linear), _has_hooks(linear)
    if not (lowbit or hooked):
        return comfy.ops.linear_input_act(linear, x, input_act, **extra)
    fuses = lowbit and not hooked and _fuses_inputs(linear)
    if fuses and input_act == "gelu_tanh":
        h = defer_gelu(x, "tanh")  # computed inside the activation quantization where the layer can
    elif fuses and input_act == "swiglu":
        h = defer_swiglu(x)  # the same: silu(gate) * up from the gate and up halves, never stored
    else:
        h = _eager_act(x, input_act, act_weight, act_eps)
        if h is None:
            if input_act not in _warned:
                _warned.add(input_act)
                log.warning("LowBit: ComfyUI asked for input activation %r, which LowBit does not know; layers given "
                            "it run through ComfyUI's own fused function (without LowBit's kernels or run-time LoRA "
                            "terms)", input_act)
            return comfy.ops.linear_input_act(linear, x, input_act, **extra)
    out = linear(h)
    return out if residual is None else torch.addcmul(residual, out, residual_scale)


class _Namespace(types.ModuleType):
    """A module's names with some replaced; a name added to the module later is read from the module."""

    def __init__(self, real: types.ModuleType, overrides: dict):
        super().__init__(real.__name__, getattr(real, "__doc__", None))
        self.__dict__.update(vars(real))
        self.__dict__.update(overrides)
        self.__dict__["_lowbit_real"] = real

    def __getattr__(self, name):
        return getattr(self.__dict__["_lowbit_real"], name)


def _calls_linear_input_act(fn) -> bool:
    return isinstance(fn, types.FunctionType) and _NAME in fn.__code__.co_names


def _routed(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with its global names ``comfy`` / ``comfy.ops`` / ``linear_input_act`` reading this module's function."""
    import comfy

    ops_view = _Namespace(comfy.ops, {_NAME: linear_input_act})
    comfy_view = _Namespace(comfy, {"ops": ops_view})
    namespace = dict(fn.__globals__)
    for name, value in fn.__globals__.items():
        if value is comfy:
            namespace[name] = comfy_view
        elif value is comfy.ops:
            namespace[name] = ops_view
        elif value is getattr(comfy.ops, _NAME, None):
            namespace[name] = linear_input_act
    routed = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    routed.__kwdefaults__ = fn.__kwdefaults__
    routed.__qualname__, routed.__doc__, routed.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    return routed


def _routed_class(base: type, classes: dict[type, type]) -> type:
    cls = classes.get(base)
    if cls is None:
        cls = type(f"LowBit{base.__name__}", (base,), {"forward": _routed(base.forward), ROUTED_ATTR: True,
                                                       "__module__": __name__})
        classes[base] = cls
    return cls


def route_input_act_calls(diffusion_model: torch.nn.Module, classes: dict[type, type]) -> int:
    """Swap the class of every module of ``diffusion_model`` whose ``forward`` calls ``linear_input_act`` to a
    per-model subclass that routes the call through :func:`linear_input_act` (``classes``: the caller's per-model
    cache). Returns how many modules were swapped (0 on a second call, or where ComfyUI has no such function)."""
    if not hasattr(comfy.ops, _NAME):
        return 0
    swapped = 0
    for module in diffusion_model.modules():
        cls = type(module)
        if getattr(cls, ROUTED_ATTR, False) or not _calls_linear_input_act(getattr(cls, "forward", None)):
            continue
        module.__class__ = _routed_class(cls, classes)
        swapped += 1
    if swapped:
        log.debug("LowBit: %d modules' linear_input_act calls routed through their layers", swapped)
    return swapped


__all__ = ["linear_input_act", "route_input_act_calls", "runs_as_module"]
