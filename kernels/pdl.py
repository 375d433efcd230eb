"""Programmatic dependent launch (PDL): a GEMM starts while the activation quantization feeding it ends.

Every quantized linear is two kernels in one stream: the activation quantization writes the codes
and scales, then the GEMM reads them. Launched plainly, the GEMM's programs are only scheduled once
the first kernel has finished and its memory is flushed, so each linear pays the gap between the two
and the GEMM's ramp-up (its index math, descriptor setup and first weight loads) in series.

On sm_90 and newer, a kernel launched with PDL (Triton's ``launch_pdl`` option) may start as soon as
every program of the kernel before it has executed ``griddepcontrol.launch_dependents``; it must run
``griddepcontrol.wait`` before it touches anything that kernel wrote. Here:

* the activation-quantization kernels call :func:`gdc_launch_dependents` first thing (``PDL``
  constexpr), so a GEMM launched after them is scheduled on the SMs they leave free;
* the GEMM kernels call :func:`gdc_wait` before their K loop and before any store (``PDL``
  constexpr), and are launched with ``launch_pdl=True``. Everything the GEMM reads from the kernel
  before it (the codes and scales) is read after the wait, and it writes nothing before it, so a
  buffer the caching allocator handed back while the previous kernel still used it is safe too.

The instructions are no-ops for a kernel that was not launched with PDL, and a GEMM launched with
PDL after any other kernel simply waits for it as usual. :func:`pdl_enabled` says whether a device
uses it: CUDA compute capability 9.0 or newer, a Triton with ``launch_pdl`` and the ``gdc`` ops, not
the CPU interpreter, and ``LOWBIT_PDL`` not ``0`` (read once per process and device).
"""

from __future__ import annotations

import functools
import os

import torch
import triton

from .backend import interpreting

try:  # Triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAS_GDC = True
except ImportError:  # pragma: no cover - older Triton: the kernels are only ever compiled with PDL=False
    _HAS_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

__all__ = ["gdc_launch_dependents", "gdc_wait", "pdl_enabled", "pdl_options", "pdl_problem"]


def pdl_enabled(device: torch.device) -> bool:
    """Whether Triton GEMMs on ``device`` are launched with PDL (see the module docstring)."""
    if device.type != "cuda" or interpreting():
        return False
    return _device_pdl(torch.cuda.current_device() if device.index is None else device.index)


def pdl_options(enabled: bool) -> dict:
    """The launch options of a GEMM: ``{"launch_pdl": True}`` when ``enabled``, else none."""
    return {"launch_pdl": True} if enabled else {}


@functools.lru_cache(maxsize=16)
def _device_pdl(index: int) -> bool:
    return pdl_problem(torch.cuda.get_device_capability(index)) is None


def pdl_problem(capability: tuple[int, int]) -> str | None:
    """Why a GPU of ``capability`` does not use PDL here (``None``: it does)."""
    if os.environ.get("LOWBIT_PDL", "1").strip().lower() in ("0", "false", "off", ""):
        return "LOWBIT_PDL=0"
    if tuple(capability) < (9, 0):
        return f"programmatic dependent launch needs sm_90 or newer, this GPU is sm_{capability[0]}{capability[1]}"
    if not _HAS_GDC or not _triton_has_launch_pdl():
        return f"Triton {triton.__version__} has no launch_pdl option or gdc ops (Triton >= 3.4 has)"
    return None


@functools.lru_cache(maxsize=1)
def _triton_has_launch_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
