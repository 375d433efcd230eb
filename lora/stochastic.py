"""Stochastic mode: merge a stack of LoRA deltas into a quantized weight with one stochastic rounding.

Per layer: the deltas are summed in fp32 *in the layout's stored basis* (rotated by the same
Hadamard as the weight; for HadaNorm also divided by the smoothing factors, with the stored row
sums updated), added to the stored weight read back in that basis (codes x scale), the scale grows
only where the sum would leave the grid, and the result is rounded once, stochastically, with a
seeded generator. The base codes are grid points, so only the delta's part is randomised: the merged
weight equals base + delta on average (no LoRA rounded away, no drift), and a strong LoRA never clips.

Layouts without an in-basis rule here (``w4a8``'s codebook packing, and any future layout) take
the general path: dequantize, add, requantize with the codec's options and seed. So do
``fp8_rowwise`` weights with outlier channels (``[N, K + 2r]`` codes, two e4m3 terms on the indexed
channels): requantizing keeps their ``outlier_index`` (the layout's ``requantize_kwargs``). ``w4a8`` stochastic
requantization needs comfy-kitchen >= 0.2.28; older kitchens round to nearest (logged once).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import zlib
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from comfy_kitchen.tensor import QuantizedTensor

from ..kernels.hadamard import rotate_blocks
from ..kernels.reference import pack_int4_signed, unpack_int4_signed
from ..quant.layouts import fp8_rowwise, fp8_tensorwise, int8_hadanorm, int8_quarot, int8_tensorwise, w4a4_convrot
from ..quant.layouts.base import FormatCodec
from .delta import Delta, sum_deltas
from .grid import FP8_MAX, grown_scale, round_to_fp8, round_to_int_grid

log = logging.getLogger(__name__)

INT8_MAX = 127
INT4_MAX = 7
_warned: set[str] = set()


@dataclass(frozen=True)
class MergeResult:
    """The merged weight and what the merge had to do."""

    weight: QuantizedTensor
    rescaled: int  # scale entries (rows, or the one tensor scale) grown to keep the sum on the grid
    scales: int  # scale entries in the layout (rows, or 1)
    path: str  # "in-basis" or "requantize"


def layer_seed(seed: int, layer: str) -> int:
    """A per-layer seed (>= 1) from a run seed and the layer name, so layers draw independent noise."""
    return (zlib.crc32(layer.encode("utf-8")) ^ (int(seed) * 0x9E3779B1)) % (2**31 - 1) + 1


def merge_stochastic(codec: FormatCodec, qt: QuantizedTensor, deltas: Sequence[Delta], *, seed: int,
                     layer: str = "") -> QuantizedTensor:
    """``qt`` with ``deltas`` merged by one seeded stochastic rounding (see the module docstring)."""
    if int(seed) < 1:
        raise ValueError(f"stochastic merge seed must be >= 1 (0 means round-to-nearest), got {seed}")
    return merge_deltas(codec, qt, deltas, seed=seed, layer=layer).weight


def merge_nearest(codec: FormatCodec, qt: QuantizedTensor, deltas: Sequence[Delta], *, layer: str = "") -> QuantizedTensor:
    """The same merge rounded to nearest: the reference that rounds small deltas away."""
    return merge_deltas(codec, qt, deltas, seed=None, layer=layer).weight


def merge_deltas(codec: FormatCodec, qt: QuantizedTensor, deltas: Sequence[Delta], *, seed: int | None,
                 layer: str = "") -> MergeResult:
    """Merge ``deltas`` into ``qt``. ``seed`` >= 1: stochastic rounding; ``None``: round to nearest."""
    if not isinstance(qt, QuantizedTensor):
        raise TypeError(f"layer {layer!r}: expected a QuantizedTensor weight, got {type(qt).__name__}")
    if getattr(qt._params, "transposed", False):
        raise ValueError(f"layer {layer!r}: cannot merge into a transposed weight view; merge into the module's weight")
    shape = tuple(qt._params.orig_shape)
    active = [d for d in deltas if d.strength != 0]
    for d in active:
        d.check_fits(shape, layer)
    scales = _scale_count(qt)
    if not active:
        return MergeResult(qt, 0, scales, "none")
    generator = None
    if seed is not None:
        generator = torch.Generator(device=qt._qdata.device).manual_seed(int(seed))
    rule = _IN_BASIS.get(qt._layout_cls)
    if getattr(qt._params, "outlier_index", None) is not None:
        rule = None  # the in-basis FP8 rule reads [N, K] codes; an outlier layer stores [N, K + 2r]
    if rule is None:
        weight, rescaled = _requantize(codec, qt, active, seed, layer)
        return MergeResult(weight, rescaled, scales, "requantize")
    weight, rescaled = rule(qt, active, generator, layer)
    if rescaled:
        log.debug("layer %s: %d of %d scales grown so the merged LoRA does not saturate", layer, rescaled, scales)
    return MergeResult(weight, rescaled, scales, "in-basis")


def _scale_count(qt: QuantizedTensor) -> int:
    scale = qt._params.scale
    return 1 if scale.numel() == 1 else int(qt._params.orig_shape[0])


def _with(qt: QuantizedTensor, qdata: torch.Tensor, **changes) -> QuantizedTensor:
    return QuantizedTensor(qdata, qt._layout_cls, dataclasses.replace(qt._params, **changes))


def _merge_on_int_grid(qt, codes, delta_in_basis, generator, qmax):
    """codes x scale + delta, rounded back onto ``[-qmax, qmax]`` x (grown) scale."""
    scale = qt._params.scale
    merged = codes.float() * _per_row(scale) + delta_in_basis
    new_scale, rescaled = grown_scale(merged, scale, qmax)
    return round_to_int_grid(merged / _per_row(new_scale), qmax, generator), new_scale, rescaled


def _per_row(scale: torch.Tensor) -> torch.Tensor:
    """A scale (one value, ``[N]`` or ``[N, 1]``) shaped to broadcast over ``[N, K]`` (fp32)."""
    return scale.float().reshape(()) if scale.numel() == 1 else scale.float().reshape(-1, 1)


# ---- the in-basis rules, one per layout ------------------------------------------------------

def _int8_tensorwise(qt, deltas, generator, layer):
    p = qt._params
    rotate = None
    if p.convrot:
        group = p.convrot_groupsize
        rotate = lambda m: rotate_blocks(m, "regular", group)  # noqa: E731 - kitchen's ConvRot basis
    delta = sum_deltas(deltas, p.orig_shape, device=qt._qdata.device, layer=layer, map_inputs=rotate)
    codes, scale, rescaled = _merge_on_int_grid(qt, qt._qdata, delta, generator, INT8_MAX)
    return _with(qt, codes, scale=scale), rescaled


def _int8_quarot(qt, deltas, generator, layer):
    p = qt._params
    rotate = lambda m: rotate_blocks(m, int8_quarot.HADAMARD, p.group_size)  # noqa: E731
    delta = sum_deltas(deltas, p.orig_shape, device=qt._qdata.device, layer=layer, map_inputs=rotate)
    codes, scale, rescaled = _merge_on_int_grid(qt, qt._qdata, delta, generator, INT8_MAX)
    return _with(qt, codes, scale=scale), rescaled


def _int8_hadanorm(qt, deltas, generator, layer):
    p = qt._params
    smooth = p.smooth.float()
    smoothed = sum_deltas(deltas, p.orig_shape, device=qt._qdata.device, layer=layer, map_inputs=lambda m: m / smooth)
    rowsum = p.rowsum.float() + smoothed.sum(dim=1)  # the exact mean-centring term follows the float weight
    delta = rotate_blocks(smoothed, int8_hadanorm.HADAMARD, p.group_size)
    codes, scale, rescaled = _merge_on_int_grid(qt, qt._qdata, delta, generator, INT8_MAX)
    return _with(qt, codes, scale=scale, rowsum=rowsum.to(p.rowsum.dtype)), rescaled


def _w4a4_convrot(qt, deltas, generator, layer):
    p = qt._params
    rotate = lambda m: rotate_blocks(m, "regular", p.convrot_groupsize)  # noqa: E731
    delta = sum_deltas(deltas, p.orig_shape, device=qt._qdata.device, layer=layer, map_inputs=rotate)
    codes, scale, rescaled = _merge_on_int_grid(qt, unpack_int4_signed(qt._qdata), delta, generator, INT4_MAX)
    return _with(qt, pack_int4_signed(codes), scale=scale), rescaled


def _fp8(qt, deltas, generator, layer):
    p = qt._params
    delta = sum_deltas(deltas, p.orig_shape, device=qt._qdata.device, layer=layer)
    merged = qt._qdata.float() * _per_row(p.scale) + delta
    new_scale, rescaled = grown_scale(merged, p.scale, FP8_MAX)
    return _with(qt, round_to_fp8(merged / _per_row(new_scale), generator), scale=new_scale), rescaled


_IN_BASIS: dict[str, Callable] = {
    int8_tensorwise.LAYOUT: _int8_tensorwise,
    int8_quarot.LAYOUT: _int8_quarot,
    int8_hadanorm.LAYOUT: _int8_hadanorm,
    w4a4_convrot.LAYOUT: _w4a4_convrot,
    fp8_tensorwise.LAYOUT: _fp8,
    fp8_rowwise.LAYOUT: _fp8,
}


# ---- the general path: dequantize -> add -> requantize ---------------------------------------

def _requantize(codec: FormatCodec, qt: QuantizedTensor, deltas, seed: int | None, layer: str):
    p = qt._params
    merged = qt.dequantize().float() + sum_deltas(deltas, p.orig_shape, device=qt._qdata.device, layer=layer)
    kwargs = {}
    if seed is not None:
        if _layout_takes_seed(qt):
            kwargs["stochastic_rounding"] = int(seed)
        elif qt._layout_cls not in _warned:
            _warned.add(qt._layout_cls)
            log.warning("LowBit LoRA: this comfy-kitchen cannot round %s (%s) weights stochastically; merged LoRAs "
                        "are rounded to nearest, so very weak LoRAs may be rounded away. Upgrade comfy-kitchen to "
                        ">= 0.2.28 for stochastic merging, or use Dynamic mode.", codec.spec.name, qt._layout_cls)
    try:
        # the layout's own options (for w4a8: the codebook already chosen, the scale dtype)
        new = qt.requantize_from_float(merged, **kwargs)
    except NotImplementedError:
        new = codec.quantize(merged, compute_dtype=p.orig_dtype, seed=int(seed or 0))
    new = QuantizedTensor(new._qdata, new._layout_cls, dataclasses.replace(new._params, orig_dtype=p.orig_dtype))
    return new, 0


def _layout_takes_seed(qt: QuantizedTensor) -> bool:
    return "stochastic_rounding" in inspect.signature(qt.layout_cls.quantize).parameters


def codec_for_weight(qt: QuantizedTensor) -> FormatCodec:
    """The registered codec that produces ``qt``'s layout (``int8`` vs ``int8_convrot`` by its flag)."""
    from ..quant.formats import FORMATS

    matches = [c for c in FORMATS.values() if c.spec.layout == qt._layout_cls]
    if qt._layout_cls == int8_tensorwise.LAYOUT:
        matches = [c for c in matches if c.convrot == bool(getattr(qt._params, "convrot", False))]
    if not matches:
        raise ValueError(f"no LowBit format stores weights as {qt._layout_cls}; LoRAs cannot be merged into it "
                         f"stochastically. Use Standard or Dynamic mode for this model.")
    return matches[0]


def merge_float(weight: torch.Tensor, deltas: Sequence[Delta], *, layer: str = "") -> torch.Tensor:
    """A float weight plus the fp32 sum of ``deltas``, in the weight's dtype (layers kept in float)."""
    active = [d for d in deltas if d.strength != 0]
    if not active:
        return weight
    total = sum_deltas(active, tuple(weight.shape), device=weight.device, layer=layer)
    return (weight.float() + total).to(weight.dtype)
