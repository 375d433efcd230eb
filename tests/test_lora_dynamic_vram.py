"""LoRA merges under ComfyUI's Dynamic VRAM (``ModelPatcherDynamic``), on a machine without a GPU.

Dynamic VRAM keeps every layer's weight where it was loaded and streams it to the GPU when the layer
runs, through ``comfy.ops.cast_bias_weight``. The copy it streams is cached *per module object*: a
VRAM allocation (``_v``) whose contents stay valid while its residency signature matches, and a pinned
host copy (``_pins``), both filled from the module's weight the first time it is cast. Neither notices
a weight assigned into the module later, so a merged weight swapped into the base model's module after
the base model has run is never what runs (the bug this file guards against: Stochastic output equal to
the base model's under Dynamic VRAM). A merge must give its layers their own module objects - ComfyUI's
object patches - which the patcher puts in the model before it loads, so the caches they build are theirs.

These tests run ComfyUI's real ``ModelPatcherDynamic`` (clone, partially_load, load, unpatch_model,
detach) and its real cast (``cast_bias_weight`` -> ``cast_modules_with_vbar`` ->
``resolve_cast_module_with_vbar``); only comfy-aimdo's allocator is replaced by an in-memory fake (a VRAM
allocation is a CPU byte buffer with a residency signature, evicted on ``partially_unload``), pinned
memory is off (it needs the CUDA driver), and the "GPU" is a device label: the patcher loads to
``cpu:0`` (so weights stay where they are and ComfyUI does not reroute it to a plain ModelPatcher as it
does for ``cpu``) and the layers are cast for ``meta`` (the device only steers ComfyUI onto its vbar
path; the bytes land in the fake allocation).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "comfy"))
from comfy_helpers import load_stock, require_comfy, tiny_flux_bf16  # noqa: E402
from lora_helpers import base_weight, random_lora  # noqa: E402

require_comfy()

import comfy.memory_management  # noqa: E402
from lora_dvram_helpers import LOAD_DEVICE, DynamicPatcher, adapter_lora_files, fake_aimdo, release, switch_to  # noqa: E402, F401
from lora_dvram_helpers import cast as _cast, module_at as _module  # noqa: E402

from lowbit.lora.stochastic import merge_deltas  # noqa: E402
from lowbit.lora.twin import module_twin  # noqa: E402
from lowbit.nodes.calibrate import apply_policy  # noqa: E402
from lowbit.nodes.lora_nodes import apply_lora_stack  # noqa: E402
from lowbit.quant.formats import FORMATS  # noqa: E402
from lowbit.quant.policy import Policy  # noqa: E402

LAYER = "double_blocks.0.img_mlp.0"
QKV = "double_blocks.0.img_attn.qkv"


@pytest.fixture
def base(fake_aimdo):  # noqa: F811 (the imported fixture)
    """A Dynamic-VRAM patcher of its own copy of the quantized tiny Flux (its modules gather vbar state)."""
    quantized = apply_policy(load_stock(tiny_flux_bf16()), Policy(mode="int8_convrot"))
    patcher = DynamicPatcher(quantized.model, LOAD_DEVICE, torch.device("cpu"), size=quantized.model_size())
    yield patcher
    release(patcher)


@pytest.fixture(scope="module")
def lora_files(tmp_path_factory):
    sd = tiny_flux_bf16()
    weight, qkv = sd[f"{LAYER}.weight"].float(), sd[f"{QKV}.weight"].float()
    qkv_prefix = f"lora_unet_{QKV.replace('.', '_')}"

    def qkv_lora(r):
        return {f"{qkv_prefix}.lora_down.weight": r(8, qkv.shape[1]) / 16,
                f"{qkv_prefix}.lora_up.weight": r(qkv.shape[0], 8, scale=0.5 * float(qkv.std()))}

    return adapter_lora_files(tmp_path_factory.mktemp("dynamic_vram_loras"), weight, LAYER, qkv_lora)


def _stored(patcher, layer) -> torch.Tensor:
    """The weight the module in the model holds now (what the non-dynamic path runs)."""
    return _module(patcher, layer).weight.dequantize().float().clone()


# ---- tests ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode, names, layers", [
    ("stochastic", ("lowrank",), (LAYER, QKV)),
    ("stochastic", ("loha",), (LAYER,)),
    ("dynamic", ("dora",), (LAYER,)),
])
def test_merged_weights_are_what_runs_after_the_base_model_ran(base, lora_files, mode, names, layers):
    """The base model runs first (its weights become resident), then the LoRA'd clone, then the base again:
    each cast returns that patcher's weights, resident or re-faulted after an eviction."""
    switch_to(base)
    base_weights = {layer: _cast(base, layer) for layer in layers}
    patched, _ = apply_lora_stack(base, lora_files(*names), mode, seed=1)
    switch_to(patched, base)
    for layer in layers:
        merged = _stored(patched, layer)
        assert not torch.equal(merged, base_weights[layer]), "the merge changed nothing; the test would not test it"
        assert torch.equal(_cast(patched, layer), merged), (layer, "the base weight ran instead of the merge")
        assert torch.equal(_cast(patched, layer), merged), (layer, "second (resident) cast")
    patched.partially_unload(None, 1e32)  # evicted: the next cast faults the allocation in again
    assert all(torch.equal(_cast(patched, layer), _stored(patched, layer)) for layer in layers)
    switch_to(base, patched)
    for layer in layers:
        assert torch.equal(_cast(base, layer), base_weights[layer]), (layer, "the merge leaked into the base model")


def test_each_patcher_streams_its_layers_through_its_own_modules(base, lora_files):
    """Per module object caches: the merged layer is another module than the base model's, streamed through
    its own vbar allocation; layers no merge touches stay the base model's modules."""
    switch_to(base)
    untouched = "double_blocks.1.img_mlp.0"
    base_module, base_other = _module(base, LAYER), _module(base, untouched)
    base_weight = base_module.weight
    _cast(base, LAYER)
    patched, _ = apply_lora_stack(base, lora_files("lowrank"), "stochastic", seed=1)
    switch_to(patched, base)
    twin = _module(patched, LAYER)
    assert twin is not base_module and twin._v is not base_module._v
    assert twin.weight is not base_weight and base_module.weight is base_weight  # the base module is never written
    assert _module(patched, untouched) is base_other
    switch_to(base, patched)
    assert _module(base, LAYER) is base_module


def test_dynamic_bypass_hooks_land_on_the_module_that_runs(base, lora_files):
    """ComfyUI's bypass forward (LoHa in dynamic mode) replaces a module's ``forward``: it must hook the module
    that is in the model when the stack's patcher runs - the DoRA merge's own module when both change one
    layer, the base model's even while another stack's merged modules are in the model."""
    switch_to(base)
    merged, _ = apply_lora_stack(base, lora_files("lowrank"), "stochastic", seed=1)
    switch_to(merged, base)  # another stack's merged module is in the model while the next stack is applied
    for names in (("loha",), ("dora", "loha")):
        patched, _ = apply_lora_stack(base, lora_files(*names), "dynamic", seed=1)
        switch_to(patched, merged)
        hook = getattr(_module(patched, LAYER).forward, "__self__", None)
        assert type(hook).__name__ == "BypassForwardHook", (names, "the LoHa does not run")
        switch_to(merged, patched)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_merge_keeps_the_weight_geometry_the_vbar_was_sized_for(name):
    """ModelPatcherDynamic sizes a module's VRAM allocation from the weight it holds when it loads - the base
    weight, the merge is swapped in after - and reads the streamed bytes back as that weight's inner tensors:
    every format's merge must keep their shapes, dtypes and ComfyUI's aligned size."""
    codec = FORMATS[name]
    weight = codec.quantize(base_weight(), compute_dtype=torch.bfloat16, seed=0)
    merged = merge_deltas(codec, weight, [random_lora(1, magnitude=0.5)], seed=3, layer=name).weight

    def geometry(qt):
        inner, _ = qt.__tensor_flatten__()
        return [(attr, tuple(getattr(qt, attr).shape), getattr(qt, attr).dtype) for attr in inner]

    assert not torch.equal(merged.dequantize(), weight.dequantize())
    assert geometry(merged) == geometry(weight)
    assert comfy.memory_management.vram_aligned_size(merged) == comfy.memory_management.vram_aligned_size(weight)


def test_a_twin_shares_the_tensors_and_none_of_the_run_state():
    """A twin's parameters are the module's tensors (no copy); assigning one leaves the module alone; the
    module's hooks, an instance-level forward and Dynamic VRAM's per-module state stay with the module."""
    module = torch.nn.Linear(8, 4)
    module.lowbit_format = "int8"
    module._v, module._v_signature, module._pins = object(), 7, {"weights": {}}
    module.forward = lambda x: x  # what ComfyUI's bypass hook leaves on the instance after ejecting
    module.register_forward_hook(lambda m, args, out: out * 0)
    twin = module_twin(module)
    assert type(twin) is type(module) and twin.lowbit_format == "int8" and twin.in_features == 8
    assert twin.weight is module.weight and twin.bias is module.bias
    assert not any(hasattr(twin, name) for name in ("_v", "_v_signature", "_pins")) and "forward" not in vars(twin)
    x = torch.randn(2, 8)
    assert torch.equal(twin(x), torch.nn.functional.linear(x, module.weight, module.bias))
    twin.weight = torch.nn.Parameter(torch.zeros(4, 8))
    assert module.weight is not twin.weight and module.weight.abs().sum() > 0
