"""The GPTQ block kernel (``kernels/triton_gptq.py``) in Triton's CPU interpreter: bit for bit the torch loop of
``quant/gptq.py`` (or, with ``LOWBIT_TEST_DEVICE=cuda``, on the GPU)."""

from __future__ import annotations

import kernels_helpers  # noqa: F401  (switches the Triton interpreter on first)
import dataclasses

import pytest
import torch

from kernels_helpers import needs_triton_interpreter
from lowbit.quant.gptq import GPTQConfig, fp8_row_grid, gptq_round, row_grid
from lowbit.quant.quantize import quantize_weight

DEVICE = "cuda" if kernels_helpers.os.environ.get("LOWBIT_TEST_DEVICE", "cpu").startswith("cuda") else "cpu"
pytestmark = [] if DEVICE == "cuda" else [needs_triton_interpreter()]


def _problem(n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) / k ** 0.5
    weight[:, 3] *= 9  # an outlier channel: its row scales set by it, the others' codes pushed to the clamp
    x = (torch.randn(3 * k, k, generator=gen) @ (torch.eye(k) + 0.4 * torch.randn(k, k, generator=gen) / k ** 0.5)
         + 0.3 * torch.randn(k, generator=gen))
    return weight.to(DEVICE), (x.T @ x).to(DEVICE)


@pytest.mark.parametrize("grid_kind", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("n,k,config", [
    (40, 96, GPTQConfig()),  # rows not a multiple of the kernel's 16, one block narrower than 128
    (19, 200, GPTQConfig(act_order=False)),  # a 128-column block, then a 72-column one
    (33, 160, GPTQConfig(block=64, damp=0.05)),  # smaller blocks
])
def test_kernel_blocks_are_the_torch_loop_bit_for_bit(grid_kind, n, k, config):
    weight, hessian = _problem(n, k, seed=n + k)
    if grid_kind == "fp8":
        grid = fp8_row_grid(weight.abs().amax(dim=1) / 448)
    else:
        top = 127 if grid_kind == "int8" else 7
        grid = row_grid(weight.abs().amax(dim=1) / top, -top, top)
    want = gptq_round(weight, hessian, grid, dataclasses.replace(config, backend="torch"))
    got = gptq_round(weight, hessian, grid, dataclasses.replace(config, backend="triton"))
    assert torch.equal(got, want), (got - want).abs().max()
    assert not torch.equal(want, grid(weight, torch.arange(k))), "GPTQ moved nothing: the test shows no feedback"


def test_wider_blocks_than_the_kernel_round_to_the_grid():
    """A block wider than the kernel's 128 columns is rounded 128 at a time (the rest of the block updated by a
    product in between): every value still a grid point, and the layer's output error what the torch loop gives,
    to float rounding."""
    weight, hessian = _problem(24, 300, seed=5)
    grid = row_grid(weight.abs().amax(dim=1) / 127, -127, 127)
    got = gptq_round(weight, hessian, grid, GPTQConfig(block=256, backend="triton"))
    want = gptq_round(weight, hessian, grid, GPTQConfig(block=256, backend="torch"))
    scale = grid.scale[:, None]
    assert torch.equal(torch.round(got / scale) * scale, got)
    assert (got != want).float().mean() < 0.02  # a few codes at rounding ties may differ


def test_formats_take_the_kernel_where_it_runs():
    """``quantize_weight`` with a hessian through the kernel stores the torch loop's codes, for each format."""
    weight, hessian = _problem(32, 256, seed=9)
    for fmt in ("int8", "int8_convrot", "fp8_rowwise", "w4a4"):
        loop, kernel = (quantize_weight(weight, fmt, options={"hessian": hessian, "gptq": GPTQConfig(backend=b)})
                        for b in ("torch", "triton"))
        assert torch.equal(kernel._qdata.view(torch.uint8), loop._qdata.view(torch.uint8)), fmt


def test_bad_calls_are_refused():
    weight, hessian = _problem(8, 64, seed=1)
    with pytest.raises(ValueError, match="row grid"):
        gptq_round(weight, hessian, lambda v, c: v, GPTQConfig(backend="triton"))
    with pytest.raises(ValueError, match="backend"):
        GPTQConfig(backend="cuda")
