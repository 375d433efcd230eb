"""The GPTQ block kernel (``kernels/triton_gptq.py``) in Triton's CPU interpreter: bit for bit the torch loop of
``quant/gptq.py`` (or, with ``LOWBIT_TEST_DEVICE=cuda``, on the GPU)."""

from __future__ import annotations

import kernels_helpers  # noqa: F401  (switches the Triton interpreter on first)
import dataclasses

import pytest
import torch

from kernels_helpers import needs_triton_interpreter
from lowbit.quant.gptq import CodebookGrid, GPTQConfig, fp8_row_grid, gptq_round, row_grid
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


def _codebook_grid(weight: torch.Tensor, group: int = 16) -> CodebookGrid:
    """16 distinct integer levels per row and group (w4a8's form), some of them equal to a neighbour group's."""
    n, k = weight.shape
    groups = -(-k // group)  # a last group narrower than the others when k is not a multiple
    gen = torch.Generator().manual_seed(n * k)
    levels = torch.stack([torch.randperm(255, generator=gen)[:16] - 127 for _ in range(n * groups)])
    levels = levels.sort(dim=-1).values.view(n, groups, 16).float()
    return CodebookGrid(levels.to(weight.device), weight.abs().amax(dim=1) / 127, group)


@pytest.mark.parametrize("grid_kind", ["int8", "int4", "fp8", "codebook"])
@pytest.mark.parametrize("n,k,config", [
    (40, 96, GPTQConfig()),  # rows not a multiple of the kernel's 16, one block narrower than 128
    (19, 200, GPTQConfig(act_order=False)),  # a 128-column block, then a 72-column one
    (33, 160, GPTQConfig(block=64, damp=0.05)),  # smaller blocks
])
def test_kernel_blocks_are_the_torch_loop_bit_for_bit(grid_kind, n, k, config):
    weight, hessian = _problem(n, k, seed=n + k)
    if grid_kind == "fp8":
        grid = fp8_row_grid(weight.abs().amax(dim=1) / 448)
    elif grid_kind == "codebook":
        grid = _codebook_grid(weight)
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
    for fmt in ("int8", "int8_convrot", "fp8_rowwise", "w4a4", "w4a8"):
        loop, kernel = (quantize_weight(weight, fmt, options={"hessian": hessian, "gptq": GPTQConfig(backend=b)})
                        for b in ("torch", "triton"))
        assert torch.equal(kernel._qdata.view(torch.uint8), loop._qdata.view(torch.uint8)), fmt


def test_codebook_ties_go_to_the_first_level_as_torch_argmin():
    """Values exactly between two levels (and equal levels) round to the first, in the kernel as in torch."""
    n, k = 16, 32
    weight = torch.zeros(n, k, device=DEVICE)
    levels = torch.arange(16, dtype=torch.float32).repeat(n, k // 16, 1) * 2 - 15  # -15, -13, ... 15
    levels[:, 1, 8] = levels[:, 1, 7]  # a repeated level in the second group
    grid = CodebookGrid(levels.to(DEVICE), torch.ones(n, device=DEVICE), 16)
    weight[:, :16] = torch.arange(16, dtype=torch.float32, device=DEVICE) * 2 - 14  # -14, -12 ...: ties
    weight[:, 16:] = 0.5 * torch.arange(16, dtype=torch.float32, device=DEVICE) - 4
    identity = torch.eye(k, device=DEVICE)
    config = GPTQConfig(act_order=False)  # H = I: no feedback, the grid alone
    want = gptq_round(weight, identity, grid, dataclasses.replace(config, backend="torch"))
    got = gptq_round(weight, identity, grid, dataclasses.replace(config, backend="triton"))
    assert torch.equal(got, want)
    assert torch.equal(got[0, :16], weight[0, :16] - 1)  # each tie went to the lower level, the first of the two


def test_bad_calls_are_refused():
    weight, hessian = _problem(8, 64, seed=1)
    with pytest.raises(ValueError, match="row grid"):
        gptq_round(weight, hessian, lambda v, c: v, GPTQConfig(backend="triton"))
    with pytest.raises(ValueError, match="CodebookGrid takes"):
        CodebookGrid(torch.zeros(8, 4, 15), torch.ones(8), 16)
    from lowbit.kernels.triton_gptq import gptq_block

    with pytest.raises(ValueError, match="group indices"):
        gptq_block(weight[:, :16], torch.eye(16, device=DEVICE), torch.ones(8, device=DEVICE),
                   levels=torch.zeros(8, 4, 16, device=DEVICE), groups=torch.full((16,), 4))
    with pytest.raises(ValueError, match="backend"):
        GPTQConfig(backend="cuda")
