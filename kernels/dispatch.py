"""The measured dispatcher: per (format, GPU capability, M bucket, N, K), the fastest implementation.

A linear call offers its candidates – our Triton kernels (one per tile config), comfy-kitchen's
op, ``torch._int_mm``/``torch._scaled_mm``, dequantize + float matmul, the eager reference – as
named zero-argument callables. The first time a key is seen on a CUDA device every candidate is
timed on the call's real inputs (CUDA events, median of a few runs; through the candidate's steady-state
plan where the linear offers one, as the model's later steps run it) and the winner is remembered;
candidates within ``Dispatcher.tie`` of the fastest are then told apart by their GPU time alone
(below); decisions are written to a JSON file whose path the caller passes in (the ComfyUI node layer
passes ComfyUI's user directory), so later runs start with them. Candidates that fail record their
error instead of breaking the call.

Without CUDA (CPU, or the Triton interpreter), while a CUDA graph is being captured, or under
``torch.compile`` tracing, nothing is measured: the first candidate in the offered order runs
(the callers list a safe default first).

``force_backend`` (``kernels/backend.py``) narrows the candidates to one backend, for tests.

Steady state: once a call has been dispatched, the linear registers a *fast plan* for its
(format, pre-processing, M bucket, shapes, dtypes, device) in ``Dispatcher.fast_plans``; the next
identical call runs it through :func:`run_fast` without building candidate lists or key strings
(two Triton launches for the Triton decisions). Fast plans are used only with ``Backend.AUTO`` and
outside ``torch.compile`` tracing, and are dropped whenever the dispatcher changes a decision (code
that edits ``decisions`` by hand calls :meth:`Dispatcher.forget_fast_plans`).

Two timings. The *sustained* time is a few calls back to back behind a short GPU sleep, as a
model's forward pass queues them: where the CPU's launch cost exceeds the GPU time (few rows, in
eager mode) it is what the call costs, and every Triton config then costs about the same. The *GPU*
time is the same calls queued entirely behind a sleep that outlasts their launches: what a CUDA
graph (``torch.compile``'s ``reduce-overhead``) or a CPU that runs ahead pays. Among the candidates
whose sustained time is within ``tie`` (15 %) of the fastest, the one with the least GPU time wins,
so a host-bound tie is never settled by noise in favour of a config that leaves SMs idle. The fastest's
own backend's configs join that comparison within ``backend_tie`` (25 %): a host-bound call's sustained
time is mostly the full path's launch cost, which the configs of one backend share, so gaps that wide
among them can be noise (an H200 run, session 12: a split-K config slow on the GPU came first at 79 µs,
15 % ahead of three configs 20 % faster on the GPU). Not wider: a TMA config's descriptors cost it
20-40 % more sustained time there, a real cost in an eager model, and 50 % let them in.
Host noise only ever adds time, and it can double a host-bound reading (an H100 machine, Session 42: a W4 plan of
19 µs GPU time read 42 µs of sustained time in one run and 30-36 µs in another, where plans of its kind measured later
in the process read 21 µs). So before the ties are drawn, a candidate outside them but under ``1 + recheck`` (2x)
the fastest is measured once more and keeps the lesser reading. Candidates whose GPU times are within ``gpu_tie`` of
the least are then told apart by their sustained time: a TMA config 1 % faster on the GPU but 20 µs slower to launch
(its descriptors) loses. Where GPU times of different backends tie too (within ``gpu_tie``, 5 %, of the least: e.g.
few rows, a product bound by the weight's bytes), the backend with the least *host* time wins: the CPU time one call
takes to enqueue its work (measured as the candidate is called here, median of three batches). In an eager model
such a call is bound by its launches, so a candidate that converts its tensors per call (comfy-kitchen's DLPack
hand-off) loses to one that launches directly, at no GPU cost. Configs of one backend are not told apart this way:
they launch alike.

A candidate that fails because the GPU cannot run its configuration at all (Triton's
``OutOfResources``: too much shared memory) is recorded per GPU capability in ``broken`` (and the
JSON cache), and is not offered again on that GPU for any shape.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import torch

from .backend import Backend, BackendUnavailableError, active_backend, capability

log = logging.getLogger(__name__)

# 2 (session 12): candidates are timed through their steady-state plans, and split-K configs are offered at
# M <= 512; decisions made the old way are measured again once.
# 3 (session 20): 16-row tiles are offered at M <= 32.
# 4 (session 21): narrower tiles are offered at 17 <= M <= 512 (``gemm_config._ROW_BANDS``).
# 5 (session 33): calls of at most 16 rows on a GPU run weight-only (``dequant:<config>``, W8A16).
# An older file keeps its decisions for the M buckets whose candidates have not changed since it was written;
# those of the buckets in REMEASURED[its version] are measured again once.
CACHE_VERSION = 5
REMEASURED = {2: (16, 32, 64, 128, 256, 512), 3: (16, 32, 64, 128, 256, 512), 4: (16,)}
M_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_RESOURCE_ERRORS = ("OutOfResources", "out of resource")  # the configuration can never run on this GPU

_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)


def m_bucket(m: int) -> int:
    """Rows are bucketed to the next power of two (16 … 16384; larger M share one more bucket)."""
    if m <= M_BUCKETS[0]:
        return M_BUCKETS[0]
    if m > M_BUCKETS[-1]:
        return M_BUCKETS[-1] * 2
    return 1 << (m - 1).bit_length()


@dataclass(frozen=True)
class DispatchKey:
    fmt: str  # format + run-time variant, e.g. "int8", "int8+regular256", "fp8_rowwise", "w4a8"
    capability: tuple[int, int]
    m_bucket: int
    n: int
    k: int

    def as_str(self) -> str:
        return f"{self.fmt}|sm{self.capability[0]}{self.capability[1]}|m{self.m_bucket}|n{self.n}|k{self.k}"


def _cap_name(cap: tuple[int, int]) -> str:
    return f"sm{cap[0]}{cap[1]}"


def _family(fmt: str) -> str:
    """The kernel family of a dispatch format (``"int8+regular256"`` → ``"int8"``, ``"w4a4/a8"`` → ``"w4a4"``):
    a configuration too large for the GPU is too large for every variant of the family."""
    return fmt.split("+", 1)[0].split("/", 1)[0]


def backend_of(candidate: str) -> Backend:
    """``"triton:128x256x128-g8-w8-s3"`` → ``Backend.TRITON``; ``"kitchen"`` → ``Backend.KITCHEN``."""
    return Backend(candidate.split(":", 1)[0])


@dataclass
class Dispatcher:
    """Chooses among candidates by measurement and remembers the choice (optionally in a JSON file)."""

    cache_path: str | os.PathLike | None = None
    measure: bool = True
    warmup: int = 2
    repeats: int = 5
    tie: float = 0.15  # sustained times within this share of the fastest: the least GPU time wins
    backend_tie: float = 0.25  # the same for the fastest's own backend's configs, within this wider share
    gpu_tie: float = 0.05  # GPU times within this share of the least (of those): the least host time wins
    recheck: float = 1.0  # sustained times outside the ties but under (1 + this) x the fastest: measured twice
    decisions: dict[str, str] = field(default_factory=dict)
    timings_us: dict[str, dict[str, float]] = field(default_factory=dict)
    gpu_timings_us: dict[str, dict[str, float]] = field(default_factory=dict)  # the tied candidates only
    host_timings_us: dict[str, dict[str, float]] = field(default_factory=dict)  # the GPU-tied ones only
    failures: dict[str, dict[str, str]] = field(default_factory=dict)
    # "sm90" -> {"int8 triton:<config>": error}: what this GPU can never run (not offered again)
    broken: dict[str, dict[str, str]] = field(default_factory=dict)
    # W8A8 calls of at most 16 rows on a GPU compute weight-only (W8A16: the activation is not quantized; off:
    # they are quantized and dispatched as larger calls are, for comparisons)
    few_rows_weight_only: bool = True
    fast: bool = True  # register steady-state plans (off: every call takes the full path; for comparisons)
    fast_plans: dict[tuple, Callable] = field(default_factory=dict, repr=False)
    fast_hits: int = field(default=0, repr=False)
    # (key, implementation) of the last call that took the full path of run() (the Kernel Tuner node reads it)
    last_choice: tuple[str, str] | None = field(default=None, repr=False)

    def __post_init__(self):
        self._lock = threading.Lock()
        if self.cache_path is not None:
            self.cache_path = Path(self.cache_path).expanduser()
            self._load()

    def forget_fast_plans(self) -> None:
        """Drop every cached steady-state plan (after a decision changed)."""
        self.fast_plans.clear()

    def is_broken(self, key: DispatchKey, candidate: str) -> bool:
        """Whether ``candidate`` of ``key``'s format failed for lack of GPU resources on this capability."""
        entries = self.broken.get(_cap_name(key.capability))
        return bool(entries) and f"{_family(key.fmt)} {candidate}" in entries

    # ---- persistence ------------------------------------------------------------------------
    def _load(self) -> None:
        path = self.cache_path
        if not path.is_file():
            return
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            log.warning("LowBit kernel dispatch cache %s is unreadable (%s); measuring again", path, err)
            return
        if isinstance(data, dict) and data.get("version") in REMEASURED:
            buckets = REMEASURED[data["version"]]
            data = _without_buckets(data, buckets)
            log.info("LowBit kernel dispatch cache %s is from an older version: its choices for %d < M <= %d "
                     "are measured again (LowBit offers more kernels there now)", path,
                     _bucket_floor(min(buckets)), max(buckets))
        elif not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            log.info("LowBit kernel dispatch cache %s is from another version; measuring again", path)
            return
        self.decisions.update({str(k): str(v) for k, v in data.get("decisions", {}).items()})
        self.timings_us.update(data.get("timings_us", {}))
        self.gpu_timings_us.update(data.get("gpu_timings_us", {}))  # absent in older files
        self.host_timings_us.update(data.get("host_timings_us", {}))  # absent in older files
        for cap, entries in data.get("broken", {}).items():  # absent in files written before it existed
            if isinstance(entries, dict):
                self.broken.setdefault(str(cap), {}).update({str(k): str(v) for k, v in entries.items()})
        self.forget_fast_plans()

    def save(self) -> None:
        """Write the decisions (atomically) to ``cache_path``; a no-op without a path."""
        if self.cache_path is None:
            return
        data = {"version": CACHE_VERSION, "decisions": self.decisions, "timings_us": self.timings_us,
                "gpu_timings_us": self.gpu_timings_us, "host_timings_us": self.host_timings_us,
                "broken": self.broken}
        path = Path(self.cache_path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False) as tmp:
                json.dump(data, tmp, indent=1, sort_keys=True)
            os.replace(tmp.name, path)
        except OSError as err:
            log.warning("LowBit could not write its kernel dispatch cache %s: %s", path, err)

    # ---- choosing ---------------------------------------------------------------------------
    def choose(self, key: DispatchKey, candidates: Mapping[str, Callable[[], torch.Tensor]],
               device: torch.device) -> str:
        """The candidate to run for ``key``: cached, measured now, or the first offered."""
        names = [name for name in candidates if not self.is_broken(key, name)] or list(candidates)
        if not names:
            raise BackendUnavailableError(f"no implementation can run {key.as_str()}")
        text = key.as_str()
        cached = self.decisions.get(text)
        if cached in candidates:
            return cached
        if len(names) == 1 or not self._can_measure(device):
            return names[0]
        with self._lock:
            timings, failures = {}, {}
            for name in names:
                try:
                    timings[name] = _time_us(candidates[name], self.warmup, self.repeats)
                except Exception as err:  # a candidate that cannot run here is not a user error
                    failures[name] = f"{type(err).__name__}: {err}"[:300]
                    log.info("LowBit kernel candidate %s failed for %s: %s", name, text, failures[name])
                    if any(marker in failures[name] for marker in _RESOURCE_ERRORS):
                        broken = self.broken.setdefault(_cap_name(key.capability), {})
                        broken[f"{_family(key.fmt)} {name}"] = failures[name]
            if not timings:
                raise BackendUnavailableError(f"every implementation failed for {text}: {failures}")
            best, tied = self._tied(timings)
            again = [name for name in timings
                     if name not in tied and timings[name] < timings[best] * (1.0 + self.recheck)]
            for name in again:  # a second look: the lesser of two readings (host noise only ever adds time)
                try:
                    timings[name] = min(timings[name], _time_us(candidates[name], self.warmup, self.repeats))
                except Exception as err:  # it ran above: keep its first reading
                    log.info("LowBit kernel candidate %s: no second reading for %s (%s)", name, text, err)
            if again:
                best, tied = self._tied(timings)
            if len(tied) > 1:
                gpu = {}
                for name in tied:
                    try:
                        gpu[name] = _gpu_time_us(candidates[name], self.repeats)
                    except Exception as err:  # it ran above: keep its sustained time, skip the tie-break
                        log.info("LowBit kernel candidate %s: no GPU time for %s (%s)", name, text, err)
                if gpu:
                    least = min(gpu.values())  # GPU-tied with the least: the least sustained time of those
                    best = min((name for name in gpu if gpu[name] <= least * (1.0 + self.gpu_tie)), key=timings.get)
                    self.gpu_timings_us[text] = {k: round(v, 2) for k, v in gpu.items()}
                    best = self._least_host_time(text, candidates, gpu, best)
            if text in self.decisions:  # a changed decision: plans built on the old one must go
                self.forget_fast_plans()
            self.decisions[text] = best
            self.timings_us[text] = {k: round(v, 2) for k, v in timings.items()}
            if failures:
                self.failures[text] = failures
            log.info("LowBit kernel dispatch %s -> %s (%s)", text, best,
                     ", ".join(f"{k} {v:.1f}us" for k, v in sorted(timings.items(), key=lambda kv: kv[1])))
            self.save()
        return best

    def _tied(self, timings: dict[str, float]) -> tuple[str, list[str]]:
        """The fastest sustained time's candidate, and the candidates tied with it (``tie``, ``backend_tie``)."""
        best = min(timings, key=timings.get)
        family = best.split(":", 1)[0]
        limit, family_limit = timings[best] * (1.0 + self.tie), timings[best] * (1.0 + self.backend_tie)
        return best, [name for name in timings if timings[name] <= limit
                      or (name.split(":", 1)[0] == family and timings[name] <= family_limit)]

    def _least_host_time(self, text: str, candidates, gpu: dict[str, float], best: str) -> str:
        """Where candidates of another backend have a GPU time within ``gpu_tie`` of ``best``'s, the backend whose
        fastest such candidate takes the least host time per call, and that candidate; ``best`` otherwise (or
        where no host time could be taken). Configs of one backend launch alike (a Triton plan's replay costs the
        same whatever its tiles), so only backends are told apart by their host time."""
        fastest: dict[str, str] = {}  # backend ("triton", "kitchen", "torch"...) -> its least-GPU-time candidate
        for name in sorted(gpu, key=gpu.get):
            if gpu[name] <= gpu[best] * (1.0 + self.gpu_tie):
                fastest.setdefault(name.split(":", 1)[0], name)
        if len(fastest) < 2:
            return best
        host = {}
        for name in fastest.values():
            try:
                host[name] = _host_time_us(candidates[name], self.repeats)
            except Exception as err:  # it ran above: leave it out of the host tie-break
                log.info("LowBit kernel candidate %s: no host time for %s (%s)", name, text, err)
        if not host:
            return best
        self.host_timings_us[text] = {k: round(v, 2) for k, v in host.items()}
        return min(host, key=host.get)

    def _can_measure(self, device: torch.device) -> bool:
        if not self.measure or device.type != "cuda":
            return False
        if torch.cuda.is_current_stream_capturing():
            return False
        compiler = getattr(torch, "compiler", None)
        return not (compiler is not None and compiler.is_compiling())


def gpu_time_us(fn: Callable[[], torch.Tensor], warmup: int = 2, repeats: int = 10) -> float:
    """The GPU time per call of ``fn`` on a CUDA device, as the dispatcher's tie-break measures it
    (calls queued behind a sleep that outlasts their launches; see the module docstring)."""
    for _ in range(warmup):
        fn()
    return _gpu_time_us(fn, repeats)


def _time_us(fn: Callable[[], torch.Tensor], warmup: int, repeats: int) -> float:
    """Sustained time per call: ``repeats`` back-to-back calls behind a short GPU sleep, so the CPU
    queues work ahead as it does in a model's forward pass (launch overhead shows only where it
    exceeds the GPU time). Median of three such batches."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    return _median_batch_us(fn, repeats, 200_000)  # ~0.1 ms of GPU time for the CPU to get ahead


def _gpu_time_us(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    """GPU time per call: ``repeats`` calls queued entirely behind a GPU sleep that outlasts their
    launch cost (measured first), so none of the CPU's time shows. Median of three batches."""
    torch.cuda.synchronize()
    start_host = time.perf_counter()
    for _ in range(repeats):
        fn()
    host_us = (time.perf_counter() - start_host) * 1e6
    torch.cuda.synchronize()
    cycles = int(min(max(200_000, 4_000 * 2 * host_us), 2e8))  # twice the launch time at up to 4 GHz, <= ~0.1 s
    return _median_batch_us(fn, repeats, cycles)


def _host_time_us(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    """Host time per call: how long ``repeats`` calls take to return (their work enqueued) behind a GPU sleep
    long enough that the queue never makes the CPU wait. Median of three batches."""
    sleep = getattr(torch.cuda, "_sleep", None)
    batches = []
    for _ in range(3):
        torch.cuda.synchronize()
        if sleep is not None:
            sleep(20_000_000)  # ~10 ms at the GPU's clock: far more than a few calls' launches
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        batches.append((time.perf_counter() - start) * 1e6 / repeats)
    torch.cuda.synchronize()
    return statistics.median(batches)


def _median_batch_us(fn: Callable[[], torch.Tensor], repeats: int, sleep_cycles: int) -> float:
    """Median over three batches of the time per call of ``repeats`` calls queued behind a GPU sleep
    of ``sleep_cycles`` clock cycles (CUDA events)."""
    sleep = getattr(torch.cuda, "_sleep", None)
    batches = []
    for _ in range(3):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        if sleep is not None:
            sleep(sleep_cycles)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        end.synchronize()
        batches.append(start.elapsed_time(end) * 1000.0 / repeats)
    value = statistics.median(batches)
    if not math.isfinite(value):
        raise RuntimeError("non-finite timing")
    return value


_default = Dispatcher()
_current: list[Dispatcher] = []


def current_dispatcher() -> Dispatcher:
    """The dispatcher of the innermost :func:`use_dispatcher`, else the process default."""
    return _current[-1] if _current else _default


def install_dispatcher(dispatcher: Dispatcher) -> Dispatcher:
    """Make ``dispatcher`` the process default (the node layer does this once); returns the old one."""
    global _default
    old, _default = _default, dispatcher
    return old


@contextlib.contextmanager
def use_dispatcher(dispatcher: Dispatcher):
    """Use ``dispatcher`` for the calls inside the block (tests, benchmarks)."""
    _current.append(dispatcher)
    try:
        yield dispatcher
    finally:
        _current.pop()


def run_fast(fast_key: tuple, *args) -> torch.Tensor | None:
    """Run the steady-state plan registered for ``fast_key`` with ``args``; ``None`` when there is
    none (a forced backend, ``torch.compile`` tracing, a first call, or a plan that just failed and
    was dropped): the caller then takes the full path of :func:`run`."""
    if active_backend() is not Backend.AUTO or _is_compiling():
        return None
    dispatcher = _current[-1] if _current else _default
    plan = dispatcher.fast_plans.get(fast_key)
    if plan is None:
        return None
    try:
        out = plan(*args)
    except Exception as err:  # the full path decides again (and raises the user-facing error, if any)
        dispatcher.fast_plans.pop(fast_key, None)
        log.info("LowBit fast kernel plan %s failed (%s: %s); taking the full path",
                 fast_key[0], type(err).__name__, err)
        return None
    dispatcher.fast_hits += 1
    return out


def fast_plan(fast_key: tuple):
    """The steady-state plan registered for ``fast_key`` (``None``: none, a forced backend, or
    ``torch.compile`` tracing), for fused variants of a linear that run its settled plan on other inputs
    (``w8a8_linear.w8a8_prologue_linear``)."""
    if active_backend() is not Backend.AUTO or _is_compiling():
        return None
    dispatcher = _current[-1] if _current else _default
    return dispatcher.fast_plans.get(fast_key)


def _bucket_floor(bucket: int) -> int:
    """The largest M below ``bucket``'s rows (0 for the first bucket)."""
    lower = [b for b in M_BUCKETS if b < bucket]
    return max(lower) if lower else 0


def _without_buckets(data: dict, buckets: tuple[int, ...]) -> dict:
    """An older cache's entries without the keys of the M ``buckets`` (measured again)."""
    drop = tuple(f"|m{m}|" for m in buckets)
    kept = dict(data)
    for field_name in ("decisions", "timings_us", "gpu_timings_us", "host_timings_us"):
        entries = data.get(field_name, {})
        if isinstance(entries, dict):
            kept[field_name] = {k: v for k, v in entries.items() if not any(m in str(k) for m in drop)}
    return kept


def run(key_fmt: str, x2d: torch.Tensor, n: int, names: Callable[[], list[str]],
        make: Callable[[str], Callable[[], torch.Tensor]], reasons: Callable[[], Mapping[str, str]],
        fast_key: tuple | None = None, make_fast: Callable[[str], Callable | None] | None = None,
        fast_args: tuple | None = None) -> torch.Tensor:
    """Run the chosen implementation of a linear of ``x2d`` ``[M, K]`` → ``[M, n]``.

    ``names()`` lists the candidates that can run here, in default order (the first is used when
    nothing is measured); ``make(name)`` builds the zero-argument call of one; ``reasons()`` says
    why absent backends were left out (for the error when a forced backend cannot run).
    ``make_fast(name)``, when given, builds the steady-state plan of the chosen candidate, which is
    registered under ``fast_key`` for :func:`run_fast` once the choice is settled (a recorded
    decision, or a device on which nothing is measured). With ``fast_args`` too (the arguments
    :func:`run_fast` passes such a plan), a measurement times each candidate through its steady-state plan
    (``plan(*fast_args)``: after the warm-up calls, launch replays), so a host-bound call is weighed at what
    it costs a model's later steps, not at its first call's full path.
    """
    forced = active_backend()
    key = DispatchKey(key_fmt, capability(x2d.device), m_bucket(x2d.shape[0]), n, x2d.shape[1])
    dispatcher = current_dispatcher()
    if forced is Backend.AUTO:
        cached = dispatcher.decisions.get(key.as_str())
        if cached is not None:
            try:
                out = make(cached)()
            except Exception as err:  # e.g. a cache written on another install; measure again
                log.warning("LowBit cached kernel choice %s for %s failed (%s); choosing again",
                            cached, key.as_str(), err)
                dispatcher.decisions.pop(key.as_str(), None)
                dispatcher.forget_fast_plans()
            else:
                _register_fast(dispatcher, key, x2d.device, fast_key, make_fast, cached)
                dispatcher.last_choice = (key.as_str(), cached)
                return out
    available = names()
    if forced is not Backend.AUTO:
        available = [name for name in available if backend_of(name) is forced]
        if not available:
            why = reasons().get(forced.value, "it does not implement this format")
            raise BackendUnavailableError(f"backend {forced.value!r} was forced but cannot run {key_fmt}: {why}")
        if len(available) == 1 or not dispatcher._can_measure(x2d.device):
            return make(available[0])()
        return make(_choose_uncached(dispatcher, key, available, make, x2d.device))()
    name = dispatcher.choose(key, {name: _timed_call(name, make, make_fast, fast_args) for name in available},
                             x2d.device)
    out = make(name)()
    _register_fast(dispatcher, key, x2d.device, fast_key, make_fast, name)
    dispatcher.last_choice = (key.as_str(), name)
    return out


def _timed_call(name: str, make: Callable[[str], Callable[[], torch.Tensor]],
                make_fast: Callable[[str], Callable | None] | None, fast_args: tuple | None) -> Callable[[], torch.Tensor]:
    """The call the dispatcher times for candidate ``name``: its steady-state plan on ``fast_args`` where the
    caller offers both, else its full path."""
    plan = make_fast(name) if make_fast is not None and fast_args is not None else None
    if plan is None:
        return make(name)
    return lambda: plan(*fast_args)


def _register_fast(dispatcher: Dispatcher, key: DispatchKey, device: torch.device, fast_key: tuple | None,
                   make_fast: Callable[[str], Callable | None] | None, name: str) -> None:
    if fast_key is None or make_fast is None or not dispatcher.fast or _is_compiling():
        return
    settled = key.as_str() in dispatcher.decisions or not (dispatcher.measure and device.type == "cuda")
    if not settled:  # e.g. the first candidate ran unmeasured inside a CUDA-graph capture
        return
    plan = make_fast(name)
    if plan is not None:
        dispatcher.fast_plans[fast_key] = plan


def _choose_uncached(dispatcher: Dispatcher, key: DispatchKey, available: list[str],
                     make: Callable[[str], Callable[[], torch.Tensor]], device: torch.device) -> str:
    """Measure a forced backend's variants without recording them as the format's decision."""
    probe = Dispatcher(measure=dispatcher.measure, warmup=dispatcher.warmup, repeats=dispatcher.repeats,
                       broken=dispatcher.broken)
    return probe.choose(key, {name: make(name) for name in available}, device)
