"""Rounding onto the quantization grids (lora/grid.py)."""

from __future__ import annotations

import pytest
import torch

from lowbit.kernels.reference import pack_int4_signed, unpack_int4_signed
from lowbit.lora.grid import FP8, FP8_MAX, fp8_step, grown_scale, round_to_fp8, round_to_int_grid


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_int_grid_stochastic_rounding_is_unbiased_and_stays_between_neighbours():
    values = torch.linspace(-5.0, 5.0, 4001)
    draws = torch.stack([round_to_int_grid(values, 7, _gen(s)).float() for s in range(1, 401)])
    assert bool(((draws >= values.floor()) & (draws <= values.ceil())).all())
    bias = (draws.mean(0) - values).abs()
    assert float(bias.max()) < 0.1  # 400 draws: std <= 0.5/20 = 0.025 per value
    assert float(bias.mean()) < 0.025
    nearest = round_to_int_grid(values, 7, None).float()
    assert float((nearest - values).abs().mean()) > 0.2  # nearest is biased per value (the mean error of 0.25)


def test_int_grid_keeps_grid_points_and_clamps_to_qmax():
    values = torch.tensor([-200.0, -127.0, -3.0, 0.0, 4.0, 127.0, 300.0])
    assert round_to_int_grid(values, 127, _gen(1)).tolist() == [-127, -127, -3, 0, 4, 127, 127]


def test_fp8_step_matches_the_e4m3fn_grid():
    codes = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()  # every non-negative finite e4m3fn value
    grid = torch.unique(codes)
    gaps = grid[1:] - grid[:-1]
    assert torch.equal(fp8_step(grid[:-1]), gaps)


def test_fp8_stochastic_rounding_is_unbiased_exact_on_grid_and_never_saturates():
    gen = _gen(3)
    values = torch.cat([torch.randn(2000, generator=gen) * 30, torch.rand(200, generator=gen) * 1e-2,
                        torch.tensor([FP8_MAX, -FP8_MAX, 433.0, -0.001953125])])
    draws = torch.stack([round_to_fp8(values, _gen(s)).float() for s in range(1, 401)])
    step = fp8_step(values)
    assert float(((draws.mean(0) - values).abs() / step).max()) < 0.12
    grid_values = values.to(FP8).float()
    assert torch.equal(round_to_fp8(grid_values, _gen(9)).float(), grid_values)
    assert float(draws.abs().max()) <= FP8_MAX


def test_fp8_nearest_matches_torch_cast():
    values = torch.randn(1000, generator=_gen(4)) * 50
    assert torch.equal(round_to_fp8(values, None).view(torch.uint8), values.to(FP8).view(torch.uint8))


@pytest.mark.parametrize("shape", [(1,), (6, 1), (6,)])
def test_grown_scale_grows_only_where_the_grid_would_overflow(shape):
    merged = torch.tensor([[1.0, -2.0], [0.5, 0.1], [-9.0, 3.0], [0.0, 0.0], [12.7, 0.0], [-12.8, 1.0]])
    scale = torch.full(shape, 0.1)
    new, grown = grown_scale(merged, scale, 127)
    assert new.shape == scale.shape
    if scale.numel() == 1:
        assert grown == 1 and float(new) == pytest.approx(12.8 / 127)
    else:
        assert grown == 1  # only the last row passes 127 * 0.1 = 12.7
        assert new.flatten().tolist() == pytest.approx([0.1] * 5 + [12.8 / 127])


def test_int4_nibbles_round_trip_and_match_kitchen_packing():
    from comfy_kitchen.tensor import TensorCoreConvRotW4A4Layout

    codes = torch.randint(-8, 8, (8, 512), generator=_gen(5), dtype=torch.int8)
    assert torch.equal(unpack_int4_signed(pack_int4_signed(codes)), codes)
    stacked = torch.randint(-8, 8, (3, 4, 64), generator=_gen(7), dtype=torch.int8)  # any leading dims
    assert torch.equal(unpack_int4_signed(pack_int4_signed(stacked)), stacked)
    weight = torch.randn(8, 512, generator=_gen(6))
    qdata, params = TensorCoreConvRotW4A4Layout.quantize(weight)
    # kitchen's own dequantize = our unpacked codes x per-row scale, rotated back
    from lowbit.kernels.hadamard import unrotate_blocks

    ours = unrotate_blocks(unpack_int4_signed(qdata).float() * params.scale.reshape(-1, 1), "regular", 256)
    theirs = TensorCoreConvRotW4A4Layout.dequantize(qdata, params).float()
    assert torch.allclose(ours, theirs, atol=1e-5)
