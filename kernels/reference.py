"""Pure-torch references of every LowBit kernel: the definition each Triton kernel must match.

They run on any device and are what ``Backend.EAGER`` executes. Arithmetic is spelled out in the
order the Triton kernels use, so that where a result can be exact (INT8 codes without rotation,
FP8 codes, INT8 GEMM accumulators) the kernels reproduce it bit for bit.

Activation quantization (one token = one row ``x`` of ``[M, K]``)::

    x' = x * smooth                (optional, HadaNorm column smoothing)
    mu = mean(x'); x' = x' - mu    (optional, HadaNorm centring; mu is returned)
    x' = x' @ blockdiag(H)         (optional, block Hadamard rotation, groups of ``group_size``)
    a  = max(max|x'|, 1e-30);  inv = qmax / a;  scale = a / qmax
    q  = clamp(rint(x' * inv), -qmax, qmax) as int8     (INT8; qmax 127, or 7 for 4-bit codes)
    q  = clamp(x' * inv, -448, 448) as float8_e4m3fn     (FP8, round-to-nearest-even)

FP8 outlier channels (LLM.int8-style split, ``O`` = a small set of ``r`` input channels): the
activation codes get ``2r`` extra columns ``[q | lo[:, O] | q[:, O]]`` with ``lo = e4m3(y - q)`` the
residual of the row's own codes on the same per-token scale; the weight stores the matching
``[w | w[:, O] | w_lo[:, O]]``, so one FP8 GEMM over ``K + 2r`` columns adds
``lo[O] . w[O] + q[O] . w_lo[O]`` to the plain product (``fp8_outlier_split``).

Weight-only product (few rows): ``out = float32(round_in(x') @ W.T) * w_scale[n] (+ mu[m] * rowsum[n]) + bias[n]``
with ``x'`` the smoothed, centred and rotated activation (each optional, as above) rounded to its own dtype, no
codes (``weight_only_reference``).

Scaled GEMM: ``out = float32(A_q @ B_q.T) * a_scale[m] * b_scale[n] + row_shift[m] * col_shift[n]
+ bias[n]``, the INT8 product accumulated exactly in int32, then cast to the output dtype.
"""

from __future__ import annotations

import torch

from .hadamard import rotate_blocks

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0
INT4_MAX = 7.0
ABSMAX_FLOOR = 1e-30
ROTATIONS = ("none", "regular", "sylvester")


def act_quant_reference(x: torch.Tensor, out_dtype: torch.dtype = torch.int8, qmax: float | None = None,
                        rotation: str = "none", group_size: int = 0, smooth: torch.Tensor | None = None,
                        center: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize ``x`` ``[M, K]`` per row; returns codes ``[M, K]``, scales ``[M, 1]`` and means fp32.

    ``means`` is ``[M, 1]`` when ``center``, else an empty ``[M, 0]``. See the module docstring for the exact arithmetic.
    """
    if qmax is None:
        qmax = FP8_MAX if out_dtype == FP8 else INT8_MAX
    xf = x.float()
    if smooth is not None:
        xf = xf * smooth.float().reshape(1, -1)
    mean = torch.empty(xf.shape[0], 0, dtype=torch.float32, device=x.device)  # [M, 1] when centring
    if center:
        mean = xf.sum(dim=-1, keepdim=True) / xf.shape[-1]
        xf = xf - mean
    if rotation != "none":
        xf = rotate_blocks(xf, rotation, group_size)
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=ABSMAX_FLOOR)
    inv = torch.full_like(amax, qmax) / amax
    scale = amax / qmax
    y = xf * inv
    if out_dtype == FP8:
        q = y.clamp(-qmax, qmax).to(FP8)
    else:
        q = torch.round(y).clamp(-qmax, qmax).to(torch.int8)
    return q, scale, mean


def fp8_outlier_split(y: torch.Tensor, codes: torch.Tensor, outlier_index: torch.Tensor,
                      low_first: bool) -> torch.Tensor:
    """``[M, K]`` e4m3 ``codes`` of ``y`` (fp32, already in code units and clamped to ±448) with the
    ``2r`` outlier columns appended: ``[codes | lo[:, O] | codes[:, O]]`` when ``low_first`` (the
    activation side), else ``[codes | codes[:, O] | lo[:, O]]`` (the weight side), where
    ``lo = e4m3(y - codes)`` (round-to-nearest-even; ``y - codes`` is exact in fp32)."""
    index = outlier_index.to(device=codes.device, dtype=torch.long)
    hi = codes[:, index]
    lo = (y[:, index] - hi.float()).to(FP8)
    return torch.cat((codes, lo, hi) if low_first else (codes, hi, lo), dim=1)


def act_quant_outliers_reference(x: torch.Tensor, outlier_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 per-token codes ``[M, K + 2r]`` of ``x`` ``[M, K]`` with the outlier columns of
    ``outlier_index`` (int32 ``[r]``) appended (see the module docstring), and the ``[M, 1]`` scales
    (those of the whole row, as :func:`act_quant_reference`)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp(min=ABSMAX_FLOOR)
    inv = torch.full_like(amax, FP8_MAX) / amax
    scale = amax / FP8_MAX
    y = (xf * inv).clamp(-FP8_MAX, FP8_MAX)
    return fp8_outlier_split(y, y.to(FP8), outlier_index, low_first=True), scale


def scaled_mm_reference(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                        bias: torch.Tensor | None = None, row_shift: torch.Tensor | None = None,
                        col_shift: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``A [M, K] @ B [N, K].T`` of INT8 or FP8 codes with the scale / shift / bias epilogue.

    ``a_scale``: ``[M, 1]`` (or ``[M]``); ``b_scale``: ``[N]``, ``[N, 1]`` or one value.
    """
    acc = (a.double() @ b.double().t()).float()  # exact for INT8 (|acc| < 2^53), then rounded once
    out = acc * a_scale.float().reshape(-1, 1) * b_scale.float().reshape(1, -1)
    if row_shift is not None:
        out = out + row_shift.float().reshape(-1, 1) * col_shift.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float().reshape(1, -1)
    return out.to(out_dtype)


def weight_only_reference(x: torch.Tensor, weight: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                          out_dtype: torch.dtype, rotation: str = "none", group_size: int = 0,
                          smooth: torch.Tensor | None = None, center_rowsum: torch.Tensor | None = None
                          ) -> torch.Tensor:
    """The W8A16 product (``triton_w8a16_gemm.py``): ``x`` smoothed, centred and rotated in fp32 (each as given)
    and rounded back to its own dtype, times the INT8 / e4m3 weight's values (no activation quantization), fp32
    sums, then ``w_scale`` (``[N]`` or one value), the centred-out mean times ``center_rowsum``, and the bias, cast
    once to ``out_dtype``."""
    xf = x.float()
    if smooth is not None:
        xf = xf * smooth.float().reshape(1, -1)
    mean = None
    if center_rowsum is not None:
        mean = xf.sum(dim=-1, keepdim=True) / xf.shape[-1]
        xf = xf - mean
    if rotation != "none":
        xf = rotate_blocks(xf, rotation, group_size)
    out = (xf.to(x.dtype).double() @ weight.double().t()).float() * w_scale.float().reshape(1, -1)
    if mean is not None:
        out = out + mean * center_rowsum.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def int8_accumulate_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact int32 ``A @ B.T`` for INT8 codes (float64 products are exact at these sizes)."""
    return (a.double() @ b.double().t()).round().to(torch.int32)


# ---- 4-bit weight storage --------------------------------------------------------------------

def unpack_int4_signed(packed: torch.Tensor) -> torch.Tensor:
    """``[..., K/2]`` bytes of two signed nibbles (low nibble = even column) → int8 ``[..., K]``."""
    p = packed.view(torch.int8)
    low = torch.bitwise_right_shift(torch.bitwise_left_shift(p, 4), 4)  # arithmetic shift sign-extends
    high = torch.bitwise_right_shift(p, 4)
    return torch.stack((low, high), dim=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def pack_int4_signed(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`unpack_int4_signed` (any leading dims): ``[..., K]`` codes in ``[-8, 7]`` → int8
    ``[..., K/2]``, the even column in the low nibble (comfy-kitchen's row-major packing)."""
    low = codes[..., 0::2].to(torch.int32) & 0x0F
    high = codes[..., 1::2].to(torch.int32) & 0x0F
    return (low | (high << 4)).to(torch.int8)


def unpack_uint4(packed: torch.Tensor) -> torch.Tensor:
    """``[N, K/2]`` bytes of two unsigned nibbles (low nibble = even column) → int64 codes ``[N, K]``."""
    p = packed.view(torch.uint8).long()
    return torch.stack((p & 0xF, p >> 4), dim=-1).reshape(p.shape[0], p.shape[1] * 2)


def codebook_values(codebook: torch.Tensor | None, device=None) -> torch.Tensor:
    """The 16 fp32 values a W4A8 code stands for: the stored codebook, or ``code - 8``."""
    if codebook is None:
        return torch.arange(16, dtype=torch.float32, device=device) - 8.0
    return codebook.to(device=device, dtype=torch.float32).reshape(16)


def w4a8_level_table(codebook: torch.Tensor | None, device=None) -> torch.Tensor:
    """int8 ``[256, 16]``: the INT8 level of code ``c`` in a group whose FP8 scale has byte ``b``.

    ``level = clamp(round(codebook[c] * fp8(b)), -127, 127)`` – the decode comfy-kitchen applies
    before its INT8 GEMM, tabulated once per tensor (4 KiB) so a kernel decodes with one lookup.
    """
    scales = torch.arange(256, dtype=torch.uint8, device=device).view(FP8).float()
    scales = torch.nan_to_num(scales, nan=0.0)
    levels = (codebook_values(codebook, device).reshape(1, 16) * scales.reshape(256, 1)).round()
    return levels.clamp(-127, 127).to(torch.int8).contiguous()


def decode_w4a8_levels(packed: torch.Tensor, s_rel: torch.Tensor, codebook: torch.Tensor | None,
                       group_size: int) -> torch.Tensor:
    """Grouped 4-bit codes → the int8 ``[N, K]`` weight the INT8 GEMM multiplies (kitchen's decode)."""
    codes = unpack_uint4(packed)
    n, k = codes.shape
    values = codebook_values(codebook, packed.device)[codes]
    values = values.view(n, k // group_size, group_size) * s_rel.float().unsqueeze(-1)
    return values.view(n, k).round().clamp(-127, 127).to(torch.int8)



def rope_reference(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``x`` (``[B, H, S, D]``) rotated by Flux's RoPE matrices ``freqs`` (``[Bf, 1, Sf, D / 2, 2, 2]``, the first
    ``S`` rows used), in fp32: ``out[2i + r] = f[i, r, 0] x[2i] + f[i, r, 1] x[2i + 1]``."""
    f = freqs[:, :, : x.shape[2]].float() if freqs.shape[2] != 1 else freqs.float()
    pairs = x.float().reshape(*x.shape[:-1], -1, 1, 2)
    return (f[..., 0] * pairs[..., 0] + f[..., 1] * pairs[..., 1]).reshape(x.shape).to(x.dtype)


def joint_qkv_reference(parts, heads: int, freqs: torch.Tensor | None):
    """The definition of ``kernels/triton_joint_heads.py``: each stream's ``[B, S, H * D]`` projections viewed as
    ``[B, H, S, D]`` heads, q and k RMS-normalized over ``D`` (``F.rms_norm``: normalized in fp32, rounded, times
    the weight), the streams concatenated along the sequence in order, q and k rotated (:func:`rope_reference`)."""
    def as_heads(t):
        return t.view(t.shape[0], t.shape[1], heads, -1).transpose(1, 2)

    def normed(t, norm, weight, eps):
        t = as_heads(t)
        return torch.nn.functional.rms_norm(t, (t.shape[-1],), weight, eps) if norm else t

    q = torch.cat([normed(p.q, p.q_norm, p.q_weight, p.q_eps) for p in parts], dim=2)
    k = torch.cat([normed(p.k, p.k_norm, p.k_weight, p.k_eps) for p in parts], dim=2)
    v = torch.cat([as_heads(p.v) for p in parts], dim=2)
    if freqs is not None:
        q, k = rope_reference(q, freqs), rope_reference(k, freqs)
    return q, k, v
