"""Show 2 (core issue): files LowBit writes in the native formats load in real, stock ComfyUI bit for bit.

For each ComfyUI-native format (int8, int8_convrot, fp8, w4a4, w4a8) the bf16 tiny Flux is quantized
by ``quantize_state_dict``, written with the checkpoint writer, and loaded by stock ComfyUI
(``comfy.utils.load_torch_file`` + ``comfy.sd.load_diffusion_model_state_dict``, i.e. stock
``mixed_precision_ops``). Every quantized weight must come back with the same qdata and params as
LowBit's codec reads from the same entries. The INT8 and FP8 files then run in stock ComfyUI and the
outputs are compared with LowBit's in-memory quantization of the float model (``quantize_model``):
bit for bit on the CPU, where both run comfy-kitchen's eager numerics; on CUDA stock runs kitchen's
kernels and LowBit its own, so there LowBit's loader must match the in-memory model bit for bit and
stock must agree within ``comfy_helpers.CUDA_STOCK_AGREEMENT_DB``. The 4-bit files are checked tensor
by tensor and run through kitchen's layouts and LowBit's loader.
"""

from __future__ import annotations

import functools

import pytest
import torch

from comfy_helpers import (assert_matches_stock, assert_same_quantized_tensor, device, flux_runner, load_stock,
                           require_comfy, run_flux, sqnr_db, tiny_flux_bf16)

require_comfy()

import comfy.ops  # noqa: E402
import comfy.utils  # noqa: E402
from comfy_kitchen.tensor import QuantizedTensor  # noqa: E402

from lowbit.nodes.comfy_ops import LowBitOpsConfig, default_dequantize_formats, lowbit_ops  # noqa: E402
from lowbit.nodes.loader import LoadSettings, load_lowbit_diffusion_model  # noqa: E402
from lowbit.nodes.model_quant import quantize_model, quantized_layers  # noqa: E402
from lowbit.quant.checkpoint import save_checkpoint  # noqa: E402
from lowbit.quant.native import decode_comfy_quant, load_layer  # noqa: E402
from lowbit.quant.policy import Policy  # noqa: E402
from lowbit.quant.quantize import quantize_state_dict  # noqa: E402

NATIVE_FORMATS = ("int8", "int8_convrot", "fp8", "w4a4", "w4a8")
#: kitchen's W4A8 quantizer (Lloyd-Max codebooks) takes seconds per layer on a CPU, so the W4A8 file
#: quantizes the two attention layers of the first double block and keeps the rest float
W4A8_ONLY = r"^(?!double_blocks\.0\.img_attn\.)"
# Denoiser-output SQNR floors against the float tiny Flux (measured on CPU: int8 26.9 dB,
# int8_convrot 31.2, fp8 28.4 (weight-only on CPU), w4a4 11.2, w4a8 (2 layers) 24.9)
MIN_OUTPUT_SQNR = {"int8": 22.0, "int8_convrot": 26.0, "fp8": 23.0, "w4a4": 8.0, "w4a8": 20.0}


def _policy(fmt: str) -> Policy:
    return Policy(mode=fmt, extra_keep_float=(W4A8_ONLY,) if fmt == "w4a8" else ())


@functools.lru_cache(maxsize=None)
def _native_file(fmt: str, tmp_dir: str):
    # quantized on the device the in-memory path uses: CPU and CUDA kernels can round a scale differently
    state_dict, plan = quantize_state_dict(tiny_flux_bf16(), _policy(fmt), device=device())
    path = save_checkpoint(state_dict, f"{tmp_dir}/tiny_flux_{fmt}.safetensors", overwrite=True)
    return str(path), state_dict, plan


@pytest.fixture(scope="module")
def tmp_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("native"))


@functools.lru_cache(maxsize=None)
def _loader_model(fmt: str, tmp_dir: str):
    path, _, _ = _native_file(fmt, tmp_dir)
    return load_lowbit_diffusion_model(path, LoadSettings(mode="native"))


@functools.lru_cache(maxsize=None)
def _loader_output(fmt: str, tmp_dir: str) -> torch.Tensor:
    return run_flux(_loader_model(fmt, tmp_dir))


def _stock_load(path: str, **model_options):
    return load_stock(comfy.utils.load_torch_file(path), **model_options)


@pytest.mark.parametrize("fmt", NATIVE_FORMATS)
def test_stock_comfyui_loads_every_quantized_weight_bit_identically(fmt, tmp_dir):
    path, state_dict, plan = _native_file(fmt, tmp_dir)
    assert plan.quantized and all(d.format == fmt for d in plan.quantized), plan.table()
    stock = _stock_load(path)
    assert type(stock.model.diffusion_model.img_in).__qualname__.startswith("mixed_precision_ops")
    modules = dict(stock.model.diffusion_model.named_modules())
    for decision in plan.quantized:
        layer = decision.name
        entries = {k[len(layer) + 1:]: v for k, v in state_dict.items() if k.startswith(f"{layer}.") and "." not in k[len(layer) + 1:]}
        conf = decode_comfy_quant(layer, entries.pop("comfy_quant"))
        codec, ours = load_layer(layer, entries, conf)
        assert codec.spec.name == fmt
        stock_weight = modules[layer].weight
        assert isinstance(stock_weight, QuantizedTensor), f"{layer}: stock ComfyUI did not load it quantized"
        assert_same_quantized_tensor(layer, ours, stock_weight)
    # the float layers the plan kept are float in stock ComfyUI too
    for decision in plan.layers:
        if decision.format is None:
            assert not isinstance(modules[decision.name].weight, QuantizedTensor), decision.name


@pytest.mark.parametrize("fmt", ("int8", "int8_convrot"))
def test_int8_stock_and_in_memory_outputs_match(fmt, tmp_dir, float_model, float_output):
    """Same tensors as the file; LowBit's loader and in-memory model bit for bit (same kernels); stock
    ComfyUI bit for bit on the CPU, within its kernels' rounding on CUDA (see assert_matches_stock)."""
    path, _, plan = _native_file(fmt, tmp_dir)
    stock = _stock_load(path)
    ours = quantize_model(float_model, Policy(mode=fmt))
    # same plan, same quantized tensors as the file stock ComfyUI read
    assert {name for name, _, _ in quantized_layers(ours)} == {d.name for d in plan.quantized}
    stock_modules = dict(stock.model.diffusion_model.named_modules())
    for name, fmt_name, qt in quantized_layers(ours):
        assert fmt_name == fmt
        assert_same_quantized_tensor(name, qt, stock_modules[name].weight)
    stock_out, ours_out = run_flux(stock), run_flux(ours)
    loader_out = _loader_output(fmt, tmp_dir)
    assert torch.equal(loader_out, ours_out), f"max |diff| {(loader_out - ours_out).abs().max():.3e}"
    assert_matches_stock(fmt, flux_runner(stock, stock_out), flux_runner(ours, ours_out),
                         flux_runner(float_model, float_output))
    assert sqnr_db(float_output, ours_out) > MIN_OUTPUT_SQNR[fmt]
    assert not torch.equal(ours_out, float_output)


def test_fp8_weights_match_and_outputs_agree_within_the_activation_rounding(tmp_dir, float_model, float_output):
    """FP8 against stock ComfyUI, without FP8 tensor cores (a CPU) and with FP8 compute.

    Without FP8 compute ComfyUI runs the layer as dequantized weight x float activation (its
    ``disabled`` list); LowBit does the same (``default_dequantize_formats``), so the outputs differ
    only by how the float product is decomposed (F.linear vs kitchen's mm + add): > 100 dB. FP8
    compute is then emulated on both sides (kitchen's eager FP8 GEMM) for the comparison below.

    With FP8 compute, stock ComfyUI quantizes a layer's activations with a *unit* scale when the
    file has no ``input_scale`` (clipping at +-448), while LowBit's codec scales them by their
    abs-max (quant/layouts/fp8_tensorwise.py). Both round every activation to e4m3 with the same
    relative precision, so on this model the two agree only to the activation rounding itself
    (~25 dB apart, each 25-26 dB from float); the honest check is that LowBit is as close to float
    as stock ComfyUI is, within 1.5 dB. (Activations above 448, where the two really differ, are
    checked layer by layer in test_comfy_ops.py.)
    """
    path, _, _ = _native_file("fp8", tmp_dir)
    stock = _stock_load(path)
    ours = quantize_model(float_model, Policy(mode="fp8"))
    stock_modules = dict(stock.model.diffusion_model.named_modules())
    for name, _, qt in quantized_layers(ours):
        assert_same_quantized_tensor(name, qt, stock_modules[name].weight)
    stock_out, ours_out = run_flux(stock), run_flux(ours)
    if "float8_e4m3fn" in default_dequantize_formats(device()):
        assert sqnr_db(stock_out, ours_out) > 100.0
        assert sqnr_db(float_output, ours_out) > MIN_OUTPUT_SQNR["fp8"]
        fp8_compute = comfy.ops.mixed_precision_ops({}, torch.float32, disabled=[])
        stock_out = run_flux(_stock_load(path, custom_operations=fp8_compute))
        ours_out = run_flux(_stock_load(path, custom_operations=lowbit_ops(LowBitOpsConfig(compute_dtype=torch.float32))))
    stock_sqnr, ours_sqnr = sqnr_db(float_output, stock_out), sqnr_db(float_output, ours_out)
    assert ours_sqnr > MIN_OUTPUT_SQNR["fp8"] - 3.0 and stock_sqnr > MIN_OUTPUT_SQNR["fp8"] - 3.0
    assert ours_sqnr > stock_sqnr - 1.5, (ours_sqnr, stock_sqnr)
    assert sqnr_db(stock_out, ours_out) > 20.0
    assert not torch.equal(stock_out, ours_out), "the activation scales differ, so should the outputs"


@pytest.mark.parametrize("fmt", ("w4a4", "w4a8"))
def test_4bit_files_run_through_kitchen_layouts_and_the_lowbit_loader(fmt, tmp_dir, float_output):
    path, _, plan = _native_file(fmt, tmp_dir)
    stock = _stock_load(path)
    ours = load_lowbit_diffusion_model(path, LoadSettings(mode="native"))
    stock_modules = dict(stock.model.diffusion_model.named_modules())
    our_modules = dict(ours.model.diffusion_model.named_modules())
    x = torch.randn(3, 5, 256, generator=torch.Generator().manual_seed(1))
    reference = tiny_flux_bf16()
    for decision in plan.quantized:
        name = decision.name
        module = our_modules[name]
        assert module.lowbit_format == fmt
        assert_same_quantized_tensor(name, module.weight, stock_modules[name].weight)
        if module.in_features != x.shape[-1]:
            continue
        w, b = reference[f"{name}.weight"].float(), reference[f"{name}.bias"].float()
        stock_weight = stock_modules[name].weight.to(x.dtype)  # as ComfyUI's forward casts it
        kitchen = torch.nn.functional.linear(x, stock_weight, b)  # kitchen's layout op, directly
        with torch.no_grad():
            lowbit = module(x)
        assert torch.equal(lowbit, kitchen), name
        assert sqnr_db(torch.nn.functional.linear(x, w, b), lowbit) > (9.0 if fmt == "w4a4" else 14.0), name
    out = _loader_output(fmt, tmp_dir)
    assert torch.isfinite(out).all()
    assert sqnr_db(float_output, out) > MIN_OUTPUT_SQNR[fmt]


@pytest.mark.parametrize("fmt", ("w4a4", "w4a8"))
def test_4bit_stock_run_matches_the_lowbit_loader_where_stock_runs(fmt, tmp_dir, float_model, float_output):
    """Stock ComfyUI 0.30 + kitchen 0.2.27 does run these on a CPU: same bits as LowBit's loader (on
    CUDA: within the kernels' rounding, see assert_matches_stock)."""
    path, _, _ = _native_file(fmt, tmp_dir)
    ours = _loader_output(fmt, tmp_dir)
    stock_model = _stock_load(path)
    try:
        stock = run_flux(stock_model)
    except Exception as err:  # the failure reported on other kitchen builds; LowBit's loader must still run
        pytest.skip(f"stock ComfyUI cannot run {fmt} here: {type(err).__name__}: {err}")
    assert_matches_stock(fmt, flux_runner(stock_model, stock), flux_runner(_loader_model(fmt, tmp_dir), ours),
                         flux_runner(float_model, float_output))
