"""Qwen-Image's MLPs in real ComfyUI: the tanh GELU computed inside the down-projection's activation quantization.

ComfyUI's Qwen-Image ``FeedForward`` runs ``net = [GELU(proj), Dropout, Linear]``, its ``GELU`` module computing
``gelu(self.proj(x), approximate="tanh")`` itself (not an ``nn.GELU``). On a model LowBit quantized those ``GELU``
modules are swapped to a deferring subclass (per model; a stock model keeps its class): their output becomes a
deferred input (``quant/deferred.py``), the inactive dropout passes it on, and once the dispatcher has settled the
down-projection's plan on our Triton kernels (the CPU interpreter; ``LOWBIT_TEST_DEVICE=cuda``: the GPU) the act-quant
kernel computes the GELU from ``proj``'s output. The blocks' affine-free LayerNorms and their ``addcmul`` modulation
(``_modulate``) defer as Flux's do. The codes are those of the tensor ComfyUI computes (up to the rare code that the
last bit of tanh moves), and the output is as accurate as the unfused run's.
"""

from __future__ import annotations

import pytest
import torch

from comfy_helpers import (assert_fused_as_computed, device, fused_and_unfused, load_tiny_qwen,
                           quantized_with_deferring, require_comfy, run_qwen)

require_comfy()

import comfy.ldm.qwen_image.model as qwen_model  # noqa: E402

from kernels_helpers import interpreter_model_marks  # noqa: E402
from lowbit.nodes.comfy_ops import DeferredProjGELUMixin  # noqa: E402
from lowbit.quant.deferred import DeferredInput, materialize  # noqa: E402

pytestmark = interpreter_model_marks(device().type == "cpu")


@pytest.fixture(scope="module")
def qwen():
    model = load_tiny_qwen()
    return model, run_qwen(model)


@pytest.mark.parametrize("fmt", ("int8_convrot", "fp8_rowwise"))  # the 4-bit fused paths: tests/test_input_fusion.py
def test_qwen_mlps_and_norms_are_computed_inside_the_activation_quantization(qwen, fmt, monkeypatch):
    float_model, float_output = qwen
    model, gelus = quantized_with_deferring(float_model, fmt, qwen_model.GELU, DeferredProjGELUMixin)
    dm = model.model.diffusion_model
    assert len(gelus) == 2 * len(dm.transformer_blocks)  # the image and the text MLP of every block

    unfused, first, fused, prologues, differing = fused_and_unfused(model, run_qwen, monkeypatch)
    blocks = len(dm.transformer_blocks)
    # every MLP's down-projection takes the GELU uncomputed, and the image and text streams' two modulated norms
    # a block feed the q/k/v projections and the MLP's proj; q, k and v take one input, quantized once (the three
    # linears' GEMMs run on its codes): 2 x (1 + 1) act-quant launches a block
    assert prologues["GeluPrologue"] == 2 * blocks
    assert prologues["NormModPrologue"] == 4 * blocks
    assert_fused_as_computed(float_output, unfused, first, fused, differing)


def test_the_deferred_gelu_computes_as_comfyui_and_passes_the_dropout(qwen):
    from lowbit.nodes.comfy_ops import install_input_fusion

    dropout = qwen[0].model.diffusion_model.transformer_blocks[0].img_mlp.net[1]  # the model's own (p 0)
    # Qwen-Image's GELU module on its own (torch's Linear for proj), swapped as a quantized model's are
    act = torch.nn.Sequential(qwen_model.GELU(256, 1024, approximate="tanh", operations=torch.nn)).requires_grad_(False)
    assert install_input_fusion(act, {}) == 1
    act = act[0]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 256, generator=gen)
    for dtype in (torch.bfloat16, torch.float32):
        act.to(device=device(), dtype=dtype)  # the kernels' device: a CPU tensor defers only in the interpreter
        xd = x.to(device(), dtype)
        out = act(xd)
        assert isinstance(out, DeferredInput) and out.shape == (2, 5, 1024) and out.dtype == dtype
        assert torch.equal(out.materialize(), torch.nn.functional.gelu(act.proj(xd), approximate="tanh"))
        assert dropout(out) is out  # the model's inactive dropout hands it on uncomputed
    # an active dropout computes it (and then drops)
    dropped = torch.nn.Dropout(0.5).train()(act(xd))
    assert type(dropped) is torch.Tensor and (dropped == 0).any()


def test_only_the_gelu_modules_that_compute_gelu_of_their_projection_are_swapped():
    import comfy.ldm.lightricks.model as ltx_model

    from lowbit.nodes.comfy_ops import _proj_gelu_classes, install_input_fusion

    assert _proj_gelu_classes() == {qwen_model.GELU, ltx_model.GELU_approx}

    class ScaledGELU(qwen_model.GELU):  # a model's own variant: its forward is not the one checked
        def forward(self, hidden_states):
            return super().forward(hidden_states) * 2

    model = torch.nn.Sequential(qwen_model.GELU(8, 16, approximate="tanh", operations=torch.nn),
                                ScaledGELU(8, 16, operations=torch.nn), ltx_model.GELU_approx(8, 16, operations=torch.nn))
    assert install_input_fusion(model, {}) == 2
    assert [isinstance(m, DeferredProjGELUMixin) for m in model] == [True, False, True]
    x = torch.randn(3, 8).to(device())
    model.to(device())
    assert torch.equal(model[1](x), 2 * torch.nn.functional.gelu(model[1].proj(x)))
    assert torch.equal(materialize(model[2](x)), torch.nn.functional.gelu(model[2].proj(x), approximate="tanh"))
