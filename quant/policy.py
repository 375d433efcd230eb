"""Per-layer policy: which layer gets which format.

A :class:`Policy` (mode + preset + options, frozen and validated) applied to the layers of a model
gives a :class:`Plan`: one :class:`LayerDecision` per weight, printable and testable without a
model. Precedence, first match wins:

1. not a 2-D ``*.weight``                      → kept as stored (biases, norms, embeddings...);
   in a full checkpoint, a key outside the diffusion model (VAE, text encoders) → kept as stored
2. named in ``layer_formats``                   → that format, or float for ``"float"`` (a calibrated
   policy, see ``quant/calibrate.py``: the most specific rule wins over 3-5)
3. matches a preset ``keep_float`` pattern     → float
4. smaller than ``min_features`` on either side → float
5. mode ``int4_mixed``: inside the INT8 budget  → ``int8_convrot`` (see below), else ``w4a4``
   mode ``int4_full``: ``w4a4``; any other mode: that format
6. the chosen format cannot take the shape     → its fallback chain (``w4a4`` → ``int8_convrot`` → ``int8``),
   the reason recorded as ``fallback <from> -> <to>: <why each could not> [<why <from> was chosen>]``

Patterns (``keep_float``, ``int4_sensitive``) and ``layer_formats`` names match the layer name relative to the diffusion model
(``model.diffusion_model.`` style prefixes stripped, see :func:`presets.model_prefix`), so
presets anchor them with ``^``; plans and decisions keep the full names.

The ``int4_mixed`` INT8 budget: layers are ranked (preset ``int4_sensitive`` patterns first, in
pattern order, then the first and last blocks of each block list (``double_blocks``,
``single_blocks``, ``layers``...) before the middle ones); the top of the
ranking takes INT8 while that keeps the INT8 share of quantized parameters nearest to ``int4_mixed_ratio``. The ranking
does not depend on the ratio, so lowering the ratio only removes INT8 layers.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Iterable, Mapping

from .errors import PolicyError, UnknownFormatError
from .formats import FORMATS, fallback_chain
from .layouts.w4a4_convrot import SCALE_CHOICES as W4A4_SCALE_CHOICES
from .presets import Preset, get_preset, model_prefix

POLICY_VERSION = 1
INT4_MODES = ("int4_mixed", "int4_full")
INT4_FORMAT = "w4a4"
INT4_MIXED_INT8_FORMAT = "int8_convrot"
FLOAT = "float"  # a ``layer_formats`` value: keep the layer in float


def all_modes() -> tuple[str, ...]:
    """Every mode a user can pick: each format, plus the 4-bit mixes."""
    return (*FORMATS, *INT4_MODES)


@dataclass(frozen=True)
class LayerDecision:
    """What the plan does with one weight."""

    name: str  # layer prefix, e.g. ``double_blocks.0.img_attn.qkv``
    shape: tuple[int, ...]
    format: str | None  # ``None``: stays float
    reason: str

    @property
    def params(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Plan:
    """The result of applying a policy to a model's layers."""

    mode: str
    preset: str
    layers: tuple[LayerDecision, ...]

    def format_of(self, name: str) -> str | None:
        for layer in self.layers:
            if layer.name == name:
                return layer.format
        return None

    @property
    def quantized(self) -> tuple[LayerDecision, ...]:
        return tuple(layer for layer in self.layers if layer.format is not None)

    def counts(self) -> dict[str, int]:
        """Layers per format (``float`` for kept layers)."""
        out: dict[str, int] = {}
        for layer in self.layers:
            key = layer.format or "float"
            out[key] = out.get(key, 0) + 1
        return out

    def fallbacks(self) -> tuple[LayerDecision, ...]:
        return tuple(layer for layer in self.layers if layer.reason.startswith("fallback"))

    def table(self) -> str:
        """A printable per-layer table."""
        width = max([len(layer.name) for layer in self.layers] + [5])
        lines = [f"plan: mode={self.mode} preset={self.preset}",
                 f"{'layer':<{width}}  {'shape':<14}  {'format':<14}  reason"]
        for layer in self.layers:
            shape = "x".join(str(d) for d in layer.shape)
            lines.append(f"{layer.name:<{width}}  {shape:<14}  {layer.format or 'float':<14}  {layer.reason}")
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(self.counts().items()))
        lines.append(f"layers per format: {counts}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Policy:
    """How to choose a format per layer. Validates itself; round-trips through :meth:`to_dict`."""

    mode: str = "int8_convrot"
    preset: str = "auto"  # a preset name, or "auto" to detect from the layer names
    int4_mixed_ratio: float = 0.2
    min_features: int = 32
    extra_keep_float: tuple[str, ...] = ()  # user patterns added to the preset's
    #: per-layer overrides (layer name relative to the diffusion model -> format name or "float"),
    #: kept as sorted ``(name, format)`` pairs so the policy stays hashable; a mapping is accepted
    layer_formats: tuple[tuple[str, str], ...] = ()
    #: how ``w4a4`` weights' row scales are chosen: ``"mse"`` searched per row (less error), ``"absmax"``
    #: comfy-kitchen's own quantizer, bit for bit (``docs/formats.md``, "w4a4 weight scales")
    w4a4_scales: str = "mse"
    version: int = POLICY_VERSION

    def __post_init__(self):
        if self.mode not in all_modes():
            raise UnknownFormatError(f"unknown mode {self.mode!r}; known modes: {', '.join(all_modes())}")
        ratio = self.int4_mixed_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
            raise PolicyError(f"int4_mixed_ratio is the share of quantized weights kept in INT8 in int4_mixed mode: "
                              f"a number from 0 to 1, got {ratio!r}")
        if isinstance(self.min_features, bool) or not isinstance(self.min_features, int) or self.min_features < 1:
            raise PolicyError(f"min_features must be an integer of at least 1 (layers with fewer input or output "
                              f"features stay float), got {self.min_features!r}")
        if not isinstance(self.preset, str):
            raise PolicyError(f"preset must be a preset name or 'auto', got {self.preset!r}")
        if self.preset != "auto":
            get_preset(self.preset)  # an unknown name raises, listing the known presets
        if self.w4a4_scales not in W4A4_SCALE_CHOICES:
            raise PolicyError(f"w4a4_scales must be one of {', '.join(W4A4_SCALE_CHOICES)} (how w4a4 weights' row "
                              f"scales are chosen), got {self.w4a4_scales!r}")
        if self.version != POLICY_VERSION:
            raise PolicyError(f"policy version {self.version} is not supported (this LowBit reads version {POLICY_VERSION})")
        object.__setattr__(self, "extra_keep_float", tuple(self.extra_keep_float))
        for pattern in self.extra_keep_float:
            compile_pattern(pattern, "extra_keep_float")
        object.__setattr__(self, "layer_formats", _layer_formats(self.layer_formats))

    @property
    def layer_format_map(self) -> dict[str, str]:
        """``layer_formats`` as a dict (layer name -> format name or ``"float"``)."""
        return dict(self.layer_formats)

    def codec_options(self, fmt: str) -> dict[str, object]:
        """The keyword options of format ``fmt``'s ``codec.quantize`` that this policy sets for every layer
        of that format (per-layer options, such as calibrated outlier channels, are added by the caller)."""
        return {"scales": self.w4a4_scales} if fmt == INT4_FORMAT else {}

    def to_dict(self) -> dict:
        out = {**dataclasses.asdict(self), "extra_keep_float": list(self.extra_keep_float)}
        if self.layer_formats:
            out["layer_formats"] = self.layer_format_map
        else:
            del out["layer_formats"]  # absent unless set: uncalibrated policies keep their old form
        return out

    @classmethod
    def from_dict(cls, data: Mapping) -> "Policy":
        check_known_keys(cls, data, "policy")
        return cls(**{k: (tuple(v) if k == "extra_keep_float" else v) for k, v in data.items()})

    def resolve_preset(self, layer_names: Iterable[str]) -> Preset:
        from .presets import detect_preset

        return detect_preset(layer_names) if self.preset == "auto" else get_preset(self.preset)

    def plan(self, shapes: Mapping[str, tuple[int, ...]], preset: Preset | None = None) -> Plan:
        """Decide every layer. ``shapes`` maps state-dict keys (``<layer>.weight``...) to shapes."""
        preset = preset or self.resolve_preset(shapes)
        keep = [compile_pattern(p, "keep_float") for p in (*preset.keep_float, *self.extra_keep_float)]
        overrides = self.layer_format_map
        prefix = model_prefix(shapes)
        decisions: dict[str, LayerDecision] = {}
        candidates: list[str] = []
        overridden: list[str] = []  # named in layer_formats: no mode rule, but the fallback chain
        for key, shape in shapes.items():
            if not key.endswith(".weight") or len(shape) != 2:
                continue
            name = key[: -len(".weight")]
            shape = tuple(int(d) for d in shape)
            if not name.startswith(prefix):
                decisions[name] = LayerDecision(name, shape, None, f"outside the diffusion model (prefix {prefix!r})")
                continue
            override = overrides.get(name[len(prefix):])
            hit = next((p.pattern for p in keep if p.search(name[len(prefix):])), None)
            if override == FLOAT:
                decisions[name] = LayerDecision(name, shape, None, "layer_formats: float")
            elif override is not None:
                decisions[name] = LayerDecision(name, shape, override, "layer_formats")
                overridden.append(name)
            elif hit is not None:
                decisions[name] = LayerDecision(name, shape, None, f"keep_float pattern {hit!r}")
            elif min(shape) < self.min_features:
                decisions[name] = LayerDecision(name, shape, None, f"smaller than min_features={self.min_features}")
            else:
                candidates.append(name)
                decisions[name] = LayerDecision(name, shape, self.mode, "mode")
        if self.mode == "int4_mixed":
            int8_layers = _int8_budget(candidates, decisions, preset, self.int4_mixed_ratio, prefix)
            for name in candidates:
                d = decisions[name]
                if name in int8_layers:
                    decisions[name] = dataclasses.replace(d, format=INT4_MIXED_INT8_FORMAT, reason=int8_layers[name])
                else:
                    decisions[name] = dataclasses.replace(d, format=INT4_FORMAT, reason="int4_mixed: 4-bit")
        elif self.mode == "int4_full":
            for name in candidates:
                decisions[name] = dataclasses.replace(decisions[name], format=INT4_FORMAT, reason="int4_full")
        for name in (*candidates, *overridden):
            d = decisions[name]
            try:
                codec, reasons = fallback_chain(d.format, d.shape)
            except ValueError as err:
                decisions[name] = dataclasses.replace(d, format=None, reason=f"no format takes this shape: {err}")
                continue
            if reasons:
                decisions[name] = dataclasses.replace(
                    d, format=codec.spec.name,
                    reason=f"fallback {d.format} -> {codec.spec.name}: {'; '.join(reasons)} [{d.reason}]")
        return Plan(mode=self.mode, preset=preset.name, layers=tuple(decisions.values()))


def _layer_formats(value) -> tuple[tuple[str, str], ...]:
    """Validate ``layer_formats`` (a mapping or ``(name, format)`` pairs) into sorted pairs."""
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        items = [tuple(p) for p in value]
    else:
        raise PolicyError(f"layer_formats must map layer names to format names (a JSON object), got {value!r:.80}")
    allowed = (*FORMATS, FLOAT)
    for name, fmt in items:
        if not isinstance(name, str) or not name:
            raise PolicyError(f"layer_formats: layer names must be non-empty strings, got {name!r}")
        if fmt not in allowed:
            raise PolicyError(f"layer_formats: layer {name!r} has format {fmt!r}; expected one of "
                              f"{', '.join(allowed)}")
    if len({name for name, _ in items}) != len(items):
        raise PolicyError("layer_formats names a layer twice")
    return tuple(sorted(items))


def compile_pattern(pattern: str, what: str) -> re.Pattern:
    """``pattern`` compiled; a :class:`PolicyError` naming ``what`` (the option it came from) if it is not one."""
    try:
        return re.compile(pattern)
    except re.error as err:
        raise PolicyError(f"{what} pattern {pattern!r} is not a valid regular expression: {err}") from None


_BLOCK_INDEX = re.compile(r"(?:^|\.)(?:[a-z0-9_]*blocks|layers)\.(?:block)?(\d+)\.")


def _block_position(name: str) -> tuple[str, int] | None:
    """``(block list, index)`` of the first block list in ``name``: ``single_blocks.7.linear1`` → ``("single_blocks", 7)``."""
    m = _BLOCK_INDEX.search(name)
    if m is None:
        return None
    return name[: m.start(1)], int(m.group(1))


def _sensitivity_rank(names: list[str], preset: Preset, prefix: str = "") -> list[tuple[str, str]]:
    """Layers from most to least sensitive, each with the reason; independent of the budget.

    Layers matching an ``int4_sensitive`` pattern come first, in pattern order; within a pattern,
    and among the other layers, a block nearer the start or end of its own block list comes
    first (Flux's last double block counts as an edge although single blocks follow it); layers
    outside any block list rank with the edge blocks. Ties go by layer name in natural order
    (``blocks.2`` before ``blocks.10``), so the plan never depends on the order of the keys.
    """
    sensitive = [compile_pattern(p, "int4_sensitive") for p in preset.int4_sensitive]
    relative = {name: name[len(prefix):] if name.startswith(prefix) else name for name in names}
    positions = {name: _block_position(relative[name]) for name in names}
    last: dict[str, int] = {}
    for pos in positions.values():
        if pos is not None:
            last[pos[0]] = max(last.get(pos[0], 0), pos[1])
    hits = {name: next((i for i, p in enumerate(sensitive) if p.search(relative[name])), None) for name in names}

    def key(name):
        hit, pos = hits[name], positions[name]
        edge = min(pos[1], last[pos[0]] - pos[1]) if pos is not None else 0  # distance from the first/last block
        return (0 if hit is not None else 1, hit if hit is not None else 0, edge, _natural(relative[name]))

    out = []
    for name in sorted(names, key=key):
        hit, pos = hits[name], positions[name]
        if hit is not None:
            why = f"int4_sensitive {sensitive[hit].pattern!r}"
        elif pos is not None:
            why = f"{min(pos[1], last[pos[0]] - pos[1])} from the first/last of {pos[0].rstrip('.')}"
        else:
            why = "outside the block lists"
        out.append((name, f"int4_mixed: int8 budget ({why})"))
    return out


def _natural(name: str) -> tuple:
    """Sort key that orders digit runs numerically: ``blocks.2.x`` < ``blocks.10.x``."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name))


def _int8_budget(names: list[str], decisions: Mapping[str, LayerDecision], preset: Preset, ratio: float,
                 prefix: str = "") -> dict[str, str]:
    total = sum(decisions[n].params for n in names)
    budget = ratio * total
    chosen: dict[str, str] = {}
    used = 0
    for name, reason in _sensitivity_rank(names, preset, prefix):
        size = decisions[name].params
        if used + size / 2 > budget:
            break  # a prefix of a fixed ranking: a smaller ratio gives a subset (nearest fill, no skipping)
        chosen[name] = reason
        used += size
    return chosen


def check_known_keys(cls: type, data: Mapping, what: str) -> None:
    """Raise :class:`PolicyError` naming any key of ``data`` that is not a field of dataclass ``cls``."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise PolicyError(f"unknown {what} keys {sorted(unknown)}; known keys: {sorted(known)}")
