"""Shared set-up for the kernel tests (``test_kernels_*``): the Triton CPU interpreter and seeded data.

The kernel tests run the Triton kernels on the CPU through Triton's interpreter. It must be switched
on before any Triton kernel is defined, so the test modules import this module first; it sets
``TRITON_INTERPRET=1`` unless the environment already says otherwise, or the tests run on a GPU
(``LOWBIT_TEST_DEVICE=cuda``: the kernels compiled, the CPU-interpreter tests skipped).
"""

from __future__ import annotations

import os

if not os.environ.get("LOWBIT_TEST_DEVICE", "cpu").startswith("cuda"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from lowbit.kernels.backend import interpreting, triton_status  # noqa: E402


def triton_interpreter_available() -> bool:
    return triton_status().available and interpreting()


def needs_triton_interpreter():
    """``pytest.mark.skipif`` for tests that run Triton kernels on the CPU."""
    status = triton_status()
    reason = status.reason if not status.available else "TRITON_INTERPRET=0 was set explicitly"
    return pytest.mark.skipif(not triton_interpreter_available(), reason=f"Triton interpreter unavailable: {reason}")


def interpreter_model_marks(on_cpu: bool) -> list:
    """``pytestmark`` of the tests that run LowBit's kernels through whole tiny ComfyUI models (the fused inputs, the
    one-pass attention): ``interpreter_model`` (CI's run on the newest comfy-kitchen leaves them out: they test
    LowBit's kernels and fusions, not kitchen, and they are the slowest tests in Triton's interpreter), and on the CPU
    :func:`needs_triton_interpreter`."""
    return [pytest.mark.interpreter_model, *([needs_triton_interpreter()] if on_cpu else [])]


def randn(*shape: int, seed: int, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def randint8(*shape: int, seed: int, low: int = -127, high: int = 128) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high, shape, generator=g, dtype=torch.int8)


def sqnr_db(y: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (y.double() - ref).pow(2).sum()))


def row_band_jobs(field_name: str) -> list:
    """(config, M) for every config of the GEMM row bands (``gemm_config._ROW_BANDS``) in ``field_name``
    (``w8a8``, ``int8_split``, ``w4``, ``w4_codebook``): an M of the config's band, ragged against its tile,
    with two row tiles where the band allows."""
    from lowbit.kernels.gemm_config import _ROW_BANDS

    jobs = {}
    for band in _ROW_BANDS:
        for config in getattr(band, field_name):
            two_tiles = config.block_m + config.block_m // 2 + 3
            jobs.setdefault(config, two_tiles if two_tiles <= band.high else band.low + 3)
    return sorted(jobs.items(), key=lambda job: job[0].name)
