"""Qwen-Image's joint attention in real ComfyUI: q, k and v made in one pass a stream (``nodes/joint_attention.py``).

On a model LowBit quantized, ComfyUI's Qwen-Image ``Attention`` modules are swapped (per model) to a subclass whose
forward makes the heads, the four q/k RMSNorms, the text + image concatenation and the RoPE of q and k in one
kernel launch per stream (``kernels/triton_joint_heads.py``; the CPU interpreter, or the GPU with
``LOWBIT_TEST_DEVICE=cuda``) and is otherwise ComfyUI's. Its output is that of ComfyUI's forward on the same
quantized model; ``attn1_patch`` patches, patched norm weights and masks other than the text mask get ComfyUI's
own forward; a class whose forward computes something else is not swapped.
"""

from __future__ import annotations

import pytest
import torch

from comfy_helpers import (_tiny_denoiser_call, device, load_tiny_qwen, one_pass_on_the_cpu, quantized_with_deferring,
                           rel_error, require_comfy, run_qwen, run_with_manual_cast_norms)

require_comfy()

import comfy.ldm.qwen_image.model as qwen_model  # noqa: E402

from kernels_helpers import interpreter_model_marks  # noqa: E402
from lowbit.nodes import joint_attention  # noqa: E402
from lowbit.nodes.joint_attention import FusedJointAttentionMixin, joint_attention_classes  # noqa: E402

pytestmark = interpreter_model_marks(device().type == "cpu")


@pytest.fixture(autouse=True)
def _one_pass(monkeypatch):
    one_pass_on_the_cpu(monkeypatch)


@pytest.fixture(scope="module")
def quantized():
    float_model = load_tiny_qwen()
    model, attentions = quantized_with_deferring(float_model, "int8_convrot", qwen_model.Attention,
                                                 FusedJointAttentionMixin)
    return float_model, model, attentions


def _comfy_forward(monkeypatch):
    """Every swapped module runs ComfyUI's own forward (the fused path declines)."""
    monkeypatch.setattr(joint_attention, "fused_joint_attention", lambda *args, **kwargs: None)


def test_qwen_attention_makes_q_k_v_in_one_launch_a_stream(quantized, launches, monkeypatch):
    float_model, model, attentions = quantized
    assert len(attentions) == len(model.model.diffusion_model.transformer_blocks)
    reference = run_qwen(float_model)
    fused = run_qwen(model)
    # text (16 tokens) then image (an 8x8 latent in 2x2 patches: 16 tokens) of every block
    assert launches == [(16, 0), (16, 16)] * len(attentions)
    launches.clear()
    with monkeypatch.context() as m:
        _comfy_forward(m)
        as_written = run_qwen(model)
    assert not launches
    # the same values up to the last bit of a norm or a rotation (bf16 on a GPU, fp32 on the CPU)
    assert rel_error(fused, as_written) < (1e-2 if device().type == "cuda" else 1e-5)
    from_float = rel_error(as_written, reference)
    assert abs(rel_error(fused, reference) - from_float) < 0.1 * from_float + 1e-4


def test_attn1_patches_and_patched_norms_get_comfyuis_forward(quantized, launches, monkeypatch):
    _, model, attentions = quantized
    seen = []

    def patch(q, k, v, pe=None, attn_mask=None, extra_options=None):
        seen.append(q.shape)
        return {"q": q * 4, "k": k * 4}

    def run_patched():  # the transformer options a sampler hands a model with the patch set
        return _tiny_denoiser_call(model, 16, 0, lambda dev: {"transformer_options": {"patches": {"attn1_patch": [patch]}}},
                                   frames=1)

    with_patch = run_patched()
    assert not launches and len(seen) == len(attentions)  # every block ran ComfyUI's forward, with the patch
    with monkeypatch.context() as m:
        _comfy_forward(m)
        assert torch.equal(run_patched(), with_patch)
    assert rel_error(with_patch, run_qwen(model)) > 1e-4  # the patch did act

    norm = attentions[0].norm_q
    norm.weight_function = [lambda weight: weight * 2]  # a patched norm weight (ComfyUI's low-VRAM patches)
    try:
        launches.clear()
        out = run_qwen(model)
        assert len(launches) == 2 * (len(attentions) - 1)  # the first block declined
        with monkeypatch.context() as m:
            _comfy_forward(m)
            assert rel_error(out, run_qwen(model)) < (1e-2 if device().type == "cuda" else 1e-5)
    finally:
        norm.weight_function = []


def test_norm_weights_cast_as_comfyuis_rmsnorm_casts_them(quantized, launches, monkeypatch):
    _, model, attentions = quantized
    expected = run_qwen(model)
    norms = [getattr(a, n) for a in attentions for n in ("norm_q", "norm_k", "norm_added_q", "norm_added_k")]
    launches.clear()
    out, casts = run_with_manual_cast_norms(norms, lambda: run_qwen(model), monkeypatch)
    assert len(launches) == 2 * len(attentions) and casts == norms
    assert torch.equal(out, expected)


def test_only_attentions_whose_forward_agrees_are_swapped():
    from lowbit.nodes.comfy_ops import install_input_fusion

    assert joint_attention_classes() == {qwen_model.Attention}

    class ScaledAttention(qwen_model.Attention):  # a model's own variant: its forward is not the one checked
        def forward(self, *args, **kwargs):
            img, txt = super().forward(*args, **kwargs)
            return img * 2, txt

    assert joint_attention._agrees(qwen_model.Attention)
    assert not joint_attention._agrees(ScaledAttention)  # the install-time check sees a forward that differs
    kwargs = dict(query_dim=64, dim_head=32, heads=2, out_dim=64, bias=True, operations=torch.nn)
    model = torch.nn.ModuleList([qwen_model.Attention(**kwargs), ScaledAttention(**kwargs)])
    assert install_input_fusion(model, {}) == 1
    assert [isinstance(m, FusedJointAttentionMixin) for m in model] == [True, False]
    assert joint_attention.model_module(type(model[0]), "optimized_attention_masked") is qwen_model
    # a mask other than the text mask [B, S_txt] (a newer ComfyUI's joint mask) is left to ComfyUI's forward
    x, txt, freqs = torch.randn(1, 5, 64), torch.randn(1, 3, 64), torch.randn(1, 1, 8, 16, 2, 2)
    assert joint_attention.fused_joint_attention(model[0], x, txt, torch.zeros(1, 3), freqs, {}, reference=True)
    assert joint_attention.fused_joint_attention(model[0], x, txt, torch.zeros(1, 1, 8, 8), freqs, {},
                                                 reference=True) is None
    assert joint_attention.fused_joint_attention(model[0], x, txt, None, None, {}, reference=True) is None
