"""LowBit's nodes in a real ComfyUI server, on a tiny Flux model (issue "nodes", Show 1).

Every workflow goes in through ``POST /prompt`` and comes back from ``GET /history``; latents are
read from what stock ``SaveLatent`` wrote. The float (bf16) model sampled with the same seed is the
reference each quantized run is measured against.
"""

from __future__ import annotations

import json

import pytest
import torch

import e2e_workflows as wf
from e2e_checks import (dequantized_weights, file_metadata, planned_formats, report_formats, saved_latent,
                        saved_model_path, sqnr_db, workflow_from_metadata)
from e2e_models import bake_lora, lora_delta, lora_layers, tiny_flux, tiny_lora, write_safetensors

FLUX = "tiny_flux.safetensors"
LORA = "tiny_flux_lora.safetensors"
NOT_A_MODEL = "not_a_diffusion_model.safetensors"
#: layers the test LoRA touches: both streams of a double block and a single block
LORA_TARGETS = ("double_blocks.0.img_attn.qkv", "double_blocks.0.txt_mlp.0", "single_blocks.0.linear1")

# Latent SQNR floors against the float model after 2 sampling steps. Measured on this model (CPU):
# int8_convrot 42.2 dB, fp8_rowwise 32.7 dB, w4a8 22.0 dB; the floors leave 6-7 dB of margin.
MIN_LATENT_SQNR = {"int8_convrot": 35.0, "fp8_rowwise": 26.0, "w4a8": 16.0}


@pytest.fixture(scope="module")
def flux(comfy_server):
    """Model files in the server's folders, and the float model's reference latent."""
    state_dict = tiny_flux()
    write_safetensors(state_dict, comfy_server.diffusion_models_dir / FLUX)
    lora = tiny_lora(state_dict, LORA_TARGETS, scale=0.5)
    write_safetensors(lora, comfy_server.loras_dir / LORA)
    write_safetensors({"text_model.embeddings.weight": torch.randn(64, 32).to(torch.bfloat16)},
                      comfy_server.diffusion_models_dir / NOT_A_MODEL)
    g = wf.Graph()
    out = wf.sample_and_save(g, wf.unet_loader(g, FLUX), wf.flux_conditioning(g), "float")
    reference = saved_latent(comfy_server, comfy_server.run_ok(g.api()), out.id)
    return {"state_dict": state_dict, "lora": lora, "reference": reference}


def _quantized_latent(server, model_builder, prefix):
    g = wf.Graph()
    out = wf.sample_and_save(g, model_builder(g), wf.flux_conditioning(g), prefix)
    return saved_latent(server, server.run_ok(g.api()), out.id)


def lowbit_node_names() -> list[str]:
    """The node classes ``nodes/__init__.py`` registers (read from its ``NODE_MODULES`` without importing
    it: importing needs ComfyUI's ``comfy_api``, which lives in the server, not in this process)."""
    import ast
    from pathlib import Path

    source = (Path(__file__).resolve().parents[2] / "nodes" / "__init__.py").read_text(encoding="utf-8")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "NODE_MODULES":
            return [name for names in ast.literal_eval(node.value).values() for name in names]
    raise AssertionError("NODE_MODULES not found in nodes/__init__.py")


def test_object_info_lists_every_lowbit_node_with_tooltips(comfy_server):
    info = comfy_server.object_info()
    expected = lowbit_node_names()
    assert len(expected) >= 4
    missing = [name for name in expected if name not in info]
    assert not missing, f"LowBit nodes missing from /object_info: {missing}\n{comfy_server.log_tail(80)}"
    problems = []
    for name in expected:
        node = info[name]
        if not node["category"].startswith("LowBit"):
            problems.append(f"{name}: category {node['category']!r}")
        if "(LowBit)" not in (node.get("display_name") or ""):
            problems.append(f"{name}: display name {node.get('display_name')!r} lacks '(LowBit)'")
        if not node.get("description"):
            problems.append(f"{name}: no description")
        inputs = {**node["input"].get("required", {}), **node["input"].get("optional", {})}
        if not inputs:
            problems.append(f"{name}: no inputs")
        for input_name, spec in inputs.items():
            options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            if spec[0] == "COMFY_AUTOGROW_V3":  # a growing group of slots, not an input of its own
                continue
            if not options.get("tooltip"):
                problems.append(f"{name}.{input_name}: no tooltip")
    assert not problems, "\n".join(problems)


def test_quantize_model_int8_convrot_samples_close_to_float(comfy_server, flux):
    """(a) UNETLoader (bf16) -> Quantize Model (LowBit, int8_convrot) -> KSampler -> SaveLatent."""
    g = wf.Graph()
    model = wf.quantize(g, wf.unet_loader(g, FLUX), "int8_convrot")
    out = wf.sample_and_save(g, model, wf.flux_conditioning(g), "int8_convrot")
    rep = wf.report(g, model, measure_error=True)
    result = comfy_server.run_ok(g.api())
    latent = saved_latent(comfy_server, result, out.id)
    reference = flux["reference"]
    assert latent.shape == reference.shape
    assert not torch.equal(latent, reference), "the quantized model sampled exactly like the float one"
    assert sqnr_db(reference, latent) > MIN_LATENT_SQNR["int8_convrot"]
    report = result.outputs[rep.id]["text"][0]
    assert report_formats(report) == planned_formats(flux["state_dict"], "int8_convrot"), report
    assert "SQNR dB" in report and "largest relative output error" in report, report


def test_attention_backend_node_runs_in_sampling(comfy_server, flux):
    """UNETLoader -> Attention Backend (LowBit) -> KSampler. ``math`` (exact SDPA) samples like ComfyUI's own
    attention; ``cudnn``, which the CPU cannot run, falls back to it with a warning and the same latent."""
    reference = flux["reference"]
    latent = _quantized_latent(comfy_server, lambda g: wf.attention_backend(g, wf.unet_loader(g, FLUX), "math"),
                               "attention_math")
    assert sqnr_db(reference, latent) > 40
    latent = _quantized_latent(comfy_server, lambda g: wf.attention_backend(g, wf.unet_loader(g, FLUX), "cudnn"),
                               "attention_cudnn")
    assert torch.equal(latent, reference)
    assert "cudnn cannot run this call" in comfy_server.log_tail(400)


def test_kernel_tuner_passes_the_model_through_and_lists_its_shapes(comfy_server, flux):
    """UNETLoader -> Quantize Model (int8_convrot) -> Kernel Tuner (LowBit) -> KSampler: the latent is
    the one the quantized model samples without the tuner, and the tuner's panel lists each distinct
    (format, N x K) of the quantized layers (on the CPU nothing is measured, and it says so)."""
    plain = _quantized_latent(comfy_server, lambda g: wf.quantize(g, wf.unet_loader(g, FLUX), "int8_convrot"),
                              "tuner_without")
    g = wf.Graph()
    tuner = wf.kernel_tuner(g, wf.quantize(g, wf.unet_loader(g, FLUX), "int8_convrot"), tokens="16, 40")
    out = wf.sample_and_save(g, tuner.out(0), wf.flux_conditioning(g), "tuner_with")
    result = comfy_server.run_ok(g.api())
    assert torch.equal(saved_latent(comfy_server, result, out.id), plain)
    table = result.outputs[tuner.id]["text"][0]
    assert "Nothing is measured off a CUDA GPU" in table and "kernel_dispatch.json" in table, table
    rows = [line for line in table.splitlines() if line.startswith("| int8")]
    assert rows and all(" 16 (16) |" in row or " 40 (64) |" in row for row in rows), table
    assert len(rows) % 2 == 0, table  # each shape at both token counts


@pytest.mark.parametrize("mode", ["w4a8", "fp8_rowwise"])
def test_lowbit_loader_quantizes_on_the_fly(comfy_server, flux, mode):
    """(b) Load Diffusion Model (LowBit) quantizing a bf16 file while loading -> KSampler."""
    latent = _quantized_latent(comfy_server, lambda g: wf.lowbit_loader(g, FLUX, mode), f"loader_{mode}")
    reference = flux["reference"]
    assert not torch.equal(latent, reference)
    assert sqnr_db(reference, latent) > MIN_LATENT_SQNR[mode]


def _digest(result, node) -> dict:
    return json.loads(result.outputs[node.id]["text"][0])


def test_saved_model_loads_in_stock_unet_loader_with_identical_latents(comfy_server, flux):
    """(c) Quantize -> Save Quantized Model; stock UNETLoader loads the file and samples the same latents.

    The saved file holds exactly the in-memory weights, and the in-memory model, stock ComfyUI and
    LowBit's loader all sample bit-identical latents. On the CPU stock ComfyUI computes with views
    into the memory-mapped file, so this holds only because the writer puts tensor data at 64-byte
    file offsets (the CPU allocator's alignment): a single-token matmul on an 8-aligned float weight
    rounds differently (~1e-7 relative), which INT8 activation rounding amplified to a latent SQNR of
    135.6 dB on this model (about 53 dB in earlier runs) instead of bit equality.
    """
    g = wf.Graph()
    model = wf.quantize(g, wf.unet_loader(g, FLUX), "int8_convrot")
    in_memory = wf.sample_and_save(g, model, wf.flux_conditioning(g), "in_memory")
    memory_digest = g.add("LowBitTestModelDigest", model=model, flux_forward=True)
    save = wf.save_quantized(g, model, "tiny_flux_int8_convrot")
    workflow_marker = {"nodes": [], "links": [], "lowbit_test": "c"}
    result = comfy_server.run_ok(g.api(), extra_pnginfo={"workflow": workflow_marker})
    path = saved_model_path(comfy_server, result, save.id)
    assert path.name.startswith("tiny_flux_int8_convrot_") and path.name.endswith("_.safetensors")

    prompt, workflow = workflow_from_metadata(file_metadata(path))
    assert prompt[save.id]["class_type"] == "LowBitSaveQuantizedModel"
    assert workflow == workflow_marker
    weights = dequantized_weights(path)
    assert weights and {fmt for fmt, _ in weights.values()} <= {"int8_convrot", "int8"}

    g2 = wf.Graph()
    stock_model = wf.unet_loader(g2, path.name)
    from_disk = wf.sample_and_save(g2, stock_model, wf.flux_conditioning(g2), "from_disk")
    disk_digest = g2.add("LowBitTestModelDigest", model=stock_model, flux_forward=True)
    lowbit = wf.sample_and_save(g2, wf.lowbit_loader(g2, path.name, "native"), wf.flux_conditioning(g2), "lowbit_native")
    result2 = comfy_server.run_ok(g2.api())

    memory, disk = _digest(result, memory_digest), _digest(result2, disk_digest)
    assert memory["weights"] == disk["weights"], "the file does not hold the in-memory weights"
    disk_latent = saved_latent(comfy_server, result2, from_disk.id)
    assert torch.equal(disk_latent, saved_latent(comfy_server, result2, lowbit.id)), \
        "stock UNETLoader and LowBit's loader sample the saved file differently"
    memory_latent = saved_latent(comfy_server, result, in_memory.id)
    assert torch.equal(memory_latent, disk_latent), \
        f"in-memory and reloaded latents differ: {sqnr_db(memory_latent, disk_latent):.1f} dB"
    forward_memory, forward_disk = torch.tensor(memory["forward"]), torch.tensor(disk["forward"])
    assert torch.equal(forward_memory, forward_disk), \
        f"in-memory and reloaded forward differ: {sqnr_db(forward_memory, forward_disk):.1f} dB"

    # saving again never overwrites: the counter moves on
    second = saved_model_path(comfy_server, comfy_server.run_ok(g.api()), save.id)
    assert second != path and path.is_file()


def test_lora_before_quantize_is_baked_once(comfy_server, flux):
    """(d) LoraLoaderModelOnly -> Quantize Model: the LoRA is in the quantized weights exactly once."""
    strength = 1.0
    g = wf.Graph()
    lora_model = g.add("LoraLoaderModelOnly", model=wf.unet_loader(g, FLUX), lora_name=LORA,
                       strength_model=strength).out()
    model = wf.quantize(g, lora_model, "int8_convrot")
    out = wf.sample_and_save(g, model, wf.flux_conditioning(g), "lora_int8")
    save = wf.save_quantized(g, model, "tiny_flux_lora_int8")
    result = comfy_server.run_ok(g.api())

    # weights: each LoRA layer holds quantize(W + delta), not quantize(W) nor quantize(W + 2 delta)
    weights = dequantized_weights(saved_model_path(comfy_server, result, save.id))
    base, lora = flux["state_dict"], flux["lora"]
    for layer in lora_layers(lora):
        w = base[f"{layer}.weight"].float()
        delta = lora_delta(lora, layer, strength)
        _, stored = weights[layer]
        once, none, twice = sqnr_db(w + delta, stored), sqnr_db(w, stored), sqnr_db(w + 2 * delta, stored)
        assert once > 30.0, f"{layer}: stored weight is not W + delta ({once:.1f} dB)"
        assert once > none + 10 and once > twice + 10, (layer, once, none, twice)

    # outputs: the LoRA changes the latent, and matches the LoRA merged into the file by hand
    latent = saved_latent(comfy_server, result, out.id)
    write_safetensors(bake_lora(base, lora, strength), comfy_server.diffusion_models_dir / "tiny_flux_baked.safetensors")
    expected = _quantized_latent(
        comfy_server, lambda g: wf.quantize(g, wf.unet_loader(g, "tiny_flux_baked.safetensors"), "int8_convrot"),
        "baked_int8")
    without = _quantized_latent(comfy_server, lambda g: wf.quantize(g, wf.unet_loader(g, FLUX), "int8_convrot"),
                                "no_lora_int8")
    assert sqnr_db(expected, latent) > sqnr_db(without, latent) + 10, "the LoRA's effect is not in the output"
    assert sqnr_db(expected, latent) > 30.0


def test_save_refuses_a_lora_applied_after_quantization(comfy_server, flux):
    g = wf.Graph()
    model = wf.quantize(g, wf.unet_loader(g, FLUX), "int8_convrot")
    patched = g.add("LoraLoaderModelOnly", model=model, lora_name=LORA, strength_model=1.0).out()
    wf.save_quantized(g, patched, "must_not_exist")
    result = comfy_server.run(g.api())
    assert result.status == "error"
    err = result.execution_error
    assert err["node_type"] == "LowBitSaveQuantizedModel"
    message = err["exception_message"]
    assert "pending weight patch" in message and "before* Quantize Model (LowBit)" in message, message
    assert not list((comfy_server.output_dir / "diffusion_models").glob("must_not_exist*"))


@pytest.mark.parametrize("lora_mode", ["dynamic", "stochastic"])
def test_save_refuses_a_lowbit_lora_applied_at_load_time(comfy_server, flux, lora_mode):
    """LowBit's LoRA modes attach as patcher injections: saving would silently drop the LoRA."""
    g = wf.Graph()
    model = wf.quantize(g, wf.unet_loader(g, FLUX), "int8_convrot")
    patched = g.add("LowBitLoadLora", model=model, lora_name=LORA, strength=1.0, mode=lora_mode).out()
    wf.save_quantized(g, patched, f"must_not_exist_{lora_mode}")
    result = comfy_server.run(g.api())
    assert result.status == "error", result.error_text()
    err = result.execution_error
    assert err["node_type"] == "LowBitSaveQuantizedModel"
    assert "injections" in err["exception_message"], err["exception_message"]
    assert not list((comfy_server.output_dir / "diffusion_models").glob("must_not_exist*"))


def _assert_serving(server):
    g = wf.Graph()
    wf.sample_and_save(g, wf.unet_loader(g, FLUX), wf.flux_conditioning(g), "still_serving")
    server.run_ok(g.api())


def test_missing_file_is_a_readable_validation_error(comfy_server, flux):
    """(e) a model file that does not exist: POST /prompt refuses it, naming the node and the input."""
    g = wf.Graph()
    wf.sample_and_save(g, wf.lowbit_loader(g, "no_such_model.safetensors", "int8_convrot"),
                       wf.flux_conditioning(g), "missing")
    result = comfy_server.run(g.api())
    assert result.status == "rejected"
    errors = result.rejection["node_errors"]
    assert any(e["class_type"] == "LowBitLoadDiffusionModel" and "no_such_model" in json_text(e)
               for e in errors.values()), result.rejection
    _assert_serving(comfy_server)


def test_non_diffusion_file_fails_with_a_node_error(comfy_server, flux):
    """(e) a safetensors file that is not a diffusion model: the loader node fails readably."""
    g = wf.Graph()
    wf.sample_and_save(g, wf.lowbit_loader(g, NOT_A_MODEL, "int8_convrot"), wf.flux_conditioning(g), "not_model")
    result = comfy_server.run(g.api())
    assert result.status == "error"
    err = result.execution_error
    assert err["node_type"] == "LowBitLoadDiffusionModel"
    assert NOT_A_MODEL in err["exception_message"] or "diffusion model" in err["exception_message"].lower(), err
    _assert_serving(comfy_server)


def test_model_without_quantizable_layers_fails_with_a_node_error(comfy_server, flux):
    """(e) quantizing (enable=always) a model with nothing left to quantize (already quantized) fails readably."""
    g = wf.Graph()
    once = wf.quantize(g, wf.unet_loader(g, FLUX), "int8_convrot")
    twice = wf.quantize(g, once, "int8_convrot", enable="always")
    wf.sample_and_save(g, twice, wf.flux_conditioning(g), "twice")
    result = comfy_server.run(g.api())
    assert result.status == "error", "quantizing an already quantized model should fail, not pass silently"
    err = result.execution_error
    assert err["node_type"] == "LowBitQuantizeModel"
    assert "quantiz" in err["exception_message"].lower(), err
    _assert_serving(comfy_server)


def json_text(value) -> str:
    return json.dumps(value)
