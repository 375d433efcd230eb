"""Triton: 4-bit weight storage × INT8 activations, decoded in registers (no expanded weight).

The weight stays packed, ``[N, K/2]`` bytes, two nibbles a byte (low nibble = even column), as
comfy-kitchen stores it. Each program loads a ``[BLOCK_N, BLOCK_K/2]`` byte tile, decodes it to
the INT8 values the GEMM multiplies, re-interleaves the two nibble planes (``tl.join``) and feeds
the INT8 tensor cores (Hopper has no INT4 MMA); the product is exact in int32.

Two decodes:

* ``CODEBOOK=False`` – signed nibbles, ``[-8, 7]`` (``convrot_w4a4``): sign-extended with shifts;
  the per-output-channel scale is applied in the epilogue.
* ``CODEBOOK=True`` – grouped codes (``asym_w4a8_int8``): the level of code ``c`` in a group with
  FP8 scale byte ``s`` is ``table[s, c]`` (``reference.w4a8_level_table``: 256×16 int8, 4 KiB,
  ``round(codebook[c] * fp8(s))``, exactly comfy-kitchen's decode), one cached lookup per weight.

``SWAP_AB`` computes the transposed tile (weight as the left operand, which on Hopper may stay in
registers) and stores it transposed; the dispatcher measures both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gemm_config import GemmConfig
from .triton_w8a8_gemm import _epilogue, _tile_ids


@triton.jit
def _decode_w4(packed, s_ptr, table_ptr, rows_b, k_byte0, stride_sn,
               CODEBOOK: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``[BLOCK_N, BLOCK_K/2]`` packed bytes → ``[BLOCK_N, BLOCK_K]`` int8 weight values."""
    if CODEBOOK:
        GROUPS: tl.constexpr = BLOCK_K // GROUP
        g = tl.arange(0, GROUPS)
        s_off = rows_b[:, None].to(tl.int64) * stride_sn + (k_byte0 * 2) // GROUP + g[None, :]
        s_byte = tl.load(s_ptr + s_off).to(tl.int32) & 0xFF  # [BLOCK_N, GROUPS]
        base = tl.reshape(tl.broadcast_to((s_byte * 16)[:, :, None], (BLOCK_N, GROUPS, GROUP // 2)),
                          (BLOCK_N, BLOCK_K // 2))
        byte = packed.to(tl.int32) & 0xFF
        low = tl.load(table_ptr + base + (byte & 0xF))
        high = tl.load(table_ptr + base + (byte >> 4))
    else:
        low = (packed << 4) >> 4  # int8 arithmetic shift sign-extends the low nibble
        high = packed >> 4
    return tl.reshape(tl.join(low, high), (BLOCK_N, BLOCK_K))


@triton.jit
def _w4a8_mm_kernel(
    a_ptr, w_ptr, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, s_ptr, table_ptr,
    M, N, K, stride_am, stride_wn, stride_sn, stride_cm,
    CODEBOOK: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    SWAP_AB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_a = tl.max_contiguous(tl.multiple_of(offs_m % M, BLOCK_M), BLOCK_M)
    rows_b = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kb = tl.arange(0, BLOCK_K // 2)
    a_ptrs = a_ptr + rows_a[:, None].to(tl.int64) * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + rows_b[:, None].to(tl.int64) * stride_wn + offs_kb[None, :]
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            packed = tl.load(w_ptrs)
        else:
            a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k * BLOCK_K, other=0)
            packed = tl.load(w_ptrs, mask=offs_kb[None, :] < (K - k * BLOCK_K) // 2, other=0)
        w = _decode_w4(packed, s_ptr, table_ptr, rows_b, k * (BLOCK_K // 2), stride_sn,
                       CODEBOOK, GROUP, BLOCK_N, BLOCK_K)
        if SWAP_AB:
            acc = tl.dot(w, tl.trans(a), acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(a, tl.trans(w), acc, out_dtype=tl.int32)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K // 2
    if SWAP_AB:
        acc = tl.trans(acc)
    _epilogue(acc, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, a_scale_ptr, a_scale_ptr,
              offs_m, offs_n, M, N, stride_cm, True, HAS_BIAS, False)


def w4a8_mm_triton(a: torch.Tensor, packed: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None, s_rel: torch.Tensor | None, table: torch.Tensor | None,
                   group_size: int, out_dtype: torch.dtype, config: GemmConfig,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch :func:`_w4a8_mm_kernel`. ``s_rel``/``table`` given ⇒ codebook decode, else signed nibbles.

    ``out`` (tests: a poisoned buffer) receives the result when given.
    """
    m, k = a.shape
    n = packed.shape[0]
    if s_rel is not None and k % config.block_k:
        raise ValueError(f"the codebook decode needs K ({k}) to be a multiple of the K tile ({config.block_k})")
    out = torch.empty((m, n), dtype=out_dtype, device=a.device) if out is None else out
    if m == 0 or n == 0:
        return out
    codebook = s_rel is not None
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    _w4a8_mm_kernel[grid](
        a, packed, out, a_scale, w_scale, bias if bias is not None else a_scale,
        s_rel.view(torch.uint8) if codebook else packed, table if codebook else packed,
        m, n, k, a.stride(0), packed.stride(0), s_rel.stride(0) if codebook else 0, out.stride(0),
        CODEBOOK=codebook, GROUP=group_size if codebook else 16, HAS_BIAS=bias is not None,
        EVEN_K=k % config.block_k == 0, SWAP_AB=config.swap_ab,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
