"""QuaRot specifics and the block Hadamard rotations it (and HadaNorm, ConvRot) rests on."""

from __future__ import annotations

import pytest
import torch
from comfy_kitchen.tensor import QuantizedTensor
from comfy_kitchen.tensor.int8_utils import _build_hadamard

from layout_helpers import activation, outlier_weight, sqnr_db
from lowbit.kernels.hadamard import hadamard_matrix, rotate_blocks, unrotate_blocks
from lowbit.quant.errors import CheckpointFormatError
from lowbit.quant.formats import get_format
from lowbit.quant.layouts.int8_quarot import LAYOUT, QuaRotINT8Layout

SIZES = {"regular": (4, 16, 64, 256), "sylvester": (2, 8, 64, 128, 256)}


@pytest.mark.parametrize("kind,size", [(kind, size) for kind, sizes in SIZES.items() for size in sizes])
def test_hadamard_is_orthonormal(kind, size):
    h = hadamard_matrix(kind, size, dtype=torch.float64)
    assert h.shape == (size, size)
    assert torch.allclose(h @ h.t(), torch.eye(size, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(h.abs(), torch.full_like(h, size**-0.5))


@pytest.mark.parametrize("size", SIZES["regular"])
def test_regular_hadamard_rows_have_equal_sums(size):
    sums = hadamard_matrix("regular", size, dtype=torch.float64).sum(dim=1)
    assert torch.allclose(sums, sums[0].expand_as(sums))


def test_regular_hadamard_is_kitchens_convrot_matrix():
    """ConvRot files are rotated by kitchen's matrix; ours must be the same one, bit for bit."""
    ours = hadamard_matrix("regular", 256)
    assert torch.equal(ours, _build_hadamard(256, device="cpu", dtype=torch.float32))


@pytest.mark.parametrize("kind,size", [("regular", 2), ("regular", 8), ("regular", 32), ("regular", 48),
                                       ("sylvester", 1), ("sylvester", 12), ("sylvester", 0)])
def test_bad_hadamard_sizes_raise(kind, size):
    with pytest.raises(ValueError, match="power of"):
        hadamard_matrix(kind, size)


def test_unknown_hadamard_kind_raises():
    with pytest.raises(ValueError, match="unknown Hadamard kind"):
        hadamard_matrix("walsh", 16)


@pytest.mark.parametrize("kind,group", [("regular", 256), ("sylvester", 128), ("sylvester", 64)])
def test_rotate_unrotate_round_trip_and_product_invariance(kind, group):
    x = torch.randn(2, 3, 512, dtype=torch.float64)
    w = torch.randn(24, 512, dtype=torch.float64)
    x_rot = rotate_blocks(x, kind, group)
    assert x_rot.shape == x.shape and x_rot.dtype == x.dtype
    assert torch.allclose(unrotate_blocks(x_rot, kind, group), x, atol=1e-12)
    assert torch.allclose(x_rot @ rotate_blocks(w, kind, group).t(), x @ w.t(), atol=1e-10)
    # low-precision inputs are rotated in fp32 and cast back
    x_bf16 = x.bfloat16()
    assert rotate_blocks(x_bf16, kind, group).dtype == torch.bfloat16
    assert sqnr_db(unrotate_blocks(rotate_blocks(x_bf16, kind, group), kind, group), x_bf16) > 45


@pytest.mark.parametrize("fn", [rotate_blocks, unrotate_blocks])
def test_rotation_needs_whole_groups(fn):
    with pytest.raises(ValueError, match="not a multiple of"):
        fn(torch.randn(4, 200), "sylvester", 128)


def test_quarot_stores_the_rotated_weight():
    weight = outlier_weight(32, 256, seed=21)
    qweight = get_format("int8_quarot").quantize(weight, compute_dtype=torch.float32)
    rotated = qweight._qdata.float() * qweight._params.scale
    assert sqnr_db(rotated, rotate_blocks(weight, "sylvester", 128)) > 38


def test_quarot_spreads_activation_outliers():
    """Two activation channels x50: plain per-token INT8 loses the rest of the token, QuaRot does not."""
    weight = outlier_weight(64, 512, seed=22, outliers=0)
    x = activation(16, 512, seed=23, dtype=torch.float32)
    x[:, [7, 300]] *= 50
    reference = x.double() @ weight.double().t()
    plain, quarot = get_format("int8"), get_format("int8_quarot")
    plain_db = sqnr_db(plain.linear(x, plain.quantize(weight, compute_dtype=torch.float32)), reference)
    quarot_db = sqnr_db(quarot.linear(x, quarot.quantize(weight, compute_dtype=torch.float32)), reference)
    assert quarot_db >= plain_db + 6


def test_quarot_reads_a_stored_group_size():
    weight = outlier_weight(32, 256, seed=24)
    qdata, params = QuaRotINT8Layout.quantize(weight, group_size=64)
    codec = get_format("int8_quarot")
    qweight = QuantizedTensor(qdata, LAYOUT, params)
    conf = codec.comfy_quant(qweight)
    assert conf == {"format": "lowbit_int8_quarot", "group_size": 64}
    restored = codec.from_state_dict("blk", codec.state_dict(qweight), conf, compute_dtype=torch.float32)
    assert restored._params.group_size == 64
    x = activation(5, 256, seed=25, dtype=torch.float32)
    assert torch.equal(codec.linear(x, restored), codec.linear(x, qweight))
    assert sqnr_db(codec.linear(x, restored), x.double() @ weight.double().t()) > 33


def test_quarot_rejects_in_features_off_the_stored_group():
    codec = get_format("int8_quarot")
    tensors = {"weight": torch.zeros(8, 192, dtype=torch.int8), "weight_scale": torch.ones(8, 1)}
    with pytest.raises(CheckpointFormatError, match="divisible by 128"):
        codec.from_state_dict("blk", tensors, {"format": "lowbit_int8_quarot", "group_size": 128})
