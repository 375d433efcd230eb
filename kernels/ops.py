"""The LowBit kernels as ``torch.library`` custom ops, each with a fake (meta) implementation.

* ``lowbit::act_quant``  – per-token INT8/FP8 activation quantization with optional smoothing,
  centring and block Hadamard rotation (``reference.act_quant_reference``).
* ``lowbit::act_quant_outliers`` – per-token FP8 codes with the ``2r`` outlier columns appended
  (``reference.act_quant_outliers_reference``).
* ``lowbit::w8a8_mm``    – INT8 or FP8 scaled GEMM with the scale / shift / bias epilogue.
* ``lowbit::w4a8_mm``    – packed 4-bit weight × INT8 activation GEMM, decoded in registers.

Every op takes an explicit ``impl`` string: ``"eager"`` runs the pure-torch reference, anything
else names a Triton variant (``"triton"`` for the act-quant kernel, a :class:`GemmConfig` name for
the GEMMs). Which ``impl`` to use is decided outside the op (``kernels/dispatch.py``), so the ops
are pure functions of their arguments – what ``torch.compile`` needs. Triton is imported only when
a Triton ``impl`` runs.
"""

from __future__ import annotations

import torch

from .reference import (FP8, FP8_MAX, act_quant_outliers_reference, act_quant_reference, scaled_mm_reference,
                        unpack_int4_signed, unpack_uint4)


def _op_defined(name: str) -> bool:
    # The package can be imported twice under different names (``lowbit`` and ComfyUI's custom
    # node module name); define each op once per process and reuse it after that.
    try:
        getattr(torch.ops.lowbit, name)
        return True
    except (AttributeError, RuntimeError):
        return False


# ---- act_quant ----------------------------------------------------------------------------------

def permute_columns(t: torch.Tensor, block: int, run: int = 1) -> torch.Tensor:
    """Reorder the columns of every ``block``-wide block: the even runs of ``run`` columns first, then the
    odd runs (``run`` 1: evens, then odds; ``block`` 0: as is)."""
    if not block:
        return t
    rows, cols = t.shape
    return t.reshape(rows, cols // block, block // (2 * run), 2, run).transpose(2, 3).reshape(rows, cols)


# The W4 kernel's column planes: the first and last 4 columns of every 8 for codebook weights (their
# codes fill a packed 32-bit word's two halves, which the decode's byte permutes read most cheaply),
# evens and odds for signed nibbles (``kernels/triton_w4_gemm.py``).
CODEBOOK_RUN = 4


def plane_run(codebook: bool) -> int:
    """The run length of the W4 kernel's planes: its activations are ``permute_columns(a, block_k, run)``."""
    return CODEBOOK_RUN if codebook else 1


def _act_quant_impl(x: torch.Tensor, out_dtype: torch.dtype, qmax: float, rotation: str, group_size: int,
                    smooth: torch.Tensor | None, center: bool, perm_block: int,
                    impl: str, perm_run: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if impl == "eager":
        q, scale, mean = act_quant_reference(x, out_dtype, qmax, rotation, group_size, smooth, center)
        return permute_columns(q, perm_block, perm_run), scale, mean
    from .triton_act_quant import act_quant_triton

    return act_quant_triton(x, out_dtype, qmax, rotation, group_size, smooth, center, perm_block,
                            perm_run=perm_run)


def _act_quant_fake(x, out_dtype, qmax, rotation, group_size, smooth, center, perm_block, impl, perm_run=1):
    m, k = x.shape
    return (x.new_empty((m, k), dtype=out_dtype), x.new_empty((m, 1), dtype=torch.float32),
            x.new_empty((m, 1 if center else 0), dtype=torch.float32))


def _act_quant_outliers_impl(x: torch.Tensor, outlier_index: torch.Tensor,
                             impl: str) -> tuple[torch.Tensor, torch.Tensor]:
    if impl == "eager":
        return act_quant_outliers_reference(x, outlier_index)
    from .triton_act_quant import act_quant_triton

    q, scale, _ = act_quant_triton(x, FP8, FP8_MAX, "none", 0, None, False, outlier_index=outlier_index)
    return q, scale


def _act_quant_outliers_fake(x, outlier_index, impl):
    m, k = x.shape
    return (x.new_empty((m, k + 2 * outlier_index.shape[0]), dtype=FP8),
            x.new_empty((m, 1), dtype=torch.float32))


# ---- w8a8_mm ------------------------------------------------------------------------------------

def _w8a8_mm_impl(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                  bias: torch.Tensor | None, row_shift: torch.Tensor | None, col_shift: torch.Tensor | None,
                  out_dtype: torch.dtype, impl: str) -> torch.Tensor:
    if impl == "eager":
        return scaled_mm_reference(a, b, a_scale, b_scale, bias, row_shift, col_shift, out_dtype)
    from .gemm_config import config_named
    from .triton_w8a8_gemm import w8a8_mm_triton

    return w8a8_mm_triton(a, b, a_scale, b_scale, bias, row_shift, col_shift, out_dtype, config_named(impl))


def _w8a8_mm_fake(a, b, a_scale, b_scale, bias, row_shift, col_shift, out_dtype, impl):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


# ---- w4a8_mm ------------------------------------------------------------------------------------

def decode_w4_reference(packed: torch.Tensor, s_rel: torch.Tensor | None, table: torch.Tensor | None,
                        group_size: int) -> torch.Tensor:
    """The int8 ``[N, K]`` weight the W4 kernel multiplies (signed nibbles, or table levels)."""
    if s_rel is None:
        return unpack_int4_signed(packed)
    codes = unpack_uint4(packed)
    n, k = codes.shape
    s_byte = s_rel.view(torch.uint8).long().repeat_interleave(group_size, dim=1)
    return table.reshape(-1)[s_byte * 16 + codes].reshape(n, k)


def _w4a8_mm_impl(a: torch.Tensor, packed: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor,
                  bias: torch.Tensor | None, s_rel: torch.Tensor | None, table: torch.Tensor | None,
                  group_size: int, perm_block: int, out_dtype: torch.dtype, impl: str) -> torch.Tensor:
    """``a``'s columns are permuted in blocks of ``perm_block``, in runs of ``plane_run(s_rel is not None)``
    (see ``permute_columns``); a Triton ``impl`` needs ``perm_block`` equal to its K tile."""
    if impl == "eager":
        weight = permute_columns(decode_w4_reference(packed, s_rel, table, group_size), perm_block,
                                 plane_run(s_rel is not None))
        return scaled_mm_reference(a, weight, a_scale, w_scale, bias, None, None, out_dtype)
    from .gemm_config import config_named
    from .triton_w4_gemm import w4a8_mm_triton

    config = config_named(impl)
    if perm_block != config.block_k:
        raise ValueError(f"the Triton 4-bit GEMM {impl} needs activations permuted in blocks of {config.block_k}, "
                         f"got {perm_block}")
    return w4a8_mm_triton(a, packed, a_scale, w_scale, bias, s_rel, table, group_size, out_dtype, config)


def _w4a8_mm_fake(a, packed, a_scale, w_scale, bias, s_rel, table, group_size, perm_block, out_dtype, impl):
    return a.new_empty((a.shape[0], packed.shape[0]), dtype=out_dtype)


def _define(name: str, fn, fake):
    if not _op_defined(name):
        op = torch.library.custom_op(f"lowbit::{name}", fn, mutates_args=())
        op.register_fake(fake)
    return getattr(torch.ops.lowbit, name)


act_quant_op = _define("act_quant", _act_quant_impl, _act_quant_fake)
act_quant_outliers_op = _define("act_quant_outliers", _act_quant_outliers_impl, _act_quant_outliers_fake)
w8a8_mm_op = _define("w8a8_mm", _w8a8_mm_impl, _w8a8_mm_fake)
w4a8_mm_op = _define("w4a8_mm", _w4a8_mm_impl, _w4a8_mm_fake)


def _compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    return compiler is not None and compiler.is_compiling()


# What the linears call: the registered op while ``torch.compile`` traces (so the graph holds one
# opaque node with a fake), the implementation directly in eager mode – a custom op's Python
# dispatch costs tens of microseconds per call, which small-M layers cannot afford.
def act_quant(*args):
    """``lowbit::act_quant`` (see :func:`_act_quant_impl` for the arguments)."""
    return act_quant_op(*args) if _compiling() else _act_quant_impl(*args)


def act_quant_outliers(*args):
    """``lowbit::act_quant_outliers`` (see :func:`_act_quant_outliers_impl` for the arguments)."""
    return act_quant_outliers_op(*args) if _compiling() else _act_quant_outliers_impl(*args)


def w8a8_mm(*args):
    """``lowbit::w8a8_mm`` (see :func:`_w8a8_mm_impl` for the arguments)."""
    return w8a8_mm_op(*args) if _compiling() else _w8a8_mm_impl(*args)


def w4a8_mm(*args):
    """``lowbit::w4a8_mm`` (see :func:`_w4a8_mm_impl` for the arguments)."""
    return w4a8_mm_op(*args) if _compiling() else _w4a8_mm_impl(*args)
