"""Shared helpers for the checkpoint IO and converter tests."""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import sys
from pathlib import Path

import pytest
import torch

from lowbit.quant.demo import TinyFluxConfig

# Small enough that every format (w4a8's codebook search is slow on CPU) converts in seconds,
# large enough that every layer kind of Flux and the 256-wide 4-bit formats are exercised.
SMALL_FLUX = TinyFluxConfig(hidden_size=256, depth=1, depth_single_blocks=1, mlp_ratio=2.0)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (any dtype, 0-d included), for bit-exact comparison."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert tuple(a.shape) == tuple(b.shape), f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert torch.equal(bits(a), bits(b)), f"{what}: bytes differ"


def assert_state_dicts_bit_equal(a: dict, b: dict, what: str) -> None:
    assert sorted(a) == sorted(b), f"{what}: keys differ: {sorted(set(a) ^ set(b))[:10]}"
    for key in a:
        assert_bit_equal(a[key], b[key], f"{what}[{key}]")


def assert_qt_bit_equal(a, b, what: str) -> None:
    """Two kitchen QuantizedTensors hold the same layout, bytes and params."""
    assert a._layout_cls == b._layout_cls, f"{what}: layout {a._layout_cls} != {b._layout_cls}"
    assert_bit_equal(a._qdata, b._qdata, f"{what}.qdata")
    assert type(a._params) is type(b._params), f"{what}: params type differs"
    for f in dataclasses.fields(a._params):
        x, y = getattr(a._params, f.name), getattr(b._params, f.name)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert x is not None and y is not None, f"{what}.{f.name}: one side is None"
            assert_bit_equal(x, y, f"{what}.{f.name}")
        else:
            assert x == y, f"{what}.{f.name}: {x!r} != {y!r}"


def write_raw_safetensors(path: Path, header: dict, data: bytes, *, header_len: int | None = None) -> Path:
    """A safetensors-shaped file with exactly this header and data (to build broken files)."""
    raw = json.dumps(header).encode("utf-8")
    path.write_bytes(struct.pack("<Q", len(raw) if header_len is None else header_len) + raw + data)
    return path


def leftovers(folder: Path) -> list[str]:
    """Temp files a writer may have left in ``folder``."""
    return sorted(name for name in os.listdir(folder) if name.endswith(".tmp"))


def comfyui_root() -> Path | None:
    root = Path(os.environ.get("COMFYUI_PATH") or os.path.expanduser("~/ComfyUI"))
    return root if (root / "comfy" / "utils.py").is_file() else None


def comfy_utils():
    """ComfyUI's ``comfy.utils`` (CPU mode), or skip the test when ComfyUI is not installed."""
    root = comfyui_root()
    if root is None:
        pytest.skip("ComfyUI not found: set COMFYUI_PATH or install it at ~/ComfyUI")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    import comfy.utils

    return comfy.utils
