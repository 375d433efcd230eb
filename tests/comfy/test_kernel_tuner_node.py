"""Kernel Tuner (LowBit) in-process on the tiny Flux, with real ComfyUI: which shapes it tunes, that it
records the dispatcher's measured choices in the cache file and shows them, that ``remeasure`` measures
again, and its errors. Without a GPU the dispatcher measures nothing, so the measuring tests give it
fixed candidate timings (the same stand-in as ``tests/test_kernels_dispatch.py``)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from comfy_helpers import on_cuda, require_comfy

require_comfy()

from lowbit.kernels import dispatch  # noqa: E402
from lowbit.kernels.dispatch import Dispatcher, m_bucket, use_dispatcher  # noqa: E402
from lowbit.nodes import NODE_MODULES, node_classes  # noqa: E402
from lowbit.nodes.common import NodeInputError  # noqa: E402
from lowbit.nodes.kernel_tuner import LowBitKernelTuner, layer_groups, parse_tokens  # noqa: E402
from lowbit.nodes.model_quant import quantize_model, quantized_layers  # noqa: E402
from lowbit.quant.policy import Policy  # noqa: E402

TOKENS = "16, 40"  # buckets 16 and 64


@pytest.fixture(scope="module")
def quantized(float_model):
    return quantize_model(float_model, Policy(mode="int8_convrot", layer_formats={"single_blocks.0.linear1":
                                                                                   "fp8_rowwise"}))


@pytest.fixture
def measuring(monkeypatch, tmp_path):
    """A dispatcher with a cache file that 'measures' on any device: each candidate timed costs less
    than the one before, so the last candidate offered wins (not the default, the first). One reading each
    (``recheck=0``): a second reading would be cheaper still, whoever it was."""
    if on_cuda():
        pytest.skip("the stand-in timings are for the CPU; on a GPU the dispatcher measures for real")
    times = itertools.count()
    timed = []

    def fake_time(fn, warmup, repeats):
        timed.append(fn)
        return 1000.0 - next(times)
    monkeypatch.setattr(Dispatcher, "_can_measure", lambda self, device: True)
    monkeypatch.setattr(dispatch, "_time_us", fake_time)
    d = Dispatcher(cache_path=tmp_path / "kernel_dispatch.json", tie=0.0, recheck=0.0)
    with use_dispatcher(d):
        yield d, timed


def test_schema_is_lowbit_and_registered():
    schema = LowBitKernelTuner.define_schema()
    assert schema.category == "LowBit" and schema.display_name == "Kernel Tuner (LowBit)" and schema.description
    assert all(i.tooltip for i in schema.inputs) and all(o.tooltip for o in schema.outputs)
    assert "LowBitKernelTuner" in NODE_MODULES["kernel_tuner"]
    assert LowBitKernelTuner in node_classes()


def test_groups_cover_every_quantized_shape_once(quantized):
    groups = layer_groups(quantized)
    expected = {(fmt, *map(int, w.shape)) for _, fmt, w in quantized_layers(quantized)}
    assert {(fmt, n, k) for fmt, _, n, k, _ in groups} == expected
    assert sum(count for *_, count in groups) == len(quantized_layers(quantized))
    assert any(fmt == "fp8_rowwise" for fmt, *_ in groups)  # the policy's one fp8_rowwise layer is its own group


def test_tuner_records_the_measured_choice_of_every_shape_and_shows_it(quantized, measuring):
    dispatcher, timed = measuring
    out = LowBitKernelTuner.execute(model=quantized, tokens=TOKENS, remeasure=False)
    model, table = out.result
    assert model is quantized
    saved = json.loads(dispatcher.cache_path.read_text())["decisions"]
    groups = layer_groups(quantized)
    assert timed, "nothing was measured"
    for fmt, _, n, k, count in groups:
        for m in parse_tokens(TOKENS):
            keys = [key for key in saved if key.endswith(f"|m{m_bucket(m)}|n{n}|k{k}")]
            assert keys, (fmt, n, k, m)
            assert f"| {fmt} | {n} x {k} | {count} | {m} ({m_bucket(m)}) |" in table
    for key, choice in saved.items():  # what the table shows is the decision on record
        assert choice in table
    # each recorded choice is the fastest measured candidate, and not the default (the first offered)
    timings = json.loads(dispatcher.cache_path.read_text())["timings_us"]
    for key, choice in saved.items():
        assert choice == min(timings[key], key=timings[key].get)
        if len(timings[key]) > 1:
            assert choice != next(iter(timings[key])), key

    # a second run finds the choices on record and measures nothing; remeasure drops and measures them again
    before = len(timed)
    LowBitKernelTuner.execute(model=quantized, tokens=TOKENS, remeasure=False)
    assert len(timed) == before
    LowBitKernelTuner.execute(model=quantized, tokens=TOKENS, remeasure=True)
    assert len(timed) > before


def test_on_the_cpu_without_measuring_the_table_says_so(quantized, tmp_path):
    if on_cuda():
        pytest.skip("on a GPU the dispatcher measures")
    with use_dispatcher(Dispatcher(cache_path=tmp_path / "d.json")):
        model, table = LowBitKernelTuner.execute(model=quantized, tokens="16", remeasure=False).result
    assert model is quantized and "Nothing is measured off a CUDA GPU" in table
    assert "x bf16" not in table


@pytest.mark.skipif(not torch.cuda.is_available(), reason="times kernels: needs a CUDA GPU")
def test_on_a_gpu_it_times_ours_against_bf16(quantized, tmp_path):
    if not on_cuda():
        pytest.skip("LOWBIT_TEST_DEVICE=cuda runs the models on the GPU")
    with use_dispatcher(Dispatcher(cache_path=tmp_path / "d.json")) as d:
        _, table = LowBitKernelTuner.execute(model=quantized, tokens="256", remeasure=False).result
    assert "x bf16" in table and json.loads(d.cache_path.read_text())["decisions"]


@pytest.mark.parametrize("tokens", ["", "abc", "0", "16, 99999999", "1.5"])
def test_bad_token_lists_are_refused_with_the_expected_form(tokens):
    with pytest.raises(NodeInputError, match="tokens"):
        parse_tokens(tokens)
    assert parse_tokens("256, 1024 256\n4096") == [256, 1024, 4096]


def test_a_float_model_is_refused(float_model):
    with pytest.raises(NodeInputError, match="no quantized layers"):
        LowBitKernelTuner.execute(model=float_model, tokens="16", remeasure=False)
