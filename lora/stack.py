"""A LoRA stack: parsed LoRA files with strengths, in slot order, turned into per-layer work.

Slot order is the order deltas are listed (and, for Dynamic, the order of ranks in a bank); the
sum itself does not depend on it. A slot at strength 0 is off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

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


def stack_report(slots: Sequence[StackSlot], mode: str) -> str:
    """A human-readable account of what the stack does: per LoRA, what matched and what did not."""
    active = active_slots(slots)
    lines = [f"LoRA stack ({mode}): {len(active)} active of {len(slots)}"]
    for slot in slots:
        state = "off (strength 0)" if slot.strength == 0 else f"strength {slot.strength:g}"
        lines.append(f"- {slot.parsed.summary(f'{slot.name} [{state}]')}")
    unmatched = sum(len(s.parsed.unmatched) for s in active)
    lines.append(f"unmatched keys in active LoRAs: {unmatched}")
    return "\n".join(lines)
