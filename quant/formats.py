"""The format registry: one entry per format name a user can pick.

Each entry is the codec of one file in ``quant/layouts/``; its :class:`FormatSpec` says which
kitchen layout holds the weight, what ``comfy_quant`` JSON the checkpoint carries, what hardware the
fast path needs and whether stock ComfyUI can load the file.
"""

from __future__ import annotations

from typing import Mapping

from .errors import UnknownFormatError
from .layouts.base import FormatCodec, FormatSpec
from .layouts.fp8_rowwise import FP8_ROWWISE
from .layouts.fp8_tensorwise import FP8_TENSORWISE
from .layouts.int8_hadanorm import INT8_HADANORM
from .layouts.int8_quarot import INT8_QUAROT
from .layouts.int8_tensorwise import INT8, INT8_CONVROT
from .layouts.w4a4_convrot import W4A4
from .layouts.w4a8_asym import W4A8

FORMATS: dict[str, FormatCodec] = {
    codec.spec.name: codec
    for codec in (INT8, INT8_CONVROT, INT8_QUAROT, INT8_HADANORM, FP8_TENSORWISE, FP8_ROWWISE, W4A4, W4A8)
}

__all__ = ["FORMATS", "FormatCodec", "FormatSpec", "get_format", "format_for_comfy_quant", "fallback_chain"]


def get_format(name: str) -> FormatCodec:
    """The codec registered as ``name``, or an :class:`UnknownFormatError` listing the known ones."""
    try:
        return FORMATS[name]
    except KeyError:
        raise UnknownFormatError(
            f"unknown quantization format {name!r}; known formats: {', '.join(FORMATS)}"
        ) from None


def format_for_comfy_quant(conf: Mapping) -> FormatCodec:
    """The codec whose native ``comfy_quant`` JSON ``conf`` is."""
    if not isinstance(conf, Mapping) or not isinstance(conf.get("format"), str):
        raise UnknownFormatError(f"comfy_quant must be a JSON object with a string 'format', got {conf!r}")
    for codec in FORMATS.values():
        if codec.matches(conf):
            return codec
    known = sorted({c.spec.native_format for c in FORMATS.values()})
    raise UnknownFormatError(
        f"comfy_quant format {conf['format']!r} is not one LowBit reads; readable formats: {', '.join(known)}"
    )


def fallback_chain(name: str, shape: tuple[int, ...]) -> tuple[FormatCodec, list[str]]:
    """The first format in ``name``'s fallback chain that takes ``shape``, and why each earlier one could not.

    Raises ``ValueError`` when no format in the chain takes the shape (a non-2-D weight, say).
    """
    reasons: list[str] = []
    codec: FormatCodec | None = get_format(name)
    while codec is not None:
        problem = codec.spec.shape_problem(tuple(shape))
        if problem is None:
            return codec, reasons
        reasons.append(problem)
        codec = get_format(codec.spec.fallback) if codec.spec.fallback else None
    raise ValueError("; ".join(reasons))
