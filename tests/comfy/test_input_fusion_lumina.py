"""Z-Image's and Lumina 2's gated MLPs in real ComfyUI: the SwiGLU of two linears computed inside the activation
quantization.

ComfyUI's Lumina ``FeedForward`` (Lumina 2, Z-Image) computes ``w2(_forward_silu_gating(w1(x), w3(x)))``, the
gating ``silu(x1) * x3``. On a model LowBit quantized, the ``FeedForward`` modules are swapped to a deferring
subclass (per model; a stock model keeps its class): the gating becomes a deferred input of the two tensors
(``quant/deferred.py``'s ``defer_swiglu_pair``), and once the dispatcher has settled ``w2``'s plan on our Triton
kernels (the CPU interpreter; ``LOWBIT_TEST_DEVICE=cuda``: the GPU) the act-quant kernel computes it from ``w1``'s
and ``w3``'s outputs. The codes are those of the tensor ComfyUI computes (up to the rare code that the last bit of
the SiLU's exponential moves), and the output is as accurate as the unfused run's. In fp16, where ComfyUI clamps
the product to fp16's range, the class's own gating runs.
"""

from __future__ import annotations

import pytest
import torch

from comfy_helpers import (assert_fused_as_computed, device, fused_and_unfused, quantized_with_deferring,
                           require_comfy, run_zimage)

require_comfy()

import comfy.ldm.lumina.model as lumina_model  # noqa: E402

from kernels_helpers import interpreter_model_marks  # noqa: E402
from lowbit.nodes.comfy_ops import DeferredGatedFeedForwardMixin  # noqa: E402
from lowbit.nodes.model_quant import quantize_model  # noqa: E402
from lowbit.quant.deferred import DeferredInput  # noqa: E402
from lowbit.quant.policy import Policy  # noqa: E402

pytestmark = interpreter_model_marks(device().type == "cpu")


@pytest.mark.parametrize("fmt", ("int8_convrot", "fp8_rowwise"))  # the 4-bit fused paths: tests/test_input_fusion.py
def test_zimage_gated_mlps_are_computed_inside_the_activation_quantization(zimage, fmt, monkeypatch):
    float_model, float_output = zimage
    model, ffns = quantized_with_deferring(float_model, fmt, lumina_model.FeedForward, DeferredGatedFeedForwardMixin)
    dm = model.model.diffusion_model
    assert len(ffns) == len(dm.layers) + len(dm.noise_refiner) + len(dm.context_refiner)

    unfused, first, fused, prologues, differing = fused_and_unfused(model, run_zimage, monkeypatch)
    # every FeedForward's w2 takes the gating uncomputed (the refiners' w2 too: the preset quantizes them)
    assert prologues["SwigluPrologue"] == len(ffns)
    assert_fused_as_computed(float_output, unfused, first, fused, differing)


def test_the_gating_defers_outside_fp16_only_and_computes_as_comfyui(zimage):
    model = quantize_model(zimage[0], Policy(mode="int8_convrot"))
    ffn = model.model.diffusion_model.layers[0].feed_forward
    gen = torch.Generator().manual_seed(3)
    dev = device()  # the kernels' device: a CPU tensor defers only in the interpreter
    x1, x3 = (torch.randn(2, 5, 768, generator=gen) * 3).to(dev), torch.randn(2, 5, 768, generator=gen).to(dev)
    for dtype in (torch.bfloat16, torch.float32):
        a, b = x1.to(dtype), x3.to(dtype)
        out = ffn._forward_silu_gating(a, b)
        assert isinstance(out, DeferredInput) and out.shape == a.shape and out.dtype == dtype
        assert torch.equal(out.materialize(), lumina_model.FeedForward._forward_silu_gating(None, a, b))
    # fp16: ComfyUI's clamp to fp16's range runs (a product past 65504 stays finite)
    a = b = torch.full((2, 768), 300.0, dtype=torch.float16, device=dev)
    out = ffn._forward_silu_gating(a, b)
    assert type(out) is torch.Tensor and torch.equal(out, torch.full_like(a, 65504.0))
    # two tensors that are not one shape: the class's own gating (which broadcasts them)
    out = ffn._forward_silu_gating(x1[:, :1].bfloat16(), x3.bfloat16())
    assert type(out) is torch.Tensor and out.shape == x3.shape
