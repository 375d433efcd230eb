"""Calibration without ComfyUI: input sampling, per-format measurement, the budgeted choice, the
calibrated policy (``layer_formats``) and its file, static FP8 input scales written natively, and
the planted-sensitive-layers experiment (issue 7, Show 2)."""

from __future__ import annotations

import itertools
import json
import logging
import random

import pytest
import torch

from calibrate_helpers import PLANTED, PlantedStack, output_error, output_probe, quantized_copy
from lowbit import cli
from lowbit.quant.calibrate import (SCHEMA, CalibrationConfig, CalibrationResult, calibrate, load_policy_file,
                                    parse_candidates, parse_policy)
from lowbit.quant.calibration_apply import LOWBIT_CALIBRATION_KEY, convert_calibrated
from lowbit.quant.calibration_choose import Budget, choose_formats
from lowbit.quant.calibration_measure import (FP8_E4M3_MAX, measure_layer, measure_layer_errors, smoothed_weight,
                                              smoothing_scale, stored_bytes)
from lowbit.quant.calibration_samples import InputSampler, record_linear_inputs
from lowbit.quant.checkpoint import load_quantized, open_checkpoint, save_checkpoint
from lowbit.quant.demo import tiny_flux_state_dict
from lowbit.quant.errors import LowBitError, OutputExistsError, PolicyError
from lowbit.quant.formats import get_format
from lowbit.quant.policy import Policy
from lowbit.quant.presets import Preset

log = logging.getLogger(__name__)
PLAIN = Preset("plain")


def _gaussian(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _sample(rows: torch.Tensor):
    sampler = InputSampler(max_rows=rows.shape[0])
    sampler.add(rows)
    return sampler.sample()


# ---- budgets --------------------------------------------------------------------------------

@pytest.mark.parametrize("text, kind, value", [
    ("7 GB", "bytes", 7e9), ("<= 6.5 GiB", "bytes", 6.5 * 2**30), ("<=512MiB", "bytes", 512 * 2**20),
    ("123456789", "bytes", 123456789), ("1.5tb", "bytes", 1.5e12), ("ratio:0.2", "ratio", 0.2),
    ("ratio=0.35", "ratio", 0.35), ("int8_ratio 1", "ratio", 1.0), ("RATIO:0", "ratio", 0.0),
])
def test_budget_parses_sizes_and_ratios(text, kind, value):
    budget = Budget.parse(text)
    assert (budget.kind, budget.value) == (kind, pytest.approx(value))
    assert Budget.parse(str(budget)) == budget if kind == "ratio" else Budget.parse(str(int(budget.value))).kind == kind


@pytest.mark.parametrize("text", ["", "seven GB", "7 parsecs", "ratio:1.5", "ratio:", "-3 GB", "0 GB", ">= 7 GB"])
def test_budget_rejects_what_is_not_a_size_or_ratio(text):
    with pytest.raises(PolicyError, match="budget|ratio|positive"):
        Budget.parse(text)


def test_ratio_budget_is_int4_mixed_sized():
    shapes = {"a": (512, 512), "b": (256, 1024), "odd": (256, 320)}  # odd: no 256-multiple, both fall back to int8
    int8 = sum(stored_bytes(f, s) for f, s in (("int8_convrot", shapes["a"]), ("int8_convrot", shapes["b"]),
                                                ("int8", shapes["odd"])))
    w4 = sum(stored_bytes(f, s) for f, s in (("w4a4", shapes["a"]), ("w4a4", shapes["b"]), ("int8", shapes["odd"])))
    assert Budget("ratio", 1.0).resolve(shapes) == int8 and Budget("ratio", 0.0).resolve(shapes) == w4
    assert Budget("ratio", 0.5).resolve(shapes) == int((int8 + w4) / 2)
    assert Budget("bytes", 10_000).resolve(shapes, fixed_bytes=4_000) == 6_000


# ---- the choice -----------------------------------------------------------------------------

def _instance(rng: random.Random, layers: int, options: int = 3):
    errors, sizes = {}, {}
    for i in range(layers):
        base = rng.randint(2, 20) * 100
        fmts = [f"f{j}" for j in range(options)]
        sizes[f"layer{i}"] = {f: base * (j + 1) + rng.randint(0, 3) * 100 for j, f in enumerate(fmts)}
        errors[f"layer{i}"] = {f: rng.random() / (j + 1) ** 2 for j, f in enumerate(fmts)}
    return errors, sizes


def _brute_force(errors, sizes, budget):
    names = sorted(errors)
    best = None
    for combo in itertools.product(*(sorted(errors[n]) for n in names)):
        size = sum(sizes[n][f] for n, f in zip(names, combo))
        if size <= budget:
            error = sum(errors[n][f] ** 2 for n, f in zip(names, combo))
            best = error if best is None or error < best else best
    return best


@pytest.mark.parametrize("seed", range(6))
def test_choice_meets_the_budget_at_the_least_total_squared_error(seed):
    rng = random.Random(seed)
    errors, sizes = _instance(rng, layers=6)
    low = sum(min(s.values()) for s in sizes.values())
    high = sum(max(s.values()) for s in sizes.values())
    for budget in (low, (2 * low + high) // 3, (low + high) // 2, high - 100, high):
        chosen = choose_formats(errors, sizes, budget)
        used = sum(sizes[n][f] for n, f in chosen.items())
        error = sum(errors[n][f] ** 2 for n, f in chosen.items())
        assert used <= budget
        assert error == pytest.approx(_brute_force(errors, sizes, budget), rel=1e-12), (seed, budget)


def test_choice_fixes_one_large_error_before_several_small_ones():
    """Layer errors add in power: upgrading the layer at 12% beats upgrading two at 6.7% for the same
    bytes (predicted model error 9.6% against 12.5%), though the plain sum of errors says otherwise."""
    errors = {"mod": {"w4": 0.12, "w8": 0.014}, "qkv": {"w4": 0.067, "w8": 0.007}, "mlp": {"w4": 0.067, "w8": 0.007}}
    sizes = {"mod": {"w4": 200, "w8": 400}, "qkv": {"w4": 100, "w8": 200}, "mlp": {"w4": 100, "w8": 200}}
    chosen = choose_formats(errors, sizes, 600)
    assert chosen == {"mod": "w8", "qkv": "w4", "mlp": "w4"}

    def predicted(choice):
        return sum(errors[n][f] ** 2 for n, f in choice.items()) ** 0.5

    assert predicted(chosen) < predicted({"mod": "w4", "qkv": "w8", "mlp": "w8"})


def test_choice_is_deterministic_and_prefers_fewer_bytes_on_ties():
    errors, sizes = _instance(random.Random(7), layers=30)
    budget = sum(min(s.values()) for s in sizes.values()) + 20_000
    first = choose_formats(errors, sizes, budget)
    shuffled = list(errors)
    random.Random(1).shuffle(shuffled)
    again = choose_formats({n: errors[n] for n in shuffled}, {n: sizes[n] for n in reversed(shuffled)}, budget)
    assert first == again
    tie = choose_formats({"a": {"small": 0.1, "big": 0.1}}, {"a": {"small": 10, "big": 20}}, 100)
    assert tie == {"a": "small"}


def test_choice_refuses_an_impossible_budget_and_takes_the_best_when_all_fits():
    errors = {"a": {"w4": 0.2, "w8": 0.01}, "b": {"w4": 0.3, "w8": 0.02}}
    sizes = {"a": {"w4": 100, "w8": 200}, "b": {"w4": 100, "w8": 200}}
    with pytest.raises(PolicyError, match="below the smallest possible size"):
        choose_formats(errors, sizes, 199)
    assert choose_formats(errors, sizes, 10**9) == {"a": "w8", "b": "w8"}
    assert choose_formats(errors, sizes, 300) == {"a": "w4", "b": "w8"}  # the bigger gain per byte wins
    with pytest.raises(PolicyError, match="same, non-empty set"):
        choose_formats(errors, {"a": sizes["a"], "b": {"w4": 100}}, 300)


# ---- measuring ------------------------------------------------------------------------------

def test_measured_errors_rank_formats_and_match_their_definition():
    weight, x = _gaussian(512, 512, seed=1) / 512**0.5, _gaussian(200, 512, seed=2)
    errors = measure_layer_errors(weight, x, ("w4a4", "int8_convrot", "fp8", "float"),
                                  channel_amax=x.abs().amax(dim=0))
    assert set(errors) == {"w4a4", "int8_convrot", "fp8", "float"}
    assert errors["float"] < 5e-3 < errors["int8_convrot"] < 0.03 < errors["fp8"] < 0.08 < errors["w4a4"] < 0.4
    # the definition, recomputed: ||codec.linear(x, Q(W)) - x W^T|| / ||x W^T||, x in bf16
    codec = get_format("w4a4")
    xb = x.to(torch.bfloat16)
    reference = xb.double() @ weight.double().T
    direct = codec.linear(xb, codec.quantize(weight)).double()
    assert errors["w4a4"] == pytest.approx(float((direct - reference).norm() / reference.norm()), rel=1e-6)


def test_measured_bytes_are_the_stored_bytes_and_fallbacks_are_resolved():
    weight, x = _gaussian(256, 320, seed=3), _gaussian(64, 320, seed=4)  # K=320: w4a4 and int8_convrot fall back
    measured = measure_layer(weight, _sample(x), ("w4a4", "int8_convrot", "fp8"))
    assert list(measured) == ["int8", "fp8"]
    for fmt, m in measured.items():
        assert m.bytes == stored_bytes(fmt, (256, 320))
    assert measured["fp8"].input_scale == pytest.approx(float(x.abs().max()) / FP8_E4M3_MAX)
    assert measured["int8"].input_scale is None


def test_fp8_is_measured_with_its_static_input_scale():
    weight, x = _gaussian(256, 256, seed=5) / 16, _gaussian(128, 256, seed=6).bfloat16()  # as a bf16 model feeds it
    dynamic = measure_layer_errors(weight, x, ("fp8",))["fp8"]
    static_same = measure_layer_errors(weight, x, ("fp8",), channel_amax=x.abs().amax(dim=0))["fp8"]
    assert static_same == dynamic  # the calibration amax is this input's amax: the same scale
    static_wide = measure_layer_errors(weight, x, ("fp8",), channel_amax=x.abs().amax(dim=0) * 1e5)["fp8"]
    assert static_wide > 3 * dynamic  # a scale 1e5x too coarse leaves only subnormals: measured, not assumed


def test_smoothing_follows_comfyui_convention_and_helps_outlier_channels():
    weight, x = _gaussian(256, 512, seed=7) / 512**0.5, _gaussian(256, 512, seed=8)
    x[:, [3, 100, 400]] *= 60.0  # outlier input channels: what per-token int8 without rotation suffers from
    amax = x.abs().amax(dim=0)
    s = smoothing_scale(amax, weight, 0.5)
    pre_quant_scale = 1.0 / s
    # ComfyUI: out = (x * pre_quant_scale) @ W_stored^T; W_stored = W diag(1 / pre_quant_scale) keeps x W^T
    stored = smoothed_weight(weight, pre_quant_scale)
    torch.testing.assert_close((x * pre_quant_scale) @ stored.T, x @ weight.T, rtol=1e-4, atol=1e-4)
    measured = measure_layer(weight, _sample(x), ("int8",), alphas=(0.25, 0.5, 0.75))["int8"]
    assert measured.smoothing_alpha in (0.25, 0.5, 0.75)
    assert measured.smoothing_gain > 2.0, measured


def test_measure_refuses_mismatched_shapes():
    with pytest.raises(LowBitError, match=r"\[N, K\] weight and \[M, K\] inputs"):
        measure_layer_errors(torch.zeros(8, 16), torch.zeros(4, 32), ("int8",))


# ---- sampling inputs ------------------------------------------------------------------------

def test_input_sample_is_bounded_uniform_and_independent_of_batching():
    rows = _gaussian(1000, 16, seed=9)
    rows[517, 4] = 1e3  # one extreme value: the channel abs-max sees every row, not only the sampled ones
    whole = InputSampler(max_rows=64, seed=3)
    whole.add(rows)
    pieces = InputSampler(max_rows=64, seed=3)
    for chunk in torch.split(rows, [1, 300, 99, 600]):
        pieces.add(chunk.reshape(1, -1, 16))  # [..., K] inputs of any rank
    a, b = whole.sample(), pieces.sample()
    assert torch.equal(a.rows, b.rows) and a.rows.shape == (64, 16)
    assert (a.rows_seen, b.rows_seen, a.calls, b.calls) == (1000, 1000, 1, 4)
    assert torch.equal(a.channel_amax, rows.abs().amax(dim=0)) and a.amax == 1e3
    matches = (a.rows[:, None, :] == rows[None, :, :]).all(-1)
    assert (matches.sum(1) == 1).all() and len(set(matches.float().argmax(1).tolist())) == 64  # distinct real rows


def test_hooks_record_every_call_and_are_removed_even_on_error():
    model = PlantedStack()
    linears = model.linears()
    with torch.no_grad(), record_linear_inputs(linears, max_rows=16) as samplers:
        model(_gaussian(3, 10, 512))
        model(_gaussian(5, 512))
    assert all(s.calls == 2 and s.rows_seen == 35 for s in samplers.values())
    assert all(not lin._forward_pre_hooks for lin in linears.values())
    with pytest.raises(RuntimeError, match="boom"), record_linear_inputs(linears):
        raise RuntimeError("boom")
    assert all(not lin._forward_pre_hooks for lin in linears.values())
    with pytest.raises(LowBitError, match="never called"):
        InputSampler().sample()


# ---- the calibrated policy ------------------------------------------------------------------

def test_layer_formats_win_over_the_mode_keep_float_and_min_features():
    preset = Preset("t", keep_float=(r"^keep$",))
    shapes = {"keep.weight": (512, 512), "small.weight": (16, 512), "big.weight": (512, 512),
              "odd.weight": (512, 320), "rest.weight": (512, 512), "floated.weight": (512, 512)}
    policy = Policy(mode="int8", layer_formats={"keep": "w4a4", "small": "fp8", "big": "w4a4", "odd": "w4a4",
                                                "floated": "float"})
    plan = policy.plan(shapes, preset)
    got = {d.name: (d.format, d.reason) for d in plan.layers}
    assert got["keep"] == ("w4a4", "layer_formats") and got["big"] == ("w4a4", "layer_formats")
    assert got["small"] == ("fp8", "layer_formats")  # named: min_features does not apply
    assert got["odd"][0] == "int8" and got["odd"][1].startswith("fallback w4a4 -> int8") and "[layer_formats]" in got["odd"][1]
    assert got["floated"] == (None, "layer_formats: float") and got["rest"] == ("int8", "mode")


def test_layer_formats_match_names_relative_to_the_diffusion_model():
    own = {"a.weight": (512, 512), "b.weight": (512, 512), **{f"c{i}.weight": (512, 512) for i in range(5)}}
    shapes = {f"model.diffusion_model.{k}": v for k, v in own.items()}  # a full checkpoint: VAE keys next to it
    shapes.update({f"first_stage_model.x{i}.weight": (64, 64) for i in range(3)})
    plan = Policy(mode="int8", layer_formats={"a": "w4a4"}).plan(shapes, PLAIN)
    assert plan.format_of("model.diffusion_model.a") == "w4a4" and plan.format_of("model.diffusion_model.b") == "int8"


@pytest.mark.parametrize("value, match", [
    ({"a": "int3"}, "expected one of"), ({"": "int8"}, "non-empty strings"), ("a=int8", "must map layer names"),
    ([["a", "int8"], ["a", "w4a4"]], "twice"),
])
def test_layer_formats_are_validated(value, match):
    with pytest.raises(PolicyError, match=match):
        Policy(layer_formats=value)


def test_layer_formats_round_trip_and_keep_the_policy_hashable():
    policy = Policy(mode="int4_mixed", layer_formats={"b": "w4a4", "a": "float"})
    assert policy.layer_formats == (("a", "float"), ("b", "w4a4")) and hash(policy) == hash(Policy.from_dict(policy.to_dict()))
    data = json.loads(json.dumps(policy.to_dict()))
    assert data["layer_formats"] == {"a": "float", "b": "w4a4"} and Policy.from_dict(data) == policy
    assert "layer_formats" not in Policy().to_dict()  # an uncalibrated policy's JSON is unchanged


# ---- policy files ---------------------------------------------------------------------------

def _tiny_calibration(config=None, seed=0) -> tuple[CalibrationResult, dict[str, torch.Tensor]]:
    state_dict = tiny_flux_state_dict()
    policy = Policy(mode="int4_mixed", preset="flux1")
    plan = policy.plan({k: tuple(v.shape) for k, v in state_dict.items()})
    weights = {d.name: state_dict[f"{d.name}.weight"] for d in plan.quantized}
    samples = {name: _sample(_gaussian(64, w.shape[1], seed=seed + i)) for i, (name, w) in enumerate(weights.items())}
    # fp8 everywhere plus room for a few layers in float: a mix of a format with input scales and one without
    budget = sum(stored_bytes("fp8", tuple(w.shape)) for w in weights.values()) + 600_000
    config = config or CalibrationConfig(budget=Budget("bytes", budget), candidates=("fp8", "float"), smoothing="off")
    return calibrate(weights, samples, config, policy=policy, source={"test": True}), state_dict


@pytest.fixture(scope="module")
def tiny_calibration():
    return _tiny_calibration()


def test_calibration_result_round_trips_through_its_file(tiny_calibration, tmp_path):
    result, _ = tiny_calibration
    assert result.used_bytes <= result.budget_bytes
    assert set(result.policy.layer_format_map) == {layer.name for layer in result.layers}
    assert {"float", "fp8"} == set(result.counts())
    path = result.save(tmp_path / "policy.json")
    policy, loaded = load_policy_file(path)
    assert loaded == result and policy == result.policy
    assert json.loads(path.read_text())["schema"] == SCHEMA
    with pytest.raises(OutputExistsError):
        result.save(path)
    # a bare policy is a policy file too
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps(result.policy.to_dict()))
    assert load_policy_file(bare) == (result.policy, None)


@pytest.mark.parametrize("change, match", [
    (lambda d: d.update(schema="other"), "schema"),
    (lambda d: d.update(version=99), "version 99"),
    (lambda d: d.update(extra=1), "unknown keys"),
    (lambda d: d["policy"]["layer_formats"].update({"double_blocks.0.img_mlp.0": "w4a4"}), "disagree"),
    (lambda d: d["calibration"]["layers"]["double_blocks.0.img_mlp.0"].update(format="int8"), "not measured"),
    (lambda d: d["calibration"].update(config={"budget": "lots"}), "budget"),
    (lambda d: d["policy"].update(mode="int2"), "unknown mode"),
])
def test_policy_file_errors_say_what_is_wrong(tiny_calibration, change, match):
    data = json.loads(tiny_calibration[0].to_json())
    change(data)
    with pytest.raises(LowBitError, match=match):  # PolicyError, or UnknownFormatError for a bad mode
        parse_policy(json.dumps(data))


def test_policy_file_that_is_not_json(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PolicyError, match="not valid JSON"):
        load_policy_file(bad)
    with pytest.raises(FileNotFoundError):
        load_policy_file(tmp_path / "missing.json")


def test_calibration_config_validates_itself():
    assert parse_candidates("w4a4, int8_convrot float") == ["w4a4", "int8_convrot", "float"]
    for bad, match in (({"candidates": "w4a4, int3"}, "not formats"), ({"candidates": ""}, "not formats"),
                       ({"candidates": ("w4a4", "w4a4")}, "twice"), ({"smoothing": "apply"}, "smoothing"),
                       ({"rows_per_layer": 0}, "rows_per_layer"), ({"alphas": (1.5,)}, "alphas")):
        with pytest.raises(PolicyError, match=match):
            CalibrationConfig(**bad)
    config = CalibrationConfig(budget="6 GiB", candidates="fp8 w4a4", compute_dtype=torch.float16)
    assert CalibrationConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


# ---- static FP8 input scales, written natively ----------------------------------------------

def test_input_scale_is_written_natively_and_used_by_the_fp8_codec(tiny_calibration, tmp_path):
    result, state_dict = tiny_calibration
    src = save_checkpoint(state_dict, tmp_path / "float.safetensors")
    dst = tmp_path / "calibrated.safetensors"
    report = convert_calibrated(src, dst, result.policy, input_scales=result.input_scales(),
                                calibration_summary=result.metadata_summary())
    scales = result.input_scales()
    assert scales and set(scales) == {l.name for l in result.layers if l.format == "fp8"}
    assert report.layer_counts == result.policy.plan({k: tuple(v.shape) for k, v in state_dict.items()}).counts()
    loaded = load_quantized(dst)
    for layer in result.layers:
        assert loaded.formats.get(layer.name, "float") == layer.format
        stored = loaded.tensors.get(f"{layer.name}.input_scale")
        if layer.format != "fp8":
            assert stored is None and (layer.format != "float" or f"{layer.name}.weight" in loaded.tensors)
            continue
        assert stored.dtype == torch.float32 and stored.dim() == 0 and float(stored) == pytest.approx(scales[layer.name])
    with open_checkpoint(dst) as reader:
        assert Policy.from_dict(json.loads(reader.metadata["lowbit_policy"])) == result.policy
        assert json.loads(reader.metadata[LOWBIT_CALIBRATION_KEY])["used_bytes"] == result.used_bytes
    # the codec quantizes activations with the stored scale (not the call's own abs-max), saturating at 448
    name = next(iter(scales))
    codec, weight = get_format("fp8"), loaded.layers[name]
    scale = loaded.tensors[f"{name}.input_scale"]
    amax = float(scale) * FP8_E4M3_MAX
    x = _gaussian(32, weight.shape[1], seed=11)
    for peak in (0.25 * amax, 4 * amax):  # inside the calibrated range, and beyond it
        xb = (x / x.abs().max() * peak).to(torch.bfloat16)
        # kitchen's per-tensor fp8 quantization: x * (1/scale) in the input's dtype, clamped, cast to e4m3
        codes = (xb * (1.0 / scale).to(xb.dtype)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        emulated = codes.float() * scale
        expected = emulated @ weight.dequantize().float().T
        static = codec.linear(xb, weight, None, scale).float()
        assert float((static - expected).norm() / expected.norm()) < 5e-3
        dynamic = codec.linear(xb, weight).float()
        assert not torch.equal(dynamic, static)  # not the call's own abs-max
    assert float((dynamic - static).norm() / dynamic.norm()) > 0.1  # beyond the calibrated range: saturated


def test_cli_quantize_with_a_policy_file(tiny_calibration, tmp_path):
    result, state_dict = tiny_calibration
    src = save_checkpoint(state_dict, tmp_path / "float.safetensors")
    policy_file = result.save(tmp_path / "policy.json")
    out = tmp_path / "out.safetensors"
    assert cli.main(["quantize", str(src), str(out), "--policy", str(policy_file), "-q"]) == 0
    loaded = load_quantized(out)
    chosen = result.policy.layer_format_map
    assert loaded.formats == {n: f for n, f in chosen.items() if f != "float"} and "float" in chosen.values()
    assert {k[: -len(".input_scale")] for k in loaded.tensors if k.endswith(".input_scale")} == set(result.input_scales())
    assert cli.main(["quantize", str(src), str(tmp_path / "x.safetensors"), "--policy", str(policy_file),
                     "--mode", "fp8", "-q"]) == cli.EXIT_USER_ERROR
    assert cli.main(["quantize", str(src), str(tmp_path / "y.safetensors"), "--policy",
                     str(tmp_path / "missing.json"), "-q"]) == cli.EXIT_USER_ERROR


# ---- Show 2: planted sensitive layers -------------------------------------------------------

@pytest.mark.parametrize("objective", ["model_output", "layer_output"])
def test_calibration_beats_structural_int4_mixed_on_planted_sensitive_layers(objective):
    """Layers whose 4-bit error is ~10x the others' sit in the middle blocks, where the structural
    int4_mixed ranking puts 4-bit; at the same byte budget, calibration finds them (whether it
    minimises the measured model-output errors or the layers' own errors)."""
    model = PlantedStack(seed=0)
    linears = model.linears()
    calibration_inputs = [_gaussian(2, 64, 512, seed=100 + step) for step in range(4)]  # a few "steps"
    with torch.no_grad(), record_linear_inputs(linears, max_rows=256, seed=0) as samplers:
        for x in calibration_inputs:
            model(x)
    samples = {name: s.sample() for name, s in samplers.items()}
    weights = {name: lin.weight.detach() for name, lin in linears.items()}
    policy = Policy(mode="int4_mixed", preset="generic", int4_mixed_ratio=0.25)
    structural = {d.name: d.format for d in policy.plan(model.shapes()).quantized}
    planted = {f"blocks.{i}.lin" for i in PLANTED}
    assert {n for n, f in structural.items() if f == "int8_convrot"}.isdisjoint(planted)
    budget = sum(stored_bytes(fmt, tuple(weights[name].shape)) for name, fmt in structural.items())
    probe = output_probe(model, calibration_inputs) if objective == "model_output" else None
    result = calibrate(weights, samples, CalibrationConfig(budget=Budget("bytes", budget), smoothing="off"),
                       policy=policy, output_error=probe)
    assert result.objective == objective
    w4_errors = {layer.name: layer.by_format["w4a4"].error for layer in result.layers}
    others = sorted(e for n, e in w4_errors.items() if n not in planted)
    # the premise (about 9.6x with w4a4's searched scales, 10x and more with kitchen's abs-max scales)
    assert min(w4_errors[n] for n in planted) >= 8 * others[len(others) // 2], w4_errors
    calibrated = result.policy.layer_format_map
    assert result.used_bytes <= budget
    assert {n for n, f in calibrated.items() if f == "int8_convrot"} == planted
    x = _gaussian(2, 64, 512, seed=999)  # held-out inputs
    structural_error = output_error(model, quantized_copy(model, structural), x)
    calibrated_error = output_error(model, quantized_copy(model, calibrated), x)
    factor = structural_error / calibrated_error
    log.warning("Show 2 (%s objective): model-output error structural int4_mixed %.4f, calibrated %.4f (%.2fx lower), "
                "same budget %d bytes", objective, structural_error, calibrated_error, factor, budget)
    assert factor >= 3.0, (structural_error, calibrated_error)
