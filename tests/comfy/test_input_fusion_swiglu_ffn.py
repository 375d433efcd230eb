"""Gated MLPs written as three linears in one ``forward`` (HiDream, Krea 2, SeedVR, MMDiT's SwiGLU variant), in real
ComfyUI: their SwiGLU computed inside the down-projection's activation quantization.

These classes compute ``down(silu(gate(x)) * up(x))`` in ``forward``. On a model LowBit quantized, they are swapped to
a deferring subclass (per model; a stock model keeps its class) whose ``forward`` calls the same three linears and
hands ``down`` the deferred ``silu(gate) * up`` (``quant/deferred.py``'s ``defer_swiglu_pair``). Once the dispatcher
has settled the plans on our Triton kernels (the CPU interpreter; ``LOWBIT_TEST_DEVICE=cuda``: the GPU) the act-quant
kernel computes it from the two outputs: the codes are those of the tensor ComfyUI computes (up to the rare code the
last bit of the SiLU's exponential moves), the output as accurate as the unfused run's. HiDream's routed experts see
a varying share of the tokens, some none (then nothing is deferred); Krea 2's text-fusion MLPs, which its preset keeps
in bf16, take the computed product.
"""

from __future__ import annotations

import pytest
import torch

from comfy_helpers import (assert_fused_as_computed, device, fused_and_unfused, load_tiny_hidream,
                           quantized_with_deferring, require_comfy, run_hidream, run_krea2)

require_comfy()

import comfy.ldm.hidream.model as hidream_model  # noqa: E402
import comfy.ldm.krea2.model as krea2_model  # noqa: E402
import comfy.ldm.modules.diffusionmodules.mmdit as mmdit  # noqa: E402
import comfy.ldm.seedvr.model as seedvr_model  # noqa: E402

from kernels_helpers import interpreter_model_marks  # noqa: E402
from lowbit.nodes.comfy_ops import is_lowbit_linear  # noqa: E402
from lowbit.nodes.swiglu_ffn import (DeferredSwiGLUFeedForwardMixin, _computes_swiglu,  # noqa: E402
                                     swiglu_feed_forward_classes)
from lowbit.quant.deferred import DeferredInput  # noqa: E402

pytestmark = interpreter_model_marks(device().type == "cpu")


@pytest.fixture(scope="module")
def hidream():
    model = load_tiny_hidream()
    return model, run_hidream(model)


def _count_nonempty_calls(ffns):
    """Forward pre-hooks counting the calls of ``ffns`` whose down-projection is a LowBit linear and whose input has
    rows (those hand it a deferred product); returns (counter, those of ``ffns`` hooked, the hooks' handles)."""
    counter = {"calls": 0}

    def hook(module, args):
        counter["calls"] += int(args[0].shape[:-1].numel() > 0)

    quantized = [f for f in ffns if is_lowbit_linear(getattr(f, f.lowbit_swiglu_linears[2]))]
    return counter, quantized, [f.register_forward_pre_hook(hook) for f in quantized]


# one format per model: the pair prologue's other formats are tests/comfy/test_input_fusion_lumina.py's and
# tests/test_input_fusion.py's
def test_krea2_swiglu_mlps_are_computed_inside_the_activation_quantization(krea2, monkeypatch):
    float_model, float_output = krea2
    model, ffns = quantized_with_deferring(float_model, "fp8_rowwise", krea2_model.SwiGLU,
                                           DeferredSwiGLUFeedForwardMixin)
    dm = model.model.diffusion_model
    assert len(ffns) == len(dm.blocks) + len(dm.txtfusion.layerwise_blocks) + len(dm.txtfusion.refiner_blocks)
    counter, quantized, handles = _count_nonempty_calls(ffns)
    assert quantized == [b.mlp for b in dm.blocks]  # the text-fusion MLPs stay bf16 (the preset)
    try:
        unfused, first, fused, prologues, differing = fused_and_unfused(model, run_krea2, monkeypatch)
    finally:
        for handle in handles:
            handle.remove()
    # every image block's down-projection took the product uncomputed in the fused run (one of the three runs)
    assert counter["calls"] == 3 * len(dm.blocks) and prologues["SwigluPrologue"] == len(dm.blocks)
    assert_fused_as_computed(float_output, unfused, first, fused, differing)


def test_hidream_experts_swiglu_is_computed_inside_the_activation_quantization(hidream, monkeypatch):
    float_model, float_output = hidream
    model, ffns = quantized_with_deferring(float_model, "int8_convrot", hidream_model.FeedForwardSwiGLU,
                                           DeferredSwiGLUFeedForwardMixin)
    dm = model.model.diffusion_model
    # per MoE MLP a shared and 4 routed experts, and the dual-stream block's text MLP
    assert len(ffns) == 5 * (len(dm.double_stream_blocks) + len(dm.single_stream_blocks)) + len(dm.double_stream_blocks)
    counter, quantized, handles = _count_nonempty_calls(ffns)
    assert quantized == ffns
    try:
        unfused, first, fused, prologues, differing = fused_and_unfused(model, run_hidream, monkeypatch)
    finally:
        for handle in handles:
            handle.remove()
    # every call with rows took the product uncomputed in the fused run (one of the three runs); at most the 4 routed
    # experts of one MoE MLP get no token
    calls = counter["calls"]
    assert calls % 3 == 0 and prologues["SwigluPrologue"] == calls // 3 >= len(ffns) - 4
    assert_fused_as_computed(float_output, unfused, first, fused, differing)


def test_every_three_linear_swiglu_class_of_this_comfyui_is_found_with_its_linears():
    found = swiglu_feed_forward_classes()
    names = {cls: mixin.lowbit_swiglu_linears for cls, mixin in found.items()}
    assert names == {hidream_model.FeedForwardSwiGLU: ("w1", "w3", "w2"), krea2_model.SwiGLU: ("gate", "up", "down"),
                     seedvr_model.SwiGLUMLP: ("proj_in_gate", "proj_in", "proj_out"),
                     mmdit.SwiGLUFeedForward: ("w1", "w3", "w2")}


def test_a_forward_that_computes_anything_else_keeps_its_own_class():
    silu = torch.nn.functional.silu

    class Clamped(hidream_model.FeedForwardSwiGLU):  # a newer ComfyUI's clamp to fp16's range, say
        def forward(self, x):
            return self.w2((silu(self.w1(x)) * self.w3(x)).clamp(-1.0, 1.0))

    class Swapped(krea2_model.SwiGLU):  # gate and up the other way round
        def forward(self, x):
            return self.down(silu(self.up(x)) * self.gate(x))

    class NeedsMore(seedvr_model.SwiGLUMLP):  # an attribute the check's instance does not have
        def forward(self, x):
            return self.proj_out(self.act(self.proj_in_gate(x)) * self.proj_in(x))

    assert _computes_swiglu(hidream_model.FeedForwardSwiGLU, ("w1", "w3", "w2"))
    assert not _computes_swiglu(Clamped, ("w1", "w3", "w2"))
    assert not _computes_swiglu(Swapped, ("gate", "up", "down"))
    assert not _computes_swiglu(NeedsMore, ("proj_in_gate", "proj_in", "proj_out"))


def test_the_deferring_forward_hands_down_the_product_and_computes_as_comfyui(krea2):
    from lowbit.nodes.model_quant import quantize_model
    from lowbit.quant.policy import Policy

    model = quantize_model(krea2[0], Policy(mode="int8_convrot"))
    mlp = model.model.diffusion_model.blocks[0].mlp
    seen = []
    handle = mlp.down.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    dev = device()  # the kernels' device: a CPU tensor defers only in the interpreter
    x = torch.randn(2, 5, 256, generator=torch.Generator().manual_seed(3)).to(dev)
    try:
        with torch.no_grad():
            out = mlp(x)
            gate, up = mlp.gate(x), mlp.up(x)
    finally:
        handle.remove()
    assert len(seen) == 1 and isinstance(seen[0], DeferredInput) and seen[0].shape == gate.shape
    assert torch.equal(seen[0].materialize(), torch.nn.functional.silu(gate) * up)
    assert out.shape == x.shape and torch.isfinite(out).all()
    # no rows: nothing to defer, the product is computed (HiDream's routed experts that no token chose)
    seen.clear()
    handle = mlp.down.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            empty = mlp(x[:0].reshape(0, 256))
    finally:
        handle.remove()
    assert type(seen[0]) is torch.Tensor and empty.shape == (0, 256)
