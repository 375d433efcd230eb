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
_NAME = re.compile(r"^(\d+)x(\d+)x(\d+)-g(\d+)-w(\d+)-s(\d+)(-swap)?(-tma)?(-ws)?(-persistent)?$")


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

    def __post_init__(self):
        for value, what in ((self.block_m, "block_m"), (self.block_n, "block_n"), (self.block_k, "block_k")):
            if value < 16 or value & (value - 1):
                raise ValueError(f"GemmConfig.{what} must be a power of two >= 16, got {value}")

    @property
    def name(self) -> str:
        base = (f"{self.block_m}x{self.block_n}x{self.block_k}-g{self.group_m}"
                f"-w{self.num_warps}-s{self.num_stages}")
        return (base + ("-swap" if self.swap_ab else "") + ("-tma" if self.tma else "")
                + ("-ws" if self.warp_specialize else "") + ("-persistent" if self.persistent else ""))

    @classmethod
    def from_name(cls, name: str) -> "GemmConfig":
        match = _NAME.match(name)
        if not match:
            raise ValueError(f"not a GEMM config name: {name!r} (expected like '128x256x128-g8-w8-s3')")
        bm, bn, bk, g, w, s = (int(v) for v in match.groups()[:6])
        return cls(bm, bn, bk, g, w, s, swap_ab=match.group(7) is not None, tma=match.group(8) is not None,
                   warp_specialize=match.group(9) is not None, persistent=match.group(10) is not None)

    def smem_bytes(self, a_bytes: float = 1.0, b_bytes: float = 1.0) -> int:
        """Pipeline buffers: ``num_stages`` A and B tiles (element sizes in bytes)."""
        per_stage = self.block_m * self.block_k * a_bytes + self.block_n * self.block_k * b_bytes
        return int(per_stage * self.num_stages)

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
    C(128, 256, 128, 8, 8, 3), C(128, 256, 128, 8, 8, 4), C(256, 128, 128, 8, 8, 3),
    C(128, 256, 128, 8, 8, 3, tma=True), C(128, 256, 128, 8, 8, 4, tma=True), C(256, 128, 128, 8, 8, 3, tma=True),
    C(256, 128, 128, 8, 8, 3, tma=True, persistent=True),
)
# Not offered: 128x256x128 persistent at 3 or 4 stages. On H200 (Triton 3.6) the persistent kernel
# keeps its pipeline buffers live through the epilogue and runs out of shared memory; offering them
# made the dispatcher compile and fail them for every new shape. (Any other configuration that fails
# that way is remembered per GPU by the dispatcher: ``Dispatcher.broken``.) Also measured and not kept:
# 128x256x64 s4 (two consumer warpgroups of 64x256), plain TMA and persistent: 6-19% slower than the
# best INT8 config on every issue shape at M = 4096, 2% faster on one FP8 shape.
# Small M (<= 1024 rows): smaller tiles so the grid fills 132 SMs.
_W8A8_SMALL = (
    C(64, 128, 128, 8, 4, 4), C(128, 128, 128, 8, 4, 4), C(64, 256, 128, 8, 8, 3), C(128, 64, 128, 8, 4, 4),
    C(128, 128, 128, 8, 4, 4, tma=True), C(64, 128, 128, 8, 4, 4, tma=True),
)
# The 4-bit GEMM: the packed weight tile is half the bytes, the decode wants more rows per weight tile.
_W4_LARGE = (
    C(128, 256, 128, 8, 8, 3), C(256, 128, 128, 8, 8, 3), C(256, 128, 128, 8, 8, 4), C(128, 128, 128, 8, 8, 4),
    C(128, 128, 128, 8, 4, 4, swap_ab=True), C(128, 256, 64, 8, 8, 4),
)
_W4_SMALL = (
    C(64, 128, 128, 8, 4, 4), C(128, 128, 128, 8, 4, 4), C(64, 256, 128, 8, 8, 3),
    C(64, 128, 128, 8, 4, 4, swap_ab=True), C(128, 64, 128, 8, 4, 4),
)


def w8a8_candidates(cap: tuple[int, int], m: int) -> list[GemmConfig]:
    """Configs worth measuring for an INT8/FP8 GEMM with ``m`` rows on capability ``cap``."""
    pool = _W8A8_SMALL if m <= 1024 else _W8A8_LARGE
    return [c for c in pool if c.fits(cap) and (not c.tma or cap >= (9, 0))] or [C(64, 64, 64, 8, 4, 2)]


def w4_candidates(cap: tuple[int, int], m: int) -> list[GemmConfig]:
    """Configs worth measuring for the 4-bit-weight GEMM (weight tiles are half the bytes)."""
    pool = _W4_SMALL if m <= 1024 else _W4_LARGE
    return [c for c in pool if c.fits(cap, 1.0, 0.5)] or [C(64, 64, 64, 8, 4, 2)]


def default_config(m: int, kind: str = "w8a8") -> GemmConfig:
    """The config used without measurement (CPU interpreter, or before the dispatcher has data)."""
    if m <= 64:
        return C(32, 64, 64, 8, 4, 2)
    if m <= 1024:
        return C(64, 128, 128, 8, 4, 4)
    return C(128, 256, 128, 8, 8, 3)
