"""The act-quant kernel's rotation variants against the reference and the original path (CPU, Triton interpreter).

``rotate_impl`` ("permute" original, "batched", "dense", "tf32") and ``split`` ("pow2": whole rows padded to
a power of two, the original; "pieces": whole rows as power-of-two pieces over the real K; "chunks":
the two-pass loop over ``chunk``-wide pieces) only change how the block Hadamard rotation is computed,
so every variant must meet the original's contract: INT8 codes at most one step from the fp32
reference for a few elements (fp16 operands: rotated values good to ~2^-12 of the maximum), FP8 codes
at most one e4m3 step, scales within 2^-10, and no rotation at all = bit exact. K is any multiple of
the group (the last super-block partly padding), M any count of rows.
"""

from __future__ import annotations

from kernels_helpers import needs_triton_interpreter, randn

import pytest
import torch

from lowbit.kernels.ops import permute_columns
from lowbit.kernels.reference import FP8, act_quant_reference

pytestmark = needs_triton_interpreter()

# (rotate_impl, split, chunk, tile_elements): programs of 1..16 rows
VARIANTS = [("batched", "pow2", 0, None), ("dense", "pow2", 0, 4096), ("permute", "chunks", 256, None),
            ("batched", "chunks", 512, 1024), ("batched", "chunks", 256, 4096), ("dense", "chunks", 1024, 4096),
            ("batched", "pieces", 0, None), ("permute", "pieces", 0, 1024), ("batched", "pieces", 0, 16384),
            ("tf32", "pieces", 0, None), ("tf32", "pow2", 0, None), ("tf32", "chunks", 512, 1024)]
VARIANT_IDS = [f"{impl}-{split}{chunk or ''}-tile{tile}" for impl, split, chunk, tile in VARIANTS]
ORIGINAL = ("permute", "pow2", 0, None)


def _triton(x, dtype, rotation, group, smooth=None, center=False, perm=0, out=None, variant=ORIGINAL, run=1):
    from lowbit.kernels.triton_act_quant import act_quant_triton

    impl, split, chunk, tile = variant
    qmax = 448.0 if dtype == FP8 else 127.0
    return act_quant_triton(x, dtype, qmax, rotation, group, smooth, center, perm, out=out, tile_elements=tile,
                            rotate_impl=impl, split=split, chunk=chunk or 1024, perm_run=run)


def _poison(m, k, dtype):
    return torch.full((m, k), float("nan")).to(FP8) if dtype == FP8 else torch.full((m, k), 99, dtype=torch.int8)


def _assert_int8_near(q, q_ref, limit=0.03):
    diff = (q.int() - q_ref.int()).abs()
    assert diff.max() <= 1, f"a code {diff.max()} steps from the reference"
    assert (diff > 0).float().mean() < limit, f"{(diff > 0).float().mean():.4f} of the codes differ"


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("rotation,group,m,k", [("regular", 256, 19, 768), ("sylvester", 128, 9, 640),
                                                ("regular", 64, 5, 320), ("sylvester", 16, 3, 1136)])
def test_int8_variants_match_reference_and_original(variant, rotation, group, m, k):
    # K is a multiple of the group but not of 256 or a power of two (the tail super-block is partly padding),
    # M is not a multiple of the rows a program takes, and every output element must be written
    x = randn(m, k, seed=k + group + m, scale=2, dtype=torch.bfloat16)
    x[1, k // 5] = 60.0  # an outlier channel sets row 1's scale
    q, scale, mean = _triton(x, torch.int8, rotation, group, out=_poison(m, k, torch.int8), variant=variant)
    q_ref, scale_ref, _ = act_quant_reference(x, torch.int8, None, rotation, group)
    _assert_int8_near(q, q_ref)
    torch.testing.assert_close(scale, scale_ref, rtol=2**-10, atol=0)
    assert mean.shape == (m, 0)
    q_old, scale_old, _ = _triton(x, torch.int8, rotation, group)
    assert (q == q_old).float().mean() > 0.97
    torch.testing.assert_close(scale, scale_old, rtol=2**-10, atol=0)


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("rotation,group", [("regular", 256), ("sylvester", 128)])
def test_fp8_variants_are_within_one_e4m3_step(variant, rotation, group):
    m, k = 7, 1280
    x = randn(m, k, seed=group, scale=3, dtype=torch.bfloat16)
    x[0, 5] = 80.0
    q, scale, _ = _triton(x, FP8, rotation, group, out=_poison(m, k, FP8), variant=variant)
    q_ref, scale_ref, _ = act_quant_reference(x, FP8, None, rotation, group)
    assert torch.isfinite(q.float()).all()
    diff = (q.float() - q_ref.float()).abs()
    assert (diff <= q_ref.float().abs() * 0.125 + 2**-9).all()
    assert (diff > 0).float().mean() < 0.01
    torch.testing.assert_close(scale, scale_ref, rtol=2**-10, atol=0)


@pytest.mark.parametrize("variant", [ORIGINAL, ("batched", "pieces", 0, None), ("batched", "chunks", 512, None),
                                     ("tf32", "pieces", 0, None)],
                         ids=["original", "batched-pieces", "batched-chunks", "tf32-pieces"])
def test_fp8_hi_only_rotation_keeps_values_to_2e_minus_12_of_the_row_maximum(variant):
    # precise_fp8=False rounds the P stage's operand to fp16 once: a value near zero may move several e4m3
    # steps, but never farther than ~2^-12 of the row maximum (448 code units), and few codes move
    from lowbit.kernels.triton_act_quant import act_quant_triton

    m, k = 7, 1280
    x = randn(m, k, seed=21, scale=3, dtype=torch.bfloat16)
    x[0, 5] = 80.0
    impl, split, chunk, tile = variant
    q, scale, _ = act_quant_triton(x, FP8, 448.0, "sylvester", 128, None, False, out=_poison(m, k, FP8),
                                   rotate_impl=impl, split=split, chunk=chunk or 1024, precise_fp8=False)
    q_ref, scale_ref, _ = act_quant_reference(x, FP8, None, "sylvester", 128)
    diff = (q.float() - q_ref.float()).abs()
    one_step = q_ref.float().abs() * 0.125 + 2**-9
    assert (diff <= torch.maximum(one_step, torch.full_like(one_step, 448.0 * 2**-11))).all()
    assert (diff > 0).float().mean() < 0.03
    torch.testing.assert_close(scale, scale_ref, rtol=2**-10, atol=0)


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_hadanorm_smoothing_centring_and_rotation(variant):
    m, k = 6, 640
    x = randn(m, k, seed=5, scale=2, dtype=torch.bfloat16) + 25.0  # a large common offset: what centring removes
    smooth = torch.rand(k, generator=torch.Generator().manual_seed(1)) + 0.5
    q, scale, mean = _triton(x, torch.int8, "sylvester", 128, smooth, True, out=_poison(m, k, torch.int8),
                             variant=variant)
    q_ref, scale_ref, mean_ref = act_quant_reference(x, torch.int8, None, "sylvester", 128, smooth, True)
    torch.testing.assert_close(mean, mean_ref, rtol=1e-5, atol=1e-5)
    _assert_int8_near(q, q_ref)
    torch.testing.assert_close(scale, scale_ref, rtol=2**-10, atol=0)


@pytest.mark.parametrize("impl", ["tf32", "batched"])
def test_pieces_with_a_rounded_up_last_piece(impl):
    # 31 super-blocks have five set bits: 16 + 8 + 4 and the last 3 rounded up to 4 (one masked super-block)
    from lowbit.kernels.triton_act_quant_split import _pieces_launch_shape

    m, k = 3, 31 * 256 - 64  # and the last group of 64 is beyond K too
    assert _pieces_launch_shape(m, k, 256, 4096, None, True)[1] == (4096, 2048, 1024, 1024)
    x = randn(m, k, seed=29, scale=2, dtype=torch.bfloat16)
    q, scale, _ = _triton(x, torch.int8, "regular", 64, out=_poison(m, k, torch.int8), variant=(impl, "pieces", 0, None))
    q_ref, scale_ref, _ = act_quant_reference(x, torch.int8, None, "regular", 64)
    _assert_int8_near(q, q_ref)
    torch.testing.assert_close(scale, scale_ref, rtol=2**-10, atol=0)


def test_dense_pieces():
    m, k = 19, 768
    x = randn(m, k, seed=4, scale=2, dtype=torch.bfloat16)
    q, scale, _ = _triton(x, torch.int8, "regular", 256, out=_poison(m, k, torch.int8),
                          variant=("dense", "pieces", 0, 65536))
    q_ref, scale_ref, _ = act_quant_reference(x, torch.int8, None, "regular", 256)
    _assert_int8_near(q, q_ref)
    torch.testing.assert_close(scale, scale_ref, rtol=2**-10, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("impl", ["tf32", "batched"])
def test_fp32_and_fp16_activations(dtype, impl):
    # tf32 operands: fp16 input is exact as is, fp32 input is rounded to tf32 first (as smoothed / centred rows)
    m, k = 6, 768
    x = randn(m, k, seed=13, scale=2, dtype=dtype)
    for split in ("pieces", "pow2"):
        q, scale, _ = _triton(x, torch.int8, "regular", 256, variant=(impl, split, 0, None))
        q_ref, scale_ref, _ = act_quant_reference(x, torch.int8, None, "regular", 256)
        _assert_int8_near(q, q_ref)
        torch.testing.assert_close(scale, scale_ref, rtol=2**-10, atol=0)


def test_register_cap_is_a_launch_option_only():
    from lowbit.kernels.triton_act_quant import act_quant_triton

    x = randn(5, 768, seed=17, scale=2, dtype=torch.bfloat16)
    capped = act_quant_triton(x, torch.int8, 127.0, "regular", 256, None, False, rotate_impl="tf32", split="pieces",
                              max_registers=64)
    free = act_quant_triton(x, torch.int8, 127.0, "regular", 256, None, False, rotate_impl="tf32", split="pieces")
    assert all(torch.equal(a, b) for a, b in zip(capped, free))


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_rows_of_any_magnitude(variant):
    # per-super-block powers of two keep fp16 operands in range for huge rows and accurate for tiny ones;
    # a zero row gives zero codes and a finite scale
    m, k = 5, 512
    x = randn(m, k, seed=9, dtype=torch.float32)
    x[0] *= 1e5
    x[1] *= 1e-6
    x[2] = 0.0
    x[3, :256] *= 1e4  # one super-block far larger than the other
    x = x.to(torch.bfloat16)
    q, scale, _ = _triton(x, torch.int8, "regular", 256, variant=variant)
    q_ref, scale_ref, _ = act_quant_reference(x, torch.int8, None, "regular", 256)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert (q[2] == 0).all()
    _assert_int8_near(q, q_ref)
    torch.testing.assert_close(scale, scale_ref, rtol=2**-10, atol=0)


@pytest.mark.parametrize("split,chunk,perm,run", [("chunks", 256, 128, 1), ("chunks", 512, 64, 1),
                                                  ("chunks", 256, 256, 1), ("pieces", 0, 128, 1),
                                                  ("pieces", 0, 512, 1), ("chunks", 256, 128, 4),
                                                  ("pieces", 0, 256, 4)])
def test_permuted_column_order(split, chunk, perm, run):
    m, k = 5, 1536 if perm == 512 else 768  # 768 = 512 + 256; 1536 in 512-wide units = 1024 + 512
    x = randn(m, k, seed=perm + chunk, scale=2, dtype=torch.bfloat16)
    q, _, _ = _triton(x, torch.int8, "regular", 256, perm=perm, out=_poison(m, k, torch.int8),
                      variant=("batched", split, chunk, None), run=run)
    q_ref, _, _ = act_quant_reference(x, torch.int8, None, "regular", 256)
    _assert_int8_near(q, permute_columns(q_ref, perm, run))
    q_old, _, _ = _triton(x, torch.int8, "regular", 256, perm=perm, run=run)
    assert (q == q_old).float().mean() > 0.97


@pytest.mark.parametrize("dtype", [torch.int8, FP8])
@pytest.mark.parametrize("split,chunk,tile", [("chunks", 64, 256), ("chunks", 256, 4096), ("chunks", 1024, None),
                                              ("pieces", 0, None), ("pieces", 0, 64)])
def test_split_rows_without_rotation_are_bit_exact(dtype, split, chunk, tile):
    m, k = 11, 1000
    x = randn(m, k, seed=chunk, scale=3, dtype=torch.bfloat16)
    x[0, k // 3] = 90.0
    smooth = torch.rand(k, generator=torch.Generator().manual_seed(2)) + 0.5
    q, scale, _ = _triton(x, dtype, "none", 0, out=_poison(m, k, dtype), variant=("permute", split, chunk, tile))
    q_ref, scale_ref, _ = act_quant_reference(x, dtype)
    assert torch.equal(q.view(torch.int8), q_ref.view(torch.int8))
    assert torch.equal(scale, scale_ref)
    # smoothed and centred (no rotation): the codes of the original path, whose mean is one sum of the row
    q, scale, mean = _triton(x, dtype, "none", 0, smooth, True, variant=("permute", split, chunk, tile))
    q_ref, scale_ref, mean_ref = act_quant_reference(x, dtype, None, "none", 0, smooth, True)
    torch.testing.assert_close(mean, mean_ref, rtol=1e-5, atol=1e-5)
    if dtype == torch.int8:
        _assert_int8_near(q, q_ref, limit=0.01)
    torch.testing.assert_close(scale, scale_ref, rtol=1e-5, atol=0)


def test_unsupported_variants_say_why():
    x = randn(4, 512, seed=1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rotate_impl"):
        _triton(x, torch.int8, "regular", 256, variant=("fast", "pow2", 0, None))
    with pytest.raises(ValueError, match="split"):
        _triton(x, torch.int8, "regular", 256, variant=("batched", "halves", 0, None))
    with pytest.raises(ValueError, match="chunk"):
        _triton(x, torch.int8, "regular", 256, variant=("batched", "chunks", 128, None))  # narrower than 256
    with pytest.raises(ValueError, match="chunk"):
        _triton(x, torch.int8, "regular", 256, variant=("batched", "chunks", 768, None))
    with pytest.raises(ValueError, match="perm_block"):
        _triton(x, torch.int8, "regular", 256, perm=512, variant=("batched", "chunks", 256, None))
    with pytest.raises(ValueError, match="dense"):
        _triton(x, torch.int8, "regular", 256, variant=("dense", "chunks", 256, 1024))
    with pytest.raises(ValueError, match="dense"):
        _triton(x, torch.int8, "regular", 256, variant=("dense", "pieces", 0, 1024))
    from lowbit.kernels.triton_act_quant import act_quant_triton

    with pytest.raises(ValueError, match="outlier"):
        act_quant_triton(x, FP8, 448.0, "none", 0, None, False, outlier_index=torch.tensor([3], dtype=torch.int32),
                         split="chunks", chunk=256)


def test_defaults_pick_the_kernel_and_keep_outlier_columns_on_theirs(monkeypatch):
    # what the lead flips after measuring: DEFAULT_ROTATE_IMPL / DEFAULT_SPLIT route rotated and plain calls of at
    # most two pieces, and FP8 outlier columns stay on the whole-row kernel whatever the defaults say
    from lowbit.kernels import triton_act_quant as aq
    from lowbit.kernels import triton_act_quant_split as aq_split
    from lowbit.kernels.reference import act_quant_outliers_reference

    monkeypatch.setattr(aq, "DEFAULT_ROTATE_IMPL", "tf32")
    monkeypatch.setattr(aq, "DEFAULT_SPLIT", "pieces")
    x = randn(5, 768, seed=23, scale=2, dtype=torch.bfloat16)
    pieces_before, pow2_before = aq_split._PIECES_LAUNCHER.slow_launches, aq._LAUNCHER.slow_launches
    q, scale, _ = aq.act_quant_triton(x, torch.int8, 127.0, "regular", 256, None, False)
    assert aq_split._PIECES_LAUNCHER.slow_launches == pieces_before + 1
    _assert_int8_near(q, act_quant_reference(x, torch.int8, None, "regular", 256)[0])
    aq.act_quant_triton(x, torch.int8, 127.0, "none", 0, None, False)
    assert aq_split._PIECES_LAUNCHER.slow_launches == pieces_before + 2  # 768 = 512 + 256, no rotation
    aq.act_quant_triton(randn(5, 1792, seed=5, dtype=torch.bfloat16), torch.int8, 127.0, "none", 0, None, False)
    assert aq._LAUNCHER.slow_launches == pow2_before + 1  # three pieces: the padded row
    index = torch.tensor([3, 700], dtype=torch.int32)
    q, scale, _ = aq.act_quant_triton(x, FP8, 448.0, "none", 0, None, False, outlier_index=index)
    q_ref, scale_ref = act_quant_outliers_reference(x, index)
    assert torch.equal(q.view(torch.int8), q_ref.view(torch.int8)) and torch.equal(scale, scale_ref)


@pytest.mark.parametrize("k,split", [(768, "pieces"), (1792, "pow2"), (3072, "pieces")])
def test_default_path_is_the_measured_one(k, split):
    # chosen from tests/gpu/bench_act_quant.py on an H200: batched rotation; rows of at most two
    # power-of-two pieces unpadded ("pieces"), wider ones (3+ pieces: slower there) padded ("pow2")
    from lowbit.kernels import triton_act_quant

    assert triton_act_quant.default_split(k) == split  # rotated or not
    x = randn(9, k, seed=3, scale=2, dtype=torch.bfloat16)
    default = _triton(x, torch.int8, "regular", 256, variant=(None, None, 0, None))
    explicit = _triton(x, torch.int8, "regular", 256, variant=(triton_act_quant.DEFAULT_ROTATE_IMPL, split, 0, None))
    assert all(torch.equal(a, b) for a, b in zip(default, explicit))
    _assert_int8_near(default[0], act_quant_reference(x, torch.int8, None, "regular", 256)[0])


@pytest.mark.parametrize("k,split", [(12288, "pieces"), (8192 + 16, "pieces"), (15360, "pow2"), (3072, "pieces"),
                                     (1024 + 512 + 16, "pow2")])
def test_plain_rows_of_two_pieces_go_unpadded_and_keep_the_padded_kernels_codes(k, split):
    # rows without rotation of at most two power-of-two pieces, unpadded (measured faster at K = 3072 and 12288 for
    # M = 256..4096); the same codes and scales as the padded row, bit for bit
    from lowbit.kernels import triton_act_quant as aq
    from lowbit.kernels import triton_act_quant_split as aq_split

    assert aq.default_split(k) == split
    x = randn(3, k, seed=k, scale=2, dtype=torch.bfloat16)
    x[1, k // 5] = -70.0
    for dtype, qmax in ((torch.int8, 127.0), (FP8, 448.0)):
        pieces_before = aq_split._PIECES_LAUNCHER.slow_launches
        q, scale, _ = aq.act_quant_triton(x, dtype, qmax, "none", 0, None, False, out=_poison(3, k, dtype))
        assert aq_split._PIECES_LAUNCHER.slow_launches == pieces_before + (split == "pieces")
        q_pad, scale_pad, _ = aq.act_quant_triton(x, dtype, qmax, "none", 0, None, False, split="pow2")
        assert torch.equal(q.view(torch.int8), q_pad.view(torch.int8)) and torch.equal(scale, scale_pad)


def test_pieces_warps_follow_the_measured_rule():
    # measured on an H100 (docs/kernels.md, Session 44): programs of at most 4096 elements 2 warps (rotated rows
    # below 1024 rows: 4), wider programs 4 rotated and 8 without rotation; an explicit count wins
    from lowbit.kernels.triton_act_quant_split import TWO_WARPS_MIN_M, _pieces_launch_shape

    assert TWO_WARPS_MIN_M == 1024
    assert _pieces_launch_shape(1024, 3072, 256, 4096, None, True)[2] == 2
    assert _pieces_launch_shape(1023, 3072, 256, 4096, None, True)[2] == 4
    assert _pieces_launch_shape(256, 3072, 16, 4096, None, False)[2] == 2
    assert _pieces_launch_shape(256, 12288, 256, 4096, None, True)[2] == 4
    assert _pieces_launch_shape(4608, 12288, 256, 4096, None, True)[2] == 4
    assert _pieces_launch_shape(1024, 12288, 16, 4096, None, False)[2] == 8
    assert _pieces_launch_shape(9, 768, 256, 4096, None, False)[:3] == (4, (512, 256, 0, 0), 2)  # 4 rows of 768
    assert _pieces_launch_shape(1024, 3072, 256, 4096, 8, True)[2] == 8


def test_gpu_benchmark_script_runs_in_the_interpreter(tmp_path):
    # tests/gpu/bench_act_quant.py at its CPU size: every variant of pass 1 runs, passes its checks against the
    # reference, and the report names a fastest variant per shape (CPU times themselves mean nothing)
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent / "gpu" / "bench_act_quant.py"
    out = tmp_path / "aq.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), "--device", "cpu", "--k", "768", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert not [r for r in report["results"] if "error" in r or not r["ok"]]
    labels = {r["label"] for r in report["results"]}
    assert {"permute/pow2/tileauto/wauto", "batched/pieces/tileauto/wauto", "tf32/pieces/tileauto/wauto"} <= labels
    assert len(report["best"]) == 6  # int8 / fp8 x none / regular256 / sylvester128
    baseline = [r for r in report["results"] if r["label"] == report["baseline"]]
    assert all(r["codes_equal_vs_baseline"] == 1.0 for r in baseline)
