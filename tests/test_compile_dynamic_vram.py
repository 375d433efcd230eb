"""The Compile node's way out of Dynamic VRAM keeps every LoRA mode, on a machine without a GPU.

Under Dynamic VRAM the node hands the compiler a regular ModelPatcher over a *new* module tree
(``nodes.compile.non_dynamic_copy``; stock's rebuild from the file is another new tree). A LowBit LoRA
stack is an injection whose appliers hold the module tree it was applied to (Dynamic banks hook
``DynamicLoras.root``'s layers, merges swap weights under ``StochasticMerge.root``, bypass hooks hold
one module each): carried over as is, the copy injected the LoRA into the Dynamic VRAM model's
modules and ran without it (an H200 run: compiled output = the no-LoRA output). These tests run
ComfyUI's real ``ModelPatcherDynamic`` with comfy-aimdo's allocator faked
(``tests/lora_dvram_helpers.py``), demote a LoRA'd clone of it and compare the demoted model
with the same quantized model, never under Dynamic VRAM, with the same stack.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "comfy"))
from comfy_helpers import load_stock, require_comfy, run_flux, sqnr_db, tiny_flux_bf16  # noqa: E402

require_comfy()

import comfy.cli_args  # noqa: E402
import comfy.model_patcher  # noqa: E402
import comfy.utils  # noqa: E402

from lora_dvram_helpers import LOAD_DEVICE, DynamicPatcher as _DynamicPatcher, adapter_lora_files, fake_aimdo  # noqa: E402, F401
from lowbit.nodes.calibrate import apply_policy  # noqa: E402
from lowbit.nodes.compile import demoted_clone, rebind_lora_injections  # noqa: E402
from lowbit.nodes.lora_nodes import INJECTION_KEY, apply_lora_stack  # noqa: E402
from lowbit.quant.policy import Policy  # noqa: E402

POLICY = Policy(mode="int8_convrot")
LAYER = "double_blocks.0.img_mlp.0"


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory):
    """A plain LoRA, a LoHa (ComfyUI's bypass in dynamic mode) and a DoRA (merged in dynamic mode) on LAYER."""
    weight = tiny_flux_bf16()[f"{LAYER}.weight"].float()
    return adapter_lora_files(tmp_path_factory.mktemp("compile_dvram_loras"), weight, LAYER)


def _module(patcher, layer):
    return comfy.utils.get_attr(patcher.model, f"diffusion_model.{layer}")


def quantized():
    return apply_policy(load_stock(tiny_flux_bf16()), POLICY)


@pytest.fixture(scope="module")
def reference():
    """The quantized tiny Flux under a regular ModelPatcher (what the compiled branch must equal)."""
    return quantized()


@pytest.fixture
def dynamic(fake_aimdo):  # noqa: F811 (the imported fixture)
    """A Dynamic VRAM patcher of its own quantized tiny Flux (same weights: quantizing is deterministic)."""
    model = quantized()
    patcher = _DynamicPatcher(model.model, LOAD_DEVICE, torch.device("cpu"), size=model.model_size())
    yield patcher
    patcher.model.dynamic_patchers.clear()


def _demoted(patcher):
    """Load ``patcher`` the way Dynamic VRAM does (its modules gather vbar state, its stack is injected),
    unload it as the model manager does, then take the Compile node's way out of Dynamic VRAM."""
    patcher.partially_load(LOAD_DEVICE, 1e32)
    assert hasattr(_module(patcher, LAYER), "_v"), "not streamed through the vbar; the test would not test it"
    patcher.detach(unpatch_all=False)
    demoted = demoted_clone(patcher)
    assert not demoted.is_dynamic() and demoted.model is not patcher.model
    return demoted


@pytest.mark.parametrize("mode, names", [
    ("dynamic", ("lowrank",)),  # banks hooked by DynamicLoras
    ("dynamic", ("loha",)),  # ComfyUI's bypass hook
    ("dynamic", ("dora", "loha")),  # a DoRA merge into a twin, with a bypass hook on that twin
    ("stochastic", ("lowrank", "loha")),  # merges into twins (object patches)
    ("standard", ("lowrank",)),  # ComfyUI weight patches
])
def test_the_demoted_copy_runs_the_lora(reference, dynamic, lora_files, mode, names):
    """Measured (CPU): the demoted copy with the stack matches the regular model with it (> 60 dB: inf, bit for
    bit); without the rebind its output was the no-LoRA output (the stacks here change it by 19.6-35.4 dB)."""
    base_out = run_flux(reference)
    expected = run_flux(apply_lora_stack(reference, lora_files(*names), mode, seed=1)[0])
    effect = sqnr_db(expected, base_out)
    assert effect < 40, f"the test LoRA is too weak to tell ({effect:.1f} dB)"
    out = run_flux(_demoted(apply_lora_stack(dynamic, lora_files(*names), mode, seed=1)[0]))
    assert sqnr_db(expected, out) > 60, (mode, names, sqnr_db(expected, out), effect)


def test_rebinding_leaves_the_source_stack_on_the_source_model(dynamic, lora_files):
    """The source patcher keeps injecting into its own modules; the rebound stack hooks only the copy's."""
    patched, _ = apply_lora_stack(dynamic, lora_files("lowrank"), "dynamic", seed=1)
    demoted = _demoted(patched)
    (source_stack,), (copy_stack,) = patched.injections[INJECTION_KEY], demoted.injections[INJECTION_KEY]
    (source_applier,), (copy_applier,) = source_stack.appliers, copy_stack.appliers
    assert source_applier.loras.root is patched.model and copy_applier.loras.root is demoted.model
    demoted.patch_model()
    try:
        hooked = [name for name, m in demoted.model.named_modules() if m._forward_hooks]
        assert hooked and not [name for name, m in patched.model.named_modules() if m._forward_hooks]
    finally:
        demoted.unpatch_model()
    assert not any(m._forward_hooks for m in demoted.model.modules())
    assert rebind_lora_injections(demoted, demoted) == 0  # same model: nothing to do
