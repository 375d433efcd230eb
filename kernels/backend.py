"""Which implementation runs a kernel: the backend enum, a context manager to force one, and
whether Triton can run here (and if not, why).

Nothing here imports Triton at module import time. :func:`triton_status` imports it on first use
and records the reason when it cannot (not installed, no CUDA device, an import error), so a
missing backend never breaks ``import lowbit``.

Backends:

* ``AUTO``     – the measured dispatcher picks per shape (``kernels/dispatch.py``); the default.
* ``EAGER``    – the pure-torch reference of every kernel (any device; slow, exact by definition).
* ``TRITON``   – our Triton kernels (CUDA, or the CPU interpreter when ``TRITON_INTERPRET=1``).
* ``TORCH``    – our activation quantization, then ``torch._int_mm`` / ``torch._scaled_mm`` (cuBLAS).
* ``KITCHEN``  – comfy-kitchen's own linear for the format (its CUDA/Triton/eager registry).
* ``DEQUANT``  – dequantize the weight and run a float ``F.linear``.

Tests force one with ``with force_backend(Backend.EAGER): ...``.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
import functools
import logging
import os
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


class Backend(str, enum.Enum):
    AUTO = "auto"
    EAGER = "eager"
    TRITON = "triton"
    TORCH = "torch"
    KITCHEN = "kitchen"
    DEQUANT = "dequant"


class BackendUnavailableError(RuntimeError):
    """A forced backend cannot run this call; the message says why and what to do."""


_forced: contextvars.ContextVar[Backend] = contextvars.ContextVar("lowbit_kernel_backend", default=Backend.AUTO)


def active_backend() -> Backend:
    """The backend forced by the innermost :func:`force_backend`, else ``Backend.AUTO``."""
    return _forced.get()


@contextlib.contextmanager
def force_backend(backend: Backend | str):
    """Run every LowBit kernel call inside the block on ``backend`` (tests, debugging, benchmarks)."""
    token = _forced.set(Backend(backend))
    try:
        yield
    finally:
        _forced.reset(token)


def interpreting() -> bool:
    """Whether Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class TritonStatus:
    available: bool
    reason: str  # why not, or the version when available


@functools.lru_cache(maxsize=1)
def triton_status() -> TritonStatus:
    """Whether our Triton kernels can be imported here, and if not, why. Imported lazily, once."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as err:  # ImportError, or a broken install raising anything else
        reason = f"triton cannot be imported ({type(err).__name__}: {err}); install 'triton>=3.0'"
        log.info("LowBit Triton kernels disabled: %s", reason)
        return TritonStatus(False, reason)
    return TritonStatus(True, f"triton {triton.__version__}")


def capability(device: torch.device) -> tuple[int, int]:
    """CUDA compute capability of ``device``; ``(0, 0)`` for the CPU (interpreter or eager)."""
    if device.type != "cuda":
        return (0, 0)
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=16)
def _cuda_capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def triton_problem(device: torch.device, *, needs_fp8: bool = False) -> str | None:
    """Why our Triton kernels cannot run on ``device`` (``None`` when they can)."""
    status = triton_status()
    if not status.available:
        return status.reason
    if device.type == "cpu":
        return None if interpreting() else "tensors are on the CPU and TRITON_INTERPRET is not set"
    if device.type != "cuda":
        return f"Triton kernels need a CUDA device, got {device.type}"
    cap = capability(device)
    if cap < (8, 0):
        return f"Triton INT8/FP8 kernels need compute capability >= 8.0 (Ampere), found {cap[0]}.{cap[1]}"
    if needs_fp8 and cap < (8, 9):
        return f"FP8 tensor cores need compute capability >= 8.9 (Ada/Hopper), found {cap[0]}.{cap[1]}"
    return None
