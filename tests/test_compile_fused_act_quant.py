"""Plain per-token W8A8 layers under torch.compile: the activation quantization is traced, the GEMM stays an op.

For ``int8``, ``fp8_rowwise`` (no outlier channels) and per-token ``fp8`` (on the CPU only with its
kernel device list patched: there, eager ``fp8`` runs kitchen's per-tensor path and the compiled one
keeps the opaque op), ``quant.compiled_linear.quantized_linear`` traces ``FormatCodec.traced_linear``:
the quantization as torch ops (``kernels/w8a8_traced.py``) and ``lowbit::w8a8_mm(impl="auto")``
(``kernels/gemm_auto.py``). Checked on the CPU with inductor: the traced quantization gives the
reference's codes and scales; a compiled layer matches the eager codec; its graph holds no
``lowbit::quantized_linear`` and inductor fuses the quantization into the op before it; token counts
reuse the graph; rotated / outlier layers, static input scales and forced backends keep the opaque op.
"""

from __future__ import annotations

from kernels_helpers import needs_triton_interpreter, randint8, randn

import re

import pytest
import torch
from torch._inductor.compile_fx import compile_fx
from torch._inductor.utils import run_and_get_code

from layout_helpers import sqnr_db
from lowbit.kernels import dispatch, ops
from lowbit.kernels.backend import BackendUnavailableError, force_backend
from lowbit.kernels.dispatch import DispatchKey, Dispatcher, use_dispatcher
from lowbit.kernels.gemm_config import default_config
from lowbit.kernels.reference import FP8, act_quant_reference, scaled_mm_reference
from lowbit.kernels.w8a8_traced import act_quant_traced
from lowbit.quant.compiled_linear import backend_scope, quantized_linear
from lowbit.quant.formats import FORMATS
from lowbit.quant.layouts import fp8_tensorwise

HIDDEN, OUT = 256, 128  # ConvRot needs K % 256 == 0; fp8 needs multiples of 16
FUSED = ("int8", "fp8_rowwise", "fp8")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def fp8_kernel_on_cpu(monkeypatch):
    """Per-tensor ``fp8`` runs LowBit's per-token kernel on CUDA only; let it do so on the CPU too, so
    its traced path can be compared with its eager kernel path here."""
    monkeypatch.setattr(fp8_tensorwise, "KERNEL_DEVICE_TYPES", frozenset({"cuda", "cpu"}))


class QuantLinear(torch.nn.Module):
    """What ComfyUI's LowBit Linear does at run time, with a GELU before it (an op for inductor to fuse into)."""

    def __init__(self, fmt: str, *, seed: int = 1, backend: str = "auto", outliers: bool = False,
                 input_scale: torch.Tensor | None = None):
        super().__init__()
        self.fmt, self.backend, self.input_scale = fmt, backend, input_scale
        w = randn(OUT, HIDDEN, seed=seed) / HIDDEN**0.5
        kwargs = {"outlier_channels": torch.tensor([3, 17], dtype=torch.int32)} if outliers else {}
        self.weight = torch.nn.Parameter(FORMATS[fmt].quantize(w, **kwargs), requires_grad=False)
        self.bias = torch.nn.Parameter(randn(OUT, seed=seed + 1, dtype=torch.bfloat16) * 0.1, requires_grad=False)

    def forward(self, x):
        return quantized_linear(self.fmt, torch.nn.functional.gelu(x), self.weight, self.bias, self.input_scale,
                                self.backend)

    def float_output(self, x) -> torch.Tensor:
        """The float layer's output (fp32) for ``x``: what the quantized one approximates."""
        weight = self.weight.dequantize().float()
        return torch.nn.functional.linear(torch.nn.functional.gelu(x.float()), weight, self.bias.float())


class GraphRecorder:
    """A Dynamo backend that keeps every FX graph it is given, then runs it eagerly or through inductor."""

    def __init__(self, inductor: bool = False):
        self.inductor, self.graphs = inductor, []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return compile_fx(gm, example_inputs) if self.inductor else gm.forward

    def ops(self, index: int = -1) -> set[str]:
        """The functions and methods graph ``index`` calls (custom ops as ``lowbit.<name>``)."""
        names = set()
        for node in self.graphs[index].graph.nodes:
            if node.op in ("call_function", "call_method"):
                names.add(str(node.target).removesuffix(".default"))
        return names


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    x = randn(2, n, HIDDEN, seed=seed, dtype=torch.bfloat16) * 2
    torch._dynamo.mark_dynamic(x, 1)
    return x


# ---- the traced act-quant against the reference ---------------------------------------------------------

@pytest.mark.parametrize("code_dtype", (torch.int8, FP8), ids=("int8", "fp8"))
def test_compiled_act_quant_gives_the_reference_codes_and_scales(code_dtype):
    x = randn(37, 200, seed=3, dtype=torch.bfloat16) * torch.logspace(-3, 2, 37).reshape(-1, 1).bfloat16()
    x[1] = 0  # an all-zero token: the abs-max floor
    # ties, exact in bf16, on a token whose scale is 1 for INT8: round half to even
    x[2] = 0
    x[2, :8] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 3.5, -126.5])
    compiled = torch.compile(lambda t: act_quant_traced(t, code_dtype), backend="inductor", fullgraph=True,
                             dynamic=True)
    q_ref, scale_ref, _ = act_quant_reference(x, code_dtype)
    q_eager, scale_eager = act_quant_traced(x, code_dtype)
    q, scale = compiled(x)
    as_bytes = (lambda t: t.view(torch.uint8)) if code_dtype == FP8 else (lambda t: t)
    assert q.dtype == code_dtype and q.shape == x.shape and scale.shape == (37, 1)
    assert torch.equal(as_bytes(q_eager), as_bytes(q_ref)) and torch.equal(scale_eager, scale_ref)
    agree = (as_bytes(q) == as_bytes(q_ref)).float().mean().item()
    assert agree >= 0.999, f"only {agree:.4%} of the compiled codes are the reference's"
    assert torch.equal(scale, scale_ref)
    if code_dtype == torch.int8:
        assert q[2, :8].tolist() == [127, 0, 2, 2, 0, -2, 4, -126]
    assert not as_bytes(q[1]).any() and scale[1].item() > 0


def test_traced_act_quant_refuses_other_code_dtypes():
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn"):
        act_quant_traced(randn(2, 16, seed=1), torch.uint8)


# ---- a compiled layer ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FUSED)
def test_compiled_layer_fuses_the_act_quant_and_matches_eager(fmt, request):
    if fmt == "fp8":
        request.getfixturevalue("fp8_kernel_on_cpu")
    layer = QuantLinear(fmt)
    recorder = GraphRecorder(inductor=True)
    compiled = torch.compile(layer, backend=recorder, fullgraph=True)
    with torch.no_grad():
        x = tokens(16)
        out, code = run_and_get_code(compiled, x)
        assert out.dtype == torch.bfloat16 and out.shape == (2, 16, OUT)
        for n in (16, 24, 40, 7):  # other token counts: the same graph
            x = tokens(n, seed=n)
            out, eager = compiled(x), layer(x)
            exact = layer.float_output(x)
            # Inductor quantizes the fp32 GELU where eager quantizes its bf16 rounding, so codes near a
            # rounding boundary differ (measured 39.7 dB from eager for FP8, 41.6 for INT8, whose eager CPU
            # path is also kitchen's bf16 division); the compiled layer is as close to the float layer.
            assert out.shape == (2, n, OUT) and sqnr_db(out.float(), eager.float()) >= 36, f"{n} tokens"
            assert sqnr_db(out.float(), exact) >= sqnr_db(eager.float(), exact) - 0.5, f"{n} tokens"
    assert len(recorder.graphs) == 1, f"{len(recorder.graphs) - 1} recompiles for new token counts"
    graph_ops = recorder.ops()
    assert "lowbit.w8a8_mm" in graph_ops and "lowbit.quantized_linear" not in graph_ops
    assert "amax" in graph_ops  # the per-token abs-max is in the graph, for inductor to fuse
    # one generated kernel computes the GELU and the per-token quantization (no bf16 activation in between)
    kernels = set(re.findall(r"\bcpp_fused_\w+", "\n".join(code)))
    fused = [name for name in kernels if "gelu" in name and "amax" in name]
    assert fused, f"no kernel fuses the GELU with the abs-max: {sorted(kernels)}"
    assert "lowbit.w8a8_mm.default(" in "\n".join(code)


@pytest.mark.parametrize("fmt", FUSED)
def test_compiled_layer_with_eager_rounding_matches_eager_and_the_reference_kernels(fmt, request):
    """With inductor rounding its bf16 intermediates as eager does (``emulate_precision_casts``), a
    compiled layer is the eager codec's output to >= 40 dB, and the reference kernels' output (what our
    act-quant + GEMM kernels compute) but for rare codes that inductor's own GELU moves across a boundary."""
    if fmt == "fp8":
        request.getfixturevalue("fp8_kernel_on_cpu")
    layer = QuantLinear(fmt)
    x = tokens(16, seed=3)
    with torch.no_grad(), torch._inductor.config.patch(emulate_precision_casts=True):
        out = torch.compile(layer, backend="inductor", fullgraph=True)(x)
        eager = layer(x)
        with force_backend("eager"):
            reference = layer(x)
    assert sqnr_db(out.float(), eager.float()) >= 40
    same = (out == reference).float().mean().item()
    assert same >= 0.999, f"only {same:.4%} of the outputs are the reference kernels'"


def test_compiled_int8_layer_is_the_reference_linear_bit_for_bit():
    """Without an op before it, a compiled ``int8`` layer computes exactly the reference kernels' output
    (the eager default on the CPU is kitchen's ``int8_linear``, which divides by the scale in bf16)."""
    weight = FORMATS["int8"].quantize(randn(OUT, HIDDEN, seed=1) / HIDDEN**0.5)
    bias = randn(OUT, seed=2, dtype=torch.bfloat16)
    compiled = torch.compile(lambda t: quantized_linear("int8", t, weight, bias), backend="inductor", fullgraph=True)
    x = randn(3, 11, HIDDEN, seed=4, dtype=torch.bfloat16)
    with force_backend("eager"):
        reference = quantized_linear("int8", x, weight, bias)
    assert torch.equal(compiled(x), reference)


# ---- what keeps the opaque op -----------------------------------------------------------------------

OPAQUE_CASES = {
    "int8_convrot": dict(fmt="int8_convrot"),
    "fp8 on the CPU": dict(fmt="fp8"),
    "fp8_rowwise with outlier channels": dict(fmt="fp8_rowwise", outliers=True),
    "fp8 with a static input_scale": dict(fmt="fp8", input_scale=torch.tensor(0.01)),
    "int8, config backend eager": dict(fmt="int8", backend="eager"),
    "int8, config backend kitchen": dict(fmt="int8", backend="kitchen"),
}


@pytest.mark.parametrize("case", OPAQUE_CASES)
def test_other_layers_and_forced_backends_keep_the_opaque_op(case):
    layer = QuantLinear(**OPAQUE_CASES[case])
    recorder = GraphRecorder()
    compiled = torch.compile(layer, backend=recorder, fullgraph=True)
    x = tokens(9)
    with torch.no_grad():
        assert torch.equal(compiled(x), layer(x))
    assert "lowbit.quantized_linear" in recorder.ops() and "lowbit.w8a8_mm" not in recorder.ops()


def test_forced_backend_is_read_once_while_tracing():
    """The forced backend is a constant of the graph (Dynamo reads it once while tracing: torch 2.11
    cannot trace the ``ContextVar`` it lives in). Traced under ``backend_scope("eager")``: the opaque op,
    which honours it. Traced under ``auto``: the fused layer, kept when a backend is forced later (no
    retrace; forcing a backend is for tests and benchmarks)."""
    x = tokens(9)
    forced_layer = QuantLinear("int8")
    forced = GraphRecorder()
    compiled = torch.compile(forced_layer, backend=forced, fullgraph=True)
    with torch.no_grad(), backend_scope("eager"):
        assert torch.equal(compiled(x), forced_layer(x))
    assert "lowbit.quantized_linear" in forced.ops() and "lowbit.w8a8_mm" not in forced.ops()

    torch._dynamo.reset()
    layer = QuantLinear("int8")
    recorder = GraphRecorder()
    compiled = torch.compile(layer, backend=recorder, fullgraph=True)
    with torch.no_grad():
        fused = compiled(x)
        with backend_scope("eager"):
            again = compiled(x)
    assert len(recorder.graphs) == 1 and "lowbit.w8a8_mm" in recorder.ops()
    assert "lowbit.quantized_linear" not in recorder.ops()
    assert torch.equal(again, fused)


# ---- the GEMM op with impl="auto" -----------------------------------------------------------------------

def _codes(code_dtype, m: int, n: int, k: int):
    x = randn(m, k, seed=5, dtype=torch.bfloat16)
    q, scale, _ = act_quant_reference(x, code_dtype)
    weight = randint8(n, k, seed=6) if code_dtype == torch.int8 else (randn(n, k, seed=6) * 60).to(FP8)
    return q, weight, scale, torch.rand(n, 1) * 1e-2 + 1e-3, randn(n, seed=7, dtype=torch.bfloat16)


@pytest.mark.parametrize("code_dtype", (torch.int8, FP8), ids=("int8", "fp8"))
def test_auto_gemm_is_the_reference_and_runs_its_fast_plan(code_dtype):
    q, weight, scale, w_scale, bias = _codes(code_dtype, 20, 48, 96)
    reference = scaled_mm_reference(q, weight, scale, w_scale, bias, None, None, torch.bfloat16)
    if code_dtype == FP8:  # the op takes e4m3 as bytes too (how the traced linear passes them)
        q, weight = q.view(torch.uint8), weight.view(torch.uint8)
    args = (q, weight, scale, w_scale.reshape(-1), bias, None, None, torch.bfloat16, "auto")
    torch.library.opcheck(ops.w8a8_mm_op, args)
    d = Dispatcher()
    with use_dispatcher(d):
        first = ops.w8a8_mm_op(*args)
        assert d.fast_hits == 0 and [key[0] for key in d.fast_plans] == ["mm"]
        again = ops.w8a8_mm_op(*args)
        assert d.fast_hits == 1
    assert torch.equal(first, reference) and torch.equal(again, reference)
    assert not d.decisions, "nothing is measured on the CPU"


def test_auto_gemm_takes_shifts_like_the_reference():
    q, weight, scale, w_scale, bias = _codes(torch.int8, 5, 32, 64)
    row_shift, col_shift = randn(5, 1, seed=8), randn(32, seed=9)
    reference = scaled_mm_reference(q, weight, scale, w_scale, bias, row_shift, col_shift, torch.float32)
    out = ops.w8a8_mm(q, weight, scale, w_scale, bias, row_shift, col_shift, torch.float32, "auto")
    assert torch.equal(out, reference)


def test_auto_gemm_honours_forced_backends_and_says_which_it_cannot_run():
    """Forced eager / torch are honoured (torch needs CUDA: a clear error on the CPU). Forced kitchen or
    dequant have no form for a GEMM on codes (they need the float activation): a fused layer of a graph
    traced without a forced backend runs its GEMM as chosen instead of failing."""
    q, weight, scale, w_scale, bias = _codes(FP8, 5, 32, 64)
    reference = scaled_mm_reference(q, weight, scale, w_scale, bias, None, None, torch.bfloat16)
    with use_dispatcher(Dispatcher()), force_backend("eager"):
        out = ops.w8a8_mm(q, weight, scale, w_scale, bias, None, None, torch.bfloat16, "auto")
    assert torch.equal(out, reference)
    with use_dispatcher(Dispatcher()), force_backend("torch"), pytest.raises(BackendUnavailableError, match="need CUDA"):
        ops.w8a8_mm(q, weight, scale, w_scale, bias, None, None, torch.bfloat16, "auto")
    for backend in ("kitchen", "dequant"):
        with use_dispatcher(Dispatcher()), force_backend(backend):
            out = ops.w8a8_mm(q, weight, scale, w_scale, bias, None, None, torch.bfloat16, "auto")
        assert torch.equal(out, reference)
    with pytest.raises(ValueError, match="int8 or both float8_e4m3fn"):
        ops.w8a8_mm(q, randint8(32, 64, seed=1), scale, w_scale, bias, None, None, torch.bfloat16, "auto")


@needs_triton_interpreter()
@pytest.mark.parametrize("code_dtype", (torch.int8, FP8), ids=("int8", "fp8"))
def test_auto_gemm_runs_a_recorded_triton_decision(code_dtype):
    """A decision recorded for the ``mm:int8`` / ``mm:fp8`` key (as a GPU would measure it) runs our
    Triton GEMM with that tile config, here through the interpreter."""
    m, n, k = 5, 32, 64
    q, weight, scale, w_scale, bias = _codes(code_dtype, m, n, k)
    fmt = "mm:int8" if code_dtype == torch.int8 else "mm:fp8"
    key = DispatchKey(fmt, (0, 0), dispatch.m_bucket(m), n, k).as_str()
    d = Dispatcher(decisions={key: "triton:" + default_config(m).name})
    with use_dispatcher(d):
        out = ops.w8a8_mm(q, weight, scale, w_scale, bias, None, None, torch.float32, "auto")
        again = ops.w8a8_mm(q, weight, scale, w_scale, bias, None, None, torch.float32, "auto")
        plan = next(iter(d.fast_plans.values()))
    assert type(plan).__name__ == "_TritonGemmPlan" and d.fast_hits == 1
    reference = scaled_mm_reference(q, weight, scale, w_scale, bias, None, None, torch.float32)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-4)
    assert torch.equal(again, out)
