"""Attention backend choice: the fastest scaled-dot-product attention for each shape, measured.

PyTorch's SDPA has several exact backends (cuDNN, FlashAttention-2, memory-efficient, math) and
the fastest differs by GPU and shape. ComfyUI 0.30 asks for FlashAttention first. On an H200 at
Flux 1024x1024 shapes (1 x 24 heads x 4608 tokens x 128) cuDNN runs 1.84x faster than flash
(0.43 vs 0.78 ms per call, ``tests/gpu/bench_attention.py``), so attention is about a quarter of a
Flux step that it need not be.

:class:`AttentionChooser` times every candidate on the first call of a shape (the call's real
inputs, outside ``torch.compile`` tracing and CUDA-graph capture) and keeps the fastest. The
candidates are the caller's own attention (``"comfy"``: whatever ComfyUI picked), each SDPA
backend, and, only when :attr:`AttentionConfig.allow_lossy` is set, comfy-kitchen's INT8 attention
(kitchen >= 0.2.30 on a GPU it supports; 1.6-3.1 % error and slower than cuDNN on the H200).
A candidate that raises (a backend that cannot run these inputs) is recorded and skipped.

Nothing here imports ComfyUI; ``nodes/attention.py`` adapts ComfyUI's attention call to it.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)

#: SDPA backends by name, in the order used when nothing was measured
SDPA_BACKENDS = ("cudnn", "flash", "efficient", "math")
LOSSY_BACKENDS = ("kitchen_int8",)
#: what a config may name: ``auto`` (measured), ``comfy`` (the caller's own attention) or one candidate
BACKEND_CHOICES = ("auto", "comfy") + SDPA_BACKENDS + LOSSY_BACKENDS


class AttentionConfigError(ValueError):
    """An attention setting that cannot be used; the message says what is allowed."""


def _sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend

    return {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[name]


@dataclass(frozen=True)
class AttentionConfig:
    """``backend``: ``auto`` measures the candidates per shape; any other name runs that one
    (falling back to the caller's attention, with one warning, where it cannot run).
    ``allow_lossy``: let ``auto`` consider comfy-kitchen's INT8 attention (not exact).
    ``repeats``: timed calls per candidate when measuring (median)."""

    backend: str = "auto"
    allow_lossy: bool = False
    repeats: int = 3

    def __post_init__(self):
        if self.backend not in BACKEND_CHOICES:
            raise AttentionConfigError(f"attention backend {self.backend!r} is not one of {', '.join(BACKEND_CHOICES)}")
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or not 1 <= self.repeats <= 50:
            raise AttentionConfigError(f"attention repeats must be an integer from 1 to 50, got {self.repeats!r}")

    def candidate_names(self) -> tuple[str, ...]:
        if self.backend != "auto":
            return (self.backend,)
        return ("comfy",) + SDPA_BACKENDS + (LOSSY_BACKENDS if self.allow_lossy else ())


def kitchen_int8_attention() -> Callable | None:
    """comfy-kitchen's INT8 attention where this install has it and the GPU can run it, else None."""
    try:
        import comfy_kitchen as ck
    except ImportError:
        return None
    fn = getattr(ck, "int8_attention", None)
    available = getattr(ck, "int8_attention_is_available", None)
    if fn is None or available is None:
        return None
    try:
        return fn if available() else None
    except Exception:  # a kitchen that cannot probe the device: treat as unavailable
        return None


def sdpa(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
         **extra) -> torch.Tensor:
    """Attention on ``[B, H, S, D]`` tensors with one named backend (an SDPA backend or ``kitchen_int8``)."""
    if name == "kitchen_int8":
        fn = kitchen_int8_attention()
        if fn is None:
            raise RuntimeError("comfy-kitchen INT8 attention is not available (needs comfy-kitchen >= 0.2.30 "
                               "and a GPU it supports)")
        if extra.get("enable_gqa"):
            raise RuntimeError("kitchen_int8 takes grouped K/V heads natively; enable_gqa is not passed")
        return fn(q, k, v, scale=extra.get("scale"), attn_mask=attn_mask)
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel([_sdpa_backend(name)]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=False, **extra)


def sdpa_priority(first: str | None, q, k, v, attn_mask=None, **extra) -> torch.Tensor:
    """SDPA with ``first`` tried first, then the others in :data:`SDPA_BACKENDS` order (compile-safe)."""
    from torch.nn.attention import sdpa_kernel

    order = ([first] if first in SDPA_BACKENDS else []) + [b for b in SDPA_BACKENDS if b != first]
    with sdpa_kernel([_sdpa_backend(b) for b in order], set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=False, **extra)


def _bucket(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@functools.lru_cache(maxsize=16)
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def shape_key(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None) -> tuple:
    """What a decision is kept for: device (and capability), dtype, batch, heads, token buckets, head dim, mask."""
    device = q.device
    cap = _capability(device.index) if device.type == "cuda" else None
    mask = None if attn_mask is None else (attn_mask.dtype, attn_mask.dim())
    return (device.type, cap, q.dtype, q.shape[0], q.shape[1], k.shape[1], _bucket(q.shape[2]), _bucket(k.shape[2]),
            q.shape[3], mask)


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of ``repeats`` calls after one warm-up (CUDA events on a GPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass
class AttentionChooser:
    """Measured choice per :func:`shape_key`, kept for the life of the object (one per model patch).

    ``decisions``: key -> candidate name; ``timings_s``: key -> {name: seconds}; ``failures``:
    key -> {name: error}; ``calls``: how many calls each candidate answered (for reports and tests).
    """

    config: AttentionConfig = field(default_factory=AttentionConfig)
    decisions: dict = field(default_factory=dict)
    timings_s: dict = field(default_factory=dict)
    failures: dict = field(default_factory=dict)
    calls: dict = field(default_factory=dict)
    _warned: set = field(default_factory=set)

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
            comfy: Callable[[], torch.Tensor], finish: Callable[[torch.Tensor], torch.Tensor], **extra) -> torch.Tensor:
        """Attention output in the caller's layout.

        ``comfy()`` runs the caller's own attention (already in its output layout); ``finish`` turns
        an SDPA ``[B, H, S, D]`` result into that layout. ``extra``: SDPA's ``scale`` / ``enable_gqa``.
        """
        def candidate(name: str) -> Callable[[], torch.Tensor]:
            if name == "comfy":
                return comfy
            return lambda: finish(sdpa(name, q, k, v, attn_mask, **extra))

        backend = self.config.backend
        if _is_compiling() or _capturing(q.device):
            # Nothing is measured or looked up per shape while tracing or capturing: a lookup would
            # guard the compiled graph on the token count (a recompile per resolution). SDPA runs with
            # the configured backend first (cuDNN for auto), the others behind it.
            if backend == "auto" or backend in SDPA_BACKENDS:
                self._count("priority")
                return finish(sdpa_priority("cudnn" if backend == "auto" else backend, q, k, v, attn_mask, **extra))
            return self._run_fixed(backend, candidate, comfy, None)
        key = shape_key(q, k, attn_mask)
        name = self.decisions.get(key)
        if name is None:
            if backend != "auto":
                return self._run_fixed(backend, candidate, comfy, key)
            name = self._measure(key, self.config.candidate_names(), candidate, q.device)
        self._count(name)
        return candidate(name)()

    def _run_fixed(self, name, candidate, comfy, key):
        try:
            out = candidate(name)()
        except Exception as err:  # the named backend cannot run these inputs: ComfyUI's attention answers
            if (name, key) not in self._warned:
                self._warned.add((name, key))
                log.warning("LowBit attention: %s cannot run this call (%s: %s); using ComfyUI's attention",
                            name, type(err).__name__, str(err).splitlines()[0][:200] if str(err) else "")
            if key is not None:
                self.failures.setdefault(key, {})[name] = f"{type(err).__name__}: {err}"[:300]
            self._count("comfy")
            return comfy()
        self._count(name)
        return out

    def _measure(self, key, names, candidate, device) -> str:
        timings, failures = {}, {}
        for name in names:
            try:
                timings[name] = _time(candidate(name), device, self.config.repeats)
            except Exception as err:  # a backend that cannot run these inputs is skipped
                failures[name] = f"{type(err).__name__}: {err}"[:300]
        if not timings:
            raise RuntimeError(f"no attention candidate could run: {failures}")
        best = min(timings, key=timings.get)
        self.decisions[key], self.timings_s[key], self.failures[key] = best, timings, failures
        log.info("LowBit attention: %s for %s (%s)", best, key[3:9],
                 ", ".join(f"{n} {t * 1e3:.3f} ms" for n, t in sorted(timings.items(), key=lambda kv: kv[1])))
        return best

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def report(self) -> list[dict]:
        """One row per measured shape: the choice and every candidate's time in ms."""
        return [{"key": str(key[3:]), "choice": name,
                 "ms": {n: round(t * 1e3, 4) for n, t in self.timings_s.get(key, {}).items()},
                 "failed": sorted(self.failures.get(key, {}))}
                for key, name in self.decisions.items()]


def candidates() -> dict[str, Callable]:
    """Every attention backend as ``fn(q, k, v)`` on ``[B, H, S, D]`` (for ``tests/gpu/bench_attention.py``)."""
    out = {name: (lambda q, k, v, _n=name: sdpa(_n, q, k, v)) for name in SDPA_BACKENDS if name != "math"}
    if kitchen_int8_attention() is not None:
        out["kitchen_int8"] = lambda q, k, v: sdpa("kitchen_int8", q, k, v)
    return out
