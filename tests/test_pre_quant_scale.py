"""SmoothQuant pre_quant_scale: calibration writes it where it lowers a layer's error and the layer's
format may carry it (no ComfyUI here; the runtime and the node paths are in tests/comfy)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn

from calibrate_helpers import PlantedStack, output_error
from lowbit.quant.calibrate import CalibrationConfig, CalibrationResult, calibrate, load_policy_file
from lowbit.quant.calibration_apply import convert_calibrated
from lowbit.quant.calibration_choose import Budget
from lowbit.quant.calibration_measure import MIN_PRE_QUANT_GAIN, relative_error, smoothed_weight
from lowbit.quant.calibration_pre_quant import (carries_pre_quant_scale, decode_scale, encode_scale,
                                                pre_quant_scale)
from lowbit.quant.calibration_samples import record_linear_inputs
from lowbit.quant.checkpoint import load_quantized, save_checkpoint
from lowbit.quant.errors import PolicyError
from lowbit.quant.formats import get_format
from lowbit.quant.policy import Policy

PLANTED = "blocks.3.lin"  # the one layer with outlier input channels (x220)
OWN_FORMATS = ("int8_quarot", "int8_hadanorm")  # LowBit's own formats where smoothing measurably helps
BIG_BUDGET = Budget("bytes", 10**9)
#: model output error with / without smoothing on fresh inputs must stay below these (measured on the CPU:
#: int8_quarot 0.25x (layer 1.29e-1 -> 1.09e-2), int8_hadanorm 0.955x (layer 1.48e-2 -> 1.09e-2, HadaNorm
#: already smooths by weight statistics)
MAX_MODEL_ERROR_RATIO = {"int8_quarot": 0.5, "int8_hadanorm": 0.98}


def _calibrated(candidates, **config):
    model = PlantedStack(seed=0, planted=(3,))
    linears = model.linears()
    gen = torch.Generator().manual_seed(1)
    inputs = [torch.randn(2, 64, 512, generator=gen) for _ in range(2)]
    with torch.no_grad(), record_linear_inputs(linears, max_rows=256, seed=0) as samplers:
        for x in inputs:
            model(x)
    samples = {name: s.sample() for name, s in samplers.items()}
    weights = {name: lin.weight.detach() for name, lin in linears.items()}
    result = calibrate(weights, samples, CalibrationConfig(budget=BIG_BUDGET, candidates=candidates, **config),
                       policy=Policy(mode="int4_mixed", preset="generic"))
    return model, samples, result


class SmoothedCodecLinear(nn.Module):
    """A Linear as LowBit runs a calibrated layer: ``codec.linear(x * pre_quant_scale, Q(W / pre_quant_scale))``."""

    def __init__(self, linear: nn.Linear, fmt: str, scale: torch.Tensor | None):
        super().__init__()
        self.codec, self.scale, self.bias = get_format(fmt), scale, linear.bias.detach()
        weight = linear.weight.detach() if scale is None else smoothed_weight(linear.weight.detach(), scale)
        self.weight_q = self.codec.quantize(weight, compute_dtype=torch.bfloat16)

    def forward(self, x):
        x = x.to(torch.bfloat16)
        if self.scale is not None:
            x = x * self.scale.to(x.dtype)
        return self.codec.linear(x, self.weight_q).float() + self.bias


def _run_as_calibrated(model: PlantedStack, result: CalibrationResult, *, smoothing: bool) -> nn.Module:
    out = copy.deepcopy(model)
    scales = result.pre_quant_scales() if smoothing else {}
    for name, fmt in result.policy.layer_format_map.items():
        block = out.get_submodule(name.rsplit(".", 1)[0])
        block.lin = SmoothedCodecLinear(block.lin, fmt, scales.get(name))
    return out


@pytest.mark.parametrize("fmt", OWN_FORMATS)
def test_smoothing_is_written_for_the_outlier_layer_only_and_lowers_the_model_error(fmt):
    model, samples, result = _calibrated((fmt,))
    assert set(result.pre_quant_scales()) == {PLANTED}, {l.name: l.chosen for l in result.layers}
    layer = next(l for l in result.layers if l.name == PLANTED)
    m = layer.chosen
    assert m.smoothed and m.pre_quant_alpha == m.smoothing_alpha and m.smoothing_gain >= MIN_PRE_QUANT_GAIN
    assert layer.cost(fmt, "layer_output") == m.smoothed_error < m.error
    scale = layer.pre_quant_scale
    assert scale.dtype == torch.bfloat16 and scale.shape == (512,)  # the compute dtype: stored as applied
    torch.testing.assert_close(scale, pre_quant_scale(samples[PLANTED].channel_amax, model.linears()[PLANTED].weight.detach(),
                                                      m.pre_quant_alpha, torch.bfloat16), rtol=0, atol=0)
    # the measured smoothed error is the error of the layer as it will run, on the calibration rows
    lin = model.linears()[PLANTED]
    x = samples[PLANTED].rows.to(torch.bfloat16)  # measured in the compute dtype, as the layer runs
    ran = SmoothedCodecLinear(lin, fmt, scale)(x) - lin.bias.detach()
    assert relative_error(torch.nn.functional.linear(x.float(), lin.weight.detach()), ran) == pytest.approx(
        m.smoothed_error, rel=1e-4)
    # the model: smoothing lowers its output error on fresh inputs of the calibration distribution
    x = torch.randn(2, 64, 512, generator=torch.Generator().manual_seed(7))
    with_scale = output_error(model, _run_as_calibrated(model, result, smoothing=True), x)
    without = output_error(model, _run_as_calibrated(model, result, smoothing=False), x)
    print(f"{fmt}: layer error {m.error:.3e} -> {m.smoothed_error:.3e}; model error {without:.3e} -> {with_scale:.3e}")
    assert with_scale < MAX_MODEL_ERROR_RATIO[fmt] * without


def test_native_formats_never_get_it_unless_their_loader_applies_it():
    """int8 (int8_tensorwise): smoothing lowers the planted layer's error ~50x, but stock ComfyUI 0.30
    drops pre_quant_scale for that format, so nothing is written; a ComfyUI that applied it would get it."""
    _, _, stock = _calibrated(("int8",))
    planted = next(l for l in stock.layers if l.name == PLANTED).chosen
    assert planted.smoothing_gain > 10 and not planted.smoothed and stock.pre_quant_scales() == {}
    assert not carries_pre_quant_scale("int8") and carries_pre_quant_scale("int8", frozenset({"int8_tensorwise"}))
    assert all(carries_pre_quant_scale(f) for f in ("int8_quarot", "int8_hadanorm", "fp8_rowwise"))
    assert not any(carries_pre_quant_scale(f) for f in ("int8_convrot", "fp8", "w4a4", "w4a8", "float"))
    _, _, allowed = _calibrated(("int8",), pre_quant_formats=frozenset({"int8_tensorwise"}))
    assert set(allowed.pre_quant_scales()) == {PLANTED}
    _, _, measured_only = _calibrated(("int8_quarot",), smoothing="measure")
    assert measured_only.pre_quant_scales() == {}
    assert next(l for l in measured_only.layers if l.name == PLANTED).chosen.smoothing_gain > 2


def test_policy_file_keeps_the_exact_scale_and_refuses_edits(tmp_path):
    _, _, result = _calibrated(("int8_quarot",))
    path = result.save(tmp_path / "policy.json")
    _, loaded = load_policy_file(path)
    assert set(loaded.pre_quant_scales()) == {PLANTED}
    assert torch.equal(loaded.pre_quant_scales()[PLANTED], result.pre_quant_scales()[PLANTED])
    data = json.loads(path.read_text())
    entry = data["calibration"]["layers"][PLANTED]
    assert entry["pre_quant_alpha"] == result.layers[3].pre_quant_alpha and entry["pre_quant_scale"]["dtype"] == "bfloat16"
    assert "pre_quant_scale" not in data["calibration"]["layers"]["blocks.0.lin"]
    assert "pre_quant_formats" in data["calibration"]["config"]
    for change, match in ((lambda e: e.update(pre_quant_alpha=0.123), "edited"),
                          (lambda e: e["pre_quant_scale"].update(base64="!!"), "malformed"),
                          (lambda e: e.pop("pre_quant_scale"), "pre_quant_scale goes with")):
        broken = json.loads(path.read_text())
        change(broken["calibration"]["layers"][PLANTED])
        with pytest.raises(PolicyError, match=match):
            CalibrationResult.from_dict(broken)
    scale = torch.rand(7, dtype=torch.float16) + 0.5
    assert torch.equal(decode_scale("x", encode_scale(scale)), scale)


def test_calibrated_conversion_writes_the_smoothed_weight_and_its_scale(tmp_path):
    model, _, result = _calibrated(("int8_quarot",))
    state_dict = {f"{k}": v.detach().bfloat16() for k, v in model.state_dict().items() if "gains" not in k}
    src = save_checkpoint(state_dict, tmp_path / "float.safetensors")
    dst = tmp_path / "calibrated.safetensors"
    convert_calibrated(src, dst, result.policy, pre_quant_scales=result.pre_quant_scales(),
                       calibration_summary=result.metadata_summary())
    loaded = load_quantized(dst)
    assert {k for k in loaded.tensors if k.endswith(".pre_quant_scale")} == {f"{PLANTED}.pre_quant_scale"}
    scale = loaded.tensors[f"{PLANTED}.pre_quant_scale"]
    assert torch.equal(scale, result.pre_quant_scales()[PLANTED])
    expected = get_format("int8_quarot").quantize(smoothed_weight(state_dict[f"{PLANTED}.weight"].float(), scale))
    assert torch.equal(loaded.layers[PLANTED].dequantize(), expected.dequantize())
