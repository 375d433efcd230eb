"""Outlier channels of ``fp8_rowwise`` layers: which input channels get a second e4m3 term.

Plain e4m3 x e4m3 round-to-nearest leaves each operand with ~31.6 dB of relative error whatever the
scaling, so the product sits near 28.7 dB. An LLM.int8-style split lifts that where it matters: for
a small set ``O`` of ``r`` input channels both the activation and the weight also store the residual
of their first e4m3 code (``quant/layouts/fp8_rowwise.py``), computed as ``2r`` extra K columns of
the same FP8 GEMM. The channels that carry most of the output's error are those where a large
activation meets a large weight column, so ``O`` is the top ``r`` of::

    score_j = max|X_j| (over the calibration inputs) * ||W[:, j]||_2

``r`` is ``outlier_fraction * K`` rounded up to a multiple of :data:`OUTLIER_MULTIPLE` (16; at most
half of ``K``); the default 1/48 gives 64 channels at ``K = 3072`` (4 % more GEMM work; on the
issue's outlier problem 28.7 dB plain, 31.4 dB with 32 channels, 32.0 dB with 64). The gain depends
on the activation statistics: with no outlier channels in the inputs there is little to win.

Nothing here imports ComfyUI.
"""

from __future__ import annotations

import math

import torch

from .errors import PolicyError

FP8_ROWWISE = "fp8_rowwise"
OUTLIER_MULTIPLE = 16
DEFAULT_OUTLIER_FRACTION = 1 / 48


def check_outlier_fraction(fraction) -> float:
    """``fraction`` as a float in ``[0, 0.5]``, else a :class:`PolicyError` (0 turns the split off)."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= float(fraction) <= 0.5:
        raise PolicyError(f"outlier_fraction (share of an fp8_rowwise layer's input channels given a second e4m3 "
                          f"term) must be a number from 0 to 0.5, got {fraction!r}; e.g. {DEFAULT_OUTLIER_FRACTION:.4f}")
    return float(fraction)


def outlier_count(in_features: int, fraction: float = DEFAULT_OUTLIER_FRACTION) -> int:
    """``r`` for a layer of ``in_features`` inputs: ``fraction * K`` rounded up to a multiple of 16, at most K/2."""
    if fraction <= 0:
        return 0
    r = math.ceil(in_features * fraction / OUTLIER_MULTIPLE) * OUTLIER_MULTIPLE
    cap = in_features // 2 // OUTLIER_MULTIPLE * OUTLIER_MULTIPLE
    return min(r, cap)


def outlier_scores(channel_amax: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``max|X_j| * ||W[:, j]||`` per input channel (fp32 ``[K]``)."""
    return channel_amax.float().reshape(-1).to(weight.device) * weight.float().norm(dim=0)


def select_outlier_channels(channel_amax: torch.Tensor, weight: torch.Tensor, count: int) -> torch.Tensor | None:
    """The ``count`` channels of largest :func:`outlier_scores`, sorted, int32 on the CPU (``None`` when 0).

    Ties go to the lower channel (a stable order), so the same inputs always give the same index."""
    if count <= 0:
        return None
    scores = outlier_scores(channel_amax, weight).cpu()
    order = torch.sort(scores, descending=True, stable=True).indices[:count]
    return order.sort().values.to(torch.int32)


def layer_outlier_channels(channel_amax: torch.Tensor, weight: torch.Tensor, fraction: float,
                           pre_quant_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """The outlier channels an ``fp8_rowwise`` layer runs with: chosen on the activations it quantizes
    (``x * pre_quant_scale`` when smoothed, with ``weight`` then the smoothed weight)."""
    amax = channel_amax.float()
    if pre_quant_scale is not None:
        amax = amax * pre_quant_scale.float().to(amax.device)
    return select_outlier_channels(amax, weight, outlier_count(weight.shape[1], fraction))


def encode_channels(index: torch.Tensor) -> list[int]:
    """The policy-file form: a JSON list of channel numbers."""
    return [int(c) for c in index.tolist()]


def decode_channels(layer: str, data, in_features: int) -> torch.Tensor:
    """The int32 index a policy file lists for ``layer``, or a :class:`PolicyError` saying what is wrong."""
    from .layouts.fp8_rowwise import outlier_index_problem

    if not isinstance(data, list) or not all(isinstance(c, int) and not isinstance(c, bool) for c in data):
        raise PolicyError(f"policy file: outlier_channels of layer {layer!r} must be a list of channel numbers, "
                          f"found {type(data).__name__}")
    index = torch.tensor(data, dtype=torch.int32)
    problem = outlier_index_problem(index, in_features)
    if problem:
        raise PolicyError(f"policy file: outlier_channels of layer {layer!r} are not valid for its {in_features} "
                          f"input features ({problem}); recalibrate the policy for this model")
    return index


__all__ = ["DEFAULT_OUTLIER_FRACTION", "OUTLIER_MULTIPLE", "check_outlier_fraction", "decode_channels",
           "encode_channels", "layer_outlier_channels", "outlier_count", "outlier_scores", "select_outlier_channels"]
