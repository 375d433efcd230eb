"""The per-layer policy: precedence, fallback chains, the int4_mixed INT8 budget, validation and
the printable plan. Shapes only: no tensors, no ComfyUI."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest

from lowbit.quant.demo import TinyFluxConfig, flux_shapes
from lowbit.quant.errors import PolicyError, UnknownFormatError
from lowbit.quant.formats import FORMATS
from lowbit.quant.policy import INT4_MODES, LayerDecision, Plan, Policy, all_modes
from lowbit.quant.presets import Preset, get_preset

TINY_FLUX = flux_shapes(TinyFluxConfig())
FLUX_DEV = flux_shapes(TinyFluxConfig(hidden_size=3072, depth=19, depth_single_blocks=38, context_in_dim=4096,
                                      vec_in_dim=768))
INT8_FAMILY = {"int8", "int8_convrot"}
PLAIN = Preset("plain")  # no keep_float, no int4_sensitive patterns


def _int8_layers(plan: Plan) -> set[str]:
    return {d.name for d in plan.quantized if d.format in INT8_FAMILY}


def _w4a4_can_take(shape) -> bool:
    return FORMATS["w4a4"].spec.shape_problem(tuple(shape)) is None


# ---- precedence -----------------------------------------------------------------------------

def test_precedence_keep_float_then_min_features_then_mode_then_fallback():
    preset = Preset("t", keep_float=(r"^keep\.",))
    shapes = {
        "keep.small.weight": (16, 16),       # keep_float and too small: keep_float wins
        "keep.big.weight": (512, 512),       # keep_float
        "small_out.weight": (16, 512),       # min_features (out)
        "small_in.weight": (512, 16),        # min_features (in)
        "big.weight": (512, 512),            # the mode's format
        "big.bias": (512,),                  # not a 2-D weight: not in the plan
        "conv.weight": (64, 64, 3, 3),       # not 2-D: not in the plan
        "odd.weight": (512, 320),            # K % 256 != 0: w4a4 -> int8_convrot -> int8
        "extra.weight": (512, 512),          # user extra_keep_float
    }
    plan = Policy(mode="w4a4", min_features=32, extra_keep_float=(r"^extra$",)).plan(shapes, preset)
    by_name = {d.name: d for d in plan.layers}
    assert set(by_name) == {"keep.small", "keep.big", "small_out", "small_in", "big", "odd", "extra"}
    assert by_name["keep.small"] == LayerDecision("keep.small", (16, 16), None, "keep_float pattern '^keep\\\\.'")
    assert by_name["keep.big"].format is None and "keep_float" in by_name["keep.big"].reason
    assert by_name["extra"].format is None and "'^extra$'" in by_name["extra"].reason
    for name in ("small_out", "small_in"):
        assert by_name[name].format is None and by_name[name].reason == "smaller than min_features=32"
    assert (by_name["big"].format, by_name["big"].reason) == ("w4a4", "mode")
    odd = by_name["odd"]
    assert odd.format == "int8"
    problems = [FORMATS[f].spec.shape_problem((512, 320)) for f in ("w4a4", "int8_convrot")]
    assert all(problems)
    assert odd.reason == f"fallback w4a4 -> int8: {problems[0]}; {problems[1]} [mode]"
    assert plan.fallbacks() == (odd,)
    # a smaller min_features lets the small layers through to the mode (and its fallback chain)
    relaxed = Policy(mode="int8", min_features=8).plan(shapes, preset)
    assert relaxed.format_of("small_out") == "int8" and relaxed.format_of("keep.small") is None


def test_fallback_chain_stops_at_the_first_format_that_fits():
    shapes = {"k256.weight": (256, 512), "k320.weight": (256, 320), "k64.weight": (256, 64)}
    plan = Policy(mode="int8_convrot", min_features=1).plan(shapes, PLAIN)
    assert plan.format_of("k256") == "int8_convrot"
    assert plan.format_of("k320") == "int8" and plan.format_of("k64") == "int8"
    assert {d.name for d in plan.fallbacks()} == {"k320", "k64"}
    assert "int8_convrot needs in_features divisible by 256, got 320" in dict((d.name, d.reason) for d in plan.layers)["k320"]
    # a format with no fallback that takes every 2-D shape never falls back
    assert Policy(mode="int8", min_features=1).plan(shapes, PLAIN).fallbacks() == ()


@pytest.mark.parametrize("mode", all_modes())
def test_every_mode_plans_the_tiny_flux(mode):
    plan = Policy(mode=mode).plan(TINY_FLUX)
    assert plan.preset == "flux1" and plan.mode == mode
    assert plan.format_of("img_in") is None and plan.format_of("final_layer.linear") is None
    for d in plan.quantized:
        assert FORMATS[d.format].spec.shape_problem(d.shape) is None, d
        if mode not in INT4_MODES and d.format != mode:
            assert d.reason.startswith(f"fallback {mode} -> {d.format}: ")


def test_int4_full_uses_w4a4_wherever_the_shape_allows():
    shapes = {**FLUX_DEV, "extra_block.weight": (3072, 3000)}
    plan = Policy(mode="int4_full", min_features=1).plan(shapes, get_preset("flux1"))
    for d in plan.quantized:
        assert (d.format == "w4a4") == _w4a4_can_take(d.shape), d
    assert plan.format_of("extra_block") == "int8"


# ---- the int4_mixed INT8 budget -------------------------------------------------------------

RATIOS = [0.0, 0.001, 0.01, 0.03, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0]


@pytest.mark.parametrize("shapes, preset", [(TINY_FLUX, "flux1"), (FLUX_DEV, "flux1"), (FLUX_DEV, "plain")],
                         ids=["tiny-flux", "flux-dev", "flux-dev-no-patterns"])
def test_int4_mixed_int8_sets_are_nested(shapes, preset):
    preset = PLAIN if preset == "plain" else get_preset(preset)
    rng = random.Random(0)
    ratios = sorted(set(RATIOS + [rng.random() for _ in range(20)]))
    sets = {r: _int8_layers(Policy(mode="int4_mixed", int4_mixed_ratio=r).plan(shapes, preset)) for r in ratios}
    for r1, r2 in itertools.combinations(ratios, 2):  # r1 < r2
        assert sets[r1] <= sets[r2], f"INT8 layers at ratio {r1} are not all INT8 at {r2}: {sorted(sets[r1] - sets[r2])}"
    assert len({frozenset(s) for s in sets.values()}) > 5, "the ratio changes the plan"


@pytest.mark.parametrize("ratio", RATIOS)
def test_int4_mixed_int8_share_is_nearest_to_the_ratio(ratio):
    plan = Policy(mode="int4_mixed", int4_mixed_ratio=ratio).plan(FLUX_DEV)
    total = sum(d.params for d in plan.quantized)
    int8 = sum(d.params for d in plan.quantized if d.format in INT8_FAMILY)
    largest = max(d.params for d in plan.quantized)
    assert abs(int8 / total - ratio) <= largest / total / 2 + 1e-12


def test_int4_mixed_ratio_zero_and_one():
    for shapes in (TINY_FLUX, FLUX_DEV):
        none = Policy(mode="int4_mixed", int4_mixed_ratio=0.0).plan(shapes)
        assert none.quantized and all(d.format == "w4a4" for d in none.quantized)
        assert not any("int8 budget" in d.reason for d in none.layers)
        every = Policy(mode="int4_mixed", int4_mixed_ratio=1.0).plan(shapes)
        assert every.quantized and all(d.format in INT8_FAMILY for d in every.quantized)
        assert {d.name for d in every.quantized} == {d.name for d in none.quantized}
    # shapes w4a4 cannot take fall back even at ratio 0: "all w4a4 where the shape allows"
    odd = {"blocks.0.a.weight": (512, 512), "blocks.0.b.weight": (512, 320), "blocks.1.a.weight": (512, 512)}
    plan = Policy(mode="int4_mixed", int4_mixed_ratio=0.0).plan(odd, PLAIN)
    assert [(d.name, d.format) for d in plan.layers] == [("blocks.0.a", "w4a4"), ("blocks.0.b", "int8"), ("blocks.1.a", "w4a4")]
    assert plan.layers[1].reason.endswith("[int4_mixed: 4-bit]")


@pytest.mark.parametrize("shapes", [TINY_FLUX, FLUX_DEV], ids=["tiny-flux", "flux-dev"])
def test_int4_sensitive_layers_get_int8_first(shapes):
    preset = get_preset("flux1")
    patterns = [re.compile(p) for p in preset.int4_sensitive]

    def rank(name):
        return next((i for i, p in enumerate(patterns) if p.search(name)), len(patterns))

    plan_all = Policy(mode="int4_mixed", int4_mixed_ratio=1.0).plan(shapes)
    ranks = {d.name: rank(d.name) for d in plan_all.quantized}
    assert {r for r in ranks.values()} == set(range(len(patterns) + 1)), "every pattern names some Flux layer"
    for ratio in RATIOS[1:-1]:
        chosen = _int8_layers(Policy(mode="int4_mixed", int4_mixed_ratio=ratio).plan(shapes))
        if not chosen:
            continue
        worst = max(ranks[n] for n in chosen)
        # every layer of a more sensitive pattern is INT8 before any layer of a less sensitive one
        assert all(n in chosen for n, r in ranks.items() if r < worst), ratio
    # at a small ratio, only the first pattern (modulation) has INT8
    small = Policy(mode="int4_mixed", int4_mixed_ratio=0.05).plan(shapes)
    assert _int8_layers(small) and all(ranks[n] == 0 for n in _int8_layers(small))
    reasons = {d.reason for d in small.quantized if d.format in INT8_FAMILY}
    assert reasons == {f"int4_mixed: int8 budget (int4_sensitive {preset.int4_sensitive[0]!r})"}


def test_edge_blocks_of_each_block_list_get_int8_before_middle_blocks():
    # with no sensitive patterns the ranking is by distance from the first/last block of each
    # block list: Flux's last double block (18) is an edge although 38 single blocks follow it
    edges_only = Preset("edges", keep_float=get_preset("flux1").keep_float)
    plan = Policy(mode="int4_mixed", int4_mixed_ratio=0.08).plan(FLUX_DEV, edges_only)
    chosen = _int8_layers(plan)
    assert chosen
    blocks = {m.group(0) for m in (re.match(r"^(double|single)_blocks\.\d+", n) for n in chosen)}
    assert {"double_blocks.0", "double_blocks.18", "single_blocks.0", "single_blocks.37"} <= blocks
    assert not any(n.startswith(("double_blocks.9.", "single_blocks.19.")) for n in chosen)
    reasons = [d.reason for d in plan.quantized if d.name.startswith("double_blocks.18.") and d.format in INT8_FAMILY]
    assert reasons and all(r == "int4_mixed: int8 budget (0 from the first/last of double_blocks)" for r in reasons)


# ---- names with a prefix --------------------------------------------------------------------

def test_prefixed_and_full_checkpoint_names_plan_like_the_bare_model():
    bare = Policy(mode="int4_mixed", int4_mixed_ratio=0.3).plan(FLUX_DEV)
    prefix = "model.diffusion_model."
    prefixed = Policy(mode="int4_mixed", int4_mixed_ratio=0.3).plan({prefix + k: v for k, v in FLUX_DEV.items()})
    assert prefixed.preset == "flux1"
    assert [(prefix + d.name, d.format) for d in bare.layers] == [(d.name, d.format) for d in prefixed.layers]
    full = {**{prefix + k: v for k, v in FLUX_DEV.items()},
            **{f"first_stage_model.decoder.mid.attn_1.{p}.weight": (512, 512) for p in "qkv"},
            "text_encoders.clip_l.transformer.text_model.final_layer_norm.weight": (768,)}
    plan = Policy(mode="int8").plan(full)
    assert plan.preset == "flux1"
    assert plan.format_of(prefix + "img_in") is None and plan.format_of(prefix + "double_blocks.0.img_attn.qkv") == "int8"
    vae = [d for d in plan.layers if d.name.startswith("first_stage_model.")]
    assert len(vae) == 3 and all(d.format is None and "outside the diffusion model" in d.reason for d in vae)


# ---- validation and round trip --------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, message", [
    ({"mode": "int3"}, UnknownFormatError, r"unknown mode 'int3'; known modes: .*int8_convrot.*int4_mixed"),
    ({"int4_mixed_ratio": 1.5}, PolicyError, r"int4_mixed_ratio .* a number from 0 to 1, got 1.5"),
    ({"int4_mixed_ratio": -0.1}, PolicyError, r"int4_mixed_ratio .* got -0.1"),
    ({"int4_mixed_ratio": float("nan")}, PolicyError, r"int4_mixed_ratio .* got nan"),
    ({"int4_mixed_ratio": "0.5"}, PolicyError, r"int4_mixed_ratio .* got '0.5'"),
    ({"min_features": 0}, PolicyError, r"min_features must be an integer of at least 1.*got 0"),
    ({"min_features": 2.5}, PolicyError, r"min_features must be an integer.*got 2.5"),
    ({"extra_keep_float": ("^ok$", "(unclosed")}, PolicyError,
     r"extra_keep_float pattern '\(unclosed' is not a valid regular expression"),
    ({"preset": "flux9"}, PolicyError, r"unknown preset 'flux9'; known presets: auto, .*flux1"),
    ({"version": 7}, PolicyError, r"policy version 7 is not supported"),
    ({"w4a4_scales": "max"}, PolicyError, r"w4a4_scales must be one of mse, absmax .*got 'max'"),
])
def test_policy_validation_errors_are_clear(kwargs, error, message):
    with pytest.raises(error, match=message):
        Policy(**kwargs)


def test_codec_options_name_the_w4a4_scales_for_w4a4_layers_only():
    assert Policy().codec_options("w4a4") == {"scales": "mse"}
    assert Policy(mode="int4_mixed", w4a4_scales="absmax").codec_options("w4a4") == {"scales": "absmax"}
    assert all(Policy(w4a4_scales="absmax").codec_options(fmt) == {} for fmt in FORMATS if fmt != "w4a4")
    assert Policy.from_dict({"mode": "w4a4"}).w4a4_scales == "mse"  # a policy written before the option


def test_policy_errors_are_value_errors():
    with pytest.raises(ValueError):
        Policy(mode="nope")
    with pytest.raises(PolicyError, match=r"unknown policy keys \['ratio'\]; known keys: .*int4_mixed_ratio"):
        Policy.from_dict({"mode": "int8", "ratio": 0.3})


@pytest.mark.parametrize("policy", [
    Policy(),
    Policy(mode="int4_mixed", preset="flux1", int4_mixed_ratio=0.35, min_features=64, extra_keep_float=(r"^x$", "final")),
    Policy(mode="fp8_rowwise", preset="wan21"),
    Policy(mode="int4_full", w4a4_scales="absmax"),
])
def test_policy_round_trips_through_a_dict_and_json(policy):
    data = policy.to_dict()
    assert Policy.from_dict(data) == policy
    assert Policy.from_dict(json.loads(json.dumps(data))) == policy
    assert isinstance(data["extra_keep_float"], list)


def test_explicit_preset_overrides_detection():
    plan = Policy(mode="int8", preset="generic").plan(TINY_FLUX)
    assert plan.preset == "generic"
    assert Policy(mode="int8").plan(TINY_FLUX).preset == "flux1"


# ---- the printable plan ---------------------------------------------------------------------

def test_plan_table_lists_every_layer():
    plan = Policy(mode="int4_mixed", int4_mixed_ratio=0.3).plan(TINY_FLUX)
    table = plan.table()
    lines = table.splitlines()
    assert lines[0] == "plan: mode=int4_mixed preset=flux1"
    assert lines[1].split()[:4] == ["layer", "shape", "format", "reason"]
    body = lines[2:-1]
    assert len(body) == len(plan.layers) == sum(1 for k, v in TINY_FLUX.items() if k.endswith(".weight") and len(v) == 2)
    for line, d in zip(body, plan.layers):
        assert line.split()[:3] == [d.name, "x".join(map(str, d.shape)), d.format or "float"]
        assert line.endswith(d.reason)
    counts = plan.counts()
    assert lines[-1] == "layers per format: " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    assert sum(counts.values()) == len(plan.layers) and set(counts) == {"float", "int8_convrot", "w4a4"}


def test_int4_mixed_plan_does_not_depend_on_key_order():
    from lowbit.quant.demo import TinyFluxConfig, flux_shapes

    shapes = flux_shapes(TinyFluxConfig(depth=3, depth_single_blocks=12))
    policy = Policy(mode="int4_mixed", int4_mixed_ratio=0.3)
    forward = {d.name: d.format for d in policy.plan(shapes).layers}
    backward = {d.name: d.format for d in policy.plan(dict(reversed(list(shapes.items())))).layers}
    assert forward == backward
    assert "int8_convrot" in forward.values() and "w4a4" in forward.values()


def test_fp8_source_weights_are_checked_for_nan():
    import torch

    from lowbit.quant.errors import NonFiniteWeightError
    from lowbit.quant.quantize import quantize_weight

    weight = torch.randn(64, 256).to(torch.float8_e4m3fn)
    assert quantize_weight(weight, "int8").shape == (64, 256)
    weight[3, 5] = float("nan")
    with pytest.raises(NonFiniteWeightError, match="1 NaN/Inf"):
        quantize_weight(weight, "int8")
