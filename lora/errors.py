"""Typed errors for LoRA problems a user can cause (a bad file, a LoRA for another model)."""

from __future__ import annotations

from ..quant.errors import LowBitError


class LoraFormatError(LowBitError):
    """A LoRA state dict whose tensors are malformed (a missing half of a pair, wrong ranks)."""


class LoraShapeError(LowBitError):
    """A LoRA delta whose shape does not fit the layer it targets (a LoRA made for another model)."""
