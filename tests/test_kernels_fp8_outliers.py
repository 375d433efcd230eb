"""FP8 outlier columns: the fused act-quant kernel against its reference, and the ``K + 2r`` linear.

The activation codes ``[x | x_lo[:, O] | x[:, O]]`` of the Triton kernel (CPU interpreter) must be
bit-identical to ``reference.act_quant_outliers_reference`` for every column, including rows past a
tile (odd M) and a buffer poisoned with NaN first. The linear over the ``[N, K + 2r]`` weight must
equal the float product of the exact ``hi + lo`` operands on every backend, and the plain path
(``outlier_index=None``) must be untouched.
"""

from __future__ import annotations

from kernels_helpers import needs_triton_interpreter, randn, sqnr_db, triton_interpreter_available

import pytest
import torch

from lowbit.kernels import dispatch, ops
from lowbit.kernels.backend import Backend, force_backend
from lowbit.kernels.dispatch import DispatchKey, Dispatcher, use_dispatcher
from lowbit.kernels.fp8_gemm import (FP8, dequantize_fp8_rowwise, fp8_rowwise_linear, quantize_fp8_rowwise,
                                     quantize_fp8_rowwise_outliers)
from lowbit.kernels.gemm_config import default_config
from lowbit.kernels.reference import act_quant_outliers_reference, act_quant_reference


def _activation(m: int, k: int, seed: int) -> torch.Tensor:
    """bf16 activations bounded away from zero (so no main code rounds to a signed zero) with two hot channels."""
    x = randn(m, k, seed=seed, scale=2.0)
    x = torch.sign(x) * (x.abs() + 0.05)
    x[:, 3] *= 25.0
    x[:, k - 2] *= 12.0
    return x.to(torch.bfloat16)


def _index(k: int, r: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat((torch.tensor([3, k - 2]), torch.randperm(k - 4, generator=g)[: r - 2] + 4)).to(torch.int32)


@needs_triton_interpreter()
@pytest.mark.parametrize("m,k,r", [(1, 64, 16), (5, 300, 3), (19, 256, 32), (33, 1000, 48)])
def test_outlier_codes_are_bit_exact(m, k, r):
    from lowbit.kernels.triton_act_quant import act_quant_triton

    x, index = _activation(m, k, seed=m + k), _index(k, r, seed=r)
    poisoned = torch.full((m, k + 2 * r), float("nan")).to(FP8)
    q, scale, _ = act_quant_triton(x, FP8, 448.0, "none", 0, None, False, out=poisoned, outlier_index=index)
    q_ref, scale_ref = act_quant_outliers_reference(x, index)
    assert q.shape == (m, k + 2 * r) and q.data_ptr() == poisoned.data_ptr()
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))  # every element written, every bit equal
    assert torch.equal(scale, scale_ref)
    # the layout of the extra columns: [codes | lo | hi] on the row's own scale, and hi + lo is closer to x
    plain, plain_scale, _ = act_quant_reference(x, FP8)
    assert torch.equal(q_ref[:, :k].view(torch.uint8), plain.view(torch.uint8)) and torch.equal(plain_scale, scale)
    assert torch.equal(q_ref[:, k + r:].view(torch.uint8), plain[:, index.long()].view(torch.uint8))
    y = x.float()[:, index.long()] / scale
    hi, lo = q_ref[:, k + r:].float(), q_ref[:, k:k + r].float()
    assert ((y - hi - lo).abs() <= (y - hi).abs()).all()
    assert (y - hi - lo).norm() < (y - hi).norm() / 8


@needs_triton_interpreter()
def test_plain_kernel_call_is_unchanged_without_an_index():
    from lowbit.kernels.triton_act_quant import act_quant_triton

    x = _activation(7, 256, seed=4)
    q, scale, _ = act_quant_triton(x, FP8, 448.0, "none", 0, None, False)
    q_none, scale_none, _ = act_quant_triton(x, FP8, 448.0, "none", 0, None, False, outlier_index=None)
    assert q.shape == (7, 256) and torch.equal(q.view(torch.uint8), q_none.view(torch.uint8))
    assert torch.equal(scale, scale_none)


def test_outlier_columns_refuse_other_preprocessing():
    from lowbit.kernels.triton_act_quant import act_quant_triton

    x, index = _activation(2, 64, seed=1), _index(64, 16, seed=1)
    with pytest.raises(ValueError, match="outlier"):
        act_quant_triton(x, torch.int8, 127.0, "none", 0, None, False, outlier_index=index)
    with pytest.raises(ValueError, match="int32"):
        act_quant_triton(x, FP8, 448.0, "none", 0, None, False, outlier_index=index.long())


def test_act_quant_outliers_op_passes_opcheck():
    x, index = _activation(5, 96, seed=2), _index(96, 16, seed=2)
    torch.library.opcheck(ops.act_quant_outliers_op, (x, index, "eager"))
    torch.library.opcheck(ops.act_quant_outliers_op, (x.float(), index[:3].contiguous(), "eager"))


def _layer(n: int, k: int, r: int, seed: int):
    weight = randn(n, k, seed=seed) * 0.02
    weight[:, 9] *= 4
    index = _index(k, r, seed=seed)
    codes, scale = quantize_fp8_rowwise_outliers(weight, index)
    return weight, index, codes, scale


def test_weight_layout_and_exact_dequantize():
    weight, index, codes, scale = _layer(24, 128, 16, seed=3)
    plain, plain_scale = quantize_fp8_rowwise(weight)
    assert codes.shape == (24, 160) and torch.equal(scale, plain_scale)
    assert torch.equal(codes[:, :128].view(torch.uint8), plain.view(torch.uint8))
    assert torch.equal(codes[:, 128:144].view(torch.uint8), plain[:, index.long()].view(torch.uint8))
    exact = plain.float()
    exact[:, index.long()] += codes[:, 144:].float()  # hi + lo is exact in fp32
    exact = exact * scale
    assert torch.equal(dequantize_fp8_rowwise(codes, scale, index), exact)
    err = lambda w: float((w - weight).norm() / weight.norm())  # noqa: E731
    rows = (weight[:, index.long()] - exact[:, index.long()]).norm() / weight[:, index.long()].norm()
    assert rows < 2**-6 and err(exact) < err(plain.float() * scale)


@pytest.mark.parametrize("backend", [Backend.EAGER, Backend.TRITON, Backend.DEQUANT])
def test_linear_matches_the_exact_split_product(backend):
    if backend is Backend.TRITON and not triton_interpreter_available():
        pytest.skip("Triton interpreter unavailable")
    n, k, r, m = 40, 256, 32, 9
    weight, index, codes, scale = _layer(n, k, r, seed=5)
    x, bias = _activation(m, k, seed=6), randn(n, seed=7, dtype=torch.bfloat16)
    q_x, s_x = act_quant_outliers_reference(x, index)
    expected = (q_x.double() @ codes.double().t()) * s_x.double() * scale.double().t() + bias.double()
    with force_backend(backend):
        out = fp8_rowwise_linear(x, codes, scale, bias, out_dtype=torch.float32, outlier_index=index)
        out3 = fp8_rowwise_linear(x.reshape(1, m, k), codes, scale, bias, outlier_index=index)
    assert out.shape == (m, n) and out3.shape == (1, m, n) and out3.dtype == torch.bfloat16
    if backend is Backend.DEQUANT:  # float activations on the exact hi + lo weight
        reference = x.double() @ dequantize_fp8_rowwise(codes, scale, index).double().t() + bias.double()
        torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    # and the split beats the plain layer on these outlier channels
    plain, plain_scale = quantize_fp8_rowwise(weight)
    exact = x.double() @ weight.double().t() + bias.double()
    with force_backend(Backend.EAGER):
        plain_out = fp8_rowwise_linear(x, plain, plain_scale, bias, out_dtype=torch.float32)
    assert sqnr_db(out, exact) > sqnr_db(plain_out, exact) + 1.0


def test_wrong_weight_width_is_refused():
    _, index, codes, scale = _layer(16, 64, 16, seed=8)
    x = _activation(3, 64, seed=9)
    with pytest.raises(ValueError, match="outlier columns"):
        fp8_rowwise_linear(x, codes[:, :80].contiguous(), scale, outlier_index=index)
    with pytest.raises(ValueError, match="features"):
        fp8_rowwise_linear(x, codes, scale)  # the [N, K + 2r] weight without its index


@needs_triton_interpreter()
def test_outlier_plan_is_cached_and_the_plain_plan_is_separate():
    n, k, r, m = 32, 256, 32, 5
    weight, index, codes, scale = _layer(n, k, r, seed=10)
    plain, plain_scale = quantize_fp8_rowwise(weight)
    x = _activation(m, k, seed=11)
    config = "triton:" + default_config(m).name
    decisions = {DispatchKey("fp8_rowwise+outliers", (0, 0), dispatch.m_bucket(m), n, k).as_str(): config,
                 DispatchKey("fp8_rowwise", (0, 0), dispatch.m_bucket(m), n, k).as_str(): config}
    d = Dispatcher(decisions=decisions)
    with use_dispatcher(d):
        first = fp8_rowwise_linear(x, codes, scale, outlier_index=index)
        plain_first = fp8_rowwise_linear(x, plain, plain_scale)
        assert len(d.fast_plans) == 2 and d.fast_hits == 0
        names = sorted(type(p).__name__ for p in d.fast_plans.values())
        assert names == ["_TritonOutlierPlan", "_TritonW8A8Plan"]
        again = fp8_rowwise_linear(x, codes, scale, outlier_index=index)
        plain_again = fp8_rowwise_linear(x, plain, plain_scale)
        assert d.fast_hits == 2
    assert torch.equal(first, again) and torch.equal(plain_first, plain_again)
    with force_backend(Backend.EAGER):
        reference = fp8_rowwise_linear(x, codes, scale, outlier_index=index)
        plain_reference = fp8_rowwise_linear(x, plain, plain_scale)
    torch.testing.assert_close(first.float(), reference.float(), rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(plain_first.float(), plain_reference.float(), rtol=1e-2, atol=1e-3)
