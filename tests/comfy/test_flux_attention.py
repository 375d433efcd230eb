"""Flux's stream blocks in real ComfyUI: q, k and v made in one pass a stream (``nodes/flux_attention.py``).

On a model LowBit quantized, ComfyUI's Flux ``DoubleStreamBlock`` and ``SingleStreamBlock`` are swapped (per model)
to subclasses whose forward makes the heads, the q/k RMSNorms, the text + image concatenation and the RoPE of q and
k in one kernel launch per stream (``kernels/triton_joint_heads.py``; the CPU interpreter, or the GPU with
``LOWBIT_TEST_DEVICE=cuda``) and is otherwise ComfyUI's. Its output is that of ComfyUI's forward on the same
quantized model (Flux 1, and Flux 2 with its SwiGLUs and global modulation); ``attn1_output_patch`` patches see
what they see under ComfyUI's forward; ``attn1_patch`` patches, patched norm weights, calls without rotary
matrices and calls with unknown arguments get ComfyUI's own forward; a class whose forward computes something
else is not swapped.
"""

from __future__ import annotations

import pytest
import torch

from comfy_helpers import (device, flux_inputs, load_stock, one_pass_on_the_cpu, quantized_with_deferring, rel_error,
                           require_comfy, run_flux, run_flux2, run_with_manual_cast_norms, tiny_flux2_bf16)

require_comfy()

import comfy.ldm.flux.layers as flux_layers  # noqa: E402

from kernels_helpers import interpreter_model_marks  # noqa: E402
from lowbit.nodes import flux_attention  # noqa: E402
from lowbit.nodes.flux_attention import (FusedDoubleStreamBlockMixin, FusedSingleStreamBlockMixin,  # noqa: E402
                                         flux_block_classes)
from lowbit.nodes.joint_attention import one_pass_wanted  # noqa: E402  (the real one: tests patch the module's)

pytestmark = interpreter_model_marks(device().type == "cpu")

IMG, TXT = 64, 8  # the tiny Flux's tokens: a 16x16 latent in 2x2 patches, 8 text tokens


@pytest.fixture(autouse=True)
def _one_pass(monkeypatch):
    one_pass_on_the_cpu(monkeypatch)


@pytest.fixture(scope="module")
def quantized(float_model):
    model, doubles = quantized_with_deferring(float_model, "int8_convrot", flux_layers.DoubleStreamBlock,
                                              FusedDoubleStreamBlockMixin)
    singles = [m for m in model.model.diffusion_model.modules() if isinstance(m, flux_layers.SingleStreamBlock)]
    assert singles and all(isinstance(m, FusedSingleStreamBlockMixin) for m in singles)
    return model, doubles, singles


def _comfy_forward(monkeypatch):
    """Every swapped block runs ComfyUI's own forward (the fused paths decline)."""
    monkeypatch.setattr(flux_attention, "fused_double_block", lambda *args, **kwargs: None)
    monkeypatch.setattr(flux_attention, "fused_single_block", lambda *args, **kwargs: None)


#: the attention inputs of the first block (the same inputs on both paths) against ComfyUI's: the last bit of a
#: norm or a rotation (bf16 on a GPU, where kitchen rotates in bf16; fp32 on the CPU)
_SAME_QKV = 4e-3 if device().type == "cuda" else 1e-6
#: the model's output: those last bits move the odd activation code of a later quantized layer by one step
_SAME = 3e-2 if device().type == "cuda" else 1e-2


def _run_with(model, transformer_options):
    """One denoiser call of the tiny Flux with ``transformer_options``, as a sampler makes it (weights loaded
    first: under Dynamic VRAM a model another test loaded since is not resident)."""
    import comfy.model_management

    comfy.model_management.load_models_gpu([model])
    inputs, dev = flux_inputs(0), model.load_device
    with torch.no_grad():
        return model.model.apply_model(inputs["x"].to(dev), inputs["t"].to(dev),
                                       c_crossattn=inputs["c_crossattn"].to(dev), y=inputs["y"].to(dev),
                                       guidance=inputs["guidance"].to(dev),
                                       transformer_options=transformer_options).float().cpu()


def _recording(calls):
    """An attention override that records each call's q, k, v and runs ComfyUI's attention."""
    def override(func, q, k, v, heads, **kwargs):
        calls.append((q.float().cpu(), k.float().cpu(), v.float().cpu()))
        return func(q, k, v, heads, **kwargs)
    return {"optimized_attention_override": override}


def test_flux_blocks_make_q_k_v_in_one_launch_a_stream(float_model, float_output, quantized, launches, monkeypatch):
    model, doubles, singles = quantized
    run_flux(model)  # loaded
    launches.clear()
    fused_qkv, comfy_qkv = [], []
    fused = _run_with(model, _recording(fused_qkv))
    # a double block: text at rows 0.., then image; a single block: its one joined stream
    assert launches == [(TXT, 0), (IMG, TXT)] * len(doubles) + [(TXT + IMG, 0)] * len(singles)
    launches.clear()
    with monkeypatch.context() as m:
        _comfy_forward(m)
        as_written = _run_with(model, _recording(comfy_qkv))
    assert not launches and len(fused_qkv) == len(comfy_qkv) == len(doubles) + len(singles)
    for got, want in zip(fused_qkv[0], comfy_qkv[0]):  # [B, H, txt + img, D], normalized and rotated
        assert got.shape == want.shape == (1, 2, TXT + IMG, 128) and rel_error(got, want) < _SAME_QKV
    assert rel_error(fused, as_written) < _SAME
    from_float = rel_error(as_written, float_output)
    assert abs(rel_error(fused, float_output) - from_float) < 0.1 * from_float + 1e-4


def test_output_patches_run_and_attn1_patches_get_comfyuis_forward(quantized, launches, monkeypatch):
    model, doubles, singles = quantized
    seen = []

    def output_patch(attn, extra_options):
        seen.append((attn.shape, extra_options.get("img_slice")))
        return attn * 0.5

    fused = _run_with(model, {"patches": {"attn1_output_patch": [output_patch]}})
    assert len(launches) == 2 * len(doubles) + len(singles)
    fused_seen, seen[:] = list(seen), []
    with monkeypatch.context() as m:
        _comfy_forward(m)
        as_written = _run_with(model, {"patches": {"attn1_output_patch": [output_patch]}})
    assert fused_seen == seen and len(seen) == len(doubles) + len(singles)  # same shapes, same img_slice
    assert rel_error(fused, as_written) < _SAME
    assert rel_error(fused, run_flux(model)) > 1e-3  # the patch did act

    q_seen = []

    def attn1_patch(q, k, v, pe=None, attn_mask=None, extra_options=None):
        q_seen.append(q.shape)
        return {"q": q * 4, "k": k * 4}

    launches.clear()
    with_patch = _run_with(model, {"patches": {"attn1_patch": [attn1_patch]}})
    assert not launches and len(q_seen) == len(doubles) + len(singles)  # every block ran ComfyUI's forward
    with monkeypatch.context() as m:
        _comfy_forward(m)
        assert torch.equal(_run_with(model, {"patches": {"attn1_patch": [attn1_patch]}}), with_patch)


def test_patched_and_cast_norm_weights(quantized, launches, monkeypatch):
    model, doubles, singles = quantized
    expected = run_flux(model)  # loaded: ComfyUI's load resets weight functions
    norm = doubles[0].img_attn.norm.key_norm
    norm.weight_function = [lambda weight: weight * 2]  # a patched norm weight (ComfyUI's low-VRAM patches)
    try:
        launches.clear()
        out = run_flux(model)
        assert len(launches) == 2 * (len(doubles) - 1) + len(singles)  # the first double block declined
        with monkeypatch.context() as m:
            _comfy_forward(m)
            assert rel_error(out, run_flux(model)) < _SAME
        assert rel_error(out, expected) > 1e-3
    finally:
        norm.weight_function = []

    norms = [n for b in doubles for a in (b.txt_attn, b.img_attn) for n in (a.norm.query_norm, a.norm.key_norm)]
    norms += [n for b in singles for n in (b.norm.query_norm, b.norm.key_norm)]
    launches.clear()
    out, casts = run_with_manual_cast_norms(norms, lambda: run_flux(model), monkeypatch)
    assert len(launches) == 2 * len(doubles) + len(singles) and casts == norms
    assert torch.equal(out, expected)


def test_flux2_blocks_fused_with_their_swiglus(launches, monkeypatch):
    """Flux 2: global modulation (the blocks are handed their modulation) and SwiGLU MLPs, whose deferred
    ``silu(x1) * x2`` still reaches the quantized layers."""
    float_model = load_stock(tiny_flux2_bf16())
    model, doubles = quantized_with_deferring(float_model, "fp8_rowwise", flux_layers.DoubleStreamBlock,
                                              FusedDoubleStreamBlockMixin)
    dm = model.model.diffusion_model
    assert not doubles[0].modulation
    fused = run_flux2(model)
    assert len(launches) == 2 * len(doubles) + len(dm.single_blocks)
    with monkeypatch.context() as m:
        _comfy_forward(m)
        assert rel_error(fused, run_flux2(model)) < _SAME
    assert rel_error(fused, run_flux2(float_model)) < 0.2


def test_only_blocks_whose_forward_agrees_are_swapped():
    from lowbit.nodes.comfy_ops import install_input_fusion

    assert dict(flux_block_classes()) == {flux_layers.DoubleStreamBlock: FusedDoubleStreamBlockMixin,
                                          flux_layers.SingleStreamBlock: FusedSingleStreamBlockMixin}

    class GatedTwice(flux_layers.SingleStreamBlock):  # a model's own variant: its forward is not the one checked
        def forward(self, x, *args, **kwargs):
            return super().forward(x, *args, **kwargs) * 2

    assert flux_attention._agrees(flux_layers.SingleStreamBlock, flux_attention.fused_single_block)
    assert not flux_attention._agrees(GatedTwice, flux_attention.fused_single_block)
    model = torch.nn.ModuleList([flux_layers.SingleStreamBlock(64, 2, operations=torch.nn),
                                 GatedTwice(64, 2, operations=torch.nn)])
    install_input_fusion(model, {})
    assert [isinstance(m, FusedSingleStreamBlockMixin) for m in model] == [True, False]

    block, x, vec = model[0], torch.randn(1, 6, 64), torch.randn(1, 64)
    pe = torch.randn(1, 1, 6, 16, 2, 2)
    assert flux_attention.fused_single_block(block, x.clone(), vec, pe, transformer_options={}, reference=True) \
        is not None
    assert flux_attention.fused_single_block(block, x.clone(), vec, None, transformer_options={},
                                             reference=True) is None  # no rotary matrices: ComfyUI's forward
    calls = []
    real = flux_layers.SingleStreamBlock.forward
    with pytest.MonkeyPatch.context() as m:  # an argument a newer ComfyUI passes goes to ComfyUI's forward
        m.setattr(flux_layers.SingleStreamBlock, "forward",
                  lambda self, *args, **kwargs: calls.append(kwargs.pop("new_argument")) or real(self, *args, **kwargs))
        block(x.clone(), vec, pe, transformer_options={}, new_argument=1)
    assert calls == [1]


def test_one_pass_is_a_gpu_default_and_forced_on_the_cpu():
    """On the CPU the preparation is ComfyUI's unless the Triton backend is forced (so a CPU run computes what
    stock ComfyUI computes); on a GPU it is the one-pass kernel unless another backend is forced."""
    from lowbit.kernels.backend import Backend, force_backend

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert not one_pass_wanted(cpu) and one_pass_wanted(gpu)
    with force_backend(Backend.TRITON):
        assert one_pass_wanted(cpu) and one_pass_wanted(gpu)
    with force_backend(Backend.EAGER):
        assert not one_pass_wanted(gpu) and not one_pass_wanted(cpu)
