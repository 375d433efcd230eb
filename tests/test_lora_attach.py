"""Attaching a LoRA stack to a torch model (lora/attach.py, lora/stack.py): reversible, base untouched."""

from __future__ import annotations

import pytest
import torch

from lora_helpers import IN_FEATURES, base_weight, dense, random_lora, rms, sqnr_db
from lowbit.lora.attach import DynamicLoras, StochasticMerge
from lowbit.lora.delta import DenseDelta
from lowbit.lora.keys import ParsedLora
from lowbit.lora.stack import LeftOut, StackSlot, active_slots, low_rank_plan, stack_report
from lowbit.lora.stochastic import merge_stochastic
from lowbit.quant.formats import get_format

OUT = 64


def _model(fmt: str = "int8_convrot") -> torch.nn.Module:
    """Two quantized linears and one float linear (a layer a policy kept in float)."""
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([torch.nn.Linear(IN_FEATURES, OUT, bias=False) for _ in range(2)])
    model.head = torch.nn.Linear(IN_FEATURES, OUT, bias=True)
    codec = get_format(fmt)
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            block.weight = torch.nn.Parameter(codec.quantize(base_weight(i), compute_dtype=torch.float32),
                                              requires_grad=False)
        model.head.weight.copy_(base_weight(5))
    return model


@torch.no_grad()
def _forward(model, x):
    return torch.cat([model.blocks[0](x), model.blocks[1](x), model.head(x)], dim=-1)


def _stack():
    w = rms(base_weight(0))
    a = ParsedLora(low_rank={"blocks.0.weight": (random_lora(1, magnitude=0.3 * w),),
                             "head.weight": (random_lora(2, magnitude=0.3 * w),)},
                   adapters={}, unmatched=(), skipped=0, total_keys=4)
    b = ParsedLora(low_rank={"blocks.0.weight": (random_lora(3, rank=4, magnitude=0.3 * w),),
                             "blocks.1.weight": (random_lora(4, magnitude=0.3 * w, alpha=2.0),)},
                   adapters={}, unmatched=(), skipped=0, total_keys=5)
    return [StackSlot("1:a", a, 0.8), StackSlot("2:b", b, -1.5), StackSlot("3:off", a, 0.0)]


def _exact_change(slots, x):
    plan = low_rank_plan(slots)
    return torch.cat([x @ sum(dense(d) for _, d in plan.get(k, [])).T if k in plan else torch.zeros(len(x), OUT)
                      for k in ("blocks.0.weight", "blocks.1.weight", "head.weight")], dim=-1)


def test_plan_keeps_slot_order_and_drops_strength_zero():
    slots = _stack()
    plan = low_rank_plan(slots)
    assert [name for name, _ in plan["blocks.0.weight"]] == ["1:a", "2:b"]
    assert plan["blocks.0.weight"][1][1].strength == -1.5
    assert [s.name for s in active_slots(slots)] == ["1:a", "2:b"]
    assert "off (strength 0)" in stack_report(slots, "dynamic")
    with pytest.raises(ValueError, match="unique"):
        active_slots([slots[0], slots[0]])


def test_report_names_left_out_and_merged_entries_under_their_lora():
    slots = _stack()
    left_out = [LeftOut("2:b", f"blocks.{i}.bias", "bias diff (.diff_b)", "merges weights only") for i in range(10)]
    report = stack_report(slots, "stochastic", left_out=left_out, merged={"1:a": ["blocks.0.weight"]}, limit=3)
    first, second = report.split("\n- 2:b", 1)
    assert "left out" not in first and "merged into the weights instead of run dynamically (DoRA): 1 layers" in first
    assert "left out by stochastic mode: 10" in second and "... and 7 more left out" in second
    assert "left out blocks.0.bias (bias diff (.diff_b)): merges weights only; use mode standard" in second
    assert report.endswith("entries left out by stochastic mode: 10")
    assert "left out" not in stack_report(slots, "dynamic").replace("entries left out by dynamic mode: 0", "")


def test_dynamic_attach_adds_the_exact_term_and_detach_restores_the_model():
    model, slots = _model(), _stack()
    x = torch.randn(8, IN_FEATURES, generator=torch.Generator().manual_seed(1))
    before = _forward(model, x)
    loras = DynamicLoras(model, low_rank_plan(slots))
    loras.attach("cpu")
    assert sqnr_db(_forward(model, x) - before, _exact_change(slots, x)) > 80
    loras.set_strengths({"2:b": 0.5})
    half = [StackSlot(s.name, s.parsed, 0.5 if s.name == "2:b" else s.strength) for s in slots]
    assert sqnr_db(_forward(model, x) - before, _exact_change(half, x)) > 80
    loras.detach()
    assert torch.equal(_forward(model, x), before)


@pytest.mark.parametrize("fmt,min_sqnr", [("int8_convrot", 10.0), ("fp8_rowwise", 10.0), ("w4a4", 3.0)])
def test_stochastic_attach_swaps_merged_weights_and_detach_restores_the_originals(fmt, min_sqnr):
    model, slots = _model(fmt), _stack()
    originals = [model.blocks[0].weight, model.blocks[1].weight, model.head.weight]
    x = torch.randn(8, IN_FEATURES, generator=torch.Generator().manual_seed(2))
    before = _forward(model, x)
    merge = StochasticMerge(model, low_rank_plan(slots), seed=7)
    merge.attach("cpu", "cpu")
    assert model.blocks[0].weight is not originals[0] and merge.merges == 3
    change = _forward(model, x) - before
    assert sqnr_db(_exact_change(slots, x), change) > min_sqnr  # one stochastic rounding of a 0.3-rms LoRA
    merged = model.blocks[0].weight
    merge.detach()
    assert [model.blocks[0].weight, model.blocks[1].weight, model.head.weight] == originals
    assert torch.equal(_forward(model, x), before)
    merge.attach("cpu", "cpu")  # ComfyUI ejects and re-injects several times a run: the merge is reused
    assert merge.merges == 3
    assert torch.equal(model.blocks[0].weight.data._qdata.view(torch.uint8), merged.data._qdata.view(torch.uint8))
    merge.detach()


def test_a_second_stack_on_the_same_model_drops_the_first_ones_kept_merges():
    model, slots = _model(), _stack()
    first = StochasticMerge(model, low_rank_plan(slots), seed=1)
    first.attach()
    first.detach()
    second = StochasticMerge(model, low_rank_plan(slots), seed=2)
    second.attach()
    second.detach()
    assert first._kept == {} and second._kept != {}


def test_stochastic_dense_deltas_from_adapters():
    model = _model("int8_quarot")
    x = torch.randn(8, IN_FEATURES, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model.blocks[1](x)
    diff = dense(random_lora(9, magnitude=0.5 * rms(base_weight(1))))
    seen = {}

    def dense_deltas(key, weight):
        seen[key] = weight.shape
        return [DenseDelta(diff)] if key == "blocks.1.weight" else []

    merge = StochasticMerge(model, {}, seed=3, dense_deltas=dense_deltas, dense_layers=["blocks.1.weight"])
    merge.attach()
    assert seen == {"blocks.1.weight": (OUT, IN_FEATURES)}
    with torch.no_grad():
        assert sqnr_db(x @ diff.T, model.blocks[1](x) - before) > 10
    merge.detach()


class _SmoothedLinear(torch.nn.Linear):
    """A layer as LowBit runs a calibrated one: ``linear(x * pre_quant_scale, Q(W / pre_quant_scale))``."""

    def forward(self, x):
        return super().forward(x * self.pre_quant_scale.to(x.dtype))


def _smoothed_model(fmt: str, scale: torch.Tensor) -> torch.nn.Module:
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([_SmoothedLinear(IN_FEATURES, OUT, bias=False) for _ in range(2)])
    codec = get_format(fmt)
    for i, block in enumerate(model.blocks):
        smoothed = base_weight(i) / scale[None, :]
        block.weight = torch.nn.Parameter(codec.quantize(smoothed, compute_dtype=torch.float32), requires_grad=False)
        block.pre_quant_scale = torch.nn.Parameter(scale.clone(), requires_grad=False)
    return model


#: LowBit's formats that carry a pre_quant_scale on stock ComfyUI, and the SQNR (dB) of a stochastic merge's
#: output change against the exact one: the bars of test_stochastic_attach_swaps_merged_weights... above
SMOOTHED_FORMATS = {"int8_quarot": 10.0, "int8_hadanorm": 10.0, "fp8_rowwise": 10.0}


@pytest.mark.parametrize("fmt,min_sqnr", list(SMOOTHED_FORMATS.items()))
def test_stochastic_merge_on_a_smoothed_layer_matches_dynamic(fmt, min_sqnr):
    """The stored weight is W / s per input channel, so a LoRA delta is merged as delta / s; Dynamic adds
    x @ delta^T to the output (it sees x before the layer scales it). Both must change the output alike."""
    gen = torch.Generator().manual_seed(4)
    scale = torch.exp(torch.randn(IN_FEATURES, generator=gen)).bfloat16()  # ~0.05..20: as calibration gives
    slots = _stack()
    x = torch.randn(8, IN_FEATURES, generator=torch.Generator().manual_seed(5))
    model = _smoothed_model(fmt, scale)
    with torch.no_grad():
        before = torch.cat([model.blocks[0](x), model.blocks[1](x)], dim=-1)
    plan = {k: v for k, v in low_rank_plan(slots).items() if k.startswith("blocks.")}
    exact = torch.cat([x @ sum(dense(d) for _, d in plan[k]).T for k in ("blocks.0.weight", "blocks.1.weight")], -1)

    dynamic = DynamicLoras(model, plan)
    dynamic.attach("cpu")
    with torch.no_grad():
        dynamic_out = torch.cat([model.blocks[0](x), model.blocks[1](x)], dim=-1)
    dynamic.detach()
    merge = StochasticMerge(model, plan, seed=7)
    merge.attach("cpu", "cpu")
    with torch.no_grad():
        stochastic_out = torch.cat([model.blocks[0](x), model.blocks[1](x)], dim=-1)
    merge.detach()
    print(f"{fmt}: stochastic vs dynamic change {sqnr_db(dynamic_out - before, stochastic_out - before):.1f} dB")
    assert sqnr_db(exact, dynamic_out - before) > 60
    assert sqnr_db(dynamic_out - before, stochastic_out - before) > min_sqnr
    # merging the delta itself (in W's space, not W / s's) would be far off: what the test guards against
    codec, layer = get_format(fmt), model.blocks[0]
    naive = merge_stochastic(codec, layer.weight.data, [d for _, d in plan["blocks.0.weight"]], seed=7)
    with torch.no_grad():
        naive_change = torch.nn.functional.linear(x * scale.float(), naive.dequantize().float()) - before[:, :OUT]
    print(f"{fmt}: merged without dividing by the scale {sqnr_db(exact[:, :OUT], naive_change):.1f} dB")
    assert sqnr_db(exact[:, :OUT], naive_change) < 0 < min_sqnr


def test_stochastic_dense_deltas_see_the_smoothed_layers_own_weight():
    scale = torch.linspace(0.25, 4.0, IN_FEATURES)
    model = _smoothed_model("int8_quarot", scale)
    seen = {}

    def dense_deltas(key, weight):
        seen[key] = weight
        return []

    stored = model.blocks[1].weight.dequantize().float()
    StochasticMerge(model, {}, seed=3, dense_deltas=dense_deltas, dense_layers=["blocks.1.weight"]).attach()
    assert torch.equal(seen["blocks.1.weight"], stored * scale)  # W (as stored, times s), not the stored W / s


def test_bench_smoke_run():
    """The Show-4 benchmark runs end to end (tiny shapes on CPU; the real numbers come from a GPU)."""
    from lowbit.lora.bench import main

    out = main(["--hidden", "256", "--tokens", "8", "--blocks", "1", "1", "--iters", "1", "--rank", "4"])
    step = out["step"]
    assert {"base_ms", "dynamic_1_ms", "dynamic_4_ms", "stochastic_4_ms"} <= set(step)
    assert out["merge"]["layers"] == 2 * 5 + 3 and out["merge"]["merge_seconds"] > 0
