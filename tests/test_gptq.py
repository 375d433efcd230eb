"""GPTQ rounding (``quant/gptq.py``) and the formats that take a ``hessian`` quantize option."""

from __future__ import annotations

import pytest
import torch

from lowbit.quant.errors import LowBitError
from lowbit.quant.formats import get_format
from lowbit.quant.gptq import GPTQConfig, gptq_round, row_grid
from lowbit.quant.quantize import quantize_weight

GPTQ_FORMATS = ("int8", "int8_convrot", "fp8_rowwise", "w4a4", "w4a8")
IDENTITY = GPTQConfig(act_order=False)


def _inputs(rows: int, k: int, seed: int, mix: torch.Tensor, gain: torch.Tensor, shift: torch.Tensor):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, k, generator=gen) @ mix) * gain + shift


@pytest.fixture(scope="module")
def layer():
    """A 256 x 512 weight with outlier input channels, and inputs shaped like a modulated norm's output:
    correlated channels, uneven gains and a mean offset; calibration and held-out rows from one distribution."""
    gen = torch.Generator().manual_seed(0)
    n, k = 256, 512
    weight = torch.randn(n, k, generator=gen) / k ** 0.5
    weight[:, torch.randint(0, k, (4,), generator=gen)] *= 8
    mix = torch.eye(k) + 0.3 * torch.randn(k, k, generator=gen) / k ** 0.5
    gain = 1 + 0.5 * torch.randn(k, generator=gen)
    shift = 0.5 * torch.randn(k, generator=gen)
    calib = _inputs(8 * k, k, 1, mix, gain, shift)
    held_out = _inputs(2 * k, k, 2, mix, gain, shift)
    return weight, calib, held_out


def _output_error(x: torch.Tensor, weight: torch.Tensor, quantized) -> float:
    ref = x @ weight.T
    return float((x @ quantized.dequantize().float().T - ref).norm() / ref.norm())


@pytest.mark.parametrize("fmt,options", [(f, {}) for f in GPTQ_FORMATS] + [("w4a4", {"scales": "absmax"})])
def test_identity_hessian_is_round_to_nearest(fmt, options, layer):
    """With H = I every column's error stays its own: the codes and scales are the format's own quantizer's, bit
    for bit (so the GPTQ path keeps the format's scales and grid exactly)."""
    weight = layer[0]
    nearest = quantize_weight(weight, fmt, options=options)
    for config in (IDENTITY, GPTQConfig()):  # act order permutes a diagonal H: still no error moves
        rounded = quantize_weight(weight, fmt, options={**options, "hessian": torch.eye(weight.shape[1]),
                                                        "gptq": config})
        assert rounded._layout_cls == nearest._layout_cls
        assert torch.equal(rounded._qdata.view(torch.uint8), nearest._qdata.view(torch.uint8))
        for field in ("scale", "s_channel", "codebook", "convrot", "convrot_groupsize"):
            if hasattr(nearest._params, field):
                mine, theirs = getattr(rounded._params, field), getattr(nearest._params, field)
                assert torch.equal(mine, theirs) if isinstance(theirs, torch.Tensor) else mine == theirs


@pytest.mark.parametrize("fmt,min_gain", [("int8_convrot", 0.12), ("w4a4", 0.12), ("w4a8", 0.10), ("int8", 0.02),
                                          ("fp8_rowwise", 0.02)])
def test_gptq_lowers_the_output_error(fmt, min_gain, layer):
    """On inputs with correlated, uneven channels GPTQ lowers the layer's output error against round-to-nearest,
    on the calibration rows and on held-out rows of the same distribution. (The rotated formats gain most: the
    rotation turns the channels' uneven gains into correlations between the rotated channels.)"""
    weight, calib, held_out = layer
    nearest = quantize_weight(weight, fmt)
    rounded = quantize_weight(weight, fmt, options={"hessian": calib.T @ calib})
    in_rtn, in_gptq = _output_error(calib, weight, nearest), _output_error(calib, weight, rounded)
    out_rtn, out_gptq = _output_error(held_out, weight, nearest), _output_error(held_out, weight, rounded)
    assert in_gptq < (1 - 2 * min_gain) * in_rtn, (in_rtn, in_gptq)
    assert out_gptq < (1 - min_gain) * out_rtn, (out_rtn, out_gptq)


@pytest.mark.parametrize("fmt", GPTQ_FORMATS)
def test_gptq_weights_are_the_formats_own(fmt, layer):
    """A GPTQ-rounded layer is an ordinary weight of its format: the same native tensors and comfy_quant, loaded
    back by the format's own reader to the same values."""
    weight, calib, _ = layer
    codec = get_format(fmt)
    qt = quantize_weight(weight, fmt, options={"hessian": calib.T @ calib})
    tensors = codec.state_dict(qt)
    conf = codec.comfy_quant(qt)
    again = codec.from_state_dict("layer", tensors, conf, compute_dtype=torch.bfloat16)
    assert torch.equal(again.dequantize(), qt.dequantize())
    if fmt in ("int8", "int8_convrot"):
        assert qt._qdata.dtype == torch.int8 and int(qt._qdata.abs().max()) <= 127


def test_gptq_round_on_a_row_grid_matches_the_algorithm():
    """``gptq_round`` against a plain column-at-a-time GPTQ written out here (no blocks, no act order)."""
    gen = torch.Generator().manual_seed(3)
    n, k = 16, 40
    weight = torch.randn(n, k, generator=gen)
    x = torch.randn(200, k, generator=gen) @ torch.randn(k, k, generator=gen)
    h = (x.T @ x).double()
    scale = weight.abs().amax(dim=1) / 7
    grid = row_grid(scale, -7, 7)
    got = gptq_round(weight, h, grid, GPTQConfig(damp=0.01, block=8, act_order=False))
    damped = h + 0.01 * h.diagonal().mean() * torch.eye(k, dtype=h.dtype)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(damped)), upper=True).float()
    w = weight.clone()
    want = torch.empty_like(w)
    for i in range(k):
        q = grid(w[:, i:i + 1], torch.tensor([i]))[:, 0]
        want[:, i] = q
        w[:, i:] -= ((w[:, i] - q) / u[i, i])[:, None] * u[i, i:][None, :]
    assert torch.equal(got, want)
    # every value a grid point, and the blocked, reordered run on the same grid
    assert torch.equal(torch.round(got / scale[:, None]) * scale[:, None], got)
    ordered = gptq_round(weight, h, grid, GPTQConfig(block=7))
    assert torch.equal(torch.round(ordered / scale[:, None]) * scale[:, None], ordered)


def test_few_rows_and_dead_inputs():
    """A Hessian of fewer rows than inputs (a modulation layer sees one row a step), with an input that was always
    zero: the damping makes it invertible, nothing is NaN, and the rows seen lose error."""
    gen = torch.Generator().manual_seed(4)
    weight = torch.randn(64, 256, generator=gen) / 16
    x = torch.randn(4, 256, generator=gen)
    x[:, 7] = 0
    qt = quantize_weight(weight, "int8_convrot", options={"hessian": x.T @ x})
    assert torch.isfinite(qt.dequantize()).all()
    assert _output_error(x, weight, qt) < 0.5 * _output_error(x, weight, quantize_weight(weight, "int8_convrot"))


def test_bad_hessians_and_options_are_refused(layer):
    weight = layer[0]
    k = weight.shape[1]
    with pytest.raises(ValueError, match=r"must be \[512, 512\]"):
        quantize_weight(weight, "int8", options={"hessian": torch.eye(k - 1)})
    bad = torch.eye(k)
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        quantize_weight(weight, "fp8_rowwise", options={"hessian": bad})
    with pytest.raises(ValueError, match="stochastic rounding"):
        quantize_weight(weight, "int8_convrot", seed=3, options={"hessian": torch.eye(k)})
    with pytest.raises(ValueError, match="outlier channels"):
        quantize_weight(weight, "fp8_rowwise", options={"hessian": torch.eye(k),
                                                        "outlier_channels": torch.tensor([1, 2], dtype=torch.int32)})
    with pytest.raises(LowBitError, match="hessian"):  # a format without GPTQ says so instead of ignoring it
        quantize_weight(weight, "int8_quarot", options={"hessian": torch.eye(k)})


def test_config_validates_and_round_trips():
    config = GPTQConfig(damp=0.05, block=64, act_order=False)
    assert GPTQConfig.from_dict(config.to_dict()) == config
    for bad in ({"damp": 0.0}, {"damp": 2.0}, {"block": 0}):
        with pytest.raises(ValueError):
            GPTQConfig(**bad)
    with pytest.raises(ValueError, match="unknown"):
        GPTQConfig.from_dict({"dampening": 0.1})
