"""LowBit's nodes on a second architecture: a tiny SD3 (MMDiT) model in a real ComfyUI server (Show 2).

The model is built from ComfyUI's MMDiT key layout (``e2e_models.sd3_shapes``), detected by stock
``UNETLoader`` as SD3, and quantized under LowBit's ``sd3`` preset.
"""

from __future__ import annotations

import pytest
import torch

import e2e_workflows as wf
from e2e_checks import (dequantized_weights, planned_formats, report_formats, saved_latent, saved_model_path,
                        sqnr_db)
from e2e_models import TinySD3Config, tiny_sd3, write_safetensors

SD3 = "tiny_sd3.safetensors"
CONFIG = TinySD3Config()
# measured (CPU): int8_convrot 44.7 dB, fp8_rowwise 33.5 dB against the float model; 6-7 dB of margin
MIN_LATENT_SQNR = {"int8_convrot": 38.0, "fp8_rowwise": 27.0}


def _conditioning(g):
    return wf.sd3_conditioning(g, CONFIG.context_width, CONFIG.pooled_width)


def _latent(server, build_model, prefix):
    g = wf.Graph()
    out = wf.sample_and_save(g, build_model(g), _conditioning(g), prefix)
    result = server.run_ok(g.api())
    return saved_latent(server, result, out.id)


@pytest.fixture(scope="module")
def sd3(comfy_server):
    state_dict = tiny_sd3(CONFIG)
    write_safetensors(state_dict, comfy_server.diffusion_models_dir / SD3)
    reference = _latent(comfy_server, lambda g: wf.unet_loader(g, SD3), "sd3_float")
    return {"state_dict": state_dict, "reference": reference}


def test_stock_loader_detects_the_tiny_sd3(comfy_server, sd3):
    assert "model_type FLOW" in comfy_server.log_text()
    assert "Requested to load SD3" in comfy_server.log_text()


def test_quantize_model_int8_convrot(comfy_server, sd3):
    g = wf.Graph()
    model = wf.quantize(g, wf.unet_loader(g, SD3), "int8_convrot")
    out = wf.sample_and_save(g, model, _conditioning(g), "sd3_int8_convrot")
    rep = wf.report(g, model)
    result = comfy_server.run_ok(g.api())
    latent = saved_latent(comfy_server, result, out.id)
    assert not torch.equal(latent, sd3["reference"])
    assert sqnr_db(sd3["reference"], latent) > MIN_LATENT_SQNR["int8_convrot"]
    report = result.outputs[rep.id]["text"][0]
    assert report_formats(report) == planned_formats(sd3["state_dict"], "int8_convrot"), report
    assert "x_embedder" not in report and "context_embedder" not in report, "the sd3 preset keeps these float"


def test_lowbit_loader_fp8_rowwise(comfy_server, sd3):
    latent = _latent(comfy_server, lambda g: wf.lowbit_loader(g, SD3, "fp8_rowwise"), "sd3_loader_fp8")
    assert not torch.equal(latent, sd3["reference"])
    assert sqnr_db(sd3["reference"], latent) > MIN_LATENT_SQNR["fp8_rowwise"]


def test_save_then_stock_loader_matches_in_memory(comfy_server, sd3):
    g = wf.Graph()
    model = wf.quantize(g, wf.unet_loader(g, SD3), "int8_convrot")
    in_memory = wf.sample_and_save(g, model, _conditioning(g), "sd3_in_memory")
    save = wf.save_quantized(g, model, "tiny_sd3_int8_convrot")
    result = comfy_server.run_ok(g.api())
    path = saved_model_path(comfy_server, result, save.id)
    weights = dequantized_weights(path)
    base = sd3["state_dict"]
    for layer, (fmt, weight) in weights.items():
        assert fmt in ("int8_convrot", "int8"), (layer, fmt)
        assert sqnr_db(base[f"{layer}.weight"].float(), weight) > 30.0, layer

    disk = _latent(comfy_server, lambda g2: wf.unet_loader(g2, path.name), "sd3_from_disk")
    native = _latent(comfy_server, lambda g2: wf.lowbit_loader(g2, path.name, "native"), "sd3_native")
    assert torch.equal(disk, native), "stock UNETLoader and LowBit's loader sample the saved file differently"
    # in memory vs loaded: same weights, float layers run by different ComfyUI op classes (see the Flux test)
    assert sqnr_db(saved_latent(comfy_server, result, in_memory.id), disk) > 45.0
