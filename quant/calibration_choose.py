"""Pick one format per layer so the model fits a byte budget at the least total measured error.

A multiple-choice knapsack: every layer takes exactly one of its measured options (format, bytes,
error); the chosen bytes must sum to at most the budget; the sum of the *squared* errors is
minimised. Each error is a relative RMS error measured with that layer alone quantized; independent
quantization noises add in power, so the squared sum predicts the whole model's squared error (a
plain sum would undervalue fixing one large error against several small ones).
:func:`choose_formats` solves it by dynamic programming over the bytes above the smallest choice
(``resolution`` buckets, costs rounded up, so the budget always holds), then spends what rounding
left over on the best remaining single-layer upgrades. Ties go to fewer bytes, then to format
name; layers are handled in name order, so the result depends on nothing but the numbers.

A :class:`Budget` is either a byte count for the whole diffusion model (``"7 GB"``, ``"<= 6.5GiB"``,
``"7000000000"``) or an INT8 share like ``int4_mixed``'s ratio (``"ratio:0.2"``): the bytes of the
model with that share of its quantized parameters in ``int8_convrot`` and the rest in ``w4a4``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from .errors import PolicyError

DEFAULT_RESOLUTION = 50_000
RATIO_HIGH, RATIO_LOW = "int8_convrot", "w4a4"  # the pair an INT8-share budget is measured against
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_BYTES = re.compile(r"^(?:<=?\s*)?(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)$")
_RATIO = re.compile(r"^(?:int8_)?ratio\s*[:=]?\s*(\d+(?:\.\d*)?|\.\d+)$")


@dataclass(frozen=True)
class Budget:
    """How much the calibrated model may take: ``bytes`` (whole diffusion model) or ``ratio`` (INT8 share)."""

    kind: str  # "bytes" or "ratio"
    value: float

    def __post_init__(self):
        if self.kind not in ("bytes", "ratio"):
            raise PolicyError(f"budget kind must be 'bytes' or 'ratio', got {self.kind!r}")
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)) or not math.isfinite(self.value):
            raise PolicyError(f"budget value must be a number, got {self.value!r}")
        if self.kind == "ratio" and not 0.0 <= self.value <= 1.0:
            raise PolicyError(f"a ratio budget is the share of quantized parameters in INT8: 0 to 1, got {self.value}")
        if self.kind == "bytes" and self.value <= 0:
            raise PolicyError(f"a byte budget must be positive, got {self.value}")

    @classmethod
    def parse(cls, text: str) -> "Budget":
        """``"7 GB"``, ``"<= 6.5 GiB"``, ``"123456789"`` (bytes) or ``"ratio:0.2"`` (INT8 share)."""
        if isinstance(text, Budget):
            return text
        cleaned = " ".join(str(text).strip().lower().split())
        ratio = _RATIO.match(cleaned)
        if ratio:
            return cls("ratio", float(ratio.group(1)))
        size = _BYTES.match(cleaned)
        if size and size.group(2) in _UNITS:
            return cls("bytes", float(size.group(1)) * _UNITS[size.group(2)])
        raise PolicyError(
            f"budget {text!r} is not a size or a ratio; expected e.g. '7 GB', '<= 6.5 GiB', '7000000000' (bytes of "
            f"the whole diffusion model) or 'ratio:0.2' (the size of int4_mixed with that INT8 share)")

    def __str__(self) -> str:
        return f"ratio:{self.value:g}" if self.kind == "ratio" else f"{int(self.value)} bytes"

    def resolve(self, shapes: Mapping[str, tuple[int, int]], fixed_bytes: int = 0) -> int:
        """Bytes the calibrated layers (``shapes``: name -> ``[N, K]``) may take together.

        ``fixed_bytes``: everything else the diffusion model stores (float layers, biases, norms),
        subtracted from a byte budget. A ratio budget is the layers' size with a share ``value`` of
        their parameters in ``int8_convrot`` and the rest in ``w4a4`` (each after its fallback chain).
        """
        if self.kind == "bytes":
            return int(self.value) - int(fixed_bytes)
        from .calibration_measure import resolve_candidates, stored_bytes

        total = 0.0
        for shape in shapes.values():
            high, low = (stored_bytes(resolve_candidates((fmt,), shape)[0], shape) for fmt in (RATIO_HIGH, RATIO_LOW))
            total += low + self.value * (high - low)
        return int(total)


def choose_formats(errors: Mapping[str, Mapping[str, float]], sizes: Mapping[str, Mapping[str, int]],
                   budget_bytes: int, *, resolution: int = DEFAULT_RESOLUTION) -> dict[str, str]:
    """``{layer: format}`` with ``sum(bytes) <= budget_bytes`` and the least ``sum(error ** 2)`` (see the module
    docstring).

    ``errors`` and ``sizes`` map each layer to ``{format: value}`` over the same formats. Raises
    :class:`PolicyError` when even the smallest choice of every layer exceeds the budget.
    """
    names = sorted(errors)
    options: dict[str, list[tuple[int, float, str]]] = {}
    for name in names:
        if set(errors[name]) != set(sizes.get(name, {})) or not errors[name]:
            raise PolicyError(f"layer {name!r}: errors and sizes must cover the same, non-empty set of formats; "
                              f"got errors for {sorted(errors[name])} and sizes for {sorted(sizes.get(name, {}))}")
        options[name] = _pareto(sorted((int(sizes[name][f]), float(errors[name][f]) ** 2, f) for f in errors[name]))
    smallest = sum(opts[0][0] for opts in options.values())
    if smallest > budget_bytes:
        raise PolicyError(
            f"the budget ({budget_bytes:,} bytes for the calibrated layers) is below the smallest possible size "
            f"({smallest:,} bytes: every layer in its smallest candidate format). Raise the budget, or add a smaller "
            f"candidate format.")
    chosen = {name: 0 for name in names}  # index into options[name]
    if sum(opts[-1][0] for opts in options.values()) <= budget_bytes:
        chosen = {name: len(opts) - 1 for name, opts in options.items()}  # everything fits at least error
    else:
        chosen = _knapsack(names, options, budget_bytes - smallest, resolution)
    chosen = _fill(names, options, chosen, budget_bytes)
    return {name: options[name][chosen[name]][2] for name in names}


def _pareto(opts: list[tuple[int, float, str]]) -> list[tuple[int, float, str]]:
    """Options sorted by bytes keeping only those with strictly less error than every smaller one."""
    kept: list[tuple[int, float, str]] = []
    for size, error, fmt in opts:
        if not kept or error < kept[-1][1]:
            if kept and size == kept[-1][0]:
                kept[-1] = (size, error, fmt)
            else:
                kept.append((size, error, fmt))
    return kept


def _knapsack(names, options, capacity: int, resolution: int) -> dict[str, int]:
    unit = max(1, math.ceil(capacity / resolution))
    slots = capacity // unit + 1
    best = np.zeros(slots)  # least error of the layers so far with at most c units spent
    picks = np.zeros((len(names), slots), dtype=np.int8)  # a layer has at most a few options
    for i, name in enumerate(names):
        base = options[name][0][0]
        candidates = np.full((len(options[name]), slots), np.inf)
        for j, (size, error, _) in enumerate(options[name]):
            cost = math.ceil((size - base) / unit)
            if cost < slots:
                candidates[j, cost:] = best[: slots - cost] + error
        picks[i] = np.argmin(candidates, axis=0)  # first minimum: the fewest bytes among equal errors
        best = candidates[picks[i], np.arange(slots)]
    chosen, c = {}, slots - 1
    for i in range(len(names) - 1, -1, -1):
        name = names[i]
        j = int(picks[i, c])
        chosen[name] = j
        c -= math.ceil((options[name][j][0] - options[name][0][0]) / unit)
    return chosen


def _fill(names, options, chosen: dict[str, int], budget_bytes: int) -> dict[str, int]:
    """Spend bytes the rounding left over: repeatedly take the fitting upgrade with the best error per byte."""
    chosen = dict(chosen)
    used = sum(options[n][chosen[n]][0] for n in names)
    while True:
        best = None
        for name in names:
            size, error, _ = options[name][chosen[name]]
            for j in range(chosen[name] + 1, len(options[name])):
                up_size, up_error, _ = options[name][j]
                if used - size + up_size > budget_bytes:
                    break
                gain = (error - up_error) / max(up_size - size, 1)
                if best is None or gain > best[0]:
                    best = (gain, name, j)
        if best is None:
            return chosen
        _, name, j = best
        used += options[name][j][0] - options[name][chosen[name]][0]
        chosen[name] = j
