"""Shared data, metrics and spies for the format tests (``test_formats_sqnr``, ``test_layout_*``).

Nothing here asserts: the tests do. Everything is deterministic (explicit ``torch.Generator`` seeds).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
from typing import Iterator

import torch
from comfy_kitchen.tensor import QuantizedTensor, get_layout_class
from packaging.version import Version

from lowbit.quant.formats import FORMATS, FormatCodec

FORMAT_NAMES = tuple(FORMATS)
#: formats whose weight layout is comfy-kitchen's own (stock ComfyUI loads them)
NATIVE_FORMATS = ("int8", "int8_convrot", "fp8", "w4a4", "w4a8")
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


def kitchen_version() -> Version:
    return Version(importlib.metadata.version("comfy-kitchen"))


def sqnr_db(y: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``y`` against ``ref`` in dB, computed in float64."""
    ref = ref.double()
    noise = (y.double() - ref).pow(2).sum()
    return float(10 * torch.log10(ref.pow(2).sum() / noise))


def rows_sqnr_db(y: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """SQNR of every row (token) separately, in dB."""
    ref = ref.double()
    return 10 * torch.log10(ref.pow(2).sum(-1) / (y.double() - ref).pow(2).sum(-1))


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact|| / ||exact||`` (Frobenius, float64)."""
    exact = exact.double()
    return float((approx.double() - exact).norm() / exact.norm())


def legal_shape(codec: FormatCodec) -> tuple[int, int]:
    """The smallest awkward ``[N, K]`` the format takes: K = 200 (no power of two) where it can,
    else 208 (a multiple of 16, not of 32), else 256; N = 40 where it can, else 48."""
    spec = codec.spec
    k = next(k for k in (200, 208, 256) if k % spec.in_features_multiple == 0)
    n = next(n for n in (40, 48) if n % spec.out_features_multiple == 0)
    return n, k


def outlier_weight(n: int, k: int, *, seed: int, outliers: int = 4, factor: float = 4.0) -> torch.Tensor:
    """``randn(n, k) * 0.02`` with ``outliers`` random input channels scaled by ``factor``."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) * 0.02
    channels = torch.randperm(k, generator=gen)[:outliers]
    weight[:, channels] *= factor
    return weight


def activation(*shape: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype)


@dataclasses.dataclass(frozen=True)
class OutlierProblem:
    """The issue's "Show 1" data: weight and activation with (different) outlier input channels."""

    weight: torch.Tensor  # fp32 [N, K]
    x: torch.Tensor  # fp32 [M, K]
    reference: torch.Tensor  # float64 x @ weight.T
    #: fp32 [M, K]: held-out activations for calibration (same outlier channels, different values)
    calibration_x: torch.Tensor | None = None


def outlier_problem(n: int = 3072, k: int = 3072, m: int = 256, *, seed: int = 0) -> OutlierProblem:
    """W = randn(n, k) * 0.02 with 32 random input channels x4; X = randn(m, k) with 32 other channels x10.

    ``calibration_x``: another ``randn(m, k)`` (its own generator) with the same 32 channels x10 – what a
    calibration pass would record from other prompts of the same model."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) * 0.02
    x = torch.randn(m, k, generator=gen)
    channels = torch.randperm(k, generator=gen)
    weight[:, channels[:32]] *= 4
    x[:, channels[32:64]] *= 10
    calibration_x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1_000_003))
    calibration_x[:, channels[32:64]] *= 10
    return OutlierProblem(weight, x, x.double() @ weight.double().t(), calibration_x)


def ranged_problem(n: int = 256, k: int = 512, m: int = 64, *, seed: int = 1) -> OutlierProblem:
    """Rows of W whose norms span 100x and tokens of X whose norms span 1e-3 .. 1e2."""
    gen = torch.Generator().manual_seed(seed)
    row_gain = torch.logspace(-1, 1, n)[torch.randperm(n, generator=gen)].unsqueeze(1)
    token_gain = torch.logspace(-3, 2, m)[torch.randperm(m, generator=gen)].unsqueeze(1)
    weight = torch.randn(n, k, generator=gen) * 0.02 * row_gain
    x = torch.randn(m, k, generator=gen) * token_gain
    return OutlierProblem(weight, x, x.double() @ weight.double().t())


def fp8_activation(x: torch.Tensor) -> QuantizedTensor:
    """A 2-D activation quantized to kitchen's per-tensor FP8 layout with its abs-max scale, as the
    ``fp8`` codec does before ``F.linear`` (kitchen's FP8 GEMM needs both operands quantized)."""
    scale = x.abs().amax().float().clamp(min=1e-12) / FP8_MAX
    return QuantizedTensor.from_float(x, "TensorCoreFP8Layout", scale=scale)


def gemm_operand(name: str, x: torch.Tensor):
    """The activation operand ``mm``/``addmm`` get for format ``name`` (quantized for ``fp8`` only)."""
    return fp8_activation(x) if name == "fp8" else x


# ---- dequantize spy ------------------------------------------------------------------------

def _kitchen_eager_dequantizers() -> list[tuple[object, str]]:
    """(module, name) of every eager-backend ``dequantize*`` function, where the backend looks it up."""
    import comfy_kitchen.backends.eager as eager
    import sys

    places = []
    for name in dir(eager):
        if name.startswith("dequantize"):
            places.append((eager, name))
            for mod_name, mod in list(sys.modules.items()):
                if mod_name.startswith("comfy_kitchen.backends.eager.") and name in vars(mod):
                    places.append((mod, name))
    return places


def _lowbit_dequantize_candidates() -> list[type]:
    """Classes of LowBit's kernel dispatch that hold a ``_dequant`` candidate (dequantize + float matmul)."""
    import importlib

    owners = []
    for module_name in ("lowbit.kernels.w8a8_linear", "lowbit.kernels.w4_linear"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        owners += [obj for obj in vars(module).values()
                   if isinstance(obj, type) and obj.__module__ == module_name and "_dequant" in vars(obj)]
    return owners


@dataclasses.dataclass
class DequantizeSpy:
    """Records every dequantization of a quantized weight: kitchen's fallback, ``QuantizedTensor.dequantize``,
    any layout's ``dequantize``, any eager-backend ``dequantize*`` kernel and the ``dequant`` candidate of
    LowBit's own kernel dispatch."""

    calls: list[str] = dataclasses.field(default_factory=list)


@contextlib.contextmanager
def spy_dequantize() -> Iterator[DequantizeSpy]:
    spy = DequantizeSpy()
    undo: list = []

    def patch(owner, name, replacement):
        had = name in vars(owner)
        old = vars(owner)[name] if had else None
        setattr(owner, name, replacement)
        undo.append((owner, name, had, old))

    fallback = vars(QuantizedTensor)["_dequant_and_fallback"].__func__

    def spy_fallback(cls, func, args, kwargs):
        spy.calls.append(f"QuantizedTensor._dequant_and_fallback({func})")
        return fallback(cls, func, args, kwargs)

    method = QuantizedTensor.dequantize

    def spy_method(self):
        spy.calls.append(f"QuantizedTensor.dequantize({self._layout_cls})")
        return method(self)

    patch(QuantizedTensor, "_dequant_and_fallback", classmethod(spy_fallback))
    patch(QuantizedTensor, "dequantize", spy_method)
    for layout in {codec.spec.layout for codec in FORMATS.values()} | {"TensorCoreFP8Layout"}:
        cls = get_layout_class(layout)
        original = cls.dequantize.__func__

        def spy_layout(kls, qdata, params, _original=original, _name=layout):
            spy.calls.append(f"{_name}.dequantize")
            return _original(kls, qdata, params)

        patch(cls, "dequantize", classmethod(spy_layout))
    for owner in _lowbit_dequantize_candidates():
        original = vars(owner)["_dequant"]

        def spy_candidate(self, *args, _original=original, _name=owner.__qualname__, **kwargs):
            spy.calls.append(f"{_name}._dequant")
            return _original(self, *args, **kwargs)

        patch(owner, "_dequant", spy_candidate)
    for module, name in _kitchen_eager_dequantizers():
        original = getattr(module, name)

        def spy_kernel(*args, _original=original, _name=name, **kwargs):
            spy.calls.append(f"eager.{_name}")
            return _original(*args, **kwargs)

        patch(module, name, spy_kernel)
    try:
        yield spy
    finally:
        for owner, name, had, old in reversed(undo):
            if had:
                setattr(owner, name, old)
            else:
                delattr(owner, name)
