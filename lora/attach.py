"""Attach a LoRA stack to a torch model and take it off again, without touching the base weights.

Two mechanisms, both reversible and both free of ComfyUI (the node layer wraps them in ComfyUI's
``PatcherInjection`` so they follow the ModelPatcher's load/unload):

:class:`DynamicLoras`
    One :class:`~.dynamic.LoraBank` per LoRA'd layer and a forward hook ``y + apply(x, bank)``.
    Banks are built once, on the first attach, on the compute device; later strength changes only
    rewrite each bank's ``rank_scale`` in place (:meth:`DynamicLoras.set_strengths`).
:class:`StochasticMerge`
    On attach, each LoRA'd layer's weight is replaced by a merged copy (one stochastic rounding in
    the layout's basis, see :mod:`.stochastic`; plain fp32 addition for float layers). The original
    weight is kept - moved to ``offload_device`` while detached from the module - and put back on detach.
    Modules are looked up at attach time, so under ComfyUI's Dynamic VRAM, which caches streamed weights
    per module object, the node layer gives each merged layer its own module first (:mod:`.twin`).
    A layer with a SmoothQuant ``pre_quant_scale`` ``s`` runs ``linear(x * s, W_stored)`` with
    ``W_stored = W diag(1 / s)``, so a delta of ``W`` is merged as ``delta diag(1 / s)`` (the
    dynamic hooks need nothing: they see the layer's input before it is scaled).

Layer keys are model state-dict keys (``diffusion_model.blocks.0.attn.qkv.weight``) relative to
``root``.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Callable, Mapping, Sequence

import torch
from comfy_kitchen.tensor import QuantizedTensor

from ..quant.calibration_pre_quant import PRE_QUANT_SCALE
from ..quant.layouts.base import FormatCodec
from .delta import Delta, DenseDelta, LowRankDelta
from .dynamic import LoraBank, add_into
from .stochastic import codec_for_weight, layer_seed, merge_deltas, merge_float

log = logging.getLogger(__name__)

LayerDeltas = Mapping[str, Sequence[tuple[str, LowRankDelta]]]


def module_of(root: torch.nn.Module, weight_key: str) -> torch.nn.Module:
    """The module holding ``weight_key`` (``<path>.weight``) under ``root``."""
    if not weight_key.endswith(".weight"):
        raise KeyError(f"{weight_key!r} is not a weight key (expected '<module path>.weight')")
    return root.get_submodule(weight_key[: -len(".weight")])


def _bank_dtype(module: torch.nn.Module) -> torch.dtype:
    dtype = module.weight.dtype  # a QuantizedTensor reports its compute dtype
    return dtype if dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16


class DynamicLoras:
    """Forward hooks adding each layer's LoRA bank term; the model's weights are never touched."""

    def __init__(self, root: torch.nn.Module, layers: LayerDeltas):
        self.root = root
        self.layers = {k: tuple(v) for k, v in layers.items() if v}
        self.banks: dict[str, LoraBank] = {}
        self._handles: list = []
        self._strengths: dict[str, float] = {}
        for entries in self.layers.values():
            for name, delta in entries:
                self._strengths.setdefault(name, float(delta.strength))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._strengths)

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def set_strengths(self, strengths: Mapping[str, float]) -> None:
        """New strengths per LoRA name (names not given keep theirs): in-place edits, no reallocation."""
        for name, value in strengths.items():
            if name not in self._strengths:
                raise KeyError(f"no LoRA named {name!r} in this stack; it holds {', '.join(self._strengths)}")
            self._strengths[name] = float(value)
        for bank in self.banks.values():
            for name in bank.names:
                if bank.strength(name) != self._strengths[name]:
                    bank.set_strength(name, self._strengths[name])

    def attach(self, device: torch.device | str | None = None) -> None:
        """Build (first time) or move the banks to ``device`` and hook every LoRA'd layer."""
        if self.attached:
            return
        for key, entries in self.layers.items():
            module = module_of(self.root, key)
            bank = self.banks.get(key)
            if bank is None:
                shape = tuple(module.weight.shape)
                entries = [(name, delta.with_strength(self._strengths[name])) for name, delta in entries]
                bank = LoraBank.build(entries, shape, dtype=_bank_dtype(module), device=device, layer=key)
                self.banks[key] = bank
            elif device is not None:
                bank.to(device)
            self._handles.append(module.register_forward_hook(_lora_hook(bank)))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _lora_hook(bank: LoraBank):
    def hook(module, args, output):
        return add_into(output, args[0], bank)  # the layer's fresh output: accumulated in place when safe

    return hook


class StochasticMerge:
    """Swap each LoRA'd layer's weight for a merged copy on attach; restore the original on detach.

    The original Parameter object goes back into the module, unless it was parked on
    ``offload_device`` while attached (then a Parameter of the same data moved home).

    ``codec_of(module)`` names the module's format when the caller knows it (else it is derived from
    the weight's layout). ``dense_deltas(weight_key, float_weight)`` may add dense deltas (what ComfyUI's
    LoHa/LoKr/DoRA adapters would change) computed from the dequantized weight.
    """

    def __init__(self, root: torch.nn.Module, layers: LayerDeltas, *, seed: int,
                 codec_of: Callable[[torch.nn.Module], FormatCodec | None] | None = None,
                 dense_deltas: Callable[[str, torch.Tensor], list[DenseDelta]] | None = None,
                 dense_layers: Sequence[str] = ()):
        self.root = root
        self.layers = {k: [d for _, d in v] for k, v in layers.items()}
        for key in dense_layers:
            self.layers.setdefault(key, [])
        self.seed = int(seed)
        self.codec_of = codec_of
        self.dense_deltas = dense_deltas
        self._originals: dict[str, tuple[torch.nn.Parameter, torch.device]] = {}  # key -> (original, home)
        self._kept: dict[str, tuple[torch.nn.Parameter, torch.Tensor]] = {}  # key -> (original, merged)
        self.rescaled = 0  # scale entries grown by the last merge
        self.merges = 0  # layers merged (computed) so far: a re-attach that reuses kept merges adds none

    @property
    def attached(self) -> bool:
        return bool(self._originals)

    def attach(self, compute_device: torch.device | str | None = None,
               offload_device: torch.device | str | None = None) -> None:
        """Merge (or reuse the merges kept from the last detach) and swap the merged weights in."""
        if self.attached:
            return
        previous = _KEEPING.get(self.root)
        if previous is not None and previous is not self:
            previous.forget()  # one stack per model keeps merges between cycles
        try:
            for key, deltas in self.layers.items():
                self._attach_layer(key, deltas, compute_device, offload_device)
        except Exception:
            self.detach()
            raise
        self._kept.clear()

    def _attach_layer(self, key, deltas, compute_device, offload_device) -> None:
        module = module_of(self.root, key)
        original = module._parameters["weight"]
        home = original.device
        kept = self._kept.get(key)
        if kept is not None and kept[0] is original:
            merged = kept[1]  # ComfyUI ejected and re-injected without touching the weight: reuse
        else:
            merged = self._merge(key, module, original, deltas, compute_device)
            if merged is None:
                return
        if offload_device is not None and torch.device(offload_device) != home:
            original = torch.nn.Parameter(original.data.to(offload_device), requires_grad=False)  # frees home memory
        self._originals[key] = (original, home)
        module.weight = torch.nn.Parameter(merged.to(home), requires_grad=False)

    def _merge(self, key, module, original, deltas, compute_device):
        work = original.data if compute_device is None else original.data.to(compute_device)
        deltas = list(deltas)
        scale = module._parameters.get(PRE_QUANT_SCALE)  # the stored weight is W diag(1 / scale)
        if scale is not None:
            scale = scale.detach().to(device=work.device, dtype=torch.float32)
        if self.dense_deltas is not None:
            as_float = work.dequantize().float() if isinstance(work, QuantizedTensor) else work.float()
            if scale is not None:  # adapters (DoRA's norms, say) see the layer's own weight
                as_float = as_float * scale
            deltas.extend(self.dense_deltas(key, as_float))
        if not any(d.strength != 0 for d in deltas):
            return None
        self.merges += 1
        if scale is not None:
            deltas = [_in_smoothed_space(d, scale, tuple(work.shape), key) for d in deltas]
        if isinstance(work, QuantizedTensor):
            codec = (self.codec_of(module) if self.codec_of is not None else None) or codec_for_weight(work)
            result = merge_deltas(codec, work, deltas, seed=layer_seed(self.seed, key), layer=key)
            self.rescaled += result.rescaled
            return result.weight
        return merge_float(work, deltas, layer=key)

    def detach(self) -> None:
        """Put the original weights back. Merges of weights that live on the CPU are kept for the
        next attach (ComfyUI ejects and re-injects several times per run); GPU merges are dropped
        (recomputing them is cheaper than parking them in host memory)."""
        for key, (original, home) in self._originals.items():
            module = module_of(self.root, key)
            merged = module._parameters["weight"]
            if original.device != home:
                original = torch.nn.Parameter(original.data.to(home), requires_grad=False)
            module.weight = original
            if home.type == "cpu":
                self._kept[key] = (original, merged.data)
        self._originals.clear()
        if self._kept:
            _KEEPING[self.root] = self

    def forget(self) -> None:
        """Drop kept merges (another stack is attaching to this model)."""
        self._kept.clear()
        if _KEEPING.get(self.root) is self:
            del _KEEPING[self.root]


def _in_smoothed_space(delta: Delta, pre_quant_scale: torch.Tensor, shape: tuple[int, int], layer: str) -> Delta:
    """``delta`` of a layer's weight ``W`` as the delta of its stored ``W diag(1 / pre_quant_scale)``:
    its input side divided by the scale (``down``'s columns of a low-rank delta, fp32)."""
    delta.check_fits(shape, layer)  # a LoRA for another model: its own error, not a broadcasting one
    if isinstance(delta, LowRankDelta):
        down = delta.down.to(device=pre_quant_scale.device, dtype=torch.float32)
        return dataclasses.replace(delta, down=down / pre_quant_scale[None, :])
    diff = delta.diff.to(device=pre_quant_scale.device, dtype=torch.float32)
    return dataclasses.replace(delta, diff=diff / pre_quant_scale[None, :])


#: per model, the one StochasticMerge keeping merges between detach and attach
_KEEPING: "weakref.WeakKeyDictionary[torch.nn.Module, StochasticMerge]" = weakref.WeakKeyDictionary()
