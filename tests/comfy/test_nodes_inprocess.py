"""The Load and Quantize nodes called in-process on the tiny Flux, with real ComfyUI modules."""

from __future__ import annotations

import gc

import pytest
import torch

from comfy_helpers import (assert_matches_stock, assert_same_quantized_weights, flux_runner, load_stock, require_comfy,
                           run_flux, sqnr_db, tiny_flux_bf16)

require_comfy()

import comfy.sd  # noqa: E402
import comfy.utils  # noqa: E402
from comfy_kitchen.tensor import QuantizedTensor  # noqa: E402

from lowbit.nodes.common import NodeInputError  # noqa: E402
from lowbit.nodes.loader import LoadSettings, LowBitLoadDiffusionModel, load_lowbit_diffusion_model  # noqa: E402
from lowbit.nodes.model_quant import (NotADiffusionModelError, NothingToQuantizeError, copy_model,  # noqa: E402
                                      is_quantized, model_info, native_state_dict, quantize_model,
                                      quantized_layers)
from lowbit.nodes.quantize import CACHE, LowBitQuantizeModel, QuantizeCache, quantize_node  # noqa: E402
from lowbit.quant.checkpoint import save_checkpoint  # noqa: E402
from lowbit.quant.errors import PolicyError  # noqa: E402
from lowbit.quant.policy import Policy  # noqa: E402
from lowbit.quant.quantize import quantize_state_dict  # noqa: E402

MODE = "int8_convrot"
#: LoRA targets: two layers the flux1 preset quantizes and one it keeps float (img_in)
LORA_TARGETS = ("double_blocks.0.img_attn.qkv", "single_blocks.1.linear2", "img_in")
LORA_RANK = 4


def _quantize(model, **inputs):
    out = LowBitQuantizeModel.execute(model=model, mode=inputs.pop("mode", MODE), **inputs)
    return out.result[0]


def _snapshot(model_patcher) -> dict[str, tuple[type, torch.Tensor]]:
    """Each module's class and a CPU copy of its weight (loading may move weights, never change them)."""
    return {name: (type(m), m.weight.detach().to("cpu", copy=True))
            for name, m in model_patcher.model.diffusion_model.named_modules()
            if isinstance(getattr(m, "weight", None), torch.Tensor)}


# ---- schemas ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("node", [LowBitLoadDiffusionModel, LowBitQuantizeModel])
def test_schema_is_lowbit_and_every_input_has_a_tooltip(node):
    schema = node.define_schema()
    assert schema.category == "LowBit" and "(LowBit)" in schema.display_name and schema.description
    assert schema.inputs and all(i.tooltip for i in schema.inputs), [i.id for i in schema.inputs if not i.tooltip]
    required = [i.id for i in schema.inputs if not i.optional]
    assert required == (["unet_name", "mode"] if node is LowBitLoadDiffusionModel else ["model", "mode"])


# ---- Quantize Model (LowBit) ------------------------------------------------------------------------

def test_quantize_node_quantizes_without_touching_its_input(float_model, float_output):
    before = _snapshot(float_model)
    quantized = _quantize(float_model)
    assert quantized is not float_model and quantized.model is not float_model.model
    layers = quantized_layers(quantized)
    assert layers and {fmt for _, fmt, _ in layers} == {MODE}
    assert all(isinstance(qt, QuantizedTensor) for _, _, qt in layers)
    info = model_info(quantized)
    assert info.source == "quantized in memory" and info.plan.mode == MODE and info.plan.preset == "flux1"
    out = run_flux(quantized)
    assert not torch.equal(out, float_output) and sqnr_db(float_output, out) > 26.0
    after = _snapshot(float_model)
    assert after.keys() == before.keys()
    for name, (cls, weight) in before.items():
        assert after[name][0] is cls and torch.equal(after[name][1], weight), name
    assert not is_quantized(float_model) and torch.equal(run_flux(float_model), float_output)


def test_quantize_node_caches_per_input_patches_and_settings(float_model):
    first = _quantize(float_model)
    assert _quantize(float_model) is first  # a re-run graph does not quantize again
    assert _quantize(float_model, int4_mixed_ratio=0.2, preset="auto") is first
    other_mode = _quantize(float_model, mode="int8")
    assert other_mode is not first
    patched = float_model.clone()
    patched.add_patches({"diffusion_model.img_in.bias": (torch.zeros(256),)}, 1.0)
    assert _quantize(patched) is not first  # new patches uuid
    assert CACHE.get(float_model, Policy(mode=MODE)) is first


def test_quantize_cache_holds_no_model_alive(float_model):
    cache = QuantizeCache()
    source = float_model.clone()
    result = quantize_node(source, "int8", cache=cache)
    assert len(cache) == 1 and quantize_node(source, "int8", cache=cache) is result
    del result
    gc.collect()
    assert len(cache) == 0  # the result was only weakly held
    del source
    gc.collect()
    assert len(cache._by_input) == 0


def test_enable_bypass_as_needed_and_always(float_model):
    assert _quantize(float_model, enable="bypass") is float_model
    quantized = _quantize(float_model)
    assert is_quantized(quantized)
    assert _quantize(quantized, enable="as_needed") is quantized
    with pytest.raises(NothingToQuantizeError, match="nothing to quantize"):
        _quantize(quantized, mode="int8", enable="always")
    with pytest.raises(NodeInputError):
        _quantize(float_model, enable="sometimes")


def test_keep_float_keeps_the_matching_layers_float(float_model, float_output):
    """``keep_float``: one regular expression per line, added to the preset's; the matching layers stay
    float, the others are quantized as without it, and the model is closer to the float one."""
    plain = {name for name, _, _ in quantized_layers(_quantize(float_model))}
    kept = _quantize(float_model, keep_float="(_mod|modulation)\\.lin$\n\n  ^single_blocks\\.1\\.linear2$  \n")
    names = {name for name, _, _ in quantized_layers(kept)}
    dropped = plain - names
    assert names < plain and names == {n for n in plain if not n.endswith("_mod.lin") and not n.endswith(".modulation.lin")
                                       and n != "single_blocks.1.linear2"}
    assert {"double_blocks.0.img_mod.lin", "single_blocks.0.modulation.lin", "single_blocks.1.linear2"} <= dropped
    modules = dict(kept.model.diffusion_model.named_modules())
    for name in dropped:
        assert not isinstance(modules[name].weight, QuantizedTensor), name
    assert info_keep(kept) == ("(_mod|modulation)\\.lin$", "^single_blocks\\.1\\.linear2$")
    assert sqnr_db(float_output, run_flux(kept)) > sqnr_db(float_output, run_flux(_quantize(float_model)))
    assert _quantize(float_model, keep_float="") is _quantize(float_model)  # empty: the same cached model
    with pytest.raises(NodeInputError, match="keep_float pattern 'img_mod\\(' is not a valid regular expression"):
        _quantize(float_model, keep_float="img_mod(")


def info_keep(model) -> tuple[str, ...]:
    """The ``extra_keep_float`` of the policy a quantized model records."""
    return tuple(model_info(model).policy["extra_keep_float"])


def _lora(state_dict, scale: float = 3.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    lora = {}
    for layer in LORA_TARGETS:
        out_f, in_f = state_dict[f"{layer}.weight"].shape
        lora[f"diffusion_model.{layer}.lora_up.weight"] = torch.randn(out_f, LORA_RANK, generator=gen) * scale / out_f ** 0.5
        lora[f"diffusion_model.{layer}.lora_down.weight"] = torch.randn(LORA_RANK, in_f, generator=gen) / in_f ** 0.5
        lora[f"diffusion_model.{layer}.alpha"] = torch.tensor(float(LORA_RANK))
    return lora


def _delta(lora, layer: str, strength: float = 1.0) -> torch.Tensor:
    up, down = lora[f"diffusion_model.{layer}.lora_up.weight"], lora[f"diffusion_model.{layer}.lora_down.weight"]
    return strength * (up @ down)


def test_a_stock_lora_is_baked_into_the_quantized_weights_once(float_model):
    base = tiny_flux_bf16()
    lora = _lora(base)
    lora_model, _ = comfy.sd.load_lora_for_models(float_model, None, lora, 1.0, 0)
    assert len(lora_model.patches) == len(LORA_TARGETS)
    lora_out = run_flux(lora_model)  # leaves the shared float model loaded *with the LoRA patched in*

    quantized = _quantize(lora_model)
    assert not quantized.patches, "baked patches must not stay pending on the result"
    assert len(lora_model.patches) == len(LORA_TARGETS) and not float_model.patches
    weights = dict(quantized.model.diffusion_model.named_modules())
    for layer in LORA_TARGETS:
        w, delta = base[f"{layer}.weight"].float(), _delta(lora, layer)
        stored = weights[layer].weight
        stored = stored.dequantize().float() if isinstance(stored, QuantizedTensor) else stored.float()
        once, none, twice = sqnr_db(w + delta, stored), sqnr_db(w, stored), sqnr_db(w + 2 * delta, stored)
        assert once > 30.0 and once > none + 10 and once > twice + 10, (layer, once, none, twice)
    assert model_info(quantized).baked_patches == len(LORA_TARGETS)

    # outputs: the LoRA merged by hand into the float weights, then quantized, gives the same model (up
    # to rounding: where ComfyUI computes in bf16 the hand-merged W + delta is stored in bf16 first;
    # measured: identical on CPU, 37.6 dB on an H200; without the LoRA 8.6 dB)
    merged = {k: v.float() for k, v in base.items()}
    for layer in LORA_TARGETS:
        merged[f"{layer}.weight"] = merged[f"{layer}.weight"] + _delta(lora, layer)
    expected = run_flux(quantize_model(load_stock(merged), Policy(mode=MODE)))
    without = run_flux(_quantize(float_model))
    out = run_flux(quantized)
    assert sqnr_db(expected, out) > 33.0 and sqnr_db(expected, out) > sqnr_db(without, out) + 12.0
    assert sqnr_db(lora_out, out) > 26.0
    assert torch.equal(run_flux(lora_model), lora_out), "the LoRA model itself must be unchanged"


def test_native_state_dict_round_trips_through_stock_comfyui(float_model, float_output, tmp_path):
    """Stock ComfyUI reads the saved file as the very tensors LowBit quantized; LowBit's loader runs it
    bit for bit as the in-memory model; stock runs it bit for bit on the CPU, and on CUDA (its kernels,
    not LowBit's) within comfy_helpers.CUDA_STOCK_AGREEMENT_DB."""
    quantized = _quantize(float_model)
    sd = native_state_dict(quantized)
    assert not any(k.startswith("diffusion_model.") for k in sd)
    assert sum(k.endswith(".comfy_quant") for k in sd) == len(quantized_layers(quantized))
    path = save_checkpoint(sd, tmp_path / "saved.safetensors")
    reloaded = load_stock(comfy.utils.load_torch_file(str(path)))
    assert assert_same_quantized_weights(quantized, reloaded) == len(quantized_layers(quantized))
    ours = run_flux(quantized)
    lowbit_reloaded = load_lowbit_diffusion_model(str(path), LoadSettings(mode="native"))
    assert torch.equal(run_flux(lowbit_reloaded), ours)
    assert_matches_stock(MODE, flux_runner(reloaded), flux_runner(quantized, ours), flux_runner(float_model, float_output))


def test_model_copy_shares_weight_storage_but_no_load_state(float_model):
    """The copy quantize_model works on: new modules and Parameters over the same storage, and none of
    the per-module load state (Dynamic VRAM vbar slots and pinned buffers, lowvram patches)."""
    source = float_model.model
    layer = source.diffusion_model.double_blocks[0].img_attn.qkv
    block = source.diffusion_model.double_blocks[0]
    planted = {(layer, "_pins"): {"weights": {"pin": torch.zeros(4)}},  # as Dynamic VRAM leaves them on a module
               (layer, "_v"): object(), (layer, "weight_function"): [lambda w: w],
               (block, "_v_block"): object(), (block, "_comfy_graph"): object()}  # newer ComfyUI: per block
    # under Dynamic VRAM the float model is really loaded: its own values go back afterwards
    saved = {key: key[0].__dict__[key[1]] for key in planted if key[1] in key[0].__dict__}
    for (module, name), value in planted.items():
        module.__dict__[name] = value
    try:
        copy = copy_model(source)
    finally:
        for module, name in planted:
            module.__dict__.pop(name, None)
        for (module, name), value in saved.items():
            module.__dict__[name] = value
    copied = copy.diffusion_model.double_blocks[0].img_attn.qkv
    assert copied is not layer and copied.weight is not layer.weight
    assert copied.weight.data_ptr() == layer.weight.data_ptr()
    assert "_pins" not in copied.__dict__ and "_v" not in copied.__dict__ and copied.weight_function == []
    assert not {"_v_block", "_comfy_graph"} & set(copy.diffusion_model.double_blocks[0].__dict__)
    assert copy.model_loaded_weight_memory == 0 and copy.current_weight_patches_uuid is None
    copied.weight = torch.nn.Parameter(torch.zeros_like(copied.weight), requires_grad=False)
    assert layer.weight.abs().sum() > 0  # replacing a weight on the copy leaves the source alone


def test_progress_reports_every_quantized_layer(float_model):
    calls = []
    quantized = quantize_model(float_model, Policy(mode="int8"), progress=lambda done, total: calls.append((done, total)))
    total = len(quantized_layers(quantized))
    assert calls == [(i, total) for i in range(1, total + 1)]


# ---- Load Diffusion Model (LowBit) ------------------------------------------------------------------

def _load(name: str, mode: str, **inputs):
    return LowBitLoadDiffusionModel.execute(unet_name=name, mode=mode, **inputs).result[0]


def test_loader_quantizes_while_loading_like_the_quantize_node(models_dir, float_model, float_output):
    save_checkpoint(tiny_flux_bf16(), models_dir / "flux.safetensors")
    loaded = _load("flux.safetensors", MODE)
    assert model_info(loaded).source == "converted while loading"
    assert torch.equal(run_flux(loaded), run_flux(_quantize(float_model)))
    as_float = _load("flux.safetensors", "native")
    assert not is_quantized(as_float) and torch.equal(run_flux(as_float), float_output)
    in_bf16 = _load("flux.safetensors", "int8", weight_dtype="bf16", kernel_backend="eager")
    layer = in_bf16.model.diffusion_model.double_blocks[0].img_attn.qkv
    assert layer.weight.dtype == torch.bfloat16 and layer.lowbit_config.backend == "eager"
    assert sqnr_db(float_output, run_flux(in_bf16)) > 20.0
    kept = _load("flux.safetensors", MODE, keep_float="(_mod|modulation)\\.lin$")
    assert {name for name, _, _ in quantized_layers(kept)} == {
        name for name, _, _ in quantized_layers(loaded) if not name.endswith("mod.lin") and "modulation" not in name}
    assert torch.equal(run_flux(kept), run_flux(_quantize(float_model, keep_float="(_mod|modulation)\\.lin$")))
    with pytest.raises(NodeInputError, match="keep_float pattern"):
        _load("flux.safetensors", MODE, keep_float="img_mod(")


def test_w4a4_scales_input_reaches_the_w4a4_weights(models_dir, float_model):
    """Quantize Model's and the loader's ``w4a4_scales`` (mse by default, or comfy-kitchen's absmax): their
    w4a4 layers hold exactly what ``quantize_state_dict`` makes under the policy with that choice."""
    save_checkpoint(tiny_flux_bf16(), models_dir / "flux.safetensors")
    scales = {}
    for choice in ("mse", "absmax"):
        # on the device the nodes quantize on (a GPU's rotation differs from the CPU's in the last bits)
        expected, plan = quantize_state_dict(tiny_flux_bf16(), Policy(mode="int4_full", w4a4_scales=choice),
                                             device=float_model.load_device)
        w4 = [d.name for d in plan.quantized if d.format == "w4a4"]
        assert w4
        for model in (_quantize(float_model, mode="int4_full", w4a4_scales=choice),
                      _load("flux.safetensors", "int4_full", w4a4_scales=choice)):
            assert model_info(model).policy["w4a4_scales"] == choice
            sd = native_state_dict(model)
            for layer in w4:
                for key in (k for k in expected if k.rpartition(".")[0] == layer):
                    assert torch.equal(sd[key].cpu(), expected[key]), (choice, key)
        scales[choice] = torch.cat([expected[f"{layer}.weight_scale"].flatten() for layer in w4])
    assert not torch.equal(scales["mse"], scales["absmax"])  # which gives less error: tests/test_scale_search.py
    with pytest.raises(PolicyError, match="w4a4_scales must be one of"):
        _quantize(float_model, mode="int4_full", w4a4_scales="max")


def test_loader_reads_a_native_file_as_stock_comfyui_does(models_dir, float_model, float_output):
    state_dict, _ = quantize_state_dict(tiny_flux_bf16(), Policy(mode=MODE))
    path = save_checkpoint(state_dict, models_dir / "flux_int8.safetensors")
    loaded = _load("flux_int8.safetensors", "native")
    assert model_info(loaded).source == "loaded native file" and len(quantized_layers(loaded)) == 26
    stock = load_stock(comfy.utils.load_torch_file(str(path)))
    assert assert_same_quantized_weights(loaded, stock) == 26
    # bit for bit on the CPU; on CUDA stock runs comfy-kitchen's kernels, LowBit its own
    assert_matches_stock(MODE, flux_runner(stock), flux_runner(loaded), flux_runner(float_model, float_output))
    converted = _load("flux_int8.safetensors", "fp8_rowwise")  # an already quantized file, converted again
    assert {fmt for _, fmt, _ in quantized_layers(converted)} == {"fp8_rowwise"}


def test_loader_errors_name_the_problem(models_dir):
    with pytest.raises(NodeInputError, match="no_such_model"):
        _load("no_such_model.safetensors", MODE)
    save_checkpoint({"text_model.embeddings.weight": torch.randn(64, 32).to(torch.bfloat16)},
                    models_dir / "not_a_model.safetensors")
    with pytest.raises(NotADiffusionModelError, match="not_a_model.safetensors"):
        _load("not_a_model.safetensors", MODE)
    (models_dir / "garbage.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(Exception, match="garbage.safetensors"):
        _load("garbage.safetensors", "native")


def test_a_model_with_no_quantizable_layer_is_a_clear_error(float_model):
    with pytest.raises(NothingToQuantizeError, match="kept in float"):
        quantize_model(float_model, Policy(mode=MODE, extra_keep_float=(".*",)))
