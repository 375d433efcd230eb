"""``lowbit::w8a8_mm`` with ``impl="auto"``: the W8A8 GEMM alone, its implementation chosen at run time.

A traced W8A8 linear (``kernels/w8a8_traced.py``) leaves the activation quantization to the compiler
and calls this op on the codes it made. The measured dispatcher (``kernels/dispatch.py``) then picks,
per (code dtype, GPU capability, M bucket, N, K), among:

* ``triton:<config>`` – our scaled GEMM with one tile config (the configs ``triton_gemm_names`` offers
  the W8A8 linear: TMA configs only for K a multiple of 16);
* ``torch``           – ``torch._int_mm`` / ``torch._scaled_mm`` with row-wise scales (where
  ``torch_mm_ok`` allows it) and the same epilogue;
* ``eager``           – the pure-torch reference (the CPU; on a GPU only when forced).

Decisions have their own key family, ``mm:int8`` / ``mm:fp8`` (``mm:int8|sm90|m4096|n3072|k3072``),
and live in the same JSON cache as the linears'. Nothing is measured on the CPU: the first candidate
runs (``torch._int_mm`` for INT8 codes, the reference for FP8 codes; both give the reference's bits).
Steady state: the settled choice is registered as a fast plan, so a repeated call costs one
dictionary lookup before the GEMM launch.
"""

from __future__ import annotations

import functools

import torch

from . import dispatch
from .backend import Backend, active_backend, force_backend, interpreting, triton_problem
from .gemm_config import config_named
from .reference import FP8, scaled_mm_reference
from .w8a8_linear import torch_mm_ok, torch_scaled_mm, triton_gemm_names

#: why the backends that need the float activation are not candidates of the GEMM-only op
_NEEDS_ACTIVATION = "the GEMM-only op takes activation codes; this backend quantizes the float activation itself"


def mm_key_format(code_dtype: torch.dtype) -> str:
    """The dispatcher's key family of a GEMM of ``code_dtype`` codes: ``"mm:int8"`` or ``"mm:fp8"``."""
    return "mm:fp8" if code_dtype == FP8 else "mm:int8"


def w8a8_mm_auto(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                 bias: torch.Tensor | None, row_shift: torch.Tensor | None, col_shift: torch.Tensor | None,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """``scaled_mm_reference(a, b, ...)`` on the implementation the dispatcher settled on for this shape.

    ``a``: int8 or float8_e4m3fn codes ``[M, K]``; ``b``: codes of the same dtype ``[N, K]``;
    ``a_scale``: fp32 ``[M, 1]``; ``b_scale``: ``[N]``, ``[N, 1]`` or one value. Returns ``[M, N]`` ``out_dtype``.
    """
    if a.dtype != b.dtype or a.dtype not in (torch.int8, FP8):
        raise ValueError(f"w8a8_mm: both operands must be int8 or both float8_e4m3fn codes, got {a.dtype} and "
                         f"{b.dtype}; quantize the activation to the weight's code dtype")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"w8a8_mm: expected codes [M, K] and [N, K], got {tuple(a.shape)} and {tuple(b.shape)}")
    # the Triton kernels read rows of a and b and the scales as dense vectors
    a, b, a_scale = a.contiguous(), b.contiguous(), a_scale.contiguous()
    key = _fast_key(a, b, b_scale, bias, row_shift, out_dtype)
    out = dispatch.run_fast(key, a, b, a_scale, b_scale, bias, row_shift, col_shift)
    if out is not None:
        return out
    plan = _GemmPlan(a, b, a_scale, b_scale, bias, row_shift, col_shift, out_dtype)
    run = functools.partial(dispatch.run, mm_key_format(a.dtype), a, b.shape[0], plan.names, plan.make, plan.reasons,
                            key, lambda name: _fast_plan(name, b_scale, out_dtype))
    if active_backend() in _NO_GEMM_FORM:
        # kitchen's linear and dequantize + matmul need the float activation, which a GEMM on codes no
        # longer has: a compiled graph traced without a forced backend keeps its fused layers (see
        # quant/compiled_linear.py), so their GEMMs run as chosen rather than fail
        with force_backend(Backend.AUTO):
            return run()
    return run()


_NO_GEMM_FORM = (Backend.KITCHEN, Backend.DEQUANT)


def _fast_key(a, b, b_scale, bias, row_shift, out_dtype) -> tuple:
    """Everything the choice and the chosen plan depend on (no strings built)."""
    return ("mm", a.dtype, dispatch.m_bucket(a.shape[0]), b.shape[0], a.shape[1], a.device, out_dtype,
            None if bias is None else bias.dtype, row_shift is None, b_scale.numel(), b_scale.dtype,
            b_scale.is_contiguous())


def _fast_plan(name: str, b_scale: torch.Tensor, out_dtype: torch.dtype):
    """The steady-state call of candidate ``name``: ``plan(a, b, a_scale, b_scale, bias, row_shift, col_shift)``."""
    if name.startswith("triton:"):
        return _TritonGemmPlan(config_named(name.split(":", 1)[1]), out_dtype,
                               scale_as_is=b_scale.dtype == torch.float32 and b_scale.is_contiguous())

    def plan(a, b, a_scale, b_scale, bias, row_shift, col_shift):  # any other decision: its full candidate
        return _GemmPlan(a, b, a_scale, b_scale, bias, row_shift, col_shift, out_dtype).make(name)()
    return plan


class _TritonGemmPlan:
    """Our scaled GEMM with one tile config: one launch, one allocation."""

    __slots__ = ("config", "out_dtype", "scale_as_is")

    def __init__(self, config, out_dtype, scale_as_is):
        self.config, self.out_dtype, self.scale_as_is = config, out_dtype, scale_as_is

    def __call__(self, a, b, a_scale, b_scale, bias, row_shift, col_shift):
        from .triton_w8a8_gemm import w8a8_mm_triton

        b_scale = b_scale if self.scale_as_is else b_scale.reshape(-1).float()
        return w8a8_mm_triton(a, b, a_scale, b_scale, bias, row_shift, col_shift, self.out_dtype, self.config)


class _GemmPlan:
    """The candidates of one GEMM call (built lazily: a cached decision builds only the one it runs)."""

    def __init__(self, a, b, a_scale, b_scale, bias, row_shift, col_shift, out_dtype):
        self.a, self.b, self.a_scale, self.bias = a, b, a_scale, bias
        self.b_scale = b_scale.reshape(-1).float()
        self.row_shift = None if row_shift is None else row_shift.float().reshape(-1, 1)
        self.col_shift = None if col_shift is None else col_shift.float().reshape(-1)
        self.out_dtype = out_dtype
        self.fp8 = a.dtype == FP8
        self.device = a.device

    def _triton_problem(self) -> str | None:
        return triton_problem(self.device, needs_fp8=self.fp8 and self.device.type == "cuda")

    def _torch_ok(self) -> bool:
        m, k = self.a.shape
        return torch_mm_ok(self.device, self.fp8, m, self.b.shape[0], k, self.out_dtype)

    def reasons(self) -> dict[str, str]:
        out = {"kitchen": _NEEDS_ACTIVATION, "dequant": _NEEDS_ACTIVATION}
        problem = self._triton_problem()
        if problem:
            out["triton"] = problem
        if not self._torch_ok():
            out["torch"] = "torch._int_mm/_scaled_mm need CUDA (FP8: sm_89+), N and K multiples of 16"
        return out

    def names(self) -> list[str]:
        triton = triton_gemm_names(self.device, *self.a.shape) if self._triton_problem() is None else []
        torch_mm = ["torch"] if self._torch_ok() else []
        if self.device.type == "cuda":  # the reference is never measured on a GPU (it cannot win): it runs
            # when forced, or when nothing else can (no Triton, and a shape torch's GEMMs refuse)
            fallback = active_backend() is Backend.EAGER or not (triton or torch_mm)
            return triton + torch_mm + (["eager"] if fallback else [])
        # CPU: nothing is measured; the interpreter only when forced (a correctness tool)
        return torch_mm + ["eager"] + (triton if interpreting() else [])

    def make(self, name: str):
        if name.startswith("triton:"):
            config = config_named(name.split(":", 1)[1])
            return lambda: _TritonGemmPlan(config, self.out_dtype, True)(
                self.a, self.b, self.a_scale, self.b_scale, self.bias, self.row_shift, self.col_shift)
        if name == "torch":
            return lambda: torch_scaled_mm(self.a, self.b, self.a_scale, self.b_scale, self.bias, self.row_shift,
                                           self.col_shift, self.out_dtype)
        if name == "eager":
            return lambda: scaled_mm_reference(self.a, self.b, self.a_scale, self.b_scale, self.bias, self.row_shift,
                                               self.col_shift, self.out_dtype)
        raise KeyError(f"unknown W8A8 GEMM implementation {name!r}")
