"""Architecture presets: data files in ``presets/`` (one JSON object each), and auto-detection.

A preset file::

    {
      "name": "flux1", "version": 1, "description": "...",
      "detect": {"all": ["double_blocks.0.img_attn.qkv.weight"], "none": ["..."]},
      "keep_float": ["^img_in$", ...],          # regular expressions on layer names
      "int4_sensitive": ["txt_mod", ...]        # ranked: first patterns get INT8 first in int4_mixed
    }

``detect.all`` keys must all be present and ``detect.none`` keys absent (after stripping a common
``model.diffusion_model.`` style prefix); ``priority`` breaks ties (higher first). When nothing
matches, the ``generic`` preset is used and a warning names the keys that were seen.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from .errors import PolicyError

log = logging.getLogger(__name__)

PRESET_DIR = Path(__file__).resolve().parent.parent / "presets"
PRESET_VERSION = 1
GENERIC = "generic"
KNOWN_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "model.")


@dataclass(frozen=True)
class Preset:
    name: str
    description: str = ""
    keep_float: tuple[str, ...] = ()
    int4_sensitive: tuple[str, ...] = ()
    detect_all: tuple[str, ...] = ()
    detect_none: tuple[str, ...] = ()
    priority: int = 0
    version: int = PRESET_VERSION

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>") -> "Preset":
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise PolicyError(f"preset {source}: expected a JSON object with a string 'name'")
        if data.get("version", PRESET_VERSION) != PRESET_VERSION:
            raise PolicyError(f"preset {source}: version {data.get('version')} is not supported (expected {PRESET_VERSION})")
        known = {"name", "description", "keep_float", "int4_sensitive", "detect", "priority", "version", "notes"}
        unknown = set(data) - known
        if unknown:
            raise PolicyError(f"preset {source}: unknown keys {sorted(unknown)}; known keys: {sorted(known)}")
        detect = data.get("detect", {}) or {}
        return cls(
            name=data["name"], description=data.get("description", ""),
            keep_float=tuple(data.get("keep_float", ())), int4_sensitive=tuple(data.get("int4_sensitive", ())),
            detect_all=tuple(detect.get("all", ())), detect_none=tuple(detect.get("none", ())),
            priority=int(data.get("priority", 0)),
        )

    def matches(self, keys: set[str]) -> bool:
        return bool(self.detect_all) and all(k in keys for k in self.detect_all) and not any(k in keys for k in self.detect_none)


@functools.lru_cache(maxsize=1)
def _load_all() -> dict[str, Preset]:
    presets = {}
    for path in sorted(PRESET_DIR.glob("*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as err:
            raise PolicyError(f"preset file {path.name} is not valid JSON: {err}") from None
        preset = Preset.from_dict(data, source=path.name)
        presets[preset.name] = preset
    if GENERIC not in presets:
        presets[GENERIC] = Preset(GENERIC, "no architecture detected: conservative defaults")
    return presets


def preset_names() -> tuple[str, ...]:
    return tuple(_load_all())


def get_preset(name: str) -> Preset:
    presets = _load_all()
    if name not in presets:
        raise PolicyError(f"unknown preset {name!r}; known presets: auto, {', '.join(presets)}")
    return presets[name]


def strip_prefix(keys: Iterable[str]) -> set[str]:
    keys = list(keys)
    for prefix in KNOWN_PREFIXES:
        if keys and all(k.startswith(prefix) for k in keys):
            return {k[len(prefix):] for k in keys}
    return set(keys)


def detect_preset(keys: Iterable[str]) -> Preset:
    """The preset whose fingerprint the state-dict ``keys`` match, else ``generic`` with a warning."""
    names = strip_prefix(keys)
    matches = [p for p in _load_all().values() if p.matches(names)]
    if matches:
        return max(matches, key=lambda p: (p.priority, len(p.detect_all)))
    sample = ", ".join(sorted(names)[:6])
    log.warning("LowBit: no preset matches this model (keys seen: %s ...); using the conservative 'generic' policy", sample)
    return get_preset(GENERIC)
