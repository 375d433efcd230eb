"""4-bit weight storage × INT8 activations: the decodes match comfy-kitchen's, the in-register
GEMM is exact against the int32 reference, and the linears agree with comfy-kitchen's."""

from __future__ import annotations

from kernels_helpers import (needs_triton_interpreter, randint8, randn, row_band_jobs, sqnr_db,
                             triton_interpreter_available)

import pytest
import torch
from comfy_kitchen.backends.eager import w4a8_int8 as ck_w4a8
from comfy_kitchen.backends.eager.svdquant import _unpack_int4_row_major

from lowbit.kernels.backend import Backend, force_backend
from lowbit.kernels.gemm_config import GemmConfig
from lowbit.kernels.ops import decode_w4_reference, permute_columns, plane_run, w4a8_mm
from lowbit.kernels.reference import (FP8, decode_w4a8_levels, int8_accumulate_reference, unpack_int4_signed,
                                      w4a8_level_table)
from lowbit.kernels.w4_linear import level_table, w4a4_linear, w4a8_linear

CODEBOOK = torch.tensor(ck_w4a8._FIXED_LUT)


def _packed(n, k, seed):
    return randint8(n, k // 2, seed=seed, low=-128, high=128)


def test_signed_nibbles_decode_like_kitchen():
    packed = _packed(8, 64, seed=1)
    assert torch.equal(unpack_int4_signed(packed), _unpack_int4_row_major(packed))


@pytest.mark.parametrize("codebook", [CODEBOOK, None], ids=["codebook", "uniform"])
@pytest.mark.parametrize("group", [16, 32])
def test_level_table_decode_is_kitchens(codebook, group):
    n, k = 12, 128
    packed = _packed(n, k, seed=2)
    s_rel = (torch.rand(n, k // group, generator=torch.Generator().manual_seed(3)) * 90 + 1).to(FP8)
    expected = ck_w4a8._dequant_int4_grouped_to_int8(packed, s_rel, codebook, group)
    assert torch.equal(decode_w4a8_levels(packed, s_rel, codebook, group), expected)
    assert torch.equal(decode_w4_reference(packed, s_rel, w4a8_level_table(codebook), group), expected)


def test_level_table_is_cached_per_codebook_tensor():
    a, b = CODEBOOK.clone(), CODEBOOK.clone() * 0.5
    assert level_table(a, a.device) is level_table(a, a.device)
    assert not torch.equal(level_table(a, a.device), level_table(b, b.device))


@needs_triton_interpreter()
@pytest.mark.parametrize("config", [GemmConfig(32, 32, 64, 4, 4, 2), GemmConfig(16, 64, 128, 4, 4, 2),
                                    GemmConfig(32, 32, 64, 4, 4, 2, swap_ab=True),
                                    GemmConfig(32, 32, 64, 4, 4, 2, swap_ab=True, split_k=4)], ids=lambda c: c.name)
@pytest.mark.parametrize("codebook", [False, True])
def test_w4_gemm_is_exact(config, codebook):
    from lowbit.kernels.triton_w4_gemm import w4a8_mm_triton

    m, n, k = 37, 40, 256
    a, packed = randint8(m, k, seed=4), _packed(n, k, seed=5)
    s_rel = (torch.rand(n, k // 16, generator=torch.Generator().manual_seed(6)) * 60 + 4).to(FP8)
    table = w4a8_level_table(CODEBOOK)
    args = (s_rel, table) if codebook else (None, None)
    weight = decode_w4_reference(packed, *args, 16)
    poison = torch.full((m, n), float("nan"))
    out = w4a8_mm_triton(permute_columns(a, config.block_k, plane_run(codebook)), packed, torch.ones(m, 1),
                         torch.ones(n), None, *args, 16, torch.float32, config, out=poison)
    assert torch.equal(out, int8_accumulate_reference(a, weight).float())


def _few_row_jobs(codebook: bool) -> list:
    from lowbit.kernels.gemm_config import w4_candidates

    configs = sorted({c for cap in ((9, 0), (8, 9)) for c in w4_candidates(cap, 1, codebook=codebook)
                      if c.block_m == 16}, key=lambda c: c.name)
    return [(codebook, c, m) for c in configs for m in (1, 5)]


@needs_triton_interpreter()
@pytest.mark.parametrize("codebook, config, m", _few_row_jobs(False) + _few_row_jobs(True)
                         + [(False, c, m) for c, m in row_band_jobs("w4")]
                         + [(True, c, m) for c, m in row_band_jobs("w4_codebook")],
                         ids=lambda v: getattr(v, "name", v))
def test_w4_small_m_configs_are_exact(codebook, config, m):
    """The tiles the dispatcher measures for few rows (the 16-row ones, on one and five rows) and for
    17 <= M <= 512 (the row bands, at an M of their band): ragged rows and columns, K spanning several K
    steps (two full shares for the split-K ones)."""
    from lowbit.kernels.triton_w4_gemm import w4a8_mm_triton

    n, k = 72, 1024
    a, packed = randint8(m, k, seed=14 + m), _packed(n, k, seed=15)
    s_rel = (torch.rand(n, k // 16, generator=torch.Generator().manual_seed(16)) * 60 + 4).to(FP8)
    args = (s_rel, w4a8_level_table(CODEBOOK)) if codebook else (None, None)
    poison = torch.full((m, n), float("nan"))
    out = w4a8_mm_triton(permute_columns(a, config.block_k, plane_run(codebook)), packed, torch.ones(m, 1),
                         torch.ones(n), None, *args, 16, torch.float32, config, out=poison)
    assert torch.equal(out, int8_accumulate_reference(a, decode_w4_reference(packed, *args, 16)).float())


@needs_triton_interpreter()
@pytest.mark.parametrize("sms", [3, 4, 7])
@pytest.mark.parametrize("codebook", [False, True])
def test_stream_k_shares_k_steps_and_leaves_its_workspace_at_zero(codebook, sms, monkeypatch):
    """Stream-K (``GemmConfig.stream_k``) on 3, 4 and 7 "SMs": programs that take a whole tile and part of the
    next, several programs on one tile (one with more programs than the tile has K steps), two launches in a
    row; each output the exact int32 product, and the locks back at zero after each launch.
    Without a workspace (as inside a CUDA-graph capture) it runs one program a tile, with the same bits."""
    from lowbit.kernels import triton_w4_gemm, triton_w8a8_gemm

    monkeypatch.setattr(triton_w8a8_gemm, "_workspaces", {})
    monkeypatch.setattr(triton_w4_gemm, "_sm_count", lambda device: sms)
    config = GemmConfig(32, 32, 64, 4, 4, 2, stream_k=True)
    table = w4a8_level_table(CODEBOOK)
    for m, n, k in ((37, 72, 320), (37, 72, 320), (5, 24, 448)):
        a, packed = randint8(m, k, seed=m + k), _packed(n, k, seed=n + k)
        s_rel = (torch.rand(n, k // 16, generator=torch.Generator().manual_seed(k)) * 60 + 4).to(FP8)
        args = (s_rel, table) if codebook else (None, None)
        expected = int8_accumulate_reference(a, decode_w4_reference(packed, *args, 16)).float()
        a_perm = permute_columns(a, config.block_k, plane_run(codebook))

        def run():
            return triton_w4_gemm.w4a8_mm_triton(a_perm, packed, torch.ones(m, 1), torch.ones(n), None, *args, 16,
                                                 torch.float32, config, out=torch.full((m, n), float("nan")))

        assert torch.equal(run(), expected)
        (ws, locks), = triton_w8a8_gemm._workspaces.values()
        assert ws.numel() >= 6 * 32 * 32 and locks.numel() >= 6 and not locks.any(), "a lock was left counting"
        with monkeypatch.context() as capture:
            capture.setattr(triton_w4_gemm, "split_k_workspace", lambda *_, **__: None)
            assert torch.equal(run(), expected)


def test_stream_k_excludes_persistent_and_split_k_and_the_w8a8_gemm():
    from lowbit.kernels.triton_w8a8_gemm import w8a8_mm_triton

    for flags in (dict(persistent=True), dict(split_k=2)):
        with pytest.raises(ValueError, match="stream_k"):
            GemmConfig(32, 32, 64, stream_k=True, **flags)
    config = GemmConfig(128, 64, 256, 8, 4, 3, tma=True, tma_store=True, join=True, stream_k=True)
    assert config.name == "128x64x256-g8-w4-s3-tma-tmastore-sk-join" and GemmConfig.from_name(config.name) == config
    a = randint8(4, 64, seed=1)
    with pytest.raises(ValueError, match="stream-K is a W4 GEMM option"):
        w8a8_mm_triton(a, a, torch.ones(4, 1), torch.ones(4), None, None, None, torch.float32,
                       GemmConfig(32, 32, 64, 4, 4, 2, stream_k=True))


def test_codebook_gemm_refuses_groups_of_part_words():
    """The codebook planes take a packed word's 8 codes from one group: a group size that is not a multiple of 8
    is refused before any launch (the dispatcher's Triton candidates already leave such weights out)."""
    from lowbit.kernels.triton_w4_gemm import w4a8_mm_triton

    a, packed = randint8(4, 128, seed=1), _packed(8, 128, seed=2)
    s_rel = torch.ones(8, 32).to(FP8)
    with pytest.raises(ValueError, match="group_size 4"):
        w4a8_mm_triton(a, packed, torch.ones(4, 1), torch.ones(8), None, s_rel, w4a8_level_table(CODEBOOK), 4,
                       torch.float32, GemmConfig(32, 32, 64, 4, 4, 2))


def test_w4_op_checks_the_activation_order():
    a, packed = randint8(4, 128, seed=1), _packed(8, 128, seed=2)
    ones = (torch.ones(4, 1), torch.ones(8))
    eager = w4a8_mm(permute_columns(a, 64), packed, *ones, None, None, None, 16, 64, torch.float32, "eager")
    assert torch.equal(eager, int8_accumulate_reference(a, unpack_int4_signed(packed)).float())
    with pytest.raises(ValueError, match="permuted in blocks of 64"):
        w4a8_mm(a, packed, *ones, None, None, None, 16, 128, torch.float32, "32x32x64-g4-w4-s2")


def _w4a4_weight(n, k, seed):
    import comfy_kitchen as ck

    return ck.quantize_convrot_w4a4_weight(randn(n, k, seed=seed) / k**0.5, 256, 64)


@pytest.mark.parametrize("backend", [Backend.EAGER, Backend.TRITON])
def test_w4a4_linear_matches_kitchen(backend):
    import comfy_kitchen as ck

    if backend is Backend.TRITON and not triton_interpreter_available():
        pytest.skip("no Triton interpreter")
    weight = randn(48, 512, seed=7) / 512**0.5
    qweight, wscales = ck.quantize_convrot_w4a4_weight(weight, 256, 64)
    x = randn(2, 5, 512, seed=8, dtype=torch.bfloat16)
    reference = x.float() @ weight.t()
    kitchen = ck.convrot_w4a4_linear(x, qweight, wscales).float()
    with force_backend(backend):
        ours = w4a4_linear(x, qweight, wscales, act_bits=4).float()
    assert ours.shape == (2, 5, 48)
    # the same 4-bit activation codes up to rounding (kitchen divides in bf16, we multiply in fp32):
    # equally accurate, and close to each other
    assert abs(sqnr_db(ours, reference) - sqnr_db(kitchen, reference)) < 0.5
    assert sqnr_db(ours, kitchen) > 25


def test_w4a4_with_int8_activations_is_more_accurate():
    qweight, wscales = _w4a4_weight(64, 512, seed=9)
    x = randn(16, 512, seed=10, dtype=torch.bfloat16)
    with force_backend(Backend.DEQUANT):
        exact = w4a4_linear(x, qweight, wscales).float()  # the stored weight, float activations
    with force_backend(Backend.EAGER):
        a4 = w4a4_linear(x, qweight, wscales, act_bits=4).float()
        a8 = w4a4_linear(x, qweight, wscales, act_bits=8).float()
    assert sqnr_db(a8, exact) > sqnr_db(a4, exact) + 15


@pytest.mark.parametrize("backend", [Backend.EAGER, Backend.TRITON, Backend.KITCHEN, Backend.DEQUANT])
def test_w4a8_linear_matches_kitchen(backend):
    import comfy_kitchen as ck

    if backend is Backend.TRITON and not triton_interpreter_available():
        pytest.skip("no Triton interpreter")
    weight = randn(32, 512, seed=11) / 512**0.5
    qdata, s_rel, s_channel, correction, codebook = ck.quantize_w4a8_int8_weight(weight)
    x = randn(6, 512, seed=12, dtype=torch.bfloat16)
    kitchen = ck.w4a8_int8_linear(x, qdata, s_rel, s_channel, codebook, correction, out_dtype=torch.float32)
    with force_backend(backend):
        ours = w4a8_linear(x, qdata, s_rel, s_channel, codebook, correction, out_dtype=torch.float32)
    assert sqnr_db(ours, kitchen) > (30 if backend is not Backend.DEQUANT else 20)


def _run_ptx(asm: str, operands: dict[int, int], memory: dict[int, bytes]) -> dict[int, int]:
    """Execute the straight-line integer PTX the codebook decode inlines (the instructions it uses, with
    their PTX semantics) on 32-/64-bit operands; returns the written ``$n`` outputs."""
    import re

    regs: dict[str, int] = {f"${i}": v for i, v in operands.items()}

    def val(token: str) -> int:
        token = token.strip()
        return regs[token] if token in regs else int(token, 0)

    def prmt(a: int, b: int, c: int) -> int:
        pool = a.to_bytes(4, "little") + b.to_bytes(4, "little")
        out = 0
        for i in range(4):
            sel = (c >> 4 * i) & 0xF
            byte = pool[sel & 7]
            if sel & 8:  # replicate the byte's sign
                byte = 0xFF if byte & 0x80 else 0
            out |= byte << 8 * i
        return out

    def lop3(a: int, b: int, c: int, lut: int) -> int:
        return sum(((lut >> ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1))) & 1) << i for i in range(32))

    body = asm.strip()[1:-1]
    for stmt in filter(None, (s.strip() for s in body.split(";"))):
        if stmt.startswith(".reg"):
            continue
        op, rest = stmt.split(None, 1)
        if op.startswith("ld.global"):
            dests, addr = re.match(r"\{([^}]*)\},\s*\[(\S+)\]", rest).groups()
            data = memory[regs[addr]]
            for i, dest in enumerate(d.strip() for d in dests.split(",")):
                regs[dest] = int.from_bytes(data[4 * i:4 * i + 4], "little")
            continue
        dest, *src = [t.strip() for t in rest.split(",")]
        v = [val(t) for t in src]
        m32 = 0xFFFFFFFF
        result = {"and.b32": lambda: v[0] & v[1], "or.b32": lambda: v[0] | v[1],
                  "shr.u32": lambda: (v[0] & m32) >> v[1], "shl.b32": lambda: (v[0] << v[1]) & m32,
                  "mul.wide.u32": lambda: (v[0] & m32) * v[1], "add.s64": lambda: v[0] + v[1],
                  "prmt.b32": lambda: prmt(*v), "lop3.b32": lambda: lop3(*v)}[op]()
        regs[dest] = result
    return {i: regs[f"${i}"] for i in (0, 1)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_codebook_ptx_decode_picks_the_table_levels(seed):
    """The inline PTX of the GPU codebook decode (the CPU interpreter runs the gathers instead), executed
    with PTX semantics: for random packed words and scale bytes, its two output words are the table's
    levels of the word's nibbles 0-3 and 4-7 (its first and last 4 columns), in column order."""
    from lowbit.kernels.triton_w4_gemm import _CODEBOOK_PTX

    gen = torch.Generator().manual_seed(seed)
    table = w4a8_level_table(CODEBOOK).view(torch.uint8)
    base = 0x10000
    memory = {base + 16 * s: bytes(table[s].tolist()) for s in range(256)}
    words = torch.randint(0, 2**32, (64,), generator=gen, dtype=torch.int64).tolist() + [0, 0xFFFFFFFF, 0x88888888]
    scales = torch.randint(0, 256, (len(words),), generator=gen).tolist()
    for word, s in zip(words, scales):
        out = _run_ptx(_CODEBOOK_PTX.value, {2: word, 3: s, 7: base}, memory)
        for i in range(4):
            assert out[0] >> 8 * i & 0xFF == table[s, word >> 4 * i & 0xF].item(), (hex(word), s, i)
            assert out[1] >> 8 * i & 0xFF == table[s, word >> 4 * (4 + i) & 0xF].item(), (hex(word), s, i)


@needs_triton_interpreter()
@pytest.mark.parametrize("k", [256, 384])
@pytest.mark.parametrize("codebook", [False, True])
def test_expanded_weight_is_the_decoded_levels(codebook, k):
    """``expand_w4_int8``: the packed weight's INT8 levels in natural column order, every row written
    (70 rows: a partial row tile), for both weight kinds, in 256-column steps and (K = 384) 128-column ones."""
    from lowbit.kernels.triton_w4_expand import expand_w4_int8

    n = 70
    packed = _packed(n, k, seed=21)
    s_rel = (torch.rand(n, k // 16, generator=torch.Generator().manual_seed(22)) * 60 + 4).to(FP8)
    args = (s_rel, w4a8_level_table(CODEBOOK)) if codebook else (None, None)
    out = expand_w4_int8(packed, *args, 16)
    assert out.dtype == torch.int8 and out.shape == (n, k)
    assert torch.equal(out, decode_w4_reference(packed, *args, 16))
    if k % 256 == 0:  # the step width asked for: the same levels
        assert torch.equal(expand_w4_int8(packed, *args, 16, block_k=128), out)
    with pytest.raises(ValueError, match="multiple of 128"):
        expand_w4_int8(_packed(4, 64, seed=1), None, None, 16)
    with pytest.raises(ValueError, match="block_k must be 128 or 256 and divide K"):
        expand_w4_int8(packed, *args, 16, block_k=256 if k % 256 else 64)


@needs_triton_interpreter()
@pytest.mark.parametrize("codebook", [False, True])
def test_overlapped_expand_experiment_gives_the_two_launches_bits(codebook):
    """``tests/gpu/overlap_w4_gemm.py``, an experiment the dispatcher does not offer (measured slower): the weight
    expanded and multiplied in one launch (tickets, release flags, the acquire wait) gives the expand kernel's
    levels and the W8A8 GEMM's output bit for bit, with pointer and TMA operands, partial row and column tiles and
    output tiles spanning two decode blocks; its counters and flags are back at zero after every launch."""
    import importlib.util
    from pathlib import Path

    from lowbit.kernels.triton_w4_expand import expand_w4_int8
    from lowbit.kernels.triton_w8a8_gemm import split_k_workspace, w8a8_mm_triton

    spec = importlib.util.spec_from_file_location("overlap_w4_gemm",
                                                  Path(__file__).resolve().parent / "gpu" / "overlap_w4_gemm.py")
    overlap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(overlap)
    m, n, k = 40, 136, 512  # 3 decode blocks of 64 rows, the last partial
    packed = _packed(n, k, seed=31)
    s_rel = (torch.rand(n, k // 16, generator=torch.Generator().manual_seed(32)) * 60 + 4).to(FP8)
    args = (s_rel, w4a8_level_table(CODEBOOK)) if codebook else (None, None)
    a = randint8(m, k, seed=33)
    a_scale = torch.rand(m, generator=torch.Generator().manual_seed(34)) + 0.1
    w_scale = torch.rand(n, generator=torch.Generator().manual_seed(35)) / 64 + 1e-3
    bias = randn(n, seed=36, dtype=torch.bfloat16)
    levels = expand_w4_int8(packed, *args, 16)
    for name in ("32x32x64-g4-w4-s2", "32x128x128-g4-w4-s2-tma-tmastore"):
        config = GemmConfig.from_name(name)
        expected = w8a8_mm_triton(a, levels, a_scale, w_scale, bias, None, None, torch.float32, config)
        poison = torch.full((m, n), float("nan"))
        got_levels, out = overlap.w4_overlap_mm(a, packed, *args, 16, a_scale, w_scale, bias, torch.float32, config,
                                                out=poison)
        assert torch.equal(got_levels, levels) and torch.equal(out, expected), name
        assert not split_k_workspace(torch.device("cpu"), 1, 2)[1].any(), "counters or flags left set"
    with pytest.raises(ValueError, match="K % 256"):
        overlap.w4_overlap_mm(a[:, :384], packed[:, :192], None, None, 16, a_scale, w_scale, bias, torch.float32,
                              config)
    with pytest.raises(ValueError, match="one program an output tile"):
        overlap.w4_overlap_mm(a, packed, *args, 16, a_scale, w_scale, bias, torch.float32,
                              GemmConfig.from_name("32x32x64-g4-w4-s2-k2"))


def _run_with_decision(fn, fmt: str, m: int, n: int, k: int, name: str):
    """``fn()`` with the dispatcher's choice for ``fmt`` at this shape set to candidate ``name``."""
    from lowbit.kernels.backend import capability
    from lowbit.kernels.dispatch import DispatchKey, Dispatcher, m_bucket, use_dispatcher

    key = DispatchKey(fmt, capability(torch.device("cpu")), m_bucket(m), n, k).as_str()
    dispatcher = Dispatcher(measure=False, decisions={key: name})
    with use_dispatcher(dispatcher):
        out = fn()
    assert dispatcher.last_choice == (key, name)
    return out


@needs_triton_interpreter()
@pytest.mark.parametrize("kind,expand_config", [("w4a8", None), ("w4a4/a8", None), ("w4a4/a4", None),
                                                ("w4a8", "32x32x64-g4-w4-s2-tma-tmastore"),
                                                ("w4a8", "32x32x64-g4-w4-s2-k2")])
def test_expanded_candidate_gives_the_in_register_kernels_bits(kind, expand_config):
    """The ``triton:expand-`` candidate (weight expanded to INT8, then the W8A8 GEMM) sums the same int32
    products as the in-register W4 GEMM and scales them in the same order: the same output, bit for bit.
    (The dispatcher offers it for codebook weights only, but a cached decision naming it runs it for
    signed nibbles too: the bits must match there as well.) The expanded weight's GEMM takes the INT8
    format's candidates, so TMA in and out and split-K too (``expand_config``; else the CPU default)."""
    import comfy_kitchen as ck

    from lowbit.kernels.gemm_config import default_config

    m, n, k = 6, 40, 512
    x = randn(m, k, seed=23, dtype=torch.bfloat16)
    bias = randn(n, seed=24, dtype=torch.bfloat16)
    if kind == "w4a8":
        qdata, s_rel, s_channel, _, codebook = ck.quantize_w4a8_int8_weight(randn(n, k, seed=25) / k**0.5)

        def fn():
            return w4a8_linear(x, qdata, s_rel, s_channel, codebook, None, bias, out_dtype=torch.float32)
    else:
        qweight, wscales = _packed(n, k, seed=26), torch.rand(n, generator=torch.Generator().manual_seed(27)) + 0.5

        def fn():
            return w4a4_linear(x, qweight, wscales, bias, out_dtype=torch.float32, act_bits=int(kind[-1]))
    in_register = _run_with_decision(fn, kind, m, n, k, f"triton:{default_config(m, 'w4').name}")
    expanded = _run_with_decision(fn, kind, m, n, k, f"triton:expand-{expand_config or default_config(m).name}")
    assert torch.isfinite(expanded).all() and expanded.abs().max() > 0
    assert torch.equal(expanded, in_register)


@needs_triton_interpreter()
def test_only_codebook_weights_are_offered_the_expansion():
    from lowbit.kernels.w4_linear import EXPAND, _W4Plan

    x, packed = randn(4, 512, seed=28), _packed(8, 512, seed=29)
    s_rel = (torch.rand(8, 512 // 16, generator=torch.Generator().manual_seed(30)) * 60 + 4).to(FP8)
    codebook = _W4Plan(x, packed, torch.ones(8), None, torch.float32, 256, 127, s_rel=s_rel).names()
    nibbles = _W4Plan(x, packed, torch.ones(8), None, torch.float32, 256, 127).names()
    assert any(name.startswith(EXPAND) for name in codebook)
    assert not any(name.startswith(EXPAND) for name in nibbles) and any(n.startswith("triton:") for n in nibbles)
