"""Dynamic mode (lora/dynamic.py): the LoRA term is exact on every format, strengths edit in place."""

from __future__ import annotations

import pytest
import torch

from lora_helpers import FORMAT_NAMES, IN_FEATURES, OUT_FEATURES, base_weight, dense, random_lora, rms, sqnr_db
from lowbit.kernels.hadamard import rotate_blocks
from lowbit.lora.delta import LowRankDelta
from lowbit.lora.dynamic import LoraBank, add_into, apply
from lowbit.quant.formats import get_format

SHAPE = (OUT_FEATURES, IN_FEATURES)


def _tokens(seed: int = 7, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(24, IN_FEATURES, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_dynamic_output_error_equals_base_quantization_error(fmt):
    """Show 1: quantized(base) + bank term vs the exact float model with the LoRAs merged.

    The error must be the base model's own quantization error, within 1 %: the LoRA term adds none.
    """
    codec = get_format(fmt)
    weight = base_weight(1)
    loras = [random_lora(1, rank=16, magnitude=0.5 * rms(weight), alpha=8.0, strength=0.8),
             random_lora(2, rank=4, magnitude=0.3 * rms(weight), strength=-1.3)]
    qt = codec.quantize(weight, compute_dtype=torch.float32)
    x = _tokens()

    quantized_base = codec.linear(x, qt)
    base_error = (quantized_base - x @ weight.T).norm()

    bank = LoraBank.build([("a", loras[0]), ("b", loras[1])], SHAPE)
    exact = x @ (weight + dense(loras[0]) + dense(loras[1])).T
    lora_error = (quantized_base + apply(x, bank) - exact).norm()

    assert (x @ (dense(loras[0]) + dense(loras[1])).T).norm() > 2 * base_error  # the LoRA term is not negligible
    assert abs(float(lora_error / base_error) - 1.0) < 0.01, (fmt, float(lora_error), float(base_error))


def test_concatenated_bank_equals_sum_of_separate_loras():
    loras = [random_lora(i, rank=r, alpha=a) for i, (r, a) in enumerate([(4, None), (8, 4.0), (32, 32.0)])]
    x = _tokens()
    bank = LoraBank.build([(f"l{i}", d) for i, d in enumerate(loras)], SHAPE)
    assert bank.rank == 44 and tuple(bank.down.shape) == (44, IN_FEATURES) and tuple(bank.up.shape) == (OUT_FEATURES, 44)
    expected = sum(x @ dense(d).T for d in loras)
    assert sqnr_db(expected, apply(x, bank)) > 100


def test_bank_is_built_where_its_loras_are_without_a_device():
    """``build`` without ``device`` keeps every bank tensor on the LoRAs' device (scales included: a GPU
    LoRA once got CPU scales, and the layer's forward failed). The meta device stands in for a GPU."""
    lora = random_lora(5, rank=4, alpha=2.0)
    meta = LowRankDelta(down=lora.down.to("meta"), up=lora.up.to("meta"), alpha=lora.alpha, strength=lora.strength)
    bank = LoraBank.build([("a", meta)], SHAPE)
    assert {t.device.type for t in (bank.down, bank.up, bank.rank_scale, bank.rank_scale_c)} == {"meta"}
    moved = LoraBank.build([("a", lora)], SHAPE, device="meta")  # a CPU LoRA, an explicit device
    assert {t.device.type for t in (moved.down, moved.up, moved.rank_scale, moved.rank_scale_c)} == {"meta"}


def test_strength_edit_rewrites_rank_scale_in_place():
    a, b = random_lora(3, rank=8, alpha=4.0), random_lora(4, rank=8)
    bank = LoraBank.build([("a", a), ("b", b)], SHAPE)
    x = _tokens()
    pointers = (bank.down.data_ptr(), bank.up.data_ptr(), bank.rank_scale.data_ptr())

    bank.set_strength("a", 0.25)
    bank.set_strength("b", -2.0)

    assert (bank.down.data_ptr(), bank.up.data_ptr(), bank.rank_scale.data_ptr()) == pointers
    assert bank.strength("a") == 0.25 and bank.strength("b") == -2.0
    expected = x @ (dense(a.with_strength(0.25)) + dense(b.with_strength(-2.0))).T
    assert sqnr_db(expected, apply(x, bank)) > 100

    bank.set_strength("a", 0.0)
    bank.set_strength("b", 0.0)
    assert torch.count_nonzero(apply(x, bank)) == 0
    with pytest.raises(KeyError, match="no LoRA named 'c'"):
        bank.set_strength("c", 1.0)


def test_strength_edit_does_not_recompile():
    torch._dynamo.reset()
    bank = LoraBank.build([("a", random_lora(5))], SHAPE)
    compiled = torch.compile(apply, backend="eager", dynamic=False)
    x = _tokens()
    from torch._dynamo.utils import counters

    counters.clear()
    first = compiled(x, bank)
    bank.set_strength("a", 3.0)
    second = compiled(x, bank)
    assert sqnr_db(3.0 * first, second) > 100
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_fused_row_slices_place_each_lora_on_its_rows():
    """Three diffusers LoRAs (to_q/to_k/to_v) on one fused qkv weight, as ComfyUI's key map slices them."""
    third = OUT_FEATURES // 3
    parts = []
    for i in range(3):
        full = random_lora(10 + i, rank=4, shape=(third, IN_FEATURES))
        parts.append(LowRankDelta(full.down, full.up, rows=(i * third, third), source=f"to_{'qkv'[i]}"))
    bank = LoraBank.build([("style", d) for d in parts], SHAPE)
    x = _tokens()
    expected = x @ sum(dense(d) for d in parts).T
    assert sqnr_db(expected, apply(x, bank)) > 100
    out = apply(x, bank)
    assert torch.count_nonzero(out[:, 3 * third:]) == 0  # rows no slice covers stay untouched


def test_in_basis_bank_on_rotated_activations():
    delta = random_lora(6, rank=8, alpha=2.0)
    bank = LoraBank.build([("a", delta)], SHAPE)
    rotated = bank.in_basis(lambda m: rotate_blocks(m, "sylvester", 128))
    x = _tokens()
    x_rot = rotate_blocks(x, "sylvester", 128)
    assert sqnr_db(apply(x, bank), apply(x_rot, rotated)) > 80
    bank.set_strength("a", 0.5)  # one strength table and one scale vector for both views
    assert rotated.strength("a") == 0.5
    assert sqnr_db(apply(x, bank), apply(x_rot, rotated)) > 80


def test_bf16_bank_matches_fp32_term():
    delta = random_lora(8, rank=32, alpha=16.0, strength=0.7)
    x = _tokens(dtype=torch.bfloat16)
    fp32 = LoraBank.build([("a", delta)], SHAPE)
    bf16 = LoraBank.build([("a", delta)], SHAPE, dtype=torch.bfloat16)
    out = apply(x, bf16)
    assert out.dtype == torch.bfloat16
    assert sqnr_db(apply(x.float(), fp32), out) > 35


def test_bank_is_a_module_that_moves_and_stays_out_of_state_dicts():
    bank = LoraBank.build([("a", random_lora(9))], SHAPE)
    holder = torch.nn.Linear(IN_FEATURES, OUT_FEATURES)
    holder.lora_bank = bank
    assert set(holder.state_dict()) == {"weight", "bias"}
    holder.to(torch.float64)
    assert bank.down.dtype == torch.float64 and bank.rank_scale.dtype == torch.float64


def test_bank_rejects_a_lora_for_another_shape():
    wrong = random_lora(1, shape=(OUT_FEATURES, 256))
    with pytest.raises(ValueError, match="made for a different model"):
        LoraBank.build([("a", wrong)], SHAPE, layer="blocks.0.attn")


def test_add_into_accumulates_in_place_and_equals_the_separate_term():
    """The forward hook's path: one ``addmm_`` into the layer's own output, no [tokens, out] temporary."""
    delta = random_lora(11, rank=8, alpha=4.0, strength=0.6)
    bank = LoraBank.build([("a", delta)], SHAPE)
    x = _tokens().reshape(2, 12, IN_FEATURES)
    base = torch.randn(2, 12, OUT_FEATURES, generator=torch.Generator().manual_seed(3))
    expected = base + apply(x, bank)
    out = base.clone()
    pointer = out.data_ptr()
    result = add_into(out, x, bank)
    assert result.data_ptr() == pointer  # accumulated into the output itself
    assert sqnr_db(expected, result) > 100
    bank.set_strength("a", -1.5)  # the edit reaches the in-place path too
    again = add_into(base.clone(), x, bank)
    assert sqnr_db(base + apply(x, bank), again) > 100
    assert sqnr_db(base - 1.5 / 0.6 * (expected - base), again) > 100


def test_add_into_returns_a_new_tensor_when_in_place_is_unsafe():
    bank = LoraBank.build([("a", random_lora(12))], SHAPE, dtype=torch.bfloat16)
    x = _tokens()
    out = torch.randn(24, OUT_FEATURES)  # fp32 output, bf16 bank: no in-place accumulation
    before = out.clone()
    result = add_into(out, x, bank)
    assert torch.equal(out, before) and result.data_ptr() != out.data_ptr()
    assert sqnr_db(before + apply(x, bank).float(), result) > 100
    fp32_bank = LoraBank.build([("a", random_lora(12))], SHAPE)
    transposed = torch.randn(OUT_FEATURES, 24).t()  # not contiguous
    kept = transposed.clone()
    result = add_into(transposed, x, fp32_bank)
    assert torch.equal(transposed, kept) and sqnr_db(kept + apply(x, fp32_bank), result) > 100
