"""torch.compile of LowBit quantized linears, without ComfyUI (issue 6, Show 1, CPU).

For every format: ``lowbit::quantized_linear`` passes ``torch.library.opcheck``; a two-layer module
compiles with ``fullgraph=True`` on inductor into one graph and matches eager exactly (the op's body
is the eager linear); token counts of any size reuse that graph. With a Dynamic LoRA hooked on a
layer, strength changes and a swap to another LoRA of the same rank compile nothing new (counted with
Dynamo's ``CompileCounter``). The kernel ops (``lowbit::act_quant``/``w8a8_mm``/``w4a8_mm``) pass
``opcheck`` with every optional argument in use.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from layout_helpers import sqnr_db
from lowbit.kernels import ops
from lowbit.lora.attach import DynamicLoras
from lowbit.lora.delta import LowRankDelta
from lowbit.kernels.hadamard import _hadamard_cpu_fp32, _hadamard_from_indices, rotate_blocks, unrotate_blocks
from lowbit.quant.compiled_linear import (CompiledLinearError, dequantize_weight, dequantize_weight_op,
                                          linear_spec, op_arguments, param_tensors, parse_spec, quantized_linear,
                                          quantized_linear_op, rebuild_weight)
from lowbit.quant.formats import FORMATS

FORMAT_NAMES = tuple(FORMATS)
HIDDEN, MLP = 256, 512  # multiples of every format's group (ConvRot 256)


def randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


class QuantLinear(torch.nn.Module):
    """What ComfyUI's LowBit Linear does at run time, without ComfyUI."""

    def __init__(self, fmt: str, out_features: int, in_features: int, seed: int):
        super().__init__()
        self.fmt = fmt
        weight = FORMATS[fmt].quantize(randn(out_features, in_features, seed=seed) / in_features**0.5)
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.bias = torch.nn.Parameter(randn(out_features, seed=seed + 1, dtype=torch.bfloat16) * 0.1,
                                       requires_grad=False)

    def forward(self, x):
        return quantized_linear(self.fmt, x, self.weight, self.bias)


class Mlp(torch.nn.Module):
    def __init__(self, fmt: str):
        super().__init__()
        self.fc1 = QuantLinear(fmt, MLP, HIDDEN, seed=1)
        self.fc2 = QuantLinear(fmt, HIDDEN, MLP, seed=3)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # every test counts its own compiles
    yield
    torch._dynamo.reset()


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    x = randn(2, n, HIDDEN, seed=seed, dtype=torch.bfloat16)
    torch._dynamo.mark_dynamic(x, 1)
    return x


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_quantized_linear_op_passes_opcheck(fmt):
    layer = QuantLinear(fmt, 64, HIDDEN, seed=5)
    for x in (randn(3, 7, HIDDEN, seed=6, dtype=torch.bfloat16), randn(5, HIDDEN, seed=7)):
        torch.library.opcheck(quantized_linear_op, op_arguments(fmt, x, layer.weight, layer.bias))
    torch.library.opcheck(quantized_linear_op, op_arguments(fmt, randn(4, HIDDEN, seed=8), layer.weight, None))


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_spec_round_trips_the_weight(fmt):
    weight = QuantLinear(fmt, 64, HIDDEN, seed=5).weight
    spec = parse_spec(linear_spec(fmt, weight))
    args = op_arguments(fmt, randn(1, HIDDEN, seed=1), weight)
    rebuilt = rebuild_weight(args[1], args[2], spec)
    assert rebuilt._layout_cls == weight._layout_cls and type(rebuilt._params) is type(weight._params)
    for a, b in zip([rebuilt._qdata, *param_tensors(rebuilt)], [weight._qdata, *param_tensors(weight)]):
        assert a.dtype == b.dtype and torch.equal(_bits(a), _bits(b))
    assert rebuilt._params.orig_shape == weight._params.orig_shape and spec.out_features == 64
    torch.testing.assert_close(rebuilt.dequantize(), weight.dequantize(), rtol=0, atol=0)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t  # float8 has no CPU equality


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_op_runs_the_bound_runner_with_the_codec_linears_bits(fmt, monkeypatch):
    """The op's steady state (the codec's bound runner, cached per kind of call) gives exactly what the
    codec's full ``linear`` gives, for float32 and bfloat16 inputs, with and without a bias."""
    import lowbit.quant.compiled_linear as cl

    layer = QuantLinear(fmt, 64, HIDDEN, seed=5)
    bound = []
    real_bound_runner = cl._bound_runner
    monkeypatch.setattr(cl, "_bound_runner", lambda *a: bound.append(real_bound_runner(*a)) or bound[-1])
    for x in (randn(3, 7, HIDDEN, seed=6, dtype=torch.bfloat16), randn(5, HIDDEN, seed=7)):
        for bias in (layer.bias, None):
            args = op_arguments(fmt, x, layer.weight, bias)
            full = cl._run(fmt, x, layer.weight, args[3], None, "auto")
            out = quantized_linear_op(*args)
            assert out.dtype == x.dtype and torch.equal(out, full)
    assert len(bound) == 4
    # every format binds on the CPU but per-tensor fp8, whose linear there is kitchen's (no FP8 kernel)
    assert all(runner is None for runner in bound) if fmt == "fp8" else all(runner is not None for runner in bound)


def test_bad_spec_is_a_clear_error():
    with pytest.raises(CompiledLinearError, match="not a LowBit linear spec"):
        parse_spec("int8|TensorWiseINT8Layout")


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_fullgraph_inductor_matches_eager_without_recompiles(fmt):
    model = Mlp(fmt)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        for n in (16, 24, 40):  # token counts: one dynamic graph serves them all
            x = tokens(n, seed=n)
            out = compiled(x)
            expected = model(x)
            assert out.dtype == expected.dtype == torch.bfloat16
            assert torch.equal(out, expected), f"{fmt}: compiled output differs from eager at {n} tokens"
    assert counter.frame_count == 1
    assert counter.op_count > 0


def _lora(seed: int, rank: int, n: int, k: int, strength: float = 1.0) -> LowRankDelta:
    return LowRankDelta(down=randn(rank, k, seed=seed) / k**0.5, up=randn(n, rank, seed=seed + 1) * 0.05,
                        alpha=float(rank), strength=strength)


@pytest.mark.parametrize("fmt", ("int8_convrot", "w4a8"))
def test_dynamic_lora_strength_and_swap_do_not_recompile(fmt):
    model = Mlp(fmt)
    layers = {"fc1.weight": [("a", _lora(10, 4, MLP, HIDDEN))], "fc2.weight": [("a", _lora(12, 4, HIDDEN, MLP))]}
    other = {"fc1.weight": [("b", _lora(20, 4, MLP, HIDDEN))], "fc2.weight": [("b", _lora(22, 4, HIDDEN, MLP))]}
    first, second = DynamicLoras(model, layers), DynamicLoras(model, other)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    x = tokens(16)
    with torch.no_grad():
        plain = model(x)
        first.attach()
        warm = compiled(x)  # warm-up with the hooks in place
        assert counter.frame_count == 1
        # inductor rounds the bf16 LoRA products differently from eager: compare against the size of
        # the LoRA's own effect (a compiled graph that ignored a strength would sit at that level)
        effect = sqnr_db(model(x).float(), plain.float())
        assert effect < 35, f"the test LoRA is too weak to tell ({effect:.1f} dB)"
        assert sqnr_db(warm.float(), model(x).float()) > effect + 10
        warm_eager = model(x).float()
        for label, action in (("strength 0.25", lambda: first.set_strengths({"a": 0.25})),
                              ("strength -2", lambda: first.set_strengths({"a": -2.0})),
                              ("swap", lambda: (first.detach(), second.attach()))):
            action()
            out = compiled(x).float()
            eager = model(x).float()
            change = sqnr_db(eager, warm_eager)  # how far the change moved the eager output
            assert change < 35 and sqnr_db(out, eager) > change + 10, f"{label}: compiled output ignores the change"
        second.detach()
        first.set_strengths({"a": 1.0})
        first.attach()
        assert torch.equal(compiled(x), warm), "swapping back must give the warm-up output again"
        assert counter.frame_count == 1, f"{counter.frame_count - 1} recompiles after warm-up"


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_dequantize_op_passes_opcheck_and_traces_after_eager_use(fmt):
    """Dequantizing inside a compiled graph (ComfyUI dequantizes a weight that a LoRA patches while it
    streams): every format, including kitchen's 4-bit ones whose dequantize multiplies by a Hadamard
    matrix from a per-process cache of real tensors. Eager calls first fill the caches, as a sampler's
    first steps would; the compiled dequantize equals eager, and eager still works after the trace."""
    weight = QuantLinear(fmt, 64, HIDDEN, seed=5).weight
    eager = dequantize_weight(fmt, weight)
    assert eager.shape == (64, HIDDEN) and eager.dtype == weight._params.orig_dtype
    qdata, tensors = op_arguments(fmt, randn(1, HIDDEN, seed=1), weight)[1:3]
    torch.library.opcheck(dequantize_weight_op, (qdata, tensors, linear_spec(fmt, weight)))
    x = randn(3, HIDDEN, seed=2, dtype=torch.bfloat16)
    compiled = torch.compile(lambda t, w: torch.nn.functional.linear(t, dequantize_weight(fmt, w)),
                             backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, weight), torch.nn.functional.linear(x, eager))
    assert torch.equal(dequantize_weight(fmt, weight), eager)


@pytest.mark.parametrize("fmt", ("int8_quarot", "int8_hadanorm"))
def test_our_rotated_layouts_dequantize_inside_a_graph(fmt):
    """Our layouts' own ``dequantize`` traced as is (what Dynamo does with ComfyUI's cast): the Hadamard
    matrix is computed in the graph instead of taken from the eager cache."""
    weight = QuantLinear(fmt, 64, HIDDEN, seed=5).weight
    eager = weight.dequantize()  # fills the cache with a real tensor
    compiled = torch.compile(lambda w: w.dequantize() * 2, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(weight), eager * 2)


@pytest.mark.parametrize("kind,sizes", [("sylvester", (2, 4, 32, 128, 512)), ("regular", (4, 16, 64, 256, 1024))])
def test_hadamard_from_indices_is_the_cached_matrix(kind, sizes):
    for size in sizes:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            expected = _hadamard_cpu_fp32(kind, size).to(dtype)
            assert torch.equal(_hadamard_from_indices(kind, size, None, dtype), expected)
    x = randn(5, 512, seed=3)
    rotate = torch.compile(lambda t: unrotate_blocks(rotate_blocks(t, kind, sizes[-2]), kind, sizes[-2]),
                           backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(rotate(x), x, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="power of"):
        _hadamard_from_indices(kind, 48, None, torch.float32)


def test_forced_backend_reaches_the_compiled_op():
    layer = QuantLinear("int8", 64, HIDDEN, seed=5)
    x = randn(4, HIDDEN, seed=1, dtype=torch.bfloat16)
    compiled = torch.compile(lambda t: quantized_linear("int8", t, layer.weight, layer.bias, backend="eager"),
                             backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), quantized_linear("int8", x, layer.weight, layer.bias, backend="eager"))
    with pytest.raises(Exception, match="unknown kernel backend"):
        quantized_linear("int8", x, layer.weight, layer.bias, backend="cublas")


def test_kernel_ops_pass_opcheck_with_every_option():
    x = randn(6, 256, seed=1, dtype=torch.bfloat16)
    smooth = randn(256, seed=2).abs() + 0.5
    for args in ((x, torch.int8, 127.0, "regular", 256, None, False, 0, "eager"),
                 (x, torch.int8, 127.0, "sylvester", 128, smooth, True, 0, "eager"),
                 (x, torch.float8_e4m3fn, 448.0, "none", 0, None, False, 0, "eager"),
                 (x, torch.int8, 7.0, "regular", 256, None, False, 64, "eager")):
        torch.library.opcheck(ops.act_quant_op, args)
    q, scale, mean = ops.act_quant(x, torch.int8, 127.0, "sylvester", 128, smooth, True, 0, "eager")
    weight = torch.randint(-127, 128, (16, 256), generator=torch.Generator().manual_seed(3), dtype=torch.int8)
    torch.library.opcheck(ops.w8a8_mm_op, (q, weight, scale, torch.rand(16), randn(16, seed=4), mean,
                                           randn(16, seed=5), torch.bfloat16, "eager"))
    packed = torch.randint(-128, 128, (16, 128), generator=torch.Generator().manual_seed(6), dtype=torch.int8)
    # the op reads the FP8 group scales as bytes (both implementations view them as uint8); passed as
    # float8, torch's CPU schema checker cannot compare them (no CPU allclose for float8)
    s_rel = torch.rand(16, 16).to(torch.float8_e4m3fn).view(torch.uint8)
    table = torch.randint(-127, 128, (256, 16), generator=torch.Generator().manual_seed(7), dtype=torch.int8)
    q8, scale8, _ = ops.act_quant(x, torch.int8, 127.0, "regular", 256, None, False, 0, "eager")
    torch.library.opcheck(ops.w4a8_mm_op, (q8, packed, scale8, torch.rand(16), None, s_rel, table, 16, 0,
                                           torch.float32, "eager"))


def test_docs_example_runs():
    """Every ```python block of docs/nodes/compile.md runs, in order, in one namespace (CPU)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "nodes" / "compile.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "docs/nodes/compile.md lost its Python example"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/nodes/compile.md", "exec"), namespace)  # noqa: S102 - our own documentation
