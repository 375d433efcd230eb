"""Measure one layer under each candidate format on its recorded inputs.

Two errors per (layer, format):

* **layer error**: the relative output error of the format's own linear (its weight rounding *and*
  its activation quantization, as it runs) against the float product on the layer's recorded
  inputs::

      error = ||codec.linear(x, Q(W)) - x W^T|| / ||x W^T||

  ``x`` in the compute dtype, ``x W^T`` in fp32, the bias left out (every format adds it exactly);
* **model-output error** (when the caller can run the model): the relative error of the whole
  model's output with only this layer in this format, on the calibration inputs. The caller gives
  an :data:`OutputErrorProbe`; this module hands it the layer's replacement product
  ``x -> x Q(W)^T`` (bias left to the caller). A layer's own error says little about how much the
  model output suffers (a modulation layer's error reaches every token), so this is what the
  choice minimises when it is measured.

``"float"`` is the layer kept in the compute dtype.

Activation-side parameters that ComfyUI's checkpoint format has fields for:

* **input_scale** (formats whose native form has one and whose stock loader uses it: FP8
  per-tensor, ``float8_e4m3fn``): the abs-max of every calibration input / 448, so no per-call
  abs-max pass is needed. The fp8 error is measured with that static scale, as it will run.
* **pre_quant_scale** (SmoothQuant smoothing): ComfyUI multiplies the input by ``pre_quant_scale``
  before the linear, so with ``s_j = max|X_j|^a / max|W_j|^(1-a)`` (normalised to geometric mean 1;
  ``max|X_j|`` raised to at least :data:`SMOOTHING_CHANNEL_FLOOR` of the median channel's)
  the layer stores ``pre_quant_scale = 1 / s`` (rounded to the compute dtype, the dtype it is
  stored and applied in) and the weight ``W diag(1 / pre_quant_scale)``; ``x W^T`` is unchanged.
  Each ``a`` of a small grid is measured and the best kept (``smoothed_error``). For the formats
  the caller says may carry it (``smoothable``), it is *applied* when it lowers the layer's error by
  at least :data:`MIN_PRE_QUANT_GAIN` (5 %; below that the gain is within the measurement's noise)
  and the layer saw at least :data:`MIN_PRE_QUANT_ROWS` input rows:
  the measurement then describes the layer as it will run (``pre_quant_alpha`` set; ``bytes``,
  ``input_scale`` and ``output_error`` with the scale), ``error`` staying the unsmoothed one.

With ``outlier_fraction`` > 0, ``fp8_rowwise`` is measured as it will run: with the outlier channels
``calibration_outliers.layer_outlier_channels`` picks from the same channel maxima (on the smoothed
inputs and weight when smoothed); its bytes include the ``2r`` extra weight columns and the index.

Nothing here imports ComfyUI.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

import torch

from .calibration_outliers import FP8_ROWWISE, layer_outlier_channels
from .calibration_samples import ActivationSample
from .errors import LowBitError
from .formats import fallback_chain, get_format
from .native import layer_bytes, layer_tensors

FLOAT = "float"
FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
#: native formats whose stored ``input_scale`` stock ComfyUI (and LowBit) quantize activations with
STATIC_INPUT_SCALE_NATIVE = ("float8_e4m3fn",)
DEFAULT_ALPHAS = (0.25, 0.5, 0.75)
#: smoothing is applied where ``error / smoothed_error`` reaches this (a smaller gain is noise on a few
#: hundred rows: fp8_rowwise layers without outliers measure 0.99x to 1.01x)
MIN_PRE_QUANT_GAIN = 1.05
#: and where the layer saw at least this many input rows while calibrating (a modulation layer sees
#: one row per denoiser call: channel maxima of a handful of rows say nothing about the next prompt)
MIN_PRE_QUANT_ROWS = 64
#: activation channel maxima below this share of the median channel's are raised to it before
#: smoothing: a channel that was quiet on the calibration inputs is not amplified by more than
#: ``(1 / share) ** a`` (unbounded, it was amplified 1000x and blew up on other prompts' inputs)
SMOOTHING_CHANNEL_FLOOR = 0.1
_FLOOR = 1e-5  # channel maxima below this share of the largest are raised to it (no zero divisors)

#: ``probe(replacement) -> relative model-output error`` with the layer computing ``replacement(x)``
#: (``x Q(W)^T``, no bias) instead of its float product
OutputErrorProbe = Callable[[Callable[[torch.Tensor], torch.Tensor]], float]


@dataclass(frozen=True)
class FormatMeasurement:
    """One candidate format measured on one layer."""

    format: str
    error: float  # relative output error as the format runs (fp8: with the static input_scale)
    bytes: int  # stored bytes of the layer's weight in this format (tensors + comfy_quant [+ input_scale])
    input_scale: float | None = None  # the static input_scale used (formats that take one)
    smoothed_error: float | None = None  # best error with SmoothQuant smoothing (None: not measured)
    smoothing_alpha: float | None = None  # the ``a`` that gave ``smoothed_error``
    output_error: float | None = None  # model-output error with only this layer in this format (None: not measured)
    pre_quant_alpha: float | None = None  # set: the layer runs with pre_quant_scale of this ``a`` (see above)

    @property
    def smoothing_gain(self) -> float | None:
        """``error / smoothed_error`` (> 1: smoothing helps), or ``None`` when not measured."""
        if self.smoothed_error is None:
            return None
        return math.inf if self.smoothed_error == 0 else self.error / self.smoothed_error

    @property
    def smoothed(self) -> bool:
        """Whether the layer runs (and is stored) with a ``pre_quant_scale`` in this format."""
        return self.pre_quant_alpha is not None

    @property
    def layer_error(self) -> float:
        """The layer's own error as it will run: ``smoothed_error`` when smoothed, else ``error``."""
        return self.smoothed_error if self.smoothed else self.error


def takes_input_scale(fmt: str) -> bool:
    """Whether layers of format ``fmt`` get a static ``input_scale`` from calibration."""
    return fmt != FLOAT and get_format(fmt).spec.native_format in STATIC_INPUT_SCALE_NATIVE


def static_input_scale(channel_amax: torch.Tensor, pre_quant_scale: torch.Tensor | None = None) -> float:
    """The FP8 per-tensor activation scale: abs-max of the (smoothed) calibration inputs / 448."""
    amax = channel_amax.float()
    if pre_quant_scale is not None:
        amax = amax * pre_quant_scale.float()
    # in fp32, as the codec's dynamic path divides: the same inputs give the same scale bit for bit
    return float(amax.max().clamp(min=1e-12) / FP8_E4M3_MAX)


def smoothing_scale(channel_amax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's per-input-channel ``s = max|X_j|^a / max|W_j|^(1-a)``, geometric mean 1 (fp32 ``[K]``)."""
    amax = channel_amax.float()
    x_max = amax.clamp(min=float(amax.median().clamp(min=1e-30)) * SMOOTHING_CHANNEL_FLOOR) if amax.numel() else amax
    w_max = _floored(weight.float().abs().amax(dim=0))
    s = x_max.pow(alpha) / w_max.pow(1.0 - alpha)
    return s / s.log().mean().exp()


def stored_bytes(fmt: str, shape: tuple[int, int], *, float_itemsize: int = 2, pre_quant_itemsize: int = 0) -> int:
    """Bytes a ``[N, K]`` weight takes in format ``fmt`` (tensors + ``comfy_quant``; ``"float"``: ``N*K*itemsize``),
    plus a ``[K]`` ``pre_quant_scale`` of ``pre_quant_itemsize`` bytes per value when that is not 0."""
    n, k = (int(d) for d in shape)
    if fmt == FLOAT:
        return n * k * float_itemsize
    return layer_bytes(fmt, (n, k)) + (4 if takes_input_scale(fmt) else 0) + k * pre_quant_itemsize


def resolve_candidates(candidates: tuple[str, ...], shape: tuple[int, int]) -> tuple[str, ...]:
    """The formats ``candidates`` give a layer of ``shape`` after each one's fallback chain, deduplicated."""
    out: list[str] = []
    for fmt in candidates:
        if fmt != FLOAT:
            try:
                fmt = fallback_chain(fmt, tuple(shape))[0].spec.name
            except ValueError:
                continue
        if fmt not in out:
            out.append(fmt)
    return tuple(out)


def relative_error(reference: torch.Tensor, output: torch.Tensor) -> float:
    reference = reference.double()
    denom = reference.norm()
    if denom == 0:
        return 0.0 if torch.equal(output.double(), reference) else math.inf
    return float((output.double() - reference).norm() / denom)


def measure_layer_errors(weight: torch.Tensor, inputs: torch.Tensor, candidate_formats, *,
                         channel_amax: torch.Tensor | None = None,
                         compute_dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """``{format: relative output error}`` of ``weight`` on ``inputs`` for each candidate that takes its shape.

    ``channel_amax`` (per input channel, over every calibration input) gives FP8 its static
    ``input_scale``; without it FP8 is measured with the per-call abs-max of ``inputs``.
    """
    measured = _measure(weight, inputs, channel_amax, tuple(candidate_formats), compute_dtype=compute_dtype,
                        alphas=(), float_itemsize=2, device=None, probe=None, smoothable=frozenset(), rows_seen=0)
    return {fmt: m.error for fmt, m in measured.items()}


def measure_layer(weight: torch.Tensor, sample: ActivationSample, candidate_formats, *,
                  compute_dtype: torch.dtype = torch.bfloat16, alphas: tuple[float, ...] = (),
                  float_itemsize: int = 2, device: torch.device | str | None = None,
                  output_error: OutputErrorProbe | None = None,
                  smoothable: frozenset[str] = frozenset(), outlier_fraction: float = 0.0) -> dict[str, FormatMeasurement]:
    """Every candidate (after fallback) measured on the layer's sample (on ``device`` when given);
    SmoothQuant smoothing too, for each strength in ``alphas``, applied to the formats in
    ``smoothable`` where it lowers the error (see the module docstring); the model-output error
    through ``output_error`` when given; ``fp8_rowwise`` with its outlier channels when
    ``outlier_fraction`` > 0."""
    return _measure(weight, sample.rows, sample.channel_amax, tuple(candidate_formats), compute_dtype=compute_dtype,
                    alphas=tuple(alphas), float_itemsize=float_itemsize, device=device, probe=output_error,
                    smoothable=frozenset(smoothable), rows_seen=sample.rows_seen, outlier_fraction=outlier_fraction)


def smoothed_weight(weight: torch.Tensor, pre_quant_scale: torch.Tensor) -> torch.Tensor:
    """The weight a layer stores next to ``pre_quant_scale``: ``W diag(1 / pre_quant_scale)`` (fp32)."""
    return weight.float() / pre_quant_scale.float()[None, :]


def _measure(weight, inputs, channel_amax, candidates, *, compute_dtype, alphas, float_itemsize, device, probe,
             smoothable, rows_seen, outlier_fraction=0.0):
    if weight.dim() != 2 or inputs.dim() != 2 or inputs.shape[1] != weight.shape[1]:
        raise LowBitError(f"measuring a layer needs a [N, K] weight and [M, K] inputs, got weight "
                          f"{tuple(weight.shape)} and inputs {tuple(inputs.shape)}")
    device = weight.device if device is None else torch.device(device)
    w = weight.to(device=device, dtype=torch.float32)
    x = inputs.to(device=device, dtype=compute_dtype)
    amax = None if channel_amax is None else channel_amax.to(device=device, dtype=torch.float32)
    with torch.no_grad():
        reference = torch.nn.functional.linear(x.float(), w)
        out: dict[str, FormatMeasurement] = {}
        for fmt in resolve_candidates(candidates, tuple(w.shape)):
            if fmt == FLOAT:
                product = _float_product(w.to(compute_dtype), compute_dtype)
                error = relative_error(reference, product(x))
                out[fmt] = FormatMeasurement(fmt, error, w.numel() * float_itemsize,
                                             output_error=probe(product) if probe is not None else None)
                continue
            product, size, scale = _quantized_product(fmt, w, amax, None, compute_dtype, outlier_fraction)
            error = relative_error(reference, product(x).float())
            best = None  # (smoothed error, alpha, product, bytes, input scale)
            for alpha in alphas if amax is not None else ():
                # 1 / s rounded to the dtype it is stored and applied in, before the weight is divided by it
                pre_quant = (1.0 / smoothing_scale(amax, w, alpha)).to(compute_dtype)
                smoothed = _quantized_product(fmt, smoothed_weight(w, pre_quant), amax, pre_quant, compute_dtype,
                                              outlier_fraction)
                smoothed_error = relative_error(reference, smoothed[0](x).float())
                if best is None or smoothed_error < best[0]:
                    best = (smoothed_error, alpha, *smoothed)
            measured = FormatMeasurement(fmt, error, size, scale, *(best[:2] if best else (None, None)))
            if (best is not None and fmt in smoothable and best[0] * MIN_PRE_QUANT_GAIN <= error
                    and rows_seen >= MIN_PRE_QUANT_ROWS):  # applied: measured as it will run
                _, alpha, product, size, scale = best
                measured = dataclasses.replace(measured, bytes=size + w.shape[1] * pre_quant.element_size(),
                                               input_scale=scale, pre_quant_alpha=alpha)
            out[fmt] = dataclasses.replace(measured, output_error=probe(product) if probe is not None else None)
    return out


def _float_product(w_compute: torch.Tensor, compute_dtype):
    def product(x):
        return torch.nn.functional.linear(x.to(compute_dtype), w_compute).to(x.dtype)

    return product


def _quantized_product(fmt, w, channel_amax, pre_quant_scale, compute_dtype, outlier_fraction=0.0):
    """(``x -> x Q(W)^T`` as format ``fmt`` runs it, stored bytes, static input_scale or None)."""
    codec = get_format(fmt)
    outliers = None
    if fmt == FP8_ROWWISE and outlier_fraction > 0 and channel_amax is not None:
        outliers = layer_outlier_channels(channel_amax, w, outlier_fraction, pre_quant_scale)
    if outliers is not None:
        qt = codec.quantize(w, compute_dtype=compute_dtype, outlier_channels=outliers)
    else:
        qt = codec.quantize(w, compute_dtype=compute_dtype)
    scale = None
    if takes_input_scale(fmt) and channel_amax is not None:
        scale = static_input_scale(channel_amax, pre_quant_scale)
    size = sum(t.numel() * t.element_size() for t in layer_tensors(codec, "layer", qt).values())
    if scale is not None:
        size += 4  # the fp32 input_scale scalar
    static = None if scale is None else torch.tensor(scale, dtype=torch.float32, device=w.device)
    smooth = None if pre_quant_scale is None else pre_quant_scale.to(compute_dtype)

    def product(x):
        xc = x.to(compute_dtype)
        if smooth is not None:
            xc = xc * smooth.to(xc.device)  # as ComfyUI applies pre_quant_scale: in the input's dtype
        return codec.linear(xc, qt, None, static).to(x.dtype)

    return product, size, scale


def _floored(values: torch.Tensor) -> torch.Tensor:
    top = values.max() if values.numel() else torch.tensor(1.0)
    return values.clamp(min=float(top.clamp(min=1e-30)) * _FLOOR)
