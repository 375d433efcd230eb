"""The W4 GEMM's TMA variants (operand loads, TMA-store epilogue whole or in halves, persistent, the decoded
planes joined into one dot) give the pointer kernel's output bit for bit, write every tile and nothing past
the output's shape.

Run in Triton's CPU interpreter, which emulates the TMA descriptors: odd M and N (partial tiles, M and
N smaller than one tile), outputs written into a view of a larger poisoned buffer, bias on and off,
signed-nibble and codebook weights, bf16 and fp32 outputs.
"""

from __future__ import annotations

from kernels_helpers import needs_triton_interpreter, randint8, randn

import dataclasses

import pytest
import torch
from comfy_kitchen.backends.eager import w4a8_int8 as ck_w4a8

from lowbit.kernels import triton_w4_gemm
from lowbit.kernels.gemm_config import GemmConfig
from lowbit.kernels.ops import decode_w4_reference, permute_columns, plane_run
from lowbit.kernels.reference import FP8, int8_accumulate_reference, scaled_mm_reference, w4a8_level_table

pytestmark = needs_triton_interpreter()

Config = GemmConfig

BASE = Config(32, 32, 64, 4, 4, 2)
VARIANTS = {
    "tma": dict(tma=True),
    "tmastore": dict(tma_store=True),
    "tmastore-sub": dict(tma_store=True, subtile=True),
    "tma-tmastore": dict(tma=True, tma_store=True),
    "tma-tmastore-sub-k128": dict(tma=True, tma_store=True, subtile=True, block_k=128),
    "swap-tma-tmastore": dict(swap_ab=True, tma=True, tma_store=True),
    "tma-persistent-tmastore-sub": dict(tma=True, persistent=True, tma_store=True, subtile=True),
    "persistent": dict(persistent=True),
    # split-K (K = 256: 4 tiles of 64): 2 shares, 2 shares of 2 tiles (3 asked), 4 shares
    "split-k2": dict(split_k=2),
    "swap-split-k3": dict(swap_ab=True, split_k=3),
    "tma-tmastore-sub-split-k4": dict(tma=True, tma_store=True, subtile=True, split_k=4),
    # the two decoded planes joined into one tile (one dot a K step): pointer and TMA loads, swap-AB, split-K
    "join": dict(join=True),
    "tma-tmastore-join": dict(tma=True, tma_store=True, join=True),
    "swap-tma-tmastore-join-k128": dict(swap_ab=True, tma=True, tma_store=True, join=True, block_k=128),
    "swap-split-k3-join": dict(swap_ab=True, split_k=3, join=True),
    # 256-column K steps (the 65-512-row codebook band's 128x64x256 and 256x64x256, Session 42)
    "tma-tmastore-join-k256": dict(tma=True, tma_store=True, join=True, block_k=256),
    # stream-K (the interpreter's 4 "SMs"; 37 x 72: 6 tiles of 4 K steps, so each program takes a whole tile and
    # half of the next, or the other half and a whole one; 5 x 24: one tile, a K step a program)
    "stream-k": dict(stream_k=True),
    "tma-tmastore-sk-join": dict(tma=True, tma_store=True, join=True, stream_k=True),
    "swap-sk-k128": dict(swap_ab=True, stream_k=True, block_k=128),
}
K = 256
CODEBOOK = torch.tensor(ck_w4a8._FIXED_LUT)


def _problem(m, n, codebook, bias, seed=0):
    """Permute-free operands: ``(a, packed, a_scale, w_scale, bias, s_rel, table)``."""
    a = randint8(m, K, seed=seed)
    packed = randint8(n, K // 2, seed=seed + 1, low=-128, high=128)
    a_scale = torch.rand(m, 1, generator=torch.Generator().manual_seed(seed + 2)) / 64 + 1e-3
    w_scale = torch.rand(n, generator=torch.Generator().manual_seed(seed + 3)) / 64 + 1e-3
    b = randn(n, seed=seed + 4, dtype=torch.bfloat16) if bias else None
    if codebook:
        s_rel = (torch.rand(n, K // 16, generator=torch.Generator().manual_seed(seed + 5)) * 60 + 4).to(FP8)
        return a, packed, a_scale, w_scale, b, s_rel, w4a8_level_table(CODEBOOK)
    return a, packed, a_scale, w_scale, b, None, None


def _poisoned_view(m, n, dtype, pad_rows=3, row_align=16):
    """An ``[m, n]`` view into a NaN-filled buffer with spare rows and columns (its row stride
    16-byte aligned, so a TMA descriptor can describe it); the buffer is returned too."""
    per_row = row_align // torch.empty((), dtype=dtype).element_size()
    cols = -(-(n + 5) // per_row) * per_row
    buffer = torch.full((m + pad_rows, cols), float("nan"), dtype=dtype)
    return buffer[:m, :n], buffer


def _run(problem, config, out):
    a, packed, a_scale, w_scale, bias, s_rel, table = problem
    a = permute_columns(a, config.block_k, plane_run(s_rel is not None))
    return triton_w4_gemm.w4a8_mm_triton(a, packed, a_scale, w_scale, bias, s_rel, table, 16, out.dtype, config,
                                         out=out)


@pytest.fixture
def descriptors(monkeypatch):
    """The block shapes of the TMA descriptors the launcher builds, in order."""
    built = []

    def recording(t, block_shape):
        built.append((t.dtype, tuple(block_shape)))
        return real(t, block_shape)

    real = triton_w4_gemm.tma_descriptor
    monkeypatch.setattr(triton_w4_gemm, "tma_descriptor", recording)
    return built


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("codebook", [False, True], ids=["nibbles", "codebook"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("shape", [(37, 72), (5, 24)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_tma_variant_equals_pointer_kernel(variant, codebook, bias, shape, dtype, descriptors):
    flags = dict(VARIANTS[variant])
    config = dataclasses.replace(BASE, **flags)
    pointer = dataclasses.replace(BASE, block_k=config.block_k, swap_ab=config.swap_ab)
    m, n = shape
    problem = _problem(m, n, codebook, bias)
    expected = _run(problem, pointer, torch.full((m, n), float("nan"), dtype=dtype))
    assert not descriptors, "the pointer kernel built a TMA descriptor"
    a, packed, a_scale, w_scale, b, s_rel, table = problem
    # the anchor: in the interpreter the epilogue's fp32 arithmetic is the reference's, in its order
    # (the interpreter's own float -> bf16 cast can round the other way: one bf16 step)
    reference = scaled_mm_reference(a, decode_w4_reference(packed, s_rel, table, 16), a_scale, w_scale, b, None,
                                    None, dtype)
    if dtype == torch.float32:
        assert torch.equal(expected, reference)
    else:
        torch.testing.assert_close(expected, reference, rtol=2**-7, atol=0)
    out, buffer = _poisoned_view(m, n, dtype)
    result = _run(problem, config, out)
    assert result.data_ptr() == out.data_ptr()
    assert torch.equal(out, expected), "a tile differs from the pointer kernel's or was not written"
    outside = buffer.clone()
    outside[:m, :n] = 0
    assert outside[m:].isnan().all() and outside[:, n:].isnan().all(), "written past the output's shape"
    half = config.block_k // 2
    want = []
    if config.tma:
        want.append((torch.int8, (config.block_m, config.block_k if config.join else half)))
        if triton_w4_gemm._TMA_WEIGHT[codebook]:
            want.append((torch.int8, (config.block_n, half)))
    if config.tma_store:
        want.append((dtype, (config.block_m, config.block_n // (2 if config.subtile else 1))))
    assert descriptors == want, "the variant did not run through the descriptors its flags name"


@pytest.mark.parametrize("variant", ["tma-tmastore-sub-k128", "swap-tma-tmastore", "tma-persistent-tmastore-sub"])
@pytest.mark.parametrize("codebook", [False, True], ids=["nibbles", "codebook"])
@pytest.mark.parametrize("weight_by_tma", [True, False], ids=["weight-tma", "weight-pointers"])
def test_weight_tile_by_tma_or_pointers(variant, codebook, weight_by_tma, monkeypatch, descriptors):
    """Both ways of reading the packed weight tile under ``tma`` (the default per weight kind is
    ``_TMA_WEIGHT``), for both weight kinds: the pointer kernel's bits."""
    monkeypatch.setitem(triton_w4_gemm._TMA_WEIGHT, codebook, weight_by_tma)
    config = dataclasses.replace(BASE, **VARIANTS[variant])
    m, n = 37, 72
    problem = _problem(m, n, codebook, True, seed=30)
    pointer = dataclasses.replace(BASE, block_k=config.block_k)
    expected = _run(problem, pointer, torch.full((m, n), float("nan"), dtype=torch.bfloat16))
    out, _ = _poisoned_view(m, n, torch.bfloat16)
    _run(problem, config, out)
    assert torch.equal(out, expected)
    int8_descriptors = [shape for dtype, shape in descriptors if dtype == torch.int8]
    assert len(int8_descriptors) == (2 if weight_by_tma else 1), "activation (and weight) descriptors"


@pytest.mark.parametrize("variant", ["tma-tmastore", "tma-persistent-tmastore-sub"])
@pytest.mark.parametrize("codebook", [False, True], ids=["nibbles", "codebook"])
def test_tma_variant_is_exact_int32(variant, codebook):
    """Unit scales, fp32 output, no bias: the output is the exact int32 product of the decoded weight."""
    config = dataclasses.replace(BASE, **VARIANTS[variant])
    m, n = 45, 56
    a, packed, _, _, _, s_rel, table = _problem(m, n, codebook, False, seed=10)
    weight = decode_w4_reference(packed, s_rel, table, 16)
    out, _ = _poisoned_view(m, n, torch.float32)
    _run((a, packed, torch.ones(m, 1), torch.ones(n), None, s_rel, table), config, out)
    assert torch.equal(out, int8_accumulate_reference(a, weight).float())


def test_undescribable_output_falls_back_to_pointer_stores(descriptors):
    """A bf16 output whose row stride is not 16-byte aligned (36 columns = 72 bytes): the operands
    still come by TMA, the output goes out through masked stores, with the same bits."""
    config = dataclasses.replace(BASE, tma=True, tma_store=True, subtile=True)
    m, n = 37, 36
    problem = _problem(m, n, True, True, seed=20)
    expected = _run(problem, BASE, torch.full((m, n), float("nan"), dtype=torch.bfloat16))
    out = _run(problem, config, torch.full((m, n), float("nan"), dtype=torch.bfloat16))
    assert torch.equal(out, expected)
    operands = [(32, 32), (32, 32)] if triton_w4_gemm._TMA_WEIGHT[True] else [(32, 32)]
    assert [shape for _, shape in descriptors] == operands, "only the operand descriptors"


def test_ragged_k_is_refused_by_the_tma_variants():
    config = dataclasses.replace(BASE, tma=True, tma_store=True)
    a, packed = randint8(8, 96, seed=1), randint8(8, 48, seed=2)
    with pytest.raises(ValueError, match="multiple of its K tile"):
        triton_w4_gemm.w4a8_mm_triton(a, packed, torch.ones(8, 1), torch.ones(8), None, None, None, 16,
                                      torch.float32, config)


def test_gpu_sweep_script_runs_in_the_interpreter(tmp_path):
    """``tests/gpu/sweep_w4_gemm.py --smoke``: both phases run, and every config's output is checked."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent / "gpu" / "sweep_w4_gemm.py"
    names = ["64x128x128-g8-w4-s4-tma-tmastore", "128x256x128-g8-w8-s3-tma-persistent-tmastore-sub"]
    report_path = tmp_path / "w4.json"
    done = subprocess.run([sys.executable, str(script), "--smoke", "--workers", "1", "--configs", *names,
                           "--out", str(report_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(report_path.read_text())
    assert set(report["configs"]) == set(names)
    variants = {"nibbles": names, "codebook": names + [name + "+alt-weight-load" for name in names]}
    assert {key: row["state"] for key, row in report["phase1"].items()} == {
        f"{name}/{kind}": "done" for kind in variants for name in variants[kind]}
    assert all(row["ok"] for row in report["phase1"].values()), report["phase1"]
    (row,) = report["results"]
    for kind in ("nibbles", "codebook"):
        entry = row["kinds"][kind]
        assert entry["reference_rel_err_vs_fp64"] < 2**-7
        assert set(entry["configs"]) == set(variants[kind])
        for name in variants[kind]:
            assert entry["configs"][name]["bit_exact"] is True and entry["configs"][name]["us"] > 0


def _ptxas() -> str | None:
    try:
        import triton

        path = triton.knobs.nvidia.ptxas.path
    except Exception:  # noqa: BLE001 - no NVIDIA backend in this Triton
        return None
    return path if path and __import__("os").path.isfile(path) else None


def _compile_report(tmp_path, *args: str) -> dict:
    """``tests/gpu/sweep_w4_gemm.py --compile-only`` (2 workers) with ``args``: its per-variant results."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent / "gpu" / "sweep_w4_gemm.py"
    report_path = tmp_path / "compile.json"
    done = subprocess.run([sys.executable, str(script), "--compile-only", "--workers", "2", *args,
                           "--out", str(report_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(report_path.read_text())["results"]


@pytest.mark.skipif(_ptxas() is None, reason="Triton's NVIDIA backend (ptxas) is not installed")
def test_tma_variants_compile_for_sm90_without_a_gpu(tmp_path):
    """The interpreter never lowers the kernel: compile TMA variants for sm_90 offline (what the GPU
    will compile) and check they fit in shared memory; the 8-warp 128x128 one spills no registers."""
    names = ["128x128x128-g8-w8-s3-tma-tmastore", "128x256x128-g8-w8-s3-tma-persistent-tmastore-sub"]
    results = _compile_report(tmp_path, "--alt-kinds", "--configs", *names)
    assert set(results) == {f"{name}/{kind}" for name in names for kind in ("nibbles", "codebook")}
    for key, row in results.items():
        assert "error" not in row, f"{key}: {row.get('error')}"
        assert row["fits_sm90"] and row["shared_bytes"] > 0, (key, row)
    for kind in ("nibbles", "codebook"):
        row = results[f"{names[0]}/{kind}"]
        assert row.get("spill_store_bytes") in (0, None), (kind, row)


@pytest.mark.skipif(_ptxas() is None, reason="Triton's NVIDIA backend (ptxas) is not installed")
def test_swap_ab_variants_decode_each_plane_once_into_registers(tmp_path):
    """Swap-AB W4 configs (signed nibbles) hand the decoded planes to ``wgmma`` from registers: one decode block
    per plane, and no decoded tile written to shared memory. With both planes out of one inline-PTX block,
    Triton 3.8 decoded the tile twice and staged one plane through shared memory (0.87x bf16 at M = 256 on an
    H200, against 0.97x with one block per plane). The non-swap form stages each plane once, as its operand."""
    swapped, plain = ["128x128x128-g8-w4-s4-swap", "64x128x128-g8-w4-s4-swap-k2"], "128x128x128-g8-w4-s4"
    results = _compile_report(tmp_path, "--kinds", "nibbles", "--configs", *swapped, plain)
    for name in swapped:
        row = results[f"{name}/nibbles"]
        assert "error" not in row, row
        assert row["decode_blocks"] == 2 and row["staged_i8_tiles"] == 0, (name, row)
    row = results[f"{plain}/nibbles"]
    assert row["decode_blocks"] == 2 and row["staged_i8_tiles"] == 2, row


@pytest.mark.skipif(_ptxas() is None, reason="Triton's NVIDIA backend (ptxas) is not installed")
def test_joined_planes_compile_to_one_wgmma_group_a_k_step(tmp_path):
    """``GemmConfig.join`` (the 65-512-row codebook configs): the two decoded planes side by side make one dot a K
    step, so one ``wgmma`` wait where the two-plane form has two (Triton waits for every INT8 group at once), with
    the same shared memory, on sm_90 and without spilling, swap-AB included."""
    two = ["128x32x128-g8-w4-s4-tma-tmastore-k2", "64x64x128-g8-w4-s4-swap"]
    results = _compile_report(tmp_path, "--kinds", "codebook", "--configs", *two, *(name + "-join" for name in two))
    for name in two:
        plain, joined = results[f"{name}/codebook"], results[f"{name}-join/codebook"]
        assert "error" not in plain and "error" not in joined, (plain, joined)
        assert plain["dot_waits"] == 2 and joined["dot_waits"] == 1, (name, plain, joined)
        assert joined["fits_sm90"] and joined["shared_bytes"] == plain["shared_bytes"], (name, plain, joined)
        assert joined.get("spill_store_bytes") in (0, None), (name, joined)


@pytest.mark.skipif(_ptxas() is None, reason="Triton's NVIDIA backend (ptxas) is not installed")
def test_256_column_codebook_configs_compile_for_sm90(tmp_path):
    """The 65-512-row band's codebook configs with 256-column K steps (Session 42: 3072 x 3072 and 3072 x 12288
    at M = 256; Session 43: 9216 x 3072 in stream-K form): joined planes, so one ``wgmma`` wait a K step, within
    sm_90's shared memory, without spilling."""
    from lowbit.kernels.gemm_config import w4_candidates

    names = [c.name for c in w4_candidates((9, 0), 256, codebook=True) if c.block_k == 256]
    assert len(names) == 3 and all(name.endswith("-join") for name in names), names
    results = _compile_report(tmp_path, "--kinds", "codebook", "--configs", *names)
    for name in names:
        row = results[f"{name}/codebook"]
        assert "error" not in row, (name, row)
        assert row["dot_waits"] == 1 and row["fits_sm90"], (name, row)
        assert row.get("spill_store_bytes") in (0, None), (name, row)
