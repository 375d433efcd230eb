"""Triton: 4-bit weight storage × INT8 activations, decoded in registers (no expanded weight).

The weight stays packed, ``[N, K/2]`` bytes, two nibbles a byte (low nibble = even column), as
comfy-kitchen stores it. Each program loads a ``[BLOCK_N, BLOCK_K/2]`` byte tile and decodes it
into two INT8 planes – the low nibbles (even columns) and the high nibbles (odd columns) – that
feed the INT8 tensor cores directly (Hopper has no INT4 MMA); the product is exact in int32.

No re-interleaving: the activation codes arrive with the columns of every ``BLOCK_K`` block
ordered evens first, then odds (``act_quant(..., perm_block=BLOCK_K)``), so each K step is two
dots, ``A_even @ low.T + A_odd @ high.T``, over contiguous halves of the activation tile.

Two decodes:

* ``CODEBOOK=False`` – signed nibbles, ``[-8, 7]`` (``convrot_w4a4``). On a GPU, one inline-PTX
  block turns each 32-bit word (4 bytes, 8 nibbles) into the two planes with ten integer
  instructions – ``((n ^ 8) + 0x78) ^ 0x80`` per byte, with no carry between bytes. The CPU
  interpreter, which cannot run PTX, uses the equivalent shifts. The per-output-channel scale is
  applied in the epilogue.
* ``CODEBOOK=True`` – grouped codes (``asym_w4a8_int8``): the level of code ``c`` in a group with
  FP8 scale byte ``s`` is ``table[s, c]`` (``reference.w4a8_level_table``: 256×16 int8, 4 KiB,
  ``round(codebook[c] * fp8(s))``, exactly comfy-kitchen's decode), one cached lookup per weight.

``SWAP_AB`` computes the transposed tile (the decoded weight as the left operand, which Hopper's
``wgmma`` can take from registers) and stores it transposed; the dispatcher measures both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .backend import interpreting
from .gemm_config import GemmConfig
from .launcher import TritonLauncher
from .triton_w8a8_gemm import _epilogue, _tile_ids


@triton.jit
def _decode_w4(packed, s_ptr, table_ptr, rows_b, k_byte0, stride_sn,
               CODEBOOK: tl.constexpr, GROUP: tl.constexpr, USE_PTX: tl.constexpr,
               BLOCK_N: tl.constexpr, HALF: tl.constexpr):
    """``[BLOCK_N, HALF]`` packed bytes → (low-nibble plane, high-nibble plane), int8 each."""
    if CODEBOOK:
        GROUPS: tl.constexpr = 2 * HALF // GROUP
        g = tl.arange(0, GROUPS)
        s_off = rows_b[:, None].to(tl.int64) * stride_sn + (k_byte0 * 2) // GROUP + g[None, :]
        s_byte = tl.load(s_ptr + s_off).to(tl.int32) & 0xFF  # [BLOCK_N, GROUPS]
        base = tl.reshape(tl.broadcast_to((s_byte * 16)[:, :, None], (BLOCK_N, GROUPS, GROUP // 2)),
                          (BLOCK_N, HALF))
        byte = packed.to(tl.int32) & 0xFF
        low = tl.load(table_ptr + base + (byte & 0xF))
        high = tl.load(table_ptr + base + (byte >> 4))
    elif USE_PTX:
        # 4 bytes a 32-bit register (pack=4). Per byte, low nibble n: t = n ^ 8 is in [0, 15], and
        # (t + 0x78) ^ 0x80 is t - 8 as a signed byte; t + 0x78 <= 0x87 never carries into the next
        # byte. The high nibble: the same on w >> 4.
        low, high = tl.inline_asm_elementwise(
            "{ .reg .b32 t; and.b32 t, $2, 0x0F0F0F0F; xor.b32 t, t, 0x08080808; add.u32 t, t, 0x78787878; "
            "xor.b32 $0, t, 0x80808080; shr.u32 t, $2, 4; and.b32 t, t, 0x0F0F0F0F; xor.b32 t, t, 0x08080808; "
            "add.u32 t, t, 0x78787878; xor.b32 $1, t, 0x80808080; }",
            "=r,=r,r", [packed], dtype=(tl.int8, tl.int8), is_pure=True, pack=4)
    else:
        low = (packed << 4) >> 4  # int8 arithmetic shift sign-extends the low nibble
        high = packed >> 4
    return low, high


@triton.jit
def _w4a8_mm_kernel(
    a_ptr, w_ptr, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, s_ptr, table_ptr,
    M, N, K, stride_am, stride_wn, stride_sn, stride_cm,
    CODEBOOK: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, USE_PTX: tl.constexpr,
    SWAP_AB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    HALF: tl.constexpr = BLOCK_K // 2
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_a = tl.max_contiguous(tl.multiple_of(offs_m % M, BLOCK_M), BLOCK_M)
    rows_b = tl.max_contiguous(tl.multiple_of(offs_n % N, BLOCK_N), BLOCK_N)
    offs_h = tl.arange(0, HALF)
    a_even_ptrs = a_ptr + rows_a[:, None].to(tl.int64) * stride_am + offs_h[None, :]
    w_ptrs = w_ptr + rows_b[:, None].to(tl.int64) * stride_wn + offs_h[None, :]
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k in range(0, K // BLOCK_K):  # K is a multiple of BLOCK_K (checked by the launcher)
        a_even = tl.load(a_even_ptrs)
        a_odd = tl.load(a_even_ptrs + HALF)
        packed = tl.load(w_ptrs)
        low, high = _decode_w4(packed, s_ptr, table_ptr, rows_b, k * HALF, stride_sn,
                               CODEBOOK, GROUP, USE_PTX, BLOCK_N, HALF)
        if SWAP_AB:
            acc = tl.dot(low, tl.trans(a_even), acc, out_dtype=tl.int32)
            acc = tl.dot(high, tl.trans(a_odd), acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(a_even, tl.trans(low), acc, out_dtype=tl.int32)
            acc = tl.dot(a_odd, tl.trans(high), acc, out_dtype=tl.int32)
        a_even_ptrs += BLOCK_K
        w_ptrs += HALF
    if SWAP_AB:
        acc = tl.trans(acc)
    _epilogue(acc, c_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, a_scale_ptr, a_scale_ptr,
              offs_m, offs_n, M, N, stride_cm, True, HAS_BIAS, False)


def w4a8_mm_triton(a: torch.Tensor, packed: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None, s_rel: torch.Tensor | None, table: torch.Tensor | None,
                   group_size: int, out_dtype: torch.dtype, config: GemmConfig,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch :func:`_w4a8_mm_kernel`. ``a``'s columns must be permuted in blocks of ``config.block_k``
    (evens, then odds). ``s_rel``/``table`` given ⇒ codebook decode, else signed nibbles.

    ``out`` (tests: a poisoned buffer) receives the result when given.
    """
    m, k = a.shape
    n = packed.shape[0]
    if k % config.block_k:
        raise ValueError(f"the 4-bit GEMM needs K ({k}) to be a multiple of its K tile ({config.block_k})")
    out = torch.empty((m, n), dtype=out_dtype, device=a.device) if out is None else out
    if m == 0 or n == 0:
        return out
    codebook = s_rel is not None
    grid = (-(-m // config.block_m) * -(-n // config.block_n),)
    _LAUNCHER.launch(
        grid,
        (a, packed, out, a_scale, w_scale, bias if bias is not None else a_scale,
         s_rel.view(torch.uint8) if codebook else packed, table if codebook else packed,
         m, n, k, a.stride(0), packed.stride(0), s_rel.stride(0) if codebook else 0, out.stride(0)),
        dict(CODEBOOK=codebook, GROUP=group_size if codebook else 16, HAS_BIAS=bias is not None,
             USE_PTX=_use_ptx(a), SWAP_AB=config.swap_ab, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
             BLOCK_K=config.block_k, GROUP_M=config.group_m),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


_LAUNCHER = TritonLauncher(_w4a8_mm_kernel)


def _use_ptx(a: torch.Tensor) -> bool:
    return a.is_cuda and not interpreting()
