"""LoRA merges into ``fp8_rowwise`` weights with calibrated outlier channels (``[N, K + 2r]`` codes):
Stochastic mode requantizes them keeping their index and layout; the merge is unbiased and runs."""

from __future__ import annotations

import pytest
import torch

from lora_helpers import IN_FEATURES, base_weight, dense, dequant, random_lora, rms, sqnr_db
from lowbit.lora.stochastic import merge_deltas, merge_nearest, merge_stochastic
from lowbit.quant.formats import get_format
from lowbit.quant.layouts.fp8_rowwise import LAYOUT

R = 32  # outlier channels: a multiple of 16, as calibration picks them


def _outlier_weight(seed: int = 0):
    """(codec, float weight, its fp8_rowwise weight with R outlier channels)."""
    codec = get_format("fp8_rowwise")
    weight = base_weight(seed)
    index = torch.randperm(IN_FEATURES, generator=torch.Generator().manual_seed(seed + 100))[:R].sort().values
    qt = codec.quantize(weight, compute_dtype=torch.float32, outlier_channels=index.to(torch.int32))
    assert tuple(qt._qdata.shape) == (weight.shape[0], IN_FEATURES + 2 * R)
    return codec, weight, qt


def test_merge_keeps_the_outlier_index_and_layout():
    codec, weight, qt = _outlier_weight()
    lora = random_lora(1, magnitude=0.3 * rms(weight), alpha=8.0)
    # e4m3 round-to-nearest keeps ~31.6 dB of a weight; stochastic rounding of the whole requantized
    # weight adds twice the noise power (~3 dB less)
    for seed, floor_db in ((None, 30.0), (7, 27.0)):
        result = merge_deltas(codec, qt, [lora], seed=seed, layer="blk")
        merged = result.weight
        assert result.path == "requantize"
        assert merged._layout_cls == LAYOUT
        assert torch.equal(merged._params.outlier_index, qt._params.outlier_index)
        assert tuple(merged._qdata.shape) == tuple(qt._qdata.shape)
        assert tuple(merged.shape) == tuple(weight.shape) and merged._params.orig_dtype == torch.float32
        target = dequant(qt) + dense(lora)
        assert sqnr_db(target, dequant(merged)) > floor_db, (seed, sqnr_db(target, dequant(merged)))


def test_stochastic_merge_is_unbiased_and_weak_loras_survive():
    """Requantizing from float rounds the whole weight stochastically; on average it is still base + delta."""
    codec, weight, qt = _outlier_weight(seed=1)
    step = rms(dequant(get_format("fp8_rowwise").quantize(weight, compute_dtype=torch.float32)) - weight) * 12**0.5
    lora = random_lora(2, rank=8, magnitude=step, strength=0.1)
    change = dense(lora)
    seeds = 48
    mean = sum(dequant(merge_stochastic(codec, qt, [lora], seed=s)) for s in range(1, seeds + 1)) / seeds
    kept = float(((mean - dequant(qt)).flatten() @ change.flatten()) / (change.flatten() @ change.flatten()))
    assert 0.8 < kept < 1.2, kept
    assert rms(merge_nearest(codec, qt, [lora]).dequantize().float() - dequant(qt)) > 0  # nearest runs too


def test_merged_outlier_layer_runs_like_the_float_layer_with_the_lora():
    codec, weight, qt = _outlier_weight(seed=2)
    lora = random_lora(6, rank=16, magnitude=0.3 * rms(weight), alpha=8.0)
    x = torch.randn(32, IN_FEATURES, generator=torch.Generator().manual_seed(12))
    x[:, qt._params.outlier_index.long()] *= 20  # hot outlier channels, where the second term matters
    merged = merge_stochastic(codec, qt, [lora], seed=3)
    base_sqnr = sqnr_db(x @ weight.T, codec.linear(x, qt))
    merged_sqnr = sqnr_db(x @ (weight + dense(lora)).T, codec.linear(x, merged))
    assert merged_sqnr > base_sqnr - 5.5, (merged_sqnr, base_sqnr)


@pytest.mark.parametrize("seed", [None, 5])
def test_plain_fp8_rowwise_still_merges_in_basis(seed):
    codec = get_format("fp8_rowwise")
    weight = base_weight(3)
    qt = codec.quantize(weight, compute_dtype=torch.float32)
    result = merge_deltas(codec, qt, [random_lora(4, magnitude=0.1 * rms(weight))], seed=seed)
    assert result.path == "in-basis" and result.weight._params.outlier_index is None
