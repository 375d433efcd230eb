"""fp8_rowwise calibrated outlier channels end to end on the tiny Flux, in-process ComfyUI: Calibrate
Policy gives fp8_rowwise layers outlier channels; Quantize with Policy (node path) and
``python -m lowbit quantize --policy`` (converter path) both quantize those layers with them
(weight ``[N, K + 2r]`` + ``weight_outlier_index``), bit-identically; Save Quantized Model writes
them, and the saved file loads back through LowBit's loader with the same index, codes and outputs."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from comfy_helpers import comfyui_path, require_comfy, run_flux, sqnr_db

require_comfy()

import comfy.model_management  # noqa: E402
import folder_paths  # noqa: E402

from lowbit.kernels.fp8_gemm import dequantize_fp8_rowwise  # noqa: E402
from lowbit.nodes.calibrate import LowBitApplyPolicy, LowBitCalibratePolicy  # noqa: E402
from lowbit.nodes.loader import LoadSettings, load_lowbit_diffusion_model  # noqa: E402
from lowbit.nodes.model_quant import native_state_dict, quantize_model, quantized_layers  # noqa: E402
from lowbit.nodes.save import LowBitSaveQuantizedModel  # noqa: E402
from lowbit.quant.calibrate import parse_policy  # noqa: E402
from lowbit.quant.checkpoint import save_checkpoint  # noqa: E402
from lowbit.quant.errors import LowBitError  # noqa: E402
from lowbit.quant.layouts.fp8_rowwise import OUTLIER_INDEX  # noqa: E402
from lowbit.quant.policy import Policy  # noqa: E402

log = logging.getLogger(__name__)
#: fp8_rowwise against w4a4 at a budget that leaves most layers in fp8_rowwise; the layer-output
#: objective and no smoothing keep it fast (~15 s on the CPU)
CALIBRATION = {"budget": "ratio:0.6", "candidates": "fp8_rowwise, w4a4", "steps": 2, "resolution": 128,
               "smoothing": "off", "objective": "layer_output"}
#: measured on the CPU: 12.7 dB for this mix (w4a4 layers dominate the error)
MIN_SQNR_DB = 10.0
TENSORS = ("weight", "weight_scale", OUTLIER_INDEX)


@pytest.fixture(scope="module")
def calibrated(float_model, tmp_path_factory):
    """(policy file, its calibration, the model Quantize with Policy made from it)."""
    policy_json, _ = LowBitCalibratePolicy.execute(model=float_model, **CALIBRATION).result
    path = tmp_path_factory.mktemp("calibrated") / "policy.json"
    path.write_text(policy_json)
    _, calibration = parse_policy(policy_json)
    model = LowBitApplyPolicy.execute(model=float_model, policy=policy_json).result[0]
    return path, calibration, model


def _outlier_weights(model) -> dict[str, object]:
    return {name: qt for name, fmt, qt in quantized_layers(model)
            if fmt == "fp8_rowwise" and qt._params.outlier_index is not None}


def _save(model, folder, monkeypatch):
    monkeypatch.setattr(folder_paths, "get_output_directory", lambda: str(folder))
    node = LowBitSaveQuantizedModel.PREPARE_CLASS_CLONE({"hidden_inputs": {"PROMPT": {}, "EXTRA_PNGINFO": {}}})
    node.execute(model=model, filename_prefix="outliers")
    (saved,) = folder.glob("outliers_*.safetensors")
    return saved


def test_quantize_with_policy_gives_each_calibrated_layer_its_outlier_channels(float_model, float_output,
                                                                             calibrated):
    _, calibration, model = calibrated
    channels = calibration.outlier_channels()
    assert channels, "no fp8_rowwise layer got outlier channels on the tiny Flux: the premise of this test"
    held = _outlier_weights(model)
    assert set(held) == set(channels)
    for name, qt in held.items():
        n, k = qt.shape
        assert torch.equal(qt._params.outlier_index.cpu(), channels[name])
        assert tuple(qt._qdata.shape) == (n, k + 2 * channels[name].numel())
    assert sqnr_db(float_output, run_flux(model)) > MIN_SQNR_DB


def test_saved_file_reloads_with_the_same_outlier_layers_and_output(calibrated, tmp_path, monkeypatch):
    _, calibration, model = calibrated
    saved = _save(model, tmp_path, monkeypatch)
    written = load_file(saved)
    memory = native_state_dict(model)
    for name in calibration.outlier_channels():
        for suffix in TENSORS:
            assert torch.equal(written[f"{name}.{suffix}"].view(torch.uint8),
                               memory[f"{name}.{suffix}"].cpu().view(torch.uint8)), (name, suffix)
    reloaded = load_lowbit_diffusion_model(str(saved), LoadSettings(mode="native"))
    again, before = _outlier_weights(reloaded), _outlier_weights(model)
    assert set(again) == set(before)
    for name, qt in again.items():
        assert torch.equal(qt._params.outlier_index.cpu(), before[name]._params.outlier_index.cpu())
        assert torch.equal(qt._qdata.cpu().view(torch.uint8), before[name]._qdata.cpu().view(torch.uint8))
        assert torch.equal(qt._params.scale.cpu(), before[name]._params.scale.cpu())
    # each outlier layer's own output, and the whole model's, with both models where ComfyUI runs them
    # (the loader leaves the reloaded one on its offload device; a CPU and a GPU kernel differ in the
    # last bit)
    comfy.model_management.load_models_gpu([model, reloaded])
    dm, dm_again = model.model.diffusion_model, reloaded.model.diffusion_model
    name = sorted(again)[0]
    x = torch.randn(7, again[name].shape[1], generator=torch.Generator().manual_seed(1), dtype=torch.float32)
    module, module_again = dm.get_submodule(name), dm_again.get_submodule(name)
    with torch.no_grad():
        # on a GPU the first call of a shape times the kernel candidates, whose roundings differ in the
        # last bit: the compared calls are the settled ones
        for _ in range(2):
            out = module(x.to(module.weight.device, torch.bfloat16))
            out_again = module_again(x.to(module_again.weight.device, torch.bfloat16))
    assert torch.equal(out.cpu(), out_again.cpu())
    run_flux(reloaded), run_flux(model)
    assert torch.equal(run_flux(reloaded), run_flux(model))


def test_cli_quantize_with_the_policy_file_writes_the_same_outlier_layers(float_model, calibrated, tmp_path):
    policy_path, calibration, model = calibrated
    source = save_checkpoint({k: v.detach().cpu() for k, v in float_model.model.diffusion_model.state_dict().items()},
                             tmp_path / "float.safetensors")
    out = tmp_path / "cli.safetensors"
    env = {**os.environ, "COMFYUI_PATH": str(comfyui_path())}
    run = subprocess.run([sys.executable, "-m", "lowbit", "quantize", str(source), str(out), "--policy",
                          str(policy_path)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "outlier channels to the codec" not in run.stderr, run.stderr  # no "written without them" warning
    written, memory = load_file(out), native_state_dict(model)
    indexed = {k[: -len(OUTLIER_INDEX) - 1] for k in written if k.endswith(OUTLIER_INDEX)}
    assert indexed == set(calibration.outlier_channels())
    for name in indexed:  # the converter and the node path quantize the same weights identically
        for suffix in TENSORS:
            assert torch.equal(written[f"{name}.{suffix}"].view(torch.uint8),
                               memory[f"{name}.{suffix}"].cpu().view(torch.uint8)), (name, suffix)
    reloaded = load_lowbit_diffusion_model(str(out), LoadSettings(mode="native"))
    assert set(_outlier_weights(reloaded)) == indexed
    assert torch.equal(run_flux(reloaded), run_flux(model))


def test_quantize_model_refuses_outlier_channels_for_a_layer_it_does_not_quantize_so(float_model):
    index = torch.arange(16, dtype=torch.int32)
    with pytest.raises(LowBitError, match="outlier_channels are not options"):
        quantize_model(float_model, Policy(mode="int8", preset="flux1"),
                       outlier_channels={"double_blocks.0.img_attn.qkv": index})
    with pytest.raises(LowBitError, match="does not quantize"):
        quantize_model(float_model, Policy(mode="fp8_rowwise", preset="flux1"), outlier_channels={"no.such": index})


def test_apply_policy_drops_outlier_channels_of_layers_not_in_fp8_rowwise_with_a_warning(float_model, caplog):
    """A hand-edited policy that moved a calibrated layer to another format: its channels are not used."""
    from lowbit.nodes.calibrate import apply_policy

    index = torch.arange(16, dtype=torch.int32)
    with caplog.at_level(logging.WARNING):
        model = apply_policy(float_model, Policy(mode="int8", preset="flux1"),
                             outlier_channels={"double_blocks.0.img_attn.qkv": index})
    assert "not quantize as fp8_rowwise" in caplog.text
    assert not [qt for _, _, qt in quantized_layers(model) if getattr(qt._params, "outlier_index", None) is not None]


def test_dynamic_and_stochastic_loras_keep_the_outlier_layers(calibrated):
    """Dynamic mode adds its term on the outlier layer's output (weight untouched); Stochastic mode
    swaps in a merged weight that keeps the layer's index and [N, K + 2r] layout, and detach restores it."""
    from lowbit.lora.attach import DynamicLoras, StochasticMerge
    from lowbit.lora.delta import LowRankDelta

    _, _, model = calibrated
    dm = model.model.diffusion_model
    name, qt = sorted(_outlier_weights(model).items())[0]
    module = dm.get_submodule(name)
    n, k = qt.shape
    g = torch.Generator().manual_seed(3)
    dev = module.weight.device  # the LoRA's tensors live where the model does, as the LoRA nodes put them
    lora = LowRankDelta(down=(torch.randn(4, k, generator=g) * 0.05).to(dev),
                        up=(torch.randn(n, 4, generator=g) * 0.05).to(dev), alpha=4.0, strength=1.0)
    x = torch.randn(5, k, generator=g).to(dev, torch.bfloat16)
    with torch.no_grad():
        base = module(x).float()
    term = x.float() @ lora.down.t() @ lora.up.t()

    dynamic = DynamicLoras(dm, {f"{name}.weight": [("a", lora)]})
    dynamic.attach()
    try:
        with torch.no_grad():
            with_dynamic = module(x).float()
        assert module._parameters["weight"]._qdata is qt._qdata  # the weight is not touched
    finally:
        dynamic.detach()
    assert sqnr_db(base + term, with_dynamic) > 35.0

    stochastic = StochasticMerge(dm, {f"{name}.weight": [("a", lora)]}, seed=7)
    stochastic.attach()
    try:
        merged = module._parameters["weight"]
        assert torch.equal(merged._params.outlier_index.cpu(), qt._params.outlier_index.cpu())
        assert tuple(merged._qdata.shape) == tuple(qt._qdata.shape)
        with torch.no_grad():
            with_merge = module(x).float()
    finally:
        stochastic.detach()
    assert sqnr_db(base + term, with_merge) > 20.0
    assert torch.equal(module._parameters["weight"]._qdata.view(torch.uint8), qt._qdata.view(torch.uint8))


@pytest.mark.parametrize("seed", [0, 7])
def test_a_stock_weight_patch_keeps_the_outlier_channels(calibrated, seed):
    """ComfyUI's own LoRA merge (``set_weight``, standard mode) requantizes the patched weight: an
    fp8_rowwise layer keeps its calibrated outlier channels and its hi+lo split."""
    _, _, model = calibrated
    name, qt = next(iter(_outlier_weights(model).items()))
    module = model.model.diffusion_model.get_submodule(name.removeprefix("diffusion_model."))
    original = qt.dequantize().float()
    delta = 0.01 * original.abs().mean() * torch.randn(original.shape, generator=torch.Generator().manual_seed(3)
                                                       ).to(original.device)
    patched = module.set_weight(original + delta, seed=seed, return_weight=True)
    assert patched._params.outlier_index is not None
    assert torch.equal(patched._params.outlier_index, qt._params.outlier_index)
    assert patched._qdata.shape == qt._qdata.shape
    target = original + delta
    assert sqnr_db(target, patched.dequantize().float()) > 25
    if seed == 0:  # rounded to nearest: the indexed channels carry a second e4m3 term, the others do not
        index = qt._params.outlier_index.long()
        # the fp32 weight the GEMM multiplies: dequantize() rounds to the model's dtype (bf16 on a GPU),
        # whose own error would hide the second term's
        p = patched._params
        err = (dequantize_fp8_rowwise(patched._qdata, p.scale, p.outlier_index) - target).pow(2)
        others = torch.ones(target.shape[1], dtype=torch.bool, device=target.device)
        others[index] = False
        indexed_rel = err[:, index].sum() / target[:, index].pow(2).sum()
        others_rel = err[:, others].sum() / target[:, others].pow(2).sum()
        assert indexed_rel < others_rel / 100, (float(indexed_rel), float(others_rel))
