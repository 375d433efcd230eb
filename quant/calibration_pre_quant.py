"""SmoothQuant ``pre_quant_scale``: which layers may carry it, its value, and its stored forms.

ComfyUI's checkpoint form has a per-layer ``<layer>.pre_quant_scale`` (``[K]``): the layer runs
``linear(x * pre_quant_scale, W_stored)`` with the multiply in the input's dtype (stock
``MixedPrecisionOps.Linear.forward``; LowBit's Linear does the same), so with
``W_stored = W diag(1 / pre_quant_scale)`` the float function is unchanged while activation outlier
channels shrink before they are quantized.

**Who may carry it.** A file is only safe when every loader that can open it applies the scale:

* LowBit's own formats (``FormatSpec.stock_loadable`` false, ``comfy_quant`` formats
  ``lowbit_*``): only LowBit loads them, and LowBit applies it. Always allowed.
* Native formats: only when the running ComfyUI's loader reads ``pre_quant_scale`` for that
  ``comfy_quant`` format (its ``QUANT_ALGOS[format]["parameters"]``). Stock ComfyUI 0.30 lists it
  for ``nvfp4`` only, which LowBit does not write, so none of LowBit's native formats (int8,
  int8_convrot, fp8, w4a4, w4a8) gets it there: stock would drop the scale and run the smoothed
  weight on unscaled inputs. The node layer detects the set; this module is told it
  (``native_formats``) and never imports ComfyUI.

**Its value.** ``1 / s`` with SmoothQuant's ``s`` (``calibration_measure.smoothing_scale``),
rounded to the dtype it is stored in, *before* the weight is divided by it, so the stored weight
and the scale the runtime multiplies by agree exactly. It is stored in the model's compute dtype
(bf16 by default), as ModelOpt / TensorRT-LLM checkpoints store it and as the runtime applies it.

**In a policy file** it is kept per layer as ``{"dtype": "bfloat16", "base64": ...}`` (the raw
little-endian values), so applying a saved policy writes the very same scale.
"""

from __future__ import annotations

import base64
from typing import Mapping

import torch

from .calibration_measure import smoothing_scale
from .errors import PolicyError
from .formats import get_format

PRE_QUANT_SCALE = "pre_quant_scale"
FLOAT = "float"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def carries_pre_quant_scale(fmt: str, native_formats: frozenset[str] | set[str] = frozenset()) -> bool:
    """Whether a layer of LowBit format ``fmt`` may be written with a ``pre_quant_scale``.

    ``native_formats``: the ``comfy_quant`` formats whose loader in the running ComfyUI applies
    ``pre_quant_scale`` (see the module docstring); LowBit's own formats carry it regardless.
    """
    if fmt == FLOAT:
        return False
    spec = get_format(fmt).spec
    return not spec.stock_loadable or spec.native_format in native_formats


def pre_quant_scale(channel_amax: torch.Tensor, weight: torch.Tensor, alpha: float,
                    dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The ``[K]`` ``pre_quant_scale`` for SmoothQuant strength ``alpha``, rounded to ``dtype``."""
    return (1.0 / smoothing_scale(channel_amax, weight, alpha)).to(dtype)


def check_pre_quant_scale(layer: str, scale: torch.Tensor, in_features: int) -> torch.Tensor:
    """``scale`` when it is a finite, positive ``[in_features]`` float vector, else a :class:`PolicyError`."""
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point() or tuple(scale.shape) != (in_features,):
        found = f"{type(scale).__name__} {tuple(getattr(scale, 'shape', ()))} {getattr(scale, 'dtype', '')}"
        raise PolicyError(f"layer {layer!r}: pre_quant_scale must be a float vector of the layer's {in_features} "
                          f"input features, found {found}; recalibrate the policy for this model")
    if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        raise PolicyError(f"layer {layer!r}: pre_quant_scale has zero, negative or non-finite values; recalibrate")
    return scale


def pre_quant_entry(layer: str, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """The native ``<layer>.pre_quant_scale`` checkpoint entry (CPU, contiguous, in its own dtype)."""
    return {f"{layer}.{PRE_QUANT_SCALE}": scale.detach().to("cpu").contiguous()}


def encode_scale(scale: torch.Tensor) -> dict:
    """The policy-file form of a scale (exact: its raw values, base64)."""
    names = {v: k for k, v in _DTYPES.items()}
    if scale.dtype not in names:
        raise PolicyError(f"pre_quant_scale dtype must be one of {', '.join(_DTYPES)}, got {scale.dtype}")
    raw = scale.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
    return {"dtype": names[scale.dtype], "base64": base64.b64encode(raw).decode("ascii")}


def decode_scale(layer: str, data: Mapping) -> torch.Tensor:
    """The scale :func:`encode_scale` wrote, or a :class:`PolicyError` saying what is wrong."""
    try:
        dtype = _DTYPES[data["dtype"]]
        raw = bytearray(base64.b64decode(data["base64"], validate=True))
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).clone()
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise PolicyError(f"policy file: pre_quant_scale of layer {layer!r} is malformed ({err!r}); expected "
                          f"{{'dtype': one of {', '.join(_DTYPES)}, 'base64': the raw values}}") from None


__all__ = ["PRE_QUANT_SCALE", "carries_pre_quant_scale", "check_pre_quant_scale", "decode_scale", "encode_scale",
           "pre_quant_entry", "pre_quant_scale"]
