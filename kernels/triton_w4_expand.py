"""Triton: a packed 4-bit weight expanded to its INT8 levels, ``[N, K]``, in natural column order.

The other way to run a 4-bit weight on INT8 tensor cores: decode it once per call into a temporary
INT8 matrix (the same levels the W4 GEMM decodes in registers, with the same ``_decode_w4``), then
run the INT8 W8A8 GEMM on it. The temporary weight costs ``N * K`` bytes while the layer runs (66 MB
for Flux's largest linear) and a read of the packed bytes plus a write of the levels; in exchange the
GEMM is the fastest one LowBit has, with nothing to decode per row tile. comfy-kitchen runs its
W4A8 format the same way (its own decode kernel, then its INT8 GEMM). The dispatcher measures it
against the in-register kernel; the in-register kernel is the one that never expands the weight.

Rows past ``N`` are not written. ``K`` must be a multiple of ``BLOCK_K`` (the 4-bit formats need
``K % 256 == 0`` anyway). The codebook's inline-PTX decode is checked against the gathers on the
first call of each variant, as in the W4 GEMM.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from .launcher import TritonLauncher
from .triton_w4_gemm import _decode_w4, _use_ptx

log = logging.getLogger(__name__)

BLOCK_N = 64
BLOCK_K = 128  # the least K step; 256 where K allows (Session 41, H100: 2-10 % faster at the issue shapes)


@triton.jit
def _expand_tile(w, s_ptr, table_ptr, out, N, off_n, off_k, stride_wn, stride_sn, stride_on,
                 CODEBOOK: tl.constexpr, GROUP: tl.constexpr, USE_PTX: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows ``[off_n, off_n + BLOCK_N)`` and columns ``[off_k, off_k + BLOCK_K)`` of the levels, written to ``out``
    (rows past ``N`` are not). Also the decode half of the experiment ``tests/gpu/overlap_w4_gemm.py``."""
    HALF: tl.constexpr = BLOCK_K // 2
    offs_n = off_n + tl.arange(0, BLOCK_N)
    rows = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N)
    k_byte0 = off_k // 2
    offs_h = tl.arange(0, HALF)
    packed = tl.load(w + rows[:, None].to(tl.int64) * stride_wn + k_byte0 + offs_h[None, :])
    low, high = _decode_w4(packed, s_ptr, table_ptr, rows, k_byte0, stride_sn, CODEBOOK, GROUP, USE_PTX,
                           BLOCK_N, HALF)
    if CODEBOOK:  # the planes hold the first and last 4 columns of every 8 (``ops.plane_run``)
        pairs = tl.join(tl.reshape(low, (BLOCK_N, HALF // 4, 4)), tl.reshape(high, (BLOCK_N, HALF // 4, 4)))
        levels = tl.reshape(tl.permute(pairs, (0, 1, 3, 2)), (BLOCK_N, BLOCK_K))
    else:
        levels = tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K))  # byte j's two nibbles: columns 2j, 2j + 1
    offs_k = off_k + tl.arange(0, BLOCK_K)
    tl.store(out + offs_n[:, None].to(tl.int64) * stride_on + offs_k[None, :], levels, mask=(offs_n < N)[:, None])


@triton.jit
def _w4_expand_kernel(w, s_ptr, table_ptr, out, N, stride_wn, stride_sn, stride_on,
                      CODEBOOK: tl.constexpr, GROUP: tl.constexpr, USE_PTX: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    _expand_tile(w, s_ptr, table_ptr, out, N, tl.program_id(0) * BLOCK_N, tl.program_id(1) * BLOCK_K,
                 stride_wn, stride_sn, stride_on, CODEBOOK, GROUP, USE_PTX, BLOCK_N, BLOCK_K)


_LAUNCHER = TritonLauncher(_w4_expand_kernel)
# (device index, codebook group size) -> whether the PTX decode agreed with the gathers
_ptx_checked: dict[tuple, bool] = {}


def expand_w4_int8(packed: torch.Tensor, s_rel: torch.Tensor | None, table: torch.Tensor | None,
                   group_size: int, ptx: bool | None = None, block_k: int | None = None) -> torch.Tensor:
    """The INT8 ``[N, K]`` levels of a packed ``[N, K/2]`` 4-bit weight: signed nibbles without
    ``s_rel``/``table``, else the codebook levels ``table[s_rel, code]``. ``ptx`` (tests) forces the
    inline-PTX decode on or off; ``block_k`` (tests, benchmarks) the columns a program expands (128 or 256;
    default: 256 where K allows)."""
    n, half = packed.shape
    k = 2 * half
    if k % BLOCK_K:
        raise ValueError(f"expanding a 4-bit weight needs K ({k}) to be a multiple of {BLOCK_K}")
    if block_k is None:
        block_k = 2 * BLOCK_K if k % (2 * BLOCK_K) == 0 else BLOCK_K
    elif block_k not in (BLOCK_K, 2 * BLOCK_K) or k % block_k:
        raise ValueError(f"expand block_k must be {BLOCK_K} or {2 * BLOCK_K} and divide K ({k}), got {block_k}")
    packed = packed.view(torch.int8)
    out = torch.empty((n, k), dtype=torch.int8, device=packed.device)
    if n == 0:
        return out
    codebook = s_rel is not None
    use_ptx = _use_ptx(packed) if ptx is None else ptx
    key = (packed.device.index, group_size)
    check = ptx is None and codebook and use_ptx and key not in _ptx_checked
    if codebook and use_ptx and ptx is None and not check:
        use_ptx = _ptx_checked[key]
    if check and torch.cuda.is_current_stream_capturing():
        check, use_ptx = False, False  # the gathers, this once: no comparison inside a graph capture
    _launch(packed, s_rel, table, group_size, out, codebook, use_ptx and not check, block_k)
    if check:
        trial = torch.empty_like(out)
        _launch(packed, s_rel, table, group_size, trial, codebook, True, block_k)
        agree = bool(torch.equal(trial, out))
        if not agree:
            log.warning("LowBit: the in-register codebook decode disagrees with the table gathers when expanding "
                        "a 4-bit weight on this Triton; expanding with gathers (slower, same results)")
        _ptx_checked[key] = agree
    return out


def _launch(packed, s_rel, table, group_size, out, codebook: bool, use_ptx: bool, block_k: int) -> None:
    n, k = out.shape
    _LAUNCHER.launch((-(-n // BLOCK_N), k // block_k),
                     (packed, s_rel.view(torch.uint8) if codebook else packed, table if codebook else packed, out,
                      n, packed.stride(0), s_rel.stride(0) if codebook else 0, out.stride(0)),
                     dict(CODEBOOK=codebook, GROUP=group_size if codebook else 16, USE_PTX=use_ptx,
                          BLOCK_N=BLOCK_N, BLOCK_K=block_k),
                     num_warps=4, num_stages=1)
