"""The W8A16 kernel for few rows (``kernels/triton_w8a16_gemm.py``) on the CPU interpreter, and its place in the
W8A8 linear's candidates (``dequant:<config>``).

Without rotation every product of an activation value and a weight value is exact in fp32, so the kernel must
match the fp64-summed reference to fp32 rounding of the sums. With a rotation the rotated activation is rounded
to bf16 / fp16 once, as the reference does; the kernel's rotation (fp16 operands split in two) may land on the
other side of a rounding tie for a few values, so those checks allow 1e-4 of the output's norm. Outputs are
poisoned with NaN first: every element must be written.
"""

from __future__ import annotations

from kernels_helpers import needs_triton_interpreter, randint8, randn

import pytest
import torch

from lowbit.kernels import dispatch
from lowbit.kernels.backend import Backend, force_backend
from lowbit.kernels.gemm_config import W8A16_DEFAULT, WEIGHT_ONLY_MAX_M, GemmConfig
from lowbit.kernels.reference import FP8, weight_only_reference
from lowbit.kernels.w8a8_linear import Preprocess, _Plan, w8a8_linear, w8a8_linear_fast

pytestmark = needs_triton_interpreter()

ROTATIONS = [("none", 0), ("regular", 256), ("sylvester", 128), ("regular", 64)]
CONFIGS = [GemmConfig(16, 32, 256, 1, 4, 2), GemmConfig(16, 64, 512, 1, 4, 3), GemmConfig(32, 16, 64, 1, 4, 2)]


def _mm(*args, **kwargs):
    from lowbit.kernels.triton_w8a16_gemm import w8a16_mm_triton

    return w8a16_mm_triton(*args, **kwargs)


def _weight(n, k, fp8, seed):
    if fp8:
        return (randn(n, k, seed=seed) * 90).clamp(-448, 448).to(FP8)
    return randint8(n, k, seed=seed)


def _rel(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("rotation,group", ROTATIONS)
@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8"])
@pytest.mark.parametrize("m,n,k", [(1, 40, 512), (7, 72, 768), (19, 33, 1280)])
def test_matches_the_weight_only_reference(config, rotation, group, fp8, m, n, k):
    x = randn(m, k, seed=m + k, scale=3.0, dtype=torch.bfloat16)
    w = _weight(n, k, fp8, seed=n)
    scale = torch.rand(n, generator=torch.Generator().manual_seed(3)) / 50 + 1e-3
    bias = randn(n, seed=4, dtype=torch.bfloat16)
    out = _mm(x, w, scale, bias, torch.float32, config, rotation, group, out=torch.full((m, n), float("nan")))
    ref = weight_only_reference(x, w, scale, bias, torch.float32, rotation, group)
    assert not out.isnan().any()
    if rotation == "none":
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    else:
        assert _rel(out, ref) < 1e-4


@pytest.mark.parametrize("group", [64, 128])
def test_a_row_ending_inside_a_super_block(group):
    """K = 384: the rotation kernel's last 256-wide super-block is half padding; the groups in it are rotated on their
    own."""
    x, w = randn(5, 384, seed=1, dtype=torch.bfloat16), randint8(40, 384, seed=2)
    scale = torch.rand(40) / 50 + 1e-3
    out = _mm(x, w, scale, None, torch.float32, CONFIGS[1], "sylvester", group, out=torch.full((5, 40), float("nan")))
    assert _rel(out, weight_only_reference(x, w, scale, None, torch.float32, "sylvester", group)) < 1e-4


PREPARED = [("smooth+center", True, True), ("center", False, True), ("smooth", True, False)]


@pytest.mark.parametrize("prep,smoothed,centred", PREPARED, ids=[p[0] for p in PREPARED])
@pytest.mark.parametrize("rotation,group", [("sylvester", 128), ("none", 0), ("regular", 64)])
@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8"])
@pytest.mark.parametrize("m,n,k", [(3, 40, 768), (16, 24, 384)])
def test_smoothed_and_centred_products_match_the_reference(prep, smoothed, centred, rotation, group, fp8, m, n, k):
    """HadaNorm's pre-processing in the weight-only kernel: the activation multiplied by the smoothing columns,
    each row's mean taken out before the rotation and added back as ``mean * rowsum`` in the epilogue. Rows have a
    large common offset, so a missing or doubled mean would be far outside the tolerance. (K = 384: the rotation
    kernel's last super-block is half padding, outside the row's sum.)"""
    x = (randn(m, k, seed=k, scale=2.0) + 25.0).to(torch.bfloat16)
    w = _weight(n, k, fp8, seed=n)
    scale = torch.rand(n, generator=torch.Generator().manual_seed(5)) / 50 + 1e-3
    smooth = torch.rand(k, generator=torch.Generator().manual_seed(6)) + 0.5 if smoothed else None
    rowsum = randn(n, seed=7, scale=40.0) if centred else None
    bias = randn(n, seed=8, dtype=torch.bfloat16)
    for config in CONFIGS[:2]:
        out = _mm(x, w, scale, bias, torch.float32, config, rotation, group, torch.full((m, n), float("nan")),
                  smooth, rowsum)
        ref = weight_only_reference(x, w, scale, bias, torch.float32, rotation, group, smooth, rowsum)
        assert not out.isnan().any()
        assert _rel(out, ref) < 1e-4, config.name
    if centred:  # without the mean added back the result is another one
        plain = weight_only_reference(x, w, scale, bias, torch.float32, rotation, group, smooth)
        assert _rel(out, plain) > 1e-2


@pytest.mark.parametrize("super_blocks", [1, 2])
def test_the_pre_pass_writes_each_rows_mean_and_a_centred_row(super_blocks):
    from lowbit.kernels.hadamard import rotate_blocks
    from lowbit.kernels.triton_w8a16_gemm import prepare_rows_triton

    x = (randn(4, 384, seed=3, scale=3.0) + torch.arange(4.0).reshape(4, 1) * 50).to(torch.bfloat16)
    smooth = torch.rand(384, generator=torch.Generator().manual_seed(1)) + 0.5
    y, mean = prepare_rows_triton(x, "sylvester", 128, smooth, True, super_blocks)
    xs = x.float() * smooth
    torch.testing.assert_close(mean, xs.mean(dim=-1), rtol=1e-6, atol=1e-5)
    want = rotate_blocks(xs - xs.mean(dim=-1, keepdim=True), "sylvester", 128).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16 and ((y.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-5).all()
    y, none = prepare_rows_triton(x, "none", 0, None, False, super_blocks)
    assert none is None and torch.equal(y, x)  # nothing asked: the row as it was


@pytest.mark.parametrize("x_dtype,out_dtype", [(torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16)])
def test_one_scale_no_bias_and_half_outputs(x_dtype, out_dtype):
    x = randn(3, 256, seed=1, dtype=x_dtype)
    w = randint8(24, 256, seed=2)
    scale = torch.tensor([0.0125])
    out = _mm(x, w, scale, None, out_dtype, W8A16_DEFAULT, "regular", 256)
    ref = weight_only_reference(x, w, scale, None, torch.float32, "regular", 256)
    assert out.dtype == out_dtype and _rel(out.float(), ref) < 2 ** -8


@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8"])
def test_rows_far_outside_fp16s_range_keep_their_products(fp8):
    """E4m3 weights multiply in fp16, each row scaled by its own power of two: rows of 1e30 and 1e-30, a zero row
    and an ordinary one all give the reference's product (no overflow, no flush to zero)."""
    x = randn(4, 512, seed=3, dtype=torch.float32)
    x[0] *= 1e30
    x[1] *= 1e-30
    x[2] = 0.0
    x = x.to(torch.bfloat16)
    w = _weight(24, 512, fp8, seed=4)
    scale = torch.rand(24) / 50 + 1e-3
    out = _mm(x, w, scale, None, torch.float32, CONFIGS[0])
    ref = weight_only_reference(x, w, scale, None, torch.float32)
    assert torch.equal(out[2], torch.zeros(24))
    for row in (0, 1, 3):
        assert _rel(out[row], ref[row]) < 1e-5, row


def test_the_activation_is_not_quantized():
    """One large value in a row: INT8 codes of that row would round every small value to zero; the W8A16 product
    keeps them (the point of the kernel)."""
    k, n = 256, 16
    x = torch.full((1, k), 0.01, dtype=torch.bfloat16)
    x[0, 0] = 300.0
    w = torch.zeros(n, k, dtype=torch.int8)
    w[:, 1:] = 1  # the output sums every small value and none of the large one
    out = _mm(x, w, torch.ones(n), None, torch.float32, W8A16_DEFAULT)
    assert torch.allclose(out, torch.full((1, n), 255 * x[0, 1].float().item()), rtol=1e-6)


@pytest.mark.parametrize("rotation,group", ROTATIONS[1:])
@pytest.mark.parametrize("super_blocks", [1, 4])
def test_the_rotation_kernel_rotates_and_rounds_once(rotation, group, super_blocks):
    from lowbit.kernels.hadamard import rotate_blocks
    from lowbit.kernels.triton_w8a16_gemm import rotate_rows_triton

    x = randn(3, 1280, seed=2, scale=5.0, dtype=torch.bfloat16)
    y = rotate_rows_triton(x, rotation, group, super_blocks)
    want = rotate_blocks(x.float(), rotation, group).to(torch.bfloat16)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    # nearest-even from a rotation accurate to ~2^-22: at most one bf16 step, and only at near-ties
    differ = (y != want)
    assert differ.float().mean() < 0.01
    assert ((y.float() - want.float()).abs() <= want.float().abs() * 2 ** -7).all()


def _plan(m, pre=Preprocess(), fp8=False, k=256, n=32, x_dtype=torch.bfloat16):
    x = randn(m, k, seed=m, dtype=x_dtype)
    return _Plan(x, _weight(n, k, fp8, seed=1), torch.rand(n) / 50 + 1e-3, None, torch.bfloat16, pre, fp8)


def test_few_rows_offer_the_weight_only_kernel_and_others_do_not():
    name = f"dequant:{W8A16_DEFAULT.name}"
    assert name in _plan(1).names() and name in _plan(WEIGHT_ONLY_MAX_M, fp8=True).names()
    assert name in _plan(4, Preprocess("regular", 256)).names()
    assert not any(n.startswith("dequant:") for n in _plan(WEIGHT_ONLY_MAX_M + 1).names())
    smooth, rowsum = torch.rand(256) + 0.5, torch.rand(32)
    assert name in _plan(2, Preprocess("sylvester", 128, smooth, rowsum)).names()  # HadaNorm
    assert not any(n.startswith("dequant:") for n in _plan(2, Preprocess("sylvester", 128, smooth[:128], rowsum)
                                                           ).names())  # a multiplier of the wrong size
    outliers = Preprocess(outlier_index=torch.tensor([3, 7], dtype=torch.int32))
    x = randn(2, 256, seed=2, dtype=torch.bfloat16)
    assert not any(n.startswith("dequant:") for n in _Plan(x, _weight(32, 256 + 4, True, seed=1), torch.rand(32),
                                                           None, torch.bfloat16, outliers, True).names())
    assert not any(n.startswith("dequant:") for n in _plan(2, x_dtype=torch.float32).names())
    # on the CPU the interpreter's candidates come last: a CPU call keeps its default implementation
    assert not _plan(1).names()[0].startswith(("dequant:", "triton:"))


@pytest.mark.parametrize("fmt,fp8,rotation,group,hadanorm", [("int8_convrot", False, "regular", 256, False),
                                                             ("fp8_rowwise", True, "none", 0, False),
                                                             ("int8", False, "sylvester", 128, True)],
                         ids=["int8_convrot", "fp8_rowwise", "int8_hadanorm"])
def test_a_settled_weight_only_decision_runs_the_kernel_on_every_later_call(fmt, fp8, rotation, group, hadanorm):
    """The dispatcher's ``dequant:<config>`` choice: the first call runs it through the full path, later calls
    through the steady-state plan (one launch; two with a pre-pass), with the same bits; both are the dequantize
    backend's product up to its bf16 rounding of each weight. HadaNorm (``int8_hadanorm``'s call: smoothing,
    centring, QuaRot's rotation) included."""
    n, k = 48, 512
    w, scale = _weight(n, k, fp8, seed=5), torch.rand(n) / 50 + 1e-3
    bias = randn(n, seed=6, dtype=torch.bfloat16)
    smooth = torch.rand(k, generator=torch.Generator().manual_seed(9)) + 0.5 if hadanorm else None
    rowsum = randn(n, seed=10, scale=30.0) if hadanorm else None
    pre = Preprocess(rotation, group, smooth, rowsum)
    key = dispatch.DispatchKey(f"{fmt}+{pre.key()}" if pre.key() else fmt, (0, 0), 16, n, k).as_str()
    name = f"dequant:{W8A16_DEFAULT.name}"
    d = dispatch.Dispatcher(measure=False, decisions={key: name})
    offset = 10.0 if hadanorm else 0.0  # a common offset per row, what HadaNorm's centring takes out
    with dispatch.use_dispatcher(d):
        first = w8a8_linear_fast(fmt, (randn(3, k, seed=7) + offset).to(torch.bfloat16), w, scale, bias,
                                 torch.bfloat16, rotation, group, smooth, rowsum)
        plans = [type(p).__name__ for p in d.fast_plans.values()]
        x = (randn(3, k, seed=8) + offset).to(torch.bfloat16)
        hits = d.fast_hits
        again = w8a8_linear_fast(fmt, x, w, scale, bias, torch.bfloat16, rotation, group, smooth, rowsum)
        assert d.fast_hits == hits + 1 and plans == ["_WeightOnlyPlan"]
    full = w8a8_linear(x, w, scale, bias, torch.bfloat16, pre, fmt)  # measured nothing: CPU
    ref = weight_only_reference(x, w, scale, bias, torch.bfloat16, rotation, group, smooth, rowsum)
    assert first.shape == again.shape == (3, n) and torch.equal(again, _Plan(
        x, w, scale, bias, torch.bfloat16, pre, fp8).make(name)())
    assert _rel(again.float(), ref.float()) < 2 ** -7
    with force_backend(Backend.DEQUANT):
        dequant = w8a8_linear(x, w, scale, bias, torch.bfloat16, pre, fmt)
    assert _rel(again.float(), dequant.float()) < 2 ** -6
    # the default CPU path quantizes x: far from the weight-only product, compared in fp32 (the interpreter's bf16
    # cast truncates, and HadaNorm's output is mostly the exact mean term)
    ref32 = weight_only_reference(x, w, scale, bias, torch.float32, rotation, group, smooth, rowsum)
    ours32 = _Plan(x, w, scale, bias, torch.float32, pre, fp8).make(name)()
    assert _rel(full.float(), ref32) > 10 * _rel(ours32, ref32)
