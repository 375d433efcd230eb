"""``fp8`` (kitchen's per-tensor FP8) specifics: the shapes it takes and its activation scale."""

from __future__ import annotations

import pytest
import torch

from layout_helpers import FP8_MAX, activation, outlier_weight, sqnr_db
from lowbit.quant.formats import fallback_chain, get_format


@pytest.mark.parametrize("shape", [(40, 208), (48, 200), (48, 100)])
def test_fp8_takes_only_multiples_of_16(shape):
    """kitchen's FP8 GEMM raises on the GPU for K or N off a multiple of 16 (seen on an H200:
    "Expected trailing dimension of mat1 to be divisible by 16"), so such a layer stays float."""
    codec = get_format("fp8")
    with pytest.raises(ValueError, match="divisible by 16"):
        codec.quantize(torch.randn(*shape))
    with pytest.raises(ValueError, match="divisible by 16"):
        fallback_chain("fp8", shape)


def test_fp8_activation_scale_is_its_abs_max_unless_given():
    codec = get_format("fp8")
    weight = outlier_weight(48, 208, seed=51)
    qweight = codec.quantize(weight)
    x = activation(6, 208, seed=52)
    reference = x.double() @ weight.double().t()
    dynamic = codec.linear(x, qweight)
    assert sqnr_db(dynamic, reference) > 26
    # a stored input_scale is used as is: one that clips the activation at half its range costs accuracy
    clipping = x.abs().amax().float() / (2 * FP8_MAX)
    assert sqnr_db(codec.linear(x, qweight, input_scale=clipping), reference) < sqnr_db(dynamic, reference) - 6
    exact = x.abs().amax().float() / FP8_MAX
    assert torch.equal(codec.linear(x, qweight, input_scale=exact), dynamic)
