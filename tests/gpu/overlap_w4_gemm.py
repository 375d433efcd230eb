"""An experiment, not wired into the dispatcher: a 4-bit weight expanded to INT8 and multiplied in one launch.

Measured slower than the two launches it would replace on every shape (Session 42, an H100, docs/kernels.md):
run by ``bench_w4_overlap.py``, tested in the CPU interpreter by ``tests/test_kernels_w4.py``.

``triton_w4_expand`` then ``triton_w8a8_gemm`` (the ``triton:expand-`` candidates) run one after the other:
at 256 rows the expand costs about as much as bf16's whole product, and the GEMM that follows has only 24-96
output tiles for 132 SMs. Here both run in one launch. Each program first takes a ticket from a counter; the
first ``decodes`` tickets are decode tasks (``DEC_N`` rows x ``DEC_K`` columns of the levels, with the expand
kernel's tile function, then a release flag), the rest are output tiles of the W8A8 GEMM, ordered by weight
rows as the decode tasks are. An output tile waits until the decode tasks of its weight rows have raised
their flags (acquire), then runs the INT8 product over the whole of K and the scale epilogue. So the GEMM of
the first rows runs beside the decode of later ones, on SMs the small GEMM would leave idle.

Tickets, not program ids, order the work: a program holding an output tile only exists once every decode
task has been handed to a running program, and decode tasks wait on nothing, so no launch order of the
programs can deadlock. The last program to finish puts the counters and flags back to zero (the split-K
lock counters, ``triton_w8a8_gemm.split_k_workspace``, zero between launches), so launches can be replayed
and captured. Like split-K, two of these launches must not run at once on two streams of one device.

The expanded levels are a temporary ``N x K`` INT8 tensor, as for ``triton:expand-``; the integer sums and
the epilogue are the W8A8 GEMM's, so the output is that candidate's (and the in-register W4 kernel's) bit
for bit. Why it loses: the whole kernel runs at the GEMM config's shared memory, so few decode tasks share an
SM (the expand kernel alone runs many small programs a SM), and output tiles that wait hold SM slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowbit.kernels.gemm_config import GemmConfig, w4_expand_candidates
from lowbit.kernels.launcher import TritonLauncher, tma_descriptor
from lowbit.kernels.triton_w4_expand import _expand_tile, _ptx_checked, expand_w4_int8
from lowbit.kernels.triton_w4_gemm import _describable, _tma_device, _use_ptx
from lowbit.kernels.triton_w8a8_gemm import _store_out, _tma_storable, split_k_workspace

DEC_N = 64  # weight rows a decode task expands
DEC_K = 256  # columns a decode task expands (the 4-bit formats have K % 256 == 0)
_RESET = 1024  # flags zeroed per store by the last program


@triton.jit
def _w4_overlap_kernel(
    a, w, s_ptr, table_ptr, levels, c, a_scale_ptr, b_scale_ptr, bias_ptr, sync,
    M, N, K, stride_am, stride_wn, stride_sn, stride_cm, DECODES, TOTAL,
    B_SCALE_PER_N: tl.constexpr, HAS_BIAS: tl.constexpr, CODEBOOK: tl.constexpr, GROUP: tl.constexpr,
    USE_PTX: tl.constexpr,
    TMA_A: tl.constexpr, TMA_STORE: tl.constexpr, SUBTILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DEC_N: tl.constexpr, DEC_K: tl.constexpr, WAIT: tl.constexpr, RESET: tl.constexpr,
):
    """``sync[0]``: the ticket counter, ``sync[1]``: programs finished, ``sync[2:]``: one flag per decode task."""
    ticket = tl.atomic_add(sync, 1, sem="relaxed", scope="gpu")
    flags = sync + 2
    k_chunks = K // DEC_K
    if ticket < DECODES:
        _expand_tile(w, s_ptr, table_ptr, levels, N, (ticket // k_chunks) * DEC_N, (ticket % k_chunks) * DEC_K,
                     stride_wn, stride_sn, K, CODEBOOK, GROUP, USE_PTX, DEC_N, DEC_K)
        tl.debug_barrier()  # every thread's levels are written before the flag (release at GPU scope)
        tl.atomic_xchg(flags + ticket, 1, sem="release", scope="gpu")
    else:
        tile = ticket - DECODES
        num_pid_m = tl.cdiv(M, BLOCK_M)
        off_m = (tile % num_pid_m) * BLOCK_M
        off_n = (tile // num_pid_m) * BLOCK_N
        first_block = off_n // DEC_N
        last_block = tl.minimum((off_n + BLOCK_N - 1) // DEC_N, tl.cdiv(N, DEC_N) - 1)
        offs_wait = tl.arange(0, WAIT)
        waiting = offs_wait < (last_block - first_block + 1) * k_chunks
        wait_ptrs = flags + first_block * k_chunks + offs_wait
        seen = tl.min(tl.load(wait_ptrs, mask=waiting, other=1, volatile=True))
        while seen == 0:
            seen = tl.min(tl.load(wait_ptrs, mask=waiting, other=1, volatile=True))
        tl.atomic_add(wait_ptrs, 0, mask=waiting, sem="acquire", scope="gpu")  # pairs with each flag's release
        tl.debug_barrier()

        offs_k = tl.arange(0, BLOCK_K)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        rows_b = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N)
        b_ptrs = levels + rows_b[:, None].to(tl.int64) * K + offs_k[None, :]
        if not TMA_A:
            offs_m = off_m + tl.arange(0, BLOCK_M)
            rows_a = tl.max_contiguous(tl.multiple_of(offs_m % M, BLOCK_M), BLOCK_M)
            a_ptrs = a + rows_a[:, None].to(tl.int64) * stride_am + offs_k[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for k in range(0, K // BLOCK_K):
            if TMA_A:
                a_tile = a.load([off_m, k * BLOCK_K])
            else:
                a_tile = tl.load(a_ptrs)
                a_ptrs += BLOCK_K
            b_tile = tl.load(b_ptrs, cache_modifier=".cg")  # written by other programs in this launch: not via L1
            acc = tl.dot(a_tile, tl.trans(b_tile), acc, out_dtype=tl.int32)
            b_ptrs += BLOCK_K
        _store_out(acc, c, a_scale_ptr, b_scale_ptr, bias_ptr, a_scale_ptr, a_scale_ptr, off_m, off_n, M, N,
                   stride_cm, B_SCALE_PER_N, HAS_BIAS, False, TMA_STORE, SUBTILE, BLOCK_M, BLOCK_N)
    done = tl.atomic_add(sync + 1, 1, sem="acq_rel", scope="gpu")
    if done == TOTAL - 1:  # every other program has finished: leave the counters as the allocation did
        offs_reset = tl.arange(0, RESET)
        for start in range(0, DECODES, RESET):
            tl.store(flags + start + offs_reset, 0, mask=start + offs_reset < DECODES)
        tl.atomic_xchg(sync, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(sync + 1, 0, sem="relaxed", scope="gpu")


_LAUNCHER = TritonLauncher(_w4_overlap_kernel)


def w4_overlap_candidates(cap: tuple[int, int], m: int) -> list[GemmConfig]:
    """The INT8 configs that fit the expand and GEMM in one launch: those of ``w4_expand_candidates`` that run one
    program an output tile over the whole of K."""
    return [c for c in w4_expand_candidates(cap, m) if c.split_k == 1 and not c.persistent]


def overlap_problem(k: int) -> str | None:
    """Why a weight with ``k`` columns cannot take this kernel, else ``None``."""
    return None if k % DEC_K == 0 else f"the overlapped expand needs K % {DEC_K} == 0, got {k}"


def w4_overlap_mm(a: torch.Tensor, packed: torch.Tensor, s_rel: torch.Tensor | None, table: torch.Tensor | None,
                  group_size: int,
                  a_scale: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                  config: GemmConfig, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(levels, out)``: ``out[m, n] = sum_k a[m, k] * levels[n, k] * a_scale[m] * w_scale[n] (+ bias[n])`` with the
    levels of ``packed`` (as :func:`~.triton_w4_expand.expand_w4_int8`: signed nibbles without ``s_rel`` and
    ``table``, else the codebook's) expanded into ``levels`` in the same launch. ``a`` is the INT8 activation in
    natural column order. ``None`` where the sync counters would have to be allocated inside a CUDA-graph
    capture (the caller then expands and multiplies in two launches)."""
    m, k = a.shape
    n = packed.shape[0]
    problem = overlap_problem(k)
    if problem:
        raise ValueError(problem)
    if config.split_k > 1 or config.persistent or k % config.block_k:
        raise ValueError(f"the overlapped expand runs one program an output tile over the whole of K: "
                         f"{config.name} does not fit K = {k}")
    out = torch.empty((m, n), dtype=out_dtype, device=a.device) if out is None else out
    levels = torch.empty((n, k), dtype=torch.int8, device=a.device)
    if m == 0 or n == 0:
        return levels, out
    packed = packed.view(torch.int8)
    decodes = -(-n // DEC_N) * (k // DEC_K)
    tiles = -(-m // config.block_m) * -(-n // config.block_n)
    held = split_k_workspace(a.device, 1, decodes + 2)
    if held is None:
        return None
    codebook = s_rel is not None
    use_ptx = _use_ptx(packed)
    if use_ptx and codebook:
        key = (packed.device.index, group_size)
        if key not in _ptx_checked and not torch.cuda.is_current_stream_capturing():
            expand_w4_int8(packed, s_rel, table, group_size)  # checks the PTX decode against the gathers once
        use_ptx = _ptx_checked.get(key, False)
    tma_a = config.tma and _tma_device(a.device) and _describable(a)
    a_arg = tma_descriptor(a, (config.block_m, config.block_k)) if tma_a else a
    tma_store = config.tma_store and _tma_device(a.device) and _tma_storable(out)
    subtile = tma_store and config.subtile
    c = tma_descriptor(out, (config.block_m, config.block_n // (2 if subtile else 1))) if tma_store else out
    blocks = max(config.block_n // DEC_N, 1)
    _LAUNCHER.launch(
        (decodes + tiles,),
        (a_arg, packed, s_rel.view(torch.uint8) if codebook else packed, table if codebook else packed, levels, c,
         a_scale, w_scale, bias if bias is not None else a_scale, held[1], m, n, k, a.stride(0), packed.stride(0),
         s_rel.stride(0) if codebook else 0, out.stride(0), decodes, decodes + tiles),
        dict(B_SCALE_PER_N=w_scale.numel() != 1, HAS_BIAS=bias is not None, CODEBOOK=codebook,
             GROUP=group_size if codebook else 16, USE_PTX=use_ptx,
             TMA_A=tma_a, TMA_STORE=tma_store, SUBTILE=subtile, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
             BLOCK_K=config.block_k, DEC_N=DEC_N, DEC_K=DEC_K,
             WAIT=triton.next_power_of_2(blocks * (k // DEC_K)), RESET=_RESET),
        num_warps=config.num_warps, num_stages=config.num_stages)
    return levels, out
