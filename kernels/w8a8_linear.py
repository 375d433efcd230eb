"""W8A8 linear (INT8 or FP8 codes), activation quantization included, through the dispatcher.

``y = Q(pre(x)) @ W.T * scales + mu * col_shift + bias`` where ``pre`` is the optional HadaNorm
smoothing / centring and block Hadamard rotation that the weight was quantized with, or (FP8 only,
nothing else) the outlier columns: ``Q`` appends ``[x_lo[:, O] | x[:, O]]`` to the codes and the
weight is ``[N, K + 2r]`` (``kernels/fp8_gemm.py``). The candidates the dispatcher chooses among:

* ``triton:<config>`` – our fused act-quant kernel + our scaled GEMM (one candidate per tile config)
* ``torch``           – our act-quant + ``torch._int_mm`` / ``torch._scaled_mm`` (rowwise) + epilogue
* ``kitchen``         – comfy-kitchen's ``int8_linear`` (INT8, no rotation or ConvRot 256 only)
* ``dequant``         – dequantize the weight, float ``F.linear`` (no activation quantization)
* ``dequant:<config>`` – the same product in Triton for few rows (M <= 16; ``triton_w8a16_gemm.py``): the weight
  converted in registers, the activation only pre-processed (rotated; HadaNorm: smoothed and centred too, the mean
  added back in the epilogue), no dequantized copy of the weight. On a GPU a call of at most 16 rows that this
  kernel takes is offered only these and ``dequant`` (unless a backend is forced): such a call is bound by the
  weight's bytes, so its activation is not quantized
* ``eager``           – the pure-torch reference of both kernels

Steady state: :func:`w8a8_linear_fast` looks up the plan the dispatcher settled on for the call's
(format, pre-processing, M bucket, shapes, dtypes, device) and runs it – for a Triton decision,
our act-quant kernel and the GEMM with the chosen tile config, nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import dispatch, ops
from .backend import Backend, active_backend, capability, interpreting, triton_problem
from .gemm_config import (W8A16_DEFAULT, WEIGHT_ONLY_MAX_M, config_named, default_config, w8a8_candidates,
                          w8a16_candidates)
from .hadamard import rotate_blocks
from .reference import FP8, FP8_MAX, INT8_MAX
from .replay import PlanReplays, input_kind

_KITCHEN_CONVROT_GROUP = 256


@dataclass(frozen=True)
class Preprocess:
    """What is done to the activation before quantization (must match how the weight was made)."""

    rotation: str = "none"  # "none" | "regular" (ConvRot) | "sylvester" (QuaRot, HadaNorm)
    group_size: int = 0
    smooth: torch.Tensor | None = None  # [K] multiplier (HadaNorm)
    center_rowsum: torch.Tensor | None = None  # [N] rowsum of the weight: centre x and add mu * rowsum
    outlier_index: torch.Tensor | None = None  # int32 [r]: FP8 outlier columns appended (nothing else)

    def __post_init__(self):
        if self.rotation not in ("none", "regular", "sylvester"):
            raise ValueError(f"rotation must be 'none', 'regular' or 'sylvester', got {self.rotation!r}")
        if self.rotation != "none" and self.group_size <= 0:
            raise ValueError(f"a {self.rotation} rotation needs a positive group_size, got {self.group_size}")
        if self.outlier_index is not None and (self.rotation != "none" or self.smooth is not None
                                               or self.center_rowsum is not None):
            raise ValueError("FP8 outlier columns cannot be combined with smoothing, centring or rotation")

    @property
    def outliers(self) -> int:
        """``r``, the number of outlier channels (0: none)."""
        return 0 if self.outlier_index is None else self.outlier_index.numel()

    def key(self) -> str:
        parts = []
        if self.smooth is not None:
            parts.append("smooth")
        if self.center_rowsum is not None:
            parts.append("center")
        if self.rotation != "none":
            parts.append(f"{self.rotation}{self.group_size}")
        if self.outlier_index is not None:
            parts.append("outliers")
        return "+".join(parts)

    def apply_float(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The float pre-processing (for the dequantize path): ``(x', mu)``."""
        xf = x.float()
        mean = None
        if self.smooth is not None:
            xf = xf * self.smooth.float()
        if self.center_rowsum is not None:
            mean = xf.mean(dim=-1, keepdim=True)
            xf = xf - mean
        if self.rotation != "none":
            xf = rotate_blocks(xf, self.rotation, self.group_size)
        return xf, mean


def w8a8_fast_key(fmt: str, x2d: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  bias: torch.Tensor | None, out_dtype: torch.dtype, rotation: str, group_size: int,
                  smooth: torch.Tensor | None, center_rowsum: torch.Tensor | None) -> tuple:
    """Everything the dispatcher's choice and the chosen plan depend on (cheap to build: no strings)."""
    return _fast_key(fmt, x2d.shape[0], x2d.shape[1], x2d.dtype, x2d.device, weight, weight_scale, bias, out_dtype,
                     rotation, group_size, smooth, center_rowsum)


def _fast_key(fmt, m, k, x_dtype, device, weight, weight_scale, bias, out_dtype, rotation, group_size, smooth,
              center_rowsum) -> tuple:
    return (fmt, rotation, group_size, smooth is None, center_rowsum is None, dispatch.m_bucket(m), weight.shape[0],
            k, weight.shape[1], x_dtype, out_dtype, weight.dtype, device, None if bias is None else bias.dtype,
            weight_scale.numel(), weight_scale.dtype, weight_scale.is_contiguous())


def w8a8_linear_fast(fmt: str, x2d: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None, out_dtype: torch.dtype, rotation: str = "none", group_size: int = 0,
                     smooth: torch.Tensor | None = None, center_rowsum: torch.Tensor | None = None, *,
                     outlier_index: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`w8a8_linear` with the pre-processing as plain arguments: the cached plan when there is
    one (no ``Preprocess``, candidate list or key string is built), else the full path."""
    if outlier_index is not None:
        return _outlier_linear_fast(fmt, x2d, weight, weight_scale, bias, out_dtype, rotation, group_size,
                                    smooth, center_rowsum, outlier_index)
    key = w8a8_fast_key(fmt, x2d, weight, weight_scale, bias, out_dtype, rotation, group_size, smooth, center_rowsum)
    out = dispatch.run_fast(key, x2d, weight, weight_scale, bias, smooth, center_rowsum)
    if out is not None:
        return out
    pre = Preprocess(rotation, group_size, smooth, center_rowsum)
    return w8a8_linear(x2d, weight, weight_scale, bias, out_dtype, pre, fmt, fast_key=key)


def _outlier_linear_fast(fmt, x2d, weight, weight_scale, bias, out_dtype, rotation, group_size, smooth,
                         center_rowsum, outlier_index) -> torch.Tensor:
    """The outlier-column path of :func:`w8a8_linear_fast`: its own keys and plans
    ``plan(x2d, weight, weight_scale, bias, outlier_index)``, so the plain path is unchanged."""
    key = ("outliers", outlier_index.numel(), outlier_index.device,
           *w8a8_fast_key(fmt, x2d, weight, weight_scale, bias, out_dtype, rotation, group_size, smooth, center_rowsum))
    out = dispatch.run_fast(key, x2d, weight, weight_scale, bias, outlier_index)
    if out is not None:
        return out
    pre = Preprocess(rotation, group_size, smooth, center_rowsum, outlier_index)
    return w8a8_linear(x2d, weight, weight_scale, bias, out_dtype, pre, fmt, fast_key=key)


def w8a8_linear(x2d: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype, pre: Preprocess, fmt: str, fast_key: tuple | None = None) -> torch.Tensor:
    """``[M, K]`` → ``[M, N]``. ``weight``: int8 or float8_e4m3fn ``[N, K]``; ``weight_scale``: ``[N]``/``[N, 1]``/scalar."""
    fp8 = weight.dtype == FP8
    if weight.dtype not in (torch.int8, FP8):
        raise ValueError(f"{fmt}: weight must be int8 or float8_e4m3fn, got {weight.dtype}")
    if pre.outliers and not fp8:
        raise ValueError(f"{fmt}: outlier columns need an FP8 weight, got {weight.dtype}")
    if x2d.shape[1] + 2 * pre.outliers != weight.shape[1]:
        extra = f" plus 2 x {pre.outliers} outlier columns" if pre.outliers else ""
        raise ValueError(f"{fmt}: input has {x2d.shape[1]} features{extra} but the weight expects {weight.shape[1]}")
    n = weight.shape[0]
    w_scale = weight_scale.reshape(-1).float()
    if w_scale.numel() not in (1, n):
        raise ValueError(f"{fmt}: weight_scale must have 1 or {n} values, found {w_scale.numel()}")
    plan = _Plan(x2d, weight, w_scale, bias, out_dtype, pre, fp8)
    key = fmt + (f"+{pre.key()}" if pre.key() else "")
    make_fast = None if fast_key is None else (
        lambda name: _fast_plan(name, x2d, weight_scale, out_dtype, pre, fp8))
    fast_args = ((x2d, weight, weight_scale, bias, pre.outlier_index) if pre.outliers else
                 (x2d, weight, weight_scale, bias, pre.smooth, pre.center_rowsum))
    return dispatch.run(key, x2d, n, plan.names, plan.make, plan.reasons, fast_key, make_fast, fast_args)


def _fast_plan(name: str, x2d: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype, pre: Preprocess,
               fp8: bool):
    """The steady-state call of candidate ``name``: ``plan(x2d, weight, weight_scale, bias, smooth, center_rowsum)``
    (with outlier columns: ``plan(x2d, weight, weight_scale, bias, outlier_index)``)."""
    if pre.outliers:
        return _fast_outlier_plan(name, weight_scale, out_dtype)
    scale_as_is = weight_scale.dtype == torch.float32 and weight_scale.is_contiguous()
    if name.startswith("triton:"):
        return _TritonW8A8Plan(config_named(name.split(":", 1)[1]), pre.rotation, pre.group_size,
                               pre.center_rowsum is not None, fp8, out_dtype, scale_as_is)
    if name.startswith("dequant:"):
        return _WeightOnlyPlan(config_named(name.split(":", 1)[1]), pre.rotation, pre.group_size, out_dtype,
                               scale_as_is)
    if name == "torch" and x2d.is_cuda and not interpreting() and _act_quant_runs(x2d, pre, fp8):
        # what _Plan._torch_mm runs on a GPU (elsewhere it quantizes with the eager reference)
        return _TritonW8A8Plan(None, pre.rotation, pre.group_size, pre.center_rowsum is not None, fp8, out_dtype,
                               scale_as_is)
    rotation, group_size = pre.rotation, pre.group_size

    def plan(x, weight, weight_scale, bias, smooth, center_rowsum):  # any other decision: its full candidate
        pre = Preprocess(rotation, group_size, smooth, center_rowsum)
        return _Plan(x, weight, weight_scale.reshape(-1).float(), bias, out_dtype, pre, fp8).make(name)()
    return plan


def _fast_outlier_plan(name: str, weight_scale: torch.Tensor, out_dtype: torch.dtype):
    if name.startswith("triton:"):
        return _TritonOutlierPlan(config_named(name.split(":", 1)[1]), out_dtype,
                                  scale_as_is=weight_scale.dtype == torch.float32 and weight_scale.is_contiguous())

    def plan(x, weight, weight_scale, bias, outlier_index):  # any other decision: its full candidate
        pre = Preprocess(outlier_index=outlier_index)
        return _Plan(x, weight, weight_scale.reshape(-1).float(), bias, out_dtype, pre, True).make(name)()
    return plan


class _TritonOutlierPlan:
    """Our act-quant kernel with outlier columns + our FP8 GEMM over ``K + 2r``: two launches."""

    __slots__ = ("config", "out_dtype", "scale_as_is")

    def __init__(self, config, out_dtype, scale_as_is):
        self.config, self.out_dtype, self.scale_as_is = config, out_dtype, scale_as_is

    def __call__(self, x, weight, weight_scale, bias, outlier_index):
        from .triton_act_quant import act_quant_triton
        from .triton_w8a8_gemm import w8a8_mm_triton

        q, scale, _ = act_quant_triton(x, FP8, FP8_MAX, "none", 0, None, False, outlier_index=outlier_index)
        w_scale = weight_scale if self.scale_as_is else weight_scale.reshape(-1).float()
        return w8a8_mm_triton(q, weight, scale, w_scale, bias, None, None, self.out_dtype, self.config)


class _WeightOnlyPlan:
    """The ``dequant:<config>`` decision: :func:`triton_w8a16_gemm.w8a16_mm_triton` (one launch, two with a
    rotation, smoothing or centring), replayed per kind of input."""

    __slots__ = ("config", "rotation", "group_size", "out_dtype", "scale_as_is", "replays")

    def __init__(self, config, rotation, group_size, out_dtype, scale_as_is):
        self.config, self.rotation, self.group_size = config, rotation, group_size
        self.out_dtype, self.scale_as_is = out_dtype, scale_as_is
        self.replays = PlanReplays()

    def __call__(self, x, weight, weight_scale, bias, smooth, center_rowsum):
        from .triton_w8a16_gemm import w8a16_launches

        w_scale = weight_scale if self.scale_as_is else weight_scale.reshape(-1).float()
        if x.stride(-1) != 1:
            x = x.contiguous()
        key, sources = input_kind(x)
        return self.replays.run(key, (*sources, weight, w_scale, bias, smooth, center_rowsum),
                                lambda: w8a16_launches(x, weight, w_scale, bias, self.out_dtype, self.config,
                                                       self.rotation, self.group_size, None, smooth, center_rowsum),
                                last_only=True)[-1]


def _act_quant_runs(x2d: torch.Tensor, pre: Preprocess, fp8: bool) -> bool:
    """Whether our act-quant kernel takes calls like this one (what ``_Plan._torch_mm`` runs it for)."""
    from .triton_act_quant import act_quant_problem

    return (triton_problem(x2d.device, needs_fp8=fp8) is None
            and act_quant_problem(x2d.shape[1], pre.rotation, pre.group_size) is None)


#: where a prologue keeps the codes its first linear computed (``_TritonW8A8Plan._prologue_call``)
_SHARED_CODES = "_lowbit_shared_codes"


class _TritonW8A8Plan:
    """Our act-quant kernel + our GEMM with one tile config (``config`` None: ``torch._int_mm`` /
    ``torch._scaled_mm`` and the epilogue, the ``torch`` decision on a GPU): two launches and three
    allocations, replayed per kind of input (``kernels/replay.py``; on a CUDA device a Triton config's
    replay makes two: the codes and scales share one). ``x`` may be a prologue
    (``kernels/prologue.py``): the act-quant kernel computes it, once for the linears that take it."""

    __slots__ = ("config", "rotation", "group_size", "center", "code_dtype", "qmax", "out_dtype", "scale_as_is",
                 "replays", "keep_codes")

    def __init__(self, config, rotation, group_size, center, fp8, out_dtype, scale_as_is):
        self.config, self.rotation, self.group_size, self.center = config, rotation, group_size, center
        self.code_dtype, self.qmax = (FP8, FP8_MAX) if fp8 else (torch.int8, INT8_MAX)
        self.out_dtype, self.scale_as_is = out_dtype, scale_as_is
        self.replays = PlanReplays()
        self.keep_codes = False  # learned: a sibling linear takes the prologue inputs it quantizes

    def __call__(self, x, weight, weight_scale, bias, smooth, center_rowsum):
        w_scale = weight_scale if self.scale_as_is else weight_scale.reshape(-1).float()
        col_shift = center_rowsum.float() if self.center else None
        config = self.config
        if not isinstance(x, torch.Tensor):  # a prologue: linears that take the same one share its codes
            return self._prologue_call(x, weight, w_scale, bias, smooth, col_shift)
        key, sources = input_kind(x)
        outputs = self.replays.run(key, (*sources, weight, w_scale, bias, smooth, col_shift),
                                   lambda: self._launch(x, weight, w_scale, bias, smooth, col_shift),
                                   last_only=config is not None)
        if config is not None:
            return outputs[-1]
        q, scale = outputs[0], outputs[1]
        return torch_scaled_mm(q, weight, scale, w_scale, bias, outputs[2] if self.center else None, col_shift,
                               self.out_dtype)

    def _prologue_call(self, prologue, weight, w_scale, bias, smooth, col_shift):
        """The linear of a prologue input. Its activation quantization runs once per prologue and kind of codes
        where a model feeds one input to sibling linears (Qwen-Image's ``to_q`` / ``to_k`` / ``to_v``, each
        taking the block's modulated norm): the first keeps the codes with the prologue object and the others
        run only their GEMM on them (the same kernel on the same sources: the same codes). A plan learns to
        keep its codes when a later linear meets an input it has quantized (``keep_codes``, from its next call
        on); until then, and in models whose linears each take their own input (Flux's), its codes stay
        scratch memory of its replay. Kept codes go when the model drops its input."""
        codes_key = (self.code_dtype, self.qmax, self.rotation, self.group_size, self.center,
                     None if smooth is None else id(smooth))
        shared = prologue.__dict__.setdefault(_SHARED_CODES, {})
        held = shared.get(codes_key)
        if isinstance(held, tuple) and held[-1] is smooth:
            return self._codes_call(*held[:3], weight, w_scale, bias, col_shift)
        if isinstance(held, _TritonW8A8Plan):  # its codes of this input are gone: it keeps them from now on
            held.keep_codes = True
        keep = held is None and (self.keep_codes or self.config is None)  # torch's GEMMs: codes are outputs
        key, sources = input_kind(prologue)
        outputs = self.replays.run((*key, "kept") if keep and self.config is not None else key,
                                   (*sources, weight, w_scale, bias, smooth, col_shift),
                                   lambda: self._launch(prologue, weight, w_scale, bias, smooth, col_shift),
                                   last_only=self.config is not None and not keep)
        mean = outputs[2] if self.center else None
        if held is None:
            shared[codes_key] = (outputs[0], outputs[1], mean, smooth) if keep else self
        if self.config is not None:
            return outputs[-1]
        return torch_scaled_mm(outputs[0], weight, outputs[1], w_scale, bias, mean, col_shift, self.out_dtype)

    def _codes_call(self, q, scale, mean, weight, w_scale, bias, col_shift):
        """This linear's GEMM on codes another linear's act-quant computed."""
        if self.config is None:
            return torch_scaled_mm(q, weight, scale, w_scale, bias, mean, col_shift, self.out_dtype)
        from .triton_w8a8_gemm import w8a8_mm_triton

        shift = (mean, col_shift) if self.center else (None, None)
        return self.replays.run(("codes", q.shape[0]), (q, scale, mean, weight, w_scale, bias, col_shift),
                                lambda: (w8a8_mm_triton(q, weight, scale, w_scale, bias, *shift, self.out_dtype,
                                                        self.config),))[-1]

    def _launch(self, x, weight, w_scale, bias, smooth, col_shift) -> tuple:
        """The kernels of one call; the tensors they allocated: ``(q, scale[, mean][, out])`` (no ``out`` for
        ``config`` None, whose product runs on torch's GEMMs)."""
        from .triton_act_quant import act_quant_triton
        from .triton_w8a8_gemm import w8a8_mm_triton

        q, scale, mean = act_quant_triton(x, self.code_dtype, self.qmax, self.rotation, self.group_size, smooth,
                                          self.center)
        quantized = (q, scale, mean) if self.center else (q, scale)
        if self.config is None:
            return quantized
        shift = (mean, col_shift) if self.center else (None, None)
        return (*quantized, w8a8_mm_triton(q, weight, scale, w_scale, bias, *shift, self.out_dtype, self.config))


def w8a8_settled_linear(fmt: str, x2d: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        bias: torch.Tensor | None, out_dtype: torch.dtype, rotation: str = "none",
                        group_size: int = 0, smooth: torch.Tensor | None = None,
                        center_rowsum: torch.Tensor | None = None) -> torch.Tensor | None:
    """:func:`w8a8_linear_fast` where the dispatcher has settled calls like this one (its plan, the same bits),
    else ``None``: the caller then takes its full path (callers that keep a layer's weight form)."""
    key = _fast_key(fmt, x2d.shape[0], x2d.shape[1], x2d.dtype, x2d.device, weight, weight_scale, bias, out_dtype,
                    rotation, group_size, smooth, center_rowsum)
    return dispatch.run_fast(key, x2d, weight, weight_scale, bias, smooth, center_rowsum)


def w8a8_prologue_linear(fmt: str, prologue, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None, out_dtype: torch.dtype, rotation: str = "none", group_size: int = 0,
                         smooth: torch.Tensor | None = None, center_rowsum: torch.Tensor | None = None
                         ) -> torch.Tensor | None:
    """``linear(prologue.materialize())`` with the prologue (``kernels/prologue.py``: ``[a | gelu(b)]`` or
    ``shift + layer_norm(x) * mult``) computed inside the activation quantization, or ``None``.

    Arguments as :func:`w8a8_linear_fast`'s, the input given by its sources. It runs where the dispatcher
    has already settled the unfused call (same format, pre-processing and shapes) on our act-quant
    kernel and a GEMM that takes its codes (a ``triton:<config>`` GEMM, or on a GPU ``torch._int_mm`` /
    ``_scaled_mm``), and runs that very plan: the same codes, so the same bits, up to the last bit of
    the GELU's ``tanh`` or the row variance. ``None`` (the caller runs the unfused linear, which
    measures and decides) otherwise: no settled plan yet, comfy-kitchen or dequantize won, a backend is
    forced, ``torch.compile`` is tracing.
    """
    m, k = prologue.shape
    src = prologue.source
    key = _fast_key(fmt, m, k, src.dtype, src.device, weight, weight_scale, bias, out_dtype, rotation, group_size,
                    smooth, center_rowsum)
    plan = dispatch.fast_plan(key)
    if not isinstance(plan, _TritonW8A8Plan):
        return None
    return plan(prologue, weight, weight_scale, bias, smooth, center_rowsum)


def triton_gemm_names(device: torch.device, m: int, k: int, fp8: bool) -> list[str]:
    """The ``triton:<config>`` candidates of an INT8 (``fp8`` False) or FP8 GEMM with ``m`` rows and reduction
    length ``k``: the tile configs worth measuring on this GPU (the CPU interpreter: the default one)."""
    configs = w8a8_candidates(capability(device), m, fp8) if device.type == "cuda" else [default_config(m)]
    k_aligned = k % 16 == 0  # TMA descriptors need 16-byte row strides
    # a ragged K (K + 2r with outlier columns) is a masked K tail: every tile config runs it
    return [f"triton:{c.name}" for c in configs if k_aligned or not c.tma]


def torch_mm_ok(device: torch.device, fp8: bool, m: int, n: int, k: int, out_dtype: torch.dtype) -> bool:
    """Whether :func:`torch_scaled_mm` (``torch._int_mm`` / ``torch._scaled_mm``) takes an ``[M, K] x [N, K]``
    product of INT8 (``fp8`` False) or e4m3 codes on ``device``: CUDA (FP8: sm_89+) with N and K multiples
    of 16 (INT8: of 8, and more than 16 rows), or any INT8 product on the CPU."""
    if fp8:
        return (device.type == "cuda" and capability(device) >= (8, 9) and k % 16 == 0 and n % 16 == 0
                and out_dtype in (torch.bfloat16, torch.float16, torch.float32))
    return device.type == "cpu" or (device.type == "cuda" and m > 16 and k % 8 == 0 and n % 8 == 0)


def torch_scaled_mm(q: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, w_scale: torch.Tensor,
                    bias: torch.Tensor | None, row_shift: torch.Tensor | None, col_shift: torch.Tensor | None,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """``lowbit::w8a8_mm``'s product on torch's GEMMs: ``torch._int_mm`` (INT8 codes) or ``torch._scaled_mm``
    with row-wise scales (e4m3 codes), then the shift / bias epilogue. ``w_scale``: fp32 ``[N]`` or one
    value; where it applies see :func:`torch_mm_ok`."""
    n = weight.shape[0]
    if q.dtype == FP8:
        w_scale = w_scale.reshape(-1).expand(n).reshape(1, n).contiguous()
        use_bias = bias is not None and out_dtype != torch.float32
        out = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=w_scale,
                               bias=bias.to(out_dtype) if use_bias else None, out_dtype=out_dtype)
        if row_shift is None and (bias is None or use_bias):
            return out
        out = out.float()
        bias = None if use_bias else bias
    else:
        out = torch._int_mm(q, weight.t()).float() * scale * w_scale.reshape(1, -1)
    if row_shift is not None:
        out = out + row_shift * col_shift.reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


class _Plan:
    """The candidates of one call (built lazily: a cached decision builds only the one it runs)."""

    def __init__(self, x, weight, w_scale, bias, out_dtype, pre, fp8):
        self.x, self.weight, self.w_scale, self.bias = x, weight, w_scale, bias
        self.out_dtype, self.pre, self.fp8 = out_dtype, pre, fp8
        self.code_dtype = FP8 if fp8 else torch.int8
        self.qmax = FP8_MAX if fp8 else INT8_MAX
        self.device = x.device

    # ---- which candidates exist ---------------------------------------------------------------
    def reasons(self) -> dict[str, str]:
        out = {}
        problem = self._triton_problem()
        if problem:
            out["triton"] = problem
        if not self._kitchen_ok():
            out["kitchen"] = "comfy-kitchen's int8_linear takes INT8 without rotation or with ConvRot 256 only"
        if not self._torch_ok():
            out["torch"] = "torch._int_mm/_scaled_mm need CUDA (FP8: sm_89+), N and K multiples of 16"
        return out

    def _triton_problem(self) -> str | None:
        problem = triton_problem(self.device, needs_fp8=self.fp8 and self.device.type == "cuda")
        if problem is None:
            from .triton_act_quant import act_quant_problem

            problem = act_quant_problem(self.x.shape[1], self.pre.rotation, self.pre.group_size)
        return problem

    @property
    def gemm_k(self) -> int:
        """The GEMM's reduction length: ``K``, plus ``2r`` with outlier columns."""
        return self.weight.shape[1]

    def _kitchen_ok(self) -> bool:
        pre = self.pre
        rot_ok = pre.rotation == "none" or (pre.rotation == "regular" and pre.group_size == _KITCHEN_CONVROT_GROUP)
        return not self.fp8 and rot_ok and pre.smooth is None and pre.center_rowsum is None

    def _torch_ok(self) -> bool:
        return torch_mm_ok(self.device, self.fp8, self.x.shape[0], self.weight.shape[0], self.gemm_k, self.out_dtype)

    def names(self) -> list[str]:
        m = self.x.shape[0]
        triton_ok = self._triton_problem() is None
        on_gpu = self.device.type == "cuda"
        triton = triton_gemm_names(self.device, m, self.gemm_k, self.fp8) if triton_ok else []
        torch_mm = ["torch"] if self._torch_ok() else []
        kitchen = ["kitchen"] if self._kitchen_ok() else []
        weight_only = self._weight_only_names()
        forced = active_backend()
        if on_gpu and weight_only and forced is Backend.AUTO and dispatch.current_dispatcher().few_rows_weight_only:
            # few rows: bound by the weight's bytes, so the activation is not quantized (W8A16: more accurate, about
            # as fast: docs/kernels.md, Session 33); a forced backend still runs its own path
            return weight_only + ["dequant"]
        if on_gpu:  # the reference is never measured on a GPU (it cannot win); it runs when forced
            return (triton + torch_mm + kitchen + (weight_only if forced is not Backend.AUTO else []) + ["dequant"]
                    + (["eager"] if forced is Backend.EAGER else []))
        # CPU: nothing is measured. comfy-kitchen first where it applies (today's behaviour), then the
        # exact emulations; the interpreter only when forced (a correctness tool, not a fast path).
        return kitchen + torch_mm + ["eager", "dequant"] + (triton + weight_only if interpreting() else [])

    def _weight_only_names(self) -> list[str]:
        """The ``dequant:<config>`` candidates: few rows, no outlier columns, and a call the W8A16 kernel takes
        (``triton_w8a16_gemm.w8a16_problem``)."""
        pre, m = self.pre, self.x.shape[0]
        if (m > WEIGHT_ONLY_MAX_M or pre.outliers
                or triton_problem(self.device, needs_fp8=self.fp8 and self.device.type == "cuda") is not None):
            return []
        from .triton_w8a16_gemm import w8a16_problem

        if w8a16_problem(self.x, self.weight, self.out_dtype, pre.rotation, pre.group_size, pre.smooth,
                         pre.center_rowsum) is not None:
            return []
        configs = w8a16_candidates(capability(self.device)) if self.device.type == "cuda" else [W8A16_DEFAULT]
        return [f"dequant:{c.name}" for c in configs]

    # ---- building one ---------------------------------------------------------------------------
    def make(self, name: str):
        if name.startswith("triton:"):
            config = name.split(":", 1)[1]
            return lambda: self._quantized("triton", config)
        if name == "eager":
            return lambda: self._quantized("eager", "eager")
        if name == "torch":
            return self._torch_mm
        if name == "kitchen":
            return self._kitchen
        if name == "dequant":
            return self._dequant
        if name.startswith("dequant:"):
            config = config_named(name.split(":", 1)[1])
            return lambda: self._weight_only(config)
        raise KeyError(f"unknown W8A8 implementation {name!r}")

    def _act_quant(self, impl: str):
        pre = self.pre
        if pre.outliers:
            q, scale = ops.act_quant_outliers(self.x, pre.outlier_index, impl)
            return q, scale, None
        return ops.act_quant(self.x, self.code_dtype, self.qmax, pre.rotation, pre.group_size, pre.smooth,
                             pre.center_rowsum is not None, 0, impl)

    def _quantized(self, act_impl: str, mm_impl: str) -> torch.Tensor:
        q, scale, mean = self._act_quant(act_impl)
        shift = (mean, self.pre.center_rowsum.float()) if self.pre.center_rowsum is not None else (None, None)
        return ops.w8a8_mm(q, self.weight, scale, self.w_scale, self.bias, shift[0], shift[1], self.out_dtype, mm_impl)

    def _torch_mm(self) -> torch.Tensor:
        act_impl = "triton" if self._triton_problem() is None and self.device.type == "cuda" else "eager"
        q, scale, mean = self._act_quant(act_impl)
        col_shift = None if self.pre.center_rowsum is None else self.pre.center_rowsum.float()
        return torch_scaled_mm(q, self.weight, scale, self.w_scale, self.bias, mean if col_shift is not None else None,
                               col_shift, self.out_dtype)

    def _kitchen(self) -> torch.Tensor:
        import comfy_kitchen as ck

        convrot = self.pre.rotation == "regular"
        return ck.int8_linear(self.x.contiguous(), self.weight, self.w_scale.reshape(-1, 1) if self.w_scale.numel() > 1
                              else self.w_scale.reshape(()), self.bias, self.out_dtype, convrot=convrot,
                              convrot_groupsize=_KITCHEN_CONVROT_GROUP)

    def _weight_only(self, config) -> torch.Tensor:
        from .triton_w8a16_gemm import w8a16_mm_triton

        pre = self.pre
        return w8a16_mm_triton(self.x.contiguous(), self.weight, self.w_scale, self.bias, self.out_dtype, config,
                               pre.rotation, pre.group_size, None, pre.smooth, pre.center_rowsum)

    def _dequant(self) -> torch.Tensor:
        compute = self.x.dtype if self.x.dtype in (torch.float16, torch.bfloat16) and self.x.is_cuda else torch.float32
        xf, mean = self.pre.apply_float(self.x)
        weight = self.weight.float()
        if self.pre.outliers:  # the hi + lo weight: the low codes added onto their channels
            r, k = self.pre.outliers, self.x.shape[1]
            weight = weight[:, :k].index_add(1, self.pre.outlier_index.long(), weight[:, k + r:])
        weight = (weight * self.w_scale.reshape(-1, 1)).to(compute)
        out = torch.nn.functional.linear(xf.to(compute), weight).float()
        if mean is not None:
            out = out + mean * self.pre.center_rowsum.float().reshape(1, -1)
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(self.out_dtype)
