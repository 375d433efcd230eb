"""Block Hadamard rotations shared by the INT8 rotation formats.

Two constructions are used:

* ``regular``  – the *regular* Hadamard matrix built from Kronecker powers of the 4×4 regular
  Hadamard (every row sums to the same value). ConvRot uses it in groups of 256; it is the
  construction comfy-kitchen uses for its native ``int8_tensorwise`` + ``convrot`` format.
* ``sylvester`` – the classic Sylvester construction ``H_{2n} = [[H, H], [H, -H]]`` used by
  QuaRot; any power of two.

Both are returned orthonormal (``H @ H.T == I``), so rotating activations by ``H`` and weights by
``H`` leaves ``x @ w.T`` unchanged: ``(x H)(w H)^T = x H H^T w^T = x w^T``.
"""

from __future__ import annotations

import functools

import torch

HADAMARD_KINDS = ("regular", "sylvester")


@functools.lru_cache(maxsize=32)
def _hadamard_cpu_fp32(kind: str, size: int) -> torch.Tensor:
    if kind == "regular":
        if size < 4 or size & (size - 1) or (size.bit_length() - 1) % 2:
            raise ValueError(f"a regular Hadamard matrix needs a power of 4 (16, 64, 256, ...), got {size}")
        base = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float64)
    elif kind == "sylvester":
        if size < 2 or size & (size - 1):
            raise ValueError(f"a Sylvester Hadamard matrix needs a power of 2, got {size}")
        base = torch.tensor([[1, 1], [1, -1]], dtype=torch.float64)
    else:
        raise ValueError(f"unknown Hadamard kind {kind!r}; expected one of {HADAMARD_KINDS}")
    matrix = base
    while matrix.shape[0] < size:
        matrix = torch.kron(matrix, base)
    return (matrix / size**0.5).to(torch.float32)


def hadamard_matrix(kind: str, size: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Orthonormal ``size``×``size`` Hadamard matrix of the given construction."""
    return _hadamard_cpu_fp32(kind, int(size)).to(device=device, dtype=dtype)


def rotate_blocks(x: torch.Tensor, kind: str, group_size: int) -> torch.Tensor:
    """Multiply every contiguous ``group_size`` block of the last dimension by ``H``.

    Used for activations at run time and for weights at quantization time (the same product on
    both sides cancels in ``x @ w.T``). Computed in the input's dtype when it is fp32 or fp64,
    otherwise in fp32 and cast back.
    """
    features = x.shape[-1]
    if features % group_size:
        raise ValueError(
            f"cannot rotate {features} features in Hadamard groups of {group_size}: "
            f"{features} is not a multiple of {group_size}"
        )
    compute_dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    h = hadamard_matrix(kind, group_size, device=x.device, dtype=compute_dtype)
    grouped = x.to(compute_dtype).reshape(*x.shape[:-1], features // group_size, group_size)
    return (grouped @ h).reshape(x.shape).to(x.dtype)


def unrotate_blocks(x: torch.Tensor, kind: str, group_size: int) -> torch.Tensor:
    """Inverse of :func:`rotate_blocks` (multiply each block by ``H.T``)."""
    features = x.shape[-1]
    if features % group_size:
        raise ValueError(f"{features} features is not a multiple of the Hadamard group {group_size}")
    compute_dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    h = hadamard_matrix(kind, group_size, device=x.device, dtype=compute_dtype)
    grouped = x.to(compute_dtype).reshape(*x.shape[:-1], features // group_size, group_size)
    return (grouped @ h.T).reshape(x.shape).to(x.dtype)
