"""Inputs computed inside the activation quantization (``kernels/prologue.py``, ``quant/deferred.py``).

* The act-quant kernel's LayerNorm + modulation prologue (Triton interpreter) gives the codes and
  scales of the same kernel on the materialized input (``F.layer_norm`` then ``torch.addcmul``), for
  INT8 and e4m3, every rotation and HadaNorm's smoothing and centring, one or two batch elements,
  fp16 and bf16; the GELU prologue the same with a rotation; the SwiGLU prologue (``silu(gate) * up``,
  ComfyUI's eager form) the same, rotated or not, INT8 and e4m3, bf16, fp16 and fp32, with gates far
  enough below zero that the SiLU's exponential overflows, after an attention output (Flux 2), and with the
  gate and up given apart (Lumina 2's and Z-Image's two linears); the RMSNorm prologue (a weight of the input's
  dtype, rounded once or before the weight; an fp32 one; the modulation as one ``addcmul`` or as a product then a
  sum) the same.
* A ``DeferredInput`` answers shape, dtype and device without computing anything; ``cat`` with a
  deferred GELU, ``addcmul`` of a deferred norm and a norm times then plus one modulation row per batch element
  extend the recipe; every other op (in place ones
  included) sees the materialized tensor, equal to what torch computes without deferral.
* Each W8A8 format's ``prologue_linear`` runs the settled plan on the prologue (after one unfused call)
  and gives the unfused linear's bits; without a settled plan, or with one that does not take our
  codes, it declines (``None``). (The ``torch`` decision's fused path needs a GPU: on the CPU that
  plan quantizes with the eager reference, which a prologue cannot feed.)
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kernels_helpers import needs_triton_interpreter, randn
from lowbit.kernels import dispatch, triton_act_quant
from lowbit.kernels.backend import capability
from lowbit.kernels.gemm_config import default_config
from lowbit.kernels.prologue import GeluPrologue, NormModPrologue, PrologueError, SwigluPrologue
from lowbit.kernels.reference import FP8, FP8_MAX, INT8_MAX
from lowbit.kernels.triton_act_quant import act_quant_triton
from lowbit.quant.deferred import (DeferredInput, defer_gelu, defer_layer_norm, defer_rms_norm, defer_swiglu,
                                  defer_swiglu_pair, rms_norm_weight_rounding)
from lowbit.quant.formats import FORMATS

K = 256
#: LOWBIT_TEST_DEVICE=cuda runs the fused linears on the GPU (tests/gpu/README.md); else the interpreter
DEVICE = torch.device(os.environ.get("LOWBIT_TEST_DEVICE", "cpu"))
interpreter = needs_triton_interpreter()  # CPU tensors through the Triton interpreter
on_device = interpreter if DEVICE.type == "cpu" else pytest.mark.skipif(False, reason="")


def _norm_inputs(rows: int, k: int, batches: int, dtype, seed: int):
    x = randn(rows * batches, k, seed=seed, scale=3.0) + 0.7
    mult = 1 + randn(batches, k, seed=seed + 1, scale=0.3)
    shift = randn(batches, k, seed=seed + 2, scale=0.5)
    return x.to(dtype), mult.to(dtype), shift.to(dtype)


@pytest.mark.parametrize("rotation,group,smooth,center", [("none", 0, False, False), ("regular", 256, False, False),
                                                          ("sylvester", 128, True, True)])
@interpreter
@pytest.mark.parametrize("code", ("int8", "fp8"))
@pytest.mark.parametrize("batches,dtype", [(1, torch.bfloat16), (2, torch.bfloat16), (2, torch.float16)])
def test_norm_mod_prologue_codes_equal_the_kernel_on_the_materialized_input(rotation, group, smooth, center, code,
                                                                            batches, dtype):
    out_dtype, qmax = (torch.int8, INT8_MAX) if code == "int8" else (FP8, FP8_MAX)
    x, mult, shift = _norm_inputs(5, K, batches, dtype, seed=7)
    prologue = NormModPrologue(x, 1e-6, mult, shift, 5 if batches > 1 else 0)
    materialized = prologue.materialize()
    expected = torch.addcmul(shift[:, None], F.layer_norm(x.view(batches, 5, K), (K,), eps=1e-6), mult[:, None])
    assert torch.equal(materialized, expected.reshape(-1, K))  # ComfyUI's apply_mod, as broadcast there
    sm = (torch.rand(K, generator=torch.Generator().manual_seed(3)) + 0.5) if smooth else None
    q, s, mean = act_quant_triton(prologue, out_dtype, qmax, rotation, group, sm, center)
    qr, sr, mean_r = act_quant_triton(materialized, out_dtype, qmax, rotation, group, sm, center, split="pow2")
    assert torch.equal(q.float(), qr.float())
    assert torch.equal(s, sr)
    assert torch.equal(mean, mean_r)


@interpreter
@pytest.mark.parametrize("mult,shift", [(True, False), (False, True), (False, False)])
def test_norm_prologue_without_mult_or_shift(mult, shift):
    x, m, sh = _norm_inputs(6, K, 1, torch.bfloat16, seed=11)
    prologue = NormModPrologue(x, 1e-5, m if mult else None, sh if shift else None)
    q, s, _ = act_quant_triton(prologue, torch.int8, INT8_MAX, "none", 0, None, False)
    qr, sr, _ = act_quant_triton(prologue.materialize(), torch.int8, INT8_MAX, "none", 0, None, False)
    assert torch.equal(q, qr) and torch.equal(s, sr)


@interpreter
@pytest.mark.parametrize("code,rotation,group", [("int8", "none", 0), ("int8", "regular", 256), ("fp8", "none", 0)])
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("weight", ("input dtype", "input dtype, rounded first", "fp32", None))
@pytest.mark.parametrize("two_step", (False, True))
def test_rms_norm_prologue_codes_equal_the_kernel_on_the_materialized_input(code, rotation, group, dtype, weight,
                                                                            two_step):
    out_dtype, qmax = (torch.int8, INT8_MAX) if code == "int8" else (FP8, FP8_MAX)
    x, mult, shift = _norm_inputs(5, K, 2, dtype, seed=17)
    w = None if weight is None else (1 + randn(K, seed=19, scale=0.3))
    if w is not None:
        w = w.to(dtype if weight.startswith("input") else torch.float32)
    first = weight == "input dtype, rounded first"
    prologue = NormModPrologue(x, 1e-5, mult, shift, 5, rms=True, weight=w, two_step=two_step,
                               round_before_weight=first)
    materialized = prologue.materialize()
    if first:
        norm = F.rms_norm(x, (K,), None, 1e-5) * w
    elif w is None or w.dtype == dtype:
        norm = F.rms_norm(x, (K,), w, 1e-5)
    else:
        norm = F.rms_norm(x.float(), (K,), w, 1e-5).to(dtype)
    norm, m, sh = norm.view(2, 5, K), mult[:, None], shift[:, None]
    modulated = norm * m + sh if two_step else torch.addcmul(sh, norm, m)
    assert torch.equal(materialized, modulated.reshape(-1, K))
    q, s, _ = act_quant_triton(prologue, out_dtype, qmax, rotation, group, None, False)
    qr, sr, _ = act_quant_triton(materialized, out_dtype, qmax, rotation, group, None, False, split="pow2")
    assert torch.equal(q.float(), qr.float())
    assert torch.equal(s, sr)


def test_rms_norm_prologue_rounding_matters():
    """The two modulations, the two weight dtypes and the two roundings differ: a kernel that ignored a flag would
    fail above."""
    x, mult, shift = _norm_inputs(5, K, 2, torch.bfloat16, seed=17)
    w = 1 + randn(K, seed=19, scale=0.3)
    one, two = (NormModPrologue(x, 1e-5, mult, shift, 5, rms=True, weight=w, two_step=t).materialize()
                for t in (False, True))
    assert not torch.equal(one, two)
    assert not torch.equal(NormModPrologue(x, 1e-5, rms=True, weight=w).materialize(),
                           NormModPrologue(x, 1e-5, rms=True, weight=w.bfloat16()).materialize())
    assert not torch.equal(NormModPrologue(x, 1e-5, rms=True, weight=w.bfloat16()).materialize(),
                           NormModPrologue(x, 1e-5, rms=True, weight=w.bfloat16(),
                                           round_before_weight=True).materialize())
    with pytest.raises(PrologueError, match="composite"):
        NormModPrologue(x, 1e-5, rms=True, weight=w, round_before_weight=True)  # fp32 weight: rounded once anyway
    with pytest.raises(PrologueError, match="RMSNorm"):
        NormModPrologue(x, 1e-5, weight=w)  # a weight on the LayerNorm prologue
    with pytest.raises(PrologueError, match="weight"):
        NormModPrologue(x, 1e-5, rms=True, weight=w[:-1])


@interpreter
def test_deferred_rms_norm_mul_and_add_extend_the_recipe():
    gen = torch.Generator().manual_seed(23)
    x = (torch.randn(2, 6, K, generator=gen) * 2).bfloat16()
    w = (1 + 0.2 * torch.randn(K, generator=gen)).bfloat16()
    scale, shift = (torch.randn(2, 1, K, generator=gen).bfloat16() for _ in range(2))
    own = F.rms_norm(x, (K,), w, 1e-6)
    d = defer_rms_norm(x, w, 1e-6)
    assert isinstance(d, DeferredInput) and torch.equal(d.materialize(), own)
    for got, want, two_step in ((defer_rms_norm(x, w, 1e-6) * (1 + scale), own * (1 + scale), False),
                                ((1 + scale) * defer_rms_norm(x, w, 1e-6) + shift, (1 + scale) * own + shift, True),
                                (torch.add(shift, defer_rms_norm(x, w, 1e-6)), shift + own, False),
                                (defer_rms_norm(x, w, 1e-6).mul(scale[:1]) + shift, own * scale[:1] + shift, True)):
        assert isinstance(got, DeferredInput) and isinstance(got.prologue, NormModPrologue)
        assert got.prologue.two_step == two_step and got.prologue.rows_per_batch in (0, 6)
        assert torch.equal(got.materialize(), want)
    # what the recipe cannot hold is computed as torch computes it: a per-token factor, another dtype, a second
    # modulation, a scaled sum, an in-place product
    cases = ((lambda: defer_rms_norm(x, w, 1e-6) * x, lambda: own * x),
             (lambda: defer_rms_norm(x, w, 1e-6) * scale.float(), lambda: own * scale.float()),
             (lambda: defer_rms_norm(x, w, 1e-6) * scale * scale, lambda: own * scale * scale),
             (lambda: torch.add(defer_rms_norm(x, w, 1e-6), shift, alpha=2), lambda: torch.add(own, shift, alpha=2)),
             (lambda: defer_rms_norm(x, w, 1e-6).mul_(scale), lambda: own.clone().mul_(scale)))
    for make, want in cases:
        got = make()
        assert type(got) is torch.Tensor and torch.equal(got, want())
    assert defer_rms_norm(x, w[:-1], 1e-6) is None and defer_rms_norm(x, w.half(), 1e-6) is None


def test_the_rms_norm_probe_tells_one_rounding_from_two(monkeypatch):
    """A ComfyUI RMSNorm with a weight defers where the kernel knows how torch's ``rms_norm`` rounds the weighted
    row: once (torch 2.14's CPU kernel), or before the weight (a composite form); anything else is not deferred."""
    from lowbit.quant import deferred

    monkeypatch.setattr(deferred, "_WEIGHT_ROUNDING", {})
    assert rms_norm_weight_rounding(torch.device("cpu"), torch.bfloat16) == "once"
    real = F.rms_norm

    def composite(x, shape, weight=None, eps=None):
        out = real(x, shape, None, eps)
        return out if weight is None else out * weight

    monkeypatch.setattr(deferred, "_WEIGHT_ROUNDING", {})
    monkeypatch.setattr(torch.nn.functional, "rms_norm", composite)
    assert rms_norm_weight_rounding(torch.device("cpu"), torch.bfloat16) == "twice"
    monkeypatch.setattr(deferred, "_WEIGHT_ROUNDING", {})
    monkeypatch.setattr(torch.nn.functional, "rms_norm",  # another epsilon: neither rounding
                        lambda x, shape, weight=None, eps=None: composite(x, shape, weight, 1e-2))
    assert rms_norm_weight_rounding(torch.device("cpu"), torch.bfloat16) is None


@interpreter
@pytest.mark.parametrize("code", ("int8", "fp8"))
def test_gelu_prologue_with_a_rotation(code):
    out_dtype, qmax = (torch.int8, INT8_MAX) if code == "int8" else (FP8, FP8_MAX)
    wide = randn(6, K + 32, seed=5, scale=3.0, dtype=torch.bfloat16)
    prologue = GeluPrologue(wide[:, 32:], randn(6, K, seed=6, dtype=torch.bfloat16), "tanh")
    q, s, _ = act_quant_triton(prologue, out_dtype, qmax, "regular", 256, None, False)
    qr, sr, _ = act_quant_triton(prologue.materialize(), out_dtype, qmax, "regular", 256, None, False, split="pow2")
    assert torch.equal(q.float(), qr.float())
    assert torch.allclose(s, sr, rtol=1e-6)


def _gate_up(rows: int, k: int, dtype, seed: int) -> torch.Tensor:
    """``[gate | up]`` rows with a few gates far below zero (``e^-gate`` beyond fp32's range)."""
    x = randn(rows, 2 * k, seed=seed, scale=3.0)
    x[0, :4] = torch.tensor([-100.0, -90.0, -85.0, -60.0])
    return x.to(dtype)


@interpreter
@pytest.mark.parametrize("code", ("int8", "fp8"))
@pytest.mark.parametrize("rotation,group", [("none", 0), ("regular", 256)])
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16, torch.float32))
def test_swiglu_prologue_codes_equal_the_kernel_on_the_materialized_input(code, rotation, group, dtype):
    out_dtype, qmax = (torch.int8, INT8_MAX) if code == "int8" else (FP8, FP8_MAX)
    x = _gate_up(6, K, dtype, seed=13)
    prologue = SwigluPrologue(x)
    assert prologue.shape == (6, K)
    materialized = prologue.materialize()
    assert torch.equal(materialized, F.silu(x[:, :K]) * x[:, K:])  # ComfyUI's INPUT_ACT_EAGER["swiglu"]
    q, s, _ = act_quant_triton(prologue, out_dtype, qmax, rotation, group, None, False)
    qr, sr, _ = act_quant_triton(materialized, out_dtype, qmax, rotation, group, None, False, split="pow2")
    assert torch.equal(q.float(), qr.float())
    assert torch.allclose(s, sr, rtol=1e-6)


@interpreter
@pytest.mark.parametrize("code", ("int8", "fp8"))
def test_swiglu_prologue_after_an_attention_output(code):
    """Flux 2's single blocks: ``cat((attn, swiglu(mlp)), -1)``, ``mlp`` a column slice of a wider output."""
    out_dtype, qmax = (torch.int8, INT8_MAX) if code == "int8" else (FP8, FP8_MAX)
    wide = torch.cat((randn(6, 96, seed=3, dtype=torch.bfloat16), _gate_up(6, K - 64, torch.bfloat16, seed=4)), 1)
    attn = randn(6, 64, seed=5, scale=2.0, dtype=torch.bfloat16)
    prologue = SwigluPrologue(wide[:, 96:], attn)
    assert prologue.shape == (6, K) and prologue.x.stride(0) == wide.shape[1]
    gate, up = wide[:, 96:].chunk(2, dim=-1)
    materialized = prologue.materialize()
    assert torch.equal(materialized, torch.cat((attn, F.silu(gate) * up), 1))
    q, s, _ = act_quant_triton(prologue, out_dtype, qmax, "regular", 256, None, False)
    qr, sr, _ = act_quant_triton(materialized, out_dtype, qmax, "regular", 256, None, False, split="pow2")
    assert torch.equal(q.float(), qr.float())
    assert torch.allclose(s, sr, rtol=1e-6)


@interpreter
@pytest.mark.parametrize("code,rotation,group,dtype", [("int8", "none", 0, torch.bfloat16),
                                                       ("int8", "regular", 256, torch.bfloat16),
                                                       ("fp8", "regular", 256, torch.bfloat16),
                                                       ("fp8", "none", 0, torch.float16),
                                                       ("int8", "none", 0, torch.float32)])
def test_swiglu_prologue_of_a_gate_and_up_given_apart(code, rotation, group, dtype):
    """Lumina 2's and Z-Image's ``silu(w1(x)) * w3(x)``: the up half a tensor of its own (here a column slice of a
    wider one, so the two sources have different row strides)."""
    out_dtype, qmax = (torch.int8, INT8_MAX) if code == "int8" else (FP8, FP8_MAX)
    gate = _gate_up(6, K, dtype, seed=17)[:, :K].contiguous()  # gates with e^-gate beyond fp32's range
    up = randn(6, K + 48, seed=18, scale=2.0, dtype=dtype)[:, 48:]
    prologue = SwigluPrologue(gate, up=up)
    assert prologue.shape == (6, K)
    materialized = prologue.materialize()
    assert torch.equal(materialized, F.silu(gate) * up)  # Lumina's FeedForward gating outside fp16
    q, s, _ = act_quant_triton(prologue, out_dtype, qmax, rotation, group, None, False)
    qr, sr, _ = act_quant_triton(materialized, out_dtype, qmax, rotation, group, None, False, split="pow2")
    assert torch.equal(q.float(), qr.float())
    assert torch.allclose(s, sr, rtol=1e-6)


@interpreter
def test_prologues_refuse_sources_that_disagree():
    x = torch.zeros(6, K, dtype=torch.bfloat16)
    with pytest.raises(PrologueError, match="modulation rows"):
        NormModPrologue(x, 1e-6, torch.ones(2, K, dtype=torch.bfloat16), None, 4)  # 2 x 4 != 6 rows
    with pytest.raises(PrologueError, match="mult must be"):
        NormModPrologue(x, 1e-6, torch.ones(1, K), None)  # fp32 modulation for a bf16 input
    with pytest.raises(ValueError, match="pow2"):
        act_quant_triton(NormModPrologue(x, 1e-6), torch.int8, INT8_MAX, "none", 0, None, False, split="pieces")
    with pytest.raises(PrologueError, match=r"\[M, 2H\]"):
        SwigluPrologue(torch.zeros(6, 7))  # no gate and up halves
    with pytest.raises(PrologueError, match="a must be"):
        SwigluPrologue(torch.zeros(6, 8), torch.zeros(5, 4))  # not x's rows
    with pytest.raises(PrologueError, match="gate and up"):
        SwigluPrologue(torch.zeros(6, 8), up=torch.zeros(6, 16))  # the up half wider than the gate
    with pytest.raises(PrologueError, match="gate and up"):
        SwigluPrologue(torch.zeros(6, 8), up=torch.zeros(6, 8, dtype=torch.bfloat16))


# ---- the deferred tensor ----------------------------------------------------------------------------

def _mlp_and_attn(seed: int):
    mlp_wide = randn(2, 3, 2 * K, seed=seed, scale=2.0, dtype=torch.bfloat16)
    return mlp_wide[..., K:], randn(2, 3, K, seed=seed + 1, dtype=torch.bfloat16)


@interpreter
def test_deferred_gelu_answers_metadata_without_computing_and_cat_extends_the_recipe():
    mlp, attn = _mlp_and_attn(1)
    g = defer_gelu(mlp, "tanh")
    assert isinstance(g, DeferredInput)
    assert g.shape == (2, 3, K) and g.dtype == torch.bfloat16 and g.device == mlp.device and g.dim() == 3
    assert g._value is None
    cat = torch.cat((attn, g), 2)
    assert isinstance(cat, DeferredInput) and cat.shape == (2, 3, 2 * K)
    assert cat.prologue.a is not None and cat._value is None
    expected = torch.cat((attn, F.gelu(mlp, approximate="tanh")), 2)
    assert torch.equal(cat.materialize(), expected)
    # any other op computes the value, equal to torch's
    assert torch.equal(cat * 2, expected * 2)
    assert type(cat * 2) is torch.Tensor


@interpreter
def test_other_concatenations_and_ops_see_the_computed_tensor():
    mlp, attn = _mlp_and_attn(2)
    g = defer_gelu(mlp, "none")
    ref = F.gelu(mlp)
    assert not isinstance(torch.cat((g, attn), 2), DeferredInput)  # the deferred part first: computed
    assert torch.equal(torch.cat((g, attn), 2), torch.cat((ref, attn), 2))
    assert torch.equal(torch.cat((attn, g), 1), torch.cat((attn, ref), 1))  # not the last dim
    assert torch.equal(g.sum(-1), ref.sum(-1))
    assert torch.equal(g.reshape(-1, K), ref.reshape(-1, K))
    g.mul_(3)  # in place: on the computed value, which the deferred tensor keeps
    assert torch.equal(g.materialize(), ref * 3)
    assert torch.equal(g + 0, ref * 3)


@interpreter
def test_deferred_norm_and_addcmul_build_the_modulated_norm():
    x = randn(2, 3, K, seed=3, scale=2.0, dtype=torch.bfloat16)
    mult = 1 + randn(2, 1, K, seed=4, scale=0.2, dtype=torch.bfloat16)
    shift = randn(2, 1, K, seed=5, dtype=torch.bfloat16)
    n = defer_layer_norm(x, 1e-6)
    assert isinstance(n, DeferredInput)
    out = torch.addcmul(shift, n, mult)  # ComfyUI's apply_mod
    assert isinstance(out, DeferredInput) and out.prologue.mult is not None and out.prologue.rows_per_batch == 3
    expected = torch.addcmul(shift, F.layer_norm(x, (K,), eps=1e-6), mult)
    assert torch.equal(out.materialize(), expected)
    # shapes that are not one modulation row per batch element, or a value other than 1: computed
    per_token = randn(2, 3, K, seed=6, dtype=torch.bfloat16)
    for args, kwargs in (((shift, defer_layer_norm(x, 1e-6), per_token), {}),
                         ((shift, defer_layer_norm(x, 1e-6), mult), {"value": 2})):
        got = torch.addcmul(*args, **kwargs)
        assert type(got) is torch.Tensor
        assert torch.equal(got, torch.addcmul(args[0], F.layer_norm(x, (K,), eps=1e-6), args[2], **kwargs))


@interpreter
def test_deferred_swiglu_answers_metadata_and_computes_comfyuis_eager_form():
    x = _gate_up(6, K, torch.bfloat16, seed=8).reshape(2, 3, 2 * K)
    h = defer_swiglu(x)
    assert isinstance(h, DeferredInput) and isinstance(h.prologue, SwigluPrologue)
    assert h.shape == (2, 3, K) and h.dtype == torch.bfloat16 and h._value is None
    gate, up = x.chunk(2, dim=-1)
    expected = F.silu(gate).mul_(up)
    assert torch.equal(h.materialize(), expected) and torch.equal(h * 2, expected * 2)
    # an attention output before it (Flux 2's single blocks) extends the recipe; after it, computed
    attn = randn(2, 3, 64, seed=9, dtype=torch.bfloat16)
    cat = torch.cat((attn, defer_swiglu(x)), -1)
    assert isinstance(cat, DeferredInput) and cat.prologue.a is not None and cat.shape == (2, 3, 64 + K)
    assert torch.equal(cat.materialize(), torch.cat((attn, expected), -1))
    assert type(torch.cat((defer_swiglu(x), attn), -1)) is torch.Tensor
    # halves too wide for the act-quant kernel: computed, the same way
    wide = randn(2, 1 << 17, seed=2, dtype=torch.bfloat16)
    got = defer_swiglu(wide)
    gate, up = wide.chunk(2, dim=-1)
    assert type(got) is torch.Tensor and torch.equal(got, F.silu(gate) * up)


@interpreter
def test_deferred_swiglu_pair_answers_metadata_and_computes_the_gating():
    gate = _gate_up(6, K, torch.bfloat16, seed=10)[:, :K].reshape(2, 3, K)
    up = randn(2, 3, K, seed=11, dtype=torch.bfloat16)
    h = defer_swiglu_pair(gate, up)
    assert isinstance(h, DeferredInput) and isinstance(h.prologue, SwigluPrologue) and h.prologue.up is not None
    assert h.shape == (2, 3, K) and h.dtype == torch.bfloat16 and h._value is None
    expected = F.silu(gate) * up
    assert torch.equal(h.materialize(), expected) and torch.equal(h - 1, expected - 1)
    # what the act-quant kernel cannot take, or two tensors that are not one shape and dtype: not deferred
    assert defer_swiglu_pair(gate, up[..., :-1]) is None
    assert defer_swiglu_pair(gate, up.float()) is None
    assert defer_swiglu_pair(gate, h) is None  # a deferred up
    assert defer_swiglu_pair(randn(2, 1 << 16, seed=2, dtype=torch.bfloat16),
                             randn(2, 1 << 16, seed=3, dtype=torch.bfloat16)) is None  # too wide


@interpreter
def test_inputs_that_cannot_be_deferred_are_computed(monkeypatch):
    x = randn(2, 3, K, seed=9, dtype=torch.bfloat16)
    assert type(defer_gelu(x, "tanh")) is DeferredInput
    assert defer_layer_norm(x[0, 0], 1e-6) is None  # 1-D
    assert defer_layer_norm(randn(2, 1 << 16, seed=1, dtype=torch.bfloat16), 1e-6) is None  # too wide
    with torch.enable_grad():
        xg = x.float().requires_grad_()
        assert type(defer_gelu(xg, "tanh")) is torch.Tensor
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU tensor without the interpreter: no kernel would take it
    assert type(defer_gelu(x, "tanh")) is torch.Tensor and defer_layer_norm(x, 1e-6) is None


# ---- each W8A8 format's fused linear ------------------------------------------------------------------

W8A8 = ("int8", "int8_convrot", "int8_quarot", "int8_hadanorm", "fp8", "fp8_rowwise")


def _weight(fmt: str, n: int, k: int):
    return FORMATS[fmt].quantize(randn(n, k, seed=21) / k**0.5)


def _prologues(seed: int, device: torch.device = torch.device("cpu")):
    mlp, attn = (t.to(device) for t in _mlp_and_attn(seed))
    x, mult, shift = (t.to(device) for t in _norm_inputs(3, K, 2, torch.bfloat16, seed=seed))
    return {"gelu": GeluPrologue(mlp.reshape(-1, K), None, "tanh"),
            "cat": GeluPrologue(mlp.reshape(-1, K), attn.reshape(-1, K), "tanh"),
            "norm": NormModPrologue(x, 1e-6, mult, shift, 3),
            "swiglu": SwigluPrologue(_gate_up(6, K, torch.bfloat16, seed=seed).to(device)),
            "cat_swiglu": SwigluPrologue(_gate_up(6, K - 64, torch.bfloat16, seed=seed).to(device),
                                         attn.reshape(-1, K)[:, :64].to(device)),
            "swiglu_pair": SwigluPrologue(mlp.reshape(-1, K), up=attn.reshape(-1, K))}


@on_device
@pytest.mark.parametrize("fmt", W8A8)
@pytest.mark.parametrize("kind", ("gelu", "cat", "norm", "swiglu", "cat_swiglu", "swiglu_pair"))
@pytest.mark.parametrize("decision", ("triton", "torch"))
def test_prologue_linear_runs_the_settled_plan_and_gives_the_unfused_bits(fmt, kind, decision, monkeypatch):
    if decision == "torch" and DEVICE.type != "cuda":
        pytest.skip("the torch decision quantizes with our kernel on a GPU only (the eager reference elsewhere)")
    prologue = _prologues(31, DEVICE)[kind]
    m, k = prologue.shape
    n = 32
    codec = FORMATS[fmt]
    weight = _weight(fmt, n, k).to(device=DEVICE, dtype=torch.bfloat16)
    bias = randn(n, seed=22, dtype=torch.bfloat16).to(DEVICE)
    x = prologue.materialize()
    form = codec.w8a8_form(x, weight)
    if form is None:
        assert fmt == "fp8" and DEVICE.type == "cpu"
        pytest.skip("fp8 keeps comfy-kitchen's per-tensor activation scale on the CPU")
    pre = "+".join(p for p in (form.smooth is not None and "smooth", form.center_rowsum is not None and "center",
                               form.rotation != "none" and f"{form.rotation}{form.group_size}") if p)
    key = dispatch.DispatchKey(form.fmt + (f"+{pre}" if pre else ""), capability(DEVICE), dispatch.m_bucket(m), n,
                               k).as_str()
    name = f"triton:{default_config(m).name}" if decision == "triton" else "torch"
    calls = []
    real = triton_act_quant.act_quant_triton
    monkeypatch.setattr(triton_act_quant, "act_quant_triton",
                        lambda src, *a, **kw: calls.append(type(src).__name__) or real(src, *a, **kw))
    with dispatch.use_dispatcher(dispatch.Dispatcher(measure=False, decisions={key: name})):
        assert codec.prologue_linear(prologue, weight, bias) is None  # nothing settled yet
        unfused = codec.linear(x, weight, bias)  # settles the plan
        calls.clear()
        fused = codec.prologue_linear(prologue, weight, bias)
    assert calls == [type(prologue).__name__]
    assert fused is not None and torch.equal(fused, unfused)


def _norm_prologue(seed: int) -> NormModPrologue:
    """A modulated norm of 24 rows (two batch elements of 12): ``torch._int_mm`` takes more than 16."""
    x, mult, shift = (t.to(DEVICE) for t in _norm_inputs(12, K, 2, torch.bfloat16, seed=seed))
    return NormModPrologue(x, 1e-6, mult, shift, 12)


@on_device
@pytest.mark.parametrize("fmt", ("int8_convrot", "int8_hadanorm", "fp8_rowwise"))
@pytest.mark.parametrize("decision", ("triton", "torch"))
def test_sibling_linears_of_one_prologue_quantize_it_once(fmt, decision, monkeypatch):
    """Three linears taking one input (Qwen-Image's q/k/v on the modulated norm): once the first has learned
    that its input has siblings, the act-quant kernel runs once per input and each linear gives the bits of its
    unfused call; a linear alone on its input keeps no codes with it. HadaNorm's smoothing vector is each
    layer's own, so are its codes: each linear quantizes."""
    from lowbit.kernels import launcher
    from lowbit.kernels.w8a8_linear import _SHARED_CODES

    if decision == "torch" and DEVICE.type != "cuda":
        pytest.skip("the torch decision quantizes with our kernel on a GPU only (the eager reference elsewhere)")
    codec = FORMATS[fmt]
    weights = [codec.quantize(randn(32, K, seed=70 + i) / K**0.5).to(device=DEVICE, dtype=torch.bfloat16)
               for i in range(4)]
    lone = codec.quantize(randn(48, K, seed=75) / K**0.5).to(device=DEVICE, dtype=torch.bfloat16)
    first = _norm_prologue(31)
    m, k = first.shape
    x = first.materialize()
    shares = codec.w8a8_form(x, weights[0]).smooth is None
    decisions = {}
    for n, w in ((32, weights[0]), (48, lone)):
        form = codec.w8a8_form(x, w)
        pre = "+".join(p for p in (form.smooth is not None and "smooth", form.center_rowsum is not None and "center",
                                   form.rotation != "none" and f"{form.rotation}{form.group_size}") if p)
        key = dispatch.DispatchKey(form.fmt + (f"+{pre}" if pre else ""), capability(DEVICE), dispatch.m_bucket(m),
                                   n, k).as_str()
        decisions[key] = f"triton:{default_config(m).name}" if decision == "triton" else "torch"
    calls = []
    real = triton_act_quant.act_quant_triton
    monkeypatch.setattr(triton_act_quant, "act_quant_triton",
                        lambda src, *a, **kw: calls.append(type(src).__name__) or real(src, *a, **kw))
    # ordinary launches only: a replay runs the kernels without the act-quant function this counts
    with dispatch.use_dispatcher(dispatch.Dispatcher(measure=False, decisions=decisions)), launcher.no_replays():
        for w in (*weights[:3], lone):
            codec.linear(x, w, None)  # settles each plan
        counts = []
        for seed in (31, 32, 33):
            prologue = _norm_prologue(seed)
            calls.clear()
            fused = [codec.prologue_linear(prologue, w, None) for w in weights[:3]]
            counts.append(calls.count("NormModPrologue"))
            unfused = [codec.linear(prologue.materialize(), w, None) for w in weights[:3]]
            assert all(f is not None and torch.equal(f, u) for f, u in zip(fused, unfused))
            alone = _norm_prologue(seed)
            assert torch.equal(codec.prologue_linear(alone, lone, None), codec.linear(alone.materialize(), lone, None))
            kept = [v for v in alone.__dict__[_SHARED_CODES].values() if isinstance(v, tuple)]
            assert kept == [] if decision == "triton" else len(kept) == 1  # torch's GEMMs take the codes as outputs
        # the triton plans learn in the first round (each linear quantizes); torch's GEMMs share from the start
        assert counts == ([3, 3, 3] if not shares else [3, 1, 1] if decision == "triton" else [1, 1, 1])
        # a fourth linear joining later takes the codes too
        prologue = _norm_prologue(34)
        calls.clear()
        codec.prologue_linear(prologue, weights[0], None)
        codec.linear(x, weights[3], None)
        calls.clear()
        joined = codec.prologue_linear(prologue, weights[3], None)
        assert calls == ([] if shares else ["NormModPrologue"]) and torch.equal(joined, codec.linear(prologue.materialize(), weights[3], None))


@on_device
@pytest.mark.parametrize("fmt", ("int8", "int8_convrot"))
def test_prologue_linear_declines_where_the_plan_does_not_take_our_codes(fmt):
    prologue = _prologues(41)["norm"]
    m, k = prologue.shape
    codec = FORMATS[fmt]
    weight = _weight(fmt, 32, k).to(dtype=torch.bfloat16)
    form = codec.w8a8_form(prologue.materialize(), weight)
    pre = f"+{form.rotation}{form.group_size}" if form.rotation != "none" else ""
    key = dispatch.DispatchKey(f"int8{pre}", (0, 0), dispatch.m_bucket(m), 32, k).as_str()
    with dispatch.use_dispatcher(dispatch.Dispatcher(measure=False, decisions={key: "dequant"})):
        codec.linear(prologue.materialize(), weight, None)
        assert codec.prologue_linear(prologue, weight, None) is None


@on_device
@pytest.mark.parametrize("fmt", ("w4a4", "w4a8"))
@pytest.mark.parametrize("kind", ("cat", "norm", "swiglu", "cat_swiglu", "swiglu_pair"))
@pytest.mark.parametrize("decision", ("triton", "expand"))
def test_4bit_prologue_linear_runs_the_settled_plan(fmt, kind, decision, monkeypatch):
    if decision == "expand" and fmt == "w4a4":
        pytest.skip("the expansion is offered for codebook weights only")
    prologue = _prologues(61, DEVICE)[kind]
    m, k = prologue.shape
    codec = FORMATS[fmt]
    weight = _weight(fmt, 32, k).to(device=DEVICE, dtype=torch.bfloat16)
    x = prologue.materialize()
    form = codec.prologue_form(x, weight)
    assert form is not None and codec.w8a8_form(x, weight) is None
    config = default_config(m) if decision == "expand" else default_config(m, "w4")
    name = f"triton:expand-{config.name}" if decision == "expand" else f"triton:{config.name}"
    key = dispatch.DispatchKey(form.fmt, capability(DEVICE), dispatch.m_bucket(m), 32, k).as_str()
    calls = []
    real = triton_act_quant.act_quant_triton
    monkeypatch.setattr(triton_act_quant, "act_quant_triton",
                        lambda src, *a, **kw: calls.append(type(src).__name__) or real(src, *a, **kw))
    with dispatch.use_dispatcher(dispatch.Dispatcher(measure=False, decisions={key: name})):
        assert codec.prologue_linear(prologue, weight, None) is None
        unfused = codec.linear(x, weight, None)
        calls.clear()
        fused = codec.prologue_linear(prologue, weight, None)
    assert calls == [type(prologue).__name__]
    assert fused is not None and torch.equal(fused, unfused)
