"""The q, k, v of a joint attention from its streams' projections: normalized, rotated and joined in one pass.

:func:`joint_qkv` takes the streams in sequence order (Qwen-Image: text, then image), each a :class:`JointPart` of
its three ``[B, S, H * D]`` projections and its q/k RMSNorms, and returns ``q, k, v`` of ``[B, H, sum S, D]``, as
ComfyUI computes them before its attention call: heads viewed, q and k normalized per head, the streams
concatenated, q and k rotated by ``freqs`` (``[Bf, 1, Sf, D / 2, 2, 2]``, Flux's RoPE matrices). On a GPU (or the
Triton interpreter) it runs ``kernels/triton_joint_heads.py``, one launch per stream; elsewhere, or for inputs the
kernel does not take, :func:`kernels.reference.joint_qkv_reference`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backend import triton_problem
from .reference import joint_qkv_reference

#: the activation dtypes the kernel takes
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class JointPart:
    """One stream: its projections ``q``, ``k``, ``v`` (``[B, S, H * D]``, the last dimension contiguous), whether
    q and k are RMS-normalized per head, with which weights (``[D]`` or ``None``) and epsilons."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_norm: bool = True
    k_norm: bool = True
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    q_eps: float = 1e-6
    k_eps: float = 1e-6


def kernel_problem(parts: tuple[JointPart, ...], heads: int, freqs: torch.Tensor | None) -> str | None:
    """Why the Triton kernel cannot take these inputs (``None`` when it can)."""
    first = parts[0].q
    why = triton_problem(first.device)
    if why is not None:
        return why
    if first.dtype not in _DTYPES:
        return f"activations of {first.dtype}"
    batch, width = first.shape[0], first.shape[-1]
    if heads <= 0 or width % heads:
        return f"{width} channels are not {heads} heads"
    d = width // heads
    if d < 16 or d > 256 or d & (d - 1):
        return f"head size {d} is not a power of two from 16 to 256"
    total = 0
    for part in parts:
        for t in (part.q, part.k, part.v):
            if (t.dim() != 3 or t.shape[0] != batch or t.shape[-1] != width or t.shape[1] != part.q.shape[1]
                    or t.dtype != first.dtype or t.device != first.device or t.stride(-1) != 1):
                return "projections of another shape, dtype, device or layout"
        for w in (part.q_weight, part.k_weight):
            if w is not None and (w.shape != (d,) or w.device != first.device or not w.is_contiguous()):
                return "a norm weight that is not [head size] on the activations' device"
        total += part.q.shape[1]
    if freqs is not None:
        if (freqs.dim() != 6 or freqs.shape[0] not in (1, batch) or freqs.shape[1] != 1
                or freqs.shape[3:] != (d // 2, 2, 2) or (freqs.shape[2] != 1 and freqs.shape[2] < total)
                or freqs.stride()[3:] != (4, 2, 1) or freqs.device != first.device or not freqs.is_floating_point()):
            return f"rotary matrices of shape {tuple(freqs.shape)}"
    return None


def joint_qkv(parts, heads: int, freqs: torch.Tensor | None, *, reference: bool = False):
    """``q, k, v`` (``[B, H, S, D]``, contiguous) of the streams ``parts`` joined in order; see the module
    docstring. ``reference`` runs the pure-torch definition."""
    parts = tuple(parts)
    if reference or kernel_problem(parts, heads, freqs) is not None:
        return joint_qkv_reference(parts, heads, freqs)
    from .triton_joint_heads import joint_qkv_part_triton

    first = parts[0].q
    batch, d = first.shape[0], first.shape[-1] // heads
    total = sum(part.q.shape[1] for part in parts)
    q, k, v = (torch.empty((batch, heads, total, d), dtype=first.dtype, device=first.device) for _ in range(3))
    row0 = 0
    for part in parts:
        joint_qkv_part_triton(part, row0, heads, freqs, q, k, v)
        row0 += part.q.shape[1]
    return q, k, v
