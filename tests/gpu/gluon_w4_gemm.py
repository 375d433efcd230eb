"""An experiment, not LowBit's product code: the W4 GEMM written in Gluon (sm_90) so that the weight
decode overlaps the tensor cores. Measured by ``sweep_w4_gluon.py``; the results are in
``docs/kernels.md`` ("Session 14"). LowBit's dispatcher does not offer it.

Why: the Triton W4 kernel (``kernels/triton_w4_gemm.py``) decodes each weight tile in registers,
stores it to shared memory and runs ``wgmma`` on it, and Triton waits for that ``wgmma`` right after
issuing it (an operand written inside the loop is not multi-buffered, so the ``wgmma`` cannot stay in
flight): decode and MMA take turns. Here the schedule is written out by hand.

* ``_w4a8_gluon_kernel``: one partition. The weight is the ``wgmma``'s left operand (the output tile
  is computed transposed: weight rows × tokens). Tile ``i``'s two decoded planes go to one of two
  shared-memory buffers and its two ``wgmma`` are issued asynchronously; the wait that retires tile
  ``i - 1``'s comes after them, so tile ``i + 1``'s decode runs while tile ``i``'s ``wgmma`` do.
  (A first version fed the decoded planes to ``wgmma`` from registers. ptxas then reused those
  registers for the next tile's decode while the ``wgmma`` still read them: wrong sums whenever two
  programs shared an SM. Triton 3.6's ``warpgroup_mma_wait`` cannot keep 8-bit values alive.)
* ``_w4a8_gluon_ws_kernel``: warp-specialized (Triton 3.6's ``gl.warp_specialize`` signature): a TMA
  loader warp, four decoder warps and the four MMA warps, meeting at mbarriers.
* Both: the activation halves (``act_quant(..., perm_block=BLOCK_K, perm_run=plane_run(codebook))``) and
  the packed weight tile arrive by TMA into a ring of ``STAGES`` stages. The codebook decode is the Triton
  kernel's inline PTX, except for the group scale byte: a row's 8 scale bytes of one K tile are one
  int64 load, and a byte permute picks each code word's (``_ROW_CODEBOOK_PTX``). The int32 sums are
  exact and the epilogue is the Triton kernel's arithmetic in the same order, so the output is the
  Triton kernel's bit for bit (checked by the sweep). Split-K uses the Triton kernels' protocol.
* ``DECODE`` (diagnostics, one-partition kernel; wrong sums): 1 leaves out the scale loads, 2 the
  table-row loads, 3 both.

Only on a CUDA GPU of compute capability 9.x with a Triton that ships Gluon (3.5 and newer): Gluon
has no CPU interpreter. :func:`gluon_problem` says why it cannot run where it cannot.
"""

from __future__ import annotations

import torch
import triton.language as tl

from lowbit.kernels.gemm_config import GemmConfig
from lowbit.kernels.triton_w8a8_gemm import split_k_shares

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError as err:  # Triton < 3.5, or a build without Gluon's NVIDIA parts
    gluon = None
    _IMPORT_ERROR = f"this Triton has no Gluon for Hopper ({err})"
else:
    _IMPORT_ERROR = None

from lowbit.kernels.triton_w4_gemm import _CODEBOOK_PTX

_NIBBLES_PTX = tl.constexpr("{ .reg .b32 t; and.b32 t, $2, 0x0F0F0F0F; xor.b32 t, t, 0x08080808; add.u32 t, t, 0x78787878; "
                "xor.b32 $0, t, 0x80808080; shr.u32 t, $2, 4; and.b32 t, t, 0x0F0F0F0F; xor.b32 t, t, 0x08080808; "
                "add.u32 t, t, 0x78787878; xor.b32 $1, t, 0x80808080; }")


def gluon_problem(device: torch.device) -> str | None:
    """Why the Gluon W4 GEMM cannot run on ``device`` (``None``: it can)."""
    if _IMPORT_ERROR:
        return _IMPORT_ERROR
    if device.type != "cuda":
        return "the Gluon W4 GEMM runs on a CUDA GPU only (Gluon has no CPU interpreter)"
    major = torch.cuda.get_device_capability(device)[0]
    if major != 9:
        return f"the Gluon W4 GEMM is written for sm_90 (wgmma); this GPU is sm_{major}x"
    return None


def _instr_n(tokens: int) -> int:
    """The wgmma instruction's N: the largest INT8 N (a multiple of 16 up to 224, or 8) dividing the
    tokens one warp column covers."""
    for n in list(range(224, 15, -16)) + [8]:
        if tokens % n == 0:
            return n
    raise ValueError(f"no wgmma N fits a token tile of {tokens}")


def _warps(block_n: int, num_warps: int) -> list[int]:
    """warps_per_cta of the [weight rows, tokens] accumulator: [4, 1] doubled along the rows while
    they last (16 rows a warp), then along the tokens."""
    warps = [4, 1]
    while warps[0] * warps[1] < num_warps:
        if block_n > 16 * warps[0]:
            warps[0] *= 2
        else:
            warps[1] *= 2
    return warps


# The codebook decode of triton_w4_gemm, its group scale byte picked from the row's 8 bytes of the tile:
# $2 the code word, $3 the 8 scale bytes ($4-$6: the same), $7 the word's group index in every byte,
# $8 the table's address ($9-$11: the same).
_ROW_CODEBOOK_PTX = tl.constexpr(_CODEBOOK_PTX.value.replace(
    "{ .reg .b32 sa, sb, v, a, b, c, d, ma, mb, t0, t1, t2, t3; .reg .b64 r; mul.wide.u32 r, $3, 16; "
    "add.s64 r, r, $7; ",
    "{ .reg .b32 x, sa, sb, v, a, b, c, d, ma, mb, t0, t1, t2, t3, lo, hi; .reg .b64 r; mov.b64 {lo, hi}, $3; "
    "prmt.b32 x, lo, hi, $7; and.b32 x, x, 0xFF; mul.wide.u32 r, x, 16; add.s64 r, r, $8; "))
assert _ROW_CODEBOOK_PTX.value != _CODEBOOK_PTX.value

# Diagnostics only (``DECODE`` > 0 gives wrong sums): 1 = the group scale bytes not loaded (a constant
# scale), 2 = the table row not loaded (its words made from the codes), 3 = both.
_ROW_CODEBOOK_PTX_NO_TABLE = tl.constexpr(_ROW_CODEBOOK_PTX.value.replace(
    "ld.global.nc.v4.b32 {t0, t1, t2, t3}, [r];", "cvt.u32.u64 t0, r; xor.b32 t1, t0, $2; add.u32 t2, t0, $2; "
    "or.b32 t3, t1, x;"))


if gluon is not None:

    @gluon.jit
    def _tile_offsets(tile, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
        """The (token, weight row) offsets of output tile ``tile``, in groups of GROUP_M token tiles (the order
        of the Triton kernels)."""
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_pid_n
        first_m = (tile // per_group) * GROUP_M
        group_rows = gl.minimum(num_pid_m - first_m, GROUP_M)
        return (first_m + (tile % per_group) % group_rows) * BLOCK_M, ((tile % per_group) // group_rows) * BLOCK_N

    @gluon.jit
    def _codebook_operands(s_ptr, table_ptr, N, off_n, k_first, stride_sn, layout: gl.constexpr, GROUP: gl.constexpr,
                           BLOCK_N: gl.constexpr, HALF: gl.constexpr):
        """For the codebook decode of ``[BLOCK_N, HALF]`` packed tiles in ``layout``: the pointers to each row's
        first-tile int64 of scale bytes (``s_ptr`` views the scales as int64; ``+ i`` for tile ``i``), the table
        address and each code word's group number (0-7, every tile the same)."""
        rows = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        s_ptrs = s_ptr + (rows % N).to(gl.int64) * stride_sn + k_first
        cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
        table = gl.full([BLOCK_N, HALF], 0, gl.int64, layout=layout) + table_ptr.to(gl.int64)
        gsel = gl.full([BLOCK_N, HALF], 0, gl.uint8, layout=layout) + ((2 * cols) // GROUP).to(gl.uint8)[None, :]
        return s_ptrs, table, gsel

    @gluon.jit
    def _decode_codebook(packed, s_words, gsel, table, DECODE: gl.constexpr):
        """The two INT8 planes of codebook codes (``_ROW_CODEBOOK_PTX``; ``DECODE`` >= 2: without the table
        loads, a diagnostic)."""
        if DECODE >= 2:
            return gl.inline_asm_elementwise(_ROW_CODEBOOK_PTX_NO_TABLE, "=r,=r,r,l,l,l,l,r,l,l,l,l",
                                             [packed, s_words, gsel, table], dtype=(gl.int8, gl.int8), is_pure=True,
                                             pack=4)
        return gl.inline_asm_elementwise(_ROW_CODEBOOK_PTX, "=r,=r,r,l,l,l,l,r,l,l,l,l", [packed, s_words, gsel, table],
                                         dtype=(gl.int8, gl.int8), is_pure=True, pack=4)

    @gluon.jit
    def _decode_nibbles(packed):
        """The two INT8 planes of signed nibbles (the Triton kernel's PTX)."""
        return gl.inline_asm_elementwise(_NIBBLES_PTX, "=r,=r,r", [packed], dtype=(gl.int8, gl.int8), is_pure=True,
                                         pack=4)

    @gluon.jit
    def _k_share(K, K_TILES_PER_SPLIT, BLOCK_K: gl.constexpr, SPLIT_K: gl.constexpr):
        """(first K tile, K tile count) of this program's K share (``program_id(1)``; all of K without split-K)."""
        k_first = 0
        k_tiles = K // BLOCK_K
        if SPLIT_K > 1:
            k_first = gl.program_id(1) * K_TILES_PER_SPLIT
            k_tiles = gl.minimum(k_tiles - k_first, K_TILES_PER_SPLIT)
        return k_first, k_tiles

    @gluon.jit
    def _epilogue(acc, c, a_scale_ptr, w_scale_ptr, bias_ptr, ws_ptr, lock_ptr, M, N, off_m, off_n, tile, stride_cm,
                  mma: gl.constexpr, HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr, BLOCK_N: gl.constexpr,
                  BLOCK_M: gl.constexpr):
        """Write the transposed int32 tile ``acc`` ([weight rows, tokens]) scaled as the Triton kernel does,
        ``(acc * a_scale[m]) * w_scale[n] + bias[n]`` in fp32. With SPLIT_K > 1, the Triton kernels' split-K
        protocol (``triton_w8a8_gemm._split_k_total``): each K share leaves its tile in the workspace and counts
        itself in; the last to arrive adds the others, puts the count back to zero and writes the tile."""
        offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
        offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
        last = True
        if SPLIT_K > 1:
            TILE: gl.constexpr = BLOCK_M * BLOCK_N
            offs = (gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))[:, None] * BLOCK_M
                    + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))[None, :])
            base = ws_ptr + tile.to(gl.int64) * (SPLIT_K * TILE)
            split = gl.program_id(1)
            gl.store(base + split * TILE + offs, acc, cache_modifier=".cg")
            gl.thread_barrier()
            arrived = gl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu")
            last = arrived == SPLIT_K - 1
            if last:
                for s in gl.static_range(SPLIT_K):
                    if s != split:
                        acc += gl.load(base + s * TILE + offs, cache_modifier=".cg")
                gl.atomic_xchg(lock_ptr + tile, 0, sem="relaxed", scope="gpu")
        if last:
            a_scale = gl.load(a_scale_ptr + offs_m, mask=offs_m < M, other=0.0)
            w_scale = gl.load(w_scale_ptr + offs_n, mask=offs_n < N, other=0.0)
            out = acc.to(gl.float32) * a_scale[None, :] * w_scale[:, None]
            if HAS_BIAS:
                out = out + gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(gl.float32)[:, None]
            c_ptrs = c + offs_m[None, :].to(gl.int64) * stride_cm + offs_n[:, None]
            gl.store(c_ptrs, out.to(c.dtype.element_ty), mask=(offs_m < M)[None, :] & (offs_n < N)[:, None])


    @gluon.jit
    def _w4a8_gluon_kernel(a_desc, w_desc, c, a_scale_ptr, w_scale_ptr, bias_ptr, s_ptr, table_ptr, ws_ptr, lock_ptr,
                           M, N, K, stride_sn, stride_cm, K_TILES_PER_SPLIT,
                           CODEBOOK: gl.constexpr, GROUP: gl.constexpr, HAS_BIAS: gl.constexpr,
                           SPLIT_K: gl.constexpr, DECODE: gl.constexpr,
                           BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                           STAGES: gl.constexpr, GROUP_M: gl.constexpr, WARPS_N: gl.constexpr,
                           WARPS_M: gl.constexpr, INSTR_N: gl.constexpr):
        HALF: gl.constexpr = BLOCK_K // 2
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS_N, WARPS_M],
                                                      instr_shape=[16, INSTR_N, 32])
        w_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=4)

        tile = gl.program_id(0)
        off_m, off_n = _tile_offsets(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        k_first, k_tiles = _k_share(K, K_TILES_PER_SPLIT, BLOCK_K, SPLIT_K)

        acts = gl.allocate_shared_memory(gl.int8, [2 * STAGES, BLOCK_M, HALF], a_desc.layout)
        wq = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, HALF], w_desc.layout)
        # the decoded planes, double-buffered: tile i's are written while tile i - 1's wgmma read the others
        dec = gl.allocate_shared_memory(gl.int8, [4, BLOCK_N, HALF], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(bars.index(s), count=1)
        STAGE_BYTES: gl.constexpr = 2 * BLOCK_M * HALF + BLOCK_N * HALF
        for s in gl.static_range(STAGES - 1):
            pred = s < k_tiles
            kk = k_first + s
            mbarrier.expect(bars.index(s), STAGE_BYTES, pred=pred)
            tma.async_copy_global_to_shared(a_desc, [off_m, kk * BLOCK_K], bars.index(s), acts.index(2 * s), pred=pred)
            tma.async_copy_global_to_shared(a_desc, [off_m, kk * BLOCK_K + HALF], bars.index(s),
                                            acts.index(2 * s + 1), pred=pred)
            tma.async_copy_global_to_shared(w_desc, [off_n, kk * HALF], bars.index(s), wq.index(s), pred=pred)

        if CODEBOOK:
            # A row's 8 group scale bytes of one K tile are one int64 (s_ptr views the scales as int64): loaded
            # once per row a thread (a tile ahead), broadcast along the row, and each code word's byte picked
            # in the decode by a byte permute with its group's index (gsel, the same every tile).
            s_ptrs, table, gsel = _codebook_operands(s_ptr, table_ptr, N, off_n, k_first, stride_sn, w_layout, GROUP,
                                                     BLOCK_N, HALF)
            if DECODE % 2 == 1:
                s_next = gl.full([BLOCK_N], 0x3838383838383838, gl.int64, layout=gl.SliceLayout(1, w_layout))
            else:
                s_next = gl.load(s_ptrs)

        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.int32, layout=mma)
        for i in range(k_tiles):
            st = i % STAGES
            b = i % 2
            if CODEBOOK:
                s_cur, _ = gl.broadcast(gl.expand_dims(s_next, 1), table)
                if DECODE % 2 == 0:
                    s_next = gl.load(s_ptrs + (i + 1) % k_tiles)  # tile i + 1's, ahead
            mbarrier.wait(bars.index(st), (i // STAGES) & 1)
            packed = wq.index(st).load(w_layout)
            if CODEBOOK:
                low, high = _decode_codebook(packed, s_cur, gsel, table, DECODE)
            else:
                low, high = _decode_nibbles(packed)
            dec.index(2 * b).store(low)
            dec.index(2 * b + 1).store(high)
            fence_async_shared()
            acc = warpgroup_mma(dec.index(2 * b), acts.index(2 * st).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(dec.index(2 * b + 1), acts.index(2 * st + 1).permute((1, 0)), acc, is_async=True)
            # tile i - 1's wgmma have retired: its decoded buffer may be rewritten, its stage takes tile i + STAGES - 1
            acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc,))
            j = i + STAGES - 1
            sj = j % STAGES
            pred = j < k_tiles
            kk = k_first + j
            mbarrier.expect(bars.index(sj), STAGE_BYTES, pred=pred)
            tma.async_copy_global_to_shared(a_desc, [off_m, kk * BLOCK_K], bars.index(sj), acts.index(2 * sj),
                                            pred=pred)
            tma.async_copy_global_to_shared(a_desc, [off_m, kk * BLOCK_K + HALF], bars.index(sj),
                                            acts.index(2 * sj + 1), pred=pred)
            tma.async_copy_global_to_shared(w_desc, [off_n, kk * HALF], bars.index(sj), wq.index(sj), pred=pred)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        for s in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(s))

        _epilogue(acc, c, a_scale_ptr, w_scale_ptr, bias_ptr, ws_ptr, lock_ptr, M, N, off_m, off_n, tile, stride_cm,
                  mma, HAS_BIAS, SPLIT_K, BLOCK_N, BLOCK_M)


if gluon is not None:

    @gluon.jit
    def _ws_loader(a_desc, w_desc, acts, wq, load_ready, act_empty, wq_empty, off_m, off_n, k_first, k_tiles,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
        """One warp: the TMA loads of every K tile (both activation halves, the packed weight tile) into the
        ring, each stage once the MMA and the decoders are done with its previous tile."""
        HALF: gl.constexpr = BLOCK_K // 2
        for i in range(k_tiles):
            st = i % STAGES
            ph = (i // STAGES) & 1
            mbarrier.wait(act_empty.index(st), ph ^ 1)
            mbarrier.wait(wq_empty.index(st), ph ^ 1)
            kk = k_first + i
            mbarrier.expect(load_ready.index(st), 2 * BLOCK_M * HALF + BLOCK_N * HALF)
            tma.async_copy_global_to_shared(a_desc, [off_m, kk * BLOCK_K], load_ready.index(st), acts.index(2 * st))
            tma.async_copy_global_to_shared(a_desc, [off_m, kk * BLOCK_K + HALF], load_ready.index(st),
                                            acts.index(2 * st + 1))
            tma.async_copy_global_to_shared(w_desc, [off_n, kk * HALF], load_ready.index(st), wq.index(st))

    @gluon.jit
    def _ws_decoder(wq, dec, load_ready, wq_empty, dec_ready, dec_empty, s_ptr, table_ptr, N, off_n, k_first,
                    k_tiles, stride_sn, CODEBOOK: gl.constexpr, GROUP: gl.constexpr, BLOCK_N: gl.constexpr,
                    BLOCK_K: gl.constexpr, STAGES: gl.constexpr, DEC_STAGES: gl.constexpr,
                    DEC_WARPS: gl.constexpr):
        """DEC_WARPS warps: each packed tile decoded into the two INT8 planes in shared memory (a ring of
        DEC_STAGES), 16 consecutive bytes of a row a thread."""
        HALF: gl.constexpr = BLOCK_K // 2
        layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 16], threads_per_warp=[512 // HALF, HALF // 16],
                                                warps_per_cta=[DEC_WARPS, 1], order=[1, 0])
        if CODEBOOK:
            s_ptrs, table, gsel = _codebook_operands(s_ptr, table_ptr, N, off_n, k_first, stride_sn, layout, GROUP,
                                                     BLOCK_N, HALF)
            s_next = gl.load(s_ptrs)
        for i in range(k_tiles):
            st = i % STAGES
            d = i % DEC_STAGES
            if CODEBOOK:
                s_cur, _ = gl.broadcast(gl.expand_dims(s_next, 1), table)
                s_next = gl.load(s_ptrs + (i + 1) % k_tiles)  # tile i + 1's, ahead
            mbarrier.wait(load_ready.index(st), (i // STAGES) & 1)
            packed = wq.index(st).load(layout)
            gl.thread_barrier()
            mbarrier.arrive(wq_empty.index(st), count=1)
            if CODEBOOK:
                low, high = _decode_codebook(packed, s_cur, gsel, table, 0)
            else:
                low, high = _decode_nibbles(packed)
            mbarrier.wait(dec_empty.index(d), ((i // DEC_STAGES) & 1) ^ 1)
            dec.index(2 * d).store(low)
            dec.index(2 * d + 1).store(high)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(dec_ready.index(d), count=1)

    @gluon.jit
    def _ws_mma(acts, dec, load_ready, act_empty, dec_ready, dec_empty, c, a_scale_ptr, w_scale_ptr, bias_ptr,
                ws_ptr, lock_ptr, M, N, off_m, off_n, tile, k_tiles, stride_cm,
                HAS_BIAS: gl.constexpr, SPLIT_K: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                STAGES: gl.constexpr, DEC_STAGES: gl.constexpr, WARPS_N: gl.constexpr, WARPS_M: gl.constexpr,
                INSTR_N: gl.constexpr):
        """The default warps: the two wgmma of every tile as soon as its activations and decoded planes are
        in, one tile's wgmma in flight while the next is awaited; then the epilogue."""
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS_N, WARPS_M],
                                                      instr_shape=[16, INSTR_N, 32])
        acc = gl.zeros([BLOCK_N, BLOCK_M], gl.int32, layout=mma)
        for i in range(k_tiles):
            st = i % STAGES
            d = i % DEC_STAGES
            mbarrier.wait(load_ready.index(st), (i // STAGES) & 1)
            mbarrier.wait(dec_ready.index(d), (i // DEC_STAGES) & 1)
            acc = warpgroup_mma(dec.index(2 * d), acts.index(2 * st).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(dec.index(2 * d + 1), acts.index(2 * st + 1).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=2, deps=(acc,))
            if i > 0:  # tile i - 1's wgmma have retired
                gl.thread_barrier()
                mbarrier.arrive(act_empty.index((i - 1) % STAGES), count=1)
                mbarrier.arrive(dec_empty.index((i - 1) % DEC_STAGES), count=1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _epilogue(acc, c, a_scale_ptr, w_scale_ptr, bias_ptr, ws_ptr, lock_ptr, M, N, off_m, off_n, tile, stride_cm,
                  mma, HAS_BIAS, SPLIT_K, BLOCK_N, BLOCK_M)

    @gluon.jit
    def _w4a8_gluon_ws_kernel(a_desc, w_desc, c, a_scale_ptr, w_scale_ptr, bias_ptr, s_ptr, table_ptr, ws_ptr,
                              lock_ptr, M, N, K, stride_sn, stride_cm, K_TILES_PER_SPLIT,
                              CODEBOOK: gl.constexpr, GROUP: gl.constexpr, HAS_BIAS: gl.constexpr,
                              SPLIT_K: gl.constexpr, DECODE: gl.constexpr,
                              BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr,
                              STAGES: gl.constexpr, GROUP_M: gl.constexpr, WARPS_N: gl.constexpr,
                              WARPS_M: gl.constexpr, INSTR_N: gl.constexpr, DEC_WARPS: gl.constexpr):
        """Warp-specialized: a loader warp, DEC_WARPS decoder warps and the default (MMA) warps, meeting at
        mbarriers; decode and MMA run on different warps at the same time."""
        HALF: gl.constexpr = BLOCK_K // 2
        DEC_STAGES: gl.constexpr = 2
        tile = gl.program_id(0)
        off_m, off_n = _tile_offsets(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        k_first, k_tiles = _k_share(K, K_TILES_PER_SPLIT, BLOCK_K, SPLIT_K)
        acts = gl.allocate_shared_memory(gl.int8, [2 * STAGES, BLOCK_M, HALF], a_desc.layout)
        wq = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, HALF], w_desc.layout)
        dec = gl.allocate_shared_memory(gl.int8, [2 * DEC_STAGES, BLOCK_N, HALF], w_desc.layout)
        load_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        act_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        wq_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        dec_ready = gl.allocate_shared_memory(gl.int64, [DEC_STAGES, 1], mbarrier.MBarrierLayout())
        dec_empty = gl.allocate_shared_memory(gl.int64, [DEC_STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(STAGES):
            mbarrier.init(load_ready.index(s), count=1)
            mbarrier.init(act_empty.index(s), count=1)
            mbarrier.init(wq_empty.index(s), count=1)
        for s in gl.static_range(DEC_STAGES):
            mbarrier.init(dec_ready.index(s), count=1)
            mbarrier.init(dec_empty.index(s), count=1)
        gl.warp_specialize([
            (_ws_mma, (acts, dec, load_ready, act_empty, dec_ready, dec_empty, c, a_scale_ptr, w_scale_ptr, bias_ptr,
                       ws_ptr, lock_ptr, M, N, off_m, off_n, tile, k_tiles, stride_cm, HAS_BIAS, SPLIT_K, BLOCK_N,
                       BLOCK_M, STAGES, DEC_STAGES, WARPS_N, WARPS_M, INSTR_N)),
            (_ws_loader, (a_desc, w_desc, acts, wq, load_ready, act_empty, wq_empty, off_m, off_n, k_first, k_tiles,
                          BLOCK_M, BLOCK_N, BLOCK_K, STAGES)),
            (_ws_decoder, (wq, dec, load_ready, wq_empty, dec_ready, dec_empty, s_ptr, table_ptr, N, off_n, k_first,
                           k_tiles, stride_sn, CODEBOOK, GROUP, BLOCK_N, BLOCK_K, STAGES, DEC_STAGES, DEC_WARPS)),
        ], [1, DEC_WARPS], [24, 112])


def w4a8_mm_gluon(a: torch.Tensor, packed: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None, s_rel: torch.Tensor | None, table: torch.Tensor | None,
                  group_size: int, out_dtype: torch.dtype, config: GemmConfig,
                  out: torch.Tensor | None = None, decode: int = 0) -> torch.Tensor:
    """:func:`triton_w4_gemm.w4a8_mm_triton`'s product with the Gluon kernel (same arguments and bits).

    ``config``: ``block_m`` tokens × ``block_n`` weight rows × ``block_k``, ``num_warps`` (4 or 8),
    ``num_stages`` (the TMA ring). ``a`` and ``packed`` must be row-major with 16-byte aligned rows."""
    problem = gluon_problem(a.device)
    if problem:
        raise RuntimeError(problem)
    m, k = a.shape
    n = packed.shape[0]
    if k % config.block_k:
        raise ValueError(f"the 4-bit GEMM needs K ({k}) to be a multiple of its K tile ({config.block_k})")
    out = torch.empty((m, n), dtype=out_dtype, device=a.device) if out is None else out
    if m == 0 or n == 0:
        return out
    half = config.block_k // 2
    a_layout = gl.NVMMASharedLayout.get_default_for([config.block_m, half], gl.int8)
    w_layout = gl.NVMMASharedLayout.get_default_for([config.block_n, half], gl.int8)
    a_desc = TensorDescriptor.from_tensor(a, [config.block_m, half], a_layout)
    w_desc = TensorDescriptor.from_tensor(packed.view(torch.int8), [config.block_n, half], w_layout)
    warps = _warps(config.block_n, config.num_warps)
    instr_n = _instr_n(config.block_m // warps[1])
    codebook = s_rel is not None
    if codebook:
        if config.block_k // group_size != 8:
            raise ValueError(f"the Gluon codebook decode takes 8 groups a K tile: block_k {config.block_k}, "
                             f"group size {group_size}")
        s64 = s_rel.view(torch.uint8).view(torch.int64)  # a row's 8 group bytes of one K tile: one int64
    tiles = triton_cdiv(m, config.block_m) * triton_cdiv(n, config.block_n)
    splits, per_split, ws, locks = split_k_shares(a, config, tiles, k // config.block_k)
    args = (a_desc, w_desc, out, a_scale, w_scale, bias if bias is not None else a_scale,
            s64 if codebook else packed, table if codebook else packed, ws, locks,
            m, n, k, s64.stride(0) if codebook else 0, out.stride(0), per_split)
    constexprs = dict(CODEBOOK=codebook, GROUP=group_size if codebook else 16, HAS_BIAS=bias is not None,
                      SPLIT_K=splits, DECODE=decode, BLOCK_N=config.block_n, BLOCK_M=config.block_m,
                      BLOCK_K=config.block_k, STAGES=config.num_stages, GROUP_M=config.group_m, WARPS_N=warps[0],
                      WARPS_M=warps[1], INSTR_N=instr_n)
    if config.warp_specialize:
        _w4a8_gluon_ws_kernel[(tiles, splits)](*args, **constexprs, DEC_WARPS=WS_DECODER_WARPS,
                                                num_warps=config.num_warps, maxnreg=WS_MAXNREG)
    else:
        _w4a8_gluon_kernel[(tiles, splits)](*args, **constexprs, num_warps=config.num_warps)
    return out


WS_DECODER_WARPS = 4
WS_MAXNREG = 168  # 12 warps (4 MMA, 1 loader padded to a warpgroup, 4 decoders) * 32 * 168 <= 65536


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
