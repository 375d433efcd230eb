"""The steady-state shortcut of a LowBit Linear whose weights live on the input's device.

A fully loaded layer goes straight from its forward to the format's kernel function (the codec's
bound runner) instead of ComfyUI's cast and the ``F.linear`` -> ``__torch_dispatch__`` walk. It must
give the same bits as the full path, rebind when the weight changes, stay out of the way when ComfyUI
would cast something or a backend is forced, and never keep a replaced weight alive.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from comfy_helpers import device, require_comfy

require_comfy()

from lowbit.nodes.comfy_ops import RUNNER_ATTR, LowBitOpsConfig  # noqa: E402
from lowbit.nodes.model_quant import quantize_model  # noqa: E402
from lowbit.quant.formats import FORMATS, get_format  # noqa: E402
from lowbit.quant.policy import Policy  # noqa: E402

LAYER = "double_blocks.0.img_attn.qkv"


def _probe(layer, seed: int = 5) -> torch.Tensor:
    """An input in the layer's compute dtype (the dtype its quantized weight reports)."""
    x = torch.randn(2, 7, layer.in_features, generator=torch.Generator().manual_seed(seed))
    return x.to(device(), layer.weight.dtype)


@pytest.fixture(scope="module")
def layers(float_model):
    """One quantized qkv layer per format (weights on the test device, as after a full load)."""
    out = {}
    for fmt in FORMATS:
        model = quantize_model(float_model, Policy(mode=fmt))
        layer = model.model.diffusion_model.get_submodule(LAYER)
        if getattr(layer, "lowbit_format", None) is None:
            continue  # the format fell back to float here (shape)
        out[fmt] = layer.to(device())
    return out


def _full_path(layer, x):
    """The same layer's output through the full path (cast, codec.linear, kitchen dispatch)."""
    codec = get_format(layer.lowbit_format)
    with torch.no_grad():
        return layer._lowbit_quantized_forward(x, codec, LowBitOpsConfig())


@pytest.mark.parametrize("fmt", FORMATS)
def test_shortcut_gives_the_full_paths_bits(layers, fmt):
    if fmt not in layers:
        pytest.skip(f"{fmt} keeps {LAYER} in float on this model")
    layer = layers[fmt]
    if getattr(layer, "quant_format", None) in layer.lowbit_config.dequantize_formats:
        pytest.skip(f"{fmt} runs dequantized on {device()} (as ComfyUI runs it: no FP8 compute)")
    layer.__dict__.pop(RUNNER_ATTR, None)
    x = _probe(layer)
    with torch.no_grad():
        first = layer(x)
        cached = layer.__dict__.get(RUNNER_ATTR)
        second = layer(x)
    assert cached is not None and cached[0]() is layer.weight
    assert layer.__dict__[RUNNER_ATTR] is cached  # reused, not rebuilt
    expected = _full_path(layer, x)
    assert first.dtype == expected.dtype and first.shape == expected.shape
    assert torch.equal(first, expected) and torch.equal(second, expected)


def test_a_new_weight_rebinds_and_the_old_one_is_not_kept_alive(layers):
    layer = layers["int8_convrot"]
    x = _probe(layer)
    with torch.no_grad():
        layer(x)
        old = weakref.ref(layer.weight)
        patched = layer.weight.dequantize().float() * 1.01
        layer.set_weight(patched)  # what ComfyUI's patch_weight_to_device does with a LoRA
        gc.collect()
        assert old() is None  # the runner cache held it only weakly
        out = layer(x)
        assert layer.__dict__[RUNNER_ATTR][0]() is layer.weight
    assert torch.equal(out, _full_path(layer, x))


def test_patched_layers_and_forced_backends_take_the_full_path(layers, monkeypatch):
    layer = layers["fp8_rowwise"]
    x = _probe(layer)
    calls = []
    full = type(layer)._lowbit_quantized_forward
    monkeypatch.setattr(type(layer), "_lowbit_quantized_forward",
                        lambda self, *a, **k: calls.append(1) or full(self, *a, **k))
    with torch.no_grad():
        layer(x)
        assert calls == []  # the shortcut ran
        old = layer.lowbit_config
        layer.lowbit_config = LowBitOpsConfig(compute_dtype=old.compute_dtype, backend="eager",
                                              dequantize_formats=old.dequantize_formats)
        try:
            layer(x)
        finally:
            layer.lowbit_config = old
        assert calls == [1]
        other = torch.bfloat16 if x.dtype != torch.bfloat16 else torch.float32
        layer.bias.data = layer.bias.data.to(other)  # a bias ComfyUI would cast to the input's dtype
        try:
            expected = full(layer, x, get_format(layer.lowbit_format), LowBitOpsConfig())
            out = layer(x)
        finally:
            layer.bias.data = layer.bias.data.to(x.dtype)
        assert calls == [1, 1] and torch.equal(out, expected)


def test_a_device_move_drops_the_caches_that_hold_the_weights_tensors(layers):
    """The form cache keeps the layer's weight form (its codes and scales, for the settled-plan lane): a
    ``Module.to`` (ComfyUI's load and unload) must drop it, or an unloaded model's codes would stay
    allocated through it; the next call binds again and gives the same bits."""
    from lowbit.nodes.comfy_ops import FORM_ATTR

    layer = layers["int8_convrot"]
    x = _probe(layer)
    with torch.no_grad():
        first = layer(x)
        form = layer.__dict__[FORM_ATTR][3]
        assert RUNNER_ATTR in layer.__dict__ and form is not None and form.codes is layer.weight._qdata
        layer.to(device())
        assert RUNNER_ATTR not in layer.__dict__ and FORM_ATTR not in layer.__dict__
        again = layer(x)
    assert torch.equal(first, again) and layer.__dict__[FORM_ATTR][3] is not None
