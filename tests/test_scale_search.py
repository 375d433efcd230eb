"""Per-row scale search (``quant/scale_search.py``) and the ``w4a4`` weights it gives."""

from __future__ import annotations

import math

import pytest
import torch

from lowbit.quant import scale_search
from lowbit.quant.formats import get_format
from lowbit.quant.scale_search import mse_row_scales


def _row_sq_error(w: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
    s = scale[:, None]
    return (w - torch.clamp(torch.round(w / s), -qmax, qmax) * s).pow(2).sum(dim=1)


def _rows(seed: int = 0) -> torch.Tensor:
    """Gaussian rows, heavy-tailed rows, rows with one large value, a constant row and an all-zero row."""
    gen = torch.Generator().manual_seed(seed)
    gauss = torch.randn(64, 3072, generator=gen)
    heavy = torch.distributions.StudentT(3.0).sample((32, 3072))
    spiky = torch.randn(16, 3072, generator=gen)
    spiky[:, 7] = 40.0
    return torch.cat([gauss, heavy, spiky, torch.full((1, 3072), 0.5), torch.zeros(1, 3072)])


@pytest.mark.parametrize("qmax", [7, 127])
def test_no_row_is_worse_than_with_its_abs_max_scale(qmax):
    w = _rows()
    searched = mse_row_scales(w, qmax)
    absmax = w.abs().amax(dim=1).clamp(min=1e-10) / qmax
    assert searched.shape == (w.shape[0],) and searched.dtype == torch.float32 and torch.isfinite(searched).all()
    assert (_row_sq_error(w, searched, qmax) <= _row_sq_error(w, absmax, qmax)).all()


def test_gaussian_rows_in_4_bits_clip_and_halve_the_error():
    """15 levels over +-3.6 sigma (the abs-max of 3072 Gaussian values) against the least-error range near
    +-2.5 sigma: the searched scale is about 0.67 of the abs-max one and the squared error falls by 1.86x
    (2.7 dB) here."""
    w = _rows()[:64]
    searched = mse_row_scales(w, 7)
    absmax = w.abs().amax(dim=1) / 7
    ratio = (searched / absmax).mean().item()
    gain = (_row_sq_error(w, absmax, 7).sum() / _row_sq_error(w, searched, 7).sum()).item()
    assert 0.55 < ratio < 0.8 and gain > 1.7, (ratio, gain)


def test_a_zero_row_keeps_zero_codes():
    w = torch.zeros(3, 64)
    scale = mse_row_scales(w, 7)
    assert (scale > 0).all() and torch.equal(torch.round(w / scale[:, None]), w)


def test_rows_are_searched_in_chunks_with_the_same_result(monkeypatch):
    w = _rows(1)
    whole = mse_row_scales(w, 7)
    monkeypatch.setattr(scale_search, "ROWS_PER_CHUNK", 7)
    assert torch.equal(mse_row_scales(w, 7), whole)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=r"\[rows, K\]"):
        mse_row_scales(torch.randn(8), 7)
    with pytest.raises(ValueError, match="qmax"):
        mse_row_scales(torch.randn(2, 8), 0)
    with pytest.raises(ValueError, match="1.0"):
        mse_row_scales(torch.randn(2, 8), 7, ratios=(0.9, 0.8))
    assert mse_row_scales(torch.zeros(0, 8), 7).shape == (0,)


def test_w4a4_default_weights_have_less_error_than_kitchens_and_the_same_layout():
    codec = get_format("w4a4")
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(96, 512, generator=gen) / math.sqrt(512)
    w[:, :4] *= 8  # outlier input channels, spread by the rotation
    ours = codec.quantize(w)
    kitchen = codec.quantize(w, scales="absmax")
    assert ours._layout_cls == kitchen._layout_cls and ours._qdata.shape == kitchen._qdata.shape
    assert ours._qdata.dtype == kitchen._qdata.dtype == torch.int8
    assert ours._params.scale.shape == kitchen._params.scale.shape and ours._params.scale.dtype == torch.float32
    assert (ours._params.scale <= kitchen._params.scale * (1 + 1e-6)).all()  # never a coarser step
    err = {name: (qt.dequantize().float() - w).pow(2).sum().item() for name, qt in (("ours", ours), ("kitchen", kitchen))}
    assert err["ours"] < 0.8 * err["kitchen"], err  # measured 0.71 (rows of 512: less to clip than of 3072)


def test_w4a4_stochastic_rounding_and_bad_scales_choice():
    codec = get_format("w4a4")
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(4))
    stochastic = codec.quantize(w, seed=5)
    absmax = codec.quantize(w, scales="absmax")
    assert torch.equal(stochastic._params.scale, absmax._params.scale)  # kitchen's quantizer, its scales
    assert not torch.equal(stochastic._qdata, absmax._qdata)
    with pytest.raises(ValueError, match="w4a4 scales must be one of mse, absmax"):
        codec.quantize(w, scales="max")
