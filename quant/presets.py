"""Architecture presets: data files in ``presets/`` (one JSON object each), and auto-detection.

A preset file (``presets/<name>.json``; the file stem must equal ``name``)::

    {
      "name": "flux1", "version": 1, "description": "...", "notes": "...",
      "comfy_classes": ["Flux", "FluxSchnell", "comfy.ldm.flux.model.Flux"],
      "detect": {"all": ["img_in.weight", ["a.weight", "a.scale"]], "none": ["..."],
                 "shapes": {"head.head.weight": [192, null]}},
      "priority": 0,
      "keep_float": ["^img_in$", ...],          # regular expressions on layer names
      "int4_sensitive": ["txt_mod", ...]        # ranked: first patterns get INT8 first in int4_mixed
    }

Layer and key names are the diffusion model's own state-dict names, as ComfyUI's ``UNETLoader``
sees them: a ``model.diffusion_model.`` style prefix is stripped first (:func:`model_prefix`).

**Key fingerprints** (``detect``, one object or a list of alternative objects): every ``all``
entry must be present (an entry that is a list is satisfied by any one of its keys, e.g. the
``.weight``/``.scale`` spellings of a norm), no ``none`` key may be present, and every ``shapes``
key must be present with that shape (``null`` matches any size). A fingerprint with ``shapes``
never matches when only key names are known. They are taken from ComfyUI's own
``comfy/model_detection.py`` so that LowBit and ComfyUI agree on what a checkpoint is. When
several presets match, the higher ``priority`` wins, then the longer ``all`` list.

**ComfyUI classes** (``comfy_classes``): a bare name is a ``comfy.supported_models`` class (the
model's ``model_config``), a dotted name is a fully qualified class (e.g. the diffusion model's
``comfy.ldm.flux.model.Flux``). :func:`detect_preset_from_classes` uses them before the keys, and
takes plain strings, so nothing here imports ComfyUI.

When nothing matches, the ``generic`` preset is used and a warning names what was seen.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from .errors import PolicyError

log = logging.getLogger(__name__)

PRESET_DIR = Path(__file__).resolve().parent.parent / "presets"
PRESET_VERSION = 1
GENERIC = "generic"
#: prefixes a whole state dict may carry in front of the diffusion model's own keys
KNOWN_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "net.", "model.")
#: prefixes under which a full checkpoint (diffusion model + VAE + text encoders) keeps its diffusion model
CHECKPOINT_PREFIXES = ("model.diffusion_model.", "net.")
SUPPORTED_MODELS_MODULE = "comfy.supported_models"

Shape = tuple[int, ...]
ShapePattern = tuple["int | None", ...]


@dataclass(frozen=True)
class Fingerprint:
    """One way to recognise an architecture from its state-dict keys (and optionally shapes)."""

    all: tuple[tuple[str, ...], ...] = ()  # each entry: alternatives, one of which must be present
    none: tuple[str, ...] = ()
    shapes: tuple[tuple[str, ShapePattern], ...] = ()

    def matches(self, names: Mapping[str, Shape | None]) -> bool:
        """Whether ``names`` (key → shape, ``None`` when unknown) fits this fingerprint."""
        if not self.all and not self.shapes:
            return False
        if not all(any(k in names for k in alternatives) for alternatives in self.all):
            return False
        if any(k in names for k in self.none):
            return False
        for key, pattern in self.shapes:
            shape = names.get(key)
            if shape is None or len(shape) != len(pattern):
                return False
            if any(want is not None and want != got for want, got in zip(pattern, shape)):
                return False
        return True

    def to_dict(self) -> dict:
        out: dict[str, Any] = {}
        if self.all:
            out["all"] = [alts[0] if len(alts) == 1 else list(alts) for alts in self.all]
        if self.none:
            out["none"] = list(self.none)
        if self.shapes:
            out["shapes"] = {k: list(v) for k, v in self.shapes}
        return out


@dataclass(frozen=True)
class Preset:
    """A validated preset (see the module docstring for the file format)."""

    name: str
    description: str = ""
    notes: str = ""
    keep_float: tuple[str, ...] = ()
    int4_sensitive: tuple[str, ...] = ()
    detect: tuple[Fingerprint, ...] = ()
    comfy_classes: tuple[str, ...] = ()
    priority: int = 0
    version: int = PRESET_VERSION

    KEYS = ("name", "version", "description", "notes", "comfy_classes", "detect", "priority",
            "keep_float", "int4_sensitive")

    @classmethod
    def from_dict(cls, data: Mapping, source: str = "<dict>") -> "Preset":
        """Validate ``data`` (a preset file's JSON); a :class:`PolicyError` says what is wrong and where."""
        where = f"preset {source}"
        if not isinstance(data, Mapping) or not isinstance(data.get("name"), str) or not data["name"]:
            raise PolicyError(f"{where}: expected a JSON object with a non-empty string 'name', found {_short(data)}")
        if data.get("version", PRESET_VERSION) != PRESET_VERSION:
            raise PolicyError(f"{where}: version {data.get('version')!r} is not supported (this LowBit reads "
                              f"version {PRESET_VERSION}); update LowBit or rewrite the preset")
        unknown = set(data) - set(cls.KEYS)
        if unknown:
            raise PolicyError(f"{where}: unknown keys {sorted(unknown)}; known keys: {list(cls.KEYS)}")
        notes = data.get("notes", "")
        if isinstance(notes, list) and all(isinstance(n, str) for n in notes):
            notes = " ".join(notes)
        if not isinstance(notes, str):
            raise PolicyError(f"{where}: 'notes' must be a string or a list of strings, found {_short(notes)}")
        keep_float = _strings(data.get("keep_float", []), f"{where}: 'keep_float'")
        int4_sensitive = _strings(data.get("int4_sensitive", []), f"{where}: 'int4_sensitive'")
        for field_name, patterns in (("keep_float", keep_float), ("int4_sensitive", int4_sensitive)):
            for pattern in patterns:
                try:
                    re.compile(pattern)
                except re.error as err:
                    raise PolicyError(f"{where}: {field_name} pattern {pattern!r} is not a valid regular "
                                      f"expression: {err}") from None
        priority = data.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise PolicyError(f"{where}: 'priority' must be an integer, found {_short(priority)}")
        description = data.get("description", "")
        if not isinstance(description, str):
            raise PolicyError(f"{where}: 'description' must be a string, found {_short(description)}")
        detect = data.get("detect", [])
        detect = [detect] if isinstance(detect, Mapping) else detect
        if not isinstance(detect, list):
            raise PolicyError(f"{where}: 'detect' must be an object or a list of objects, found {_short(detect)}")
        return cls(
            name=data["name"], description=description, notes=notes,
            keep_float=keep_float, int4_sensitive=int4_sensitive,
            detect=tuple(_fingerprint(fp, f"{where}: detect[{i}]") for i, fp in enumerate(detect)),
            comfy_classes=_strings(data.get("comfy_classes", []), f"{where}: 'comfy_classes'"),
            priority=priority,
        )

    def to_dict(self) -> dict:
        """The preset's JSON form; ``Preset.from_dict(p.to_dict()) == p``."""
        detect = [fp.to_dict() for fp in self.detect]
        return {
            "name": self.name, "version": self.version, "description": self.description, "notes": self.notes,
            "comfy_classes": list(self.comfy_classes),
            "detect": detect[0] if len(detect) == 1 else detect,
            "priority": self.priority,
            "keep_float": list(self.keep_float), "int4_sensitive": list(self.int4_sensitive),
        }

    def matches(self, names: Mapping[str, Shape | None] | Iterable[str]) -> bool:
        """Whether any of this preset's fingerprints fits ``names`` (prefix already stripped)."""
        if not isinstance(names, Mapping):
            names = dict.fromkeys(names)
        return any(fp.matches(names) for fp in self.detect)

    def claims_class(self, class_name: str) -> bool:
        """Whether ``class_name`` (bare or qualified) is one of this preset's ComfyUI classes."""
        return any(_class_matches(entry, class_name) for entry in self.comfy_classes)

    @property
    def _rank(self) -> tuple[int, int]:
        return (self.priority, max((len(fp.all) + len(fp.shapes) for fp in self.detect), default=0))


# ---- loading --------------------------------------------------------------------------------

def load_preset_file(path: Path) -> Preset:
    """Read and validate one preset file; its ``name`` must equal the file stem."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise PolicyError(f"preset file {Path(path).name} is not valid JSON: {err}") from None
    preset = Preset.from_dict(data, source=Path(path).name)
    if preset.name != Path(path).stem:
        raise PolicyError(f"preset file {Path(path).name}: 'name' is {preset.name!r} but must equal the file "
                          f"name {Path(path).stem!r}; rename the file or fix the name")
    return preset


@functools.lru_cache(maxsize=1)
def _load_all() -> dict[str, Preset]:
    presets = {}
    for path in sorted(PRESET_DIR.glob("*.json")):
        preset = load_preset_file(path)
        presets[preset.name] = preset
    if GENERIC not in presets:
        presets[GENERIC] = Preset(GENERIC, "no architecture detected: conservative defaults")
    return presets


def preset_names() -> tuple[str, ...]:
    return tuple(_load_all())


def all_presets() -> tuple[Preset, ...]:
    return tuple(_load_all().values())


def get_preset(name: str) -> Preset:
    presets = _load_all()
    if name not in presets:
        raise PolicyError(f"unknown preset {name!r}; known presets: auto, {', '.join(presets)}")
    return presets[name]


# ---- key names ------------------------------------------------------------------------------

def model_prefix(keys: Iterable[str]) -> str:
    """The prefix in front of the diffusion model's own keys (``""`` when there is none).

    Every key carrying one of :data:`KNOWN_PREFIXES` means a prefixed diffusion model; otherwise a
    full checkpoint keeps its diffusion model under ``model.diffusion_model.`` (or ``net.``) next
    to VAE and text-encoder keys, and that prefix is returned when more than 5 keys carry it (as
    ComfyUI's ``unet_prefix_from_state_dict`` decides).
    """
    keys = list(keys)
    if not keys:
        return ""
    for prefix in KNOWN_PREFIXES:
        if all(k.startswith(prefix) for k in keys):
            return prefix
    counts = {p: sum(k.startswith(p) for k in keys) for p in CHECKPOINT_PREFIXES}
    best = max(counts, key=counts.get)
    return best if counts[best] > 5 else ""


def model_names(keys: Mapping[str, Any] | Iterable[str]) -> dict[str, Shape | None]:
    """The diffusion model's keys with the prefix stripped, each with its shape (``None`` if unknown).

    ``keys`` is a state dict (tensors), a key → shape mapping, or just key names. Keys outside the
    diffusion model's prefix (a full checkpoint's VAE or text encoders) are left out.
    """
    if isinstance(keys, Mapping):
        items = [(k, _shape_of(v)) for k, v in keys.items()]
    else:
        items = [(k, None) for k in keys]
    prefix = model_prefix(k for k, _ in items)
    return {k[len(prefix):]: shape for k, shape in items if k.startswith(prefix)}


def strip_prefix(keys: Iterable[str]) -> set[str]:
    """The diffusion model's key names without their common prefix (see :func:`model_names`)."""
    return set(model_names(list(keys)))


# ---- detection ------------------------------------------------------------------------------

def matching_presets(keys: Mapping[str, Any] | Iterable[str]) -> tuple[Preset, ...]:
    """Every preset whose fingerprint fits ``keys``, best first (priority, then fingerprint size)."""
    return _matching(model_names(keys))


def detect_preset(keys: Mapping[str, Any] | Iterable[str]) -> Preset:
    """The preset whose fingerprint fits ``keys``, else ``generic`` with a warning.

    ``keys`` is a state dict, a key → shape mapping, or key names; with shapes, fingerprints that
    need them (Wan 2.2 versus Wan 2.1, say) can match too.
    """
    return _detect(model_names(keys))


def _matching(names: Mapping[str, Shape | None]) -> tuple[Preset, ...]:
    matches = [p for p in _load_all().values() if p.matches(names)]
    return tuple(sorted(matches, key=lambda p: p._rank, reverse=True))


def _detect(names: Mapping[str, Shape | None], classes: Sequence[str] = ()) -> Preset:
    """The best preset by key fingerprint; ``classes``: the ComfyUI classes seen first (none claimed by
    a preset), named in the warning when the keys match no preset either."""
    matches = _matching(names)
    if matches:
        if len(matches) > 1 and matches[0]._rank == matches[1]._rank:
            log.warning("LowBit: presets %s all match this model equally; using %r",
                        [p.name for p in matches], matches[0].name)
        return matches[0]
    sample = ", ".join(sorted(names)[:8])
    seen = f"ComfyUI class(es) {', '.join(classes)}, which no preset claims; " if classes else ""
    log.warning("LowBit: no preset matches this model (%s%d keys, e.g. %s ...); using the conservative "
                "'generic' policy. Pick a preset by name if you know the architecture.", seen, len(names), sample)
    return get_preset(GENERIC)


def preset_for_model_class(class_name: str, keys: Mapping[str, Any] | Iterable[str] | None = None) -> Preset | None:
    """The one preset that claims the ComfyUI class ``class_name``, or ``None``.

    ``None`` when no preset claims it, or when several do (``Flux2``: Flux.2 dev or klein) and
    ``keys`` (when given) do not single one out; callers then fall back to :func:`detect_preset`.
    """
    claimed = _claimants(class_name)
    if len(claimed) > 1 and keys is not None:
        names = model_names(keys)
        claimed = [p for p in claimed if p.matches(names)]
    return claimed[0] if len(claimed) == 1 else None


def detect_preset_from_classes(class_names: Iterable[str], keys: Mapping[str, Any] | Iterable[str] | None = None) -> Preset:
    """The preset for a ComfyUI model known by its class names, with key fingerprints as fallback.

    ``class_names`` are plain strings, most specific first, e.g.
    ``[f"{type(m.model_config).__module__}.{type(m.model_config).__qualname__}",
    f"{type(m.diffusion_model).__module__}.{type(m.diffusion_model).__qualname__}"]`` for a
    ComfyUI ``BaseModel`` ``m``; a bare name is taken as a ``comfy.supported_models`` class. The
    first name that some preset claims decides; when several presets claim it (``Flux2`` is
    Flux.2 dev or klein), ``keys`` choose among them. When no preset claims any name, this is
    :func:`detect_preset` on ``keys`` (or ``generic`` with a warning when there are no keys).
    """
    class_names = [c for c in class_names if c]
    names = model_names(keys) if keys is not None else None
    for class_name in class_names:
        claimed = _claimants(class_name)
        if not claimed:
            continue
        if len(claimed) == 1:
            chosen = claimed[0]
        else:
            fitting = [p for p in claimed if names is not None and p.matches(names)]
            pool = fitting or claimed
            chosen = max(pool, key=lambda p: p._rank)
            if not fitting:
                log.info("LowBit: %s could be presets %s and the keys do not decide; using %r",
                         class_name, [p.name for p in claimed], chosen.name)
        if names is not None:
            by_keys = _matching(names)
            if by_keys and chosen not in by_keys:
                log.info("LowBit: ComfyUI class %s gives preset %r; the key fingerprint suggests %r",
                         class_name, chosen.name, by_keys[0].name)
        return chosen
    if names is not None:
        return _detect(names, class_names)
    log.warning("LowBit: no preset claims the ComfyUI classes %s and no keys were given; using the "
                "conservative 'generic' policy", class_names)
    return get_preset(GENERIC)


def _claimants(class_name: str) -> list[Preset]:
    return [p for p in _load_all().values() if p.claims_class(class_name)]


# ---- helpers --------------------------------------------------------------------------------

def _class_matches(entry: str, class_name: str) -> bool:
    if "." in entry:
        return class_name == entry
    return class_name in (entry, f"{SUPPORTED_MODELS_MODULE}.{entry}")


def _shape_of(value: Any) -> Shape | None:
    shape = value.shape if hasattr(value, "shape") else value  # a tensor, or a shape already
    if isinstance(shape, (tuple, list)) and all(isinstance(d, int) for d in shape):
        return tuple(int(d) for d in shape)
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _strings(value: Any, what: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise PolicyError(f"{what} must be a list of non-empty strings, found {_short(value)}")
    return tuple(value)


def _fingerprint(data: Any, where: str) -> Fingerprint:
    if not isinstance(data, Mapping):
        raise PolicyError(f"{where} must be an object with 'all'/'none'/'shapes', found {_short(data)}")
    unknown = set(data) - {"all", "none", "shapes"}
    if unknown:
        raise PolicyError(f"{where}: unknown keys {sorted(unknown)}; known keys: all, none, shapes")
    entries = data.get("all", [])
    if not isinstance(entries, list):
        raise PolicyError(f"{where}: 'all' must be a list, found {_short(entries)}")
    all_keys = []
    for entry in entries:
        alternatives = [entry] if isinstance(entry, str) else entry
        all_keys.append(_strings(alternatives, f"{where}: 'all' entry"))
    shapes = data.get("shapes", {})
    if not isinstance(shapes, Mapping):
        raise PolicyError(f"{where}: 'shapes' must map keys to shapes, found {_short(shapes)}")
    shape_items = []
    for key, pattern in shapes.items():
        if (not isinstance(pattern, list) or not pattern
                or not all(d is None or (isinstance(d, int) and not isinstance(d, bool) and d > 0) for d in pattern)):
            raise PolicyError(f"{where}: shape of {key!r} must be a list of positive integers or null, "
                              f"found {_short(pattern)}")
        shape_items.append((key, tuple(pattern)))
    fingerprint = Fingerprint(tuple(all_keys), _strings(data.get("none", []), f"{where}: 'none'"), tuple(shape_items))
    if not fingerprint.all and not fingerprint.shapes:
        raise PolicyError(f"{where}: a fingerprint needs at least one 'all' key or 'shapes' entry")
    return fingerprint
