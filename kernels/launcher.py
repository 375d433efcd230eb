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
``run``, ``function`` and ``packed_metadata`` (Triton 3.2 – 3.8), when no launch hooks are set
(profilers), and never in the CPU interpreter (``TRITON_INTERPRET=1``, where there is no compiled
kernel). If a fast launch raises, the launcher logs once, stops using the fast path for that kernel
and launches through ``kernel[grid]``. ``LOWBIT_TRITON_FAST_LAUNCH=0`` turns it off everywhere.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from typing import Any, Sequence

import torch

from .backend import interpreting

log = logging.getLogger(__name__)

_MAX_KEYS = 4096


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
                return
            except Exception as err:  # an API that does not match: never again for this kernel
                self._disable(f"{type(err).__name__}: {err}")
        compiled = self.kernel[tuple(grid)](*args, **constexprs, **options)
        self.slow_launches += 1
        if self.disabled_reason is None and key is not None:
            self._remember(key, compiled, constexprs)

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
    if _stream_getter is None:
        try:
            from torch._C import _cuda_getCurrentRawStream as getter
        except ImportError:
            def getter(index):
                return torch.cuda.current_stream(index).cuda_stream
        _stream_getter = getter
    return _stream_getter(device_index)


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
