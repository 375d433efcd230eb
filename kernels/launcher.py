"""Cheap repeated launches of a ``@triton.jit`` kernel: the compiled kernel cached per specialization.

``kernel[grid](*args)`` spends tens of microseconds of CPU time per call in Triton's own Python
(argument binding, specialization, the cache-key string, option parsing), more than the GPU
needs for a small linear. :class:`TritonLauncher` does that once per *specialization*: the first
call with a new key goes through ``kernel[grid]`` as usual (compiling if needed) and keeps the
:class:`CompiledKernel` it returns; later calls with the same key hand the arguments straight to
that kernel's launcher (``CompiledKernel.run``, the C function ``kernel[grid]`` ends in).

The key is conservative – it holds everything Triton specializes on, and more: every constexpr
value, the launch options, the current device, and per runtime argument: for tensors the dtype and
16-byte alignment, for integers (sizes, strides) and floats the value itself, for tensor
descriptors the base's dtype and alignment, the block shape, shape and strides. A key that is too
fine only costs an extra slow launch per new shape; it never runs a kernel compiled for other
assumptions. (Each argument position takes one type in LowBit's kernels, so an int ``1`` and a
float ``1.0`` never compete for one key.)

The fast path is feature-detected: it is used only when the object ``kernel[grid]`` returns has
``run``, ``function`` and ``packed_metadata`` (Triton 3.2 – 3.9), when no launch hooks are set
(profilers), and never in the CPU interpreter (``TRITON_INTERPRET=1``, where there is no compiled
kernel). If a fast launch raises, the launcher logs once, stops using the fast path for that kernel
and launches through ``kernel[grid]``. ``LOWBIT_TRITON_FAST_LAUNCH=0`` turns it off everywhere.

Every kernel is compiled with FP fusion on (``enable_fp_fusion=True``, multiply-adds contracted to FMAs)
unless its launch says otherwise: Triton's default through 3.9, under which every kernel was checked on
the GPU. Triton 3.9 warns that its default becomes off in 3.10; naming it keeps the numerics as measured.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import weakref
from typing import Any, NamedTuple, Sequence

import torch

from .backend import interpreting

log = logging.getLogger(__name__)

_MAX_KEYS = 4096
#: compile options every launch gets unless it names them (see the module docstring)
_COMPILE_DEFAULTS = {"enable_fp_fusion": True}


def fast_launch_enabled() -> bool:
    """Whether compiled kernels may be launched directly (``LOWBIT_TRITON_FAST_LAUNCH``, default on)."""
    return os.environ.get("LOWBIT_TRITON_FAST_LAUNCH", "1") not in ("0", "false", "off", "")


def _arg_key(value: Any):
    """Key part of a runtime argument that is not a tensor or an int: what Triton could specialize on."""
    if value is None or isinstance(value, (bool, int, float)):
        return (type(value), value)
    base = getattr(value, "base", None)
    if isinstance(base, torch.Tensor):  # a host TensorDescriptor
        return ("desc", base.dtype, base.data_ptr() % 16 == 0, tuple(value.block_shape), tuple(value.shape),
                tuple(value.strides), getattr(value, "padding", None))
    raise TypeError(f"no fast-launch key for an argument of type {type(value).__name__}")


def specialization_key(args: Sequence[Any]) -> tuple:
    """Per runtime argument: a tensor's dtype and 16-byte alignment, an int's value (a superset of
    Triton's ``== 1`` / ``% 16`` / int32-range specialization, and cheaper to take), anything else
    through :func:`_arg_key`."""
    return tuple([(a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
                  else a if type(a) in _NUMBERS else _arg_key(a) for a in args])


_NUMBERS = frozenset({int, float})  # by value (a float runtime argument is fp32 whatever its value)


class TritonLauncher:
    """Launches one ``@triton.jit`` kernel; see the module docstring.

    ``launch(grid, args, constexprs, num_warps=..., num_stages=...)``: ``args`` are the runtime
    arguments in the kernel's parameter order, ``constexprs`` a dict of the constexpr parameters
    that follow them, in parameter order (checked on the first launch of each key).
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self._compiled: dict[tuple, tuple] = {}
        self._lock = threading.Lock()
        self.disabled_reason: str | None = None
        self.fast_launches = 0  # counters for tests and the overhead report
        self.slow_launches = 0
        _ALL.add(self)

    def launch(self, grid: Sequence[int], args: Sequence[Any], constexprs: dict[str, Any], **options: Any) -> None:
        entry = key = None
        if self.disabled_reason is None:
            try:
                first = args[0]
                device_index = _current_device() if getattr(first, "base", first).is_cuda else -1
                key = (device_index, tuple(constexprs.values()), tuple(options.values()), specialization_key(args))
            except Exception as err:  # an argument we cannot key: launch as usual
                log.debug("LowBit fast launch: no key for %s (%s)", self._name(), err)
            else:
                entry = self._compiled.get(key)
        if entry is not None and not (_hooks[0] and (_hooks[0].calls or _hooks[1].calls)):
            run, function, packed = entry
            try:
                if len(grid) == 1:
                    run(grid[0], 1, 1, _raw_stream(key[0]), function, packed, None, None, None, *args,
                        *constexprs.values())
                else:
                    g = tuple(grid) + (1, 1)
                    run(g[0], g[1], g[2], _raw_stream(key[0]), function, packed, None, None, None, *args,
                        *constexprs.values())
                self.fast_launches += 1
                if _captured.launches is not None:
                    _captured.launches.append((self, key, grid, args, constexprs))
                return
            except Exception as err:  # an API that does not match: never again for this kernel
                self._disable(f"{type(err).__name__}: {err}")
        compiled = self.kernel[tuple(grid)](*args, **constexprs, **{**_COMPILE_DEFAULTS, **options})
        self.slow_launches += 1
        if self.disabled_reason is None and key is not None:
            self._remember(key, compiled, constexprs)
        if _captured.launches is not None:
            _captured.launches.append((self, key, grid, args, constexprs))

    # ---- internals --------------------------------------------------------------------------
    def _name(self) -> str:
        return getattr(self.kernel, "__name__", repr(self.kernel))

    def _disable(self, why: str) -> None:
        if self.disabled_reason is None:
            self.disabled_reason = why
            log.warning("LowBit fast Triton launch of %s failed (%s); using kernel[grid] from now on",
                        self._name(), why)
        self._compiled.clear()

    def _remember(self, key: tuple, compiled: Any, constexprs: dict[str, Any]) -> None:
        why = self._unsupported(compiled, constexprs)
        if why:
            if not interpreting():
                log.info("LowBit fast Triton launch unavailable for %s: %s", self._name(), why)
            self.disabled_reason = why
            return
        if hasattr(compiled, "result"):  # an asynchronously compiled kernel (Triton >= 3.5)
            compiled = compiled.result()
        with self._lock:
            if len(self._compiled) >= _MAX_KEYS:  # shapes keep changing (ints are in the key): start over
                self._compiled.clear()
            self._compiled[key] = (compiled.run, compiled.function, compiled.packed_metadata)

    def _unsupported(self, compiled: Any, constexprs: dict[str, Any]) -> str | None:
        if not fast_launch_enabled():
            return "LOWBIT_TRITON_FAST_LAUNCH=0"
        if not _triton_launch_api_known():
            return "Triton older than 3.3 passes other launcher arguments"
        if interpreting() or compiled is None:
            return "the Triton interpreter returns no compiled kernel"
        for attr in ("run", "function", "packed_metadata"):
            if not hasattr(compiled, attr):
                return f"this Triton's compiled kernel has no {attr!r}"
        names = getattr(self.kernel, "arg_names", None)
        if names is not None and list(names[len(names) - len(constexprs):]) != list(constexprs):
            return f"constexprs {list(constexprs)} are not the kernel's trailing parameters {names}"
        if _launch_hooks_set():
            return "Triton launch hooks are set (a profiler is attached)"
        return None


_ALL: "weakref.WeakSet[TritonLauncher]" = weakref.WeakSet()  # for slow_launches_only()


@contextlib.contextmanager
def slow_launches_only():
    """Every :class:`TritonLauncher` launches through ``kernel[grid]`` inside the block (benchmarks
    compare against it)."""
    saved = {launcher: (launcher.disabled_reason, dict(launcher._compiled)) for launcher in list(_ALL)}
    for launcher in saved:
        launcher.disabled_reason = launcher.disabled_reason or "switched off (slow_launches_only)"
        launcher._compiled.clear()
    try:
        yield
    finally:
        for launcher, (reason, compiled) in saved.items():
            launcher.disabled_reason = reason
            launcher._compiled.update(compiled)


def _triton_launch_api_known() -> bool:
    """Triton >= 3.3: ``CompiledKernel.run(gx, gy, gz, stream, function, packed_metadata,
    launch_metadata, enter_hook, exit_hook, *every_argument_constexprs_included)``."""
    try:
        import triton

        major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    except Exception:
        return False
    return (major, minor) >= (3, 3)


# Triton >= 3.5 keeps its launch hooks in two HookChain objects (empty unless a profiler attached);
# fast launches check them on every call. Before that, hooks were plain attributes, checked only when
# a kernel is first cached (and an attached profiler then still sees every slow launch).
_hooks: list = [None, None]


def _launch_hooks_set() -> bool:
    """Whether a profiler hooked Triton's launches (then every launch goes through ``kernel[grid]``)."""
    try:
        from triton import knobs

        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    except Exception:  # no knobs (older Triton): CompiledKernel.launch_metadata decides there
        return False
    if hasattr(enter, "calls") and hasattr(leave, "calls"):
        _hooks[:] = [enter, leave]
        return bool(enter.calls or leave.calls)
    return enter is not None or leave is not None


def _current_device() -> int:
    try:
        return torch._C._cuda_getDevice()
    except AttributeError:  # pragma: no cover - other torch builds
        return torch.cuda.current_device()


_stream_getter = None


def _raw_stream(device_index: int) -> int:
    global _stream_getter
    if device_index < 0:  # a CPU launch (tests' interpreter-backed kernels): no stream
        return 0
    if _stream_getter is None:
        try:
            from torch._C import _cuda_getCurrentRawStream as getter
        except ImportError:
            def getter(index):
                return torch.cuda.current_stream(index).cuda_stream
        _stream_getter = getter
    return _stream_getter(device_index)


# ---- replaying one call's launches -------------------------------------------------------------

class _Captured(threading.local):
    launches: list | None = None


_captured = _Captured()


@contextlib.contextmanager
def capture_launches():
    """The :class:`TritonLauncher` launches made on this thread inside the block, in order, as
    ``(launcher, key, grid, args, constexprs)`` (what :meth:`LaunchReplay.build` takes)."""
    saved, _captured.launches = _captured.launches, []
    try:
        yield _captured.launches
    finally:
        _captured.launches = saved


# id(tensor) -> weak reference: cached operands that never change (a LaunchReplay passes them again)
_constants: dict[int, weakref.ref] = {}


def constant_tensor(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` – a cached operand whose contents never change (rotation factors, an empty placeholder) –
    as one that a :class:`LaunchReplay` may keep and pass to later launches. Returns ``t``."""
    key = id(t)
    _constants[key] = weakref.ref(t, lambda _ref, key=key: _constants.pop(key, None))
    return t


def _is_constant(t: torch.Tensor) -> bool:
    ref = _constants.get(id(t))
    return ref is not None and ref() is t


_replay_failure: list = [None]  # why replays stopped (the first one that raised), else None
_replays_paused = [0]  # no_replays() blocks entered


def replays_enabled() -> bool:
    return _replay_failure[0] is None and not _replays_paused[0] and fast_launch_enabled()


@contextlib.contextmanager
def no_replays():
    """Every call inside the block takes its ordinary launches (benchmarks compare against them)."""
    _replays_paused[0] += 1
    try:
        yield
    finally:
        _replays_paused[0] -= 1


class LaunchReplay:
    """The Triton launches of one call, launched again for a later call whose tensors play the same roles.

    A linear's steady state calls the same two or three kernels with the same grids, constexprs and
    sizes on every step; only the tensors change. Building those arguments in Python (shape checks,
    launch shapes, the specialization key of each launch) cost about as much as the launches
    themselves. A replay keeps the compiled kernels and every non-tensor argument of one recorded call,
    and per later call only checks the given tensors, allocates the outputs and launches.

    :meth:`build` takes the launches of one call (:func:`capture_launches`), the tensors the call was
    given (``inputs``, a fixed order, ``None`` allowed) and the tensors it allocated with ``torch.empty``
    (``outputs``: results and scratch, a fixed order; the first ``scratch`` of them only the call's own
    launches use, so a replay may hand back ``None`` in their place, see :func:`_compile_replay`). Each
    tensor argument of each launch must be one of those (or a view of one as another dtype of the same
    size), or a :func:`constant_tensor`; each TMA descriptor must describe one of those; each launch must
    have a compiled kernel in its launcher's fast path. Otherwise there is no replay (``None``): the caller keeps its ordinary path.
    The caller keys its replays by everything else its scalar arguments and constexprs depend on.

    :meth:`replay` runs when the new inputs have the recorded dtypes, shapes, strides and 16-byte
    alignment (what the kernels were specialized on) and returns the new outputs; it returns ``None``
    (run the ordinary path) when they differ, when a profiler hooked Triton's launches, or on another
    current device. A replay that raises switches replays off everywhere (logged once).
    """

    __slots__ = ("device_index", "device", "signatures", "allocs", "steps", "scratch", "fn")

    def __init__(self, device_index, device, signatures, allocs, steps, scratch=0):
        self.device_index, self.device = device_index, device
        self.signatures, self.allocs, self.steps = signatures, allocs, steps
        self.scratch = scratch  # how many leading outputs only the call's own launches use
        self.fn = None  # the generated replay (_compile_replay), made on the first replay

    @classmethod
    def build(cls, launches: Sequence[tuple], inputs: Sequence[torch.Tensor | None],
              outputs: Sequence[torch.Tensor], scratch: int = 0) -> "LaunchReplay | None":
        if not launches or not replays_enabled():
            return None
        roles = [*inputs, *outputs]
        given = [t for t in roles if t is not None]
        if len({id(t) for t in given}) != len(given):  # one tensor in two roles: a later call may split them
            return None
        steps, device_index = [], None
        for launcher, key, grid, args, constexprs in launches:
            entry = None if key is None or launcher.disabled_reason else launcher._compiled.get(key)
            if entry is None or device_index not in (None, key[0]):
                return None
            device_index = key[0]
            spec = []
            for arg in args:
                base = getattr(arg, "base", None) if not isinstance(arg, torch.Tensor) else None
                if isinstance(arg, torch.Tensor):
                    role = _role_of(arg, roles)
                    if role is None and not _is_constant(arg):
                        return None
                    spec.append((0, arg, None) if role is None else (1, *role))
                elif isinstance(base, torch.Tensor):  # a host TMA descriptor
                    role = _role_of(base, roles)
                    if role is None:
                        return None
                    spec.append((2, role[0], _descriptor_maker(arg, role[1])))
                else:
                    spec.append((0, arg, None))
            g = tuple(grid) + (1,) * (3 - len(grid))
            steps.append((*entry, g[0], g[1], g[2], tuple(spec), tuple(constexprs.values())))
        device = next(t.device for t in roles if t is not None)
        signatures = tuple(None if t is None else (t.dtype, tuple(t.shape), t.stride(), t.data_ptr() % 16 == 0)
                           for t in inputs)
        allocs = tuple((tuple(t.shape), t.dtype) for t in outputs)
        return cls(device_index, device, signatures, allocs, tuple(steps), min(scratch, len(allocs)))

    def replay(self, inputs: Sequence[torch.Tensor | None]) -> list[torch.Tensor] | None:
        if _replay_failure[0] is not None or _replays_paused[0] or (_hooks[0] and (_hooks[0].calls or _hooks[1].calls)):
            return None
        if self.device_index >= 0 and _current_device() != self.device_index:
            return None
        fn = self.fn
        if fn is None:
            fn = self.fn = _compile_replay(self)
        try:
            return fn(inputs, _raw_stream(self.device_index))
        except Exception as err:  # an API that does not match: the ordinary launches from now on
            _replay_failure[0] = f"{type(err).__name__}: {err}"
            log.warning("LowBit launch replay failed (%s); launching through the kernels' wrappers from now on",
                        _replay_failure[0])
            return None


def _compile_replay(replay: LaunchReplay, raw_pointers: bool | None = None, pool: bool | None = None,
                    direct: bool | None = None):
    """``fn(inputs, stream)``: the replay as one generated function – the input checks, the allocations and
    the launches written out with every constant bound by name (a loop over the recorded argument specs
    costs several microseconds a call; this is the same work without the interpretation). Returns the
    outputs, or ``None`` where an input differs from the recording.

    ``raw_pointers`` (default: on a CUDA device) passes each tensor argument as its address, an int. Triton's
    C launcher takes an int as the pointer itself; given a tensor it calls the tensor's ``data_ptr`` and asks
    the driver whether that address is device memory (``cuPointerGetAttribute``), about a microsecond a
    tensor on an H200's host, and a dtype view made for an argument costs another. The replay checks instead
    that every input is on the recorded device (``get_device``), and keeps every constant it passes by address
    alive with it. ``LOWBIT_REPLAY_RAW_POINTERS=0`` passes the tensors themselves.

    ``pool`` (default: with ``raw_pointers``) carves the replay's scratch outputs (``replay.scratch``, tensors
    only its own launches use: activation codes and scales, an expanded weight) out of one allocation, each at
    a 512-byte aligned offset, and passes their addresses: one ``torch.empty`` a call instead of one per
    scratch tensor (3-6 µs each on an H200's host). A TMA descriptor over a scratch tensor gets its address as
    its base. The buffer is released when the replay returns, like the scratch tensors it replaces: the
    caching allocator hands the memory out again only to work queued after these launches on the same
    stream. The replay returns ``None`` in the scratch outputs' places.

    ``direct`` (default: with ``raw_pointers``, where :func:`_direct_launch` recognizes Triton's launcher)
    calls Triton's C launch function itself rather than the compiled kernel's Python launcher, and encodes
    each TMA descriptor once per address (:func:`_descriptor_encoder`) rather than on every launch."""
    if raw_pointers is None:
        raw_pointers = replay.device_index >= 0 and os.environ.get("LOWBIT_REPLAY_RAW_POINTERS", "1") not in (
            "0", "false", "off", "")
    raw = raw_pointers
    n_in = len(replay.signatures)
    pooled: dict[int, int] = {}  # scratch output -> byte offset in the pool
    if raw and (pool is None or pool):
        described: dict[int, list] = {}  # output -> the descriptor makers over it
        for *_, spec, _tail in replay.steps:
            for kind, value, extra in spec:
                if kind == 2 and value >= n_in:
                    described.setdefault(value - n_in, []).append(extra)
        offset = 0
        for j in range(replay.scratch):
            if any(getattr(m, "from_address", None) is None for m in described.get(j, ())):
                continue  # a descriptor that needs the tensor itself
            shape, dtype = replay.allocs[j]
            pooled[j] = offset
            offset += -(-math.prod(shape) * dtype.itemsize // _POOL_ALIGN) * _POOL_ALIGN
        pool_bytes = offset
    names: dict[str, object] = {"empty": torch.empty, "DEVICE": replay.device, "DEV": replay.device_index}
    lines = ["def replay(inputs, stream):",
             f"    if len(inputs) != {len(replay.signatures)}:",
             "        return None",
             f"    {''.join(f'i{j}, ' for j in range(len(replay.signatures)))}= inputs"]
    for j, sig in enumerate(replay.signatures):
        if sig is None:
            lines.append(f"    if i{j} is not None: return None")
            continue
        dtype, shape, stride, aligned = sig
        names.update({f"D{j}": dtype, f"SH{j}": shape, f"ST{j}": stride})
        lines.append(f"    if i{j} is None or i{j}.dtype is not D{j} or i{j}.shape != SH{j} or i{j}.stride() != ST{j}"
                     + (" or i{j}.get_device() != DEV: return None".format(j=j) if raw else ": return None"))
        lines.append(f"    p{j} = i{j}.data_ptr()")
        lines.append(f"    if p{j} % 16 {'!=' if aligned else '=='} 0: return None")
    if pooled:
        names["POOL"] = (pool_bytes,)
        lines.append("    pool = empty(POOL, dtype=UINT8, device=DEVICE)")
        lines.append("    base = pool.data_ptr()")
        names["UINT8"] = torch.uint8
    for j, (shape, dtype) in enumerate(replay.allocs):
        if j in pooled:
            lines.append(f"    q{j} = base + {pooled[j]}")
            continue
        names.update({f"OS{j}": shape, f"OD{j}": dtype})
        lines.append(f"    o{j} = empty(OS{j}, dtype=OD{j}, device=DEVICE)")
        if raw:
            lines.append(f"    q{j} = o{j}.data_ptr()")

    def role(index: int) -> str:
        return f"i{index}" if index < n_in else f"o{index - n_in}"

    def address(index: int) -> str:
        return f"p{index}" if index < n_in else f"q{index - n_in}"
    for s, (run, function, packed, g0, g1, g2, spec, tail) in enumerate(replay.steps):
        names.update({f"R{s}": run, f"F{s}": function, f"P{s}": packed})
        args = [f"{g0}, {g1}, {g2}, stream, F{s}, P{s}, None, None, None"]
        c_launch = _direct_launch(run, spec) if raw and (direct is None or direct) else None
        head = None
        if c_launch is not None:  # Triton's C launcher itself; descriptors encoded once per address
            names.update({f"C{s}": c_launch.launch, f"COOP{s}": c_launch.cooperative, f"PDL{s}": c_launch.pdl})
            encoders = c_launch.encoders
            if c_launch.annotations is None:  # Triton 3.6: the kernel's arguments follow the launch's own
                args = [f"{g0}, {g1}, {g2}, stream, F{s}, COOP{s}, PDL{s}, None, None, P{s}, None, None, None"]
            else:  # Triton 3.7+: one generic launch function, the kernel's arguments in one tuple at the end
                names.update({f"ANN{s}": c_launch.annotations, f"SIG{s}": c_launch.signature})
                head = (f"{g0}, {g1}, {g2}, stream, F{s}, COOP{s}, PDL{s}, P{s}, None, None, None, None, None, "
                        f"ANN{s}, SIG{s}")
                args = []
        for a, (kind, value, extra) in enumerate(spec):
            if c_launch is not None and kind == 2:
                names[f"E{s}_{a}"] = encoders[a]
                args.append(f"*E{s}_{a}({address(value)})")
                continue
            if kind == 0:
                if raw and isinstance(value, torch.Tensor):
                    names[f"KEEP{s}_{a}"] = value  # the address stays valid while the replay lives
                    names[f"K{s}_{a}"] = value.data_ptr()
                else:
                    names[f"K{s}_{a}"] = value
                args.append(f"K{s}_{a}")
            elif kind == 1:
                if raw:  # a same-size dtype view has the tensor's own address
                    args.append(address(value))
                elif extra is None:
                    args.append(role(value))
                else:
                    names[f"V{s}_{a}"] = extra
                    args.append(f"{role(value)}.view(V{s}_{a})")
            elif value - n_in in pooled:
                names[f"M{s}_{a}"] = extra.from_address
                args.append(f"M{s}_{a}({address(value)})")
            else:
                names[f"M{s}_{a}"] = extra
                args.append(f"M{s}_{a}({role(value)})")
        for c, value in enumerate(tail):
            names[f"T{s}_{c}"] = value
            args.append(f"T{s}_{c}")
        if head is not None:
            lines.append(f"    C{s}({head}, ({''.join(f'{a}, ' for a in args)}))")
        else:
            lines.append(f"    {'C' if c_launch is not None else 'R'}{s}({', '.join(args)})")
    lines.append(f"    return [{''.join('None, ' if j in pooled else f'o{j}, ' for j in range(len(replay.allocs)))}]")
    exec(compile("\n".join(lines), f"<LowBit launch replay {id(replay):x}>", "exec"), names)
    return names["replay"]


class DirectLaunch(NamedTuple):
    """Triton's C launch function under a compiled kernel's launcher, and what a replay passes it besides the
    kernel's arguments. ``annotations`` / ``signature``: Triton 3.7+'s generic launch function's per-argument
    annotations and kernel signature (``None`` for Triton 3.6's launcher, made for one kernel)."""

    launch: Any
    cooperative: bool
    pdl: bool
    encoders: dict  # position of a TMA descriptor argument -> its _descriptor_encoder
    annotations: Any = None
    signature: Any = None


# ``CudaLauncher.__call__``'s parameters, as Triton 3.6 and Triton 3.7 - 3.9 name them
_CALL_36 = ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]
_CALL_GENERIC = ["self", "gridX", "gridY", "gridZ", "stream", "function", "kernel_metadata", "launch_metadata",
                 "launch_enter_hook", "launch_exit_hook", "args"]


def _direct_launch(run, spec) -> DirectLaunch | None:
    """The C launch function under ``run`` (a compiled kernel's launcher), when ``run`` is one of the two forms
    of Triton's ``CudaLauncher`` this knows and needs no scratch memory; ``None`` otherwise (other Triton
    versions, a profiler's or sanitizer's launcher): the replay calls ``run`` as before.

    * Triton 3.6: ``__call__(gridX, gridY, gridZ, stream, function, *args)`` hands ``(grid, stream, function,
      cooperative, pdl, None, None, *args)`` to a C function made for the kernel (its module's
      ``_BASE_ARGS_FORMAT`` names the leading arguments).
    * Triton 3.7 - 3.9: ``__call__(gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
      enter_hook, exit_hook, *args)`` hands ``(grid, stream, function, cooperative, pdl, kernel_metadata,
      launch_metadata, enter_hook, exit_hook, global_scratch, profile_scratch, arg_annotations,
      kernel_signature, args)`` to one generic C function.

    Either way the C function is wrapped (``wrap_handle_tensordesc``: a closure named ``inner``) when the
    kernel takes host TMA descriptors, to expand each into Triton's encoding of it (``make_tensordesc_arg``: the
    CUtensorMap, then the shape and strides). ``encoders`` does that expansion per descriptor argument of
    ``spec``, once per address (:func:`_descriptor_encoder`)."""
    import inspect
    import sys

    try:
        if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1) \
                or getattr(run, "gsan_enabled", False):
            return None
        params = list(inspect.signature(type(run).__call__).parameters)
        driver = sys.modules.get(type(run).__module__)
        if params == _CALL_36:
            if getattr(driver, "_BASE_ARGS_FORMAT", None) != "iiiKKppOOOOOO":
                return None
            generic = None
        elif params == _CALL_GENERIC:
            generic = (run.arg_annotations, run.kernel_signature)
        else:
            return None
        launch, indices, metas, make_arg = run.launch, set(), [], getattr(driver, "make_tensordesc_arg", None)
        if getattr(launch, "__name__", "") == "inner":  # wrap_handle_tensordesc's wrapper around the C function
            cells = dict(zip(launch.__code__.co_freevars, (c.cell_contents for c in launch.__closure__ or ())))
            if "relevant_paths" in cells:  # Triton 3.8+: descriptors found by path, the encoder a closure value
                paths = cells["relevant_paths"]
                if any(paths.values()):
                    return None  # a descriptor inside a tuple argument
                indices, make_arg = set(paths), _meta_only(cells["make_tensordesc_arg"])
            else:
                indices = set(cells["tensordesc_indices"])
            metas = list(cells["tensordesc_meta"] or ())
            launch = cells["launcher"]
        described = [a for a, (kind, _, _) in enumerate(spec) if kind == 2]
        if not callable(launch) or set(described) != indices or len(metas) != len(described):
            return None
        encoders = {}
        for a, meta in zip(sorted(described), metas):
            maker = spec[a][2]
            if meta is None or make_arg is None or getattr(maker, "from_address", None) is None:
                return None  # a descriptor passed as base, shape and strides: it would hold the tensor
            encoders[a] = _descriptor_encoder(maker.from_address, meta, make_arg)
        return DirectLaunch(launch, run.launch_cooperative_grid, run.launch_pdl, encoders, *(generic or ()))
    except Exception:  # anything unexpected: the launcher as it is
        return None


def _meta_only(make_tensordesc_arg):
    """Triton 3.8+'s ``make_tensordesc_arg(arg, metadata, base_args)`` as a function of the first two, where its
    third parameter is the unused ``_`` (the CUDA backend's); ``None`` otherwise."""
    import inspect

    if list(inspect.signature(make_tensordesc_arg).parameters)[2:] != ["_"]:
        return None
    return lambda arg, meta: make_tensordesc_arg(arg, meta, None)


def _descriptor_encoder(from_address, meta, make_arg):
    """``encode(address)``: Triton's expansion of a host TMA descriptor (``make_arg(descriptor, meta)``: the
    CUtensorMap, then the shape and strides) of the recorded block shape, shape and strides at ``address``,
    kept per address. The encoding depends on nothing else (the replay has checked dtype, shape and strides),
    so an address seen before (a layer's weight; an activation buffer the caching allocator hands out again)
    costs a dictionary lookup instead of a ``cuTensorMapEncodeTiled``."""
    cache: dict[int, list] = {}

    def encode(address: int) -> list:
        expanded = cache.get(address)
        if expanded is None:
            if len(cache) >= _MAX_KEYS:
                cache.clear()
            expanded = cache[address] = make_arg(from_address(address), meta)
        return expanded
    return encode


def _descriptor_maker(desc, dtype: torch.dtype | None):
    """``make(tensor)``: a host TMA descriptor like ``desc`` over another tensor of the same dtype (or a view of
    it as ``dtype``), shape, strides and alignment – which the replay has checked, so none of
    :func:`tma_descriptor`'s checks are repeated."""
    block_shape = list(desc.block_shape)
    cls, known = _descriptor_class if _descriptor_class is not None else (None, False)
    if not known or type(desc) is not cls or any(getattr(desc, f, None) != getattr(cls, f, None)
                                                 for f in ("padding", "round_f32_to_tf32") if hasattr(cls, f)):
        return lambda t: tma_descriptor(t if dtype is None else t.view(dtype), block_shape)
    shape, strides = desc.shape, desc.strides

    def make(t):
        new = cls.__new__(cls)
        new.base, new.shape, new.strides, new.block_shape = t if dtype is None else t.view(dtype), shape, strides, \
            block_shape
        return new

    def from_address(address: int):  # Triton's launcher reads only the base's ``data_ptr()``
        new = cls.__new__(cls)
        new.base, new.shape, new.strides, new.block_shape = _Address(address), shape, strides, block_shape
        return new
    make.from_address = from_address
    return make


class _Address:
    """The base of a TMA descriptor over pooled scratch memory: an address with ``data_ptr``."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


_POOL_ALIGN = 512  # the caching allocator's own alignment: every kernel specialization still holds


def _role_of(t: torch.Tensor, roles: Sequence[torch.Tensor | None]) -> tuple[int, torch.dtype | None] | None:
    """``(index, dtype to view it as or None)`` of the role ``t`` is (itself, or a same-size dtype view of it)."""
    for i, r in enumerate(roles):
        if r is t:
            return i, None
    if not t.numel():
        return None
    views = [i for i, r in enumerate(roles)
             if r is not None and r.data_ptr() == t.data_ptr() and r.element_size() == t.element_size()
             and r.shape == t.shape and r.stride() == t.stride() and r.device == t.device]
    return (views[0], t.dtype) if len(views) == 1 else None


# ---- host TMA descriptors -----------------------------------------------------------------------

_DESCRIPTOR_FIELDS = {"base", "shape", "strides", "block_shape", "padding", "round_f32_to_tf32"}
_descriptor_class = None  # (class, whether its fields are the ones we know) once imported


def tma_descriptor(t: torch.Tensor, block_shape: tuple[int, ...]):
    """``TensorDescriptor.from_tensor(t, block_shape)`` without its per-call dataclass validation
    (4 µs): the same checks done here, on the few values that can change between calls. Falls back
    to ``from_tensor`` when this Triton's descriptor has other fields or a check fails (it then
    raises with Triton's message)."""
    global _descriptor_class
    if _descriptor_class is None:
        import dataclasses

        from triton.tools.tensor_descriptor import TensorDescriptor

        names = {f.name for f in dataclasses.fields(TensorDescriptor)}
        known = {"base", "shape", "strides", "block_shape"} <= names <= _DESCRIPTOR_FIELDS
        _descriptor_class = (TensorDescriptor, known)
    cls, known = _descriptor_class
    strides = t.stride()
    if (known and t.data_ptr() % 16 == 0 and strides[-1] == 1 and min(t.shape) > 0
            and all(s * t.element_size() % 16 == 0 for s in strides[:-1])):
        desc = cls.__new__(cls)  # the remaining fields keep their dataclass defaults (class attributes)
        desc.base, desc.shape, desc.strides, desc.block_shape = t, t.shape, strides, list(block_shape)
        return desc
    return cls.from_tensor(t, list(block_shape))
