"""ComfyUI's own LoRA patching ("standard" mode) of a smoothed LowBit layer under Dynamic VRAM, on the CPU.

A layer with a ``pre_quant_scale`` ``s`` stores ``W diag(1 / s)``; a LoRA's delta is in ``W``'s space, so a
patch must be applied to ``stored * s`` and divided back (nodes/comfy_ops.py). Under Dynamic VRAM ComfyUI
does not patch through ``convert_weight``/``set_weight`` nor ``weight_function``: ``ModelPatcherDynamic.load``
leaves a ``LowVramPatch`` in the module's ``weight_lowvram_function`` and the vbar cast
(``resolve_cast_module_with_vbar``) runs it on the streamed, dequantized stored weight, then requantizes
(``want_requant``). The bug this file guards against: that patch landing in the stored (smoothed) space,
``stored + delta`` instead of ``stored + delta diag(1 / s)`` (the H200 run's 25.1 dB Dynamic-vs-Standard
agreement in tests/comfy/test_lora_pre_quant_scale.py, 30.3 needed). The layer's own forward is run, up
up to its cast (the rest would run on the GPU); comfy-aimdo is faked as in tests/lora_dvram_helpers.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent / "comfy"))
from comfy_helpers import load_stock, require_comfy, sqnr_db, tiny_flux_bf16  # noqa: E402

require_comfy()

import comfy.model_patcher  # noqa: E402
import comfy.ops  # noqa: E402
from lora_dvram_helpers import CAST_DEVICE, LOAD_DEVICE, DynamicPatcher, fake_aimdo, module_at  # noqa: E402, F401
from lora_dvram_helpers import release, switch_to  # noqa: E402

from lowbit.nodes.calibrate import apply_policy  # noqa: E402
from lowbit.nodes.comfy_ops import PRE_QUANT_SCALE  # noqa: E402
from lowbit.nodes.lora_nodes import LoraEntry, apply_lora_stack  # noqa: E402
from lowbit.quant.policy import Policy  # noqa: E402

LAYERS = ("double_blocks.0.img_mlp.0", "double_blocks.0.img_attn.qkv")
RANK, STRENGTH = 8, 1.0


@pytest.fixture
def smoothed(fake_aimdo):  # noqa: F811 (the imported fixture)
    """A Dynamic-VRAM patcher of the tiny Flux in int8_quarot, ``LAYERS`` smoothed with scales ~0.2..5."""
    gen = torch.Generator().manual_seed(3)
    model = load_stock(tiny_flux_bf16())
    dm = model.model.diffusion_model
    scales = {name: torch.exp(0.5 * torch.randn(dm.get_submodule(name).in_features, generator=gen)).bfloat16()
              for name in LAYERS}
    quantized = apply_policy(model, Policy(mode="int8_quarot"), pre_quant_scales=scales)
    patcher = DynamicPatcher(quantized.model, LOAD_DEVICE, torch.device("cpu"), size=quantized.model_size())
    yield patcher
    release(patcher)


def _lora(tmp_path) -> tuple[list[LoraEntry], dict[str, torch.Tensor]]:
    """A kohya LoRA on ``LAYERS`` whose delta is as large as the weight (rounding noise far below it)."""
    sd, gen, out, deltas = tiny_flux_bf16(), torch.Generator().manual_seed(0), {}, {}
    for layer in LAYERS:
        weight = sd[f"{layer}.weight"].float()
        (n, k), prefix = weight.shape, f"lora_unet_{layer.replace('.', '_')}"
        down = (torch.randn(RANK, k, generator=gen) / k**0.5).bfloat16()
        up = (torch.randn(n, RANK, generator=gen) * float(weight.std())).bfloat16()
        out.update({f"{prefix}.lora_down.weight": down, f"{prefix}.lora_up.weight": up,
                    f"{prefix}.alpha": torch.tensor(float(RANK))})
        deltas[layer] = STRENGTH * up.float() @ down.float()
    path = tmp_path / "lora.safetensors"
    save_file(out, str(path))
    return [LoraEntry("lora", str(path), STRENGTH)], deltas


class _CastDone(Exception):
    """Stops the layer's forward once ComfyUI's cast returned: the rest would run on the GPU."""


def _forward_weight(patcher, layer, monkeypatch) -> torch.Tensor:
    """The weight the layer's own forward gets from ComfyUI's vbar cast, dequantized (the stored space).

    The forward runs for ``meta`` input up to its cast. A pending patch's factors are read where they are
    (``LowVramPatch.memory_required`` 0): ComfyUI would stage them in a cast buffer on the device, which
    for ``meta`` holds no data; the patch math is the same."""
    module, seen, real_cast = module_at(patcher, layer), [], comfy.ops.cast_bias_weight

    def recording_cast(s, *args, **kwargs):
        weight, bias, stream = real_cast(s, *args, **kwargs)
        seen.append(weight.dequantize().float().clone())
        comfy.ops.uncast_bias_weight(s, weight, bias, stream)
        raise _CastDone

    with monkeypatch.context() as patch:
        patch.setattr(comfy.ops, "cast_bias_weight", recording_cast)
        patch.setattr(comfy.model_patcher.LowVramPatch, "memory_required", lambda self: 0)
        with pytest.raises(_CastDone):
            module(torch.randn(2, module.in_features, dtype=torch.bfloat16, device=CAST_DEVICE))
    assert hasattr(module, "_v") and len(seen) == 1, "the vbar cast did not run; the test would not test it"
    return seen[0]


def test_standard_patches_land_in_the_original_space_under_dynamic_vram(smoothed, tmp_path, monkeypatch):
    """The patched weight the vbar cast streams is ``stored + delta diag(1 / s)``, up to one rounding.

    Measured (CPU, int8_quarot): the change agrees with ``delta / s`` to 25.0-26.3 dB (the requantization's
    rounding) and with ``delta`` to 5.1-5.4; patched in the stored space (before the fix) 7.2 and 24.6 dB."""
    entries, deltas = _lora(tmp_path)
    switch_to(smoothed)
    base = {layer: _forward_weight(smoothed, layer, monkeypatch) for layer in LAYERS}
    patched, _ = apply_lora_stack(smoothed, entries, "standard")
    switch_to(patched, smoothed)
    for layer in LAYERS:
        module = module_at(patched, layer)
        assert module.__dict__.get("weight_lowvram_function") is not None, "not patched through the vbar path"
        scale = module._parameters[PRE_QUANT_SCALE].float()
        change = _forward_weight(patched, layer, monkeypatch) - base[layer]
        expected, stored_space = deltas[layer] / scale, deltas[layer]
        right, wrong = sqnr_db(expected, change), sqnr_db(stored_space, change)
        assert sqnr_db(expected, stored_space) < 10, "the scales barely smooth; the test would not test it"
        assert right > 20 and right > wrong + 10, (layer, right, wrong)
