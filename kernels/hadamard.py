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


def _check(kind: str, size: int) -> None:
    if kind == "regular":
        if size < 4 or size & (size - 1) or (size.bit_length() - 1) % 2:
            raise ValueError(f"a regular Hadamard matrix needs a power of 4 (16, 64, 256, ...), got {size}")
    elif kind == "sylvester":
        if size < 2 or size & (size - 1):
            raise ValueError(f"a Sylvester Hadamard matrix needs a power of 2, got {size}")
    else:
        raise ValueError(f"unknown Hadamard kind {kind!r}; expected one of {HADAMARD_KINDS}")


@functools.lru_cache(maxsize=32)
def _hadamard_cpu_fp32(kind: str, size: int) -> torch.Tensor:
    _check(kind, size)
    if kind == "regular":
        base = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=torch.float64)
    else:
        base = torch.tensor([[1, 1], [1, -1]], dtype=torch.float64)
    matrix = base
    while matrix.shape[0] < size:
        matrix = torch.kron(matrix, base)
    return (matrix / size**0.5).to(torch.float32)


def _hadamard_from_indices(kind: str, size: int, device, dtype) -> torch.Tensor:
    """The same matrix as :func:`_hadamard_cpu_fp32`, bit for bit, computed from row/column indices
    with tensor ops only (no cache, no Python-held tensor), so it can be built under fake tensors.

    Entry ``(i, j)`` of a Kronecker power of a base matrix is the product of the base's entries at
    each pair of digits of ``i`` and ``j``: Sylvester (base 2) is ``-1`` where ``i & j`` has an odd
    bit count; regular (base 4, ``-1`` where the two digits sum to 3) is ``-1`` where an odd number
    of base-4 digit pairs sum to 3.
    """
    _check(kind, size)
    index = torch.arange(size, device=device)
    rows, cols = index[:, None], index[None, :]
    odd = torch.zeros((size, size), dtype=torch.bool, device=device)
    if kind == "sylvester":
        both = rows & cols
        for bit in range(size.bit_length() - 1):
            odd = odd ^ (((both >> bit) & 1) == 1)
    else:
        for digit in range((size.bit_length() - 1) // 2):
            odd = odd ^ ((((rows >> (2 * digit)) & 3) + ((cols >> (2 * digit)) & 3)) == 3)
    sign = 1.0 - 2.0 * odd.to(torch.float32)
    # +-1 times the float32 rounding of 1/sqrt(size): what the cached float64 build rounds to
    return (sign * (1.0 / size**0.5)).to(dtype)


def _building_a_graph() -> bool:
    """Whether torch.compile (Dynamo, or AOT tracing under fake tensors) is running this code: a
    tensor cached by an eager call is a real tensor, which a fake-tensor graph cannot take in."""
    return torch.compiler.is_compiling() or torch._guards.detect_fake_mode() is not None


def hadamard_matrix(kind: str, size: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Orthonormal ``size``×``size`` Hadamard matrix of the given construction.

    Eager calls copy a per-process cached matrix; while torch.compile traces (fake tensors), the
    matrix is computed from indices instead (same values), so a dequantize or rotation traced into
    a graph never meets the cache's real tensor.
    """
    size = int(size)
    if _building_a_graph():
        return _hadamard_from_indices(kind, size, device, dtype)
    return _hadamard_cpu_fp32(kind, size).to(device=device, dtype=dtype)


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
