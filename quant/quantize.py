"""Quantize float weights: one weight, or a whole state dict under a policy (in memory).

The streaming file-to-file converter (``quant/convert.py``) uses the same per-layer function, so a
file converted on disk and a state dict converted in memory are identical.
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping

import torch
from comfy_kitchen.tensor import QuantizedTensor

from .errors import NonFiniteWeightError
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


def quantize_weight(weight: torch.Tensor, fmt: str, *, name: str = "weight",
                    compute_dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                    device: torch.device | str | None = None) -> QuantizedTensor:
    """Quantize one float ``[out, in]`` weight to format ``fmt`` (on ``device`` when given)."""
    codec = get_format(fmt)
    check_finite(name, weight)
    if device is not None:
        weight = weight.to(device)
    return codec.quantize(weight, compute_dtype=compute_dtype, seed=seed)


def quantize_layer(name: str, weight: torch.Tensor, fmt: str, *, compute_dtype: torch.dtype = torch.bfloat16,
                   device: torch.device | str | None = None, seed: int = 0) -> dict[str, torch.Tensor]:
    """The native checkpoint entries (on CPU) of layer ``name`` quantized to ``fmt``."""
    qt = quantize_weight(weight, fmt, name=name, compute_dtype=compute_dtype, seed=seed, device=device)
    return {k: v.to("cpu").contiguous() for k, v in layer_tensors(get_format(fmt), name, qt).items()}


def quantize_state_dict(state_dict: Mapping[str, torch.Tensor], policy: Policy | None = None, *,
                        compute_dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                        plan: Plan | None = None,
                        progress: Callable[[int, int], None] | None = None) -> tuple[dict[str, torch.Tensor], Plan]:
    """Quantize a float state dict to the native checkpoint form.

    Returns the new state dict (quantized layers as ``weight`` + scales + ``comfy_quant``; every other
    tensor unchanged) and the plan that decided each layer. ``progress(done, total)`` is called
    after each quantized layer.
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
        out.update(quantize_layer(layer, tensor, fmt, compute_dtype=compute_dtype, device=device))
        done += 1
        if progress is not None:
            progress(done, len(chosen))
    return out, plan
