"""Triton: per-token activation quantization of ``[a | gelu(b)]``, the GELU and the concatenation fused in.

Transformer MLPs feed their second linear ``gelu(h)``, and Flux's single blocks feed it
``cat(attention, gelu(mlp))``. Run as written, that is a pointwise kernel writing the bf16 input in
full and a quantization kernel reading it again. Here one program owns ``BLOCK_M`` whole rows: it
reads ``a`` (``Ka`` columns, may be absent) and ``b`` (``Kb`` columns, before the GELU), applies
the GELU to ``b`` in fp32 and rounds it to the input dtype (so the codes are those of the very
tensor the unfused graph would quantize, up to the last bit of ``tanh``), then takes the row
abs-max and stores INT8 or FP8 codes and the fp32 scales, as ``triton_act_quant.py``'s plain path.

GELU: ``"tanh"`` is ``x * sigmoid(2u)``, ``u = sqrt(2/pi) (x + 0.044715 x^3)`` (the same function as
``0.5 x (1 + tanh(u))``, one exponential); ``"none"`` is ``0.5 x (1 + erf(x / sqrt(2)))``.

No smoothing, centring or rotation: this serves the plain W8A8 formats (``int8``, ``fp8``,
``fp8_rowwise``). ``quant/compile_fusion.py`` routes compiled graphs here.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .backend import interpreting
from .launcher import TritonLauncher
from .reference import FP8
from .triton_act_quant import MAX_BLOCK_K
from .triton_act_quant_parts import _pow2_at_least, _row_scales, _store_codes

GELU_APPROXIMATIONS = {"none": 0, "tanh": 1}
TILE_ELEMENTS = 4096  # elements a program (as the plain act-quant kernel: measured on an H200)


@triton.jit
def _gelu(x, APPROX: tl.constexpr):
    if APPROX == 1:
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        return x / (1.0 + tl.exp(tl.minimum(-2.0 * u, 80.0)))  # e^80: the quotient is 0 already
    return 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))


@triton.jit
def _gelu_act_quant_kernel(
    a_ptr, b_ptr, q_ptr, scale_ptr, M, KA, KB, stride_am, stride_bm, stride_qm, qmax,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, HAS_A: tl.constexpr, APPROX: tl.constexpr,
    OUT_FP8: tl.constexpr, HW_FP8_CAST: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    in_b = (cols >= KA) & (cols < KA + KB)
    xb = tl.load(b_ptr + rows[:, None].to(tl.int64) * stride_bm + (cols - KA)[None, :],
                 mask=row_ok[:, None] & in_b[None, :], other=0.0)
    # the GELU in fp32, rounded to the input dtype: the value the unfused graph would hold
    x = _gelu(xb.to(tl.float32), APPROX)
    if ROUND_BF16:  # to nearest-even by hand (the CPU interpreter's bf16 cast truncates)
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    else:
        x = x.to(xb.dtype).to(tl.float32)
    if HAS_A:
        in_a = cols < KA
        xa = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_am + cols[None, :],
                     mask=row_ok[:, None] & in_a[None, :], other=0.0)
        x = tl.where(in_a[None, :], xa.to(tl.float32), x)
    mask = row_ok[:, None] & (cols < KA + KB)[None, :]
    x = tl.where(mask, x, 0.0)
    inv = _row_scales(tl.max(tl.abs(x), axis=1), qmax, scale_ptr, rows, row_ok, BLOCK_M)
    y = tl.minimum(tl.maximum(x * inv[:, None], -qmax), qmax)
    q_ptrs = q_ptr + rows[:, None].to(tl.int64) * stride_qm + cols[None, :]
    _store_codes(q_ptrs, y, mask, OUT_FP8, 0, HW_FP8_CAST, BLOCK_M, BLOCK_K)


@functools.lru_cache(maxsize=1024)
def _launch_shape(m: int, k: int, tile_elements: int, num_warps: int | None) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_K, num_warps, programs) for rows of ``k`` features."""
    block_k = max(_pow2_at_least(k), 16)
    block_m = max(1, min(16, tile_elements // block_k, _pow2_at_least(m)))
    if num_warps is None:
        num_warps = 4 if block_m * block_k <= 4096 else 8
    return block_m, block_k, num_warps, -(-m // block_m)


def gelu_act_quant_problem(k: int, approximate: str) -> str | None:
    """Why the kernel cannot take rows of ``k`` features with this GELU (``None`` when it can)."""
    if approximate not in GELU_APPROXIMATIONS:
        return f"GELU approximate={approximate!r} is not one of {sorted(GELU_APPROXIMATIONS)}"
    if _pow2_at_least(k) > MAX_BLOCK_K:
        return f"rows of {k} features exceed the register-resident limit of {MAX_BLOCK_K}"
    return None


def gelu_act_quant_triton(a: torch.Tensor | None, b: torch.Tensor, out_dtype: torch.dtype, qmax: float,
                          approximate: str = "tanh", tile_elements: int = TILE_ELEMENTS,
                          num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``[M, Ka + Kb]`` and fp32 scales ``[M, 1]`` of ``cat([a, gelu(b)], -1)`` (``a`` may be
    ``None``), quantized per row. ``a``, ``b``: 2-D, same rows and dtype, unit column stride (any row
    stride: ``b`` may be a column slice of a wider tensor). ``out_dtype``: int8 or float8_e4m3fn.
    ``tile_elements`` / ``num_warps``: the program size (benchmark sweeps)."""
    if b.dim() != 2 or (a is not None and (a.dim() != 2 or a.shape[0] != b.shape[0] or a.dtype != b.dtype)):
        raise ValueError(f"a and b must be 2-D with the same rows and dtype, got "
                         f"{None if a is None else (tuple(a.shape), a.dtype)} and {(tuple(b.shape), b.dtype)}")
    if b.stride(1) != 1:
        b = b.contiguous()
    if a is not None and a.stride(1) != 1:
        a = a.contiguous()
    m, kb = b.shape
    ka = 0 if a is None else a.shape[1]
    problem = gelu_act_quant_problem(ka + kb, approximate)
    if problem:
        raise ValueError(problem)
    q = torch.empty((m, ka + kb), dtype=out_dtype, device=b.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=b.device)
    if m == 0:
        return q, scale
    block_m, block_k, num_warps, programs = _launch_shape(m, ka + kb, tile_elements, num_warps)
    _LAUNCHER.launch(
        (programs,),
        (b if a is None else a, b, q, scale, m, ka, kb, 0 if a is None else a.stride(0), b.stride(0), q.stride(0),
         float(qmax)),
        dict(BLOCK_M=block_m, BLOCK_K=block_k, HAS_A=a is not None, APPROX=GELU_APPROXIMATIONS[approximate],
             OUT_FP8=out_dtype == FP8, HW_FP8_CAST=b.is_cuda and not interpreting(),
             ROUND_BF16=b.dtype == torch.bfloat16),
        num_warps=num_warps,
    )
    return q, scale


_LAUNCHER = TritonLauncher(_gelu_act_quant_kernel)
