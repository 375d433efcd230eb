"""HadaNorm specifics: the smoothing factors, and the exact mean correction."""

from __future__ import annotations

import pytest
import torch

from layout_helpers import activation, outlier_weight, sqnr_db
from lowbit.quant.errors import CheckpointFormatError
from lowbit.quant.formats import get_format
from lowbit.quant.layouts.int8_hadanorm import smoothing_factors

N, K = 64, 512


@pytest.fixture(scope="module")
def weight():
    return outlier_weight(N, K, seed=31, outliers=8)


def _sqnr(name: str, weight: torch.Tensor, x: torch.Tensor) -> float:
    codec = get_format(name)
    out = codec.linear(x, codec.quantize(weight, compute_dtype=torch.float32))
    return sqnr_db(out, x.double() @ weight.double().t())


def test_smoothing_factors_are_positive_with_mean_one(weight):
    factors = smoothing_factors(weight, 0.5)
    assert factors.shape == (K,) and (factors > 0).all()
    assert torch.isclose(factors.mean(), torch.tensor(1.0))
    # alpha 0.5: the factor follows sqrt(colmax), so the x4 outlier columns get twice the factor
    colmax = weight.abs().amax(dim=0)
    assert torch.allclose(factors / factors.mean(), colmax.sqrt() / colmax.sqrt().mean(), rtol=1e-5)


def test_zero_columns_do_not_make_zero_divisors(weight):
    weight = weight.clone()
    weight[:, :3] = 0
    factors = smoothing_factors(weight, 0.5)
    assert torch.isfinite(factors).all() and (factors > 0).all()


def test_mean_correction_is_exact(weight):
    """An activation whose smoothed form ``x * a`` is constant centres to exactly zero: the whole
    output is the fp32 term ``mean * rowsum(W / a)``, equal to ``x @ W.T`` up to fp32 rounding."""
    codec = get_format("int8_hadanorm")
    qweight = codec.quantize(weight, compute_dtype=torch.float32)
    x = torch.tensor([[3.0], [-0.25], [40.0]]) / qweight._params.smooth
    out = codec.linear(x, qweight)
    reference = x.double() @ weight.double().t()
    assert ((out.double() - reference).abs().max() / reference.abs().max()) < 1e-5


def test_constant_activation_is_nearly_exact(weight):
    """x = c * 1: only the small residual ``c (a - 1)`` goes through INT8, so HadaNorm beats even the
    weight-only error of QuaRot (which rotates the constant into one exact coordinate per block)."""
    x = torch.full((4, K), 3.0)
    hadanorm, quarot = _sqnr("int8_hadanorm", weight, x), _sqnr("int8_quarot", weight, x)
    assert hadanorm >= 50.0
    assert hadanorm >= quarot + 8.0


def test_offset_activation_keeps_its_accuracy(weight):
    """A large per-token offset plus small detail: centring removes the offset before INT8."""
    x = 3.0 + 0.05 * activation(8, K, seed=32, dtype=torch.float32)
    hadanorm, quarot = _sqnr("int8_hadanorm", weight, x), _sqnr("int8_quarot", weight, x)
    assert hadanorm >= 48.0
    assert hadanorm >= quarot + 10.0


def test_rejects_stored_tensors_of_the_wrong_size(weight):
    codec = get_format("int8_hadanorm")
    qweight = codec.quantize(weight)
    tensors = codec.state_dict(qweight)
    conf = codec.comfy_quant(qweight)
    with pytest.raises(CheckpointFormatError, match="weight_smooth"):
        codec.from_state_dict("blk", {**tensors, "weight_smooth": tensors["weight_smooth"][:-1]}, conf)
    with pytest.raises(CheckpointFormatError, match="weight_rowsum"):
        codec.from_state_dict("blk", {k: v for k, v in tensors.items() if k != "weight_rowsum"}, conf)
    with pytest.raises(CheckpointFormatError, match="group_size 384"):
        codec.from_state_dict("blk", tensors, {**conf, "group_size": 384})
