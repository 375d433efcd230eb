"""Replaced Stochastic stacks give their pinned memory back under Dynamic VRAM, on the CPU.

Every Stochastic stack under Dynamic VRAM runs its merged layers in twins (new module objects, see
lora/twin.py), and Dynamic VRAM pins each module's weight in a per-model stack of host copies that
only shrinks from the top. The bug this file guards against (the H200 run's "RSS grew 9.9% over 20
swaps"): each strength change's twins stayed on that stack - their pinned copies, and through the stack
the twins themselves - for as long as the base model lived. Runs ComfyUI's real patcher, cast and pin
stacks with comfy-aimdo's allocator and CUDA host registration faked (tests/lora_dvram_helpers.py).
"""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent / "comfy"))
from comfy_helpers import load_stock, require_comfy, tiny_flux_bf16  # noqa: E402

require_comfy()

from lora_dvram_helpers import LOAD_DEVICE, DynamicPatcher, cast, fake_aimdo_pinned, module_at  # noqa: E402, F401
from lora_dvram_helpers import release, switch_to  # noqa: E402

from lowbit.nodes.calibrate import apply_policy  # noqa: E402
from lowbit.nodes.lora_nodes import LoraEntry, apply_lora_stack  # noqa: E402
from lowbit.quant.policy import Policy  # noqa: E402

LAYERS = ("double_blocks.0.img_mlp.0", "double_blocks.0.img_attn.qkv", "single_blocks.0.linear1")
SWAPS = 6
WEIGHT_PIN_SUBSETS = ("weights", "weights-loaded")  # where ComfyUI pins a module's weight (comfy/pinned_memory.py)


def _lora_file(tmp_path) -> str:
    sd, gen, out = tiny_flux_bf16(), torch.Generator().manual_seed(0), {}
    for layer in LAYERS:
        (n, k), prefix = sd[f"{layer}.weight"].shape, f"lora_unet_{layer.replace('.', '_')}"
        out[f"{prefix}.lora_down.weight"] = (torch.randn(8, k, generator=gen) / k**0.5).bfloat16()
        out[f"{prefix}.lora_up.weight"] = (torch.randn(n, 8, generator=gen) * 0.02).bfloat16()
    path = tmp_path / "lora.safetensors"
    save_file(out, str(path))
    return str(path)


def _pinned(model) -> list:
    """Every module holding a pinned weight copy of ``model``, in pin order."""
    pins = model.dynamic_pins[LOAD_DEVICE]
    return [module for subset in WEIGHT_PIN_SUBSETS for module, _ in pins[subset][1]]


def _pinned_bytes(model) -> int:
    pins = model.dynamic_pins[LOAD_DEVICE]
    return sum(pins[subset][0].size for subset in WEIGHT_PIN_SUBSETS)


def test_strength_swaps_keep_pinned_copies_and_twins_bounded(fake_aimdo_pinned, tmp_path):  # noqa: F811
    """Base model, then SWAPS stacks each replacing the last (a strength change each): after every swap the
    pins are the base model's layers plus the running stack's twins, and no replaced stack's twin is alive.

    Before the fix: 3 + 3 * swaps pinned modules, every twin alive."""
    quantized = apply_policy(load_stock(tiny_flux_bf16()), Policy(mode="int8_convrot"))
    base = DynamicPatcher(quantized.model, LOAD_DEVICE, torch.device("cpu"), size=quantized.model_size())
    path = _lora_file(tmp_path)
    try:
        switch_to(base)
        base_modules = [module_at(base, layer) for layer in LAYERS]
        for layer in LAYERS:
            cast(base, layer)
        assert _pinned(base.model) == base_modules, "the base layers are not pinned; the test would not test it"
        base_bytes, twins, previous = _pinned_bytes(base.model), [], base
        for swap in range(SWAPS):
            patched, _ = apply_lora_stack(base, [LoraEntry("lora", path, 1.0 + 0.5 * swap)], "stochastic", seed=1)
            switch_to(patched, previous)
            running = [module_at(patched, layer) for layer in LAYERS]
            assert not any(m is b for m, b in zip(running, base_modules)), "no twins; the test would not test it"
            for layer in LAYERS:
                cast(patched, layer)
            twins.extend(weakref.ref(m) for m in running)
            del running
            previous = patched
            del patched
            gc.collect()
            pinned = _pinned(base.model)
            assert pinned[: len(LAYERS)] == base_modules, swap
            assert len(pinned) == 2 * len(LAYERS), (swap, len(pinned))
            assert _pinned_bytes(base.model) < 2.5 * base_bytes, swap
            alive = sum(ref() is not None for ref in twins)
            assert alive == len(LAYERS), (swap, alive)  # the running stack's, none of the replaced ones
        switch_to(base, previous)
        del previous
        gc.collect()
        assert _pinned(base.model) == base_modules  # the last stack's twins unpinned when it detached
        assert sum(ref() is not None for ref in twins) <= len(LAYERS)
    finally:
        release(base)


def test_twins_pinned_from_a_fast_disk_are_released_too():
    """Newer ComfyUI (>= 0.3x) pins a model read from a fast disk in a ``weights-fast`` subset, next to a
    ``fast_disk`` flag in the same per-device pin state; ComfyUI 0.30 has neither, so this builds that state."""
    from lowbit.nodes.lora_nodes import _release_pins

    class Pinned(torch.nn.Module):
        def __init__(self, nbytes):
            super().__init__()
            self._pins = {"weights-fast": {"pin": torch.empty(nbytes, dtype=torch.uint8)}}

    base, twin_a, twin_b = Pinned(100), Pinned(30), Pinned(20)
    calls = []

    class Patcher:
        load_device = LOAD_DEVICE
        model = type("Model", (), {})()

        def partially_unload_ram(self, size, subsets):
            calls.append((size, tuple(subsets)))

    patcher = Patcher()
    stack = [(base, 0), (twin_a, 100), (twin_b, 130)]
    patcher.model.dynamic_pins = {LOAD_DEVICE: {"weights": (None, [], [0], [0], [0], {}),
                                                "weights-fast": (None, stack, [0], [0], [0], {}),
                                                "fast_disk": True}}
    _release_pins(patcher, [twin_a, twin_b])
    assert calls == [(50, ("weights-fast",))]
