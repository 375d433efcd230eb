"""Typed errors for everything a user can cause. Each message says what, what was expected,
what was found, and how to fix it."""

from __future__ import annotations


class LowBitError(ValueError):
    """Base class of LowBit's user-facing errors (a ``ValueError``, so callers can catch either)."""


class UnknownFormatError(LowBitError):
    """A format or mode name that LowBit does not know."""


class CheckpointFormatError(LowBitError):
    """A file that is not a readable safetensors checkpoint, or whose quantization data is wrong."""


class OutputExistsError(LowBitError, FileExistsError):
    """The output path exists and overwriting was not asked for."""


class NonFiniteWeightError(LowBitError):
    """A weight holds NaN or Inf values; quantizing it would spread them through the scale."""


class PolicyError(LowBitError):
    """A policy or preset that is malformed or does not fit the model."""
