"""Per-layer quantize options through the converter: ``fp8_rowwise`` layers with calibrated outlier
channels are written as ``[N, K + 2r]`` plus ``weight_outlier_index`` by ``convert_file`` /
``convert_calibrated`` / ``quantize_state_dict``, identical to quantizing the weight in memory; an
option a layer's format does not take is refused before anything is written. No ComfyUI needed."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint_helpers import SMALL_FLUX, assert_qt_bit_equal, assert_state_dicts_bit_equal, leftovers
from lowbit.quant.calibration_apply import convert_calibrated
from lowbit.quant.checkpoint import load_quantized
from lowbit.quant.convert import convert_file
from lowbit.quant.demo import tiny_flux_state_dict
from lowbit.quant.errors import LowBitError
from lowbit.quant.formats import get_format
from lowbit.quant.layouts.fp8_rowwise import OUTLIER_INDEX
from lowbit.quant.policy import Policy
from lowbit.quant.quantize import quantize_state_dict, quantize_weight

R = 16


@pytest.fixture(scope="module")
def flux_file(tmp_path_factory):
    sd = tiny_flux_state_dict(SMALL_FLUX, seed=3)
    path = tmp_path_factory.mktemp("src") / "flux.safetensors"
    save_file(sd, path)
    return path, sd


def _channels(sd, layers) -> dict[str, torch.Tensor]:
    """``R`` distinct seeded channels per layer."""
    out = {}
    for i, layer in enumerate(layers):
        k = sd[f"{layer}.weight"].shape[1]
        out[layer] = torch.randperm(k, generator=torch.Generator().manual_seed(i))[:R].sort().values.to(torch.int32)
    return out


def _fp8_rowwise_layers(sd, count: int) -> list[str]:
    plan = Policy(mode="fp8_rowwise").plan(dict(sorted((k, tuple(v.shape)) for k, v in sd.items())))
    names = sorted(d.name for d in plan.quantized)
    assert len(names) > count
    return names[:count]


def test_quantize_weight_passes_options_to_the_codec():
    weight = torch.randn(32, 128, generator=torch.Generator().manual_seed(0))
    index = torch.tensor([3, 17, 64, 100], dtype=torch.int32)
    got = quantize_weight(weight, "fp8_rowwise", options={"outlier_channels": index})
    direct = get_format("fp8_rowwise").quantize(weight, outlier_channels=index)
    assert_qt_bit_equal(got, direct, "quantize_weight options")
    assert torch.equal(got._params.outlier_index, index) and tuple(got._qdata.shape) == (32, 128 + 8)
    assert quantize_weight(weight, "fp8_rowwise", options={})._params.outlier_index is None


@pytest.mark.parametrize("fmt,options,match", [
    ("int8", {"outlier_channels": torch.tensor([1], dtype=torch.int32)}, "outlier_channels are not options"),
    ("fp8_rowwise", {"seed": 3}, "seed are not options"),
    ("fp8_rowwise", [("outlier_channels", None)], "must be a mapping"),
])
def test_an_option_the_format_does_not_take_is_refused(fmt, options, match):
    with pytest.raises(LowBitError, match=match):
        quantize_weight(torch.randn(32, 256), fmt, name="blk", options=options)


def test_convert_file_writes_the_outlier_layers_as_in_memory(flux_file, tmp_path):
    src, sd = flux_file
    chosen = _channels(sd, _fp8_rowwise_layers(sd, 2))
    seen = []

    def options(layer, fmt):
        seen.append((layer, fmt))
        return {"outlier_channels": chosen[layer]} if layer in chosen else {}

    policy = Policy(mode="fp8_rowwise")
    report = convert_file(src, tmp_path / "out.safetensors", policy, quantize_options=options)
    assert sorted(seen) == sorted((d.name, d.format) for d in report.plan.quantized)
    written = load_file(report.output)
    assert {k[: -len(OUTLIER_INDEX) - 1] for k in written if k.endswith(OUTLIER_INDEX)} == set(chosen)
    loaded = load_quantized(report.output)
    for layer, index in chosen.items():
        n, k = sd[f"{layer}.weight"].shape
        assert tuple(written[f"{layer}.weight"].shape) == (n, k + 2 * R)
        assert torch.equal(written[f"{layer}.{OUTLIER_INDEX}"], index)
        direct = quantize_weight(sd[f"{layer}.weight"], "fp8_rowwise", options={"outlier_channels": index})
        assert_qt_bit_equal(loaded.layers[layer], direct, layer)
    # the in-memory converter with the same options gives the same bytes
    expected, _ = quantize_state_dict(dict(sorted(sd.items())), policy, quantize_options=options)
    assert_state_dicts_bit_equal(written, expected, "fp8_rowwise with outlier channels")


def test_convert_file_refuses_an_option_of_another_format_and_writes_nothing(flux_file, tmp_path):
    src, sd = flux_file
    layer = _fp8_rowwise_layers(sd, 1)[0]
    channels = _channels(sd, [layer])
    with pytest.raises(LowBitError, match=f"{layer}.*outlier_channels are not options of this format"):
        convert_file(src, tmp_path / "bad.safetensors", Policy(mode="int8"),
                     quantize_options=lambda l, f: {"outlier_channels": channels[l]} if l in channels else {})
    assert leftovers(tmp_path) == [] and not (tmp_path / "bad.safetensors").exists()


def test_convert_calibrated_writes_outlier_channels_without_a_warning(flux_file, tmp_path, caplog):
    src, sd = flux_file
    chosen = _channels(sd, _fp8_rowwise_layers(sd, 3))
    with caplog.at_level(logging.WARNING):
        report = convert_calibrated(src, tmp_path / "cal.safetensors", Policy(mode="fp8_rowwise"),
                                    outlier_channels=chosen)
    assert not [r for r in caplog.records if "outlier" in r.getMessage()], caplog.text
    loaded = load_quantized(report.output)
    with_index = {name for name, qt in loaded.layers.items() if qt._params.outlier_index is not None}
    assert with_index == set(chosen)
    for layer, index in chosen.items():
        assert torch.equal(loaded.layers[layer]._params.outlier_index, index)
        # the stored layer dequantizes more exactly than the plain one on its outlier columns
        weight = sd[f"{layer}.weight"].float()
        plain = quantize_weight(weight, "fp8_rowwise").dequantize().float()
        split = loaded.layers[layer].dequantize().float()
        cols = index.long()
        assert (split[:, cols] - weight[:, cols]).norm() < 0.25 * (plain[:, cols] - weight[:, cols]).norm()
