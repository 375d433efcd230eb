"""On a CUDA GPU: W8A8 calls of at most 16 rows (HadaNorm's too) are computed weight-only (``dequant:<config>``, W8A16) unless the
dispatcher is told not to (``Dispatcher.few_rows_weight_only``) or a backend is forced, and the measured choice
matches the weight-only reference. Skipped without a GPU (the CPU interpreter's tests are in
``test_kernels_w8a16.py``); ``tests/gpu/README.md`` says how to run it there."""

from __future__ import annotations

from kernels_helpers import randn

import pytest
import torch

from lowbit.kernels import dispatch
from lowbit.kernels.backend import Backend, force_backend
from lowbit.kernels.gemm_config import WEIGHT_ONLY_MAX_M
from lowbit.kernels.reference import FP8, weight_only_reference
from lowbit.kernels.w8a8_linear import Preprocess, _Plan, w8a8_linear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICE = torch.device("cuda")


def _weight(n, k, fp8):
    if fp8:
        return (randn(n, k, seed=1) * 90).clamp(-448, 448).to(FP8).to(DEVICE)
    return torch.randint(-127, 128, (n, k), generator=torch.Generator().manual_seed(1), dtype=torch.int8).to(DEVICE)


def _plan(m, fp8, pre=Preprocess(), n=256, k=512):
    x = randn(m, k, seed=m, dtype=torch.bfloat16).to(DEVICE)
    return _Plan(x, _weight(n, k, fp8), (torch.rand(n) / 50 + 1e-3).to(DEVICE), None, torch.bfloat16, pre, fp8)


@pytest.mark.parametrize("fp8", [False, True], ids=["int8", "fp8"])
def test_few_rows_offer_only_weight_only_unless_switched_off(fp8):
    few = _plan(1, fp8, Preprocess("regular", 256)).names()
    assert few[-1] == "dequant" and few[:-1] and all(n.startswith("dequant:") for n in few[:-1])
    with dispatch.use_dispatcher(dispatch.Dispatcher(few_rows_weight_only=False)):
        quantized = _plan(1, fp8, Preprocess("regular", 256)).names()
    assert any(n.startswith("triton:") for n in quantized) and not any(n.startswith("dequant:") for n in quantized)
    more = _plan(WEIGHT_ONLY_MAX_M + 1, fp8).names()
    assert any(n.startswith("triton:") for n in more) and not any(n.startswith("dequant:") for n in more)
    with force_backend(Backend.TRITON):  # a forced backend runs its own path
        assert any(n.startswith("triton:") for n in _plan(1, fp8).names())


@pytest.mark.parametrize("fp8,rotation,group,hadanorm", [(False, "none", 0, False), (False, "regular", 256, False),
                                                        (True, "none", 0, False), (False, "sylvester", 128, True)],
                         ids=["int8", "int8_convrot", "fp8", "int8_hadanorm"])
@pytest.mark.parametrize("m", [1, 5, WEIGHT_ONLY_MAX_M])
def test_the_measured_few_row_choice_is_the_weight_only_product(fp8, rotation, group, hadanorm, m):
    n, k = 3072, 3072
    w, scale = _weight(n, k, fp8), (torch.rand(n) / 50 + 1e-3).to(DEVICE)
    bias = randn(n, seed=6, dtype=torch.bfloat16).to(DEVICE)
    x = (randn(m, k, seed=7) + (4.0 if hadanorm else 0.0)).to(torch.bfloat16).to(DEVICE)
    smooth = (torch.rand(k) + 0.5).to(DEVICE) if hadanorm else None
    rowsum = randn(n, seed=8, scale=20.0).to(DEVICE) if hadanorm else None
    fmt = "fp8_rowwise" if fp8 else ("int8_convrot" if group == 256 else "int8")
    pre = Preprocess(rotation, group, smooth, rowsum)
    d = dispatch.Dispatcher()
    with dispatch.use_dispatcher(d):
        out = w8a8_linear(x, w, scale, bias, torch.bfloat16, pre, fmt)
        again = w8a8_linear(x, w, scale, bias, torch.bfloat16, pre, fmt)
    (choice,) = d.decisions.values()
    assert choice.startswith("dequant"), d.decisions
    ref = weight_only_reference(x.cpu(), w.cpu(), scale.cpu(), bias.cpu(), torch.bfloat16, rotation, group,
                                None if smooth is None else smooth.cpu(), None if rowsum is None else rowsum.cpu())
    for y in (out, again):
        rel = ((y.double().cpu() - ref.double()).norm() / ref.double().norm()).item()
        assert y.shape == (m, n) and rel < 2 ** -7, (choice, rel)
