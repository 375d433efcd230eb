"""The format linears through every backend, the custom ops' fakes, and the benchmark's command line.

Every backend computes the same function up to its rounding: the quantized paths must agree with
each other to within a few INT8 steps (high SQNR between them) and with the float product to within
the format's quantization noise.
"""

from __future__ import annotations

from kernels_helpers import randint8, randn, sqnr_db, triton_interpreter_available

import pytest
import torch

from lowbit.kernels import ops
from lowbit.kernels.backend import Backend, force_backend
from lowbit.kernels.fp8_gemm import FP8, fp8_rowwise_linear
from lowbit.kernels.hadamard import rotate_blocks
from lowbit.kernels.int8_gemm import int8_linear

BACKENDS = [Backend.EAGER, Backend.TRITON, Backend.TORCH, Backend.KITCHEN, Backend.DEQUANT]


def _int8_weight(n, k, seed):
    w = randn(n, k, seed=seed) / k**0.5
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    return w, torch.round(w / scale).to(torch.int8), scale


def _skip_without_interpreter(backend):
    if backend is Backend.TRITON and not triton_interpreter_available():
        pytest.skip("no Triton interpreter")


@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_linear_backends_agree(backend):
    _skip_without_interpreter(backend)
    w, codes, scale = _int8_weight(48, 256, seed=1)
    x = randn(2, 7, 256, seed=2, dtype=torch.bfloat16)
    bias = randn(48, seed=3, dtype=torch.bfloat16)
    exact = x.float() @ (codes.float() * scale).t() + bias.float()
    with force_backend(Backend.EAGER):
        eager = int8_linear(x, codes, scale, bias).float()
    with force_backend(backend):
        out = int8_linear(x, codes, scale, bias)
    assert out.shape == (2, 7, 48) and out.dtype == torch.bfloat16
    assert sqnr_db(out.float(), exact) > 30
    # our act-quant (eager, Triton, torch._int_mm): the same codes, only the bf16 output rounding differs
    # (the CPU interpreter truncates bf16 stores); kitchen divides in bf16, so a few codes differ;
    # dequant skips activation quantization
    floor = {Backend.KITCHEN: 38, Backend.DEQUANT: 30}.get(backend, 45)
    assert sqnr_db(out.float(), eager) > floor


@pytest.mark.parametrize("backend", [Backend.EAGER, Backend.TRITON, Backend.TORCH, Backend.DEQUANT])
@pytest.mark.parametrize("rotation,group", [("regular", 256), ("sylvester", 128)])
def test_fused_rotation_equals_rotating_first(backend, rotation, group):
    """int8_linear(x, rotation=...) == int8_linear(x @ H) – the rotation moved into the kernel."""
    _skip_without_interpreter(backend)
    _, codes, scale = _int8_weight(32, 512, seed=4)
    x = randn(9, 512, seed=5)
    with force_backend(backend):
        fused = int8_linear(x, codes, scale, rotation=rotation, group_size=group)
    with force_backend(Backend.EAGER):
        separate = int8_linear(rotate_blocks(x, rotation, group), codes, scale)
    assert sqnr_db(fused, separate) > (60 if backend is Backend.EAGER else 35)


@pytest.mark.parametrize("backend", [Backend.EAGER, Backend.TRITON, Backend.TORCH, Backend.DEQUANT])
def test_hadanorm_keywords_reproduce_the_layout_math(backend):
    """smooth + center_rowsum + rotation == the HadaNorm layout's torch code (quant/layouts/int8_hadanorm)."""
    _skip_without_interpreter(backend)
    k, n = 256, 24
    weight = randn(n, k, seed=6) / k**0.5
    smooth = torch.rand(k, generator=torch.Generator().manual_seed(7)) + 0.5
    smoothed = weight / smooth
    rotated = rotate_blocks(smoothed, "sylvester", 128)
    scale = rotated.abs().amax(dim=1, keepdim=True) / 127
    codes = torch.round(rotated / scale).to(torch.int8)
    rowsum = smoothed.sum(dim=1)
    x = randn(6, k, seed=8, dtype=torch.bfloat16) + 2.0
    exact = x.float() @ weight.t()
    with force_backend(backend):
        out = int8_linear(x, codes, scale, rotation="sylvester", group_size=128, smooth=smooth, center_rowsum=rowsum)
    assert sqnr_db(out.float(), exact) > 30


@pytest.mark.parametrize("backend", [Backend.EAGER, Backend.TRITON, Backend.DEQUANT])
def test_fp8_rowwise_linear(backend):
    _skip_without_interpreter(backend)
    w = randn(40, 128, seed=9) / 128**0.5
    scale = w.abs().amax(dim=1, keepdim=True) / 448
    codes = (w / scale).to(FP8)
    x = randn(3, 128, seed=10, dtype=torch.bfloat16)
    exact = x.float() @ (codes.float() * scale).t()
    with force_backend(backend):
        out = fp8_rowwise_linear(x, codes, scale)
    assert sqnr_db(out.float(), exact) > (25 if backend is not Backend.DEQUANT else 40)


def test_wrong_shapes_are_user_errors():
    _, codes, scale = _int8_weight(8, 64, seed=1)
    with pytest.raises(ValueError, match="expects 64"):
        int8_linear(randn(2, 32, seed=1), codes, scale)
    with pytest.raises(ValueError, match="weight_scale"):
        int8_linear(randn(2, 64, seed=1), codes, torch.ones(3))
    with pytest.raises(ValueError, match="rotation"):
        int8_linear(randn(2, 64, seed=1), codes, scale, rotation="fourier", group_size=16)


def test_custom_ops_have_working_fakes():
    x = randn(5, 64, seed=1, dtype=torch.bfloat16)
    torch.library.opcheck(ops.act_quant_op, (x, torch.int8, 127.0, "none", 0, None, False, 0, "eager"))
    q, s, _ = ops.act_quant(x, torch.int8, 127.0, "none", 0, None, False, 0, "eager")
    w = randint8(8, 64, seed=2)
    torch.library.opcheck(ops.w8a8_mm_op, (q, w, s, torch.rand(8), None, None, None, torch.bfloat16, "eager"))
    packed = randint8(8, 32, seed=3, low=-128)
    torch.library.opcheck(ops.w4a8_mm_op, (q, packed, s, torch.rand(8), None, None, None, 16, 0, torch.float32, "eager"))


def test_ops_compile_as_opaque_nodes():
    """torch.compile traces the custom op through its fake and runs the real implementation."""
    x = randn(4, 64, seed=1, dtype=torch.bfloat16)

    def quantize(t):
        return ops.act_quant(t, torch.int8, 127.0, "none", 0, None, False, 0, "eager")[0]
    compiled = torch.compile(quantize, backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), quantize(x))


def test_bench_command_line(capsys, tmp_path):
    import json

    from lowbit.kernels.bench import main

    assert main(["--shapes", "nope"]) == 2
    assert "shape sets" in capsys.readouterr().err
    out_json = tmp_path / "bench.json"
    assert main(["--device", "cpu", "--shapes", "tiny", "--m", "16", "--formats", "int8,w4a4",
                 "--no-kitchen", "--rep-ms", "1", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "geomean vs bf16" in out and "int8" in out
    report = json.loads(out_json.read_text())
    # the file says what it was measured on: two cards' numbers must not be mixed up
    assert report["environment"]["device"] == "cpu" and report["environment"]["torch"] == torch.__version__
    assert report["verify"] == {"ran": False, "failures": []}
    assert [(row["n"], row["k"], row["m"]) for row in report["rows"]] == [(256, 512, 16), (384, 768, 16)]


def test_docs_examples_run():
    """Every ```python block of docs/kernels.md runs, in order, in one namespace (CPU)."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "kernels.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 3
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/kernels.md", "exec"), namespace)  # noqa: S102 - our own documentation
    assert tuple(namespace["y"].shape) == (4, 64)
