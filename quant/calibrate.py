"""Calibration: measure every layer under every candidate format on real inputs, then choose.

The caller runs the model (a few real denoising steps, see ``nodes/calibrate.py``) with
:func:`calibration_samples.record_linear_inputs` on the layers a structural policy would quantize,
and hands the recorded samples and the float weights to :func:`calibrate`, which

1. measures each layer's relative output error and stored bytes under each candidate format
   (``calibration_measure.py``; FP8 with its static ``input_scale``; SmoothQuant smoothing too
   unless ``smoothing="off"``, and with ``smoothing="write"`` (the default) each format that may
   carry a ``pre_quant_scale`` is measured *with* it where that lowers the layer's error) and, when
   the caller can run the model (``output_error``), the model-output error with only that layer in
   that format, as it will run,
2. picks one format per layer so the diffusion model fits the :class:`Budget` at the least summed
   error (``calibration_choose.py``): the summed model-output errors when they were measured (the
   ``"model_output"`` objective), else the summed layer errors (``"layer_output"``),
3. returns a :class:`CalibrationResult`: the structural policy plus ``layer_formats`` (the choice),
   each layer's measurements, the static ``input_scale`` of every FP8 layer and the
   ``pre_quant_scale`` of every layer whose chosen format runs smoothed, and the outlier channels of
   every ``fp8_rowwise`` layer (``config.outlier_fraction`` > 0, see below).

**The policy file** (:meth:`CalibrationResult.save`, :func:`load_policy_file`) is JSON::

    {"schema": "lowbit.policy", "version": 1,
     "policy": {... Policy.to_dict(), with "layer_formats": {layer: format} ...},
     "calibration": {"config": {...}, "objective": "model_output", "budget_bytes": ..., "fixed_bytes": ..., "used_bytes": ...,
                     "total_error": ..., "source": {...how the inputs were recorded...},
                     "layers": {layer: {"shape": [N, K], "format": "int8_quarot", "rows": 256,
                                        "input_scale": 0.0123,            # FP8 layers only
                                        "pre_quant_alpha": 0.5,           # smoothed layers only, with
                                        "pre_quant_scale": {"dtype": "bfloat16", "base64": "..."},
                                        "outlier_channels": [17, 301, ...],  # fp8_rowwise layers only
                                        "measured": {format: {"error": ..., "output_error": ..., "bytes": ...,
                                                              "smoothed_error": ..., "smoothing_alpha": ...,
                                                              "pre_quant_alpha": ...}}}}}}

A bare ``Policy.to_dict()`` object is a policy file too (no calibration data). Layer names are
relative to the diffusion model, as ``Policy`` patterns are.

**Smoothing (``pre_quant_scale``) is written where it lowers a layer's error and is safe.** With
``smoothing="write"``, a layer gets a ``pre_quant_scale`` (the best strength ``a`` of
``config.alphas``) when its chosen format may carry one and smoothing lowers its measured layer
error by at least 5 % (``calibration_measure.MIN_PRE_QUANT_GAIN``; who may carry one:
``calibration_pre_quant.carries_pre_quant_scale``): LowBit's own formats (``int8_quarot``,
``int8_hadanorm``, ``fp8_rowwise``: only LowBit loads them, and LowBit's Linear applies the scale)
always; native formats only when ``config.pre_quant_formats`` lists their ``comfy_quant`` format,
which the node layer fills with what the running ComfyUI's loader applies. Stock ComfyUI 0.30
applies it only for ``nvfp4``, so there no int8/fp8/w4a4/w4a8 layer gets one: stock would drop it
and run the smoothed weight on unscaled inputs. The layer then stores
``smoothed_weight(W, pre_quant_scale)`` in its format plus ``<layer>.pre_quant_scale`` (compute
dtype); the policy file keeps the scale itself, so applying it writes the same bytes.
``smoothing="measure"`` only reports the gain; ``"off"`` skips it.

**Outlier channels (``fp8_rowwise``).** With ``config.outlier_fraction`` > 0 (default 1/48: 64
channels at K = 3072) every ``fp8_rowwise`` layer is measured, chosen and stored with the top ``r``
input channels by ``max|X_j| * ||W[:, j]||`` given a second e4m3 term
(``calibration_outliers.py``); the policy file lists them per layer, and
``calibration_apply.convert_calibrated`` quantizes those layers with them
(``<layer>.weight_outlier_index``). ``0`` turns it off.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from .calibration_choose import Budget, choose_formats
from .calibration_outliers import (DEFAULT_OUTLIER_FRACTION, FP8_ROWWISE, check_outlier_fraction, decode_channels,
                                   encode_channels, layer_outlier_channels)
from .calibration_measure import (DEFAULT_ALPHAS, FLOAT, MIN_PRE_QUANT_GAIN, FormatMeasurement, OutputErrorProbe,
                                  measure_layer, resolve_candidates, smoothed_weight, takes_input_scale)
from .calibration_pre_quant import (carries_pre_quant_scale, check_pre_quant_scale, decode_scale, encode_scale,
                                    pre_quant_scale)
from .calibration_samples import DEFAULT_MAX_ROWS, ActivationSample
from .errors import LowBitError, PolicyError
from .formats import FORMATS
from .policy import Policy, check_known_keys
from .safetensors_file import check_output_path

log = logging.getLogger(__name__)

SCHEMA = "lowbit.policy"
FILE_VERSION = 1
CONFIG_VERSION = 1
DEFAULT_CANDIDATES = ("w4a4", "int8_convrot")  # int4_mixed's pair, so a ratio budget compares like with like
SMOOTHING_MODES = ("write", "measure", "off")  # see the module docstring
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
OBJECTIVES = ("model_output", "layer_output")  # what the choice minimises (see the module docstring)
REPORT_MIN_SMOOTHING_GAIN = MIN_PRE_QUANT_GAIN  # smoothing is reported (and written) where it lowers the error by 5 %


@dataclass(frozen=True)
class CalibrationConfig:
    """What to measure and how to choose. Validates itself; round-trips through :meth:`to_dict`."""

    budget: Budget = Budget("ratio", 0.2)
    candidates: tuple[str, ...] = DEFAULT_CANDIDATES  # format names, or "float" (keep in the compute dtype)
    smoothing: str = "write"  # "write", "measure" (reported only) or "off" (see the module docstring)
    alphas: tuple[float, ...] = DEFAULT_ALPHAS  # SmoothQuant migration strengths tried per layer
    #: native ``comfy_quant`` formats whose loader (in the ComfyUI the result is for) applies a
    #: ``pre_quant_scale``; LowBit's own formats carry one regardless. Empty: stock ComfyUI 0.30.
    pre_quant_formats: frozenset[str] = frozenset()
    rows_per_layer: int = DEFAULT_MAX_ROWS
    compute_dtype: torch.dtype = torch.bfloat16
    seed: int = 0
    #: share of an fp8_rowwise layer's input channels given a second e4m3 term (0: off; see the module docstring)
    outlier_fraction: float = DEFAULT_OUTLIER_FRACTION
    version: int = CONFIG_VERSION

    def __post_init__(self):
        if self.version != CONFIG_VERSION:
            raise PolicyError(f"calibration config version {self.version} is not supported (this LowBit reads "
                              f"version {CONFIG_VERSION})")
        object.__setattr__(self, "budget", Budget.parse(self.budget))
        candidates = tuple(parse_candidates(self.candidates))
        object.__setattr__(self, "candidates", candidates)
        if self.smoothing not in SMOOTHING_MODES:
            raise PolicyError(f"smoothing must be one of {', '.join(SMOOTHING_MODES)}, got {self.smoothing!r}")
        alphas = tuple(float(a) for a in self.alphas)
        if not alphas or any(not 0.0 <= a <= 1.0 for a in alphas):
            raise PolicyError(f"alphas (SmoothQuant strengths) must be numbers from 0 to 1, got {self.alphas!r}")
        object.__setattr__(self, "alphas", alphas)
        if isinstance(self.pre_quant_formats, str) or not all(isinstance(f, str) for f in self.pre_quant_formats):
            raise PolicyError(f"pre_quant_formats must be a set of comfy_quant format names, got {self.pre_quant_formats!r}")
        object.__setattr__(self, "pre_quant_formats", frozenset(self.pre_quant_formats))
        if isinstance(self.rows_per_layer, bool) or not isinstance(self.rows_per_layer, int) or self.rows_per_layer < 1:
            raise PolicyError(f"rows_per_layer must be a positive integer, got {self.rows_per_layer!r}")
        if self.compute_dtype not in DTYPE_NAMES:
            raise PolicyError(f"compute_dtype must be one of {', '.join(DTYPE_NAMES.values())}, got {self.compute_dtype}")
        object.__setattr__(self, "outlier_fraction", check_outlier_fraction(self.outlier_fraction))

    def to_dict(self) -> dict:
        return {"budget": str(self.budget) if self.budget.kind == "ratio" else int(self.budget.value),
                "candidates": list(self.candidates), "smoothing": self.smoothing, "alphas": list(self.alphas),
                "pre_quant_formats": sorted(self.pre_quant_formats),
                "rows_per_layer": self.rows_per_layer, "compute_dtype": DTYPE_NAMES[self.compute_dtype],
                "seed": self.seed, "outlier_fraction": self.outlier_fraction, "version": self.version}

    @classmethod
    def from_dict(cls, data: Mapping) -> "CalibrationConfig":
        check_known_keys(cls, data, "calibration config")
        values = dict(data)
        if "budget" in values:
            values["budget"] = Budget.parse(str(values["budget"]))
        if "compute_dtype" in values:
            names = {v: k for k, v in DTYPE_NAMES.items()}
            if values["compute_dtype"] not in names:
                raise PolicyError(f"compute_dtype must be one of {', '.join(names)}, got {values['compute_dtype']!r}")
            values["compute_dtype"] = names[values["compute_dtype"]]
        for key in ("candidates", "alphas"):
            if key in values:
                values[key] = tuple(values[key])
        if "pre_quant_formats" in values:
            values["pre_quant_formats"] = frozenset(values["pre_quant_formats"])
        return cls(**values)


def parse_candidates(value) -> list[str]:
    """Candidate formats from a list or a comma/space separated string; validated, order kept."""
    items = value.replace(",", " ").split() if isinstance(value, str) else list(value)
    allowed = (*FORMATS, FLOAT)
    bad = [c for c in items if c not in allowed]
    if bad or not items:
        raise PolicyError(f"candidate formats {bad or '(none)'} are not formats; expected one or more of "
                          f"{', '.join(allowed)} (e.g. 'w4a4, int8_convrot')")
    if len(set(items)) != len(items):
        raise PolicyError(f"candidate formats name a format twice: {items}")
    return items


@dataclass(frozen=True)
class LayerCalibration:
    """One layer: what was measured and what was chosen."""

    name: str
    shape: tuple[int, int]
    format: str  # the chosen format, or "float"
    measured: tuple[FormatMeasurement, ...]
    rows: int  # input rows the measurement ran on
    #: the ``[K]`` scale the chosen format runs with, when ``chosen.smoothed`` (compute dtype)
    pre_quant_scale: torch.Tensor | None = field(default=None, compare=False)
    #: int32 ``[r]``: the input channels an ``fp8_rowwise`` layer gives a second e4m3 term (``calibration_outliers``)
    outlier_channels: torch.Tensor | None = field(default=None, compare=False)

    def __post_init__(self):
        if self.format in self.by_format and self.chosen.smoothed != (self.pre_quant_scale is not None):
            raise PolicyError(f"layer {self.name!r}: a pre_quant_scale goes with a chosen format measured smoothed "
                              f"(pre_quant_alpha), and only with one; found format {self.format!r} "
                              f"{'smoothed' if self.chosen.smoothed else 'not smoothed'} and "
                              f"{'a' if self.pre_quant_scale is not None else 'no'} scale")
        if self.pre_quant_scale is not None:
            check_pre_quant_scale(self.name, self.pre_quant_scale, self.shape[1])
        if self.outlier_channels is not None:
            if self.format != FP8_ROWWISE:
                raise PolicyError(f"layer {self.name!r}: outlier channels go with format {FP8_ROWWISE!r} only, found "
                                  f"{self.format!r}")
            decode_channels(self.name, encode_channels(self.outlier_channels), self.shape[1])

    @property
    def by_format(self) -> dict[str, FormatMeasurement]:
        return {m.format: m for m in self.measured}

    @property
    def chosen(self) -> FormatMeasurement:
        return self.by_format[self.format]

    def cost(self, fmt: str, objective: str) -> float:
        """The error the choice minimises for format ``fmt`` under ``objective`` (as the layer will run)."""
        m = self.by_format[fmt]
        return m.output_error if objective == "model_output" else m.layer_error

    @property
    def pre_quant_alpha(self) -> float | None:
        """The SmoothQuant strength of the written ``pre_quant_scale`` (``None``: the layer has none)."""
        return self.chosen.pre_quant_alpha

    @property
    def input_scale(self) -> float | None:
        """The static FP8 ``input_scale`` of the chosen format (``None`` for formats without one)."""
        return self.chosen.input_scale if takes_input_scale(self.format) else None

    def to_dict(self) -> dict:
        out: dict[str, Any] = {"shape": list(self.shape), "format": self.format, "rows": self.rows}
        if self.input_scale is not None:
            out["input_scale"] = self.input_scale
        if self.pre_quant_scale is not None:
            out["pre_quant_alpha"] = self.pre_quant_alpha
            out["pre_quant_scale"] = encode_scale(self.pre_quant_scale)
        if self.outlier_channels is not None:
            out["outlier_channels"] = encode_channels(self.outlier_channels)
        out["measured"] = {m.format: {k: v for k, v in dataclasses.asdict(m).items() if k != "format" and v is not None}
                           for m in self.measured}
        return out

    @classmethod
    def from_dict(cls, name: str, data: Mapping) -> "LayerCalibration":
        try:
            measured = tuple(FormatMeasurement(format=fmt, **values) for fmt, values in data["measured"].items())
            shape, fmt, rows = tuple(int(d) for d in data["shape"]), data["format"], int(data.get("rows", 0))
        except (KeyError, TypeError, ValueError) as err:
            raise PolicyError(f"policy file: calibration of layer {name!r} is malformed ({err!r}); expected "
                              f"shape, format and measured") from None
        if fmt not in {m.format for m in measured}:
            raise PolicyError(f"policy file: layer {name!r} chose {fmt!r}, which was not measured "
                              f"(measured: {', '.join(m.format for m in measured)})")
        scale = data.get("pre_quant_scale")
        channels = data.get("outlier_channels")
        layer = cls(name=name, shape=shape, format=fmt, measured=measured, rows=rows,
                    pre_quant_scale=None if scale is None else decode_scale(name, scale),
                    outlier_channels=None if channels is None else decode_channels(name, channels, shape[1]))
        if "pre_quant_alpha" in data and data["pre_quant_alpha"] != layer.pre_quant_alpha:
            raise PolicyError(f"policy file: layer {name!r} records pre_quant_alpha {data['pre_quant_alpha']!r} but "
                              f"its chosen format was measured with {layer.pre_quant_alpha!r}; the file was edited")
        return layer


@dataclass(frozen=True)
class CalibrationResult:
    """A calibrated policy with the measurements behind it (see the module docstring)."""

    policy: Policy
    config: CalibrationConfig
    budget_bytes: int  # what the calibrated layers could take
    fixed_bytes: int  # the rest of the diffusion model (float layers, biases, norms)
    layers: tuple[LayerCalibration, ...]
    source: dict = field(default_factory=dict)  # how the inputs were recorded (steps, conditioning...)
    objective: str = "layer_output"  # "model_output" when model-output errors were measured

    def __post_init__(self):
        if self.objective not in OBJECTIVES:
            raise PolicyError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.objective == "model_output" and any(m.output_error is None for l in self.layers for m in l.measured):
            raise PolicyError("objective 'model_output' needs every layer's model-output error measured")

    @property
    def used_bytes(self) -> int:
        return sum(layer.chosen.bytes for layer in self.layers)

    @property
    def total_error(self) -> float:
        """The summed error of the chosen formats under the objective (what the choice minimised)."""
        return sum(layer.cost(layer.format, self.objective) for layer in self.layers)

    def input_scales(self) -> dict[str, float]:
        """``{layer: input_scale}`` for every layer whose chosen format takes a static input scale."""
        return {layer.name: layer.input_scale for layer in self.layers if layer.input_scale is not None}

    def pre_quant_scales(self) -> dict[str, torch.Tensor]:
        """``{layer: pre_quant_scale}`` for every layer whose chosen format runs smoothed."""
        return {layer.name: layer.pre_quant_scale for layer in self.layers if layer.pre_quant_scale is not None}

    def outlier_channels(self) -> dict[str, torch.Tensor]:
        """``{layer: int32 outlier channels}`` for every ``fp8_rowwise`` layer that has them."""
        return {layer.name: layer.outlier_channels for layer in self.layers if layer.outlier_channels is not None}

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for layer in self.layers:
            out[layer.format] = out.get(layer.format, 0) + 1
        return dict(sorted(out.items()))

    # ---- file form ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA, "version": FILE_VERSION, "policy": self.policy.to_dict(),
            "calibration": {
                "config": self.config.to_dict(), "objective": self.objective, "budget_bytes": self.budget_bytes,
                "fixed_bytes": self.fixed_bytes, "used_bytes": self.used_bytes, "total_error": self.total_error, "source": dict(self.source),
                "layers": {layer.name: layer.to_dict() for layer in self.layers},
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> "CalibrationResult":
        policy, calibration = _split_policy_file(data)
        if calibration is None:
            raise PolicyError("this policy file holds no calibration data (a plain policy); calibrate the model "
                              "to get one")
        try:
            layers = calibration["layers"]
            result = cls(policy=policy, config=CalibrationConfig.from_dict(calibration.get("config", {})),
                         budget_bytes=int(calibration["budget_bytes"]), fixed_bytes=int(calibration.get("fixed_bytes", 0)),
                         layers=tuple(LayerCalibration.from_dict(name, layer) for name, layer in layers.items()),
                         source=dict(calibration.get("source", {})),
                         objective=calibration.get("objective", "layer_output"))
        except (KeyError, TypeError, AttributeError) as err:
            raise PolicyError(f"policy file: the calibration section is malformed ({err!r}); expected budget_bytes "
                              f"and layers") from None
        chosen = {layer.name: layer.format for layer in result.layers}
        if chosen != policy.layer_format_map:
            raise PolicyError("policy file: policy.layer_formats and the calibration's chosen formats disagree; "
                              "the file was edited by hand. Recalibrate, or remove the calibration section.")
        return result

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        path = Path(path)
        check_output_path(path, overwrite=overwrite)
        path.write_text(self.to_json() + "\n", encoding="utf-8")
        return path

    def metadata_summary(self) -> dict:
        """A small summary for a checkpoint's ``lowbit_calibration`` metadata (the full file can be large)."""
        return {"schema": SCHEMA, "version": FILE_VERSION, "config": self.config.to_dict(),
                "objective": self.objective, "budget_bytes": self.budget_bytes, "used_bytes": self.used_bytes, "fixed_bytes": self.fixed_bytes,
                "total_error": self.total_error, "layers": self.counts(), "input_scales": len(self.input_scales()),
                "pre_quant_scales": len(self.pre_quant_scales()), "outlier_layers": len(self.outlier_channels()),
                "source": dict(self.source)}

    # ---- reporting ------------------------------------------------------------------------
    def summary(self) -> str:
        counts = ", ".join(f"{k}: {v}" for k, v in self.counts().items())
        budget = self.budget_bytes + self.fixed_bytes
        what = "model-output" if self.objective == "model_output" else "layer-output"
        return (f"calibrated {len(self.layers)} layers to {self.config.budget} ({_size(budget)} for the diffusion "
                f"model): {_size(self.used_bytes + self.fixed_bytes)} used; summed {what} error "
                f"{self.total_error:.4g}; {counts}; {len(self.input_scales())} static FP8 input scales; "
                f"{len(self.pre_quant_scales())} pre_quant_scales")

    def table(self) -> str:
        """A markdown report: the chosen policy and every layer's measured error per format."""
        formats = [f for f in (*self.config.candidates, *sorted({m.format for l in self.layers for m in l.measured}))
                   if any(f in l.by_format for l in self.layers)]
        formats = list(dict.fromkeys(formats))
        smoothing = self.config.smoothing != "off"
        model = self.objective == "model_output"
        header = ["layer", "shape", "chosen", "bytes", *(f"{f} error" for f in formats)]
        header += [f"{f} model error" for f in formats] if model else []
        header += ["input_scale"] + (["pre_quant_scale: layer error with / without"] if smoothing else [])
        lines = [f"**{self.summary()}**", "",
                 "*error*: the layer's own relative output error; *model error*: the relative error of the model "
                 "output with only that layer in that format." if model else
                 "*error*: the layer's own relative output error.", "",
                 "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for layer in self.layers:
            by_format = layer.by_format
            cells = [layer.name, "x".join(map(str, layer.shape)), layer.format, _size(layer.chosen.bytes)]
            cells += [f"{by_format[f].error:.3e}" if f in by_format else "-" for f in formats]
            if model:
                cells += [f"{by_format[f].output_error:.3e}" if f in by_format else "-" for f in formats]
            cells.append(f"{layer.input_scale:.4g}" if layer.input_scale is not None else "-")
            if smoothing:
                cells.append(_smoothing_cell(layer))
            lines.append("| " + " | ".join(cells) + " |")
        if smoothing:
            written = [l for l in self.layers if l.pre_quant_scale is not None]
            helped = [l for l in self.layers if l.pre_quant_scale is None
                      and (l.chosen.smoothing_gain or 0) >= REPORT_MIN_SMOOTHING_GAIN]
            lines += ["", f"**pre_quant_scale** (SmoothQuant smoothing) is written for {len(written)} of "
                          f"{len(self.layers)} layers (each where it lowers the layer's error and its format may carry "
                          f"it). It would lower the error of {len(helped)} more layers by at least "
                          f"{REPORT_MIN_SMOOTHING_GAIN - 1:.0%}, whose format "
                          + ("this ComfyUI's loader does not apply it to (stock ComfyUI applies it to nvfp4 only)"
                             if self.config.smoothing == "write" else "is not smoothed with smoothing 'measure'")
                          + ": see docs/calibration.md."]
        return "\n".join(lines)


def _smoothing_cell(layer: LayerCalibration) -> str:
    m = layer.chosen
    if m.smoothed:
        return f"**written** a={m.pre_quant_alpha:g}: {m.smoothed_error:.3e} / {m.error:.3e} ({m.smoothing_gain:.2f}x lower)"
    gain = m.smoothing_gain
    if gain is not None and gain >= REPORT_MIN_SMOOTHING_GAIN:
        return f"not written; a={m.smoothing_alpha:g} would give {m.smoothed_error:.3e} / {m.error:.3e} ({gain:.2f}x lower)"
    return "-"


def calibrate(weights: Mapping[str, torch.Tensor], samples: Mapping[str, ActivationSample], config: CalibrationConfig,
              *, policy: Policy, fixed_bytes: int = 0, float_itemsize: int = 2, source: Mapping | None = None,
              device: torch.device | str | None = None,
              output_error: Callable[[str], OutputErrorProbe] | None = None,
              progress: Callable[[int, int], None] | None = None) -> CalibrationResult:
    """Measure the layers of ``samples`` and choose their formats (see the module docstring).

    ``weights[name]`` is each layer's float ``[N, K]`` weight (fetched once per layer, so it may be
    a lazy mapping); ``policy`` is the structural policy the layers were planned with (its preset
    and keep-float rules stay; ``layer_formats`` is replaced). ``fixed_bytes``: the bytes of every
    other tensor of the diffusion model, counted against a byte budget. ``float_itemsize``: bytes
    per value of a layer kept in float. ``device``: where to measure (default: each weight's device).
    ``output_error(name)``: the model-output probe of layer ``name`` (see
    ``calibration_measure.OutputErrorProbe``); with it the choice minimises model-output errors.
    With ``config.smoothing == "write"``, the formats that may carry a ``pre_quant_scale`` (LowBit's
    own, and ``config.pre_quant_formats``) are measured and chosen as they run with one, where it
    lowers their layer error, and the chosen layers get theirs (see the module docstring).
    """
    alphas = config.alphas if config.smoothing != "off" else ()
    smoothable = frozenset(f for f in FORMATS if config.smoothing == "write"
                           and carries_pre_quant_scale(f, config.pre_quant_formats))
    names = list(samples)
    layers: dict[str, tuple[tuple[int, int], dict[str, FormatMeasurement], int]] = {}
    scales: dict[str, dict[float, torch.Tensor]] = {}  # layer -> the pre_quant_scale of each applied alpha
    outliers: dict[str, dict[float | None, torch.Tensor | None]] = {}  # fp8_rowwise: alpha (None: unsmoothed) -> index
    for done, name in enumerate(names, 1):
        weight = weights[name]
        shape = tuple(int(d) for d in weight.shape)
        if not resolve_candidates(config.candidates, shape):
            log.info("LowBit: no candidate format takes layer %s %s; it keeps the policy's choice", name, shape)
        else:
            probe = output_error(name) if output_error is not None else None
            measured = measure_layer(weight, samples[name], config.candidates, compute_dtype=config.compute_dtype,
                                     alphas=alphas, float_itemsize=float_itemsize, device=device, output_error=probe,
                                     smoothable=smoothable, outlier_fraction=config.outlier_fraction)
            layers[name] = (shape, measured, int(samples[name].rows.shape[0]))
            amax = samples[name].channel_amax.to(weight.device)
            scales[name] = {m.pre_quant_alpha: pre_quant_scale(amax, weight, m.pre_quant_alpha, config.compute_dtype).cpu()
                            for m in measured.values() if m.smoothed}
            rowwise = measured.get(FP8_ROWWISE)
            if rowwise is not None and config.outlier_fraction > 0:
                alpha = rowwise.pre_quant_alpha
                scale = scales[name].get(alpha)
                w = weight if scale is None else smoothed_weight(weight, scale.to(weight.device))
                outliers[name] = {alpha: layer_outlier_channels(amax, w, config.outlier_fraction, scale)}
        del weight
        if progress is not None:
            progress(done, len(names))
    objective = "model_output" if output_error is not None else "layer_output"
    errors = {name: {f: (m.output_error if objective == "model_output" else m.layer_error) for f, m in measured.items()}
              for name, (_, measured, _) in layers.items()}
    sizes = {name: {f: m.bytes for f, m in measured.items()} for name, (_, measured, _) in layers.items()}
    budget_bytes = config.budget.resolve({name: shape for name, (shape, _, _) in layers.items()}, fixed_bytes)
    if budget_bytes <= 0 and layers:
        raise PolicyError(f"the budget {config.budget} leaves {budget_bytes:,} bytes for the quantized layers once the "
                          f"rest of the model ({fixed_bytes:,} bytes) is counted; raise the budget")
    chosen = choose_formats(errors, sizes, budget_bytes) if layers else {}
    calibrated = dataclasses.replace(policy, layer_formats=chosen)
    results = tuple(LayerCalibration(name, shape, chosen[name], tuple(measured.values()), rows,
                                     scales[name].get(measured[chosen[name]].pre_quant_alpha),
                                     outliers.get(name, {}).get(measured[chosen[name]].pre_quant_alpha)
                                     if chosen[name] == FP8_ROWWISE else None)
                    for name, (shape, measured, rows) in layers.items())
    return CalibrationResult(calibrated, config, budget_bytes, int(fixed_bytes), results, dict(source or {}), objective)


# ---- policy files ---------------------------------------------------------------------------

def load_policy_file(path: str | os.PathLike) -> tuple[Policy, CalibrationResult | None]:
    """Read a policy file: a calibrated one (``schema`` ``lowbit.policy``) or a bare ``Policy.to_dict()``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"policy file not found: {path}" if not path.exists()
                                else f"policy path {path} is not a file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PolicyError(f"policy file {path} is not valid JSON: {err}") from None
    try:
        return parse_policy(data)
    except LowBitError as err:
        raise type(err)(f"policy file {path}: {err}") from None


def parse_policy(data: Mapping | str) -> tuple[Policy, CalibrationResult | None]:
    """A policy (and its calibration, when present) from a policy file's JSON object or text."""
    if isinstance(data, str):
        try:
            data = json.loads(data)
        except json.JSONDecodeError as err:
            raise PolicyError(f"the policy is not valid JSON: {err}") from None
    policy, calibration = _split_policy_file(data)
    return policy, (CalibrationResult.from_dict(data) if calibration is not None else None)


def _split_policy_file(data) -> tuple[Policy, Mapping | None]:
    if not isinstance(data, Mapping):
        raise PolicyError(f"a policy file is a JSON object, found {type(data).__name__}")
    if "schema" not in data:
        return Policy.from_dict(data), None  # a bare Policy.to_dict()
    if data["schema"] != SCHEMA:
        raise PolicyError(f"schema is {data['schema']!r}, expected {SCHEMA!r}")
    if data.get("version") != FILE_VERSION:
        raise PolicyError(f"policy file version {data.get('version')!r} is not supported (this LowBit reads version "
                          f"{FILE_VERSION}); update LowBit or recalibrate")
    unknown = set(data) - {"schema", "version", "policy", "calibration"}
    if unknown:
        raise PolicyError(f"unknown keys {sorted(unknown)}; known keys: schema, version, policy, calibration")
    if not isinstance(data.get("policy"), Mapping):
        raise PolicyError("a policy file needs a 'policy' object (Policy.to_dict())")
    calibration = data.get("calibration")
    if calibration is not None and not isinstance(calibration, Mapping):
        raise PolicyError(f"'calibration' must be an object, found {type(calibration).__name__}")
    return Policy.from_dict(data["policy"]), calibration


def _size(n: int | float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


__all__ = ["Budget", "CalibrationConfig", "CalibrationResult", "LayerCalibration", "DEFAULT_CANDIDATES", "calibrate",
           "load_policy_file", "parse_policy", "parse_candidates", "choose_formats"]
