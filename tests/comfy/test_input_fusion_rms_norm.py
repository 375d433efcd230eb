"""The RMSNorms in front of Z-Image's and Krea 2's attention and MLP, in real ComfyUI: the norm and its modulation
computed inside the activation quantization (``nodes/rms_norm.py``).

Z-Image's ``JointTransformerBlock`` feeds ``attention_norm1(x) * (1 + scale)`` to ``qkv`` and ``ffn_norm1(x) * (1 +
scale)`` to ``w1`` and ``w3`` (its refiner blocks the norms alone); Krea 2's blocks feed ``(1 + scale) * norm(x) +
shift`` (its own fp32 ``RMSNorm``) to four attention linears and to the MLP's gate and up. On a model LowBit
quantized those norms are swapped to deferring subclasses (per model): each becomes one act-quant pass over the
norm's input, shared by the linears that take it, with the codes of the tensor ComfyUI computes (up to the rare
code that the last bit of a row's rsqrt moves) and an output as accurate as the unfused run's. The q/k norms and the
post-norms keep their classes.
"""

from __future__ import annotations

import copy

import pytest
import torch

from comfy_helpers import assert_fused_as_computed, device, fused_and_unfused, require_comfy, run_krea2, run_zimage

require_comfy()

import comfy.ldm.krea2.model as krea2_model  # noqa: E402
import comfy.ldm.lumina.model as lumina_model  # noqa: E402

from kernels_helpers import interpreter_model_marks  # noqa: E402
from lowbit.nodes.model_quant import quantize_model  # noqa: E402
from lowbit.nodes.rms_norm import DeferredRMSNormMixin, DeferredScaleRMSNormMixin, block_norm_sites  # noqa: E402
from lowbit.quant.deferred import DeferredInput  # noqa: E402
from lowbit.quant.policy import Policy  # noqa: E402

pytestmark = interpreter_model_marks(device().type == "cpu")


def _deferring_norms(model, mixin):
    return [m for m in model.model.diffusion_model.modules() if isinstance(m, mixin)]


@pytest.mark.parametrize("fmt", ("int8_convrot", "fp8_rowwise"))
def test_zimage_block_norms_are_computed_inside_the_activation_quantization(zimage, fmt, monkeypatch):
    float_model, float_output = zimage
    model = quantize_model(float_model, Policy(mode=fmt))
    dm = model.model.diffusion_model
    blocks = [*dm.layers, *dm.noise_refiner, *dm.context_refiner]
    norms = _deferring_norms(model, DeferredRMSNormMixin)
    assert norms and sorted(map(id, norms)) == sorted(id(getattr(b, n)) for b in blocks
                                                      for n in ("attention_norm1", "ffn_norm1"))
    assert not _deferring_norms(float_model, DeferredRMSNormMixin)  # the swap is per model
    assert not isinstance(dm.layers[0].attention.q_norm, DeferredRMSNormMixin)  # a per-head norm: its own class

    unfused, first, fused, prologues, differing = fused_and_unfused(model, run_zimage, monkeypatch)
    # one act-quant per norm: qkv takes attention_norm1's, w1 and w3 share ffn_norm1's
    assert prologues["NormModPrologue"] == len(norms)
    assert_fused_as_computed(float_output, unfused, first, fused, differing)


@pytest.mark.parametrize("fmt", ("int8_convrot", "fp8_rowwise"))
def test_krea2_block_norms_are_computed_inside_the_activation_quantization(krea2, fmt, monkeypatch):
    float_model, float_output = krea2
    model = quantize_model(float_model, Policy(mode=fmt))
    dm = model.model.diffusion_model
    norms = _deferring_norms(model, DeferredScaleRMSNormMixin)
    assert sorted(map(id, norms)) == sorted(id(getattr(b, n)) for b in dm.modules() if type(b).__name__ in
                                            ("SingleStreamBlock", "TextFusionBlock") for n in ("prenorm", "postnorm"))
    qknorm = next(m for m in dm.modules() if isinstance(m, krea2_model.QKNorm))
    assert not isinstance(qknorm.qnorm, DeferredScaleRMSNormMixin)

    unfused, first, fused, prologues, differing = fused_and_unfused(model, run_krea2, monkeypatch)
    # the image blocks' linears are quantized: per block one act-quant for wq, wk, wv and the gate, one for the
    # MLP's gate and up (the text-fusion blocks' linears stay bf16 and get the computed tensor)
    assert prologues["NormModPrologue"] == 2 * len(dm.blocks)
    assert_fused_as_computed(float_output, unfused, first, fused, differing)


def test_the_deferred_norms_compute_as_comfyui(zimage, krea2):
    dev = device()  # the kernels' device: a CPU tensor defers only in the interpreter
    gen = torch.Generator().manual_seed(5)
    z = quantize_model(zimage[0], Policy(mode="int8_convrot")).model.diffusion_model.layers[0]
    k = quantize_model(krea2[0], Policy(mode="int8_convrot")).model.diffusion_model.blocks[0]
    for norm, base in ((z.ffn_norm1, None), (k.postnorm, krea2_model.RMSNorm)):
        width = norm.weight.shape[0] if base is None else norm.scale.shape[0]
        x = (torch.randn(2, 7, width, generator=gen) * 3 + 0.4).to(dev)
        scale, shift = torch.randn(2, 1, width, generator=gen).to(dev), torch.randn(2, 1, width, generator=gen).to(dev)
        for dtype in (torch.bfloat16, torch.float16):
            xd, sd, hd = x.to(dtype), (1 + scale).to(dtype), shift.to(dtype)
            # a copy on the kernels' device; ComfyUI's RMSNorm defers with its weight in the input's dtype
            norm = copy.deepcopy(norm).to(dev) if base is not None else copy.deepcopy(norm).to(dev, dtype)
            own = type(norm).__mro__[2].forward(norm, xd)  # the class's own forward (past LowBit's mixin)
            out = norm(xd)
            assert isinstance(out, DeferredInput) and out.shape == xd.shape
            modulated = sd * out + hd  # Krea 2's order; Z-Image's is norm * (1 + scale)
            assert isinstance(modulated, DeferredInput) and modulated.prologue.two_step
            assert torch.equal(modulated.materialize(), sd * own + hd)
            assert torch.equal(norm(xd).__mul__(sd).materialize(), own * sd)
            assert torch.equal(norm(xd).materialize(), own)
            # a per-token modulation and an fp32 one: computed, as torch computes them
            for other in (torch.randn(2, 7, width, generator=gen).to(dev, dtype), sd.float()):
                got = norm(xd) * other
                assert type(got) is torch.Tensor and torch.equal(got, own * other)


def test_a_weight_of_another_dtype_keeps_the_norms_own_forward(zimage):
    norm = quantize_model(zimage[0], Policy(mode="int8_convrot")).model.diffusion_model.layers[0].ffn_norm1
    norm = copy.deepcopy(norm).to(device(), torch.float32)
    x = torch.randn(2, 3, norm.weight.shape[0]).to(device(), torch.bfloat16)
    out = norm(x)
    assert type(out) is torch.Tensor and torch.equal(out, type(norm).__mro__[2].forward(norm, x))


def test_each_block_norm_site_is_a_block_of_this_comfyui():
    sites = block_norm_sites()
    assert sites[lumina_model.JointTransformerBlock] == ("attention_norm1", "ffn_norm1")
    assert sites[krea2_model.SingleStreamBlock] == ("prenorm", "postnorm")



@pytest.mark.parametrize("kind", ("rms_norm", "layer_norm"))
def test_a_deferred_norm_stops_the_run_when_comfyui_is_interrupted(kind, zimage, float_model):
    """A deferred norm returns without its ComfyUI forward, so it calls the hook that forward calls first
    (``comfy.ops.run_every_op``): the user's cancel stops the step there too. Z-Image's block RMSNorm, and Flux's
    affine-free LayerNorm (``DeferredLayerNormMixin``)."""
    import comfy.model_management as mm

    from lowbit.nodes.comfy_ops import DeferredLayerNormMixin

    if kind == "rms_norm":
        norm = quantize_model(zimage[0], Policy(mode="int8_convrot")).model.diffusion_model.layers[0].ffn_norm1
        width, like = norm.weight.shape[0], norm.weight
    else:
        dm = quantize_model(float_model, Policy(mode="int8_convrot")).model.diffusion_model
        norm = dm.double_blocks[0].img_norm1
        assert isinstance(norm, DeferredLayerNormMixin)
        width, like = norm.normalized_shape[0], next(dm.parameters())
    norm = norm.to(device())
    x = torch.randn(1, 5, width, generator=torch.Generator().manual_seed(7)).to(device(), like.dtype)
    want = norm(x)
    assert isinstance(want, DeferredInput)
    mm.interrupt_current_processing(True)
    try:
        with pytest.raises(mm.InterruptProcessingException):
            norm(x)
    finally:
        mm.interrupt_current_processing(False)
    out = norm(x)  # nothing stays interrupted
    assert isinstance(out, DeferredInput) and torch.equal(out.materialize(), want.materialize())
