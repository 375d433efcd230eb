"""Parse a LoRA state dict into per-layer deltas, given the model's LoRA key map.

The key map ``{lora_key_prefix: target}`` comes from the caller (the node layer builds it with
``comfy.lora.model_lora_keys_unet``; tests build it by hand). A target is a model weight key
(``diffusion_model.double_blocks.0.img_attn.qkv.weight``) or ``(key, (dim, offset, length))`` for a
slice of a fused weight (a diffusers ``to_q`` LoRA on Flux's ``qkv``).

Recognised low-rank pairs - the same names ComfyUI reads (``up`` / ``down``):

=================  ================================  ==================================
style              up                                down
=================  ================================  ==================================
kohya / LyCORIS    ``.lora_up.weight``               ``.lora_down.weight``
diffusers / PEFT   ``.lora_B.weight``                ``.lora_A.weight``
PEFT (named)       ``.lora_B.default.weight``        ``.lora_A.default.weight``
diffusers (old)    ``_lora.up.weight``               ``_lora.down.weight``
diffusers (attn)   ``.lora.up.weight``               ``.lora.down.weight``
transformers       ``.lora_linear_layer.up.weight``  ``.lora_linear_layer.down.weight``
mochi              ``.lora_B``                       ``.lora_A``
=================  ================================  ==================================

plus ``.alpha``. Which prefix names a layer is the key map's business, so kohya
(``lora_unet_...``), diffusers (``transformer....``) and ComfyUI-style (``diffusion_model....``)
keys all work through it.

Entries that are not a plain additive low-rank pair on a 2-D weight - LoHa, LoKr, DoRA
(``dora_scale``), LoCon ``lora_mid``, OFT/BOFT, GLoRA, full ``diff``/``set_weight``, ``reshape_weight``,
conv LoRAs or LoRAs on conv layers, row slices on another dimension - are returned as *adapter* prefixes for ComfyUI's
weight adapters (dequantize -> adapter -> requantize). Every key that matches no layer, has no
partner, or does not fit its layer's shape is listed in ``unmatched`` with the reason - never
silently dropped.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from .delta import LowRankDelta

#: (style, up suffix, down suffix), in ComfyUI's order of preference
LOW_RANK_STYLES: tuple[tuple[str, str, str], ...] = (
    ("kohya", ".lora_up.weight", ".lora_down.weight"),
    ("diffusers-old", "_lora.up.weight", "_lora.down.weight"),
    ("peft", ".lora_B.weight", ".lora_A.weight"),
    ("diffusers-attn", ".lora.up.weight", ".lora.down.weight"),
    ("mochi", ".lora_B", ".lora_A"),
    ("transformers", ".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight"),
    ("peft-named", ".lora_B.default.weight", ".lora_A.default.weight"),
)
ALPHA = ".alpha"
#: suffixes only ComfyUI's weight adapters (or its diff/set patches) can apply
ADAPTER_SUFFIXES: tuple[str, ...] = (
    ".hada_w1_a", ".hada_w1_b", ".hada_w2_a", ".hada_w2_b", ".hada_t1", ".hada_t2",  # LoHa
    ".lokr_w1", ".lokr_w2", ".lokr_w1_a", ".lokr_w1_b", ".lokr_w2_a", ".lokr_w2_b", ".lokr_t2",  # LoKr
    ".dora_scale", ".lora_mid.weight", ".reshape_weight",  # DoRA, LoCon mid, padded weights
    ".oft_blocks", ".rescale", ".a1.weight", ".a2.weight", ".b1.weight", ".b2.weight",  # OFT/BOFT, GLoRA
    ".diff", ".diff_b", ".w_norm", ".b_norm", ".set_weight",  # full diffs and set patches
)
_SUFFIXES = sorted({s for _, up, down in LOW_RANK_STYLES for s in (up, down)} | {ALPHA, *ADAPTER_SUFFIXES},
                   key=len, reverse=True)  # longest first: ".lora_B.weight" before ".lora_B"


@dataclass(frozen=True)
class UnmatchedKey:
    key: str
    reason: str


@dataclass(frozen=True)
class ParsedLora:
    """A LoRA file sorted by what can use each key."""

    low_rank: Mapping[str, tuple[LowRankDelta, ...]]  # model weight key -> deltas at strength 1
    adapters: Mapping[str, object]  # LoRA prefix -> key-map target, for ComfyUI's weight adapters
    unmatched: tuple[UnmatchedKey, ...]
    skipped: int  # keys left out on purpose (``skip_prefixes``: a text-encoder part, say)
    total_keys: int
    styles: Mapping[str, int] = field(default_factory=dict)  # low-rank pairs per key style

    @property
    def layers(self) -> int:
        return len(self.low_rank) + len({_target_key(t) for t in self.adapters.values()} - set(self.low_rank))

    def deltas(self, strength: float) -> dict[str, list[LowRankDelta]]:
        """``low_rank`` with every delta at ``strength``."""
        return {layer: [d.with_strength(strength) for d in ds] for layer, ds in self.low_rank.items()}

    def summary(self, name: str = "LoRA", limit: int = 8) -> str:
        """One paragraph for logs and node reports: what matched, what did not and why."""
        pairs = sum(len(v) for v in self.low_rank.values())
        styles = ", ".join(f"{k}: {v}" for k, v in sorted(self.styles.items())) or "none"
        lines = [f"{name}: {self.total_keys} keys; {pairs} low-rank pairs on {len(self.low_rank)} layers ({styles}); "
                 f"{len(self.adapters)} entries for ComfyUI's weight adapters; {self.skipped} skipped; "
                 f"{len(self.unmatched)} unmatched"]
        for item in self.unmatched[:limit]:
            lines.append(f"  unmatched {item.key}: {item.reason}")
        if len(self.unmatched) > limit:
            lines.append(f"  ... and {len(self.unmatched) - limit} more")
        return "\n".join(lines)


def _target_key(target) -> str:
    return target[0] if isinstance(target, tuple) else target


def split_key(key: str) -> tuple[str, str] | None:
    """``(prefix, suffix)`` for a LoRA key with a recognised suffix, else ``None``."""
    for suffix in _SUFFIXES:
        if key.endswith(suffix) and len(key) > len(suffix):
            return key[: -len(suffix)], suffix
    return None


def parse_lora(lora: Mapping[str, torch.Tensor], key_map: Mapping[str, object], *,
               shapes: Mapping[str, Sequence[int]] | None = None,
               skip_prefixes: Sequence[str] = ()) -> ParsedLora:
    """Sort the keys of ``lora`` into low-rank deltas per model weight, adapter entries and unmatched keys.

    ``shapes`` (model weight key -> shape), when given, lets a pair that does not fit its layer be
    reported as unmatched instead of failing later. Keys starting with one of ``skip_prefixes`` are
    counted as skipped (e.g. the text-encoder half of a LoRA applied to the model only).
    """
    groups: dict[str, dict[str, str]] = {}
    unmatched: list[UnmatchedKey] = []
    skipped = 0
    for key in lora:
        if skip_prefixes and key.startswith(tuple(skip_prefixes)):
            skipped += 1
            continue
        split = split_key(key)
        if split is None:
            unmatched.append(UnmatchedKey(key, "not a LoRA key LowBit or ComfyUI knows (unrecognised suffix)"))
            continue
        prefix, suffix = split
        groups.setdefault(prefix, {})[suffix] = key

    low_rank: dict[str, list[LowRankDelta]] = {}
    adapters: dict[str, object] = {}
    styles: Counter = Counter()
    for prefix, keys in groups.items():
        target = key_map.get(prefix)
        if target is None:
            unmatched.extend(UnmatchedKey(k, f"no model layer for LoRA prefix {prefix!r}") for k in keys.values())
            continue
        weight_key, rows = _target(target)
        pair = next(((style, up, down) for style, up, down in LOW_RANK_STYLES if up in keys or down in keys), None)
        adapter_only = any(s in keys for s in ADAPTER_SUFFIXES)
        if pair is None or adapter_only or not weight_key.endswith(".weight") or rows == "other-dim":
            if pair is None and not adapter_only:  # only an alpha
                unmatched.extend(UnmatchedKey(k, "alpha without a LoRA pair") for k in keys.values())
                continue
            adapters[prefix] = target
            continue
        style, up_suffix, down_suffix = pair
        if up_suffix not in keys or down_suffix not in keys:
            missing = down_suffix if up_suffix in keys else up_suffix
            unmatched.extend(UnmatchedKey(k, f"half of a LoRA pair: {prefix + missing!r} is missing")
                             for k in keys.values())
            continue
        up, down = lora[keys[up_suffix]], lora[keys[down_suffix]]
        target_shape = None if shapes is None else shapes.get(weight_key)
        if up.dim() != 2 or down.dim() != 2 or (target_shape is not None and len(target_shape) != 2):
            adapters[prefix] = target  # conv LoRA or conv layer: ComfyUI's adapter reshapes it
            continue
        alpha = float(lora[keys[ALPHA]].item()) if ALPHA in keys else None
        try:
            delta = LowRankDelta(down=down, up=up, alpha=alpha, rows=rows, source=prefix)
        except ValueError as err:  # e.g. a slice length that is not up's row count
            unmatched.extend(UnmatchedKey(k, str(err)) for k in keys.values())
            continue
        if shapes is not None:
            problem = _shape_problem(delta, weight_key, shapes)
            if problem:
                unmatched.extend(UnmatchedKey(k, problem) for k in keys.values())
                continue
        low_rank.setdefault(weight_key, []).append(delta)
        styles[style] += 1
    return ParsedLora(low_rank={k: tuple(v) for k, v in low_rank.items()}, adapters=adapters,
                      unmatched=tuple(unmatched), skipped=skipped, total_keys=len(lora), styles=dict(styles))


def _target(target) -> tuple[str, object]:
    """(weight key, rows) from a key-map value; rows ``None``, ``(offset, length)`` or ``"other-dim"``."""
    if isinstance(target, str):
        return target, None
    if isinstance(target, (tuple, list)) and len(target) == 2 and isinstance(target[0], str):
        dim, offset, length = target[1]
        return target[0], ((int(offset), int(length)) if int(dim) == 0 else "other-dim")
    raise TypeError(f"key-map value must be a weight key or (key, (dim, offset, length)), got {target!r}")


def _shape_problem(delta: LowRankDelta, weight_key: str, shapes: Mapping[str, Sequence[int]]) -> str | None:
    shape = shapes.get(weight_key)
    if shape is None:
        return f"target {weight_key!r} is not in the model"
    try:
        delta.check_fits((int(shape[0]), int(shape[1])), weight_key)
    except ValueError as err:
        return str(err)
    return None
