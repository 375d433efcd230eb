"""Triton: W8A8 GEMM (INT8 or FP8 e4m3 codes) with the scale / shift / bias epilogue.

``out[m, n] = float32(sum_k A[m, k] * B[n, k]) * a_scale[m] * b_scale[n]
              (+ row_shift[m] * col_shift[n]) (+ bias[n])``

``A`` is ``[M, K]`` row-major (the quantized activation), ``B`` is ``[N, K]`` row-major (the
weight as stored), so both operands are K-major, which is what the 8-bit tensor-core paths want
(``wgmma`` on sm_90, ``mma`` on sm_80/sm_89). INT8 accumulates exactly in int32, FP8 in fp32.
``b_scale`` is per output channel or one value (per-tensor); ``row_shift``/``col_shift`` is the
rank-1 term HadaNorm uses to add the token mean back (``mu[m] * rowsum(W)[n]``).

Programs are ordered in groups of ``GROUP_M`` row-tiles so that consecutive programs reuse the
same weight columns from L2. Out-of-range rows/columns are read from clamped (valid) addresses
and never stored, so interior tiles need no load masks; a ragged K uses masked loads.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .gemm_config import GemmConfig
from .launcher import TritonLauncher, constant_tensor, tma_descriptor


@functools.lru_cache(maxsize=8)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the CPU interpreter: a few programs, so the persistent loop is exercised
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_pid_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _scaled(acc, a_scale_ptr, b_scale_ptr, bias_ptr, row_shift_ptr, col_shift_ptr, offs_m, offs_n, M, N,
            B_SCALE_PER_N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SHIFT: tl.constexpr):
    """The fp32 output tile: ``acc * a_scale * b_scale (+ row_shift * col_shift) (+ bias)``."""
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_scale = tl.load(a_scale_ptr + offs_m, mask=m_ok, other=0.0)
    if B_SCALE_PER_N:
        b_scale = tl.load(b_scale_ptr + offs_n, mask=n_ok, other=0.0)
    else:
        b_scale = tl.load(b_scale_ptr + offs_n * 0)
    out = acc.to(tl.float32) * a_scale[:, None] * b_scale[None, :]
    if HAS_SHIFT:
        row_shift = tl.load(row_shift_ptr + offs_m, mask=m_ok, other=0.0)
        col_shift = tl.load(col_shift_ptr + offs_n, mask=n_ok, other=0.0)
        out = out + row_shift[:, None] * col_shift[None, :]
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    return out


@triton.jit
def _epilogue(acc, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, row_shift_ptr, col_shift_ptr,
              offs_m, offs_n, M, N, stride_cm,
              B_SCALE_PER_N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SHIFT: tl.constexpr):
    out = _scaled(acc, a_scale_ptr, b_scale_ptr, bias_ptr, row_shift_ptr, col_shift_ptr, offs_m, offs_n, M, N,
                  B_SCALE_PER_N, HAS_BIAS, HAS_SHIFT)
    c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _store_out(acc, c, a_scale_ptr, b_scale_ptr, bias_ptr, row_shift_ptr, col_shift_ptr, off_m, off_n, M, N,
               stride_cm, B_SCALE_PER_N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SHIFT: tl.constexpr,
               TMA_STORE: tl.constexpr, SUBTILE: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Write one output tile: through the TMA store descriptor ``c`` (``TMA_STORE``; rows and columns
    past the descriptor's shape are clipped by the copy engine; ``SUBTILE``: as two ``BLOCK_N / 2``
    halves, so the staging buffer is half the tile), or with masked stores through the pointer ``c``."""
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    if TMA_STORE:
        out = _scaled(acc, a_scale_ptr, b_scale_ptr, bias_ptr, row_shift_ptr, col_shift_ptr, offs_m, offs_n, M, N,
                      B_SCALE_PER_N, HAS_BIAS, HAS_SHIFT)
        if SUBTILE:
            halves = tl.permute(tl.reshape(out, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            c.store([off_m, off_n], left.to(c.dtype))
            c.store([off_m, off_n + BLOCK_N // 2], right.to(c.dtype))
        else:
            c.store([off_m, off_n], out.to(c.dtype))
    else:
        _epilogue(acc, c, a_scale_ptr, b_scale_ptr, bias_ptr, row_shift_ptr, col_shift_ptr,
                  offs_m, offs_n, M, N, stride_cm, B_SCALE_PER_N, HAS_BIAS, HAS_SHIFT)


@triton.jit
def _split_k_total(acc, ws_ptr, lock_ptr, tile, split, SPLIT_K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split-K in one launch: program ``(tile, split)`` leaves its int32 partial tile in the workspace and
    counts itself in on the tile's lock; the program that arrives last adds the other shares to its own
    (integer sums: exact, in any order) and returns ``(sum, True)``, the others ``(acc, False)`` and stop.
    The last one also puts the lock back to zero, so the next launch finds it as the allocation left it
    (:func:`split_k_workspace`): no zeroing launch, and the launch can be replayed."""
    TILE: tl.constexpr = BLOCK_M * BLOCK_N
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    base = ws_ptr + tile.to(tl.int64) * (SPLIT_K * TILE)
    tl.store(base + split * TILE + offs, acc, cache_modifier=".cg")
    tl.debug_barrier()  # every thread's share is written before the count (release at GPU scope)
    arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLIT_K - 1
    if last:
        for s in tl.static_range(SPLIT_K):
            if s != split:
                acc += tl.load(base + s * TILE + offs, cache_modifier=".cg")
        tl.atomic_xchg(lock_ptr + tile, 0, sem="relaxed", scope="gpu")
    return acc, last


@triton.jit
def _w8a8_mm_kernel(
    a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, row_shift_ptr, col_shift_ptr, ws_ptr, lock_ptr,
    M, N, K, stride_am, stride_bn, stride_cm, K_TILES_PER_SPLIT,
    B_SCALE_PER_N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SHIFT: tl.constexpr, ACC_INT32: tl.constexpr,
    EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """One output tile a program; with ``SPLIT_K`` > 1 (INT8 only) program ``(tile, s)`` sums the K tiles
    ``[s * K_TILES_PER_SPLIT, (s + 1) * K_TILES_PER_SPLIT)`` and the last share of a tile to finish
    writes it (:func:`_split_k_total`)."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_a = tl.max_contiguous(tl.multiple_of(offs_m % M, BLOCK_M), BLOCK_M)
    rows_b = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    first = 0
    if SPLIT_K > 1:
        first = tl.program_id(1) * K_TILES_PER_SPLIT
        k_tiles = tl.minimum(k_tiles, first + K_TILES_PER_SPLIT)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows_a[:, None].to(tl.int64) * stride_am + (first * BLOCK_K + offs_k)[None, :]
    b_ptrs = b_ptr + rows_b[:, None].to(tl.int64) * stride_bn + (first * BLOCK_K + offs_k)[None, :]
    if ACC_INT32:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(first, k_tiles):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        elif ACC_INT32:
            k_ok = offs_k[None, :] < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok, other=0)
            b = tl.load(b_ptrs, mask=k_ok, other=0)
        else:  # FP8 codes: the fill must be a float (an integer 0 does not cast to e4m3)
            k_ok = offs_k[None, :] < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok, other=0.0)
            b = tl.load(b_ptrs, mask=k_ok, other=0.0)
        if ACC_INT32:
            acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(a, tl.trans(b), acc, out_dtype=tl.float32)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if SPLIT_K > 1:
        acc, last = _split_k_total(acc, ws_ptr, lock_ptr, tl.program_id(0), tl.program_id(1), SPLIT_K,
                                   BLOCK_M, BLOCK_N)
        if last:
            _epilogue(acc, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, row_shift_ptr, col_shift_ptr,
                      offs_m, offs_n, M, N, stride_cm, B_SCALE_PER_N, HAS_BIAS, HAS_SHIFT)
    else:
        _epilogue(acc, c_ptr, a_scale_ptr, b_scale_ptr, bias_ptr, row_shift_ptr, col_shift_ptr,
                  offs_m, offs_n, M, N, stride_cm, B_SCALE_PER_N, HAS_BIAS, HAS_SHIFT)


@triton.jit
def _w8a8_mm_tma_kernel(
    a_desc, b_desc, c, a_scale_ptr, b_scale_ptr, bias_ptr, row_shift_ptr, col_shift_ptr, ws_ptr, lock_ptr,
    M, N, K, stride_cm, K_TILES_PER_SPLIT,
    B_SCALE_PER_N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SHIFT: tl.constexpr, ACC_INT32: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, TMA_STORE: tl.constexpr, SUBTILE: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """sm_90 variant: operand tiles arrive by TMA (the bulk tensor copy engine); out-of-range rows
    and a ragged K are zero-filled by the copy engine, so no masks at all. ``SPLIT_K`` as in
    :func:`_w8a8_mm_kernel`."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    k_tiles = tl.cdiv(K, BLOCK_K)
    first = 0
    if SPLIT_K > 1:
        first = tl.program_id(1) * K_TILES_PER_SPLIT
        k_tiles = tl.minimum(k_tiles, first + K_TILES_PER_SPLIT)
    if ACC_INT32:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(first, k_tiles, warp_specialize=WARP_SPECIALIZE):
        a = a_desc.load([off_m, k * BLOCK_K])
        b = b_desc.load([off_n, k * BLOCK_K])
        if ACC_INT32:
            acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(a, b.T, acc, out_dtype=tl.float32)
    if SPLIT_K > 1:
        acc, last = _split_k_total(acc, ws_ptr, lock_ptr, tl.program_id(0), tl.program_id(1), SPLIT_K,
                                   BLOCK_M, BLOCK_N)
        if last:
            _store_out(acc, c, a_scale_ptr, b_scale_ptr, bias_ptr, row_shift_ptr, col_shift_ptr, off_m, off_n,
                       M, N, stride_cm, B_SCALE_PER_N, HAS_BIAS, HAS_SHIFT, TMA_STORE, SUBTILE, BLOCK_M, BLOCK_N)
    else:
        _store_out(acc, c, a_scale_ptr, b_scale_ptr, bias_ptr, row_shift_ptr, col_shift_ptr, off_m, off_n, M, N,
                   stride_cm, B_SCALE_PER_N, HAS_BIAS, HAS_SHIFT, TMA_STORE, SUBTILE, BLOCK_M, BLOCK_N)


@triton.jit
def _w8a8_mm_persistent_kernel(
    a_desc, b_desc, c, a_scale_ptr, b_scale_ptr, bias_ptr, row_shift_ptr, col_shift_ptr,
    M, N, K, stride_cm,
    B_SCALE_PER_N: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SHIFT: tl.constexpr, ACC_INT32: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, TMA_STORE: tl.constexpr, SUBTILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """sm_90 persistent variant: one program per SM walks the output tiles; with ``flatten`` the
    pipeliner overlaps a tile's epilogue with the next tile's TMA loads."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_group = GROUP_M * num_pid_n
    for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, NUM_PROGRAMS, flatten=True):
        group = tile // per_group
        first_m = group * GROUP_M
        group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % group_rows
        pid_n = (tile % per_group) // group_rows
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        if ACC_INT32:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        else:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_tiles):
            a = a_desc.load([off_m, k * BLOCK_K])
            b = b_desc.load([off_n, k * BLOCK_K])
            if ACC_INT32:
                acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
            else:
                acc = tl.dot(a, b.T, acc, out_dtype=tl.float32)
        _store_out(acc, c, a_scale_ptr, b_scale_ptr, bias_ptr, row_shift_ptr, col_shift_ptr, off_m, off_n, M, N,
                   stride_cm, B_SCALE_PER_N, HAS_BIAS, HAS_SHIFT, TMA_STORE, SUBTILE, BLOCK_M, BLOCK_N)


def w8a8_mm_triton(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                   bias: torch.Tensor | None, row_shift: torch.Tensor | None, col_shift: torch.Tensor | None,
                   out_dtype: torch.dtype, config: GemmConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch :func:`_w8a8_mm_kernel`; inputs already validated by the op (contiguous, matching K).

    ``out`` (tests: a poisoned buffer) receives the result when given.
    """
    if config.stream_k:
        raise ValueError(f"{config.name}: stream-K is a W4 GEMM option; the W8A8 GEMM has no stream-K form")
    m, k = a.shape
    n = b.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device) if out is None else out
    if m == 0 or n == 0:
        return out
    tiles = -(-m // config.block_m) * -(-n // config.block_n)
    args = (bias if bias is not None else a_scale, row_shift if row_shift is not None else a_scale,
            col_shift if col_shift is not None else a_scale)
    flags = dict(B_SCALE_PER_N=b_scale.numel() != 1, HAS_BIAS=bias is not None, HAS_SHIFT=row_shift is not None,
                 ACC_INT32=a.dtype == torch.int8)
    tiles_flags = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m)
    options = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    splits, per_split, ws, locks = _split_plan(a, config, tiles, k)
    grid = (tiles, splits)
    if config.tma:
        a_desc = tma_descriptor(a, (config.block_m, config.block_k))
        b_desc = tma_descriptor(b, (config.block_n, config.block_k))
        tma_store = config.tma_store and _tma_storable(out)
        c = tma_descriptor(out, (config.block_m, config.block_n // (2 if config.subtile else 1))) if tma_store else out
        store = dict(TMA_STORE=tma_store, SUBTILE=tma_store and config.subtile)
        if config.persistent:
            programs = min(tiles, _sm_count(a.device))
            _PERSISTENT.launch((programs,), (a_desc, b_desc, c, a_scale, b_scale, *args, m, n, k, out.stride(0)),
                               dict(**flags, NUM_PROGRAMS=programs, **store, **tiles_flags), **options)
        else:
            _TMA.launch(grid, (a_desc, b_desc, c, a_scale, b_scale, *args, ws, locks, m, n, k, out.stride(0),
                               per_split),
                        dict(**flags, WARP_SPECIALIZE=config.warp_specialize, **store, SPLIT_K=splits, **tiles_flags),
                        **options)
    else:
        _POINTER.launch(grid, (a, b, out, a_scale, b_scale, *args, ws, locks, m, n, k, a.stride(0), b.stride(0),
                               out.stride(0), per_split),
                        dict(**flags, EVEN_K=k % config.block_k == 0, SPLIT_K=splits, **tiles_flags), **options)
    return out


def _split_plan(a: torch.Tensor, config: GemmConfig, tiles: int, k: int) -> tuple:
    """:func:`split_k_shares` for an INT8 or FP8 GEMM (FP8 codes refused: their sums depend on the order)."""
    if config.split_k > 1 and a.dtype != torch.int8:
        raise ValueError(f"split-K config {config.name} sums INT8 products exactly in int32; FP8 codes ({a.dtype}) "
                         f"take a config without -k")
    return split_k_shares(a, config, tiles, -(-k // config.block_k))


def split_k_shares(a: torch.Tensor, config: GemmConfig, tiles: int, k_tiles: int) -> tuple:
    """``(splits, K tiles per split, workspace, locks)`` for a launch of ``config`` over ``tiles`` output tiles
    and ``k_tiles`` K tiles: ``splits`` is 1 (and the workspace and locks placeholders, ``a``) unless the config
    splits K (not persistent), K has more than one tile to share out, and a workspace is at hand (none is
    made inside a CUDA-graph capture). No share is empty."""
    if config.split_k == 1 or config.persistent:
        return 1, 0, a, a
    per_split = -(-k_tiles // config.split_k)
    splits = -(-k_tiles // per_split)
    held = split_k_workspace(a.device, tiles * splits * config.block_m * config.block_n, tiles) if splits > 1 else None
    return (splits, per_split, *held) if held is not None else (1, 0, a, a)


# device -> (workspace, locks): the split-K scratch, grown when a launch needs more and never freed (a CUDA
# graph may hold an earlier one). One per device: the kernels of one stream run in order, and LowBit's
# layers run on the device's current stream; two split-K launches running at once on two streams of one
# device would share it.
_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_retired: list[tuple[torch.Tensor, torch.Tensor]] = []


def split_k_workspace(device: torch.device, elements: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The int32 split-K workspace (at least ``elements``) and lock counters (at least ``tiles``, all zero
    between launches: each launch's last share puts its tile's back), both kept for later launches and
    marked as replayable constants (their contents between launches never change). ``None`` where they
    would have to be allocated during a CUDA-graph capture (the zeroing would only run when the graph is
    replayed): the caller then runs the config without splitting K."""
    held = _workspaces.get(device)
    if held is not None and held[0].numel() >= elements and held[1].numel() >= tiles:
        return held
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    if held is not None:
        _retired.append(held)
        elements, tiles = max(elements, held[0].numel()), max(tiles, held[1].numel())
    held = (constant_tensor(torch.empty(elements, dtype=torch.int32, device=device)),
            constant_tensor(torch.zeros(tiles, dtype=torch.int32, device=device)))
    _workspaces[device] = held
    return held


_STORABLE = (torch.bfloat16, torch.float16, torch.float32)


def _tma_storable(out: torch.Tensor) -> bool:
    """Whether a TMA descriptor can describe ``out`` (row-major, 16-byte aligned base and row stride)."""
    return (out.dtype in _STORABLE and out.stride(1) == 1 and out.data_ptr() % 16 == 0
            and out.stride(0) * out.element_size() % 16 == 0)


_POINTER = TritonLauncher(_w8a8_mm_kernel)
_TMA = TritonLauncher(_w8a8_mm_tma_kernel)
_PERSISTENT = TritonLauncher(_w8a8_mm_persistent_kernel)
