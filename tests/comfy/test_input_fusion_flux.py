"""A quantized Flux in real ComfyUI, its LayerNorms and GELUs fused into the activation quantization.

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

from comfy_helpers import TritonFirst, device, require_comfy, run_flux

require_comfy()

from kernels_helpers import needs_triton_interpreter  # noqa: E402
from lowbit.kernels import dispatch, triton_act_quant  # noqa: E402
from lowbit.nodes.comfy_ops import DeferredGELUMixin, DeferredLayerNormMixin  # noqa: E402
from lowbit.nodes.model_quant import quantize_model  # noqa: E402
from lowbit.quant.policy import Policy  # noqa: E402

pytestmark = needs_triton_interpreter() if device().type == "cpu" else []


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

    calls, differing = [], []
    real = triton_act_quant.act_quant_triton

    def spy(x, *args, **kwargs):
        out = real(x, *args, **kwargs)
        calls.append(x)
        if not isinstance(x, torch.Tensor):  # the same kernel on the input ComfyUI's graph computes
            ref = real(x.materialize(), *args, **{**kwargs, "split": "pow2"})
            codes, ref_codes = out[0].float(), ref[0].float()
            diff = (codes - ref_codes).abs()
            # one INT8 step; e4m3: a step plus 2^-7 of the range (where shift + norm * mult nearly cancels,
            # one bf16 step of the norm is a large share of the sum: kernels/gpu_checks.py)
            step = 1.0 if out[0].dtype == torch.int8 else ref_codes.abs() * 0.125 + 448 * 2**-7
            differing.append(((diff > 0).float().mean().item(), bool((diff <= step).all()),
                              ((out[1] - ref[1]).abs() / ref[1]).max().item(),
                              (out[2] - ref[2]).abs().max().item() if out[2].numel() else 0.0))
        return out

    monkeypatch.setattr(triton_act_quant, "act_quant_triton", spy)
    with dispatch.use_dispatcher(TritonFirst(measure=False, fast=False)):  # no settled plans: all computed
        unfused = run_flux(model)
    assert calls and all(isinstance(x, torch.Tensor) for x in calls)
    with dispatch.use_dispatcher(TritonFirst(measure=False)):
        first = run_flux(model)  # settles the plans: each first call runs the fused plan it settled
        calls.clear()
        fused = run_flux(model)
    assert torch.equal(first, fused)  # the first run gives the bits of the next (a seed, the same image)
    prologues = collections.Counter(
        ("cat" if x.a is not None else "gelu") if type(x).__name__ == "GeluPrologue" else type(x).__name__
        for x in calls if not isinstance(x, torch.Tensor))
    _assert_resident_in_the_vbar_if_dynamic(model)  # Dynamic VRAM: the fused path runs on the vbar's copies
    assert prologues["NormModPrologue"] == 4 * len(dm.double_blocks) + len(dm.single_blocks)
    assert prologues["cat"] == len(dm.single_blocks)
    assert prologues["gelu"] == 2 * len(dm.double_blocks)
    # every fused call: the codes of the input ComfyUI's own graph computes, but where the last bit of
    # tanh or of the row variance moves a value to the neighbouring bf16 (then its code moves one step)
    for frac, within_a_step, scale_rel, mean_diff in differing:
        assert frac < 1e-3 and within_a_step and scale_rel < 2**-7 and mean_diff < 1e-5
    # the output: as accurate as the unfused run (this random model amplifies a moved code, so the two
    # differ by more than the codes do)
    assert torch.isfinite(fused).all()
    quant_error = (unfused - float_output).pow(2).mean()
    assert (fused - float_output).pow(2).mean() <= 1.1 * quant_error


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
