"""Tile configurations for the Triton GEMMs, and which ones fit a given GPU.

A :class:`GemmConfig` is one compiled variant (tile shape, warps, pipeline depth). The dispatcher
measures a short candidate list per shape and caches the winner by :meth:`GemmConfig.name`, so
the names are stable strings (``"128x256x128-g8-w8-s3"``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

# shared memory per block (bytes) by compute capability; Triton needs a little for itself
_SMEM_LIMIT = {(8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 7): 163 * 1024, (8, 9): 99 * 1024, (9, 0): 227 * 1024}
_NAME = re.compile(r"^(\d+)x(\d+)x(\d+)-g(\d+)-w(\d+)-s(\d+)(-swap)?(-tma)?(-ws)?(-persistent)?(-tmastore)?(-sub)?"
                   r"(?:-k(\d+))?(-sk)?(-join)?$")


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    swap_ab: bool = False  # W4 kernel only: decoded weight as the left operand (output tile transposed)
    tma: bool = False  # W8A8 kernel only, sm_90: operand tiles through TMA tensor descriptors
    warp_specialize: bool = False  # with tma: Triton's warp specialization (no effect seen on sm_90, Triton 3.6/3.8)
    persistent: bool = False  # with tma: one program per SM looping over output tiles
    tma_store: bool = False  # the output tile leaves through a TMA store (contiguous outputs; else plain stores)
    subtile: bool = False  # with tma_store: the tile is stored as two BLOCK_N / 2 halves (half the staging buffer)
    split_k: int = 1  # INT8 products only: K split over this many programs per tile, summed exactly in int32
    join: bool = False  # W4 kernel only: the two decoded planes side by side, one dot (one wgmma group) per K step
    stream_k: bool = False  # W4 kernel only: one program per SM, each a contiguous share of all tiles' K steps

    def __post_init__(self):
        for value, what in ((self.block_m, "block_m"), (self.block_n, "block_n"), (self.block_k, "block_k")):
            if value < 16 or value & (value - 1):
                raise ValueError(f"GemmConfig.{what} must be a power of two >= 16, got {value}")
        if self.subtile and not self.tma_store:
            raise ValueError("GemmConfig.subtile splits the TMA-stored output tile: it needs tma_store=True")
        if self.split_k < 1 or (self.split_k > 1 and self.persistent):
            raise ValueError(f"GemmConfig.split_k must be >= 1, and > 1 only without persistent, "
                             f"got split_k={self.split_k}")
        if self.stream_k and (self.persistent or self.split_k > 1):
            raise ValueError("GemmConfig.stream_k shares K steps over the SMs itself: it excludes persistent "
                             "and split_k > 1")

    @property
    def name(self) -> str:
        base = (f"{self.block_m}x{self.block_n}x{self.block_k}-g{self.group_m}"
                f"-w{self.num_warps}-s{self.num_stages}")
        return (base + ("-swap" if self.swap_ab else "") + ("-tma" if self.tma else "")
                + ("-ws" if self.warp_specialize else "") + ("-persistent" if self.persistent else "")
                + ("-tmastore" if self.tma_store else "") + ("-sub" if self.subtile else "")
                + (f"-k{self.split_k}" if self.split_k > 1 else "") + ("-sk" if self.stream_k else "")
                + ("-join" if self.join else ""))

    @classmethod
    def from_name(cls, name: str) -> "GemmConfig":
        match = _NAME.match(name)
        if not match:
            raise ValueError(f"not a GEMM config name: {name!r} (expected like '128x256x128-g8-w8-s3')")
        bm, bn, bk, g, w, s = (int(v) for v in match.groups()[:6])
        return cls(bm, bn, bk, g, w, s, swap_ab=match.group(7) is not None, tma=match.group(8) is not None,
                   warp_specialize=match.group(9) is not None, persistent=match.group(10) is not None,
                   tma_store=match.group(11) is not None, subtile=match.group(12) is not None,
                   split_k=int(match.group(13) or 1), stream_k=match.group(14) is not None,
                   join=match.group(15) is not None)

    def smem_bytes(self, a_bytes: float = 1.0, b_bytes: float = 1.0, c_bytes: float = 2.0) -> int:
        """Pipeline buffers: ``num_stages`` A and B tiles (element sizes in bytes), plus the staging
        buffer of a TMA-stored output tile (``c_bytes`` per element) where the kernel cannot reuse the
        pipeline's buffers for it (persistent: the next tile's loads are in flight)."""
        per_stage = self.block_m * self.block_k * a_bytes + self.block_n * self.block_k * b_bytes
        staging = 0
        if self.tma_store and self.persistent:
            staging = self.block_m * self.block_n * c_bytes // (2 if self.subtile else 1)
        return int(per_stage * self.num_stages + staging)

    def fits(self, cap: tuple[int, int], a_bytes: float = 1.0, b_bytes: float = 1.0) -> bool:
        limit = _SMEM_LIMIT.get(cap, 99 * 1024 if cap < (9, 0) else 227 * 1024)
        return self.smem_bytes(a_bytes, b_bytes) + 8 * 1024 <= limit


@functools.lru_cache(maxsize=256)
def config_named(name: str) -> GemmConfig:
    """:meth:`GemmConfig.from_name`, cached (it runs on every GEMM call)."""
    return GemmConfig.from_name(name)


C = GemmConfig
# Large M: 128x256 tiles (the untuned start), deeper pipelines, 256-row tiles, and the same
# through TMA descriptors (sm_90 only).
_W8A8_LARGE = (
    C(128, 128, 128, 8, 4, 3, tma=True, tma_store=True),
    C(128, 256, 128, 8, 8, 3, tma=True, persistent=True, tma_store=True, subtile=True),
    C(256, 128, 128, 8, 8, 3, tma=True, tma_store=True, subtile=True),
    C(128, 256, 128, 8, 8, 3), C(256, 128, 128, 8, 8, 3, tma=True, persistent=True),
    C(128, 128, 128, 8, 8, 3), C(128, 128, 64, 8, 4, 4),  # plain loads and stores: also sm_80 / sm_89
)
# Measured on an H200 (Triton 3.6, session 5; M = 4096, the five issue shapes, CUDA-graph time):
# * the output tile stored through TMA (``tma_store``) beat every plain-store config. Best INT8:
#   128x128x128, 4 warps, 3 stages, TMA in and out (1.64-2.01x bf16 GEMM alone, was 1.45-1.77x).
#   Best FP8 on 4 shapes: persistent 128x256x128 with the epilogue stored in two halves (1.76-2.01x),
#   and 256x128x128 TMA-stored halves or plain 128x256x128 on the fifth (3072 x 12288).
# * Dropped from the list: 128x256x128 at 4 stages and the TMA-load-only variants (a few % slower than
#   these everywhere), 128x256x64 / 256x128x64 at 4 stages (20-40% slower for INT8).
# * 128x256x128 persistent with plain stores runs out of shared memory (the epilogue's layout change
#   needs its own buffer while the pipeline's are live); with a TMA-stored half tile it fits.
# Small M (<= 1024 rows): smaller tiles so the grid fills 132 SMs.
_W8A8_SMALL = (
    C(64, 128, 128, 8, 4, 4), C(128, 128, 128, 8, 4, 4), C(64, 256, 128, 8, 8, 3), C(128, 64, 128, 8, 4, 4),
    C(128, 128, 128, 8, 4, 4, tma=True), C(64, 128, 128, 8, 4, 4, tma=True),
    C(128, 128, 128, 8, 4, 3, tma=True, tma_store=True), C(64, 128, 128, 8, 4, 4, tma=True, tma_store=True),
    C(128, 64, 128, 8, 4, 4, tma=True, tma_store=True),
)
# Split-K for few rows (INT8 products only: the partial sums add exactly in int32). At M = 256 an N = 3072
# layer has 24-96 output tiles for 132 SMs, each looping over all of K; splitting K fills the GPU. One
# launch: each share leaves its partial tile in a kept workspace and the last share of a tile to finish adds
# them up and runs the epilogue (``triton_w8a8_gemm._split_k_total``). Session 6 measured an earlier form (a
# zeroed workspace, atomic adds, a separate epilogue launch: three launches) on an H200: at M = 256 it took
# 1.0-2.2x the best other config's time in the dispatcher's eager timing and won 1 key of 15. The one-launch
# form, GEMM alone at M = 256 (session 12, tests/gpu/sweep_small_m_gemm.py, CUDA-graph time): 3072 x 12288
# went from 1.16x to 1.39x bf16 (64x128x128, 2 shares); on the wide shapes (N >= 9216) a split config is
# 0.5-0.9x where the best other is 1.4-1.7x, and 256-row tiles with 4 shares were never the best.
_W8A8_SPLIT_K = (C(64, 128, 128, 8, 4, 4, split_k=2), C(128, 128, 128, 8, 4, 3, tma=True, tma_store=True, split_k=4))
_SPLIT_K_MAX_M = 512
# The 4-bit GEMM: the packed weight tile is half the bytes, the decode wants more rows per weight tile.
# H200 sweep (session 5, tests/gpu/sweep_w4_gemm.py, GEMM alone, weights from HBM): signed nibbles are
# fastest as 128x128x128 swap-AB, 4 warps, 4 stages (1.42x bf16 at M = 4096, 1.14x at M = 1024), with
# or without TMA in and out; the codebook weights gain 2x from TMA (0.46x against 0.24x with pointers),
# still behind comfy-kitchen's path. 64x256 tiles, 128x256x64 and 256x128 at 4 stages: 0.2-0.7x, dropped.
# Session 8 (Triton 3.6, the same sweep): at M = 4096 the 8-warp swap-AB TMA-in-and-out variant led the
# signed nibbles (1.43x geomean against 1.35x for the 4-warp ones), so it is measured too. Through the
# whole linear (activation quantization first, weights warm in L2) it ties with them within 2 %: the
# dispatcher chose it for 1 of the 6 large-M w4a4 shapes of a Flux step.
_W4_LARGE = (
    C(128, 128, 128, 8, 4, 4, swap_ab=True), C(128, 128, 128, 8, 4, 4, swap_ab=True, tma=True, tma_store=True),
    C(128, 128, 128, 8, 8, 4, swap_ab=True, tma=True, tma_store=True),
    C(128, 128, 128, 8, 4, 3, tma=True, tma_store=True), C(128, 128, 128, 8, 8, 4), C(256, 128, 128, 8, 8, 3),
    C(128, 256, 128, 8, 8, 3),
)
_W4_SMALL = (
    C(64, 128, 128, 8, 4, 4), C(128, 128, 128, 8, 4, 4), C(64, 128, 128, 8, 4, 4, swap_ab=True),
    C(128, 64, 128, 8, 4, 4), C(128, 128, 128, 8, 4, 4, swap_ab=True), C(128, 128, 128, 8, 4, 3, tma=True, tma_store=True),
)
# Split-K for few rows (as ``_W8A8_SPLIT_K``). Session 12's sweep at M = 256: signed nibbles 3072 x 12288
# 1.15x bf16 with 64x128x128 swap-AB in 2 shares (0.69x for the whole linear in session 10), and 3072 x 3072
# 0.74x against 0.73x; codebook weights 3072 x 12288 0.74x (4 shares) against 0.56x. 256-row tiles (each
# packed tile decoded once) were slower than these everywhere: 0.41-0.85x.
_W4_SPLIT_K = (C(64, 128, 128, 8, 4, 4, swap_ab=True, split_k=2), C(128, 128, 128, 8, 4, 4, swap_ab=True, split_k=4))
_W4_CODEBOOK_SPLIT_K = (C(128, 64, 128, 8, 4, 4, tma=True, tma_store=True, split_k=2),
                        C(128, 64, 128, 8, 4, 4, tma=True, tma_store=True, split_k=4, join=True))


# Few rows (M <= 32): the per-block modulation linears of Flux, Qwen-Image and the like see one row a call at
# batch 1, and a 64- or 128-row tile wastes most of its MMA and, at N = 18432, leaves a second, nearly empty
# wave of programs. 16-row tiles (split-K for the INT8 products). Session 20, H200, Triton 3.6
# (tests/gpu/sweep_small_m_gemm.py --shapes mod, GEMM alone, CUDA-graph time, each against the best of the
# configs above), M = 1, N x K = 18432 x 3072 and 9216 x 3072: INT8 16.8 / 8.7 us against 21.3 / 11.0 (bf16
# 32.0 / 19.5); signed-nibble W4 11.4 / 8.2 against 29.1 / 22.2; codebook W4 24.1 / 15.0 against 50.5 / 32.7.
# At M = 16 the same picture. Every output bit for bit the one-program config's.
_FEW_ROWS_MAX_M = 32
_W8A8_FEW_ROWS = (C(16, 64, 128, 8, 4, 4, tma=True), C(16, 128, 256, 8, 4, 3), C(16, 32, 256, 8, 4, 3))
_W8A8_FEW_ROWS_SPLIT_K = (C(16, 64, 128, 8, 4, 4, split_k=2),)
_W4_FEW_ROWS = (C(16, 64, 128, 8, 4, 4, swap_ab=True), C(16, 64, 128, 8, 4, 4, split_k=2),
                C(16, 64, 256, 8, 4, 3, swap_ab=True), C(16, 32, 256, 8, 4, 3))
_W4_CODEBOOK_FEW_ROWS = (C(16, 64, 128, 8, 4, 4, split_k=2), C(16, 64, 128, 8, 4, 4, split_k=4),
                         C(16, 32, 256, 8, 4, 3), C(16, 64, 256, 8, 4, 3, split_k=2))


# More rows than few (17-512): narrower tiles. Session 21, H200, Triton 3.6 (tests/gpu/sweep_small_m_gemm.py, GEMM
# alone, CUDA-graph time, geomean over the issue shapes against bf16, best of the configs above -> with these):
# * INT8: M = 32 1.71 -> 1.80, M = 64 1.48 -> 1.79, M = 128 1.41 -> 1.52, M = 256 1.33 -> 1.38. At N = 3072 a
#   64x128 tile leaves 24-48 programs for 132 SMs; 64x64 and 64x32 tiles fill them (3072 x 3072, M = 64:
#   0.77x -> 1.23x).
# * signed-nibble W4: M = 32 1.70 -> 1.87, M = 64 1.15 -> 1.42, M = 128 1.06 -> 1.13, M = 256 1.08 -> 1.23,
#   M = 512 1.15 -> 1.25.
# * codebook W4: M = 32 0.82 -> 1.07, M = 64 0.69 -> 0.91 (64-row tiles, so each weight tile is decoded
#   once), M = 128 0.74 -> 0.75; M = 256 and 512 unchanged (0.72).
# Every output bit for bit the one-program config's.
# Session 40, H100, Triton 3.6 (the same sweep with --also-join, M = 256): the codebook configs of 65-512 rows
# with their two decoded planes joined (one dot, so one wgmma wait, a K step): 128x32x128 TMA in and out, with
# and without 2 shares, 1.01-1.23x as fast as with two dots on every issue shape; 128x64x128 TMA 1.00-1.14x
# (kept beside its two-dot form, which 513-1024 rows use), its 4 shares 1.01-1.11x (its 2 shares: 0.96-1.06x,
# left with two dots); 256x128x128 at 4 stages 1-4 % faster than at 3 on every shape. Best config per shape,
# geomean against bf16: 0.886x -> 0.923x. Session 42, H100, the same sweep with --extra: 256-column K steps
# (joined planes, so the activation tile arrives in one copy) halve the K loop's waits and barriers. 128x64x256,
# 3 stages: 3072 x 3072 0.72x -> 0.84x; 256x64x256, 8 warps, 3 stages, 2 shares: 3072 x 12288 0.93x -> 1.16x. Best
# config per shape, geomean 0.979x (docs/kernels.md, Session 42). Session 43, H100, the same sweep: 256x64x256 in
# stream-K form (``stream_k``: 132 programs share the 144 x 12 K steps of 9216 x 3072) 0.78x -> 0.89x at 9216 x 3072,
# 1.17x at 3072 x 12288 (2 shares: 1.16x); geomean 1.008x. Stream-K on 128-row or 256 x 128 tiles lost to their
# whole-tile forms everywhere (their partial tiles cost more than the idle SMs). The bands end where the dispatcher's
# M buckets do, so a bucket is measured with one candidate list whichever of its M comes first.
@dataclass(frozen=True)
class _RowBand:
    low: int  # rows, inclusive
    high: int
    w8a8: tuple = ()  # INT8 and FP8
    int8_split: tuple = ()  # INT8 only (split-K)
    w4: tuple = ()  # signed nibbles
    w4_codebook: tuple = ()

    def holds(self, m: int) -> bool:
        return self.low <= m <= self.high


_ROW_BANDS = (
    _RowBand(17, 32, w8a8=(C(32, 64, 256, 8, 4, 3),), int8_split=(C(32, 64, 128, 8, 4, 4, split_k=2),),
             w4_codebook=(C(32, 64, 128, 8, 4, 4, split_k=2), C(32, 64, 256, 8, 4, 3), C(32, 32, 256, 8, 4, 3))),
    _RowBand(17, 128, w8a8=(C(64, 32, 256, 8, 4, 3),),
             w4=(C(32, 64, 128, 8, 4, 4, swap_ab=True), C(32, 64, 256, 8, 4, 3), C(32, 64, 128, 8, 4, 4, split_k=2))),
    _RowBand(33, 128, w4_codebook=(C(64, 32, 256, 8, 4, 3), C(64, 64, 128, 8, 4, 4, swap_ab=True))),
    _RowBand(33, 512, w8a8=(C(64, 64, 128, 8, 4, 4, tma=True),), int8_split=(C(64, 64, 128, 8, 4, 4, split_k=2),),
             w4=(C(64, 64, 128, 8, 4, 4, swap_ab=True), C(64, 64, 256, 8, 4, 3, swap_ab=True))),
    _RowBand(65, 512, w4_codebook=(C(128, 32, 128, 8, 4, 4, tma=True, tma_store=True, join=True),
                                   C(128, 32, 128, 8, 4, 4, tma=True, tma_store=True, split_k=2, join=True),
                                   C(128, 64, 128, 8, 4, 4, tma=True, tma_store=True, join=True),
                                   C(256, 128, 128, 8, 8, 4, tma=True, tma_store=True, subtile=True),
                                   C(128, 64, 256, 8, 4, 3, tma=True, tma_store=True, join=True),
                                   C(256, 64, 256, 8, 8, 3, tma=True, tma_store=True, split_k=2, join=True),
                                   C(256, 64, 256, 8, 8, 3, tma=True, tma_store=True, stream_k=True, join=True))),
)


def _banded(m: int, field_name: str) -> tuple:
    return tuple(c for band in _ROW_BANDS if band.holds(m) for c in getattr(band, field_name))


def w8a8_candidates(cap: tuple[int, int], m: int, fp8: bool = False) -> list[GemmConfig]:
    """Configs worth measuring for an INT8 (``fp8`` False) or FP8 GEMM with ``m`` rows on capability ``cap``."""
    pool = (_W8A8_SMALL + (() if fp8 or m > _SPLIT_K_MAX_M else _W8A8_SPLIT_K)) if m <= 1024 else _W8A8_LARGE
    pool = pool + _banded(m, "w8a8") + (() if fp8 else _banded(m, "int8_split"))
    if m <= _FEW_ROWS_MAX_M:
        pool = _W8A8_FEW_ROWS + (() if fp8 else _W8A8_FEW_ROWS_SPLIT_K) + pool
    return [c for c in pool if c.fits(cap) and (not c.tma or cap >= (9, 0))] or [C(64, 64, 64, 8, 4, 2)]


# The codebook weights (session 8, in-register PRMT decode, the same sweep, geomean of GEMM-alone time
# over the issue shapes): the decode is the cost, so the tile with the most rows per decoded weight
# tile wins at M >= 1024 – 256x128x128, 8 warps, TMA-stored halves (0.90x bf16 at M = 4096, 0.78x at
# 1024) – and at M = 256, 128x64x128 with TMA in and out, which fills more SMs (0.56x).
_W4_CODEBOOK = (C(256, 128, 128, 8, 8, 3, tma=True, tma_store=True, subtile=True),
                C(128, 64, 128, 8, 4, 4, tma=True, tma_store=True))


def w4_candidates(cap: tuple[int, int], m: int, codebook: bool = False) -> list[GemmConfig]:
    """Configs worth measuring for the 4-bit-weight GEMM (weight tiles are half the bytes);
    ``codebook``: for grouped codebook weights (``asym_w4a8_int8``), whose decode favours other tiles."""
    pool = _W4_SMALL if m <= 1024 else _W4_LARGE
    if codebook:
        pool = _W4_CODEBOOK[:1] + pool + (_W4_CODEBOOK[1:] if m <= 1024 else ())
    if m <= _SPLIT_K_MAX_M:
        pool = pool + (_W4_CODEBOOK_SPLIT_K if codebook else _W4_SPLIT_K)
    pool = pool + _banded(m, "w4_codebook" if codebook else "w4")
    if m <= _FEW_ROWS_MAX_M:
        pool = (_W4_CODEBOOK_FEW_ROWS if codebook else _W4_FEW_ROWS) + pool
    return ([c for c in pool if c.fits(cap, 1.0, 0.5) and (not (c.tma or c.tma_store) or cap >= (9, 0))]
            or [C(64, 64, 64, 8, 4, 2)])


# The W4 "expand" candidates (the weight decoded into a temporary INT8 matrix, then the W8A8 GEMM). The expanded
# weight is an INT8 weight like any other, so its GEMM gets the INT8 format's own list for the M bucket. Until
# Session 41 it got a fixed pair (the configs Flux-dev's step logs settled on most in session 8), which at
# M <= 1024 had no TMA config: there the INT8 format's dispatcher takes 128x128x128 with TMA in and out
# (docs/kernels.md, Session 41).
def w4_expand_candidates(cap: tuple[int, int], m: int) -> list[GemmConfig]:
    """INT8 GEMM configs for a 4-bit weight expanded to INT8 per call (``kernels/triton_w4_expand.py``)."""
    return w8a8_candidates(cap, m)


# The W8A16 kernel (``triton_w8a16_gemm.py``) for few rows, bound by the weight's bytes: 16-row tiles, 256-deep K
# steps (whole rotation super-blocks), output tiles narrow enough to spread N over the SMs, pipelines deep enough
# to keep the weight streaming. Not yet swept on a GPU beyond the dispatcher's own measurements.
WEIGHT_ONLY_MAX_M = 16
_W8A16 = (C(16, 32, 256, 1, 4, 4), C(16, 64, 256, 1, 4, 4), C(16, 64, 256, 1, 4, 3), C(16, 128, 256, 1, 4, 3),
          C(16, 128, 256, 1, 8, 3))
W8A16_DEFAULT = C(16, 32, 256, 1, 4, 2)  # the CPU interpreter's


def w8a16_candidates(cap: tuple[int, int]) -> list[GemmConfig]:
    """Configs worth measuring for the W8A16 kernel on capability ``cap`` (bf16 / fp16 activation tiles)."""
    return [c for c in _W8A16 if c.fits(cap, 2.0, 1.0)] or [W8A16_DEFAULT]


def default_config(m: int, kind: str = "w8a8") -> GemmConfig:
    """The config used without measurement (CPU interpreter, or before the dispatcher has data)."""
    if m <= 64:
        return C(32, 64, 64, 8, 4, 2)
    if m <= 1024:
        return C(64, 128, 128, 8, 4, 4)
    return C(128, 256, 128, 8, 8, 3)
