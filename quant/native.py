"""The native per-layer checkpoint form, exactly as ComfyUI writes it.

For a quantized layer ``<layer>``: ``<layer>.comfy_quant`` is a uint8 tensor holding UTF-8 JSON
(``{"format": ...}`` plus format options), next to the layout's tensors (``<layer>.weight``,
``<layer>.weight_scale``, ...).
"""

from __future__ import annotations

import functools
import json
from typing import Mapping

import torch
from comfy_kitchen.tensor import QuantizedTensor

from .errors import CheckpointFormatError
from .formats import FormatCodec, format_for_comfy_quant

COMFY_QUANT = "comfy_quant"


def encode_comfy_quant(conf: Mapping) -> torch.Tensor:
    return torch.tensor(list(json.dumps(dict(conf)).encode("utf-8")), dtype=torch.uint8)


def decode_comfy_quant(layer: str, tensor: torch.Tensor) -> dict:
    """Parse a ``comfy_quant`` tensor, or raise a :class:`CheckpointFormatError` naming the layer."""
    if tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise CheckpointFormatError(
            f"{layer}.comfy_quant must be a 1-D uint8 tensor of JSON bytes, found {tensor.dtype} {tuple(tensor.shape)}")
    raw = tensor.cpu().numpy().tobytes()
    try:
        conf = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointFormatError(f"{layer}.comfy_quant is not valid JSON ({err}): {raw[:80]!r}") from None
    if not isinstance(conf, dict) or not isinstance(conf.get("format"), str):
        raise CheckpointFormatError(f"{layer}.comfy_quant must be a JSON object with a string 'format', got {conf!r}")
    return conf


def layer_tensors(codec: FormatCodec, layer: str, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
    """All checkpoint entries of one quantized layer: its tensors and its ``comfy_quant``."""
    out = {f"{layer}.{suffix}": t for suffix, t in codec.state_dict(qt).items()}
    out[f"{layer}.{COMFY_QUANT}"] = encode_comfy_quant(codec.comfy_quant(qt))
    return out


def load_layer(layer: str, entries: Mapping[str, torch.Tensor], conf: Mapping,
               compute_dtype: torch.dtype = torch.bfloat16) -> tuple[FormatCodec, QuantizedTensor]:
    """Rebuild a quantized weight from its entries (keys relative to the layer: ``weight``, ...)."""
    try:
        codec = format_for_comfy_quant(conf)
    except ValueError as err:
        raise CheckpointFormatError(f"layer {layer!r}: {err}") from None
    return codec, codec.from_state_dict(layer, entries, conf, compute_dtype)


def layer_bytes(fmt: str, shape: tuple[int, ...]) -> int:
    """Exact bytes a ``[N, K]`` weight takes stored in format ``fmt``: its tensors plus its ``comfy_quant``."""
    n, k = (int(d) for d in shape)
    fixed, per_row = _bytes_per_row(fmt, k)
    return fixed + per_row * n


@functools.lru_cache(maxsize=None)
def _bytes_per_row(fmt: str, in_features: int) -> tuple[int, int]:
    """Stored bytes are affine in the row count (per-row data plus fixed parts): measure two row counts."""
    from .formats import get_format

    codec = get_format(fmt)
    rows = 16 * codec.spec.out_features_multiple
    generator = torch.Generator().manual_seed(0)
    sizes = []
    for n in (rows, 2 * rows):
        qt = codec.quantize(torch.randn(n, in_features, generator=generator), compute_dtype=torch.bfloat16)
        sizes.append(sum(t.numel() * t.element_size() for t in layer_tensors(codec, "layer", qt).values()))
    per_row = (sizes[1] - sizes[0]) // rows
    return sizes[0] - per_row * rows, per_row
