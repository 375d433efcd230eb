"""Session-wide test setup.

Triton decides at ``@triton.jit`` time whether a kernel runs compiled or in its CPU interpreter, so
``TRITON_INTERPRET`` must be set before any test module imports LowBit's kernels (or anything that
imports Triton). Without a GPU the kernel tests run in the interpreter; on the CPU the dispatcher
never picks an interpreted kernel unless a test forces it, so the rest of the suite is unaffected.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
