"""A LoRA stack: parsed LoRA files with strengths, in slot order, turned into per-layer work.

Slot order is the order deltas are listed (and, for Dynamic, the order of ranks in a bank); the
sum itself does not depend on it. A slot at strength 0 is off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from .delta import LowRankDelta
from .keys import ParsedLora


@dataclass(frozen=True)
class StackSlot:
    """One LoRA of a stack: a unique ``name`` (also its key in Dynamic banks), the parsed file, a strength."""

    name: str
    parsed: ParsedLora
    strength: float = 1.0


def active_slots(slots: Sequence[StackSlot]) -> list[StackSlot]:
    """The slots that change the model (strength not 0), in order; names must be unique."""
    seen: set[str] = set()
    for slot in slots:
        if slot.name in seen:
            raise ValueError(f"two LoRA stack slots are named {slot.name!r}; slot names must be unique")
        seen.add(slot.name)
    return [s for s in slots if s.strength != 0]


def low_rank_plan(slots: Sequence[StackSlot]) -> dict[str, list[tuple[str, LowRankDelta]]]:
    """Model weight key -> ``(slot name, delta at the slot's strength)``, in slot order."""
    plan: dict[str, list[tuple[str, LowRankDelta]]] = {}
    for slot in active_slots(slots):
        for layer, deltas in slot.parsed.low_rank.items():
            plan.setdefault(layer, []).extend((slot.name, d.with_strength(slot.strength)) for d in deltas)
    return plan


def adapter_plan(slots: Sequence[StackSlot]) -> list[tuple[StackSlot, dict[str, object]]]:
    """Per active slot with adapter entries: the slot and its ``{lora prefix: key-map target}``."""
    return [(s, dict(s.parsed.adapters)) for s in active_slots(slots) if s.parsed.adapters]


@dataclass(frozen=True)
class LeftOut:
    """A LoRA entry that matched a layer but that the chosen mode cannot apply: which LoRA (slot name),
    the model key, what kind of entry, why, and what to do instead."""

    slot: str
    key: str
    what: str
    reason: str
    fix: str = "use mode standard for this LoRA"


def stack_report(slots: Sequence[StackSlot], mode: str, *, left_out: Sequence[LeftOut] = (),
                 merged: Mapping[str, Sequence[str]] | None = None, limit: int = 8) -> str:
    """A human-readable account of what the stack does: per LoRA, what matched, what did not, what the
    mode leaves out (``left_out``) and, in dynamic mode, which layers it merged instead (``merged``:
    slot name -> model weight keys)."""
    active = active_slots(slots)
    merged = merged or {}
    lines = [f"LoRA stack ({mode}): {len(active)} active of {len(slots)}"]
    for slot in slots:
        state = "off (strength 0)" if slot.strength == 0 else f"strength {slot.strength:g}"
        lines.append(f"- {slot.parsed.summary(f'{slot.name} [{state}]')}")
        layers = merged.get(slot.name, ())
        if layers:
            lines.append(f"  merged into the weights instead of run dynamically (DoRA): {len(layers)} layers "
                         f"({', '.join(layers[:limit])}{', ...' if len(layers) > limit else ''}); a strength "
                         f"change of this LoRA re-merges them")
        mine = [item for item in left_out if item.slot == slot.name]
        if mine:
            lines.append(f"  left out by {mode} mode: {len(mine)}")
        for item in mine[:limit]:
            lines.append(f"  left out {item.key} ({item.what}): {item.reason}; {item.fix}")
        if len(mine) > limit:
            lines.append(f"  ... and {len(mine) - limit} more left out")
    unmatched = sum(len(s.parsed.unmatched) for s in active)
    lines.append(f"unmatched keys in active LoRAs: {unmatched}")
    lines.append(f"entries left out by {mode} mode: {len(left_out)}")
    return "\n".join(lines)
