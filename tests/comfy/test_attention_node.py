"""Attention Backend (LowBit) in real ComfyUI, in-process on the CPU.

A tiny Flux built by stock ComfyUI runs with and without the node. Measured: the output against the
stock model's, which candidates the chooser timed and which it picked, that a backend the device
cannot run falls back to ComfyUI's attention, and that the override reproduces ComfyUI's own
``attention_pytorch`` (layouts, masks, ``skip_output_reshape``) on direct calls. The speed itself is
measured on a GPU by ``tests/gpu/bench_attention.py`` and ``tests/gpu/bench_flux_step.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from comfy_helpers import flux_inputs, load_stock, on_cuda, require_comfy, sqnr_db, tiny_flux_bf16

require_comfy()

import comfy.ldm.flux.math  # noqa: E402
import comfy.ldm.modules.attention as comfy_attention  # noqa: E402
import comfy.model_management  # noqa: E402

from lowbit.kernels.attention import AttentionChooser, AttentionConfig  # noqa: E402
from lowbit.nodes.attention import (OVERRIDE_KEY, LowBitAttentionBackend, LowBitAttentionOverride,  # noqa: E402
                                    apply_attention_backend, attention_override)
from lowbit.nodes.common import NodeInputError  # noqa: E402


@pytest.fixture(autouse=True)
def pytorch_attention(monkeypatch):
    """ComfyUI's PyTorch attention, as a CUDA install runs (its CPU default is sub-quadratic attention)."""
    monkeypatch.setattr(comfy.ldm.flux.math, "optimized_attention", comfy_attention.attention_pytorch)


@pytest.fixture(scope="module")
def stock():
    return load_stock(tiny_flux_bf16())


def run(model_patcher) -> torch.Tensor:
    """One denoiser call with the patcher's ``transformer_options``, as ComfyUI's sampler passes them."""
    comfy.model_management.load_models_gpu([model_patcher])
    inputs = flux_inputs(0)
    dev = model_patcher.load_device
    options = dict(model_patcher.model_options.get("transformer_options", {}))
    with torch.no_grad():
        out = model_patcher.model.apply_model(
            inputs["x"].to(dev), inputs["t"].to(dev), c_crossattn=inputs["c_crossattn"].to(dev),
            y=inputs["y"].to(dev), guidance=inputs["guidance"].to(dev), transformer_options=options)
    return out.float().cpu()


def test_auto_measures_the_candidates_and_keeps_the_output(stock):
    reference = run(stock)
    (patched,) = LowBitAttentionBackend.execute(stock, backend="auto").args
    assert patched is not stock and attention_override(stock) is None
    override = attention_override(patched)
    assert isinstance(override, LowBitAttentionOverride)
    out = run(patched)
    chooser = override.chooser
    # Flux's joint attention is one shape here: one decision, timed among ComfyUI's attention and SDPA's
    assert len(chooser.decisions) == 1
    (key, choice), = chooser.decisions.items()
    timed, failed = set(chooser.timings_s[key]), set(chooser.failures[key])
    assert timed | failed == set(AttentionConfig().candidate_names()) and not timed & failed
    assert "comfy" in timed and "math" in timed and choice in timed
    if on_cuda():
        assert "cudnn" in timed and "flash" in timed
    else:
        assert "cudnn" in failed  # no cuDNN attention on the CPU: recorded, not fatal
    assert chooser.calls.get(choice, 0) >= 4  # 2 double + 2 single blocks, all on the decision
    assert sqnr_db(reference, out) > 45, "an exact attention backend changed the model's output"


def test_a_backend_the_device_cannot_run_falls_back_to_comfy(stock, caplog):
    if on_cuda():
        pytest.skip("every SDPA backend runs these calls on a CUDA GPU; the fallback is checked on the CPU")
    reference = run(stock)
    patched = apply_attention_backend(stock, AttentionConfig(backend="cudnn"))
    with caplog.at_level(logging.WARNING, logger="lowbit.kernels.attention"):
        out = run(patched)
    chooser = attention_override(patched).chooser
    assert torch.equal(out, reference)
    assert chooser.calls == {"comfy": 4}
    assert sum("cudnn cannot run this call" in r.getMessage() for r in caplog.records) == 1  # once per shape


def test_forced_math_runs_sdpa_math(stock):
    reference = run(stock)
    patched = apply_attention_backend(stock, AttentionConfig(backend="math"))
    out = run(patched)
    assert attention_override(patched).chooser.calls == {"math": 4}
    assert sqnr_db(reference, out) > 45


def test_comfy_backend_removes_the_override(stock):
    patched = apply_attention_backend(stock, AttentionConfig(backend="math"))
    (restored,) = LowBitAttentionBackend.execute(patched, backend="comfy").args
    assert attention_override(restored) is None
    assert OVERRIDE_KEY not in restored.model_options.get("transformer_options", {})
    assert attention_override(patched) is not None  # the input is unchanged


def test_bad_backend_is_a_node_error(stock):
    with pytest.raises(NodeInputError, match="not one of"):
        LowBitAttentionBackend.execute(stock, backend="sage")


@pytest.mark.parametrize("skip_reshape", [False, True])
@pytest.mark.parametrize("skip_output_reshape", [False, True])
@pytest.mark.parametrize("mask_dims", [0, 2, 3])
def test_override_matches_comfy_attention_pytorch(skip_reshape, skip_output_reshape, mask_dims):
    gen = torch.Generator().manual_seed(1)
    b, heads, s, d = 2, 3, 10, 8
    shape = (b, heads, s, d) if skip_reshape else (b, s, heads * d)
    q, k, v = (torch.randn(shape, generator=gen) for _ in range(3))
    mask = None
    if mask_dims:
        mask = torch.randn((s, s) if mask_dims == 2 else (b, s, s), generator=gen)
    expected = comfy_attention.attention_pytorch(q, k, v, heads, mask=mask, skip_reshape=skip_reshape,
                                                 skip_output_reshape=skip_output_reshape)
    override = LowBitAttentionOverride(AttentionChooser(AttentionConfig(backend="math")))
    options = {OVERRIDE_KEY: override}
    got = comfy_attention.attention_pytorch(q, k, v, heads, mask=mask, skip_reshape=skip_reshape,
                                            skip_output_reshape=skip_output_reshape, transformer_options=options)
    assert override.chooser.calls == {"math": 1}
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_calls_it_cannot_take_go_to_comfy_unchanged():
    gen = torch.Generator().manual_seed(2)
    heads, d = 4, 8
    q = torch.randn(1, 6, heads * d, generator=gen)
    kv = torch.randn(1, 6, 2 * d, generator=gen)  # grouped K/V heads in the flat layout
    seen = []

    def comfy(*args, **kwargs):
        seen.append(kwargs.get("enable_gqa"))
        return torch.zeros(1)

    override = LowBitAttentionOverride(AttentionChooser(AttentionConfig(backend="math")))
    assert torch.equal(override(comfy, q, kv, kv, heads, enable_gqa=True), torch.zeros(1))
    assert seen == [True] and override.chooser.calls == {}


def test_compiled_attention_uses_the_priority_path():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=gen) for _ in range(3))
    override = LowBitAttentionOverride(AttentionChooser(AttentionConfig()))
    options = {OVERRIDE_KEY: override}

    def f(q, k, v):
        return comfy_attention.attention_pytorch(q, k, v, 2, skip_reshape=True, transformer_options=options)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), comfy_attention.attention_pytorch(q, k, v, 2, skip_reshape=True))
    assert override.chooser.decisions == {}  # nothing is measured while tracing
    assert override.chooser.calls.get("priority", 0) >= 1


def test_config_validation():
    with pytest.raises(ValueError, match="repeats"):
        AttentionConfig(repeats=0)
    assert AttentionConfig(backend="auto").candidate_names()[0] == "comfy"
    assert "kitchen_int8" in AttentionConfig(allow_lossy=True).candidate_names()
    assert "kitchen_int8" not in AttentionConfig().candidate_names()


def test_compiled_model_with_the_node_does_not_recompile_for_another_resolution(stock):
    """The compile node marks token counts dynamic: the attention override must not specialize on them
    (a decision looked up per token bucket would guard on the exact count and recompile per size)."""
    from torch._dynamo.utils import counters

    from lowbit.nodes.compile import CompileSettings, compile_model

    def run_sized(patcher, size):
        comfy.model_management.load_models_gpu([patcher])
        dev = patcher.load_device
        gen = torch.Generator().manual_seed(size)
        x, ctx, y = (torch.randn(1, 16, size, size, generator=gen), torch.randn(1, 8, 64, generator=gen),
                     torch.randn(1, 32, generator=gen))
        options = {**patcher.model_options.get("transformer_options", {}), "wrappers": patcher.wrappers}
        with torch.no_grad():
            return patcher.model.apply_model(x.to(dev), torch.full((1,), 0.6, device=dev), c_crossattn=ctx.to(dev),
                                             y=y.to(dev), guidance=torch.full((1,), 3.5, device=dev),
                                             transformer_options=options).float().cpu()

    torch._dynamo.reset()
    patched = apply_attention_backend(stock, AttentionConfig())
    eager = {size: run_sized(patched, size) for size in (16, 24)}  # eager calls measure both token buckets
    compiled = compile_model(patched, CompileSettings(backend="aot_eager", fullgraph=True))
    out = run_sized(compiled, 16)
    graphs = counters["stats"]["unique_graphs"]
    out24 = run_sized(compiled, 24)
    assert counters["stats"]["unique_graphs"] == graphs, "a new resolution recompiled the blocks"
    assert sqnr_db(eager[16], out) > 40 and sqnr_db(eager[24], out24) > 40
