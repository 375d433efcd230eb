"""Quantize float weights: one weight, or a whole state dict under a policy (in memory).

The streaming file-to-file converter (``quant/convert.py``) uses the same per-layer function, so a
file converted on disk and a state dict converted in memory are identical.
"""

from __future__ import annotations

import inspect
import logging
from typing import Callable, Mapping

import torch
from comfy_kitchen.tensor import QuantizedTensor

from .errors import LowBitError, NonFiniteWeightError
from .formats import get_format
from .native import layer_tensors
from .policy import Plan, Policy

log = logging.getLogger(__name__)


def check_finite(name: str, weight: torch.Tensor) -> None:
    """Raise :class:`NonFiniteWeightError` when ``weight`` has NaN or Inf values."""
    if not weight.is_floating_point():
        return
    if weight.element_size() == 1:  # fp8: isfinite has no fp8 kernel
        weight = weight.float()
    if not torch.isfinite(weight).all():
        bad = int((~torch.isfinite(weight)).sum())
        raise NonFiniteWeightError(
            f"layer {name!r} has {bad} NaN/Inf values out of {weight.numel()}; quantizing would spread them through "
            f"the scale. Fix the source checkpoint, or keep this layer in float (extra_keep_float / --keep-float)."
        )


#: what a caller may give per layer: ``(layer, format) -> keyword options of that format's codec.quantize``
QuantizeOptions = Callable[[str, str], Mapping[str, object]]


def format_options(fmt: str) -> frozenset[str]:
    """The per-layer keyword options format ``fmt``'s ``codec.quantize`` takes (``hessian``: GPTQ rounding,
    ``outlier_channels``, ``scales``, ...), beside ``compute_dtype`` and ``seed``."""
    parameters = inspect.signature(get_format(fmt).quantize).parameters
    return frozenset(p for p, info in parameters.items()
                     if info.kind is inspect.Parameter.KEYWORD_ONLY and p not in ("compute_dtype", "seed"))


def gptq_problem(formats) -> str | None:
    """Why GPTQ rounding cannot help a plan quantizing to ``formats`` (none of them takes a ``hessian``), else None."""
    formats = sorted(set(formats))
    if not formats or any("hessian" in format_options(f) for f in formats):
        return None
    return (f"none of the formats this mode quantizes to ({', '.join(formats)}) takes GPTQ rounding; pick a mode of "
            f"int8, int8_convrot, fp8_rowwise, w4a4 or w4a8 layers (or int4_mixed), or round to nearest (Quantize Model, "
            f"'lowbit quantize')")


def check_quantize_options(name: str, fmt: str, options: Mapping[str, object]) -> dict[str, object]:
    """``options`` as a dict, after checking that format ``fmt``'s codec takes each of them.

    A per-layer option the codec does not know (outlier channels for an ``int8`` layer, say) is an
    error, not a silently ignored keyword: it means the caller's plan and its options disagree."""
    if not isinstance(options, Mapping):
        raise LowBitError(f"layer {name!r}: quantize options must be a mapping of keyword arguments, found "
                          f"{type(options).__name__}; fix the quantize_options passed for this layer")
    options = dict(options)
    if not options:
        return options
    reserved = sorted({"compute_dtype", "seed"} & set(options))
    parameters = inspect.signature(get_format(fmt).quantize).parameters
    takes = {p for p, info in parameters.items() if info.kind is inspect.Parameter.KEYWORD_ONLY}
    unknown = sorted(set(options) - takes) + reserved
    if unknown:
        allowed = sorted(takes - {"compute_dtype", "seed"})
        raise LowBitError(f"layer {name!r} ({fmt}): the quantize option(s) {', '.join(unknown)} are not options of "
                          f"this format (it takes: {', '.join(allowed) or 'none'}); give them only to layers of a "
                          f"format that takes them")
    return options


def layer_options(policy: Policy, layer: str, fmt: str,
                  quantize_options: QuantizeOptions | None = None) -> dict[str, object]:
    """The codec options of ``layer`` (format ``fmt``): ``policy``'s for that format (``w4a4``: its
    ``w4a4_scales``), then the caller's per-layer ``quantize_options(layer, fmt)`` on top."""
    options = policy.codec_options(fmt)
    if quantize_options is not None:
        options.update(check_quantize_options(layer, fmt, quantize_options(layer, fmt)))
    return options


def quantize_weight(weight: torch.Tensor, fmt: str, *, name: str = "weight",
                    compute_dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                    device: torch.device | str | None = None,
                    options: Mapping[str, object] | None = None) -> QuantizedTensor:
    """Quantize one float ``[out, in]`` weight to format ``fmt`` (on ``device`` when given).

    ``options`` are extra keyword arguments of the format's ``codec.quantize`` (``fp8_rowwise``:
    ``outlier_channels``); one the codec does not take raises a :class:`LowBitError`."""
    codec = get_format(fmt)
    options = check_quantize_options(name, fmt, options or {})
    check_finite(name, weight)
    if device is not None:
        weight = weight.to(device)
    return codec.quantize(weight, compute_dtype=compute_dtype, seed=seed, **options)


def quantize_layer(name: str, weight: torch.Tensor, fmt: str, *, compute_dtype: torch.dtype = torch.bfloat16,
                   device: torch.device | str | None = None, seed: int = 0,
                   options: Mapping[str, object] | None = None) -> dict[str, torch.Tensor]:
    """The native checkpoint entries (on CPU) of layer ``name`` quantized to ``fmt`` (``options``: as
    :func:`quantize_weight`)."""
    qt = quantize_weight(weight, fmt, name=name, compute_dtype=compute_dtype, seed=seed, device=device,
                         options=options)
    return {k: v.to("cpu").contiguous() for k, v in layer_tensors(get_format(fmt), name, qt).items()}


def quantize_state_dict(state_dict: Mapping[str, torch.Tensor], policy: Policy | None = None, *,
                        compute_dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                        plan: Plan | None = None,
                        progress: Callable[[int, int], None] | None = None,
                        quantize_options: QuantizeOptions | None = None) -> tuple[dict[str, torch.Tensor], Plan]:
    """Quantize a float state dict to the native checkpoint form.

    Returns the new state dict (quantized layers as ``weight`` + scales + ``comfy_quant``; every other
    tensor unchanged) and the plan that decided each layer. ``progress(done, total)`` is called
    after each quantized layer. Each layer's codec gets the policy's options for its format
    (:meth:`Policy.codec_options`) and ``quantize_options(layer, format)``'s extra keyword options on
    top (as :func:`quantize_weight`; ``fp8_rowwise``: ``outlier_channels``).
    """
    policy = policy or Policy()
    if plan is None:
        plan = policy.plan({k: tuple(v.shape) for k, v in state_dict.items()})
    chosen = {d.name: d.format for d in plan.quantized}
    out: dict[str, torch.Tensor] = {}
    done = 0
    for key, tensor in state_dict.items():
        layer = key[: -len(".weight")] if key.endswith(".weight") else None
        fmt = chosen.get(layer) if layer is not None else None
        if fmt is None:
            out[key] = tensor
            continue
        options = layer_options(policy, layer, fmt, quantize_options)
        out.update(quantize_layer(layer, tensor, fmt, compute_dtype=compute_dtype, device=device, options=options))
        done += 1
        if progress is not None:
            progress(done, len(chosen))
    return out, plan
