"""Triton: 4-bit weight storage × INT8 activations, decoded in registers (no expanded weight).

The weight stays packed, ``[N, K/2]`` bytes, two nibbles a byte (low nibble = even column), as
comfy-kitchen stores it. Each program loads a ``[BLOCK_N, BLOCK_K/2]`` byte tile and decodes it
into two INT8 planes of half the tile's columns each, which feed the INT8 tensor cores directly
(Hopper has no INT4 MMA); the product is exact in int32.

No re-interleaving: the activation codes arrive with the columns of every ``BLOCK_K`` block
permuted to match the planes (``act_quant(..., perm_block=BLOCK_K, perm_run=ops.plane_run(codebook))``),
so each K step is two dots, ``A_first @ plane0.T + A_second @ plane1.T``, over contiguous halves of
the activation tile. Signed nibbles: the planes are the low nibbles (even columns) and the high
nibbles (odd columns), evens first. Codebook: the planes are the first and last 4 columns of every 8
(one 32-bit word of packed bytes), whose codes sit in the word's low and high halves.

Two decodes:

* ``CODEBOOK=False`` – signed nibbles, ``[-8, 7]`` (``convrot_w4a4``). On a GPU, one inline-PTX
  block turns each 32-bit word (4 bytes, 8 nibbles) into the two planes with ten integer
  instructions – ``((n ^ 8) + 0x78) ^ 0x80`` per byte, with no carry between bytes. The CPU
  interpreter, which cannot run PTX, uses the equivalent shifts. The per-output-channel scale is
  applied in the epilogue.
* ``CODEBOOK=True`` – grouped codes (``asym_w4a8_int8``): the level of code ``c`` in a group with
  FP8 scale byte ``s`` is ``table[s, c]`` (``reference.w4a8_level_table``: 256×16 int8, 4 KiB,
  ``round(codebook[c] * fp8(s))``, exactly comfy-kitchen's decode). On a GPU, per 4 packed bytes
  (8 codes of one group) an inline-PTX block loads the group's 16-byte table row in one vector load
  and picks each code's level with byte permutes (PRMT: ``T[c & 7]`` from the row's first 8 bytes,
  ``T[8 + (c & 7)]`` from the last 8, chosen by code bit 3), 12 integer instructions for both planes
  (21 with even / odd planes, which need the codes gathered into a selector and the bytes put back in
  order); the group scale byte is read once per group. The first call of each compiled variant also
  runs the interpreter's form (byte gathers) and compares the outputs bit for bit, since the PTX
  assumes Triton hands it 4 consecutive bytes of one row (``_check_ptx_codebook``).

``SWAP_AB`` computes the transposed tile (the decoded weight as the left operand, which Hopper's
``wgmma`` can take from registers) and stores it transposed; the dispatcher measures both.

``join`` (``JOIN``) puts the two decoded planes side by side, ``[BLOCK_N, BLOCK_K]``: the first half of the
tile's K the first plane, the second half the other, which is the order the activation's permuted columns
already have. So each K step is one dot, over one activation tile (one TMA copy of ``[BLOCK_M, BLOCK_K]``),
instead of two: Triton waits for every INT8 ``wgmma`` group right after issuing it (its accumulator is int32),
and one group a K step drains the tensor cores once instead of twice. Same integer sums, same output bits.

sm_90 variants, picked by the :class:`GemmConfig` flags (the dispatcher measures them too):

* ``tma`` – the activation halves arrive by TMA (bulk tensor copies into shared memory, pipelined),
  and for signed nibbles the packed weight tile too (the codebook decode's gathers keep fewer
  registers live with the weight tile read through pointers: ``_TMA_WEIGHT``); rows past ``M`` / ``N``
  come back as zeros.
* ``tma_store`` – the scaled output tile leaves through a TMA store (the copy engine clips rows and
  columns past the output's shape); ``subtile`` stores it as two ``BLOCK_N / 2`` halves, half the
  staging buffer. The scale / bias arithmetic is the pointer epilogue's, in the same order.
* ``persistent`` – one program per SM walks the tiles in the grouped order.
* ``stream_k`` – one program per SM too, but each takes an equal, contiguous run of all tiles' K steps (tile
  after tile), so a grid of fewer tiles than SMs (M = 256 at N = 3072-15360) still keeps every SM busy; a tile
  shared between programs is summed exactly in int32 through split-K's workspace.

A flag whose requirement is missing (a GPU older than sm_90; a tensor that is not row-major with a
16-byte-aligned base and row stride) runs that part through pointers instead: same results.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl

from .backend import capability, interpreting
from .gemm_config import GemmConfig
from .launcher import TritonLauncher, tma_descriptor
from .triton_w8a8_gemm import _sm_count, _split_k_total, split_k_shares, split_k_workspace

log = logging.getLogger(__name__)


# $2: 4 packed bytes (8 codes of one group, nibble i = column i); $3: the group's FP8 scale byte,
# zero-extended ($4-$6: the same); $7: the table's address ($8-$10: the same). The table row s holds the 16 levels
# of scale s. Per plane: a PRMT selector of the 4 codes' low 3 bits (PRMT reads a selector's low 16
# bits, and bit 3 of each nibble is its sign mode, so that bit is cleared), PRMTs picking
# ``T[c & 7]`` from the table words t0:t1 and ``T[8 + (c & 7)]`` from t2:t3, and a LOP3 choosing
# between them (``m ? b : a``) by a byte mask of code bit 3: bit 3 of an odd nibble is a sign bit of
# the word, of an even nibble a sign bit of the word << 4, and a sign-replicating PRMT of those two
# spreads each to its byte. 12 integer instructions for 8 codes, after the table row's load.
# Every input is read before the first output is written (an output may share an input's register).
_CODEBOOK_PTX = tl.constexpr(
    "{ .reg .b32 sa, sb, v, a, b, c, d, ma, mb, t0, t1, t2, t3; .reg .b64 r; "
    "mul.wide.u32 r, $3, 16; add.s64 r, r, $7; "
    "ld.global.nc.v4.b32 {t0, t1, t2, t3}, [r]; "
    "and.b32 sa, $2, 0x7777; shr.u32 sb, $2, 16; and.b32 sb, sb, 0x7777; shl.b32 v, $2, 4; "
    "prmt.b32 ma, $2, v, 0x9D8C; prmt.b32 mb, $2, v, 0xBFAE; "
    "prmt.b32 a, t0, t1, sa; prmt.b32 b, t2, t3, sa; prmt.b32 c, t0, t1, sb; prmt.b32 d, t2, t3, sb; "
    "lop3.b32 $0, a, b, ma, 0xD8; lop3.b32 $1, c, d, mb, 0xD8; }")


@triton.jit
def _per_byte(t, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, GROUP: tl.constexpr):
    """``[BLOCK_N, GROUPS]`` → ``[BLOCK_N, GROUPS * GROUP / 2]``: each group's value at each of its packed bytes."""
    return tl.reshape(tl.broadcast_to(t[:, :, None], (BLOCK_N, GROUPS, GROUP // 2)), (BLOCK_N, GROUPS * GROUP // 2))


@triton.jit
def _scale_bytes(s_ptr, rows_b, k_byte0, stride_sn, GROUPS: tl.constexpr, GROUP: tl.constexpr):
    """``[BLOCK_N, GROUPS]``: the K step's group scale bytes (raw FP8 bytes), zero-extended to int32."""
    g = tl.arange(0, GROUPS)
    s_off = rows_b[:, None].to(tl.int64) * stride_sn + (k_byte0 * 2) // GROUP + g[None, :]
    return tl.load(s_ptr + s_off).to(tl.int32) & 0xFF


@triton.jit
def _decode_w4(packed, s_ptr, table_ptr, rows_b, k_byte0, stride_sn,
               CODEBOOK: tl.constexpr, GROUP: tl.constexpr, USE_PTX: tl.constexpr,
               BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """``[BLOCK_N, HALF]`` packed bytes → (low-nibble plane, high-nibble plane), int8 each."""
    if CODEBOOK and USE_PTX:
        # The group's 16 levels (table row s: 16 bytes) come in one vector load per 4 packed bytes, and
        # a byte permute (PRMT) picks each code's level from them in registers. pack=4: the 4 bytes of a
        # 32-bit register are consecutive along K and share a group (groups are 8-byte aligned runs);
        # the launcher checks this layout assumption once per variant (``_check_ptx_codebook``).
        GROUPS: tl.constexpr = 2 * HALF // GROUP
        # zero-extended: a 32-bit operand each, so nothing packs four copies of a byte into one register for the
        # assembly
        s_word = _scale_bytes(s_ptr, rows_b, k_byte0, stride_sn, GROUPS, GROUP)
        table = tl.full((BLOCK_N, HALF), 0, tl.int64) + table_ptr.to(tl.int64)
        low, high = tl.inline_asm_elementwise(_CODEBOOK_PTX, "=r,=r,r,r,r,r,r,l,l,l,l",
                                              [packed, _per_byte(s_word, BLOCK_N, GROUPS, GROUP), table],
                                              dtype=(tl.int8, tl.int8), is_pure=True, pack=4)
    elif CODEBOOK:
        GROUPS: tl.constexpr = 2 * HALF // GROUP
        s_byte = _scale_bytes(s_ptr, rows_b, k_byte0, stride_sn, GROUPS, GROUP)
        base = _per_byte(s_byte * 16, BLOCK_N, GROUPS, GROUP)
        # The codes in column order (a word's nibbles 0..7), then each word's first 4 and last 4.
        byte = packed.to(tl.int32) & 0xFF
        codes = tl.reshape(tl.join(byte & 0xF, byte >> 4), (BLOCK_N, HALF // 4, 2, 4))
        first, last = tl.split(tl.permute(codes, (0, 1, 3, 2)))
        low = tl.load(table_ptr + base + tl.reshape(first, (BLOCK_N, HALF)))
        high = tl.load(table_ptr + base + tl.reshape(last, (BLOCK_N, HALF)))
    elif USE_PTX:
        # 4 bytes a 32-bit register (pack=4). Per byte, low nibble n: t = n ^ 8 is in [0, 15], and
        # (t + 0x78) ^ 0x80 is t - 8 as a signed byte; t + 0x78 <= 0x87 never carries into the next
        # byte. The high nibble: the same on w >> 4. One block per plane: with both planes out of one
        # block, Triton 3.8 gives each plane its own layout (the swap-AB operand's and a blocked one),
        # decodes the tile twice and sends one plane through shared memory; Triton 3.6 did neither.
        low = tl.inline_asm_elementwise(
            "{ .reg .b32 t; and.b32 t, $1, 0x0F0F0F0F; xor.b32 t, t, 0x08080808; add.u32 t, t, 0x78787878; "
            "xor.b32 $0, t, 0x80808080; }", "=r,r", [packed], dtype=tl.int8, is_pure=True, pack=4)
        high = tl.inline_asm_elementwise(
            "{ .reg .b32 t; shr.u32 t, $1, 4; and.b32 t, t, 0x0F0F0F0F; xor.b32 t, t, 0x08080808; "
            "add.u32 t, t, 0x78787878; xor.b32 $0, t, 0x80808080; }", "=r,r", [packed], dtype=tl.int8, is_pure=True,
            pack=4)
    else:
        low = (packed << 4) >> 4  # int8 arithmetic shift sign-extends the low nibble
        high = packed >> 4
    return low, high


@triton.jit
def _w4_tile(a, w, s_ptr, table_ptr, off_m, off_n, M, N, k_first, k_last, stride_am, stride_wn, stride_sn,
             CODEBOOK: tl.constexpr, GROUP: tl.constexpr, USE_PTX: tl.constexpr, SWAP_AB: tl.constexpr,
             TMA_A: tl.constexpr, TMA_W: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, JOIN: tl.constexpr):
    """The int32 ``[BLOCK_M, BLOCK_N]`` product tile at ``(off_m, off_n)``, over the K tiles
    ``[k_first, k_last)`` (K is a multiple of ``BLOCK_K``: checked by the launcher).

    ``TMA_A`` / ``TMA_W``: ``a`` / ``w`` is a TMA descriptor (blocks ``[BLOCK_M, BLOCK_K / 2]`` /
    ``[BLOCK_N, BLOCK_K / 2]``: the two halves of the activation tile are two copies, so each lands in
    shared memory as the tensor-core operand it is; with ``JOIN`` one copy of ``[BLOCK_M, BLOCK_K]``); rows
    past ``M`` / ``N`` arrive as zeros. Otherwise it is a pointer, read at clamped (valid) rows."""
    HALF: tl.constexpr = BLOCK_K // 2
    offs_n = off_n + tl.arange(0, BLOCK_N)
    rows_b = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N)  # the group-scale rows (codebook)
    offs_h = tl.arange(0, HALF)
    if not TMA_A:
        offs_m = off_m + tl.arange(0, BLOCK_M)
        rows_a = tl.max_contiguous(tl.multiple_of(offs_m % M, BLOCK_M), BLOCK_M)
        if JOIN:  # the whole tile
            a_full_ptrs = (a + rows_a[:, None].to(tl.int64) * stride_am
                           + (k_first * BLOCK_K + tl.arange(0, BLOCK_K))[None, :])
        else:  # its first half (the second is HALF columns on)
            a_even_ptrs = a + rows_a[:, None].to(tl.int64) * stride_am + (k_first * BLOCK_K + offs_h)[None, :]
    if not TMA_W:
        w_ptrs = w + rows_b[:, None].to(tl.int64) * stride_wn + (k_first * HALF + offs_h)[None, :]
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(k_first, k_last):
        if JOIN:
            if TMA_A:
                a_tile = a.load([off_m, k * BLOCK_K])
            else:
                a_tile = tl.load(a_full_ptrs)
                a_full_ptrs += BLOCK_K
        elif TMA_A:
            a_even = a.load([off_m, k * BLOCK_K])
            a_odd = a.load([off_m, k * BLOCK_K + HALF])
        else:
            a_even = tl.load(a_even_ptrs)
            a_odd = tl.load(a_even_ptrs + HALF)
            a_even_ptrs += BLOCK_K
        if TMA_W:
            packed = w.load([off_n, k * HALF])
        else:
            packed = tl.load(w_ptrs)
            w_ptrs += HALF
        low, high = _decode_w4(packed, s_ptr, table_ptr, rows_b, k * HALF, stride_sn,
                               CODEBOOK, GROUP, USE_PTX, BLOCK_N, HALF)
        if JOIN:
            # the two planes side by side: the tile's first and second halves of K, as the activation's columns are
            w_tile = tl.reshape(tl.permute(tl.join(low, high), (0, 2, 1)), (BLOCK_N, BLOCK_K))
            if SWAP_AB:
                acc = tl.dot(w_tile, tl.trans(a_tile), acc, out_dtype=tl.int32)
            else:
                acc = tl.dot(a_tile, tl.trans(w_tile), acc, out_dtype=tl.int32)
        elif SWAP_AB:
            acc = tl.dot(low, tl.trans(a_even), acc, out_dtype=tl.int32)
            acc = tl.dot(high, tl.trans(a_odd), acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(a_even, tl.trans(low), acc, out_dtype=tl.int32)
            acc = tl.dot(a_odd, tl.trans(high), acc, out_dtype=tl.int32)
    if SWAP_AB:
        acc = tl.trans(acc)
    return acc


@triton.jit
def _w4_scaled(acc, a_scale_ptr, w_scale_ptr, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS: tl.constexpr):
    """The fp32 output tile ``acc * a_scale[m] * w_scale[n] (+ bias[n])``, in the W8A8 epilogue's order."""
    a_scale = tl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)
    w_scale = tl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0)
    out = acc.to(tl.float32) * a_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    return out


@triton.jit
def _w4_store(acc, c, a_scale_ptr, w_scale_ptr, bias_ptr, off_m, off_n, M, N, stride_cm,
              HAS_BIAS: tl.constexpr, TMA_STORE: tl.constexpr, SUBTILE: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Scale and write one output tile. ``TMA_STORE``: ``c`` is a TMA descriptor (block
    ``[BLOCK_M, BLOCK_N]``, or ``[BLOCK_M, BLOCK_N / 2]`` with ``SUBTILE``: two half stores, half the
    staging buffer); the copy engine clips rows and columns past the output's shape. Otherwise ``c``
    is the output pointer and the stores are masked."""
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    out = _w4_scaled(acc, a_scale_ptr, w_scale_ptr, bias_ptr, offs_m, offs_n, M, N, HAS_BIAS)
    if TMA_STORE:
        if SUBTILE:
            left, right = tl.split(tl.permute(tl.reshape(out, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            c.store([off_m, off_n], left.to(c.dtype))
            c.store([off_m, off_n + BLOCK_N // 2], right.to(c.dtype))
        else:
            c.store([off_m, off_n], out.to(c.dtype))
    else:
        c_ptrs = c + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, out.to(c.dtype.element_ty), mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.jit
def _w4a8_mm_kernel(
    a, w, c, a_scale_ptr, w_scale_ptr, bias_ptr, s_ptr, table_ptr, ws_ptr, lock_ptr,
    M, N, K, stride_am, stride_wn, stride_sn, stride_cm, K_TILES_PER_SPLIT,
    CODEBOOK: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PTX: tl.constexpr,
    SWAP_AB: tl.constexpr, TMA_A: tl.constexpr, TMA_W: tl.constexpr, TMA_STORE: tl.constexpr, SUBTILE: tl.constexpr,
    PERSISTENT: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, JOIN: tl.constexpr,
    STREAM_K: tl.constexpr,
):
    """One output tile a program, or (``PERSISTENT``) a grid of at most one program per SM walking the
    tiles in the same grouped order; with ``flatten`` the pipeliner overlaps a tile's epilogue with the
    next tile's loads. (The stride is ``tl.num_programs``, not a constexpr: a grid smaller than the SM
    count, for a small output, needs no compile of its own.) ``SPLIT_K`` > 1 (not persistent): program
    ``(tile, s)`` sums its share of the K tiles and the last share of a tile to finish writes it
    (``triton_w8a8_gemm._split_k_total``). ``STREAM_K``: the K steps of all tiles, tile after tile, are
    shared out evenly over the programs (one a SM), each taking a contiguous run of them: whole tiles are
    written directly, a tile split between programs is summed through the workspace (``K_TILES_PER_SPLIT`` is
    then its slots a tile) and written by the program that completes its count of K steps
    (:func:`_stream_k_total`)."""
    if STREAM_K:
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        k_tiles = K // BLOCK_K
        total = (num_pid_m * num_pid_n * k_tiles).to(tl.int64)
        it = (tl.program_id(0) * total // tl.num_programs(0)).to(tl.int32)
        end = ((tl.program_id(0) + 1) * total // tl.num_programs(0)).to(tl.int32)
        while it < end:
            tile = it // k_tiles
            k_first = it - tile * k_tiles
            k_last = tl.minimum(k_tiles, k_first + (end - it))
            pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
            acc = _w4_tile(a, w, s_ptr, table_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, k_first, k_last,
                           stride_am, stride_wn, stride_sn, CODEBOOK, GROUP, USE_PTX, SWAP_AB, TMA_A, TMA_W,
                           BLOCK_M, BLOCK_N, BLOCK_K, JOIN)
            whole = (k_first == 0) & (k_last == k_tiles)
            if (k_first != 0) | (k_last != k_tiles):
                acc, whole = _stream_k_total(acc, ws_ptr, lock_ptr, tile, k_last - k_first, k_tiles, total,
                                             K_TILES_PER_SPLIT, BLOCK_M, BLOCK_N)
            if whole:
                _w4_store(acc, c, a_scale_ptr, w_scale_ptr, bias_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N,
                          stride_cm, HAS_BIAS, TMA_STORE, SUBTILE, BLOCK_M, BLOCK_N)
            it += k_last - k_first
    elif PERSISTENT:
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), num_pid_m * num_pid_n, tl.num_programs(0), flatten=True):
            pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
            acc = _w4_tile(a, w, s_ptr, table_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, 0, K // BLOCK_K,
                           stride_am, stride_wn, stride_sn, CODEBOOK, GROUP, USE_PTX, SWAP_AB, TMA_A, TMA_W,
                           BLOCK_M, BLOCK_N, BLOCK_K, JOIN)
            _w4_store(acc, c, a_scale_ptr, w_scale_ptr, bias_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, stride_cm,
                      HAS_BIAS, TMA_STORE, SUBTILE, BLOCK_M, BLOCK_N)
    else:
        pid_m, pid_n = _grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
        k_first = 0
        k_last = K // BLOCK_K
        if SPLIT_K > 1:
            k_first = tl.program_id(1) * K_TILES_PER_SPLIT
            k_last = tl.minimum(k_last, k_first + K_TILES_PER_SPLIT)
        acc = _w4_tile(a, w, s_ptr, table_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, k_first, k_last, stride_am,
                       stride_wn, stride_sn, CODEBOOK, GROUP, USE_PTX, SWAP_AB, TMA_A, TMA_W, BLOCK_M, BLOCK_N,
                       BLOCK_K, JOIN)
        if SPLIT_K > 1:
            acc, last = _split_k_total(acc, ws_ptr, lock_ptr, tl.program_id(0), tl.program_id(1), SPLIT_K,
                                       BLOCK_M, BLOCK_N)
            if last:
                _w4_store(acc, c, a_scale_ptr, w_scale_ptr, bias_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N,
                          stride_cm, HAS_BIAS, TMA_STORE, SUBTILE, BLOCK_M, BLOCK_N)
        else:
            _w4_store(acc, c, a_scale_ptr, w_scale_ptr, bias_ptr, pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, stride_cm,
                      HAS_BIAS, TMA_STORE, SUBTILE, BLOCK_M, BLOCK_N)


@triton.jit
def _stream_k_total(acc, ws_ptr, lock_ptr, tile, steps, k_tiles, total, slots, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """Stream-K's shared tiles: the program leaves its partial tile (``steps`` of the tile's ``k_tiles`` K steps) in
    the tile's workspace slot of its rank among the programs that share the tile (at most ``slots``), then counts
    its steps in on the tile's lock; the program whose steps complete the count adds the other ranks' partial tiles
    to its own (integer sums: exact, in any order), puts the lock back to zero and returns ``(sum, True)``; the
    others ``(acc, False)``. Plain stores and loads, as split-K's (``_split_k_total``): a first form that added the
    partial tiles into a zeroed workspace with atomic adds was slower than the whole-tile kernel (GPU, Session 43)."""
    TILE: tl.constexpr = BLOCK_M * BLOCK_N
    progs = tl.num_programs(0).to(tl.int64)
    # the programs holding the tile's first and last K steps: program p starts at step p * total // progs
    first = ((tile.to(tl.int64) * k_tiles + 1) * progs - 1) // total
    last_pid = (((tile.to(tl.int64) + 1) * k_tiles) * progs - 1) // total
    rank = tl.program_id(0) - first
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    base = ws_ptr + tile.to(tl.int64) * slots * TILE
    tl.store(base + rank * TILE + offs, acc, cache_modifier=".cg")
    tl.debug_barrier()  # every thread's part is written before the count (release at GPU scope)
    done = tl.atomic_add(lock_ptr + tile, steps, sem="acq_rel", scope="gpu") + steps
    last = done == k_tiles
    if last:
        for r in range(0, last_pid - first + 1):
            if r != rank:
                acc += tl.load(base + r * TILE + offs, cache_modifier=".cg")
        tl.atomic_xchg(lock_ptr + tile, 0, sem="relaxed", scope="gpu")
    return acc, last


@triton.jit
def _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile ``tile``'s (row, column) in groups of ``GROUP_M`` row-tiles (consecutive tiles share
    weight columns in L2); the order of ``triton_w8a8_gemm._tile_ids``."""
    per_group = GROUP_M * num_pid_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows


def w4a8_mm_triton(a: torch.Tensor, packed: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None, s_rel: torch.Tensor | None, table: torch.Tensor | None,
                   group_size: int, out_dtype: torch.dtype, config: GemmConfig,
                   out: torch.Tensor | None = None, ptx: bool | None = None) -> torch.Tensor:
    """Launch :func:`_w4a8_mm_kernel`. ``a``'s columns must be permuted in blocks of ``config.block_k``
    in runs of ``ops.plane_run(codebook)`` (``ops.permute_columns(a, config.block_k, ops.plane_run(codebook))``).
    ``s_rel``/``table`` given ⇒ codebook decode (a group size that is a multiple of 8), else signed nibbles.

    The config's flags pick the variant: ``tma`` (operand tiles through TMA descriptors),
    ``tma_store`` / ``subtile`` (the output tile through a TMA store, whole or in two halves),
    ``persistent`` (one program per SM), ``swap_ab``. The TMA flags need sm_90 (or the CPU
    interpreter) and tensors a descriptor can describe; where either is missing, that part runs
    through pointers (same results). ``out`` (tests: a poisoned buffer) receives the result when given.
    ``ptx`` (tests) forces the inline-PTX decode on or off; by default it runs on a GPU, for the codebook
    only once :func:`_check_ptx_codebook` has seen this variant agree with the gather decode.
    """
    m, k = a.shape
    n = packed.shape[0]
    if k % config.block_k:
        raise ValueError(f"the 4-bit GEMM needs K ({k}) to be a multiple of its K tile ({config.block_k})")
    out = torch.empty((m, n), dtype=out_dtype, device=a.device) if out is None else out
    if m == 0 or n == 0:
        return out
    codebook = s_rel is not None
    if codebook and group_size % 8:
        raise ValueError(f"the codebook decode needs groups of whole 8-code words, got group_size {group_size}")
    tiles = -(-m // config.block_m) * -(-n // config.block_n)
    half = config.block_k // 2
    tma_ok = _tma_device(a.device)
    tma_a = config.tma and tma_ok and _describable(a)
    tma_w = config.tma and tma_ok and _describable(packed) and _TMA_WEIGHT[codebook]
    tma_store = config.tma_store and tma_ok and out.dtype in _STORABLE and _describable(out)
    subtile = tma_store and config.subtile
    a_arg = tma_descriptor(a, (config.block_m, config.block_k if config.join else half)) if tma_a else a
    w_arg = tma_descriptor(packed, (config.block_n, half)) if tma_w else packed
    c_arg = tma_descriptor(out, (config.block_m, config.block_n // (2 if subtile else 1))) if tma_store else out
    programs = min(tiles, _sm_count(a.device)) if config.persistent else tiles
    splits, per_split, ws, locks = split_k_shares(a, config, tiles, k // config.block_k)
    stream_k = config.stream_k
    if stream_k:  # one program a SM (at most one a K step); without a workspace (a graph capture), one a tile
        k_tiles = k // config.block_k
        sk_programs = min(_sm_count(a.device), tiles * k_tiles)
        # a tile's K steps meet at most this many programs' runs (each at least total // programs steps long)
        per_split = (k_tiles - 2) // (tiles * k_tiles // sk_programs) + 2
        held = split_k_workspace(a.device, tiles * per_split * config.block_m * config.block_n, tiles)
        if held is not None:
            ws, locks = held
            programs = sk_programs
    grid = (programs, splits)
    constexprs = kernel_constexprs(config, codebook=codebook, group_size=group_size, has_bias=bias is not None,
                                   use_ptx=_use_ptx(a) if ptx is None else ptx, tma_a=tma_a, tma_w=tma_w,
                                   tma_store=tma_store, splits=splits, stream_k=stream_k)
    args = (a_arg, w_arg, c_arg, a_scale, w_scale, bias if bias is not None else a_scale,
            s_rel.view(torch.uint8) if codebook else packed, table if codebook else packed, ws, locks,
            m, n, k, a.stride(0), packed.stride(0), s_rel.stride(0) if codebook else 0, out.stride(0), per_split)
    if ptx is None and codebook and constexprs["USE_PTX"]:
        key = (a.device.index, config.name, out_dtype, tma_a, tma_w, tma_store, bias is not None, group_size)
        verdict = _ptx_checked.get(key)
        if verdict is None and not torch.cuda.is_current_stream_capturing():
            _check_ptx_codebook(args, constexprs, config, grid, out, key)
            return out
        constexprs["USE_PTX"] = bool(verdict)  # inside a graph capture, before any check: the gathers, this once
    _LAUNCHER.launch(grid, args, constexprs, num_warps=config.num_warps, num_stages=config.num_stages)
    return out


# The codebook's PTX decode assumes that the 4 bytes Triton hands one inline-assembly instance are
# consecutive along K in one row (so they share a group). That is how Triton 3.x lays out these tiles,
# but it is Triton's choice: the first call of each compiled variant in a process also runs the gather
# decode and compares the two outputs bit for bit; a variant that disagrees keeps the gathers (and
# says so in the log).
_ptx_checked: dict[tuple, bool] = {}


def _check_ptx_codebook(args: tuple, constexprs: dict, config: GemmConfig, grid: tuple, out: torch.Tensor,
                        key: tuple) -> None:
    """Run the variant with the gather decode into ``out`` and with the PTX decode into a second
    buffer; keep the verdict under ``key`` (what selects the compiled variant: device, config, output
    dtype, the TMA flags, bias, group size). ``args[2]`` (the output or its TMA descriptor) is rebuilt
    for the second run."""
    gathers = dict(constexprs, USE_PTX=False)
    _LAUNCHER.launch(grid, args, gathers, num_warps=config.num_warps, num_stages=config.num_stages)
    trial = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=out.device)
    c_arg = trial
    if constexprs["TMA_STORE"]:
        c_arg = tma_descriptor(trial, (config.block_m, config.block_n // (2 if constexprs["SUBTILE"] else 1)))
    _LAUNCHER.launch(grid, args[:2] + (c_arg,) + args[3:16] + (trial.stride(0),) + args[17:], constexprs,
                     num_warps=config.num_warps, num_stages=config.num_stages)
    verdict = bool(torch.equal(trial, out))
    if not verdict:
        log.warning("LowBit: the in-register codebook decode disagrees with the table gathers for the W4 "
                    "GEMM config %s on this Triton; that config decodes with gathers (slower, same results)",
                    config.name)
    _ptx_checked[key] = verdict


def kernel_constexprs(config: GemmConfig, *, codebook: bool, group_size: int, has_bias: bool, use_ptx: bool,
                      tma_a: bool, tma_w: bool, tma_store: bool, splits: int = 1, stream_k: bool = False) -> dict:
    """The constexpr arguments of :func:`_w4a8_mm_kernel`, in parameter order, for one variant
    (also what an offline compile of the variant needs: ``tests/gpu/sweep_w4_gemm.py --compile-only``)."""
    return dict(CODEBOOK=codebook, GROUP=group_size if codebook else 16, HAS_BIAS=has_bias, USE_PTX=use_ptx,
                SWAP_AB=config.swap_ab, TMA_A=tma_a, TMA_W=tma_w, TMA_STORE=tma_store,
                SUBTILE=tma_store and config.subtile, PERSISTENT=config.persistent, SPLIT_K=splits,
                BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
                JOIN=config.join, STREAM_K=stream_k)


_LAUNCHER = TritonLauncher(_w4a8_mm_kernel)
# By weight kind (codebook?): whether ``tma`` brings the packed weight tile by TMA too, or only the activation.
# Offline sm_90 compiles (Triton 3.8, ptxas -v): with signed nibbles TMA weight tiles spill no register in any
# listed config; with the codebook's table gathers they spill 100-420 bytes where pointer loads spill 24-84
# (4-warp and 128x256 tiles; 8-warp 128x128: none either way, 132 registers instead of 202).
# tests/gpu/sweep_w4_gemm.py measures the other choice too ("+alt-weight-load").
_TMA_WEIGHT = {False: True, True: False}
_STORABLE = (torch.bfloat16, torch.float16, torch.float32)


def _use_ptx(a: torch.Tensor) -> bool:
    return a.is_cuda and not interpreting()


def _tma_device(device: torch.device) -> bool:
    """TMA descriptors: sm_90 and newer on a GPU; the CPU interpreter emulates them."""
    return capability(device) >= (9, 0) if device.type == "cuda" else interpreting()


def _describable(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor can describe ``t``: row-major, 16-byte aligned base and row stride."""
    return (t.dim() == 2 and t.stride(1) == 1 and t.data_ptr() % 16 == 0
            and t.stride(0) * t.element_size() % 16 == 0)
