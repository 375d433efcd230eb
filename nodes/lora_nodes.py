"""LoRA nodes (LowBit): a LoRA stack applied to a (quantized) MODEL in one of three modes.

Nodes: **LoRA Stack Entry** (a file and a strength), **Apply LoRA Stack** (a mode and an autogrowing
list of up to 100 entries, applied in slot order; strength 0 or a bypassed entry is off), **Load
LoRA** (one file) and **Load LoRA Stack** (ten fixed slots).

Modes (see ``lora/``):

* ``stochastic`` - per layer, every delta of the stack summed in fp32 in the layer's stored basis
  and rounded once, stochastically, into the quantized weight (the scale grows where it would
  saturate). Runs as fast as the base model. The merge runs when ComfyUI loads the model and is
  undone when it unloads it; the base weights are never modified in place.
* ``dynamic`` - weights untouched; each LoRA'd layer adds ``((x @ A.T) * s) @ B.T`` with all of its
  LoRAs' ranks in one pair. Changing strengths only rewrites the per-rank scale ``s`` in place.
  LoHa/LoKr/diff entries run through ComfyUI's bypass forward. DoRA layers (which the bypass would
  run as a plain LoRA) are merged as ``stochastic`` merges them, and re-merged on a strength change.
* ``standard`` - ComfyUI's own weight patches (``ModelPatcher.add_patches``): dequantize, add,
  requantize with ComfyUI's seeded rounding. For comparison and for anything else.

Attach/detach follow the ModelPatcher through one ``PatcherInjection`` (key :data:`INJECTION_KEY`)
holding every LowBit stack of that patcher, undone last-in first-out. Under Dynamic VRAM
(``ModelPatcherDynamic``), which streams each weight through caches kept per module object, every layer
a merge changes is first given its own module object, an object patch of the stack's patcher
(:func:`_twin_layers`), so the merged weight - not the base model's cached one - is what runs. LoRA files are read once
and kept in a small cache (:class:`LoraFileCache`, by path, size and mtime), so re-running a
workflow with a changed strength reads neither the LoRA nor the base model again.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import threading
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch
from comfy_api.latest import io

from ..lora.attach import DynamicLoras, StochasticMerge
from ..lora.delta import DenseDelta
from ..lora.keys import ParsedLora, parse_lora
from ..lora.stack import LeftOut, StackSlot, active_slots, adapter_plan, low_rank_plan, stack_report
from ..lora.twin import module_twin
from ..quant.errors import LowBitError
from . import CATEGORY
from .input_act import route_input_act_calls

log = logging.getLogger(__name__)

MODES = ("stochastic", "dynamic", "standard")
DEFAULT_MODE = "stochastic"
MAX_STACK = 100  # io.Autogrow's limit
FIXED_SLOTS = 10
NONE = "None"
INJECTION_KEY = "lowbit_lora"
#: LoRA key prefixes of text encoders: these nodes patch the diffusion model only
TEXT_ENCODER_PREFIXES = ("lora_te", "text_encoder", "text_encoders.", "lora_clip", "te_", "clip_")
MODE_TOOLTIP = ("stochastic: merge all LoRAs into the quantized weights with one unbiased rounding (full speed; "
                "weak LoRAs survive, strong ones do not clip). dynamic: keep weights, add the LoRAs at run time "
                "(strength changes are instant, never re-quantize). standard: ComfyUI's own LoRA patching.")
STRENGTH = dict(default=1.0, min=-100.0, max=100.0, step=0.01)
#: not called "seed": the front end would randomize it after every run, re-merging (and changing) the weights
MERGE_SEED = dict(default=0, min=0, max=2**31 - 1, optional=True, advanced=True, control_after_generate=False,
                  tooltip="stochastic mode: the rounding seed (the same seed gives bit-identical weights).")

LoraEntryType = io.Custom("LOWBIT_LORA")


class LoraInputError(LowBitError):
    """A LoRA node input that cannot work (a missing file, an unknown mode)."""


@dataclass(frozen=True)
class LoraEntry:
    """One stack slot as it travels between nodes: the file and its strength."""

    lora_name: str
    path: str
    strength: float


# ---- LoRA files -------------------------------------------------------------------------------

class LoraFileCache:
    """LoRA state dicts keyed by (path, size, mtime); least recently used dropped past the limits."""

    def __init__(self, max_files: int = 16, max_bytes: int = 4 << 30):
        self.max_files, self.max_bytes = max_files, max_bytes
        self._items: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()
        self.reads = 0  # files actually read from disk (tests and logs)

    @staticmethod
    def file_key(path: str) -> tuple:
        st = os.stat(path)
        return (os.path.realpath(path), st.st_size, st.st_mtime_ns)

    def load(self, path: str) -> tuple[tuple, dict[str, torch.Tensor]]:
        """``(file key, state dict)`` of a LoRA file, converted as ComfyUI converts LoRAs."""
        import comfy.lora_convert
        import comfy.utils

        key = self.file_key(path)
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return key, self._items[key]
        state_dict = comfy.lora_convert.convert_lora(comfy.utils.load_torch_file(path, safe_load=True))
        with self._lock:
            self.reads += 1
            self._items[key] = state_dict
            self._evict()
        return key, state_dict

    def _evict(self) -> None:
        def size(sd):
            return sum(t.numel() * t.element_size() for t in sd.values())

        while len(self._items) > self.max_files or (
                len(self._items) > 1 and sum(size(sd) for sd in self._items.values()) > self.max_bytes):
            self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


LORA_FILES = LoraFileCache()


@dataclass
class _ModelKeys:
    key_map: dict
    shapes: dict
    parsed: collections.OrderedDict  # file key -> ParsedLora
    dynamic: collections.OrderedDict  # (stack position, slot names and file keys) -> DynamicLoras


_MODEL_KEYS: "weakref.WeakKeyDictionary[torch.nn.Module, _ModelKeys]" = weakref.WeakKeyDictionary()


def model_keys(model_patcher) -> _ModelKeys:
    """The LoRA key map and weight shapes of a model (cached per diffusion model object)."""
    import comfy.lora

    base = model_patcher.model
    info = _MODEL_KEYS.get(base)
    if info is None:
        key_map = comfy.lora.model_lora_keys_unet(base, {})
        shapes = {f"{name}.weight": tuple(module.weight.shape) for name, module in base.named_modules()
                  if isinstance(getattr(module, "weight", None), torch.Tensor)}
        info = _ModelKeys(key_map, shapes, collections.OrderedDict(), collections.OrderedDict())
        _MODEL_KEYS[base] = info
    return info


def parsed_lora(info: _ModelKeys, file_key: tuple, state_dict) -> ParsedLora:
    parsed = info.parsed.get(file_key)
    if parsed is None:
        parsed = parse_lora(state_dict, info.key_map, shapes=info.shapes, skip_prefixes=TEXT_ENCODER_PREFIXES)
        info.parsed[file_key] = parsed
        while len(info.parsed) > 32:
            info.parsed.popitem(last=False)
    else:
        info.parsed.move_to_end(file_key)
    return parsed


def lora_path(lora_name: str) -> str:
    import folder_paths

    path = folder_paths.get_full_path("loras", lora_name)
    if path is None:
        raise LoraInputError(f"LoRA {lora_name!r} not found in models/loras; fix: put the file there (or in a folder "
                             f"extra_model_paths.yaml lists) and refresh the node list.")
    return path


# ---- applying a stack -------------------------------------------------------------------------

class LoraInjection:
    """Every LowBit LoRA stack of one patcher, attached in order and detached in reverse.

    Stored as the patcher's ``INJECTION_KEY`` injection (ComfyUI's ``PatcherInjection`` protocol:
    ``inject(patcher)`` / ``eject(patcher)``). A chained stack makes a new one with one more applier.
    """

    def __init__(self, appliers: tuple = ()):
        self.appliers = tuple(appliers)

    def inject(self, patcher) -> None:
        done = []
        try:
            for applier in self.appliers:
                applier.attach(patcher)
                done.append(applier)
        except Exception:
            for applier in reversed(done):
                applier.detach(patcher)
            raise

    def eject(self, patcher) -> None:
        for applier in reversed(self.appliers):
            applier.detach(patcher)


class _DynamicApplier:
    """Banks and bypass hooks added at run time; ``merge`` (DoRA layers, or None) merged into the weights."""

    def __init__(self, loras: DynamicLoras, strengths: dict[str, float], bypass: list,
                 merge: StochasticMerge | None = None):
        self.loras, self.strengths, self.bypass, self.merge = loras, strengths, bypass, merge

    def attach(self, patcher) -> None:
        # the hooks must run where ComfyUI's model code would compute a layer without calling it (linear_input_act)
        route_input_act_calls(patcher.model.diffusion_model, {})
        if self.merge is not None:
            self.merge.attach(patcher.load_device, patcher.offload_device)
        try:
            self.loras.set_strengths(self.strengths)
            self.loras.attach(patcher.load_device)
            for injection in self.bypass:
                injection.inject(patcher)
        except Exception:
            self.detach(patcher)
            raise

    def detach(self, patcher) -> None:
        for injection in reversed(self.bypass):
            injection.eject(patcher)
        self.loras.detach()
        if self.merge is not None:
            self.merge.detach()


class _StochasticApplier:
    def __init__(self, merge: StochasticMerge):
        self.merge = merge

    def attach(self, patcher) -> None:
        self.merge.attach(patcher.load_device, patcher.offload_device)

    def detach(self, patcher) -> None:
        self.merge.detach()


def apply_lora_stack(model_patcher, entries: Sequence[LoraEntry | None], mode: str, seed: int = 0):
    """A clone of ``model_patcher`` with the stack applied in ``mode``; also returns a text report
    (what matched, what did not, what the mode leaves out and, in dynamic, which layers it merged)."""
    if mode not in MODES:
        raise LoraInputError(f"LoRA mode {mode!r} is not one of {', '.join(MODES)}")
    entries = [e for e in entries if e is not None]
    info = model_keys(model_patcher)
    slots, files = [], {}
    for index, entry in enumerate(entries):
        name = f"{index + 1}:{entry.lora_name}"
        if entry.strength == 0:
            slots.append(StackSlot(name, ParsedLora({}, {}, (), 0, 0), 0.0))
            continue
        file_key, state_dict = LORA_FILES.load(entry.path)
        files[name] = (file_key, state_dict)
        slots.append(StackSlot(name, parsed_lora(info, file_key, state_dict), float(entry.strength)))

    patcher = model_patcher.clone()
    active = active_slots(slots)
    left_out: list[LeftOut] = []
    merged: dict[str, list[str]] = {}
    if active and mode == "standard":
        import comfy.lora

        for slot in active:
            patches = comfy.lora.load_lora(files[slot.name][1], info.key_map, log_missing=False)
            patcher.add_patches(patches, slot.strength)
    elif active:
        previous = patcher.get_injections(INJECTION_KEY) or []
        chain = previous[0].appliers if previous else ()
        if mode == "dynamic":
            applier, left_out, merged = _dynamic_applier(patcher, info, active, files, len(chain), seed)
        else:
            applier, left_out = _stochastic_applier(patcher, info, active, files, seed)
        patcher.set_injections(INJECTION_KEY, [LoraInjection(chain + (applier,))])
        patcher.is_injected = False  # the clone's modules are not hooked yet, whatever its parent's state

    report = stack_report(slots, mode, left_out=left_out, merged=merged)
    unmatched = sum(len(s.parsed.unmatched) for s in active)
    log.log(logging.WARNING if unmatched or left_out else logging.INFO, "LowBit: %s", report.replace("\n", "\n  "))
    return patcher, report


def _adapter_patches(plan, files) -> dict[str, list[tuple]]:
    """Model key -> ``(slot, ComfyUI patch, slice or None)`` per entry of ``plan`` (``adapter_plan``'s
    ``(slot, {lora prefix: target})``), in slot order, as ``comfy.lora.load_lora`` builds them."""
    import comfy.lora

    patches: dict[str, list[tuple]] = {}
    for slot, prefixes in plan:
        for target, patch in comfy.lora.load_lora(files[slot.name][1], prefixes, log_missing=False).items():
            key, offset = (target, None) if isinstance(target, str) else (target[0], target[1])
            patches.setdefault(key, []).append((slot, patch, offset))
    return patches


def _patch_kind(key: str, patch) -> str:
    """What a ComfyUI patch is, for reports: ``LoRA``/``LoHa``/``LoKr``..., ``weight diff``, ``set_weight``."""
    if isinstance(patch, tuple):
        if key.endswith(".bias"):
            return "bias diff (.diff_b)"
        return {"diff": "weight diff (.diff)", "set": "set_weight"}.get(patch[0], str(patch[0]))
    return type(patch).__name__.replace("Adapter", "")


def _merge(patcher, info: _ModelKeys, low_rank, patches: dict[str, list[tuple]], seed: int,
           mode: str) -> tuple[StochasticMerge, list[LeftOut]]:
    """A :class:`StochasticMerge` of ``low_rank`` deltas and of ComfyUI adapter ``patches``, each run by
    ``comfy.lora.calculate_weight`` on the dequantized weight (LoHa/LoKr/DoRA/diff: dequantize ->
    adapter -> requantize); the original weights stay in memory. Patches on anything but a linear
    layer's weight (bias diffs, conv layers) cannot be merged: they are returned as left out."""
    try:
        from .comfy_ops import module_codec
    except ImportError:  # the ops adapter names no codec: derive it from each weight's layout
        module_codec = None

    shaped = {k for k in patches if len(info.shapes.get(k, ())) == 2}
    left_out = []
    for key in sorted(set(patches) - shaped):
        shape = info.shapes.get(key)
        reason = (f"{mode} mode merges into linear weights only, not biases" if shape is None and key.endswith(".bias")
                  else f"{mode} mode merges into linear [out, in] weights only; this weight has shape {shape}")
        left_out.extend(LeftOut(slot.name, key, _patch_kind(key, patch), reason) for slot, patch, _ in patches[key])

    def dense_deltas(key: str, weight: torch.Tensor) -> list[DenseDelta]:
        import comfy.lora

        out = []
        for slot, patch, offset in patches.get(key, ()):
            patched = comfy.lora.calculate_weight([(slot.strength, patch, 1.0, offset, None)], weight.clone(), key)
            out.append(DenseDelta(patched - weight, source=slot.name))
        return out

    def codec_of(module):
        try:
            return module_codec(module) if module_codec is not None else None
        except LowBitError:  # a format name this LowBit does not know: derive it from the layout instead
            return None

    merge = StochasticMerge(patcher.model, low_rank, seed=seed, codec_of=codec_of,
                            dense_deltas=dense_deltas if shaped else None, dense_layers=sorted(shaped))
    if patcher.is_dynamic():
        _twin_layers(patcher, merge.layers)
    return merge, left_out


def _twin_layers(patcher, weight_keys) -> None:
    """Under Dynamic VRAM, give each layer a merge changes its own module object: a twin of the base model's
    module (same parameters, see :mod:`..lora.twin`) installed as one of ``patcher``'s object patches.

    ModelPatcherDynamic caches the weight it streams per module object (VRAM allocation, residency
    signature, pinned host copy), filled at the first cast and never refreshed from the module's
    ``weight``: a merge swapped into the base model's module would run as the base weight once the base
    model has run. The patcher puts its object patches in the model before it loads, so the twin gets its
    own caches, filled from the merged weight the injection swaps into it; other patchers of the model
    load the base model's modules again. Without Dynamic VRAM the merge goes into the model's modules."""
    import comfy.patcher_extension
    import comfy.utils

    twins = []
    for key in weight_keys:
        path = key[: -len(".weight")]
        # the base model's module: the model's, or the one kept aside while some clone's object patch is in
        source = patcher.object_patches_backup.get(path)
        if source is None:
            source = comfy.utils.get_attr(patcher.model, path)
        twins.append(module_twin(source))
        patcher.add_object_patch(path, twins[-1])
    if twins:
        patcher.add_callback_with_key(comfy.patcher_extension.CallbacksMP.ON_DETACH, INJECTION_KEY,
                                      lambda detached, unpatch_all: _release_pins(detached, twins))


#: the pin subsets of ComfyUI's Dynamic VRAM a module's weight is pinned in (``comfy/pinned_memory.py``);
#: newer ComfyUI pins a model read from a fast disk under ``weights-fast`` (a subset absent here is skipped)
WEIGHT_PIN_SUBSETS = ("weights", "weights-loaded", "weights-fast")


def _release_pins(patcher, twins) -> None:
    """Give back the pinned host copies of ``twins`` (the layers a stack's patcher merged) when it detaches.

    Dynamic VRAM pins a module's weight the first time it is cast and keeps the module in a per-model
    stack of pins (``model.dynamic_pins``) that only shrinks from the top (``partially_unload_ram``), by
    RAM pressure, or when the last patcher of the model goes. Twins are new module objects per stack:
    left there, every replaced stack's twins - their pinned copy of the merged layers, the twins themselves
    - would stay for as long as the base model lives (RSS growing with every strength change). So when
    the patcher that runs them detaches (another model or stack is loaded, or it is garbage), the stack is
    unwound down to its lowest twin with ComfyUI's own ``partially_unload_ram``; any other module unwound
    with it (normally none: the base model's layers were pinned before any stack's) pins again the next
    time it runs, and so do the twins if this patcher is loaded again.
    """
    pin_state = getattr(patcher.model, "dynamic_pins", {}).get(patcher.load_device)
    if pin_state is None:
        return
    ids = {id(twin) for twin in twins}
    for subset in WEIGHT_PIN_SUBSETS:
        if subset not in pin_state:
            continue
        stack = pin_state[subset][1]
        lowest = next((i for i, (module, _) in enumerate(stack) if id(module) in ids), None)
        if lowest is None:
            continue
        size = sum(module._pins[subset]["pin"].nbytes for module, _ in stack[lowest:])
        patcher.partially_unload_ram(size, subsets=[subset])


def _dynamic_applier(patcher, info: _ModelKeys, active, files, position: int, seed: int):
    """``(applier, left out, merged)``: low-rank pairs in cached banks, other adapters through ComfyUI's
    bypass, and DoRA layers - which the bypass would run as a plain LoRA - merged like Stochastic merges
    them (``merged``: slot name -> weight keys), re-merged whenever the stack is applied again."""
    key = (position, tuple((s.name, files[s.name][0]) for s in active))
    loras = info.dynamic.get(key)
    if loras is None:
        loras = DynamicLoras(patcher.model, low_rank_plan(active))
        info.dynamic[key] = loras
        while len(info.dynamic) > 4:  # a patcher still holding an evicted set keeps it alive
            info.dynamic.popitem(last=False)
    else:
        info.dynamic.move_to_end(key)
    dora_plan, bypass_plan = [], []
    for slot, prefixes in adapter_plan(active):
        state_dict = files[slot.name][1]
        dora = {p: t for p, t in prefixes.items() if f"{p}.dora_scale" in state_dict}
        if dora:
            dora_plan.append((slot, dora))
        if len(dora) < len(prefixes):
            bypass_plan.append((slot, {p: t for p, t in prefixes.items() if p not in dora}))
    merge, left_out, merged = None, [], {}
    if dora_plan:
        patches = _adapter_patches(dora_plan, files)
        merge, left_out = _merge(patcher, info, {}, patches, seed, "dynamic")
        for layer in sorted(merge.layers):
            for slot, _, _ in patches[layer]:
                merged.setdefault(slot.name, []).append(layer)
        for name, layers in merged.items():
            log.info("LowBit: %s: dynamic mode merges %d DoRA layers into the weights instead of running them at "
                     "run time (ComfyUI's bypass ignores dora_scale): %s; a strength change of this LoRA re-merges "
                     "them", name, len(layers), ", ".join(layers))
    bypass, not_run = _bypass_injections(patcher, bypass_plan, files, info.shapes)
    strengths = {s.name: s.strength for s in active if s.name in loras.names}
    return _DynamicApplier(loras, strengths, bypass, merge), left_out + not_run, merged


def _linear_diff(key: str, patch: tuple, shapes) -> bool:
    """A ``diff`` of a linear layer's ``[out, in]`` weight or of its bias (what :class:`_DiffBypass` runs)."""
    if patch[0] != "diff":
        return False
    module, _, name = key.rpartition(".")
    dims = {"weight": 2, "bias": 1}.get(name)
    return patch[1][0].dim() == dims and len(shapes.get(f"{module}.weight", ())) == 2


def _bypass_injections(patcher, plan, files, shapes) -> tuple[list, list[LeftOut]]:
    """An injection running ``plan``'s adapters at run time through ComfyUI's bypass forward hooks, and the
    entries they cannot run.

    A hook replaces one module object's ``forward``, so each is made for the module that is in the model
    when ``patcher`` runs (``get_model_object``: the patcher's own object patch - a DoRA merge's twin -
    or the base model's module, even while another clone's object patches are in the model). Hooks on
    one module wrap each other: injected in order, ejected in reverse."""
    if not plan:
        return [], []
    from comfy.weight_adapter.bypass import BypassForwardHook

    hooks: list = []
    left_out = []
    for key, entries in _adapter_patches(plan, files).items():
        for slot, adapter, offset in entries:
            kind = _patch_kind(key, adapter)
            if offset is not None:
                left_out.append(LeftOut(slot.name, key, kind, f"on a slice {tuple(offset)} of a fused weight; "
                                        "ComfyUI's bypass runs adapters on whole layers only"))
                continue
            if isinstance(adapter, tuple):
                if not _linear_diff(key, adapter, shapes):
                    reason = ("it replaces the weight; dynamic mode only adds terms at run time" if adapter[0] == "set"
                              else "dynamic mode runs full diffs of linear weights and biases only")
                    left_out.append(LeftOut(slot.name, key, kind, reason))
                    continue
                adapter = _DiffBypass(adapter[1][0])  # a full weight or bias diff: its share of the output
            path = key.rsplit(".", 1)[0] if key.endswith((".weight", ".bias")) else key
            hooks.append(BypassForwardHook(patcher.get_model_object(path), adapter, multiplier=slot.strength))
    if not hooks:
        return [], left_out
    return [hooks_injection(hooks)], left_out


def hooks_injection(hooks: list):
    """One ``PatcherInjection`` for ComfyUI bypass ``hooks``: injected in order, ejected in reverse."""
    from comfy.patcher_extension import PatcherInjection

    def inject(_patcher) -> None:
        for hook in hooks:
            hook.inject()

    def eject(_patcher) -> None:
        for hook in reversed(hooks):
            hook.eject()

    return PatcherInjection(inject=inject, eject=eject)


class _DiffBypass:
    """A ``diff`` patch as a bypass adapter for ComfyUI's ``BypassForwardHook``: ``h(x) = x diffᵀ`` for a
    weight diff, the diff itself for a bias diff, times the hook's ``multiplier`` (the strength)."""

    def __init__(self, diff: torch.Tensor):
        self.weights = (diff,)

    def h(self, x: torch.Tensor, base_out: torch.Tensor) -> torch.Tensor:
        diff = self.weights[0].to(device=x.device, dtype=x.dtype)
        term = diff if diff.dim() == 1 else torch.nn.functional.linear(x, diff)
        return term * getattr(self, "multiplier", 1.0)

    def g(self, y: torch.Tensor) -> torch.Tensor:
        return y


def _stochastic_applier(patcher, info: _ModelKeys, active, files, seed: int):
    """``(applier, left out)``: every low-rank pair and adapter of the stack merged per layer."""
    patches = _adapter_patches(adapter_plan(active), files)
    merge, left_out = _merge(patcher, info, low_rank_plan(active), patches, seed, "stochastic")
    return _StochasticApplier(merge), left_out


# ---- nodes ------------------------------------------------------------------------------------

def _lora_names() -> list[str]:
    import folder_paths

    return folder_paths.get_filename_list("loras")


class LowBitLoraStackEntry(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowBitLoraStackEntry",
            display_name="LoRA Stack Entry (LowBit)",
            category=CATEGORY,
            description="One LoRA of a stack: a file from models/loras and its strength. Connect it to Apply LoRA "
                        "Stack (LowBit). Strength 0, or bypassing this node, turns it off.",
            inputs=[
                io.Combo.Input("lora_name", options=_lora_names(), tooltip="The LoRA file (models/loras)."),
                io.Float.Input("strength", **STRENGTH, tooltip="How strongly the LoRA changes the model (may be negative)."),
            ],
            outputs=[LoraEntryType.Output(display_name="lora")],
        )

    @classmethod
    def execute(cls, lora_name: str, strength: float) -> io.NodeOutput:
        return io.NodeOutput(LoraEntry(lora_name, lora_path(lora_name), float(strength)))


class LowBitApplyLoraStack(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        template = io.Autogrow.TemplatePrefix(
            input=LoraEntryType.Input("lora", tooltip="A LoRA Stack Entry (LowBit); a new slot appears as you connect one."),
            prefix="lora", min=0, max=MAX_STACK)
        return io.Schema(
            node_id="LowBitApplyLoraStack",
            display_name="Apply LoRA Stack (LowBit)",
            category=CATEGORY,
            description="Apply a stack of LoRAs (in slot order) to a quantized or float diffusion model. " + MODE_TOOLTIP,
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model to apply the LoRA(s) to: a LowBit quantized model, or any model in standard mode."),
                io.Combo.Input("mode", options=list(MODES), default=DEFAULT_MODE, tooltip=MODE_TOOLTIP),
                io.Autogrow.Input("loras", template=template, optional=True,
                                  tooltip="The LoRA stack, applied in slot order; bypassed entries and strength 0 are off."),
                io.Int.Input("merge_seed", **MERGE_SEED),
            ],
            outputs=[io.Model.Output(), io.String.Output(display_name="report")],
        )

    @classmethod
    def execute(cls, model, mode: str, loras: io.Autogrow.Type = None, merge_seed: int = 0) -> io.NodeOutput:
        entries = [value for _, value in sorted((loras or {}).items(), key=lambda kv: _slot_index(kv[0]))]
        patched, report = apply_lora_stack(model, entries, mode, merge_seed)
        return io.NodeOutput(patched, report)


def _slot_index(name: str) -> int:
    """``lora7`` (or ``loras.lora7``) -> 7: autogrow slots in slot order, not string order."""
    match = re.search(r"(\d+)$", name)
    return int(match.group(1)) if match else 0


class LowBitLoadLora(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowBitLoadLora",
            display_name="Load LoRA (LowBit)",
            category=CATEGORY,
            description="Apply one LoRA to a quantized or float diffusion model. " + MODE_TOOLTIP,
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model to apply the LoRA(s) to: a LowBit quantized model, or any model in standard mode."),
                io.Combo.Input("lora_name", options=_lora_names(), tooltip="The LoRA file (models/loras)."),
                io.Float.Input("strength", **STRENGTH, tooltip="How strongly the LoRA changes the model (may be negative)."),
                io.Combo.Input("mode", options=list(MODES), default=DEFAULT_MODE, tooltip=MODE_TOOLTIP),
                io.Int.Input("merge_seed", **MERGE_SEED),
            ],
            outputs=[io.Model.Output()],
        )

    @classmethod
    def execute(cls, model, lora_name: str, strength: float, mode: str, merge_seed: int = 0) -> io.NodeOutput:
        entry = LoraEntry(lora_name, lora_path(lora_name), float(strength))
        return io.NodeOutput(apply_lora_stack(model, [entry], mode, merge_seed)[0])


class LowBitLoadLoraStack(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        inputs = [io.Model.Input("model", tooltip="The diffusion model to apply the LoRA(s) to: a LowBit quantized model, or any model in standard mode."),
                  io.Combo.Input("mode", options=list(MODES), default=DEFAULT_MODE, tooltip=MODE_TOOLTIP)]
        for i in range(1, FIXED_SLOTS + 1):
            inputs.append(io.Combo.Input(f"lora_{i}", options=[NONE, *_lora_names()], default=NONE, optional=True,
                                         tooltip=f"LoRA file of slot {i} (models/loras); None leaves the slot off."))
            inputs.append(io.Float.Input(f"strength_{i}", **STRENGTH, optional=True,
                                         tooltip=f"Strength of slot {i}'s LoRA; 0 turns the slot off."))
        inputs.append(io.Int.Input("merge_seed", **MERGE_SEED))
        return io.Schema(
            node_id="LowBitLoadLoraStack",
            display_name="Load LoRA Stack (LowBit)",
            category=CATEGORY,
            description=f"Apply up to {FIXED_SLOTS} LoRAs (in slot order; None or strength 0 = off). " + MODE_TOOLTIP,
            inputs=inputs,
            outputs=[io.Model.Output(), io.String.Output(display_name="report")],
        )

    @classmethod
    def execute(cls, model, mode: str, merge_seed: int = 0, **slots) -> io.NodeOutput:
        entries = []
        for i in range(1, FIXED_SLOTS + 1):
            name = slots.get(f"lora_{i}", NONE)
            if name and name != NONE:
                entries.append(LoraEntry(name, lora_path(name), float(slots.get(f"strength_{i}", 1.0))))
        patched, report = apply_lora_stack(model, entries, mode, merge_seed)
        return io.NodeOutput(patched, report)


NODE_CLASSES = (LowBitLoraStackEntry, LowBitApplyLoraStack, LowBitLoadLora, LowBitLoadLoraStack)
