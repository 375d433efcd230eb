"""The W8A8 Triton GEMMs (INT8 and FP8, plain / TMA / persistent variants) on the CPU interpreter.

INT8 accumulates exactly in int32: with unit scales and fp32 output the kernel must equal the int32
reference bit for bit, on ragged shapes, with every output element written (the output buffer is
poisoned with NaN first). The scale / shift / bias epilogue and FP8 are checked against the
reference within fp32 rounding.
"""

from __future__ import annotations

from kernels_helpers import needs_triton_interpreter, randint8, randn, row_band_jobs

import pytest
import torch

from lowbit.kernels.gemm_config import GemmConfig, config_named, w4_candidates, w8a8_candidates
from lowbit.kernels.reference import FP8, int8_accumulate_reference, scaled_mm_reference

pytestmark = needs_triton_interpreter()

CONFIGS = [
    GemmConfig(32, 64, 64, 4, 4, 2),
    GemmConfig(16, 32, 32, 2, 4, 2),
    GemmConfig(32, 32, 64, 4, 4, 2, tma=True),
    GemmConfig(32, 32, 64, 4, 4, 2, tma=True, persistent=True),
    GemmConfig(32, 32, 64, 4, 4, 2, tma=True, tma_store=True),
    GemmConfig(32, 64, 64, 4, 4, 2, tma=True, persistent=True, tma_store=True, subtile=True),
]
TMA_STORE = [c for c in CONFIGS if c.tma_store]
SPLIT_K = [GemmConfig(32, 32, 32, 4, 4, 2, split_k=2), GemmConfig(16, 32, 64, 2, 4, 2, split_k=3),
           GemmConfig(32, 32, 32, 4, 4, 2, tma=True, tma_store=True, split_k=4)]


def _mm(*args, **kwargs):
    from lowbit.kernels.triton_w8a8_gemm import w8a8_mm_triton

    return w8a8_mm_triton(*args, **kwargs)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("m,n,k", [(37, 72, 320), (64, 64, 128), (1, 40, 96), (70, 33, 48)])
def test_int8_accumulators_are_exact(config, m, n, k):
    if config.tma and k % 16:
        pytest.skip("TMA descriptors need 16-byte rows")
    a, b = randint8(m, k, seed=m + k), randint8(n, k, seed=n + k + 1)
    poison = torch.full((m, n), float("nan"))
    out = _mm(a, b, torch.ones(m, 1), torch.ones(n), None, None, None, torch.float32, config, out=poison)
    assert torch.equal(out, int8_accumulate_reference(a, b).float())


def test_extreme_int8_values_accumulate_exactly():
    k = 512  # 512 * 127 * 128 < 2^24: the fp32 output holds the int32 sum exactly
    a = torch.full((16, k), -128, dtype=torch.int8)
    b = torch.full((32, k), 127, dtype=torch.int8)
    out = _mm(a, b, torch.ones(16, 1), torch.ones(32), None, None, None, torch.float32, CONFIGS[0])
    assert (out == -128 * 127 * k).all()


@pytest.mark.parametrize("per_channel", [True, False])
def test_epilogue_scales_shift_bias(per_channel):
    m, n, k = 29, 48, 192
    a, b = randint8(m, k, seed=1), randint8(n, k, seed=2)
    a_scale = torch.rand(m, 1, generator=torch.Generator().manual_seed(3)) * 1e-2
    b_scale = torch.rand(n if per_channel else 1, generator=torch.Generator().manual_seed(4)) * 1e-2
    bias, row_shift, col_shift = randn(n, seed=5), randn(m, seed=6), randn(n, seed=7)
    out = _mm(a, b, a_scale, b_scale, bias, row_shift, col_shift, torch.float32, CONFIGS[0])
    ref = scaled_mm_reference(a, b, a_scale, b_scale, bias, row_shift, col_shift, torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("config", CONFIGS[:3] + TMA_STORE, ids=lambda c: c.name)
def test_fp8_gemm(config):
    m, n, k = 33, 64, 256
    a = randn(m, k, seed=8, scale=40).clamp(-448, 448).to(FP8)
    b = randn(n, k, seed=9, scale=40).clamp(-448, 448).to(FP8)
    a_scale, b_scale = torch.rand(m, 1) + 0.5, torch.rand(n) + 0.5
    bias = randn(n, seed=10, dtype=torch.bfloat16)
    ref = scaled_mm_reference(a, b, a_scale, b_scale, bias, None, None, torch.float32)
    out = _mm(a, b, a_scale, b_scale, bias, None, None, torch.float32, config)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("config", [CONFIGS[1]] + TMA_STORE, ids=lambda c: c.name)
def test_bf16_output(config):
    a, b = randint8(20, 64, seed=1), randint8(24, 64, seed=2)
    out = _mm(a, b, torch.full((20, 1), 1e-3), torch.full((24,), 1e-2), None, None, None, torch.bfloat16, config)
    ref = scaled_mm_reference(a, b, torch.full((20, 1), 1e-3), torch.full((24,), 1e-2), out_dtype=torch.float32)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=1e-6)


@pytest.mark.parametrize("config", TMA_STORE, ids=lambda c: c.name)
def test_tma_store_epilogue_scales_shift_bias_and_ragged_edges(config):
    """The TMA-stored tile gets the same epilogue; rows and columns past the output are clipped (a
    poisoned buffer with a guard band shows nothing outside was written and nothing inside was missed)."""
    m, n, k = 45, 40, 128  # neither M nor N a multiple of the tile
    a, b = randint8(m, k, seed=11), randint8(n, k, seed=12)
    a_scale = torch.rand(m, 1, generator=torch.Generator().manual_seed(13)) * 1e-2
    b_scale = torch.rand(n, generator=torch.Generator().manual_seed(14)) * 1e-2
    bias, row_shift, col_shift = randn(n, seed=15), randn(m, seed=16), randn(n, seed=17)
    big = torch.full((m + 3, 48), float("nan"))  # rows of 48 floats: 16-byte aligned, wider than n
    out = big[:m, :n]
    _mm(a, b, a_scale, b_scale, bias, row_shift, col_shift, torch.float32, config, out=out)
    ref = scaled_mm_reference(a, b, a_scale, b_scale, bias, row_shift, col_shift, torch.float32)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert torch.isnan(big[m:]).all() and torch.isnan(big[:, n:]).all()


def test_tma_store_falls_back_to_plain_stores_for_unaligned_outputs():
    config = TMA_STORE[0]
    m, n, k = 16, 30, 64
    a, b = randint8(m, k, seed=18), randint8(n, k, seed=19)
    big = torch.full((m, 31), float("nan"))  # a 124-byte row stride: no TMA descriptor can describe it
    out = big[:, :n]
    _mm(a, b, torch.ones(m, 1), torch.ones(n), None, None, None, torch.float32, config, out=out)
    assert torch.equal(out, int8_accumulate_reference(a, b).float()) and torch.isnan(big[:, n]).all()


@pytest.mark.parametrize("config", SPLIT_K, ids=lambda c: c.name)
@pytest.mark.parametrize("m,n,k", [(37, 72, 320), (5, 40, 96), (33, 64, 1000)])
def test_split_k_sums_int8_exactly(config, m, n, k):
    """K split over several programs whose int32 partial sums the last one to finish adds up: exact, for
    ragged M, N and K (a K share may end in a masked tail or be shorter than the others)."""
    if config.tma and k % 16:
        pytest.skip("a TMA descriptor needs 16-byte row strides")
    a, b = randint8(m, k, seed=m + 2 * k), randint8(n, k, seed=n + k + 3)
    poison = torch.full((m, n), float("nan"))
    out = _mm(a, b, torch.ones(m, 1), torch.ones(n), None, None, None, torch.float32, config, out=poison)
    assert torch.equal(out, int8_accumulate_reference(a, b).float())


@pytest.mark.parametrize("config", SPLIT_K[::2], ids=lambda c: c.name)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_split_k_epilogue_is_the_one_program_epilogue(config, out_dtype):
    m, n, k = 29, 48, 384
    a, b = randint8(m, k, seed=21), randint8(n, k, seed=22)
    a_scale = torch.rand(m, 1, generator=torch.Generator().manual_seed(23)) * 1e-2
    b_scale = torch.rand(n, generator=torch.Generator().manual_seed(24)) * 1e-2
    bias, row_shift, col_shift = randn(n, seed=25), randn(m, seed=26), randn(n, seed=27)
    args = (a, b, a_scale, b_scale, bias, row_shift, col_shift, out_dtype)
    assert torch.equal(_mm(*args, config), _mm(*args, CONFIGS[0]))


def test_split_k_workspace_is_kept_and_its_locks_left_at_zero(monkeypatch):
    """One launch, no zeroing: every launch finds the locks at zero because each tile's last share puts its
    lock back; the workspace is kept between launches, and a bigger need replaces it without freeing the
    old one (a CUDA graph may still use it)."""
    from lowbit.kernels import triton_w8a8_gemm as gemm

    monkeypatch.setattr(gemm, "_workspaces", {})
    monkeypatch.setattr(gemm, "_retired", [])
    config = SPLIT_K[0]
    outputs = []
    for m, n, k in ((20, 40, 128), (20, 40, 128), (9, 30, 96)):
        a, b = randint8(m, k, seed=m + k), randint8(n, k, seed=n + 1)
        outputs.append(_mm(a, b, torch.ones(m, 1), torch.ones(n), None, None, None, torch.float32, config))
        assert torch.equal(outputs[-1], int8_accumulate_reference(a, b).float())
        (ws, locks), = gemm._workspaces.values()
        assert not locks.any(), "a lock was left counting"
    assert not gemm._retired, "the workspace was replaced for a launch it already fits"
    gemm.split_k_workspace(torch.device("cpu"), ws.numel() + 1, locks.numel())
    assert gemm._retired == [(ws, locks)] and gemm._workspaces[torch.device("cpu")][0].numel() == ws.numel() + 1


def test_no_split_k_workspace_is_made_during_a_cuda_graph_capture(monkeypatch):
    """Allocated inside a capture, the locks' zeroing would only run at the graph's replay: none is made
    there (the launch then runs its config without splitting K); one made before is used."""
    from lowbit.kernels import triton_w8a8_gemm as gemm

    monkeypatch.setattr(gemm, "_workspaces", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert gemm.split_k_workspace(torch.device("cuda", 0), 64, 4) is None and not gemm._workspaces
    held = gemm.split_k_workspace(torch.device("cpu"), 64, 4)
    assert held is not None and gemm.split_k_workspace(torch.device("cpu"), 32, 2) is held


def test_split_k_refuses_fp8_and_is_offered_for_int8_at_small_m_only():
    a = randn(16, 64, seed=28, scale=40).clamp(-448, 448).to(FP8)
    with pytest.raises(ValueError, match="INT8 products exactly"):
        _mm(a, a, torch.ones(16, 1), torch.ones(16), None, None, None, torch.float32, SPLIT_K[0])
    assert any(c.split_k > 1 for c in w8a8_candidates((9, 0), 256))
    assert not any(c.split_k > 1 for c in w8a8_candidates((9, 0), 256, fp8=True))
    assert any(c.split_k > 1 for c in w8a8_candidates((9, 0), 512))
    assert not any(c.split_k > 1 for c in w8a8_candidates((9, 0), 4096))
    assert not any(c.split_k > 1 for c in w8a8_candidates((9, 0), 1024))
    assert not any(c.split_k > 1 and c.tma for c in w8a8_candidates((8, 9), 256))  # no TMA before sm_90
    assert any(c.split_k > 1 for c in w4_candidates((9, 0), 256)) and any(
        c.split_k > 1 for c in w4_candidates((9, 0), 256, codebook=True))
    assert not any(c.split_k > 1 for c in w4_candidates((9, 0), 1024))
    with pytest.raises(ValueError, match="split_k"):
        GemmConfig(64, 64, 64, tma=True, persistent=True, split_k=2)


#: the 16-row tiles offered for few rows (M <= 32: modulation linears at batch 1), on Hopper and on Ada
FEW_ROWS = sorted({c for cap in ((9, 0), (8, 9)) for c in w8a8_candidates(cap, 1) if c.block_m == 16},
                  key=lambda c: c.name)


@pytest.mark.parametrize("config, m", [(c, m) for c in FEW_ROWS for m in (1, 5)] + row_band_jobs("w8a8")
                         + row_band_jobs("int8_split"), ids=lambda v: getattr(v, "name", v))
def test_small_m_configs_accumulate_exactly(config, m):
    """The configs the dispatcher measures for few rows (the 16-row tiles, on one and five rows) and for
    17 <= M <= 512 (the row bands, at an M of their band): rows and columns ragged against the tile, K
    spanning several of its K steps (so a split-K config has two full shares)."""
    n, k = 200, 1024
    a, b = randint8(m, k, seed=m + 40), randint8(n, k, seed=41)
    poison = torch.full((m, n), float("nan"))
    out = _mm(a, b, torch.ones(m, 1), torch.ones(n), None, None, None, torch.float32, config, out=poison)
    assert torch.equal(out, int8_accumulate_reference(a, b).float())


def test_few_row_configs_are_offered_for_few_rows_only():
    for cap in ((9, 0), (8, 9)):
        for m in (1, 16, 32):
            assert any(c.block_m == 16 for c in w8a8_candidates(cap, m))
            assert any(c.block_m == 16 for c in w4_candidates(cap, m))
            assert any(c.block_m == 16 for c in w4_candidates(cap, m, codebook=True))
        for m in (33, 256, 4096):
            assert not any(c.block_m == 16 for c in w8a8_candidates(cap, m) + w4_candidates(cap, m)
                           + w4_candidates(cap, m, codebook=True))
    assert not any(c.split_k > 1 for c in w8a8_candidates((9, 0), 1, fp8=True))  # FP8 sums do not split
    assert any(c.block_m == 16 for c in w8a8_candidates((9, 0), 1, fp8=True))


def test_row_bands_are_offered_in_their_bands_and_end_at_dispatch_buckets():
    from lowbit.kernels.dispatch import M_BUCKETS, m_bucket
    from lowbit.kernels.gemm_config import _ROW_BANDS

    for band in _ROW_BANDS:
        # a dispatcher bucket never straddles a band edge, so its candidates do not depend on which M came first
        assert m_bucket(band.high) == band.high and (band.low - 1 in M_BUCKETS)
        for m in (band.low, band.high):
            assert set(band.w8a8 + band.int8_split) <= set(w8a8_candidates((9, 0), m))
            assert set(band.w8a8) <= set(w8a8_candidates((9, 0), m, fp8=True))
            assert not set(band.int8_split) & set(w8a8_candidates((9, 0), m, fp8=True))  # FP8 sums do not split
            assert set(band.w4) <= set(w4_candidates((9, 0), m))
            assert set(band.w4_codebook) <= set(w4_candidates((9, 0), m, codebook=True))
    banded = {c for band in _ROW_BANDS for c in band.w8a8 + band.int8_split + band.w4 + band.w4_codebook}
    for m in (1, 16, 1024, 4096):  # outside every band: none of them
        offered = w8a8_candidates((9, 0), m) + w4_candidates((9, 0), m) + w4_candidates((9, 0), m, codebook=True)
        assert not banded & set(offered), m


def test_config_names_round_trip_and_reject_garbage():
    for config in CONFIGS + SPLIT_K + [GemmConfig(64, 128, 128, 8, 4, 4, swap_ab=True),
                                       GemmConfig(128, 32, 128, 8, 4, 4, tma=True, tma_store=True, split_k=2, join=True)]:
        assert GemmConfig.from_name(config.name) == config
        assert config_named(config.name) is config_named(config.name)
    with pytest.raises(ValueError, match="config name"):
        GemmConfig.from_name("fast")
    with pytest.raises(ValueError, match="power of two"):
        GemmConfig(48, 64, 64)
    with pytest.raises(ValueError, match="tma_store"):
        GemmConfig(64, 64, 64, subtile=True)


def test_candidates_fit_the_gpu():
    hopper = w8a8_candidates((9, 0), 4096)
    ada = w8a8_candidates((8, 9), 4096)
    assert any(c.tma for c in hopper) and not any(c.tma for c in ada)
    assert all(c.fits((8, 9)) for c in ada) and all(c.fits((8, 9), 1.0, 0.5) for c in w4_candidates((8, 9), 4096))
    # small M: tiles of at most 128 rows fill the SMs; a 256-row tile only where K is split among programs
    assert max(c.block_m for c in w8a8_candidates((9, 0), 256) if c.split_k == 1) <= 128


def _back_to_back(monkeypatch=None, stale=False):
    """``bench kernels --verify``'s back-to-back check at interpreter sizes; ``stale``: the INT8 GEMM hands back
    the previous call's result from the second call on (what a GEMM reading its codes early would give)."""
    from lowbit.kernels import gpu_checks, triton_w8a8_gemm

    if stale:
        real, last = triton_w8a8_gemm.w8a8_mm_triton, []

        def w8a8_mm_stale(*args, **kwargs):
            out = real(*args, **kwargs)
            last.append(out)
            return last[-2] if len(last) > 1 else out

        monkeypatch.setattr(triton_w8a8_gemm, "w8a8_mm_triton", w8a8_mm_stale)
    results = []
    gpu_checks._check_back_to_back(torch.device("cpu"), (9, 0), lambda name, ok, detail="": results.append((name, ok)),
                                   n=64, k=512, rows=(20,), configs=2)
    return results


def test_back_to_back_check_passes_on_the_interpreter():
    """Act-quant then GEMM with the inputs changing every call: every result is the synchronised one (two INT8
    configs and one codebook W4 config at 20 rows)."""
    results = _back_to_back()
    assert [ok for _, ok in results] == [True, True, True], results
    assert sum("int8 gemm" in name for name, _ in results) == 2


def test_back_to_back_check_fails_on_stale_results(monkeypatch):
    """The same check fails the INT8 configs when each call hands back the previous call's result."""
    results = _back_to_back(monkeypatch, stale=True)
    assert [ok for name, ok in results if "int8 gemm" in name] == [False, False], results
    assert [ok for name, ok in results if "w4a8 gemm" in name] == [True], results
