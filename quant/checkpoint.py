"""Quantized checkpoints on disk: read ComfyUI's native quantized form, write LowBit's.

Which layers are quantized, and how, is read the way ComfyUI reads it (``comfy.utils.convert_old_quants``):

1. ``<layer>.comfy_quant`` uint8 tensors holding the layer's JSON (``{"format": ...}``);
2. the header metadata ``_quantization_metadata`` (``{"format_version": ..., "layers": {layer: conf}}``),
   which takes precedence over (1) for the layers it names;
3. only when (2) is absent, the legacy scaled-FP8 form: a ``scaled_fp8`` marker tensor, FP8
   ``<layer>.weight`` with ``<layer>.scale_weight`` (read as ``weight_scale``) and optional
   ``<layer>.scale_input`` (read as ``input_scale``, dropped when it is 1.0). A two-element marker
   means ``full_precision_matrix_mult``.

:func:`load_quantized` rebuilds each quantized layer as a kitchen ``QuantizedTensor`` through the
format codecs; :func:`save_checkpoint` and :class:`CheckpointWriter` write standard safetensors
files (see ``safetensors_file.py``) that ``safetensors`` and ComfyUI read back bit for bit;
:func:`inspect_checkpoint` summarises a file per format.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Mapping

import torch
from comfy_kitchen.tensor import QuantizedTensor

from .errors import CheckpointFormatError, UnknownFormatError
from .formats import format_for_comfy_quant
from .native import COMFY_QUANT, decode_comfy_quant, load_layer
from .safetensors_file import (SafetensorsFile, SafetensorsWriter, TensorInfo, check_metadata, header_size_bound)

__all__ = [
    "CheckpointReader", "CheckpointWriter", "LayerQuant", "QuantizedCheckpoint", "CheckpointSummary",
    "LayerSummary", "FormatUsage", "open_checkpoint", "load_quantized", "save_checkpoint", "inspect_checkpoint",
    "lowbit_metadata", "QUANT_METADATA_KEY", "SCALED_FP8_MARKER", "TensorInfo",
]

QUANT_METADATA_KEY = "_quantization_metadata"
SCALED_FP8_MARKER = "scaled_fp8"
LOWBIT_VERSION_KEY = "lowbit_version"
LOWBIT_POLICY_KEY = "lowbit_policy"
LOWBIT_PLAN_KEY = "lowbit_plan"
_LEGACY_RENAMES = {"scale_weight": "weight_scale", "scale_input": "input_scale"}

CheckpointWriter = SafetensorsWriter


@dataclass(frozen=True)
class LayerQuant:
    """How one quantized layer is stored in a file."""

    layer: str
    conf: dict  # the layer's comfy_quant JSON object
    source: str  # "comfy_quant tensor", "header _quantization_metadata" or "legacy scaled_fp8"
    entries: dict[str, str] = field(default_factory=dict)  # suffix as ComfyUI names it -> key in the file


class CheckpointReader(SafetensorsFile):
    """A safetensors checkpoint opened lazily, plus where its quantized layers are.

    Everything :class:`SafetensorsFile` offers (keys, shapes, dtypes, per-tensor bytes, header
    ``metadata``, :meth:`read`), and :attr:`quant_layers`. Malformed quantization data raises
    :class:`CheckpointFormatError` naming the layer.
    """

    @cached_property
    def scaled_fp8_prefix(self) -> str | None:
        """The key prefix of a legacy scaled-FP8 file (``""`` or ``"model.diffusion_model."``...), else ``None``."""
        for key in self.tensors:
            if key == SCALED_FP8_MARKER or key.endswith("." + SCALED_FP8_MARKER):
                return key[: -len(SCALED_FP8_MARKER)]
        return None

    @cached_property
    def quant_layers(self) -> dict[str, LayerQuant]:
        """Every quantized layer, by layer name (the key prefix before ``.weight``)."""
        children = _children_by_layer(self.tensors)
        layers: dict[str, LayerQuant] = {}
        for key in self.tensors:
            if key.endswith("." + COMFY_QUANT):
                layer = key[: -len(COMFY_QUANT) - 1]
                conf = decode_comfy_quant(layer, self.read(key))
                layers[layer] = LayerQuant(layer, conf, "comfy_quant tensor", _entries(children.get(layer, {})))
        if QUANT_METADATA_KEY in self.metadata:
            for layer, conf in self._header_quant_layers().items():
                layers[layer] = LayerQuant(layer, conf, f"header {QUANT_METADATA_KEY}", _entries(children.get(layer, {})))
        elif self.scaled_fp8_prefix is not None:
            layers.update(self._legacy_layers(children))
        return layers

    def quant_configs(self) -> dict[str, dict]:
        """Each quantized layer's ``comfy_quant`` JSON object, by layer name."""
        return {layer: dict(q.conf) for layer, q in self.quant_layers.items()}

    @property
    def is_quantized(self) -> bool:
        return bool(self.quant_layers) or self.scaled_fp8_prefix is not None

    def _header_quant_layers(self) -> dict[str, dict]:
        raw = self.metadata[QUANT_METADATA_KEY]
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as err:
            raise CheckpointFormatError(
                f"{self.path}: header metadata {QUANT_METADATA_KEY!r} is not valid JSON ({err}): {raw[:80]!r}") from None
        layers = data.get("layers") if isinstance(data, dict) else None
        if not isinstance(layers, dict):
            raise CheckpointFormatError(
                f"{self.path}: header metadata {QUANT_METADATA_KEY!r} must be a JSON object with a 'layers' object "
                f"mapping layer names to their quantization config, found {raw[:120]!r}")
        for layer, conf in layers.items():
            if not isinstance(conf, dict) or not isinstance(conf.get("format"), str):
                raise CheckpointFormatError(
                    f"{self.path}: header {QUANT_METADATA_KEY!r}, layer {layer!r}: expected a JSON object with a "
                    f"string 'format', found {conf!r:.120}")
        return layers

    def _legacy_layers(self, children: Mapping[str, Mapping[str, str]]) -> dict[str, LayerQuant]:
        prefix = self.scaled_fp8_prefix
        full_precision = _numel(self.tensors[prefix + SCALED_FP8_MARKER].shape) == 2
        out = {}
        for key in self.tensors:
            if key.startswith(prefix) and key.endswith(".scale_weight"):
                layer = key[: -len(".scale_weight")]
                conf = {"format": "float8_e4m3fn"}
                if full_precision:
                    conf["full_precision_matrix_mult"] = True
                out[layer] = LayerQuant(layer, conf, "legacy scaled_fp8", _entries(children.get(layer, {}), legacy=True))
        return out


def open_checkpoint(path: str | os.PathLike) -> CheckpointReader:
    """Open ``path`` for lazy reading (header validated, no tensor read). Close it, or use ``with``."""
    return CheckpointReader(path)


def _children_by_layer(tensors: Mapping[str, TensorInfo]) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for key in tensors:
        layer, _, suffix = key.rpartition(".")
        if layer:
            out.setdefault(layer, {})[suffix] = key
    return out


def _entries(children: Mapping[str, str], legacy: bool = False) -> dict[str, str]:
    out = {}
    for suffix, key in children.items():
        if suffix == COMFY_QUANT:
            continue
        out[_LEGACY_RENAMES.get(suffix, suffix) if legacy else suffix] = key
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---- loading --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class QuantizedCheckpoint:
    """A checkpoint loaded into memory: quantized layers rebuilt, every other tensor as stored."""

    layers: dict[str, QuantizedTensor]  # layer name -> weight
    formats: dict[str, str]  # layer name -> LowBit format name
    tensors: dict[str, torch.Tensor]  # every other entry (biases, norms, input_scale, float weights...)
    metadata: dict[str, str]


def load_quantized(path: str | os.PathLike, compute_dtype: torch.dtype = torch.bfloat16) -> QuantizedCheckpoint:
    """Read a checkpoint, rebuilding each quantized layer through its format codec.

    Legacy scaled-FP8 entries are renamed as ComfyUI renames them (``scale_weight`` ->
    ``weight_scale``, ``scale_input`` -> ``input_scale``; a unit ``scale_input`` and the marker are
    dropped). Raises :class:`CheckpointFormatError` naming the file and layer for an unknown format
    or malformed data.
    """
    with open_checkpoint(path) as reader:
        quant = reader.quant_layers
        consumed: set[str] = set()
        layers, formats = {}, {}
        for layer, info in quant.items():
            try:
                codec = format_for_comfy_quant(info.conf)
            except UnknownFormatError as err:
                raise CheckpointFormatError(f"{reader.path}: layer {layer!r} ({info.source}): {err}") from None
            keys = {suffix: info.entries[suffix] for suffix in codec.tensor_keys if suffix in info.entries}
            try:
                _, qt = load_layer(layer, {suffix: reader.read(key) for suffix, key in keys.items()}, info.conf,
                                   compute_dtype)
            except CheckpointFormatError as err:
                raise CheckpointFormatError(f"{reader.path}: {err} (quantization config from {info.source})") from None
            layers[layer], formats[layer] = qt, codec.spec.name
            consumed.update(keys.values())
        tensors = {}
        legacy = reader.scaled_fp8_prefix if QUANT_METADATA_KEY not in reader.metadata else None
        for key in reader.tensors:
            if key in consumed or key.endswith("." + COMFY_QUANT):
                continue
            if legacy is not None:
                if key == legacy + SCALED_FP8_MARKER:
                    continue
                if key.startswith(legacy) and key.endswith(".scale_input"):
                    value = reader.read(key)
                    if value.numel() == 1 and float(value.float().reshape(())) == 1.0:
                        continue  # ComfyUI drops unit input scales
                    tensors[key[: -len("scale_input")] + "input_scale"] = value
                    continue
            tensors[key] = reader.read(key)
        return QuantizedCheckpoint(layers, formats, tensors, dict(reader.metadata))


# ---- writing --------------------------------------------------------------------------------------

def save_checkpoint(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike, metadata: Mapping[str, str] | None = None,
                    overwrite: bool = False, protect=()) -> Path:
    """Write ``tensors`` as a safetensors file, atomically (see :class:`SafetensorsWriter`)."""
    reserve = header_size_bound(((k, tuple(v.shape)) for k, v in tensors.items()), check_metadata(metadata))
    with CheckpointWriter(path, metadata=metadata, overwrite=overwrite, protect=protect, header_reserve=reserve) as writer:
        writer.update(tensors)
    return Path(path)


def lowbit_metadata(source_metadata: Mapping[str, str], policy, plan) -> dict[str, str]:
    """Header metadata of a converted file: the source's, minus stale quantization keys, plus LowBit's."""
    from .. import __version__

    out = {k: v for k, v in source_metadata.items()
           if k != QUANT_METADATA_KEY and k not in (LOWBIT_VERSION_KEY, LOWBIT_POLICY_KEY, LOWBIT_PLAN_KEY)}
    out[LOWBIT_VERSION_KEY] = str(__version__)
    out[LOWBIT_POLICY_KEY] = json.dumps(policy.to_dict(), sort_keys=True)
    out[LOWBIT_PLAN_KEY] = json.dumps({"mode": plan.mode, "preset": plan.preset, "layers": plan.counts()}, sort_keys=True)
    return out


# ---- inspecting -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class LayerSummary:
    name: str
    format: str  # LowBit format name, "float", or "<native format> (unsupported)"
    stored_shape: tuple[int, ...]  # shape of the stored weight (4-bit formats pack two values a byte)
    bytes: int  # the weight plus its scales and comfy_quant


@dataclass(frozen=True)
class FormatUsage:
    format: str
    layers: int
    bytes: int


@dataclass(frozen=True)
class CheckpointSummary:
    """Per-format layer counts and bytes of a checkpoint (float layers counted as ``float``)."""

    path: Path
    file_bytes: int
    tensor_count: int
    metadata: dict[str, str]
    layers: tuple[LayerSummary, ...]  # every quantized layer and every float weight of 2+ dims
    other_bytes: int  # biases, norms and any other tensors

    @property
    def formats(self) -> tuple[FormatUsage, ...]:
        usage: dict[str, list[int]] = {}
        for layer in self.layers:
            slot = usage.setdefault(layer.format, [0, 0])
            slot[0] += 1
            slot[1] += layer.bytes
        return tuple(FormatUsage(fmt, n, b) for fmt, (n, b) in sorted(usage.items()))

    def counts(self) -> dict[str, int]:
        return {u.format: u.layers for u in self.formats}

    def table(self) -> str:
        lines = [f"{self.path}: {self.file_bytes / 2**20:.1f} MiB, {self.tensor_count} tensors",
                 f"{'format':<24} {'layers':>7} {'MiB':>10}"]
        for u in self.formats:
            lines.append(f"{u.format:<24} {u.layers:>7} {u.bytes / 2**20:>10.2f}")
        lines.append(f"{'other tensors':<24} {'':>7} {self.other_bytes / 2**20:>10.2f}")
        return "\n".join(lines)


def inspect_checkpoint(path: str | os.PathLike) -> CheckpointSummary:
    """Summarise ``path`` from its header (and the small ``comfy_quant`` tensors); reads no weight."""
    with open_checkpoint(path) as reader:
        quant = reader.quant_layers
        counted: set[str] = set()
        layers = []
        for layer, info in quant.items():
            try:
                fmt = format_for_comfy_quant(info.conf).spec.name
            except UnknownFormatError:
                fmt = f"{info.conf['format']} (unsupported)"
            keys = set(info.entries.values()) | ({f"{layer}.{COMFY_QUANT}"} & set(reader.tensors))
            keys.discard(f"{layer}.bias")
            counted |= keys
            weight = reader.tensors.get(info.entries.get("weight", ""))
            layers.append(LayerSummary(layer, fmt, weight.shape if weight is not None else (),
                                       sum(reader.nbytes(k) for k in keys)))
        for key, tensor_info in reader.tensors.items():
            if key in counted or not key.endswith(".weight") or len(tensor_info.shape) < 2:
                continue
            counted.add(key)
            layers.append(LayerSummary(key[: -len(".weight")], "float", tensor_info.shape, tensor_info.nbytes))
        other = sum(info.nbytes for key, info in reader.tensors.items() if key not in counted)
        return CheckpointSummary(reader.path, reader.file_size, len(reader.tensors), dict(reader.metadata),
                                 tuple(layers), other)
