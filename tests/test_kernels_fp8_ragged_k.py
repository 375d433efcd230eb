"""The FP8 Triton GEMM on a ragged K (not a multiple of BLOCK_K), on the CPU interpreter, and the
outlier-column linear (``K + 2r``) offered and run on every tile config, whatever ``K + 2r`` is.

The K tail is a masked load whose fill must be an e4m3 zero; the GEMM must equal the float product
of the codes on every output element (the buffer is poisoned with NaN first).
"""

from __future__ import annotations

from kernels_helpers import needs_triton_interpreter, randn

import pytest
import torch

from lowbit.kernels.backend import Backend, force_backend
from lowbit.kernels.fp8_gemm import fp8_rowwise_linear, quantize_fp8_rowwise_outliers
from lowbit.kernels.gemm_config import GemmConfig, default_config
from lowbit.kernels.reference import FP8, act_quant_outliers_reference, scaled_mm_reference

pytestmark = needs_triton_interpreter()

POINTER_CONFIGS = [GemmConfig(32, 64, 64, 4, 4, 2), GemmConfig(16, 32, 32, 2, 4, 2)]
TMA_CONFIG = GemmConfig(32, 32, 64, 4, 4, 2, tma=True)


def _fp8(rows: int, k: int, seed: int) -> torch.Tensor:
    return randn(rows, k, seed=seed, scale=40).clamp(-448, 448).to(FP8)


@pytest.mark.parametrize("config", POINTER_CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("m,n,k", [(33, 64, 200), (5, 40, 112), (17, 24, 70)])
def test_fp8_gemm_with_a_k_tail(config, m, n, k):
    assert k % config.block_k  # the tail really is masked
    a, b = _fp8(m, k, seed=k), _fp8(n, k, seed=k + 1)
    a_scale, b_scale = torch.rand(m, 1) + 0.5, torch.rand(n) + 0.5
    bias = randn(n, seed=3, dtype=torch.bfloat16)
    from lowbit.kernels.triton_w8a8_gemm import w8a8_mm_triton

    poison = torch.full((m, n), float("nan"))
    out = w8a8_mm_triton(a, b, a_scale, b_scale, bias, None, None, torch.float32, config, out=poison)
    ref = scaled_mm_reference(a, b, a_scale, b_scale, bias, None, None, torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-3)


def test_fp8_gemm_with_a_k_tail_by_tma():
    """TMA zero-fills the tail itself (16-byte rows: K a multiple of 16, not of BLOCK_K)."""
    m, n, k = 21, 48, 208
    a, b = _fp8(m, k, seed=4), _fp8(n, k, seed=5)
    from lowbit.kernels.triton_w8a8_gemm import w8a8_mm_triton

    out = w8a8_mm_triton(a, b, torch.ones(m, 1), torch.ones(n), None, None, None, torch.float32, TMA_CONFIG)
    ref = scaled_mm_reference(a, b, torch.ones(m, 1), torch.ones(n), None, None, None, torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("k,r", [(80, 16), (96, 8)])
def test_outlier_linear_runs_on_triton_when_k_plus_2r_is_ragged(k, r):
    """``K + 2r`` = 112 / 112: not a multiple of the default tile's BLOCK_K (64), so the GEMM's last
    K tile is masked; the forced Triton path must still be offered and equal the exact split product."""
    n, m = 40, 9
    assert (k + 2 * r) % default_config(m).block_k
    weight = randn(n, k, seed=k) * 0.02
    g = torch.Generator().manual_seed(r)
    index = torch.randperm(k, generator=g)[:r].to(torch.int32)
    codes, scale = quantize_fp8_rowwise_outliers(weight, index)
    x = randn(m, k, seed=r + 1, scale=2.0)
    x[:, index[0].long()] *= 25.0
    x = x.to(torch.bfloat16)
    bias = randn(n, seed=7, dtype=torch.bfloat16)
    q_x, s_x = act_quant_outliers_reference(x, index)
    expected = (q_x.double() @ codes.double().t()) * s_x.double() * scale.double().t() + bias.double()
    with force_backend(Backend.TRITON):
        out = fp8_rowwise_linear(x, codes, scale, bias, out_dtype=torch.float32, outlier_index=index)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
