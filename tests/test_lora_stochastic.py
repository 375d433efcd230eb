"""Stochastic mode (lora/stochastic.py): unbiased merges, weak LoRAs survive, strong LoRAs do not clip."""

from __future__ import annotations

import dataclasses
import inspect
import logging

import pytest
import torch
from comfy_kitchen.tensor import AsymW4A8Int8Layout, QuantizedTensor

from lora_helpers import (FORMAT_NAMES, IN_FEATURES, OUT_FEATURES, base_weight, dense, dequant, random_lora, rms,
                          sqnr_db)
from lowbit.lora.delta import DenseDelta, LowRankDelta
from lowbit.lora.errors import LoraShapeError
from lowbit.lora.stochastic import layer_seed, merge_deltas, merge_nearest, merge_stochastic
from lowbit.quant.formats import get_format

SHAPE = (OUT_FEATURES, IN_FEATURES)
KITCHEN_W4A8_SEED = "stochastic_rounding" in inspect.signature(AsymW4A8Int8Layout.quantize).parameters
NEEDS_SEEDED_REQUANT = pytest.mark.skipif(
    not KITCHEN_W4A8_SEED, reason="w4a8 merges requantize; stochastic rounding there needs comfy-kitchen >= 0.2.28 "
                                  "(this one rounds to nearest - see test_w4a8_merge_falls_back_to_nearest_with_warning)")


def _stochastic_formats():
    return [pytest.param(f, marks=NEEDS_SEEDED_REQUANT) if f == "w4a8" else f for f in FORMAT_NAMES]


def _quantized(fmt: str, seed: int = 0):
    codec = get_format(fmt)
    weight = base_weight(seed)
    return codec, weight, codec.quantize(weight, compute_dtype=torch.float32)


def _grid_step(weight: torch.Tensor, qt) -> float:
    """The format's typical grid step on this weight, from its measured rounding error (uniform-noise model)."""
    return rms(dequant(qt) - weight) * 12**0.5


@pytest.mark.parametrize("fmt", _stochastic_formats())
def test_mean_merged_weight_is_base_plus_delta(fmt):
    """Show 2a: over many seeds the merge averages to base + delta; its error shrinks like 1/sqrt(seeds)."""
    codec, weight, qt = _quantized(fmt)
    step = _grid_step(weight, qt)
    loras = [random_lora(1, magnitude=1.5 * step, alpha=4.0, strength=0.7), random_lora(2, rank=4, magnitude=step)]
    target = dequant(qt) + dense(loras[0]) + dense(loras[1])
    seeds = 64
    draws = torch.stack([dequant(merge_stochastic(codec, qt, loras, seed=s)) for s in range(1, seeds + 1)])

    single = rms(draws[0] - target)
    averaged = rms(draws.mean(0) - target)
    assert single > 0.05 * step  # the rounding is really stochastic
    assert averaged < 2.5 * single / seeds**0.5, (fmt, averaged, single)  # unbiased: no error floor
    assert averaged < 0.1 * rms(target - dequant(qt)), (fmt, averaged)


def _kept_fraction(change: torch.Tensor, true_change: torch.Tensor) -> float:
    """How much of ``true_change`` ``change`` carries (least-squares coefficient: 1 = all, 0 = none)."""
    return float((change.flatten() @ true_change.flatten()) / (true_change.flatten() @ true_change.flatten()))


@pytest.mark.parametrize("fmt", _stochastic_formats())
def test_weak_lora_is_not_rounded_away(fmt):
    """Show 2b: at strength 0.1 (a tenth of a grid step) the LoRA still moves the weight, on average
    by the right amount; the round-to-nearest merge loses most of it (int grids: nearly all; fp8, whose
    grid is finer near zero: over 40 %)."""
    codec, weight, qt = _quantized(fmt)
    lora = random_lora(3, rank=8, magnitude=_grid_step(weight, qt), strength=0.1)
    change = dense(lora)

    nearest = dequant(merge_nearest(codec, qt, [lora])) - dequant(qt)
    assert _kept_fraction(nearest, change) < 0.6, fmt

    seeds = 64
    mean_change = sum(dequant(merge_stochastic(codec, qt, [lora], seed=s)) for s in range(1, seeds + 1)) / seeds
    mean_change = mean_change - dequant(qt)
    assert 0.85 < _kept_fraction(mean_change, change) < 1.15, fmt
    assert rms(mean_change - change) < 0.5 * rms(change), (fmt, rms(mean_change - change) / rms(change))


@pytest.mark.parametrize("fmt", _stochastic_formats())
def test_weak_lora_changes_the_output_measurably(fmt):
    """One merge at strength 0.1: the layer's output moves with the true LoRA change (clear correlation)."""
    codec, weight, qt = _quantized(fmt, seed=4)
    lora = random_lora(4, rank=8, magnitude=_grid_step(weight, qt), strength=0.1)
    x = torch.randn(64, IN_FEATURES, generator=torch.Generator().manual_seed(11))
    true_change = (x @ dense(lora).T).flatten()
    base_out = codec.linear(x, qt)
    merged_change = (codec.linear(x, merge_stochastic(codec, qt, [lora], seed=layer_seed(5, "blk"))) - base_out).flatten()
    nearest_change = (codec.linear(x, merge_nearest(codec, qt, [lora])) - base_out).flatten()

    correlation = float(torch.corrcoef(torch.stack([merged_change, true_change]))[0, 1])
    assert correlation > 0.15, (fmt, correlation)  # 4096 outputs: chance correlation is ~0.016
    assert _kept_fraction(nearest_change, true_change) < 0.6, fmt  # nearest loses most of the change


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_strong_lora_does_not_clip(fmt):
    """Show 2c: a strength-4 LoRA that takes weights far past the old grid edge is stored as well as
    quantizing base + delta from scratch would store it; the scale grew instead of saturating."""
    codec, weight, qt = _quantized(fmt)
    lora = random_lora(5, rank=16, magnitude=1.5 * rms(weight), alpha=16.0, strength=4.0)
    target = dequant(qt) + dense(lora)
    assert target.abs().amax() > 1.5 * dequant(qt).abs().amax()  # the LoRA really leaves the old grid

    result = merge_deltas(codec, qt, [lora], seed=9)
    merged = dequant(result.weight)
    fresh = dequant(codec.quantize(target, compute_dtype=torch.float32, seed=9 if KITCHEN_W4A8_SEED or fmt != "w4a8" else 0))
    assert sqnr_db(target, merged) > sqnr_db(target, fresh) - 1.0, (fmt, sqnr_db(target, merged), sqnr_db(target, fresh))
    if result.path == "in-basis":
        assert float(merged.abs().amax()) > 0.95 * float(target.abs().amax())  # the peaks survive
        assert result.rescaled > result.scales // 2  # most rows (or the one scale) had to grow
    else:  # requantized by the format's own quantizer (w4a8's codebook may not reach the peak itself)
        assert float(merged.abs().amax()) > 0.95 * float(fresh.abs().amax())


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_merged_layer_runs_like_the_float_layer_with_the_lora(fmt):
    """The merged weight runs through the format's own linear (HadaNorm row sums included) and stays
    close to x @ (W + delta).T. Its error is the base rounding error (step^2/12) plus one stochastic
    rounding of the delta (step^2/6 on average), so the output SQNR may drop by up to
    10*log10(3) = 4.8 dB from the base's - that is the price of an unbiased merge; Dynamic pays none."""
    codec, weight, qt = _quantized(fmt, seed=2)
    lora = random_lora(6, rank=16, magnitude=0.3 * rms(weight), alpha=8.0)
    x = torch.randn(32, IN_FEATURES, generator=torch.Generator().manual_seed(12))
    merged = merge_stochastic(codec, qt, [lora], seed=3)
    base_sqnr = sqnr_db(x @ weight.T, codec.linear(x, qt))
    merged_sqnr = sqnr_db(x @ (weight + dense(lora)).T, codec.linear(x, merged))
    assert merged_sqnr > base_sqnr - 5.5, (fmt, merged_sqnr, base_sqnr)


@pytest.mark.parametrize("fmt", [f for f in FORMAT_NAMES if f != "w4a8"])
def test_rows_without_a_delta_keep_their_codes_and_scales(fmt):
    codec, weight, qt = _quantized(fmt)
    full = random_lora(7, rank=4, shape=(16, IN_FEATURES), magnitude=0.2 * rms(weight))
    lora = LowRankDelta(full.down, full.up, rows=(8, 16))
    merged = merge_stochastic(codec, qt, [lora], seed=4)
    assert torch.equal(merged._qdata[24:].view(torch.uint8), qt._qdata[24:].view(torch.uint8))
    assert torch.equal(merged._qdata[:8].view(torch.uint8), qt._qdata[:8].view(torch.uint8))
    assert not torch.equal(merged._qdata[8:24].view(torch.uint8), qt._qdata[8:24].view(torch.uint8))
    if qt._params.scale.numel() > 1:
        assert torch.equal(merged._params.scale.flatten()[24:], qt._params.scale.flatten()[24:])


def test_hadanorm_row_sums_follow_the_merged_float_weight():
    codec, weight, qt = _quantized("int8_hadanorm")
    lora = random_lora(8, magnitude=0.3 * rms(weight))
    merged = merge_stochastic(codec, qt, [lora], seed=2)
    expected = ((weight + dense(lora)) / qt._params.smooth).sum(dim=1)
    assert torch.allclose(merged._params.rowsum, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(merged._params.smooth, qt._params.smooth)


@pytest.mark.parametrize("fmt", ["int8_convrot", "fp8_rowwise", "w4a4"])
def test_merge_is_reproducible_per_seed(fmt):
    codec, _, qt = _quantized(fmt)
    loras = [random_lora(9), random_lora(10, rank=2)]
    a = merge_stochastic(codec, qt, loras, seed=17)
    b = merge_stochastic(codec, qt, loras, seed=17)
    c = merge_stochastic(codec, qt, loras, seed=18)
    assert torch.equal(a._qdata.view(torch.uint8), b._qdata.view(torch.uint8))
    assert not torch.equal(a._qdata.view(torch.uint8), c._qdata.view(torch.uint8))
    assert layer_seed(1, "a") != layer_seed(1, "b") and layer_seed(1, "a") == layer_seed(1, "a") >= 1


def test_dense_delta_merges_like_the_equal_low_rank_delta():
    codec, _, qt = _quantized("int8_quarot")
    lora = random_lora(11, alpha=2.0, strength=0.6)
    from_low_rank = merge_stochastic(codec, qt, [lora], seed=5)
    from_dense = merge_stochastic(codec, qt, [DenseDelta(dense(lora.with_strength(1.0)), strength=0.6)], seed=5)
    same = (from_low_rank._qdata == from_dense._qdata).float().mean()
    assert float(same) > 0.999  # fp32 summation order may flip a draw sitting on a threshold


def test_nothing_to_merge_returns_the_same_weight():
    codec, _, qt = _quantized("int8")
    assert merge_stochastic(codec, qt, [], seed=1) is qt
    assert merge_stochastic(codec, qt, [random_lora(1, strength=0.0)], seed=1) is qt


def test_bad_inputs_are_refused_with_a_reason():
    codec, _, qt = _quantized("int8")
    with pytest.raises(ValueError, match="seed must be >= 1"):
        merge_stochastic(codec, qt, [random_lora(1)], seed=0)
    with pytest.raises(LoraShapeError, match="made for a different model"):
        merge_stochastic(codec, qt, [random_lora(1, shape=(OUT_FEATURES, 256))], seed=1, layer="blocks.0")
    transposed = QuantizedTensor(qt._qdata, qt._layout_cls, dataclasses.replace(qt._params, transposed=True))
    with pytest.raises(ValueError, match="transposed"):
        merge_stochastic(codec, transposed, [random_lora(1)], seed=1)


@pytest.mark.skipif(KITCHEN_W4A8_SEED, reason="this comfy-kitchen rounds w4a8 stochastically")
def test_w4a8_merge_falls_back_to_nearest_with_warning(caplog):
    codec, weight, qt = _quantized("w4a8")
    lora = random_lora(12, magnitude=0.2 * rms(weight))
    import lowbit.lora.stochastic as stochastic

    stochastic._warned.discard(qt._layout_cls)
    with caplog.at_level(logging.WARNING, logger="lowbit.lora.stochastic"):
        merged = merge_stochastic(codec, qt, [lora], seed=3)
    assert "Upgrade comfy-kitchen to >= 0.2.28" in caplog.text
    nearest = merge_nearest(codec, qt, [lora])
    assert torch.equal(merged._qdata, nearest._qdata)
    assert merged._params.codebook is not None and torch.equal(merged._params.codebook, qt._params.codebook)
    target = dequant(qt) + dense(lora)
    assert sqnr_db(target, dequant(merged)) > sqnr_db(weight, dequant(qt)) - 3.0
