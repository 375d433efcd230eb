"""A linear's input that is not computed yet: the eager form of the act-quant prologues.

A DiT block writes a GELU's output, or a LayerNorm's and then the modulation's, in full in bf16 only
for the next quantized linear to read it back and quantize it. Run eagerly, the model's own code
decides the order of ops, so the fusion has to be arranged without changing that code:

* the model's ``nn.GELU`` modules and its affine-free LayerNorms return a :class:`DeferredInput`
  (``defer_gelu`` / ``defer_layer_norm``): a tensor subclass with the output's shape, dtype and device
  that holds only a recipe (``kernels/prologue.py``); so do Flux 2's ``SiLUActivation`` modules and the
  SwiGLU of ComfyUI's fused ``linear_input_act`` calls on a LowBit layer (``defer_swiglu``), and the gating of
  Lumina 2's and Z-Image's ``FeedForward`` (``defer_swiglu_pair``: the gate and up are two linears' outputs);
* so do the RMSNorms before a block's attention and MLP (``defer_rms_norm``: Lumina 2's and Z-Image's,
  Krea 2's; ``nodes/rms_norm.py`` says which);
* some follow-up ops extend the recipe instead of running: ``torch.cat((a, gelu), -1)`` (Flux's single
  blocks; Flux 2's with its SwiGLU), ``torch.addcmul(shift, norm, mult)`` (the adaptive modulation,
  ComfyUI's ``apply_mod``), a norm times one modulation row per batch element (``norm * mult``, either
  order: Z-Image's ``x * (1 + scale)``) and, after it or alone, plus one (``norm * mult + shift``: Krea 2's,
  AuraFlow's and PixArt's ``modulate``); an inactive dropout (``p`` 0, or not training: Qwen-Image's MLP runs
  one between its GELU and its down-projection) returns it as it is;
* a LowBit linear that receives one hands the recipe to its format's fused path
  (``FormatCodec.prologue_linear``): the act-quant kernel computes the rows from the sources.

Anything else that touches a :class:`DeferredInput` - any other op, a linear that cannot fuse, a
metadata query beyond shape/dtype/device - gets the materialized tensor (``prologue.materialize()``:
the unfused graph in torch, computed once and kept), so the fusion can only change how an input is
computed, never what: a consumer this module does not know sees an ordinary tensor.

Nothing here imports ComfyUI; ``nodes/comfy_ops.py`` installs the producers on a model's modules.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch.utils._pytree import tree_map

from ..kernels.backend import interpreting
from ..kernels.prologue import GELU_APPROXIMATIONS, GeluPrologue, NormModPrologue, SwigluPrologue

MAX_FEATURES = 32768  # the act-quant kernel's register-resident rows (triton_act_quant.MAX_BLOCK_K)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_CAT = {torch.cat, getattr(torch, "concat", torch.cat), getattr(torch, "concatenate", torch.cat)}
_MUL = {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__}
_ADD = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__}
#: what a DeferredInput answers itself: its metadata (anything else materializes it)
_METADATA = {torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
             torch.Tensor.ndim.__get__, torch.Tensor.is_cuda.__get__, torch.Tensor.requires_grad.__get__,
             torch.Tensor.layout.__get__, torch.Tensor.dim, torch.Tensor.size, torch.Tensor.numel,
             torch.Tensor.is_floating_point, torch.Tensor.__len__}


class DeferredInput(torch.Tensor):
    """A tensor known by its recipe (``prologue``, 2-D) and its leading dims (``lead_shape``).

    ``materialize()`` computes it (once); every op but the ones listed in the module docstring runs on
    that value. ``prologue`` is what a fused linear takes.
    """

    @staticmethod
    def __new__(cls, prologue, lead_shape):
        src = prologue.source
        shape = (*lead_shape, prologue.shape[1])
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=src.dtype, device=src.device,
                                                   requires_grad=False)

    def __init__(self, prologue, lead_shape):
        self.prologue = prologue
        self.lead_shape = tuple(lead_shape)
        self._value = None

    def materialize(self) -> torch.Tensor:
        if self._value is None:
            self._value = self.prologue.materialize().reshape(*self.lead_shape, self.prologue.shape[1])
        return self._value

    def __repr__(self):
        return f"DeferredInput({type(self.prologue).__name__}, shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        out = None
        if func in _CAT:
            out = _deferred_cat(*args, **kwargs)
        elif func is torch.addcmul:
            out = _deferred_addcmul(*args, **kwargs)
        elif func in _MUL:
            out = _deferred_mul(*args, **kwargs)
        elif func in _ADD:
            out = _deferred_add(*args, **kwargs)
        elif func is torch.nn.functional.dropout:
            out = _inactive_dropout(*args, **kwargs)
        if out is not None:
            return out
        args, kwargs = tree_map(_value, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = tree_map(_value, (args, kwargs or {}))
        return func(*args, **kwargs)


def _value(obj):
    return obj.materialize() if isinstance(obj, DeferredInput) else obj


def materialize(x):
    """``x`` as an ordinary tensor (a :class:`DeferredInput` computed; anything else as it is)."""
    return _value(x)


def can_defer(x: torch.Tensor) -> bool:
    """Whether a producer may return a :class:`DeferredInput` for an output shaped like ``x``: a plain
    floating tensor of at least 2 dims on a device LowBit's Triton kernels run on, outside
    ``torch.compile`` tracing and autograd, rows narrow enough for the act-quant kernel."""
    return (type(x) is torch.Tensor and (x.is_cuda or interpreting()) and x.dtype in _DTYPES and x.dim() >= 2
            and 0 < x.shape[-1] <= MAX_FEATURES and x.numel() > 0 and not (x.requires_grad and torch.is_grad_enabled())
            and not torch.compiler.is_compiling())


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, features]`` (a view where the strides allow), unit column stride."""
    x2d = x.reshape(-1, x.shape[-1])
    return x2d if x2d.stride(-1) == 1 else x2d.contiguous()


def defer_gelu(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """``gelu(x)``, deferred where :func:`can_defer` allows (else computed)."""
    if approximate in GELU_APPROXIMATIONS and can_defer(x):
        return DeferredInput(GeluPrologue(_rows(x), None, approximate), x.shape[:-1])
    return torch.nn.functional.gelu(x, approximate=approximate)


def defer_swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x = [gate | up]`` (ComfyUI's ``"swiglu"`` input activation), deferred where
    :func:`can_defer` allows for the ``[..., K]`` output (else computed, as ComfyUI computes it)."""
    if x.dim() >= 2 and x.shape[-1] % 2 == 0 and can_defer(x[..., : x.shape[-1] // 2]):
        return DeferredInput(SwigluPrologue(_rows(x)), x.shape[:-1])
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate).mul_(up)


def defer_swiglu_pair(gate: torch.Tensor, up: torch.Tensor) -> DeferredInput | None:
    """``silu(gate) * up`` of two tensors of one shape (a gated MLP written as two linears: Lumina 2's and
    Z-Image's ``FeedForward``), deferred; ``None`` where it cannot be (the caller computes it its own way)."""
    if (type(up) is not torch.Tensor or not can_defer(gate) or up.shape != gate.shape or up.dtype != gate.dtype
            or up.device != gate.device):
        return None
    return DeferredInput(SwigluPrologue(_rows(gate), up=_rows(up)), gate.shape[:-1])


def defer_layer_norm(x: torch.Tensor, eps: float) -> DeferredInput | None:
    """``layer_norm(x)`` over the last dim without affine weights, deferred; ``None`` where it cannot be."""
    if not can_defer(x):
        return None
    return DeferredInput(NormModPrologue.checked_by_caller(_rows(x), float(eps)), x.shape[:-1])  # 2-D rows


def defer_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> DeferredInput | None:
    """``rms_norm(x, weight)`` over the last dim, deferred; ``None`` where it cannot be. ``weight`` of ``x``'s
    dtype stands for ``F.rms_norm(x, (K,), weight, eps)`` (rounded as :func:`rms_norm_weight_rounding` finds torch
    does on this device; ``None`` there: not deferred), an fp32 one for ``F.rms_norm(x.float(), (K,), weight,
    eps).to(x.dtype)`` (``kernels/prologue.NormModPrologue``)."""
    if not can_defer(x) or (weight is not None and (type(weight) is not torch.Tensor or weight.dim() != 1
                                                    or weight.shape[0] != x.shape[-1] or weight.device != x.device
                                                    or weight.dtype not in (x.dtype, torch.float32))):
        return None
    rounded = False
    if weight is not None:
        if weight.dtype == x.dtype and weight.dtype != torch.float32:
            rounding = rms_norm_weight_rounding(x.device, x.dtype)
            if rounding is None:
                return None
            rounded = rounding == "twice"
        if weight.stride(0) != 1:
            weight = weight.contiguous()
    return DeferredInput(NormModPrologue.checked_by_caller(_rows(x), float(eps), rms=True, weight=weight,
                                                           round_before_weight=rounded), x.shape[:-1])


_WEIGHT_ROUNDING: dict = {}


def rms_norm_weight_rounding(device: torch.device, dtype: torch.dtype) -> str | None:
    """How torch's ``F.rms_norm`` with a weight of the input's ``dtype`` rounds on ``device``: ``"once"``
    (``x * rsqrt(mean(x^2) + eps) * weight`` rounded once: torch's fused kernels), ``"twice"`` (the normalized row
    rounded, then times the weight: its composite form), or ``None`` (neither: such a norm is not deferred).
    Measured once per device type and dtype on a small input."""
    key = (device.type, dtype)
    if key not in _WEIGHT_ROUNDING:
        gen = torch.Generator().manual_seed(0)
        x = (torch.randn(8, 512, generator=gen) * 3 + 0.5).to(dtype=dtype).to(device)
        w = (1 + 0.3 * torch.randn(512, generator=gen)).to(dtype=dtype).to(device)
        found = None
        with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
            got = torch.nn.functional.rms_norm(x, (512,), w, 1e-5)
            xf = x.float()
            normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
            # a reduction in another order may move the last bit of a few rows' rsqrt; the other rounding moves
            # most elements
            for name, want in (("once", (normed * w.float()).to(dtype)), ("twice", normed.to(dtype) * w)):
                if (got != want).float().mean().item() < 0.01:
                    found = name
                    break
        _WEIGHT_ROUNDING[key] = found
    return _WEIGHT_ROUNDING[key]


def _deferred_cat(tensors, dim=0, *, out=None):
    """``cat((a, gelu(b)), -1)`` / ``cat((a, swiglu(x)), -1)`` as a deferred ``[a | ...]``; ``None`` for any other
    concatenation."""
    if out is not None or not isinstance(tensors, (tuple, list)) or len(tensors) != 2:
        return None
    a, d = tensors
    if not isinstance(d, DeferredInput) or isinstance(a, DeferredInput) or type(a) is not torch.Tensor:
        return None
    p = d.prologue
    if not isinstance(p, (GeluPrologue, SwigluPrologue)) or p.a is not None or d._value is not None:
        return None
    lead, src = d.lead_shape, p.source  # the deferred tensor's metadata, read from plain tensors
    ndim = len(lead) + 1
    if (a.dim() != ndim or dim not in (-1, ndim - 1) or a.shape[:-1] != lead or a.dtype != src.dtype
            or a.device != src.device or a.shape[-1] + p.shape[1] > MAX_FEATURES):
        return None
    return DeferredInput(dataclasses.replace(p, a=_rows(a)), lead)


def _inactive_dropout(input, p=0.5, training=True, inplace=False):
    """``dropout(input)`` where it is the identity (``p`` 0 or not training): ``input`` itself; ``None`` otherwise."""
    return input if isinstance(input, DeferredInput) and (p == 0 or not training) else None


def _per_batch(t, lead_shape: tuple, features: int) -> torch.Tensor | None:
    """A modulation tensor that broadcasts over ``[*lead_shape, features]`` one row per batch element
    (``[B, 1, .., features]``) or one row for all (``[1, .., features]`` / ``[features]``), as ``[B or 1,
    features]``; ``None`` for any other shape."""
    if type(t) is not torch.Tensor:
        return None
    shape = t.shape
    if not shape or shape[-1] != features or len(shape) > len(lead_shape) + 1:
        return None
    numel = t.numel()
    if numel == features:  # every leading dim is 1
        return t.reshape(1, features)
    if len(shape) == len(lead_shape) + 1 and shape[0] == lead_shape[0] and numel == shape[0] * features:
        return t.reshape(shape[0], features)  # [B, 1, .., features]
    return None


def _deferred_addcmul(shift, tensor1, tensor2, *, value=1, out=None):
    """``addcmul(shift, layer_norm(x), mult)`` as a deferred modulated norm; ``None`` otherwise."""
    if out is not None or value != 1 or not isinstance(tensor1, DeferredInput) or isinstance(tensor2, DeferredInput):
        return None
    p = tensor1.prologue
    if not isinstance(p, NormModPrologue) or p.mult is not None or p.shift is not None or tensor1._value is not None:
        return None
    lead, x = tensor1.lead_shape, p.x  # the deferred tensor's metadata, read from plain tensors
    k = x.shape[1]
    mult, add = _per_batch(tensor2, lead, k), _per_batch(shift, lead, k)
    if mult is None or add is None or mult.dtype != x.dtype or add.dtype != x.dtype \
            or mult.device != x.device or add.device != x.device:
        return None
    batches = max(mult.shape[0], add.shape[0])
    if batches > 1:
        mult, add = mult.expand(batches, k), add.expand(batches, k)
    rows_per_batch = math.prod(lead[1:]) if batches > 1 else 0
    # [B or 1, k] of x's dtype and device (above); B > 1 only as lead[0], so rows_per_batch * B is x's rows
    return DeferredInput(NormModPrologue.checked_by_caller(p.x, p.eps, mult, add, rows_per_batch), lead)


def _plain_norm(d) -> NormModPrologue | None:
    """The prologue of a deferred norm not modulated yet (nor computed); ``None`` for anything else."""
    if not isinstance(d, DeferredInput) or d._value is not None:
        return None
    p = d.prologue
    return p if isinstance(p, NormModPrologue) and p.mult is None and p.shift is None else None


def _modulation_row(t, d: DeferredInput, p: NormModPrologue) -> torch.Tensor | None:
    """``t`` as ``[B or 1, K]`` rows of ``p``'s dtype and device that broadcast over ``d`` one per batch element."""
    x = p.x
    row = _per_batch(t, d.lead_shape, x.shape[1])
    return row if row is not None and row.dtype == x.dtype and row.device == x.device else None


def _modulated(d: DeferredInput, p: NormModPrologue, mult, shift, two_step: bool) -> DeferredInput:
    k = p.x.shape[1]
    batches = max(t.shape[0] for t in (mult, shift) if t is not None)
    if batches > 1:
        mult, shift = (None if t is None else t.expand(batches, k) for t in (mult, shift))
    rows_per_batch = math.prod(d.lead_shape[1:]) if batches > 1 else 0
    return DeferredInput(NormModPrologue.checked_by_caller(p.x, p.eps, mult, shift, rows_per_batch, p.rms, p.weight,
                                                           two_step, p.round_before_weight), d.lead_shape)


def _deferred_mul(a, b, *, out=None):
    """``norm * mult`` (either order; ``mult`` one row per batch element, as :func:`_per_batch` reads it) as a
    deferred modulated norm; ``None`` otherwise."""
    if out is not None:
        return None
    d, t = (a, b) if isinstance(a, DeferredInput) else (b, a)
    p = _plain_norm(d)
    if p is None or isinstance(t, DeferredInput):
        return None
    mult = _modulation_row(t, d, p)
    return None if mult is None else _modulated(d, p, mult, None, False)


def _deferred_add(a, b, *, alpha=1, out=None):
    """``norm + shift`` or ``norm * mult + shift`` (either order; ``shift`` one row per batch element) as a
    deferred modulated norm, the product rounded before the sum as two ops round it; ``None`` otherwise."""
    if out is not None or alpha != 1:
        return None
    d, t = (a, b) if isinstance(a, DeferredInput) else (b, a)
    if not isinstance(d, DeferredInput) or isinstance(t, DeferredInput) or d._value is not None:
        return None
    p = d.prologue
    if not isinstance(p, NormModPrologue) or p.shift is not None:
        return None
    shift = _modulation_row(t, d, p)
    if shift is None:
        return None
    # mult and shift each have 1 or B rows (B: the first leading dim, _per_batch), so they broadcast together
    return _modulated(d, p, p.mult, shift, p.mult is not None)


__all__ = ["DeferredInput", "can_defer", "defer_gelu", "defer_layer_norm", "defer_rms_norm", "defer_swiglu",
           "defer_swiglu_pair", "materialize", "rms_norm_weight_rounding"]
