"""MiniMax H3's gated MLP in real ComfyUI: the SwiGLU computed inside LowBit's activation quantization.

ComfyUI's MiniMax ``MLP`` computes ``comfy.ops.linear_input_act(fc2, fc1(x), "swiglu")``. On a model LowBit
quantized, that call is routed through ``fc2`` (``nodes/input_act.py``), and ``silu(gate) * up`` reaches the
layer uncomputed (``quant/deferred.py``'s ``defer_swiglu``): once the dispatcher has settled ``fc2``'s plan on
our Triton kernels (the CPU interpreter; ``LOWBIT_TEST_DEVICE=cuda``: the GPU), the act-quant kernel computes
it from ``fc1``'s output. The codes are those of the tensor ComfyUI's eager form computes (up to the rare code
that the last bit of the SiLU's exponential moves), and so is the output.
"""

from __future__ import annotations

import pytest
import torch

from comfy_helpers import TritonFirst, device, random_weights, require_comfy, sqnr_db

require_comfy()

import comfy.ldm.minimax.model as minimax_model  # noqa: E402
import comfy.model_management  # noqa: E402
import comfy.ops  # noqa: E402
import comfy.sd  # noqa: E402

from kernels_helpers import needs_triton_interpreter  # noqa: E402
from lowbit.kernels import dispatch, triton_act_quant  # noqa: E402
from lowbit.kernels.prologue import SwigluPrologue  # noqa: E402
from lowbit.nodes import input_act  # noqa: E402
from lowbit.nodes.comfy_ops import is_lowbit_linear  # noqa: E402
from lowbit.nodes.model_quant import quantize_model  # noqa: E402
from lowbit.quant.policy import Policy  # noqa: E402

pytestmark = needs_triton_interpreter() if device().type == "cpu" else []

HIDDEN, FFN = 256, 256
#: the MLP's output SQNR against the float MLP, both linears quantized (measured on the CPU: 35.5, 24.7, 10.5 dB)
FLOOR_DB = {"int8_convrot": 30.0, "fp8_rowwise": 21.0, "w4a4": 8.0}


def _minimax_state_dict() -> dict[str, torch.Tensor]:
    """A one-block MiniMax H3 with random weights (width 256, two heads of 128, FFN 256), as ComfyUI detects it."""
    return random_weights(lambda: minimax_model.MiniMaxH3Model(
        hidden_size=HIDDEN, num_layers=1, token_refiner_num_layers=1, num_attention_heads=2, attention_head_dim=128,
        ffn_hidden_size=FFN, text_dim=256, time_embed_hidden_size=256, time_embed_dim=128, device="meta",
        operations=comfy.ops.disable_weight_init))


@pytest.fixture(scope="module")
def minimax():
    float_model = comfy.sd.load_diffusion_model_state_dict(_minimax_state_dict())
    assert type(float_model.model.diffusion_model.blocks[0].mlp) is minimax_model.MLP
    return float_model


@pytest.mark.parametrize("fmt", ("int8_convrot", "fp8_rowwise", "w4a4"))
def test_the_swiglu_reaches_fc2_uncomputed_and_gives_comfyuis_codes(minimax, fmt, monkeypatch):
    quantized = quantize_model(minimax, Policy(mode=fmt))
    mlp = quantized.model.diffusion_model.blocks[0].mlp
    assert getattr(type(mlp), input_act.ROUTED_ATTR, False) and isinstance(mlp, minimax_model.MLP)
    assert is_lowbit_linear(mlp.fc2) and is_lowbit_linear(mlp.fc1)
    float_mlp = minimax.model.diffusion_model.blocks[0].mlp
    comfy.model_management.load_models_gpu([minimax, quantized])
    dev = quantized.load_device
    dtype = float_mlp.fc1.weight.dtype  # the model's compute dtype (fp32 on the CPU, bf16 on a GPU)
    x = torch.randn(1, 7, HIDDEN, generator=torch.Generator().manual_seed(3)).to(device=dev, dtype=dtype)

    seen, differing = [], []
    real = triton_act_quant.act_quant_triton

    def spy(src, *args, **kwargs):
        out = real(src, *args, **kwargs)
        seen.append(type(src).__name__)
        if isinstance(src, SwigluPrologue):  # the same kernel on the tensor ComfyUI's eager form computes
            gate, up = src.x.chunk(2, dim=-1)
            ref = real(comfy.ops.INPUT_ACT_EAGER["swiglu"](src.x), *args, **{**kwargs, "split": "pow2"})
            assert torch.equal(src.materialize(), torch.nn.functional.silu(gate) * up)
            diff = (out[0].float() - ref[0].float()).abs()
            step = 1.0 if out[0].dtype == torch.int8 else ref[0].float().abs() * 0.125 + 448 * 2**-7
            differing.append(((diff > 0).float().mean().item(), bool((diff <= step).all()),
                              ((out[1] - ref[1]).abs() / ref[1]).max().item()))
        return out

    monkeypatch.setattr(triton_act_quant, "act_quant_triton", spy)
    with torch.no_grad():
        with dispatch.use_dispatcher(TritonFirst(measure=False, fast=False)):  # no settled plans: all computed
            unfused = mlp(x).float()
        assert seen and "SwigluPrologue" not in seen
        with dispatch.use_dispatcher(TritonFirst(measure=False)):
            first = mlp(x).float()  # settles fc2's plan, then runs the fused plan it settled
            seen.clear()
            fused = mlp(x).float()
        reference = float_mlp(x).float()
    assert seen.count("SwigluPrologue") == 1  # fc2's input; fc1's is the block's own tensor
    assert torch.equal(first, fused)
    for frac, within_a_step, scale_rel in differing:
        assert frac < 2e-3 and within_a_step and scale_rel < 2**-7
    # as accurate as the unfused call, against the float MLP
    assert sqnr_db(reference, fused) >= sqnr_db(reference, unfused) - 0.5
    assert sqnr_db(reference, fused) > FLOOR_DB[fmt]


def test_a_hooked_or_unfused_fc2_gets_the_computed_swiglu(minimax):
    """``fuse_inputs=False``, or a forward hook on ``fc2`` (a ``dynamic`` LoRA): ``fc2`` sees an ordinary tensor,
    ComfyUI's eager SwiGLU, exactly."""
    for quantized, hook in ((quantize_model(minimax, Policy(mode="int8_convrot"), fuse_inputs=False), False),
                            (quantize_model(minimax, Policy(mode="int8_convrot")), True)):
        mlp = quantized.model.diffusion_model.blocks[0].mlp
        comfy.model_management.load_models_gpu([quantized])
        dtype = minimax.model.diffusion_model.blocks[0].mlp.fc1.weight.dtype
        x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(9)).to(quantized.load_device, dtype)
        inputs = []
        handle = mlp.fc2.register_forward_pre_hook(lambda module, args: inputs.append(args[0])) if hook else None
        try:
            with torch.no_grad():
                h = mlp.fc1(x)
                expected = comfy.ops.INPUT_ACT_EAGER["swiglu"](h)
                if hook:
                    mlp(x)
                    assert len(inputs) == 1 and type(inputs[0]) is torch.Tensor
                    assert torch.equal(inputs[0], expected)
                else:
                    assert torch.equal(input_act.linear_input_act(mlp.fc2, h, "swiglu"), mlp.fc2(expected))
        finally:
            if handle is not None:
                handle.remove()
