"""LowBit's ops class and its Linear inside real ComfyUI: loading, forward paths, patches, streaming."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from comfy_helpers import device, dynamic_vram_on, load_stock, require_comfy, run_flux, sqnr_db, tiny_flux_bf16

require_comfy()

import comfy.model_management  # noqa: E402
import comfy.ops  # noqa: E402
import comfy.utils  # noqa: E402
from comfy_kitchen.tensor import QuantizedTensor  # noqa: E402

from lowbit.kernels.dispatch import Dispatcher, use_dispatcher  # noqa: E402
from lowbit.nodes import comfy_ops  # noqa: E402
from lowbit.nodes.comfy_ops import (KERNEL_BACKENDS, LowBitOpsConfig, default_dequantize_formats,  # noqa: E402
                                    lowbit_ops, requantize)
from lowbit.nodes.loader import LoadSettings, load_lowbit_diffusion_model  # noqa: E402
from lowbit.nodes.model_quant import quantize_model, quantized_layers  # noqa: E402
from lowbit.quant.checkpoint import save_checkpoint  # noqa: E402
from lowbit.quant.demo import TinyFluxConfig, tiny_flux_state_dict  # noqa: E402
from lowbit.quant.errors import CheckpointFormatError, LowBitError  # noqa: E402
from lowbit.quant.formats import FORMATS, get_format  # noqa: E402
from lowbit.quant.native import layer_tensors  # noqa: E402
from lowbit.quant.policy import Policy  # noqa: E402
from lowbit.quant.quantize import quantize_state_dict  # noqa: E402

LAYER = "double_blocks.0.img_attn.qkv"
LOWBIT_ONLY = ("int8_quarot", "int8_hadanorm", "fp8_rowwise")
# denoiser-output SQNR vs the float tiny Flux, measured on CPU: quarot 30.0, hadanorm 36.2, fp8_rowwise 24.3 dB
MIN_OUTPUT_SQNR = {"int8_quarot": 26.0, "int8_hadanorm": 31.0, "fp8_rowwise": 20.0}
#: Least SQNR (dB) of a forced kernel backend against the layer's default ("auto") run of one INT8 ConvRot
#: layer (K = 256, fp32 probe), per device type.
#: CPU: auto runs kitchen's int8_linear; kitchen and LowBit's eager reference both rotate in fp32, so the
#: activation codes are the same (kitchen bit for bit, eager > 140 dB).
#: CUDA: auto runs LowBit's Triton kernel (the unmeasured dispatcher's first candidate), which rotates with
#: fp16 tensor-core operands after scaling each row by a power of two to below 2 (kernels/triton_act_quant.py):
#: a rotated value is accurate to ~2^-12 of the row maximum, 1/30 of an INT8 step, so ~1% of the activation
#: codes land on the neighbouring level compared with the fp32 rotation of eager and kitchen (kitchen's own
#: CUDA quantizer rotates bf16 activations in bf16; for this fp32 probe it matched eager). One flip is one
#: activation step: the backends then sit ~10 dB below the activation quantization noise itself (42.3 dB
#: against unquantized activations on this layer), 52.1 dB measured on an H200 and in the Triton interpreter.
BACKEND_AGREEMENT_DB = {"cpu": 60.0, "cuda": 50.0}
#: on every device the backends must disagree by well under the activation quantization they all do
BACKEND_MARGIN_OVER_ACTIVATION_NOISE_DB = 6.0


@pytest.fixture(scope="module")
def int8_model(float_model):
    return quantize_model(float_model, Policy(mode="int8_convrot"))


@functools.lru_cache(maxsize=None)
def _file(fmt: str, tmp_dir: str) -> str:
    state_dict, _ = quantize_state_dict(tiny_flux_bf16(), Policy(mode=fmt), device=device())
    return str(save_checkpoint(state_dict, f"{tmp_dir}/tiny_flux_{fmt}.safetensors", overwrite=True))


@pytest.fixture(scope="module")
def tmp_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ops"))


def _probe(k: int, seed: int = 3) -> torch.Tensor:
    return torch.randn(2, 7, k, generator=torch.Generator().manual_seed(seed)).to(device())


# ---- configuration ------------------------------------------------------------------------------

def test_config_validates_and_round_trips():
    config = LowBitOpsConfig(compute_dtype=torch.bfloat16, backend="eager", dequantize_formats={"float8_e4m3fn"})
    assert LowBitOpsConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert isinstance(config.dequantize_formats, frozenset)
    for bad in ({"backend": "cuda_magic"}, {"compute_dtype": torch.int8}, {"version": 99}):
        with pytest.raises(LowBitError):
            LowBitOpsConfig(**bad)
    assert KERNEL_BACKENDS[0] == "auto"


def test_default_dequantize_formats_follow_comfyui_on_this_device():
    formats = default_dequantize_formats(device())
    fp8_compute = comfy.model_management.supports_fp8_compute(device())
    assert ("float8_e4m3fn" in formats) == (not fp8_compute)
    assert "lowbit_fp8_rowwise" not in formats and "int8_tensorwise" not in formats


def test_default_dequantize_formats_take_newer_comfyuis_own_list(monkeypatch):
    """ComfyUI >= 0.3x answers ``get_disabled_quant_formats(device)`` itself (INT8 formats on devices without INT8
    compute, e.g. XPU); LowBit then dequantizes what stock would, on top of its own FP8/Blackwell checks."""
    asked = []
    monkeypatch.setattr(comfy.ops, "get_disabled_quant_formats",
                        lambda dev: asked.append(dev) or {"int8_tensorwise", "asym_w4a8_int8"}, raising=False)
    formats = default_dequantize_formats(device())
    assert asked == [device()]
    assert {"int8_tensorwise", "asym_w4a8_int8"} <= formats
    assert ("float8_e4m3fn" in formats) == (not comfy.model_management.supports_fp8_compute(device()))


def test_every_load_gets_its_own_ops_class_and_config(tmp_dir):
    path = _file("int8", tmp_dir)
    a = LowBitOpsConfig(compute_dtype=torch.float32, backend="eager")
    b = LowBitOpsConfig(compute_dtype=torch.bfloat16)
    ops_a, ops_b = lowbit_ops(a), lowbit_ops(b)
    assert ops_a is not ops_b and ops_a.Linear is not ops_b.Linear
    assert issubclass(ops_a.Linear, comfy.ops.CastWeightBiasOp)
    assert "mixed_precision_ops" in ops_a.Linear.__mro__[2].__qualname__  # ComfyUI's own Linear underneath
    assert not hasattr(ops_a.Linear, "lowbit_config"), "the config must live on instances, not on a class"
    model_a = load_stock(comfy.utils.load_torch_file(path), custom_operations=ops_a)
    model_b = load_stock(comfy.utils.load_torch_file(path), custom_operations=ops_b)
    layer_a = model_a.model.diffusion_model.get_submodule(LAYER)
    layer_b = model_b.model.diffusion_model.get_submodule(LAYER)
    assert layer_a.lowbit_config is a and layer_b.lowbit_config is b
    assert layer_a.weight.dtype == torch.float32 and layer_b.weight.dtype == torch.bfloat16
    assert torch.equal(layer_a.weight._qdata, layer_b.weight._qdata)


# ---- LowBit's own formats: stock ComfyUI cannot load them, LowBit's loader can ------------------

@pytest.mark.parametrize("fmt", LOWBIT_ONLY)
def test_lowbit_formats_load_natively_and_match_in_memory_quantization(fmt, tmp_dir, float_model, float_output):
    path = _file(fmt, tmp_dir)
    with pytest.raises(KeyError):  # QUANT_ALGOS is a fixed table in stock ComfyUI
        load_stock(comfy.utils.load_torch_file(path))
    loaded = load_lowbit_diffusion_model(path, LoadSettings(mode="native"))
    layer = loaded.model.diffusion_model.get_submodule(LAYER)
    assert layer.lowbit_format == fmt and layer.quant_format == get_format(fmt).spec.native_format
    in_memory = quantize_model(float_model, Policy(mode=fmt))
    out = run_flux(loaded)
    assert torch.equal(out, run_flux(in_memory))
    assert sqnr_db(float_output, out) > MIN_OUTPUT_SQNR[fmt]


def test_an_unknown_comfy_quant_format_is_a_clear_error(tmp_dir):
    state_dict = dict(tiny_flux_bf16())
    state_dict[f"{LAYER}.comfy_quant"] = torch.tensor(list(json.dumps({"format": "bogus4"}).encode()), dtype=torch.uint8)
    path = save_checkpoint(state_dict, f"{tmp_dir}/bogus.safetensors", overwrite=True)
    with pytest.raises(CheckpointFormatError, match="bogus4") as info:
        load_lowbit_diffusion_model(str(path), LoadSettings(mode="native"))
    assert LAYER in str(info.value)


# ---- forward paths -------------------------------------------------------------------------------

def test_quantized_path_runs_the_codec_and_patched_path_dequantizes(int8_model):
    layer = int8_model.model.diffusion_model.get_submodule(LAYER)
    codec = get_format(layer.lowbit_format)
    x = _probe(layer.in_features)
    with torch.no_grad():
        out = layer(x)
    weight, bias = layer.weight.to(device=x.device, dtype=x.dtype), layer.bias.to(x)
    assert torch.equal(out, codec.linear(x, weight, bias))
    dequantized = torch.nn.functional.linear(x, weight.dequantize(), bias)
    assert not torch.equal(out, dequantized)  # activations were quantized too

    delta = torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(0)).to(x.device) * 0.01
    layer.weight_function = [lambda w: w + delta.to(w.dtype)]
    try:
        with torch.no_grad():
            patched = layer(x)
    finally:
        layer.weight_function = []
    expected = torch.nn.functional.linear(x, weight.dequantize() + delta, bias)
    assert torch.allclose(patched, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_every_kernel_backend_runs_and_agrees(backend, int8_model):
    layer = int8_model.model.diffusion_model.get_submodule(LAYER)
    x = _probe(layer.in_features)
    # unmeasured, "auto" runs the candidate offered first (LowBit's Triton kernel on CUDA, kitchen's
    # int8_linear on the CPU), not whichever won a timing race earlier in this process
    with torch.no_grad(), use_dispatcher(Dispatcher(measure=False)):
        reference = layer(x)
        old = layer.lowbit_config
        layer.lowbit_config = LowBitOpsConfig(compute_dtype=old.compute_dtype, backend=backend,
                                              dequantize_formats=old.dequantize_formats)
        try:
            out = layer(x)
        finally:
            layer.lowbit_config = old
        weight = layer.weight.to(device=x.device, dtype=x.dtype)
        unquantized_activations = torch.nn.functional.linear(x, weight.dequantize(), layer.bias.to(x))
    agreement, activation_noise = sqnr_db(reference, out), sqnr_db(unquantized_activations, reference)
    assert agreement > BACKEND_AGREEMENT_DB[x.device.type], (agreement, activation_noise)
    assert agreement > activation_noise + BACKEND_MARGIN_OVER_ACTIVATION_NOISE_DB, (agreement, activation_noise)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_an_input_without_rows_gives_an_output_without_rows(fmt, float_model):
    # a routed MoE expert that no token chose (HiDream) calls its linears on [0, K]; kitchen's activation
    # quantizers reject an empty input, so without the layer's own check this raised
    model = quantize_model(float_model, Policy(mode=fmt))
    layer = model.model.diffusion_model.get_submodule(LAYER)
    assert isinstance(layer.weight, QuantizedTensor)
    x = _probe(layer.in_features)
    with torch.no_grad():
        for empty in (x[0, :0], x[:, :0], x[:0]):
            out = layer(empty)
            assert out.shape == (*empty.shape[:-1], layer.out_features) and out.dtype == x.dtype
        assert layer(x).shape == (2, 7, layer.out_features)  # and rows still compute


def test_fp8_abs_max_activation_scale_does_not_clip_large_activations():
    """Why LowBit's fp8 codec scales activations by their abs-max: stock's unit scale clips above 448."""
    codec = get_format("fp8")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(64, 256, generator=gen) / 16
    qt = codec.quantize(w, compute_dtype=torch.float32)
    x = torch.randn(32, 256, generator=gen)
    x[:, :4] *= 2000.0  # outlier channels, as in real diffusion transformers' hidden states
    reference = x @ w.t()
    stock = torch.nn.functional.linear(QuantizedTensor.from_float(x, "TensorCoreFP8E4M3Layout", scale=None), qt)
    ours = codec.linear(x, qt)
    assert sqnr_db(reference, ours) > 25.0
    assert sqnr_db(reference, stock) < sqnr_db(reference, ours) - 15.0


# ---- ComfyUI's weight patching and streaming -----------------------------------------------------

def _diff_patch(model, scale: float = 0.05):
    weight = model.model.diffusion_model.get_submodule(LAYER).weight
    delta = torch.randn(weight.shape, generator=torch.Generator().manual_seed(7)) * scale
    clone = model.clone()
    assert clone.add_patches({f"diffusion_model.{LAYER}.weight": (delta,)}, 1.0) == [f"diffusion_model.{LAYER}.weight"]
    return clone, delta


def _skip_if_dynamic(model):
    if model.is_dynamic():
        pytest.skip("Dynamic VRAM loads layers itself (ModelPatcherDynamic refuses patch_model with weights); "
                    "test_dynamic_vram_streams_quantized_layers_and_patches_offloaded_ones covers it")


def test_full_load_patch_requantizes_and_unpatch_restores(int8_model):
    _skip_if_dynamic(int8_model)
    original = int8_model.model.diffusion_model.get_submodule(LAYER).weight
    base = original.dequantize().float().cpu()
    patched, delta = _diff_patch(int8_model)
    patched.patch_model(device_to=device(), lowvram_model_memory=0)
    try:
        weight = patched.model.diffusion_model.get_submodule(LAYER).weight
        assert isinstance(weight, QuantizedTensor) and weight is not original
        merged = weight.dequantize().float().cpu()
        assert sqnr_db(base + delta, merged) > 30.0 and sqnr_db(base + delta, merged) > sqnr_db(base, merged) + 10
    finally:
        patched.unpatch_model(device_to=torch.device("cpu"))
    restored = patched.model.diffusion_model.get_submodule(LAYER).weight
    assert restored._qdata.data_ptr() == original._qdata.data_ptr()  # the original weight, not a requantized one


def test_lowvram_streaming_keeps_weights_quantized_and_applies_patches_on_the_fly(int8_model):
    _skip_if_dynamic(int8_model)
    dm = int8_model.model.diffusion_model
    x = _probe(dm.get_submodule(LAYER).in_features)
    with torch.no_grad():
        full = dm.get_submodule(LAYER)(x)
    patched, delta = _diff_patch(int8_model)
    for model, patch in ((int8_model.clone(), None), (patched, delta)):
        model.patch_model(device_to=device(), lowvram_model_memory=1)  # stream every layer
        try:
            layer = model.model.diffusion_model.get_submodule(LAYER)
            assert layer.comfy_cast_weights and isinstance(layer.weight, QuantizedTensor)
            with torch.no_grad():
                out = layer(x)
            if patch is None:
                assert not layer.weight_function
                assert torch.equal(out, full)
            else:
                assert layer.weight_function, "lowvram should patch on the fly"
                weight = layer.weight.to(device=x.device, dtype=x.dtype)  # dequantized in the compute dtype
                expected = torch.nn.functional.linear(x, weight.dequantize() + patch.to(x), layer.bias.to(x))
                assert torch.allclose(out, expected, rtol=1e-4, atol=1e-4)
        finally:
            model.unpatch_model(device_to=torch.device("cpu"))
        assert isinstance(layer.weight, QuantizedTensor) and not layer.weight_function


# ---- Dynamic VRAM (comfy-aimdo): partly resident, streaming quantized, LoRA on offloaded layers -----

#: hidden size of the Flux the Dynamic VRAM test loads: ~110 MiB of INT8 weights span several of
#: comfy-aimdo's 32 MiB VBAR pages (the tiny Flux fits in one page: all resident or all streamed)
DYNAMIC_VRAM_HIDDEN = 1024


def _lora_on_every_quantized_layer(model, float_state_dict, rank: int = 4, relative: float = 0.3):
    """A rank-``rank`` LoRA in ComfyUI's key format on every quantized layer; each delta has ~``relative``
    of its layer's weight RMS (measured on the CPU: the float output moves by 7 dB, the quantized
    model with the LoRA merged stays 33 dB from the float model with it)."""
    gen = torch.Generator().manual_seed(11)
    lora = {}
    for name, _, qt in quantized_layers(model):
        n, k = qt.shape
        scale = relative * float(float_state_dict[f"{name}.weight"].float().std()) / rank**0.5
        down, up = torch.randn(rank, k, generator=gen), torch.randn(n, rank, generator=gen) * scale
        lora[f"diffusion_model.{name}.lora_down.weight"] = down.to(torch.bfloat16)
        lora[f"diffusion_model.{name}.lora_up.weight"] = up.to(torch.bfloat16)
    return lora


def test_dynamic_vram_streams_quantized_layers_and_patches_offloaded_ones(monkeypatch):
    """Under Dynamic VRAM a quantized model loads partly: with a VRAM budget smaller than the model the
    layers left out of VRAM stream from RAM on every call, still quantized, and a LoRA on them is applied
    on the fly; the layers that stay resident got the LoRA merged into their VRAM copy when they loaded.

    How ModelPatcherDynamic does it (comfy/model_patcher.py ``load``, comfy/ops.py ``cast_bias_weight``):
    ``load`` gives each large layer a slot (``_v``) in the model's VBAR, turns on ``comfy_cast_weights``
    and attaches its patches as ``weight_lowvram_function``; the module's own weight stays in RAM. On a
    call, ``vbar_fault`` pages the slot into VRAM, or fails when the VBAR's watermark is below it; then
    the weight is copied through a cast buffer instead (``_v_signature`` None: streamed). LowBit's Linear
    asks for the weight in its stored (quantized) dtype with ``want_requant``, so a patched layer's weight
    is dequantized, patched, requantized (``requantize_from_float``) and the INT8 kernels run on it; a
    resident layer also writes that result into its VRAM copy once. ComfyUI's model manager shrinks a
    loaded model's VRAM with ``LoadedModel.model_unload(memory_to_free)`` -> ``partially_unload``, which
    lowers the VBAR's watermark: the test does exactly that.
    """
    if not dynamic_vram_on():
        pytest.skip("Dynamic VRAM (comfy-aimdo's ModelPatcherDynamic) needs a CUDA device: run with "
                    "LOWBIT_TEST_DEVICE=cuda LOWBIT_TEST_DYNAMIC_VRAM=1 (tests/gpu/README.md)")
    import comfy.lora
    import comfy.sd

    float_sd = tiny_flux_state_dict(TinyFluxConfig(hidden_size=DYNAMIC_VRAM_HIDDEN), seed=0)
    float_model = load_stock(float_sd)
    quantized = quantize_model(float_model, Policy(mode="int8_convrot"))
    assert quantized.is_dynamic()
    layers = [name for name, _, _ in quantized_layers(quantized)]
    stored = {name: qt._qdata.clone() for name, _, qt in quantized_layers(quantized)}
    lora = _lora_on_every_quantized_layer(quantized, float_sd)
    with_lora = comfy.sd.load_lora_for_models(quantized, None, lora, 1.0, 0.0)[0]
    float_with_lora = comfy.sd.load_lora_for_models(float_model, None, lora, 1.0, 0.0)[0]
    assert len(with_lora.patches) == len(layers)
    reference, without_lora = run_flux(float_with_lora), run_flux(float_model)

    codec = get_format("int8_convrot")
    calls = []
    linear = codec.linear

    def recording_linear(x, weight, *args, **kwargs):  # what LowBit's Linear hands its INT8 kernels
        calls.append((isinstance(weight, QuantizedTensor), weight.device.type))
        return linear(x, weight, *args, **kwargs)

    monkeypatch.setitem(vars(codec), "linear", recording_linear)

    def recording_lane(real):  # the steady state: a settled plan run from the form of the weight the cast made
        def lane(form, x, bias):
            out = real(form, x, bias)
            if out is not None:
                calls.append(("settled plan", form.codes.device.type))
            return out
        return lane

    monkeypatch.setattr(comfy_ops, "form_settled_linear", recording_lane(comfy_ops.form_settled_linear))
    monkeypatch.setattr(comfy_ops, "form_prologue_linear", recording_lane(comfy_ops.form_prologue_linear))

    # loaded by ComfyUI's model manager with VRAM to spare: every large layer staged and resident
    resident_out = run_flux(with_lora)
    dm = with_lora.model.diffusion_model
    staged = {name: dm.get_submodule(name) for name in layers if hasattr(dm.get_submodule(name), "_v")}
    assert len(staged) == len(layers), f"Dynamic VRAM staged {len(staged)} of {len(layers)} quantized layers"
    assert all(m._v_signature is not None for m in staged.values()), "with VRAM to spare all should be resident"
    vbar = with_lora.model.dynamic_vbars[with_lora.load_device]
    resident_bytes = vbar.loaded_size()

    # a VRAM budget smaller than the model: the model manager takes back half of its VRAM
    loaded = next(m for m in comfy.model_management.current_loaded_models if m.model is with_lora)
    assert loaded.model_unload(memory_to_free=resident_bytes // 2) is False, "the model should stay partly loaded"
    assert 0 < vbar.loaded_size() < resident_bytes, (vbar.loaded_size(), resident_bytes)
    calls.clear()
    streamed_out = run_flux(with_lora, load=False)
    streamed = [name for name, m in staged.items() if m._v_signature is None]
    resident = [name for name, m in staged.items() if m._v_signature is not None]
    assert streamed and resident, f"want a partly loaded model; streamed: {streamed}, resident: {resident}"
    assert vbar.loaded_size() < resident_bytes, "streaming paged the evicted layers back into VRAM"

    # quantized throughout: the stored weights are the original QuantizedTensors (the LoRA is never baked
    # into RAM) and every call ran LowBit's INT8 kernels in VRAM on the QuantizedTensor the cast handed back
    # (the vbar's resident copy, or the streamed and requantized one): its settled plan from the weight's
    # form, or codec.linear while no plan is settled
    for name, fmt, qt in quantized_layers(with_lora):
        assert fmt == "int8_convrot" and torch.equal(qt._qdata, stored[name]), name
    assert len(calls) >= len(layers) and ("settled plan", "cuda") in calls, set(calls)
    assert set(calls) <= {(True, "cuda"), ("settled plan", "cuda")}, set(calls)

    # the LoRA is applied on streamed and resident layers alike: the model with it, not without it
    with_sqnr, without_sqnr = sqnr_db(reference, streamed_out), sqnr_db(without_lora, streamed_out)
    assert with_sqnr > 22.0 and with_sqnr > without_sqnr + 15.0, (with_sqnr, without_sqnr)
    # the same requantized weights whether a layer streams or stays resident (seeded requantization)
    assert sqnr_db(resident_out, streamed_out) > 60.0, sqnr_db(resident_out, streamed_out)

    # one streamed and one resident layer on their own, against their float weight with the LoRA
    for name in (streamed[0], resident[0]):
        layer, key = staged[name], f"diffusion_model.{name}.weight"
        base = layer.weight.dequantize().float().cpu()
        with_delta = comfy.lora.calculate_weight(with_lora.patches[key], base.clone(), key)
        x = _probe(layer.in_features)
        with torch.no_grad():
            out = layer(x).float().cpu()
        x, bias = x.float().cpu(), layer.bias.float().cpu()
        expected = torch.nn.functional.linear(x, with_delta, bias)
        unpatched = torch.nn.functional.linear(x, base, bias)
        layer_sqnr, unpatched_sqnr = sqnr_db(expected, out), sqnr_db(unpatched, out)
        assert layer_sqnr > 30.0 and layer_sqnr > unpatched_sqnr + 15.0, (name, layer_sqnr, unpatched_sqnr)
    assert staged[streamed[0]]._v_signature is None, "the streamed layer was paged back in"


class _CastRecorder:
    """Records ``comfy.ops.cast_modules_with_vbar`` calls: the module lists the block prefetch casts (made
    inside ``prefetch_queue_pop``) apart from the ones a layer's own ``cast_bias_weight`` makes for it
    alone (it does when no prefetch record waits on the layer)."""

    def __init__(self, monkeypatch):
        self.in_prefetch = False
        self.prefetch_casts: list[list] = []
        self.layer_casts: list[list] = []
        real_cast = comfy.ops.cast_modules_with_vbar

        def recording_cast(comfy_modules, *args, **kwargs):
            (self.prefetch_casts if self.in_prefetch else self.layer_casts).append(list(comfy_modules))
            return real_cast(comfy_modules, *args, **kwargs)

        monkeypatch.setattr(comfy.ops, "cast_modules_with_vbar", recording_cast)

    def pop(self, queue, dev, block):
        import comfy.model_prefetch

        self.in_prefetch = True
        try:
            comfy.model_prefetch.prefetch_queue_pop(queue, dev, block)
        finally:
            self.in_prefetch = False


def _prefetch_blocks(recorder: _CastRecorder, dm, dev):
    """Run ``dm``'s Flux blocks through ComfyUI's block prefetch queue (``comfy.model_prefetch``, ComfyUI
    0.31+), the way newer ComfyUI's DiTs run theirs (LTX-2, MiniMax H3 in 0.33; most DiTs in 0.38): before
    each block, ``prefetch_queue_pop`` releases the previous block's casts and casts every layer of the
    next one with a VBAR slot at once (``cast_modules_with_vbar``: pins resident pages, streams the rest on
    an offload stream); each layer's ``cast_bias_weight`` then takes its weight from that prefetch. Flux
    itself does not use the queue in 0.33, so forward pre-hooks make the same calls around its blocks.
    Returns the hooks."""
    import comfy.model_prefetch

    blocks = [*dm.double_blocks, *dm.single_blocks]
    state = {"queue": None}

    def before_block(block, _args):
        if block is blocks[0]:
            options = {"prefetch_dynamic_vbars": True}  # what model_base sets for a Dynamic VRAM model
            state["queue"] = comfy.model_prefetch.make_prefetch_queue(list(blocks), dev, options)
            assert state["queue"] is not None, "ComfyUI did not make a prefetch queue on this CUDA device"
        recorder.pop(state["queue"], dev, block)

    def after_blocks(_module, _args):
        recorder.pop(state["queue"], dev, None)

    hooks = [block.register_forward_pre_hook(before_block) for block in blocks]
    hooks.append(dm.final_layer.register_forward_pre_hook(after_blocks))
    return hooks


def test_block_prefetch_of_newer_comfyui_streams_quantized_layers(monkeypatch):
    """ComfyUI 0.31+ casts a whole block's Dynamic VRAM layers ahead of the block (``comfy.model_prefetch``)
    and leaves each layer a ``_prefetch`` record that its ``cast_bias_weight`` consumes instead of casting
    the layer again. LowBit's quantized layers, partly streamed and with a LoRA patched on the fly, must
    take their weights from it, give the same output as without it, and leave no prefetch state behind."""
    if not dynamic_vram_on():
        pytest.skip("Dynamic VRAM (comfy-aimdo's ModelPatcherDynamic) needs a CUDA device: run with "
                    "LOWBIT_TEST_DEVICE=cuda LOWBIT_TEST_DYNAMIC_VRAM=1 (tests/gpu/README.md)")
    prefetch = pytest.importorskip("comfy.model_prefetch", reason="ComfyUI before 0.31 has no block prefetch")
    if not hasattr(prefetch, "make_prefetch_queue"):
        pytest.skip("this ComfyUI's comfy.model_prefetch has no block prefetch queue")
    import comfy.sd

    float_sd = tiny_flux_state_dict(TinyFluxConfig(hidden_size=DYNAMIC_VRAM_HIDDEN), seed=0)
    float_model = load_stock(float_sd)
    quantized = quantize_model(float_model, Policy(mode="int8_convrot"))
    layers = {name for name, _, _ in quantized_layers(quantized)}
    lora = _lora_on_every_quantized_layer(quantized, float_sd)
    with_lora = comfy.sd.load_lora_for_models(quantized, None, lora, 1.0, 0.0)[0]
    reference = run_flux(comfy.sd.load_lora_for_models(float_model, None, lora, 1.0, 0.0)[0])

    run_flux(with_lora)
    vbar = with_lora.model.dynamic_vbars[with_lora.load_device]
    resident_bytes = vbar.loaded_size()
    loaded = next(m for m in comfy.model_management.current_loaded_models if m.model is with_lora)
    assert loaded.model_unload(memory_to_free=resident_bytes // 2) is False, "the model should stay partly loaded"
    dm = with_lora.model.diffusion_model
    names = {module: name for name, module in dm.named_modules()}

    def cast_names(casts):
        return {names[m] for modules in casts for m in modules if m in names}

    recorder = _CastRecorder(monkeypatch)
    plain_out = run_flux(with_lora, load=False)
    assert layers <= cast_names(recorder.layer_casts), "without the queue every layer casts itself"
    recorder.layer_casts.clear()

    hooks = _prefetch_blocks(recorder, dm, with_lora.load_device)
    try:
        prefetched_out = run_flux(with_lora, load=False)
        left = [name for name, m in dm.named_modules() if hasattr(m, "_prefetch")]
    finally:
        for hook in hooks:
            hook.remove()
        prefetch.cleanup_prefetch_queues()

    assert layers <= cast_names(recorder.prefetch_casts), \
        f"layers the prefetch never cast: {sorted(layers - cast_names(recorder.prefetch_casts))[:5]}"
    recast = layers & cast_names(recorder.layer_casts)
    assert not recast, f"layers cast again despite the prefetch: {sorted(recast)[:5]}"
    assert not left, f"prefetch state left behind after the last block: {left[:5]}"
    streamed = [name for name in layers if dm.get_submodule(name)._v_signature is None]
    assert streamed, "want a partly loaded model: every quantized layer stayed resident"
    for name, fmt, _ in quantized_layers(with_lora):
        assert fmt == "int8_convrot", name
    # the same weights reach the kernels with or without the prefetch: the outputs agree to rounding
    assert sqnr_db(plain_out, prefetched_out) > 60.0, sqnr_db(plain_out, prefetched_out)
    with_sqnr = sqnr_db(reference, prefetched_out)
    assert with_sqnr > 22.0, with_sqnr


def test_module_moves_keep_the_weight_quantized(int8_model):
    layer = int8_model.model.diffusion_model.get_submodule(LAYER)
    qdata = layer.weight._qdata
    dtype = layer.weight.dtype
    try:
        layer.to(torch.bfloat16)
        assert isinstance(layer.weight, QuantizedTensor) and isinstance(layer.weight, torch.nn.Parameter)
        assert layer.weight.dtype == torch.bfloat16 and torch.equal(layer.weight._qdata, qdata)
    finally:
        layer.to(dtype)
    assert layer.weight.dtype == dtype


def test_state_dict_is_the_native_form_and_sizes_count_stored_bytes(int8_model, float_model):
    layer = int8_model.model.diffusion_model.get_submodule(LAYER)
    sd = layer.state_dict(prefix=f"{LAYER}.")
    expected = layer_tensors(get_format(layer.lowbit_format), LAYER, layer.weight)
    assert set(sd) == set(expected) | {f"{LAYER}.bias"}
    for key, tensor in expected.items():
        assert torch.equal(sd[key], tensor), key
    # ComfyUI's memory accounting sees the stored bytes: float model minus float weights plus native tensors
    quantized = quantized_layers(int8_model)
    replaced = {f"diffusion_model.{name}.weight" for name, _, _ in quantized}
    expected = sum(t.nbytes for k, t in float_model.model.state_dict().items() if k not in replaced)
    expected += sum(t.nbytes for name, fmt, qt in quantized for t in layer_tensors(get_format(fmt), name, qt).values())
    assert int8_model.model_size() == expected < 0.6 * float_model.model_size()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_requantize_of_a_patched_weight_keeps_the_format(fmt):
    codec = get_format(fmt)
    n = 32 if fmt != "fp8" else 64
    w = torch.randn(n, 256, generator=torch.Generator().manual_seed(1)) / 16
    qt = requantize(codec, w, dtype=torch.float32, seed=12345, layer="test")
    assert qt._layout_cls == codec.spec.layout
    assert sqnr_db(w, qt.dequantize().float()) > (8.0 if codec.spec.weight_bits == 4 else 25.0)


def test_module_attr_reads_what_getattr_reads():
    """The hot path's ``_module_attr`` gives ``getattr(module, name, default)`` for every kind of attribute a
    ComfyUI layer has: instance values, parameters, buffers, class defaults, properties, absent names."""
    from lowbit.nodes.comfy_ops import _module_attr

    class Layer(comfy.ops.disable_weight_init.Linear):
        flag = "class default"

        @property
        def computed(self):
            return self.in_features * 2

    layer = Layer(4, 3)
    layer.register_buffer("input_scale", torch.ones(1))
    layer.weight_function = [len]
    for name in ("weight", "bias", "input_scale", "weight_function", "bias_function", "flag", "computed",
                 "comfy_force_cast_weights", "quant_format", "_full_precision_mm", "in_features"):
        for default in (None, False, ()):
            expected = getattr(layer, name, default)
            assert _module_attr(layer, name, default) is expected, name
    layer.flag = "instance"
    assert _module_attr(layer, "flag") == "instance"
