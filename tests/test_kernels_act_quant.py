"""The fused activation-quantization kernel against its pure-torch reference (CPU, Triton interpreter).

Without rotation or centring the INT8 and FP8 codes must be bit-identical to the reference; with
the fused block Hadamard rotation (fp16 tensor-core products) INT8 codes may sit one step away for a
few elements, FP8 (two-term fp16 products) at most one e4m3 step.
"""

from __future__ import annotations

from kernels_helpers import needs_triton_interpreter, randn

import pytest
import torch

from lowbit.kernels.hadamard import rotate_blocks
from lowbit.kernels.ops import act_quant, permute_columns
from lowbit.kernels.reference import FP8, act_quant_reference

pytestmark = needs_triton_interpreter()


def _triton(*args, **kwargs):
    from lowbit.kernels.triton_act_quant import act_quant_triton

    return act_quant_triton(*args, **kwargs)


def _poison(m, k, dtype):
    return torch.full((m, k), float("nan")).to(FP8) if dtype == FP8 else torch.full((m, k), 99, dtype=torch.int8)


@pytest.mark.parametrize("dtype", [torch.int8, FP8])
@pytest.mark.parametrize("m,k", [(1, 16), (5, 300), (19, 1000), (3, 2048)])
def test_plain_codes_are_bit_exact(dtype, m, k):
    x = randn(m, k, seed=m * k, scale=3, dtype=torch.bfloat16)
    x[0, k // 3] = 90.0  # an outlier channel sets the row's scale
    qmax = 448.0 if dtype == FP8 else 127.0
    q, scale, mean = _triton(x, dtype, qmax, "none", 0, None, False, out=_poison(m, k, dtype))
    q_ref, scale_ref, _ = act_quant_reference(x, dtype)
    assert torch.equal(q.view(torch.int8), q_ref.view(torch.int8))  # every element written, every bit equal
    assert torch.equal(scale, scale_ref)
    assert mean.shape == (m, 0)


def test_int4_range_codes_are_bit_exact():
    x = randn(7, 512, seed=3, dtype=torch.bfloat16)
    q, scale, _ = _triton(x, torch.int8, 7.0, "none", 0, None, False)
    q_ref, scale_ref, _ = act_quant_reference(x, torch.int8, 7.0)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)
    assert q.abs().max() == 7


def test_zero_rows_give_zero_codes_and_finite_scales():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    x[1] = 1.0
    q, scale, _ = _triton(x, torch.int8, 127.0, "none", 0, None, False)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert (q[0] == 0).all() and (q[1] == 127).all()


@pytest.mark.parametrize("rotation,group,k", [("regular", 256, 768), ("sylvester", 128, 384), ("regular", 64, 320),
                                              ("sylvester", 16, 96), ("sylvester", 256, 512)])
def test_fused_rotation_matches_reference(rotation, group, k):
    m = 9
    x = randn(m, k, seed=k + group, scale=2, dtype=torch.bfloat16)
    q, scale, _ = _triton(x, torch.int8, 127.0, rotation, group, None, False, out=_poison(m, k, torch.int8))
    q_ref, scale_ref, _ = act_quant_reference(x, torch.int8, None, rotation, group)
    diff = (q.int() - q_ref.int()).abs()
    assert diff.max() <= 1
    assert (diff > 0).float().mean() < 0.03
    torch.testing.assert_close(scale, scale_ref, rtol=2**-10, atol=0)
    # and the reference itself is x @ blockdiag(H): dequantized codes recover the rotated row
    rotated = rotate_blocks(x.float(), rotation, group)
    assert ((q_ref.float() * scale_ref - rotated).abs() <= scale_ref * 0.5 + 1e-6).all()


def test_fp8_rotation_is_within_one_e4m3_step():
    x = randn(6, 1024, seed=11, scale=3, dtype=torch.bfloat16)
    x[0, 5] = 80.0
    q, _, _ = _triton(x, FP8, 448.0, "regular", 256, None, False)
    q_ref, _, _ = act_quant_reference(x, FP8, None, "regular", 256)
    diff = (q.float() - q_ref.float()).abs()
    assert (diff <= q_ref.float().abs() * 0.125 + 2**-9).all()
    assert (diff > 0).float().mean() < 0.01


def test_hadanorm_smoothing_and_centring():
    m, k = 5, 256
    x = randn(m, k, seed=5, scale=2, dtype=torch.bfloat16) + 3.0  # a common offset: what centring removes
    smooth = torch.rand(k, generator=torch.Generator().manual_seed(1)) + 0.5
    q, scale, mean = _triton(x, torch.int8, 127.0, "sylvester", 128, smooth, True)
    q_ref, scale_ref, mean_ref = act_quant_reference(x, torch.int8, None, "sylvester", 128, smooth, True)
    torch.testing.assert_close(mean, mean_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mean, (x.float() * smooth).mean(-1, keepdim=True), rtol=1e-5, atol=1e-5)
    assert (q.int() - q_ref.int()).abs().max() <= 1


@pytest.mark.parametrize("perm", [64, 128])
def test_permuted_column_order(perm):
    x = randn(4, 512, seed=perm, dtype=torch.bfloat16)
    q, _, _ = _triton(x, torch.int8, 127.0, "none", 0, None, False, perm)
    q_ref, _, _ = act_quant_reference(x, torch.int8)
    assert torch.equal(q, permute_columns(q_ref, perm))
    assert torch.equal(permute_columns(q_ref, perm)[:, : perm // 2], q_ref[:, 0:perm:2])


@pytest.mark.parametrize("perm,run", [(64, 4), (128, 4), (256, 4), (32, 16)])
def test_permuted_runs_of_columns(perm, run):
    """``perm_run``: the even runs of ``run`` columns of every block, then the odd runs (the codebook W4
    kernel's planes: the first and last 4 columns of every 8)."""
    x = randn(3, 512, seed=perm + run, dtype=torch.bfloat16)
    q, _, _ = _triton(x, torch.int8, 127.0, "none", 0, None, False, perm, out=_poison(3, 512, torch.int8),
                      perm_run=run)
    q_ref, _, _ = act_quant_reference(x, torch.int8)
    expected = permute_columns(q_ref, perm, run)
    assert torch.equal(q, expected)
    first = torch.arange(perm).view(-1, 2, run)[:, 0].reshape(-1)  # columns 0..run-1, 2run..3run-1, ...
    assert torch.equal(expected[:, : perm // 2], q_ref[:, first])
    assert torch.equal(expected[:, perm // 2: perm], q_ref[:, first + run])
    with pytest.raises(ValueError, match="multiple of 8"):
        _triton(x, torch.int8, 127.0, "none", 0, None, False, 4, perm_run=4)


def test_op_routes_eager_and_triton_alike():
    x = randn(3, 128, seed=2, dtype=torch.bfloat16)
    eager = act_quant(x, torch.int8, 127.0, "none", 0, None, False, 0, "eager")
    triton = act_quant(x, torch.int8, 127.0, "none", 0, None, False, 0, "triton")
    assert all(torch.equal(a, b) for a, b in zip(eager, triton))


def test_unsupported_shapes_say_why():
    from lowbit.kernels.triton_act_quant import act_quant_problem

    assert "group" in act_quant_problem(1024, "regular", 512)
    assert "register" in act_quant_problem(40000, "none", 0)
    assert act_quant_problem(3072, "regular", 256) is None
    with pytest.raises(ValueError, match="perm_block"):
        _triton(randn(2, 96, seed=1), torch.int8, 127.0, "none", 0, None, False, 64)
