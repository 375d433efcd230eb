"""Issue "nodes" Show 1c in-process: a model quantized in memory and the file Save Quantized Model
writes from it sample the same latents (KSampler): LowBit's loader on the file bit for bit, on every
device; stock ComfyUI's UNETLoader bit for bit on the CPU, and on CUDA (comfy-kitchen's kernels, not
LowBit's) within ``comfy_helpers.CUDA_STOCK_AGREEMENT_DB``."""

from __future__ import annotations

import functools

import pytest
import torch
from safetensors.torch import save_file

from comfy_helpers import assert_matches_stock, comfy_nodes, require_comfy, tiny_flux_bf16

require_comfy()

from lowbit.nodes.loader import LowBitLoadDiffusionModel  # noqa: E402
from lowbit.nodes.model_quant import native_state_dict  # noqa: E402
from lowbit.nodes.quantize import LowBitQuantizeModel  # noqa: E402
from lowbit.nodes.save import write_checkpoint  # noqa: E402

nodes = comfy_nodes()  # ComfyUI's nodes.py, not this repository's nodes/ package


def _sample(model, seed: int = 0) -> torch.Tensor:
    latent = {"samples": torch.zeros(1, 16, 8, 8)}
    context = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(1 + 2 * seed))
    cond = [[context, {"pooled_output": torch.randn(1, 32, generator=torch.Generator().manual_seed(2 + 2 * seed))}]]
    return nodes.common_ksampler(model, 42 + seed, 2, 1.0, "euler", "simple", cond, cond, latent)[0]["samples"]


def _sampler(model, latents_0: torch.Tensor):
    """``seed -> _sample(model, seed)``, giving ``latents_0`` for seed 0 (already sampled)."""
    return lambda seed: latents_0 if seed == 0 else _sample(model, seed)


@pytest.mark.parametrize("mode", ["int8_convrot", "int8", "fp8_rowwise"])
def test_saved_file_samples_the_in_memory_latents(models_dir, mode):
    save_file(tiny_flux_bf16(), str(models_dir / "tiny_flux_bf16.safetensors"))
    float_model = nodes.UNETLoader().load_unet("tiny_flux_bf16.safetensors", "default")[0]
    quantized = LowBitQuantizeModel.execute(model=float_model, mode=mode).result[0]
    in_memory = _sample(quantized)
    float_latents = _sample(float_model)
    assert not torch.equal(in_memory, float_latents), "the quantized model must differ from the float one"

    write_checkpoint(native_state_dict(quantized), str(models_dir / "saved.safetensors"), None)
    reloaded = LowBitLoadDiffusionModel.execute(unet_name="saved.safetensors", mode="native").result[0]
    assert torch.equal(in_memory, _sample(reloaded)), "LowBit's loader runs the saved file as the in-memory model"
    if mode != "fp8_rowwise":  # a LowBit-only format: stock UNETLoader cannot read it
        stock = nodes.UNETLoader().load_unet("saved.safetensors", "default")[0]
        assert_matches_stock(mode, functools.partial(_sample, stock), _sampler(quantized, in_memory),
                             _sampler(float_model, float_latents), what="latents")


def test_saved_metadata_records_the_policy_even_without_workflow_metadata(models_dir):
    import json

    from lowbit.nodes.save import checkpoint_metadata

    save_file(tiny_flux_bf16(), str(models_dir / "tiny_flux_bf16.safetensors"))
    float_model = nodes.UNETLoader().load_unet("tiny_flux_bf16.safetensors", "default")[0]
    quantized = LowBitQuantizeModel.execute(model=float_model, mode="int4_mixed").result[0]
    metadata = checkpoint_metadata(quantized, None)  # --disable-metadata: no workflow, still the policy
    assert json.loads(metadata["lowbit_policy"])["mode"] == "int4_mixed"
    assert json.loads(metadata["lowbit_plan"])["layers"]["w4a4"] > 0
    assert "prompt" not in metadata
    with_workflow = checkpoint_metadata(quantized, {"prompt": "{}"})
    assert with_workflow["prompt"] == "{}" and "lowbit_policy" in with_workflow
    assert checkpoint_metadata(float_model, {"prompt": "{}"}) == {"prompt": "{}"}
