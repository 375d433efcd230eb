"""GELU fused into the activation quantization of compiled quantized linears (issue 6).

The act-quant kernel's GELU prologue (``kernels/prologue.py``, Triton interpreter): the codes of
``[a | gelu(b)]`` equal the reference quantization of the materialized input, for both GELUs, INT8 and e4m3, with and without
``a``, ``b`` a column slice of a wider tensor. ``lowbit::quantized_linear_gelu`` passes ``opcheck``,
runs the fused kernel only where the dispatcher settled the unfused call on our act-quant and a GEMM
that takes its codes, and
otherwise computes exactly the unfused linear. ``quant/compile_fusion.py`` rewrites the MLP and Flux
single-block patterns under ``torch.compile`` (and nothing else); the compiled output equals eager.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from kernels_helpers import needs_triton_interpreter, randn
from lowbit.kernels import dispatch, triton_act_quant
from lowbit.kernels.gemm_config import default_config
from lowbit.kernels.reference import FP8, FP8_MAX, INT8_MAX, act_quant_reference
from lowbit.kernels.prologue import GeluPrologue, PrologueError
from lowbit.kernels.triton_act_quant import act_quant_problem, act_quant_triton
from lowbit.kernels.triton_w8a8_gemm import w8a8_mm_triton
from lowbit.quant.compile_fusion import GeluLinearFusion, supported
from lowbit.quant.compiled_linear import (gelu_input, op_arguments, quantized_linear, quantized_linear_gelu_op)
from lowbit.quant.formats import FORMATS
from test_compile_ops import QuantLinear

KA, KB, N = 256, 256, 64  # multiples of every format's group (ConvRot 256)


def _inputs(m: int, ka: int, kb: int, seed: int):
    wide = randn(m, kb + 32, seed=seed, scale=3.0, dtype=torch.bfloat16)
    b = wide[:, 32:]  # a column slice: row stride kb + 32
    a = randn(m, ka, seed=seed + 1, dtype=torch.bfloat16) if ka else None
    return a, b


@needs_triton_interpreter()
@pytest.mark.parametrize("ka", (0, KA))
@pytest.mark.parametrize("approximate", ("tanh", "none"))
@pytest.mark.parametrize("code", ("int8", "fp8"))
def test_gelu_act_quant_equals_the_reference_of_the_materialized_input(ka, approximate, code):
    out_dtype, qmax = (torch.int8, INT8_MAX) if code == "int8" else (FP8, FP8_MAX)
    a, b = _inputs(7, ka, KB, seed=3)
    assert b.stride(0) != b.shape[1]
    q, scale, _ = act_quant_triton(GeluPrologue(b, a, approximate), out_dtype, qmax, "none", 0, None, False)
    x = gelu_input(a, b, approximate)
    g = F.gelu(b, approximate=approximate)
    assert torch.equal(x, g if a is None else torch.cat([a, g], -1))
    ref_q, ref_scale, _ = act_quant_reference(x, out_dtype, qmax)
    assert q.dtype == out_dtype and q.shape == (7, ka + KB)
    # as values: far below a code step the GELU's tail (-1e-35...) keeps no sign in the hand-rounded e4m3
    assert torch.equal(q.float(), ref_q.float())
    assert torch.equal(scale, ref_scale)


def test_gelu_prologue_refuses_what_it_cannot_take():
    with pytest.raises(PrologueError, match="sigmoid"):
        GeluPrologue(torch.zeros(2, 4, dtype=torch.bfloat16), None, "sigmoid")
    assert act_quant_problem(1 << 16, "none", 0) is not None
    assert act_quant_problem(15360, "none", 0) is None
    with pytest.raises(PrologueError, match="same rows"):
        GeluPrologue(torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(3, 4, dtype=torch.bfloat16))


def _gelu_op_args(fmt: str, layer: QuantLinear, a, b, approximate="tanh"):
    args = op_arguments(fmt, gelu_input(a, b, approximate), layer.weight, layer.bias)
    return (a, b, *args[1:], approximate)


@pytest.mark.parametrize("fmt", ("int8", "fp8", "fp8_rowwise", "int8_convrot", "w4a4"))
@pytest.mark.parametrize("ka", (0, KA))
def test_fused_op_passes_opcheck_and_without_a_decision_is_the_unfused_linear(fmt, ka):
    layer = QuantLinear(fmt, N, ka + KB, seed=11)
    a, b = _inputs(5, ka, KB, seed=12)
    args = _gelu_op_args(fmt, layer, a, b)
    torch.library.opcheck(quantized_linear_gelu_op, args)
    expected = quantized_linear(fmt, gelu_input(a, b, "tanh"), layer.weight, layer.bias)
    assert torch.equal(quantized_linear_gelu_op(*args), expected)


@needs_triton_interpreter()
@pytest.mark.parametrize("fmt", ("int8", "fp8_rowwise"))
def test_fused_op_runs_the_kernel_with_the_decided_gemm(fmt, monkeypatch):
    m = 6
    layer = QuantLinear(fmt, N, KA + KB, seed=21)
    a, b = _inputs(m, KA, KB, seed=22)
    config = default_config(m)
    key_fmt = "int8" if fmt == "int8" else "fp8_rowwise"
    key = dispatch.DispatchKey(key_fmt, (0, 0), dispatch.m_bucket(m), N, KA + KB).as_str()
    calls = []
    real = triton_act_quant.act_quant_triton
    monkeypatch.setattr(triton_act_quant, "act_quant_triton",
                        lambda x, *a_, **k: calls.append(isinstance(x, GeluPrologue)) or real(x, *a_, **k))
    args = _gelu_op_args(fmt, layer, a, b)

    def run_twice():  # the unfused first call settles the plan the fused second call runs
        quantized_linear_gelu_op(*args)
        calls.clear()
        return quantized_linear_gelu_op(*args)

    with dispatch.use_dispatcher(dispatch.Dispatcher(measure=False, decisions={key: f"triton:{config.name}"})):
        out = run_twice()
    assert calls == [True]
    codes, w_scale = layer.weight._qdata, layer.weight._params.scale
    code_dtype, qmax = (torch.int8, INT8_MAX) if fmt == "int8" else (FP8, FP8_MAX)
    q, scale, _ = act_quant_reference(gelu_input(a, b, "tanh"), code_dtype, qmax)
    expected = w8a8_mm_triton(q, codes, scale, w_scale.reshape(-1).float(), layer.bias, None, None, torch.bfloat16,
                              config)
    assert torch.equal(out, expected)
    # a decision whose GEMM does not take our codes (dequantize): the unfused linear, no fused kernel
    with dispatch.use_dispatcher(dispatch.Dispatcher(measure=False, decisions={key: "dequant"})):
        assert torch.equal(run_twice(), quantized_linear(fmt, gelu_input(a, b, "tanh"), layer.weight, layer.bias))
    assert True not in calls


class Block(torch.nn.Module):
    """Flux's single block (``linear2(cat((attn, gelu(mlp)), 2))``) and an MLP (``fc2(gelu(fc1(x)))``)."""

    def __init__(self, fmt: str, hidden: int = 256, heads: int = 2):
        super().__init__()
        self.heads, self.hidden = heads, hidden
        self.linear1 = QuantLinear(fmt, 3 * hidden + 4 * hidden, hidden, seed=31)
        self.linear2 = QuantLinear(fmt, hidden, hidden + 4 * hidden, seed=33)
        self.fc1 = QuantLinear(fmt, 4 * hidden, hidden, seed=35)
        self.fc2 = QuantLinear(fmt, hidden, 4 * hidden, seed=37)

    def forward(self, x):
        qkv, mlp = torch.split(self.linear1(x), [3 * self.hidden, 4 * self.hidden], dim=-1)
        b, n, _ = qkv.shape
        q, k, v = qkv.view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, self.hidden)
        x = x + self.linear2(torch.cat((attn, F.gelu(mlp, approximate="tanh")), 2))
        return x + self.fc2(F.gelu(self.fc1(x)))


class Unfusable(torch.nn.Module):
    """Near misses: a GELU with a second user, a concatenation along tokens, a SiLU."""

    def __init__(self, fmt: str, hidden: int = 64):
        super().__init__()
        self.fc1 = QuantLinear(fmt, hidden, hidden, seed=41)
        self.fc2 = QuantLinear(fmt, hidden, hidden, seed=43)
        self.fc3 = QuantLinear(fmt, hidden, hidden, seed=45)

    def forward(self, x):
        g = F.gelu(x)
        y = self.fc1(g) + g
        y = self.fc2(torch.cat((y, F.gelu(x)), 1))
        return self.fc3(F.silu(y))


@pytest.fixture
def fresh_dynamo():
    """A fresh Dynamo, and inductor's caches off: a cached graph skips the pass (and so its count)."""
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()


def _compiled_and_eager(model: torch.nn.Module, x: torch.Tensor):
    """(the pass, compiled output, eager output): ``model`` compiled by inductor with the pass."""
    fusion = GeluLinearFusion()
    compiled = torch.compile(model, backend="inductor", fullgraph=True, options={"pre_grad_custom_pass": fusion})
    with torch.no_grad():
        return fusion, compiled(x), model(x)


@pytest.mark.skipif(not supported(), reason="this torch's inductor has no pre_grad_custom_pass")
@pytest.mark.parametrize("fmt", ("int8", "fp8", "fp8_rowwise", "int8_convrot", "w4a8"))
def test_pass_fuses_the_mlp_and_single_block_patterns_and_matches_eager(fmt, fresh_dynamo):
    """Plain W8A8 formats are rewritten (both patterns); rotated and 4-bit ones are left to inductor."""
    fusion, out, expected = _compiled_and_eager(Block(fmt), randn(2, 12, 256, seed=51, dtype=torch.bfloat16))
    plain = fmt in ("int8", "fp8", "fp8_rowwise")
    assert fusion.fused == (2 if plain else 0)
    if plain:  # the op's body is the eager linear of the same bf16 input
        assert torch.equal(out, expected)
    else:  # inductor's own GELU and concatenation (fp32 inside): close, not equal
        torch.testing.assert_close(out, expected, rtol=0.05, atol=0.05)


@pytest.mark.skipif(not supported(), reason="this torch's inductor has no pre_grad_custom_pass")
def test_pass_leaves_near_misses_alone(fresh_dynamo):
    fusion, out, expected = _compiled_and_eager(Unfusable("int8"), randn(2, 12, 64, seed=61, dtype=torch.bfloat16))
    assert fusion.fused == 0
    # inductor's own GELU / SiLU / adds keep fp32 between them: close to eager, not equal
    torch.testing.assert_close(out, expected, rtol=0.05, atol=0.05)
    assert len(fusion.uuid()) == 32


def test_only_plain_w8a8_specs_are_fusable():
    from lowbit.quant.compile_fusion import fusable_spec
    from lowbit.quant.compiled_linear import linear_spec

    found = {fmt: fusable_spec(linear_spec(fmt, QuantLinear(fmt, 64, 256, seed=71).weight)) for fmt in FORMATS}
    assert found == {fmt: fmt in ("int8", "fp8", "fp8_rowwise") for fmt in FORMATS}
    outliers = FORMATS["fp8_rowwise"].quantize(randn(64, 256, seed=72), outlier_channels=torch.tensor([3, 9], dtype=torch.int32))
    assert not fusable_spec(linear_spec("fp8_rowwise", outliers))  # the outlier columns need the plain act-quant
    assert not fusable_spec("not a spec") and not fusable_spec(None)
