"""Output accuracy of every format on the issue's outlier problem ("Show 1"), and parity with kitchen.

Data (fixed seed): W = randn(3072, 3072) * 0.02 with 32 random input channels x4, X = randn(256, 3072)
with 32 other channels x10; the reference is X @ W.T in float64. Our path is
``codec.linear(X.bfloat16(), codec.quantize(W, compute_dtype=bfloat16))``. For the formats whose layout
is comfy-kitchen's own, the same figure is computed by calling kitchen directly
(``QuantizedTensor.from_float`` on the same fp32 W, ``F.linear`` on the same bf16 X) and must match.

FP8 floors: e4m3 round-to-nearest has a relative error, so each quantized operand sits near 31.6 dB
whatever its distribution or scale, and the product of two quantized operands near 28.7 dB whatever
the scale granularity: that is the plain ``fp8_rowwise`` figure (floor 28.5). Row-wise scales only
pay off when rows of W or tokens of X differ in range, which
:func:`test_fp8_rowwise_beats_tensorwise_when_ranges_differ` shows on a second data set.

Calibrated ``fp8_rowwise`` (floor 31.0): outlier channels (``quant/calibration_outliers.py``) give
the ``r`` input channels of largest ``max|X_j| * ||W[:, j]||`` a second e4m3 term on both operands,
as ``2r`` extra K columns of the same FP8 GEMM. The channels are chosen on a *held-out* activation
sample (``OutlierProblem.calibration_x``: the same outlier channels, different values), never on the
X being measured. Measured: r = 0 / 16 / 32 / 64 give 28.71 / 29.85 / 31.36 / 31.99 dB (r = 64 is
4 % more GEMM work at K = 3072). The gain depends on the activation statistics: it comes from the
few channels where a large activation meets a large weight column, so inputs without outlier
channels gain little.

Run with ``-s`` to see the per-format table; each figure is also a junit ``record_property``.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from comfy_kitchen.tensor import QuantizedTensor

from layout_helpers import NATIVE_FORMATS, outlier_problem, ranged_problem, rows_sqnr_db, sqnr_db
from lowbit.quant.calibration_outliers import outlier_count, select_outlier_channels
from lowbit.quant.formats import FORMATS, get_format

log = logging.getLogger(__name__)

#: minimum output SQNR (dB) on the outlier problem
SQNR_FLOOR_DB = {
    "int8": 24.0,
    "int8_convrot": 36.0,
    "int8_quarot": 36.0,
    "int8_hadanorm": 36.0,
    "fp8": 28.0,
    # plain: round-to-nearest on both operands (see the module docstring), more than tensor-wise fp8
    # here; the calibrated path (outlier channels) has its own floor, CALIBRATED_FP8_ROWWISE_FLOOR_DB
    "fp8_rowwise": 28.5,
    "w4a8": 21.0,
    "w4a4": 12.0,
}


#: calibrated fp8_rowwise (outlier channels chosen on the held-out sample), the issue's target
CALIBRATED_FP8_ROWWISE_FLOOR_DB = 31.0


@pytest.fixture(scope="module")
def problem():
    return outlier_problem()


def _calibrated_rowwise(problem, count: int):
    """fp8_rowwise with the ``count`` outlier channels of the held-out sample (``count`` 0: plain)."""
    codec = get_format("fp8_rowwise")
    amax = problem.calibration_x.bfloat16().float().abs().amax(dim=0)  # what calibration records (bf16 inputs)
    channels = select_outlier_channels(amax, problem.weight, count)
    qweight = codec.quantize(problem.weight, compute_dtype=torch.bfloat16, outlier_channels=channels)
    return codec.linear(problem.x.bfloat16(), qweight), qweight


def test_calibrated_fp8_rowwise_reaches_31_db(problem, record_property):
    count = outlier_count(problem.weight.shape[1])  # the default fraction: 64 of 3072
    y, qweight = _calibrated_rowwise(problem, count)
    plain, _ = _calibrated_rowwise(problem, 0)
    calibrated_db, plain_db = sqnr_db(y, problem.reference), sqnr_db(plain, problem.reference)
    record_property("sqnr_db_fp8_rowwise_calibrated", round(calibrated_db, 3))
    summary = f"fp8_rowwise on the outlier problem: plain {plain_db:.2f} dB, {count} outlier channels {calibrated_db:.2f} dB"
    log.info(summary)
    print("\n" + summary)
    assert count == 64 and qweight._qdata.shape == (3072, 3072 + 2 * count) and qweight.shape == (3072, 3072)
    assert y.dtype == torch.bfloat16 and y.shape == problem.reference.shape
    assert calibrated_db >= CALIBRATED_FP8_ROWWISE_FLOOR_DB, f"{calibrated_db:.2f} dB < {CALIBRATED_FP8_ROWWISE_FLOOR_DB}"
    assert plain_db >= SQNR_FLOOR_DB["fp8_rowwise"] and calibrated_db >= plain_db + 2.5


class _Measured(dict):
    """Our output per format, computed once per module and printed as a table at the end."""

    def __init__(self, problem):
        super().__init__()
        self.problem = problem

    def output(self, name: str) -> torch.Tensor:
        if name not in self:
            codec = get_format(name)
            qweight = codec.quantize(self.problem.weight, compute_dtype=torch.bfloat16)
            self[name] = codec.linear(self.problem.x.bfloat16(), qweight)
        return self[name]


@pytest.fixture(scope="module")
def measured(problem):
    table = _Measured(problem)
    yield table
    lines = ["output SQNR vs fp32 on the 3072x3072 outlier problem (dB):"]
    lines += [f"  {name:<14s} {sqnr_db(table[name], problem.reference):6.2f}  (floor {SQNR_FLOOR_DB[name]})"
              for name in FORMATS if name in table]
    log.info("\n".join(lines))
    print("\n" + "\n".join(lines))


def test_every_format_has_a_floor():
    assert set(SQNR_FLOOR_DB) == set(FORMATS)


@pytest.mark.parametrize("name", list(FORMATS))
def test_output_sqnr_meets_floor(name, problem, measured, record_property):
    y = measured.output(name)
    assert y.dtype == torch.bfloat16 and y.shape == problem.reference.shape
    sqnr = sqnr_db(y, problem.reference)
    record_property(f"sqnr_db_{name}", round(sqnr, 3))
    assert sqnr >= SQNR_FLOOR_DB[name], f"{name}: {sqnr:.2f} dB < {SQNR_FLOOR_DB[name]} dB"


def test_fp8_rowwise_not_worse_than_tensorwise_on_outliers(problem, measured):
    rowwise = sqnr_db(measured.output("fp8_rowwise"), problem.reference)
    assert rowwise >= sqnr_db(measured.output("fp8"), problem.reference)


def _fp8(tensor: torch.Tensor, scale=None):
    from comfy_kitchen.tensor import TensorCoreFP8Layout

    qdata, params = TensorCoreFP8Layout.quantize(tensor, scale=scale)
    return qdata, "TensorCoreFP8Layout", params


def _kitchen_direct(name: str, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` through comfy-kitchen's own layouts, no LowBit code involved."""
    if name == "int8":
        return F.linear(x, QuantizedTensor.from_float(weight, "TensorWiseINT8Layout", per_channel=True))
    if name == "int8_convrot":
        qweight = QuantizedTensor.from_float(weight, "TensorWiseINT8Layout", per_channel=True, convrot=True)
        return F.linear(x, qweight)
    if name == "fp8":
        # kitchen's class itself: once ComfyUI is imported, the registry name "TensorCoreFP8Layout"
        # resolves to ComfyUI's subclass, whose quantize() defaults to a unit scale.
        qweight = QuantizedTensor(*_fp8(weight))
        scale = x.abs().amax().float() / torch.finfo(torch.float8_e4m3fn).max
        return F.linear(QuantizedTensor(*_fp8(x, scale)), qweight)
    if name == "w4a4":
        return F.linear(x, QuantizedTensor.from_float(weight, "TensorCoreConvRotW4A4Layout"))
    if name == "w4a8":
        return F.linear(x, QuantizedTensor.from_float(weight, "AsymW4A8Int8Layout"))
    raise AssertionError(name)


@pytest.mark.parametrize("name", NATIVE_FORMATS)
def test_native_format_is_bit_identical_to_kitchen(name, problem, measured, record_property):
    ours = measured.output(name) if name != "w4a4" else _w4a4_absmax_output(problem)
    theirs = _kitchen_direct(name, problem.weight, problem.x.bfloat16())
    ours_db, theirs_db = sqnr_db(ours, problem.reference), sqnr_db(theirs, problem.reference)
    record_property(f"kitchen_sqnr_db_{name}", round(theirs_db, 3))
    if name == "w4a8":
        # kitchen's W4A8 returns the weight's dtype (fp32 here); ours returns the input's (bf16):
        # the same result rounded once more.
        assert theirs.dtype == torch.float32
        theirs = theirs.bfloat16()
    assert theirs.dtype == ours.dtype
    assert torch.equal(ours, theirs), f"{name}: ours {ours_db:.3f} dB, kitchen {theirs_db:.3f} dB"
    assert abs(ours_db - theirs_db) <= 0.01


def _w4a4_absmax_output(problem) -> torch.Tensor:
    """``w4a4`` with comfy-kitchen's own weight quantizer (``scales="absmax"``), as LowBit runs it."""
    codec = get_format("w4a4")
    qweight = codec.quantize(problem.weight, compute_dtype=torch.bfloat16, scales="absmax")
    return codec.linear(problem.x.bfloat16(), qweight)


def test_w4a4_error_searched_scales_beat_kitchens_abs_max_scales(problem, measured, record_property):
    """LowBit's default ``w4a4`` row scales (``quant/scale_search.py``) against kitchen's ``max|row| / 7``,
    on the outlier problem: the same format, codes and run time. Measured: the weight 18.9 against 16.2 dB,
    the output (4-bit activations, whose outlier channels weigh most here) 13.8 against 12.6 dB."""
    codec = get_format("w4a4")
    searched_w = codec.quantize(problem.weight, compute_dtype=torch.bfloat16)
    absmax_w = codec.quantize(problem.weight, compute_dtype=torch.bfloat16, scales="absmax")
    weight = problem.weight.double()
    weight_gain = sqnr_db(searched_w.dequantize().double(), weight) - sqnr_db(absmax_w.dequantize().double(), weight)
    searched = sqnr_db(measured.output("w4a4"), problem.reference)
    absmax = sqnr_db(_w4a4_absmax_output(problem), problem.reference)
    record_property("w4a4_absmax_sqnr_db", round(absmax, 3))
    assert weight_gain >= 2.0, f"weight: searched scales {weight_gain:+.2f} dB over abs-max scales"
    assert searched >= absmax + 0.8, f"output: searched scales {searched:.2f} dB, abs-max scales {absmax:.2f} dB"


def test_fp8_matches_kitchen_choosing_its_own_activation_scale(problem, measured):
    """Kitchen's ``scale=None`` computes the abs-max scale in bf16, ours in fp32. The scales differ in
    the fourth digit, which moves every activation on the e4m3 grid: the figure is the same up to that
    noise (measured 0.015 dB), not bit for bit."""
    x = problem.x.bfloat16()
    qweight = QuantizedTensor(*_fp8(problem.weight))
    theirs = F.linear(QuantizedTensor(*_fp8(x)), qweight)
    ours = measured.output("fp8")
    assert abs(sqnr_db(ours, problem.reference) - sqnr_db(theirs, problem.reference)) <= 0.05


def test_fp8_rowwise_beats_tensorwise_when_ranges_differ(record_property):
    """Token norms spanning 1e-3..1e2 and weight rows spanning 100x: per-tensor fp8 crushes the small
    tokens (they fall into e4m3's subnormals), per-token scales keep every token near 28 dB."""
    data = ranged_problem()
    x = data.x.bfloat16()
    reference = x.double() @ data.weight.double().t()
    per_token = {}
    for name in ("fp8", "fp8_rowwise"):
        codec = get_format(name)
        y = codec.linear(x, codec.quantize(data.weight, compute_dtype=torch.bfloat16))
        per_token[name] = rows_sqnr_db(y, reference)
        record_property(f"ranged_worst_token_sqnr_db_{name}", round(per_token[name].min().item(), 2))
        record_property(f"ranged_mean_token_sqnr_db_{name}", round(per_token[name].mean().item(), 2))
    rowwise, tensorwise = per_token["fp8_rowwise"], per_token["fp8"]
    summary = (f"ranged problem, per-token SQNR (dB): fp8 worst {tensorwise.min():.2f} mean {tensorwise.mean():.2f}; "
               f"fp8_rowwise worst {rowwise.min():.2f} mean {rowwise.mean():.2f}")
    log.info(summary)
    print("\n" + summary)
    assert rowwise.min() >= 25.0
    assert rowwise.min() >= tensorwise.min() + 15.0
    assert rowwise.mean() >= tensorwise.mean() + 2.0


def test_outlier_channels_help_more_as_r_grows(problem):
    """r = 16 / 32 of the held-out sample's channels: each step a measurable gain over the plain layer."""
    plain = sqnr_db(_calibrated_rowwise(problem, 0)[0], problem.reference)
    r16 = sqnr_db(_calibrated_rowwise(problem, 16)[0], problem.reference)
    r32 = sqnr_db(_calibrated_rowwise(problem, 32)[0], problem.reference)
    assert plain + 0.5 < r16 < r32 and r32 >= plain + 2.0


# ---- the outlier layer's checkpoint form ---------------------------------------------------------

def _small_outlier_layer(seed: int = 3):
    data = outlier_problem(96, 256, 48, seed=seed)
    channels = select_outlier_channels(data.calibration_x.abs().amax(dim=0), data.weight, 32)
    qweight = get_format("fp8_rowwise").quantize(data.weight, compute_dtype=torch.bfloat16, outlier_channels=channels)
    return data, channels, qweight


def test_outlier_layer_round_trips_through_a_checkpoint(tmp_path):
    from lowbit.quant.checkpoint import load_quantized, save_checkpoint
    from lowbit.quant.native import layer_tensors

    data, channels, qweight = _small_outlier_layer()
    codec = get_format("fp8_rowwise")
    entries = layer_tensors(codec, "blocks.0.lin", qweight)
    stored = entries["blocks.0.lin.weight_outlier_index"]
    assert stored.dtype == torch.int32 and torch.equal(stored, channels)
    assert entries["blocks.0.lin.weight"].shape == (96, 256 + 64)
    loaded = load_quantized(save_checkpoint(entries, tmp_path / "outliers.safetensors")).layers["blocks.0.lin"]
    assert loaded.shape == (96, 256) and loaded._layout_cls == qweight._layout_cls
    assert torch.equal(loaded._qdata.view(torch.uint8), qweight._qdata.view(torch.uint8))
    assert torch.equal(loaded._params.scale, qweight._params.scale)
    assert torch.equal(loaded._params.outlier_index, channels)
    x = data.x.bfloat16()
    assert torch.equal(codec.linear(x, loaded), codec.linear(x, qweight))
    assert torch.equal(loaded.dequantize(), qweight.dequantize())
    # the exact hi + lo weight: closer to W than the plain layer's
    plain = codec.quantize(data.weight, compute_dtype=torch.bfloat16)
    error = lambda q: float((q.dequantize().float() - data.weight).norm())  # noqa: E731
    assert error(qweight) < error(plain)
    # a file without the index loads exactly as before: a plain [N, K] layer
    plain_loaded = load_quantized(save_checkpoint(layer_tensors(codec, "l", plain), tmp_path / "plain.safetensors"))
    layer = plain_loaded.layers["l"]
    assert layer._params.outlier_index is None and layer._qdata.shape == (96, 256)
    assert torch.equal(codec.linear(x, layer), codec.linear(x, plain))


@pytest.mark.parametrize("change, match", [
    (lambda idx: idx.long(), "int32"),
    (lambda idx: idx.reshape(2, -1), "1-D"),
    (lambda idx: torch.cat((idx[:-1], idx[:1])), "twice"),
    (lambda idx: torch.cat((idx[:-1], torch.tensor([400], dtype=torch.int32))), r"\[0, 256\)"),
    (lambda idx: idx[:-1], "do not repeat"),
    (lambda idx: idx.flip(0), "do not repeat"),
])
def test_bad_outlier_index_in_a_file_is_a_clear_error(change, match):
    from lowbit.quant.errors import CheckpointFormatError

    _, channels, qweight = _small_outlier_layer()
    codec = get_format("fp8_rowwise")
    tensors = {"weight": qweight._qdata, "weight_scale": qweight._params.scale, "weight_outlier_index": change(channels)}
    with pytest.raises(CheckpointFormatError, match=match) as info:
        codec.from_state_dict("blocks.0.lin", tensors, {"format": "lowbit_fp8_rowwise"})
    assert "blocks.0.lin" in str(info.value) and "weight_outlier_index" in str(info.value)


def test_bad_outlier_channels_are_refused_when_quantizing():
    codec = get_format("fp8_rowwise")
    weight = torch.randn(32, 64)
    for bad in (torch.tensor([1, 1], dtype=torch.int32), torch.tensor([64], dtype=torch.int32),
                torch.arange(40, dtype=torch.int32), torch.tensor([3])):
        with pytest.raises(ValueError, match="outlier channels"):
            codec.quantize(weight, outlier_channels=bad)


# ---- the calibrated policy path ----------------------------------------------------------------

def test_calibrated_policy_gives_fp8_rowwise_layers_their_outlier_channels(tmp_path):
    """calibrate() -> policy file -> quantized layers: every fp8_rowwise layer gets outlier channels,
    chosen on the recorded inputs' hot channels, stored in the file, and the codec runs with them."""
    from lowbit.quant.calibrate import CalibrationConfig, calibrate, load_policy_file
    from lowbit.quant.calibration_choose import Budget
    from lowbit.quant.calibration_samples import InputSampler
    from lowbit.quant.demo import tiny_flux_state_dict
    from lowbit.quant.policy import Policy

    state_dict = tiny_flux_state_dict()
    policy = Policy(mode="int4_mixed", preset="flux1")
    plan = policy.plan({k: tuple(v.shape) for k, v in state_dict.items()})
    weights = {d.name: state_dict[f"{d.name}.weight"].float() for d in plan.quantized}
    samples, hot = {}, {}
    for i, (name, w) in enumerate(weights.items()):
        gen = torch.Generator().manual_seed(100 + i)
        rows = torch.randn(64, w.shape[1], generator=gen)
        hot[name] = torch.randperm(w.shape[1], generator=gen)[:4]
        rows[:, hot[name]] *= 40.0
        sampler = InputSampler(max_rows=64)
        sampler.add(rows)
        samples[name] = sampler.sample()
    config = CalibrationConfig(budget=Budget("bytes", 10**12), candidates=("fp8_rowwise",), smoothing="off")
    result = calibrate(weights, samples, config, policy=policy)
    assert set(result.counts()) == {"fp8_rowwise"}
    channels = result.outlier_channels()
    assert set(channels) == set(weights)
    codec = get_format("fp8_rowwise")
    for name, index in channels.items():
        k = weights[name].shape[1]
        assert index.dtype == torch.int32 and index.numel() == outlier_count(k) and index.numel() % 16 == 0
        assert set(hot[name].tolist()) <= set(index.tolist())  # the hot input channels are among them
        # the measurement describes the layer as it runs: with its outlier channels, and better than plain
        x = samples[name].rows.bfloat16()
        reference = x.float() @ weights[name].t()
        with_outliers = codec.linear(x, codec.quantize(weights[name], outlier_channels=index)).float()
        plain = codec.linear(x, codec.quantize(weights[name])).float()
        error = float((with_outliers - reference).norm() / reference.norm())
        layer = next(l for l in result.layers if l.name == name)
        assert error == pytest.approx(layer.chosen.error, rel=1e-6)
        assert error < float((plain - reference).norm() / reference.norm())
    _, loaded = load_policy_file(result.save(tmp_path / "policy.json"))
    reloaded = loaded.outlier_channels()
    assert set(reloaded) == set(channels) and all(torch.equal(reloaded[n], channels[n]) for n in channels)
    off = calibrate(weights, samples, CalibrationConfig(budget=Budget("bytes", 10**12), candidates=("fp8_rowwise",),
                                                        smoothing="off", outlier_fraction=0.0), policy=policy)
    assert off.outlier_channels() == {}


def test_outlier_layer_passes_the_compiled_linear_opchecks():
    """``lowbit::quantized_linear`` / ``dequantize_weight`` carry the index as a tensor field."""
    from lowbit.quant.compiled_linear import dequantize_weight_op, linear_spec, op_arguments, quantized_linear_op

    data, _, qweight = _small_outlier_layer()
    args = op_arguments("fp8_rowwise", data.x[:5].bfloat16(), qweight, None)
    torch.library.opcheck(quantized_linear_op, args)
    torch.library.opcheck(dequantize_weight_op, (args[1], args[2], linear_spec("fp8_rowwise", qweight)))
    assert torch.equal(quantized_linear_op(*args), get_format("fp8_rowwise").linear(data.x[:5].bfloat16(), qweight))
