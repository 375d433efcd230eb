"""LoRA files that only ComfyUI's weight adapters can apply (LoHa, LoKr, full diffs, DoRA) through the LowBit
nodes in real ComfyUI: Dynamic (ComfyUI's bypass forward) and Stochastic (adapter on the dequantized weight,
merged like any delta) must match the float model with the LoRA as closely as the quantized base matches
the float model; stacks mixing them with low-rank LoRAs, or holding a LoRA that matches nothing, must run.
"""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import save_file

from comfy_helpers import require_comfy, run_flux, sqnr_db, tiny_flux_bf16

require_comfy()

from lowbit.nodes.calibrate import apply_policy  # noqa: E402
from lowbit.nodes.lora_nodes import LoraEntry, apply_lora_stack  # noqa: E402
from lowbit.quant.policy import Policy  # noqa: E402

LAYER = "double_blocks.0.img_mlp.0"
PREFIX = f"lora_unet_{LAYER.replace('.', '_')}"
QKV = "lora_unet_double_blocks_0_img_attn_qkv"


def _files(seed: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    weight = tiny_flux_bf16()[f"{LAYER}.weight"].float()
    (n, k), s, gen = weight.shape, float(weight.std()), torch.Generator().manual_seed(seed)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    return {
        "loha": {f"{PREFIX}.hada_w1_a": r(n, 4, scale=0.3), f"{PREFIX}.hada_w1_b": r(4, k, scale=0.3),
                 f"{PREFIX}.hada_w2_a": r(n, 4, scale=0.3), f"{PREFIX}.hada_w2_b": r(4, k, scale=s),
                 f"{PREFIX}.alpha": torch.tensor(4.0)},
        "loha2": {f"{PREFIX}.hada_w1_a": r(n, 4, scale=0.3), f"{PREFIX}.hada_w1_b": r(4, k, scale=0.3),
                  f"{PREFIX}.hada_w2_a": r(n, 4, scale=0.3), f"{PREFIX}.hada_w2_b": r(4, k, scale=s),
                  f"{PREFIX}.alpha": torch.tensor(4.0)},
        "lokr": {f"{PREFIX}.lokr_w1": r(4, 4), f"{PREFIX}.lokr_w2": r(n // 4, k // 4, scale=0.5 * s)},
        "diff": {f"diffusion_model.{LAYER}.diff": r(n, k, scale=0.5 * s),
                 f"diffusion_model.{LAYER}.diff_b": r(n, scale=0.05)},
        "dora": {f"{PREFIX}.lora_down.weight": r(8, k) / k**0.5, f"{PREFIX}.lora_up.weight": r(n, 8, scale=0.5 * s),
                 f"{PREFIX}.dora_scale": weight.norm(dim=1, keepdim=True) * 1.3},
        "lowrank": {f"{QKV}.lora_down.weight": r(8, 256) / 16, f"{QKV}.lora_up.weight": r(768, 8, scale=0.5 * s)},
        "nothing": {"lora_unet_no_such_layer.lora_down.weight": r(8, 256),
                    "lora_unet_no_such_layer.lora_up.weight": r(768, 8)},
    }


@pytest.fixture(scope="module")
def setup(float_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter_loras")
    for name, sd in _files().items():
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}, str(root / f"{name}.safetensors"))
    quantized = apply_policy(float_model, Policy(mode="int8_convrot"))
    base_error = sqnr_db(run_flux(float_model), run_flux(quantized))
    return {"root": root, "float": float_model, "quantized": quantized, "base_error": base_error}


def _entries(setup, names):
    return [LoraEntry(n, str(setup["root"] / f"{n}.safetensors"), 1.0) for n in names]


def _reference(setup, names):
    """The float model with the LoRAs, patched by ComfyUI itself, and how much the LoRAs change it."""
    reference = run_flux(apply_lora_stack(setup["float"], _entries(setup, names), "standard")[0])
    return reference, sqnr_db(reference, run_flux(setup["float"]))


@pytest.mark.parametrize("names", [("loha",), ("lokr",), ("diff",), ("loha", "loha2"), ("lowrank", "loha", "nothing")])
@pytest.mark.parametrize("mode", ["dynamic", "stochastic"])
def test_adapter_loras_match_the_float_model_with_the_lora(setup, mode, names):
    """Measured (CPU): the quantized base is 31.2 dB from the float model; with the LoRAs (which change it by
    15-28 dB) both modes stay 30.1-32.6 dB from the float model with them. Two LoHa on one layer must both
    count (ComfyUI's bypass manager keeps one adapter per module; keeping only the last gives 26.0 dB)."""
    reference, effect = _reference(setup, names)
    out = run_flux(apply_lora_stack(setup["quantized"], _entries(setup, names), mode, seed=1)[0])
    assert effect < setup["base_error"] - 3  # the LoRA changes the output more than quantization does
    assert sqnr_db(reference, out) > setup["base_error"] - 1.5, (mode, names, sqnr_db(reference, out))


def test_dynamic_runs_a_stack_whose_loras_match_nothing(setup):
    base = run_flux(setup["quantized"])
    out = run_flux(apply_lora_stack(setup["quantized"], _entries(setup, ["nothing"]), "dynamic")[0])
    assert torch.equal(out, base)


def test_dynamic_dora_warns_that_its_magnitude_is_not_applied(setup, caplog):
    with caplog.at_level(logging.WARNING, logger="lowbit.nodes.lora_nodes"):
        apply_lora_stack(setup["quantized"], _entries(setup, ["dora"]), "dynamic")
    assert "DoRA" in caplog.text and "use stochastic or standard" in caplog.text
