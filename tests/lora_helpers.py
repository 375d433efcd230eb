"""Shared pieces of the LoRA tests: small weights every format takes, random LoRAs, error measures."""

from __future__ import annotations

import torch

from lowbit.lora.delta import LowRankDelta
from lowbit.quant.formats import FORMATS

FORMAT_NAMES = tuple(FORMATS)
OUT_FEATURES = 64
IN_FEATURES = 512  # a multiple of every format's in_features_multiple (256)


def base_weight(seed: int = 0, shape: tuple[int, int] = (OUT_FEATURES, IN_FEATURES)) -> torch.Tensor:
    """Gaussian weight (std 1/sqrt(K)) with a few outlier input channels, like trained transformers."""
    gen = torch.Generator().manual_seed(seed)
    n, k = shape
    weight = torch.randn(n, k, generator=gen) / k**0.5
    weight[:, torch.randperm(k, generator=gen)[:4]] *= 6.0
    return weight


def random_lora(seed: int, rank: int = 8, shape: tuple[int, int] = (OUT_FEATURES, IN_FEATURES), *,
                magnitude: float = 1.0, alpha: float | None = None, strength: float = 1.0,
                source: str = "") -> LowRankDelta:
    """A rank-``rank`` LoRA whose delta at strength 1 has RMS ``magnitude`` (alpha/rank included)."""
    gen = torch.Generator().manual_seed(1000 + seed)
    n, k = shape
    down = torch.randn(rank, k, generator=gen)
    up = torch.randn(n, rank, generator=gen)
    delta = LowRankDelta(down=down, up=up, alpha=alpha, strength=1.0, source=source)
    rms = (delta.factor * up @ down).pow(2).mean().sqrt()
    return LowRankDelta(down=down, up=up * (magnitude / rms), alpha=alpha, strength=strength, source=source)


def dense(delta: LowRankDelta, out_features: int = OUT_FEATURES) -> torch.Tensor:
    """The exact fp32 weight change of ``delta`` (reference, written independently of lora.delta)."""
    up = torch.zeros(out_features, delta.rank)
    offset, length = delta.rows if delta.rows is not None else (0, out_features)
    up[offset:offset + length] = delta.up.float()
    scale = 1.0 if delta.alpha is None else delta.alpha / delta.rank
    return delta.strength * scale * (up @ delta.down.float())


def rms(t: torch.Tensor) -> float:
    return float(t.float().pow(2).mean().sqrt())


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    noise = (reference.float() - approx.float()).pow(2).sum().clamp(min=1e-30)
    return float(10 * torch.log10(reference.float().pow(2).sum() / noise))


def dequant(qt) -> torch.Tensor:
    return qt.dequantize().float()
