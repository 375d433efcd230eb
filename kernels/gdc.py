"""Programmatic dependent launch (PDL): a GEMM's programs start while the activation quantization finishes.

A quantized linear is two launches: the activation quantization, then the GEMM that reads its codes. Launched
the ordinary way, the GEMM's programs are scheduled only once every program of the quantization has exited,
and the GPU idles in between: the launch, the programs' set-up (shared memory, barriers, TMA descriptors) and
their first loads. At a few hundred rows, where a whole linear takes 5-20 µs, that gap is a noticeable share.

On Hopper (sm_90) and newer a kernel can be launched with programmatic stream serialization
(``launch_pdl=True`` in Triton). Its programs may then start as soon as every program of the kernel before it
has called ``griddepcontrol.launch_dependents`` (:func:`let_dependents_start`, which the activation
quantization calls first thing). Each one runs ``griddepcontrol.wait`` (:func:`wait_for_inputs`) before it
touches memory another kernel writes; the wait returns once the kernel before has finished and its writes are
visible. What the GEMM writes, and everything after it, is ordered as before. The two calls do nothing in a
kernel launched without PDL, and are compiled out (a ``False`` constexpr) where PDL is not used: the CPU
interpreter, GPUs before sm_90, a Triton without the two instructions.

:func:`pdl_launch` says whether a launch on a device uses it; ``LOWBIT_PDL=0`` turns it off.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .backend import capability, interpreting

try:  # Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents as _launch_dependents
    from triton.language.extra.cuda import gdc_wait as _wait
    HAVE_GDC = True
except ImportError:  # pragma: no cover - older Triton: the constexprs below are never True
    HAVE_GDC = False
    _launch_dependents = _wait = None


def pdl_enabled() -> bool:
    """Whether PDL may be used at all (``LOWBIT_PDL``, default on)."""
    return os.environ.get("LOWBIT_PDL", "1") not in ("0", "false", "off", "")


def pdl_launch(device: torch.device) -> bool:
    """Whether launches on ``device`` use PDL: a CUDA GPU of compute capability >= 9.0, a Triton with the
    grid-dependency instructions, not the interpreter, and ``LOWBIT_PDL`` not off."""
    return device.type == "cuda" and _pdl_device(device.index if device.index is not None
                                                 else torch.cuda.current_device())


@functools.lru_cache(maxsize=16)
def _pdl_device(index: int) -> bool:
    return (HAVE_GDC and pdl_enabled() and not interpreting()
            and capability(torch.device("cuda", index)) >= (9, 0))


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    """In a kernel launched with PDL: wait until the kernel before has finished and its writes are visible.
    Call it before the first load of anything another kernel writes, and before the first store."""
    if PDL:
        _wait()


#: where the activation quantization lets the GEMM after it start (its ``TRIGGER`` constexpr): nowhere, as its
#: first instruction, or after its last store
NO_TRIGGER, TRIGGER_FIRST, TRIGGER_LAST = 0, 1, 2


def trigger_point(device: torch.device) -> int:
    """The ``TRIGGER`` of a kernel launched on ``device`` that a PDL-launched GEMM may follow."""
    return TRIGGER_LAST if pdl_launch(device) else NO_TRIGGER


@triton.jit
def let_dependents_start(TRIGGER: tl.constexpr, HERE: tl.constexpr):
    """Let a kernel launched after this one with PDL start its programs (they still wait for this one's
    writes in :func:`wait_for_inputs`), where ``TRIGGER`` (``trigger_point``) is ``HERE``: the kernel calls this
    once as its first instruction (``HERE`` 1, ``TRIGGER_FIRST``) and once after its last store (2)."""
    if TRIGGER != 0:
        if TRIGGER == HERE:
            _launch_dependents()
