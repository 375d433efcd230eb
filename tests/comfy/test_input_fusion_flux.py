"""A quantized Flux in real ComfyUI, its LayerNorms and GELUs (Flux 2: SwiGLUs) fused into the activation quantization.

The tiny Flux, quantized by LowBit: its GELUs and affine-free LayerNorms are swapped to deferring
subclasses (per model; a stock model keeps its classes). Run through ComfyUI with every W8A8 call
settled on our Triton kernels (the CPU interpreter; ``LOWBIT_TEST_DEVICE=cuda``: the GPU), the
modulated norms (double blocks' ``img/txt_norm1/2``, single blocks' ``pre_norm``), the MLP GELUs and
the single blocks' ``cat((attn, gelu(mlp)), 2)`` reach the quantized linears uncomputed and are
computed inside the activation quantization: each call's codes are those of the input ComfyUI's own
graph computes (up to the rare code that the last bit of tanh or of the row variance moves), and the
output is as accurate as the unfused run's.
"""

from __future__ import annotations

import collections

import pytest
import torch

from comfy_helpers import (TritonFirst, assert_fused_as_computed, device, fused_and_unfused, load_stock, require_comfy,
                           run_flux, run_flux2, tiny_flux2_bf16)

require_comfy()

from kernels_helpers import interpreter_model_marks  # noqa: E402
from lowbit.kernels import dispatch  # noqa: E402
from lowbit.nodes.comfy_ops import DeferredGELUMixin, DeferredLayerNormMixin, DeferredSwiGLUMixin  # noqa: E402
from lowbit.nodes.model_quant import quantize_model  # noqa: E402
from lowbit.quant.policy import Policy  # noqa: E402

pytestmark = interpreter_model_marks(device().type == "cpu")


@pytest.mark.parametrize("fmt", ("int8_convrot", "fp8_rowwise", "int8_hadanorm", "w4a4", "w4a8"))
def test_fused_inputs_give_the_unfused_output(float_model, float_output, fmt, monkeypatch):
    model = quantize_model(float_model, Policy(mode=fmt))
    dm = model.model.diffusion_model
    kinds = collections.Counter(type(m).__mro__[1].__name__ for m in dm.modules()
                                if isinstance(m, (DeferredGELUMixin, DeferredLayerNormMixin)))
    assert kinds["DeferredGELUMixin"] == 2 * len(dm.double_blocks) + len(dm.single_blocks)
    assert kinds["DeferredLayerNormMixin"] >= 4 * len(dm.double_blocks) + len(dm.single_blocks)
    assert not any(isinstance(m, (DeferredGELUMixin, DeferredLayerNormMixin))
                   for m in float_model.model.diffusion_model.modules())  # the source model is untouched

    unfused, first, fused, prologues, differing = fused_and_unfused(model, run_flux, monkeypatch)
    _assert_resident_in_the_vbar_if_dynamic(model)  # Dynamic VRAM: the fused path runs on the vbar's copies
    assert prologues["NormModPrologue"] == 4 * len(dm.double_blocks) + len(dm.single_blocks)
    assert prologues["GeluPrologue+a"] == len(dm.single_blocks)
    assert prologues["GeluPrologue"] == 2 * len(dm.double_blocks)
    assert_fused_as_computed(float_output, unfused, first, fused, differing)


@pytest.fixture(scope="module")
def flux2():
    model = load_stock(tiny_flux2_bf16())
    return model, run_flux2(model)


@pytest.mark.parametrize("fmt", ("int8_convrot", "fp8_rowwise", "w4a8"))
def test_flux2_swiglus_are_computed_inside_the_activation_quantization(flux2, fmt, monkeypatch):
    """Flux 2's MLPs: ``SiLUActivation`` (``silu(x1) * x2``) before each double block's ``mlp.2``, and in each
    single block ``cat((attn, silu(x1) * x2), 2)`` before ``linear2``: both reach the layer uncomputed."""
    float_model, float_output = flux2
    model = quantize_model(float_model, Policy(mode=fmt))
    dm = model.model.diffusion_model
    swiglus = [m for m in dm.modules() if isinstance(m, DeferredSwiGLUMixin)]
    assert len(swiglus) == 2 * len(dm.double_blocks) + len(dm.single_blocks)
    assert not any(isinstance(m, DeferredSwiGLUMixin) for m in float_model.model.diffusion_model.modules())

    unfused, first, fused, prologues, differing = fused_and_unfused(model, run_flux2, monkeypatch)
    assert prologues["SwigluPrologue"] == 2 * len(dm.double_blocks)
    assert prologues["SwigluPrologue+a"] == len(dm.single_blocks)
    assert_fused_as_computed(float_output, unfused, first, fused, differing)


def _assert_resident_in_the_vbar_if_dynamic(model) -> None:
    """Under Dynamic VRAM (a GPU run with ``LOWBIT_TEST_DYNAMIC_VRAM=1``) every quantized layer has a vbar slot
    and is resident there after a run: ComfyUI's cast hands back the same VRAM copy on every call, which the
    steady-state lanes take (``LowBitLinearMixin._lowbit_vbar_form``)."""
    if not getattr(model, "is_dynamic", lambda: False)():
        return
    layers = [m for m in model.model.diffusion_model.modules() if getattr(m, "lowbit_format", None)]
    assert layers and all(hasattr(m, "_v") and m._v_signature is not None for m in layers)


def test_settled_lane_gives_the_full_paths_bits(float_model, monkeypatch):
    """Inputs computed as written (``fuse_inputs=False``): after the first call settles its plan, every
    quantized linear goes from its forward straight to that plan through its weight's form (a resident
    layer; under Dynamic VRAM the vbar's resident copy), and the output has the full path's bits."""
    from lowbit.nodes import comfy_ops

    model = quantize_model(float_model, Policy(mode="int8_convrot"), fuse_inputs=False)
    layers = [m for m in model.model.diffusion_model.modules() if getattr(m, "lowbit_format", None)]
    with dispatch.use_dispatcher(TritonFirst(measure=False, fast=False)):  # no settled plans: the full path
        full = run_flux(model)
    served = []
    real = comfy_ops.form_settled_linear

    def spy(form, x, bias):
        out = real(form, x, bias)
        served.append(out is not None)
        return out

    monkeypatch.setattr(comfy_ops, "form_settled_linear", spy)
    with dispatch.use_dispatcher(TritonFirst(measure=False)):
        first = run_flux(model)  # settles the plans
        served.clear()
        lane = run_flux(model)
    _assert_resident_in_the_vbar_if_dynamic(model)
    assert len(served) == len(layers) and all(served), (len(served), len(layers), served.count(False))
    assert torch.equal(lane, full) and torch.equal(first, full)


class UpcastNorm(torch.nn.LayerNorm):
    """A norm with a forward of its own (as Wan's upcasting LayerNorm): not what a deferral stands for."""

    def forward(self, x):
        return super().forward(x.float()).type_as(x)


def test_only_plain_gelus_and_affine_free_norms_are_swapped_and_they_compute_as_before():
    import comfy.ops

    from lowbit.nodes.comfy_ops import install_input_fusion

    model = torch.nn.ModuleDict({
        "gelu": torch.nn.GELU(approximate="tanh"), "silu": torch.nn.SiLU(),
        "norm": torch.nn.LayerNorm(64, elementwise_affine=False),
        "comfy_norm": comfy.ops.disable_weight_init.LayerNorm(64, elementwise_affine=False),
        "affine": torch.nn.LayerNorm(64), "upcast": UpcastNorm(64, elementwise_affine=False)})
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        before = {name: module(x) for name, module in model.items() if name != "affine"}
        classes = {}
        assert install_input_fusion(model, classes) == 3
        assert install_input_fusion(model, classes) == 0  # idempotent
        swapped = {name for name, m in model.items() if isinstance(m, (DeferredGELUMixin, DeferredLayerNormMixin))}
        assert swapped == {"gelu", "norm", "comfy_norm"}
        assert type(torch.nn.GELU()) is torch.nn.GELU  # nothing global
        for name, out in before.items():
            got = model[name](x)
            assert torch.equal(got * 1, out), name  # any op computes a deferred output as the module did


def test_a_swiglu_with_another_gate_or_a_hooked_one_runs_its_own_forward(flux2):
    """The deferral stands for ``silu(x1) * x2``: a ``SiLUActivation`` whose ``gate_fn`` is hooked, or is not an
    ``nn.SiLU``, computes its output as its class does."""
    import comfy.ldm.flux.layers as flux_layers

    model = quantize_model(flux2[0], Policy(mode="int8_convrot"))
    act = model.model.diffusion_model.double_blocks[0].img_mlp[1]
    assert isinstance(act, DeferredSwiGLUMixin) and isinstance(act, flux_layers.SiLUActivation)
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    x1, x2 = x.chunk(2, dim=-1)
    handle = act.gate_fn.register_forward_hook(lambda module, args, out: out * 2)
    try:
        out = act(x)
        assert type(out) is torch.Tensor and torch.equal(out, 2 * torch.nn.functional.silu(x1) * x2)
    finally:
        handle.remove()
    act.gate_fn = torch.nn.GELU()
    out = act(x)
    assert type(out) is torch.Tensor and torch.equal(out, torch.nn.functional.gelu(x1) * x2)
