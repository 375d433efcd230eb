"""ComfyUI's fused ``comfy.ops.linear_input_act`` on LowBit layers, in real ComfyUI with a real (tiny) Wan 2.1 model.

ComfyUI's ``WanFeedForward`` computes ``ffn.2`` with ``comfy.ops.linear_input_act``, which for an INT8
weight (LowBit's ``int8`` / ``int8_convrot``) runs kitchen's INT8 linear without calling the layer: its
forward hooks (LowBit's ``dynamic`` LoRA) and LowBit's forward never ran. These tests pin down that LowBit
routes those calls through the layer (``nodes/input_act.py``) and what a user gets from it.
"""

from __future__ import annotations

import pytest
import torch

from comfy_helpers import random_weights, require_comfy, sqnr_db

require_comfy()

import comfy.ldm.wan.model as wan_model  # noqa: E402
import comfy.model_management  # noqa: E402
import comfy.ops  # noqa: E402
import comfy.sd  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from lowbit.nodes import input_act  # noqa: E402
from lowbit.nodes.comfy_ops import is_lowbit_linear  # noqa: E402
from lowbit.nodes.lora_nodes import LoraEntry, apply_lora_stack  # noqa: E402
from lowbit.nodes.model_quant import quantize_model  # noqa: E402
from lowbit.quant.policy import Policy  # noqa: E402

FFN_OUT = "blocks.0.ffn.2"


def _wan_state_dict() -> dict[str, torch.Tensor]:
    """A one-block Wan 2.1 t2v with random weights (dim 256, two heads; ComfyUI's detection needs a 4096 text width)."""
    return random_weights(lambda: wan_model.WanModel(
        model_type="t2v", dim=256, ffn_dim=512, freq_dim=256, text_dim=4096, num_heads=2, num_layers=1, in_dim=16,
        out_dim=16, device="meta", operations=comfy.ops.disable_weight_init))


def _run(model_patcher, wrappers: bool = False) -> torch.Tensor:
    """One call of the model (``wrappers``: with the patcher's wrappers in ``transformer_options``, as ComfyUI's
    sampler passes them)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 16, 1, 8, 8, generator=gen)
    context = torch.randn(1, 8, 4096, generator=gen)
    comfy.model_management.load_models_gpu([model_patcher])
    dev = model_patcher.load_device
    options = {"transformer_options": {"wrappers": model_patcher.wrappers}} if wrappers else {}
    with torch.no_grad():
        out = model_patcher.model.apply_model(x.to(dev), torch.tensor([0.7], device=dev),
                                              c_crossattn=context.to(dev), **options)
    return out.float().cpu()


def _lora(path, sd) -> LoraEntry:
    """A strong rank-8 LoRA on ``blocks.0.ffn.2`` (the layer ComfyUI computes through linear_input_act)."""
    n, k = sd[f"{FFN_OUT}.weight"].shape
    gen = torch.Generator().manual_seed(5)
    down = torch.randn(8, k, generator=gen) / k**0.5
    up = torch.randn(n, 8, generator=gen) * 3.0 * float(sd[f"{FFN_OUT}.weight"].float().std())
    save_file({f"diffusion_model.{FFN_OUT}.lora_down.weight": down.to(torch.bfloat16).contiguous(),
               f"diffusion_model.{FFN_OUT}.lora_up.weight": up.to(torch.bfloat16).contiguous()}, str(path))
    return LoraEntry("ffn_lora.safetensors", str(path), 1.0)


@pytest.fixture(scope="module")
def wan():
    sd = _wan_state_dict()
    float_model = comfy.sd.load_diffusion_model_state_dict(dict(sd))
    assert type(float_model.model.diffusion_model.blocks[0].ffn) is wan_model.WanFeedForward
    quantized = quantize_model(float_model, Policy(mode="int8_convrot"))
    return sd, float_model, quantized


def test_the_ffn_of_a_quantized_wan_routes_its_linear_input_act_call_through_the_layer(wan, monkeypatch):
    sd, float_model, quantized = wan
    ffn = quantized.model.diffusion_model.blocks[0].ffn
    assert getattr(type(ffn), input_act.ROUTED_ATTR, False) and isinstance(ffn, wan_model.WanFeedForward)
    assert is_lowbit_linear(ffn[2]) and ffn[2].weight._layout_cls == "TensorWiseINT8Layout"

    calls = []
    handle = ffn[2].register_forward_pre_hook(lambda module, args: calls.append(args[0].shape))
    stock_calls = []
    stock = comfy.ops.linear_input_act
    monkeypatch.setattr(comfy.ops, "linear_input_act", lambda *a, **k: stock_calls.append(a[2]) or stock(*a, **k))
    try:
        out = _run(quantized)
    finally:
        handle.remove()
    assert len(calls) == 1 and not stock_calls  # LowBit's layer ran; ComfyUI's fused function did not
    reference = _run(float_model)
    assert sqnr_db(out, reference) > 25  # int8_convrot of the whole (tiny) model, through LowBit's layers


def test_a_float_layer_keeps_comfyuis_own_function(wan, monkeypatch):
    """A layer LowBit does not run and nobody hooked goes to ComfyUI's function, looked up at call time."""
    linear = torch.nn.Linear(8, 4)
    seen = []
    monkeypatch.setattr(comfy.ops, "linear_input_act", lambda lin, x, act, **extra: seen.append((act, extra)) or x)
    x = torch.randn(2, 8)
    assert input_act.linear_input_act(linear, x, "gelu_tanh") is x
    assert seen == [("gelu_tanh", {})]
    linear.register_forward_hook(lambda module, args, out: out)
    out = input_act.linear_input_act(linear, x, "gelu_tanh")
    assert torch.equal(out, linear(torch.nn.functional.gelu(x, approximate="tanh"))) and len(seen) == 1


def test_an_activation_lowbit_does_not_know_goes_to_comfyuis_function_with_one_warning(monkeypatch, caplog):
    linear = torch.nn.Linear(8, 4)
    linear.register_forward_hook(lambda module, args, out: out)
    seen = []
    monkeypatch.setattr(comfy.ops, "linear_input_act", lambda lin, x, act, **extra: seen.append(act) or x)
    x = torch.randn(2, 8)
    with caplog.at_level("WARNING"):
        for _ in range(3):
            assert input_act.linear_input_act(linear, x, "future_act") is x
    assert seen == ["future_act"] * 3
    assert sum("future_act" in r.getMessage() for r in caplog.records) == 1


def test_newer_comfyuis_residual_and_rms_norm_arguments_are_computed_as_comfyui_defines_them():
    """ComfyUI >= 0.36 passes ``act_weight``/``act_eps`` (``"rms_norm"``) and ``residual``/``residual_scale``."""
    import comfy.rmsnorm

    linear = torch.nn.Linear(8, 4)
    linear.register_forward_hook(lambda module, args, out: out)  # called as a module
    gen = torch.Generator().manual_seed(3)
    x, w, res, scale = (torch.randn(2, 8, generator=gen), torch.rand(8, generator=gen) + 0.5,
                        torch.randn(2, 4, generator=gen), torch.randn(2, 4, generator=gen))
    out = input_act.linear_input_act(linear, x, "rms_norm", act_weight=w, act_eps=1e-6, residual=res,
                                     residual_scale=scale)
    expected = res + scale * linear(comfy.rmsnorm.rms_norm(x, w, 1e-6))
    torch.testing.assert_close(out, expected)


def _ffn_output(model_patcher) -> torch.Tensor:
    """The first block's FFN output in one call of the model (the block scales it by a small random gate)."""
    seen = []
    handle = model_patcher.model.diffusion_model.blocks[0].ffn.register_forward_hook(
        lambda module, args, out: seen.append(out.float().cpu()))
    try:
        _run(model_patcher)
    finally:
        handle.remove()
    assert len(seen) == 1
    return seen[0]


def test_a_dynamic_lora_on_the_ffn_output_layer_takes_effect(wan, tmp_path):
    """LowBit's ``dynamic`` LoRA is a forward hook: before the routing, ComfyUI's fused call skipped it on ffn.2."""
    sd, float_model, quantized = wan
    entry = _lora(tmp_path / "ffn_lora.safetensors", sd)
    with_lora, report = apply_lora_stack(quantized, [entry], "dynamic")
    float_lora, _ = apply_lora_stack(float_model, [entry], "dynamic")
    base, lora_out = _ffn_output(quantized), _ffn_output(with_lora)
    float_base, float_lora_out = _ffn_output(float_model), _ffn_output(float_lora)
    # the LoRA moves the float FFN's output a lot; the quantized FFN with it lands where the float one does
    assert sqnr_db(float_lora_out, float_base) < 15
    assert sqnr_db(float_lora_out, lora_out) > sqnr_db(float_lora_out, base) + 10
    assert sqnr_db(float_lora_out, lora_out) > 25


def test_a_dynamic_lora_on_a_stock_loaded_int8_wan_takes_effect(wan, tmp_path):
    """A native ``int8_convrot`` Wan file loaded by ComfyUI's own loader (kitchen's layers, not LowBit's), with a
    LowBit ``dynamic`` stack: ComfyUI's fused call would run ffn.2 without the stack's hook."""
    from safetensors.torch import save_file as save

    from lowbit.quant.convert import convert_file

    sd, float_model, _ = wan
    src, dst = tmp_path / "wan_bf16.safetensors", tmp_path / "wan_int8.safetensors"
    save({k: v.contiguous() for k, v in sd.items()}, str(src))
    convert_file(src, dst, Policy(mode="int8_convrot"))
    stock = comfy.sd.load_diffusion_model(str(dst))
    ffn2 = stock.model.diffusion_model.blocks[0].ffn[2]
    assert not is_lowbit_linear(ffn2) and ffn2.weight._layout_cls == "TensorWiseINT8Layout"
    entry = _lora(tmp_path / "ffn_lora.safetensors", sd)
    with_lora, _ = apply_lora_stack(stock, [entry], "dynamic")
    float_lora, _ = apply_lora_stack(float_model, [entry], "dynamic")
    float_lora_out, base = _ffn_output(float_lora), _ffn_output(stock)
    lora_out = _ffn_output(with_lora)
    assert sqnr_db(float_lora_out, lora_out) > sqnr_db(float_lora_out, base) + 10
    assert sqnr_db(float_lora_out, lora_out) > 25


def test_swiglu_runs_as_comfyui_computes_it_eagerly(wan):
    """MiniMax's ``"swiglu"``: a LowBit layer gets ``linear(INPUT_ACT_EAGER["swiglu"](x))``."""
    _, _, quantized = wan
    linear = quantized.model.diffusion_model.blocks[0].ffn[2]  # a LowBit int8_convrot layer, 512 inputs
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(4)).to(linear.weight.dtype)
    comfy.model_management.load_models_gpu([quantized])
    x = x.to(quantized.load_device)
    with torch.no_grad():
        out = input_act.linear_input_act(linear, x, "swiglu")
        expected = linear(comfy.ops.INPUT_ACT_EAGER["swiglu"](x))
    assert torch.equal(out, expected)


def test_the_routed_ffn_compiles_fullgraph(wan, monkeypatch):
    """Compile Quantized Model (LowBit) on the quantized Wan, ``fullgraph=True``: Dynamo traces the routed forward
    (its globals read through LowBit's namespace) without a break, and aot_eager gives eager's exact output.
    (One block is no repeated block list: the node compiles the whole model, one graph.)"""
    import comfy.ldm.modules.attention
    from torch._dynamo.utils import counters

    from lowbit.nodes.compile import CompileSettings, compile_model, compile_wrapper

    # ComfyUI's CPU attention cannot be traced; the PyTorch one is what a CUDA install runs
    monkeypatch.setattr(wan_model, "optimized_attention", comfy.ldm.modules.attention.attention_pytorch)
    _, _, quantized = wan
    compiled = compile_model(quantized, CompileSettings(backend="aot_eager", fullgraph=True))
    twin = compiled.clone()
    from comfy.patcher_extension import WrappersMP

    from lowbit.nodes.compile import WRAPPER_KEY

    twin.remove_wrappers_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY)
    reference = _run(twin)
    before = counters["stats"]["unique_graphs"]
    out = _run(compiled, wrappers=True)
    state = compile_wrapper(compiled).state
    assert state.failure is None and state.regions == ("WanModel",)
    assert counters["stats"]["unique_graphs"] - before == 1
    assert torch.equal(out, reference)
