"""4-bit weight storage × 8-bit-path activations, through the dispatcher (Hopper has no INT4 MMA).

Both comfy-kitchen 4-bit formats are run by our W4 kernel, which keeps the weight packed and
decodes it in registers (``kernels/triton_w4_gemm.py``):

* :func:`w4a4_linear` – ``convrot_w4a4``: signed nibbles, per-row scale, ConvRot-256 rotation.
  ``act_bits=4`` reproduces the format's 4-bit activations (codes in [-7, 7] fed to the INT8
  tensor cores – same numerics as comfy-kitchen); ``act_bits=8`` quantizes activations to INT8
  instead (W4A8, more accurate).
* :func:`w4a8_linear` – ``asym_w4a8_int8``: grouped codebook codes with FP8 group scales and an
  fp32 channel scale, ConvRot-256 rotation, INT8 activations.

Candidates: ``triton:<config>`` (the in-register W4 GEMM), for codebook weights also
``triton:expand-<config>`` (the weight expanded into a temporary INT8 matrix by
``kernels/triton_w4_expand.py``, then the INT8 W8A8 GEMM with that config: the same int32 sums and
epilogue, so the same bits), ``kitchen`` (comfy-kitchen's linear), ``dequant`` and ``eager``.
Signed nibbles are not offered the expansion: their in-register decode is cheap, and on an H200 the
Flux-dev step with both offered took 163.9 ms against 153.5 ms without (the per-layer timings had
favoured the expansion by about 5 % at M = 4096).
After the first call of a shape, the dispatcher's settled choice runs as a cached plan
(``dispatch.run_fast``): for a Triton decision, the act-quant kernel and the W4 GEMM alone.
"""

from __future__ import annotations

import weakref

import torch

from . import dispatch, ops
from .backend import Backend, active_backend, capability, interpreting, triton_problem
from .gemm_config import config_named, default_config, w4_candidates, w4_expand_candidates
from .hadamard import rotate_blocks
from .reference import FP8, INT4_MAX, INT8_MAX, decode_w4a8_levels, unpack_int4_signed, w4a8_level_table
from .replay import PlanReplays, input_kind

# id(codebook) -> (weak reference to it, its table). Keyed by identity: a WeakKeyDictionary would
# compare tensors with ``==`` on a hash collision.
_tables: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
_default_tables: dict[torch.device, torch.Tensor] = {}


def level_table(codebook: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The 256×16 INT8 level table for ``codebook`` on ``device``, computed once per codebook tensor."""
    if codebook is None:
        if device not in _default_tables:
            _default_tables[device] = w4a8_level_table(None, device)
        return _default_tables[device]
    entry = _tables.get(id(codebook))
    if entry is None or entry[0]() is not codebook or entry[1].device != device:
        key = id(codebook)
        entry = (weakref.ref(codebook, lambda _ref, key=key: _tables.pop(key, None)), w4a8_level_table(codebook, device))
        _tables[key] = entry
    return entry[1]


def w4a4_linear(x: torch.Tensor, qweight: torch.Tensor, wscales: torch.Tensor, bias: torch.Tensor | None = None,
                convrot_groupsize: int = 256, out_dtype: torch.dtype | None = None, act_bits: int = 4) -> torch.Tensor:
    """``x @ W.T + bias`` for a ``convrot_w4a4`` weight (``qweight`` int8 ``[N, K/2]``, ``wscales`` ``[N]``)."""
    if act_bits not in (4, 8):
        raise ValueError(f"w4a4 act_bits must be 4 or 8, got {act_bits}")
    out_dtype = out_dtype or x.dtype
    x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    fmt = "w4a4/a4" if act_bits == 4 else "w4a4/a8"
    key = _fast_key(fmt, x2d, qweight, wscales, bias, out_dtype, convrot_groupsize, None, None, None, 0)
    out = dispatch.run_fast(key, x2d, qweight, wscales, bias, None, None, None)
    if out is None:
        x2d, n = _check(x, qweight, convrot_groupsize, "w4a4")
        plan = _W4Plan(x2d, qweight, wscales.reshape(-1).float(), bias, out_dtype, convrot_groupsize,
                       qmax=INT4_MAX if act_bits == 4 else INT8_MAX)
        out = dispatch.run(fmt, x2d, n, plan.names, plan.make, plan.reasons, key, plan.make_fast,
                           (x2d, qweight, wscales, bias, None, None, None))
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], qweight.shape[0])


def w4a8_linear(x: torch.Tensor, qdata: torch.Tensor, s_rel: torch.Tensor, s_channel: torch.Tensor,
                codebook: torch.Tensor | None = None, correction: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, group_size: int = 16, convrot_groupsize: int = 256,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for an ``asym_w4a8_int8`` weight, arguments as comfy-kitchen's ``w4a8_int8_linear``."""
    out_dtype = out_dtype or x.dtype
    x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    key = _fast_key("w4a8", x2d, qdata, s_channel, bias, out_dtype, convrot_groupsize, s_rel, codebook, correction,
                    group_size)
    out = dispatch.run_fast(key, x2d, qdata, s_channel, bias, s_rel, codebook, correction)
    if out is None:
        x2d, n = _check(x, qdata, convrot_groupsize, "w4a8")
        if s_rel.shape != (n, 2 * qdata.shape[1] // group_size):
            raise ValueError(f"w4a8: s_rel must be [{n}, {2 * qdata.shape[1] // group_size}] for group_size "
                             f"{group_size}, found {tuple(s_rel.shape)}")
        plan = _W4Plan(x2d, qdata, s_channel.reshape(-1).float(), bias, out_dtype, convrot_groupsize, qmax=INT8_MAX,
                       s_rel=s_rel, codebook=codebook, correction=correction, group_size=group_size)
        out = dispatch.run("w4a8", x2d, n, plan.names, plan.make, plan.reasons, key, plan.make_fast,
                           (x2d, qdata, s_channel, bias, s_rel, codebook, correction))
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], qdata.shape[0])


def _fast_key(fmt, x2d, packed, w_scale, bias, out_dtype, rot_group, s_rel, codebook, correction, group_size) -> tuple:
    """Everything the dispatcher's choice and the chosen plan depend on (cheap to build: no strings)."""
    return _key(fmt, x2d.shape[0], x2d.shape[1], x2d.dtype, x2d.device, packed, w_scale, bias, out_dtype, rot_group,
                s_rel, codebook, correction, group_size)


def _key(fmt, m, k, x_dtype, device, packed, w_scale, bias, out_dtype, rot_group, s_rel, codebook, correction,
         group_size) -> tuple:
    return (fmt, rot_group, group_size, dispatch.m_bucket(m), packed.shape[0], k, packed.shape[1], packed.dtype,
            x_dtype, out_dtype, device, None if bias is None else bias.dtype, w_scale.numel(),
            None if s_rel is None else (s_rel.dtype, s_rel.shape), codebook is None, correction is None)


def w4_settled_linear(fmt: str, x2d: torch.Tensor, packed: torch.Tensor, w_scale: torch.Tensor,
                      bias: torch.Tensor | None, out_dtype: torch.dtype, rot_group: int, s_rel: torch.Tensor | None = None,
                      codebook: torch.Tensor | None = None, correction: torch.Tensor | None = None,
                      group_size: int = 0) -> torch.Tensor | None:
    """The settled plan of a 4-bit linear like this one (arguments as :func:`w4_prologue_linear`, the input a
    2-D tensor), run; ``None`` where the dispatcher has not settled one (the caller takes its full path)."""
    key = _key(fmt, x2d.shape[0], x2d.shape[1], x2d.dtype, x2d.device, packed, w_scale, bias, out_dtype, rot_group,
               s_rel, codebook, correction, group_size)
    return dispatch.run_fast(key, x2d, packed, w_scale, bias, s_rel, codebook, correction)


def w4_prologue_linear(fmt: str, prologue, packed: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
                       out_dtype: torch.dtype, rot_group: int, s_rel: torch.Tensor | None = None,
                       codebook: torch.Tensor | None = None, correction: torch.Tensor | None = None,
                       group_size: int = 0) -> torch.Tensor | None:
    """``linear(prologue.materialize())`` of a 4-bit weight with the prologue (``kernels/prologue.py``)
    computed inside the activation quantization, where the dispatcher settled the unfused call (``fmt``:
    ``"w4a4/a4"``, ``"w4a4/a8"`` or ``"w4a8"``; arguments as :func:`w4a4_linear` / :func:`w4a8_linear`)
    on our Triton plans, which it then runs; ``None`` otherwise (see ``w8a8_linear.w8a8_prologue_linear``)."""
    m, k = prologue.shape
    src = prologue.source
    key = _key(fmt, m, k, src.dtype, src.device, packed, w_scale, bias, out_dtype, rot_group, s_rel, codebook,
               correction, group_size)
    plan = dispatch.fast_plan(key)
    if not isinstance(plan, _TritonPlanBase):
        return None
    return plan(prologue, packed, w_scale, bias, s_rel, codebook, correction)


def _check(x: torch.Tensor, packed: torch.Tensor, convrot_groupsize: int, fmt: str) -> tuple[torch.Tensor, int]:
    if packed.dim() != 2 or packed.dtype not in (torch.int8, torch.uint8):
        raise ValueError(f"{fmt}: the packed weight must be a 2-D int8 tensor, found {packed.dtype} {tuple(packed.shape)}")
    k = x.shape[-1]
    if k != 2 * packed.shape[1]:
        raise ValueError(f"{fmt}: input has {k} features but the packed weight holds {2 * packed.shape[1]}")
    if k % convrot_groupsize:
        raise ValueError(f"{fmt}: {k} input features are not a multiple of convrot_groupsize {convrot_groupsize}")
    return x.reshape(-1, k), packed.shape[0]


class _W4Plan:
    def __init__(self, x, packed, w_scale, bias, out_dtype, convrot_groupsize, qmax, s_rel=None, codebook=None,
                 correction=None, group_size=16):
        self.x, self.packed, self.w_scale, self.bias, self.out_dtype = x, packed.view(torch.int8), w_scale, bias, out_dtype
        self.rot_group, self.qmax = convrot_groupsize, qmax
        self.s_rel, self.codebook, self.correction, self.group_size = s_rel, codebook, correction, group_size
        self.device = x.device

    def _triton_problem(self) -> str | None:
        problem = triton_problem(self.device)
        if problem is None:
            from .triton_act_quant import act_quant_problem

            problem = act_quant_problem(self.x.shape[1], "regular", self.rot_group)
        if problem is None and self.s_rel is not None:
            if self.correction is not None:
                problem = "asymmetric W4A8 weights (with a correction term) are not decoded in-kernel"
            elif self.s_rel.dtype not in (FP8, torch.uint8):
                problem = f"in-kernel decode needs FP8 group scales, found {self.s_rel.dtype}"
            elif self.x.shape[1] % 256 or 64 % self.group_size or self.group_size % 8:
                problem = f"in-kernel decode needs K % 256 == 0 and a group size of 8, 16, 32 or 64, got {self.group_size}"
        return problem

    def _kitchen_ok(self) -> bool:
        return self.s_rel is not None or self.qmax == INT4_MAX  # kitchen's w4a4 runs 4-bit activations

    def reasons(self) -> dict[str, str]:
        out = {}
        problem = self._triton_problem()
        if problem:
            out["triton"] = problem
        if not self._kitchen_ok():
            out["kitchen"] = "comfy-kitchen runs convrot_w4a4 with 4-bit activations only (use act_bits=4)"
        out["torch"] = "torch has no 4-bit weight GEMM"
        return out

    def names(self) -> list[str]:
        m = self.x.shape[0]
        triton = []
        if self._triton_problem() is None:
            on_gpu = self.device.type == "cuda"
            configs = (w4_candidates(capability(self.device), m, codebook=self.s_rel is not None) if on_gpu
                       else [default_config(m, "w4")])
            expand = []
            if self.s_rel is not None:  # the codebook; signed nibbles decode cheaply in the GEMM itself
                expand = w4_expand_candidates(capability(self.device), m) if on_gpu else [default_config(m)]
            triton = [f"triton:{c.name}" for c in configs] + [f"{EXPAND}{c.name}" for c in expand]
        kitchen = ["kitchen"] if self._kitchen_ok() else []
        if self.device.type == "cuda":  # the reference runs on a GPU only when forced
            return triton + kitchen + ["dequant"] + (["eager"] if active_backend() is Backend.EAGER else [])
        return kitchen + ["eager", "dequant"] + (triton if interpreting() else [])

    def make_fast(self, name: str):
        """The steady-state call of candidate ``name``:
        ``plan(x2d, packed, w_scale, bias, s_rel, codebook, correction)``."""
        if name.startswith(EXPAND):
            return _ExpandW4Plan(config_named(name[len(EXPAND):]), self.qmax, self.rot_group, self.group_size,
                                 self.out_dtype)
        if name.startswith("triton:"):
            return _TritonW4Plan(config_named(name.split(":", 1)[1]), self.qmax, self.rot_group, self.group_size,
                                 self.out_dtype)
        qmax, rot_group, group_size, out_dtype = self.qmax, self.rot_group, self.group_size, self.out_dtype

        def plan(x, packed, w_scale, bias, s_rel, codebook, correction):  # any other decision: its full candidate
            return _W4Plan(x, packed, w_scale.reshape(-1).float(), bias, out_dtype, rot_group, qmax, s_rel, codebook,
                           correction, group_size).make(name)()
        return plan

    def make(self, name: str):
        if name.startswith(EXPAND):
            config = config_named(name[len(EXPAND):])
            return lambda: _ExpandW4Plan(config, self.qmax, self.rot_group, self.group_size, self.out_dtype)(
                self.x, self.packed, self.w_scale, self.bias, self.s_rel, self.codebook, self.correction)
        if name.startswith("triton:"):
            config = name.split(":", 1)[1]
            return lambda: self._quantized("triton", config, config_named(config).block_k)
        if name == "eager":
            return lambda: self._quantized("eager", "eager", 0)
        if name == "kitchen":
            return self._kitchen
        if name == "dequant":
            return self._dequant
        raise KeyError(f"unknown 4-bit implementation {name!r}")

    def _quantized(self, act_impl: str, mm_impl: str, perm_block: int) -> torch.Tensor:
        if self.correction is not None and mm_impl == "eager":
            return self._dequant()  # the asymmetric correction is not an INT8 product (kitchen does the same)
        q, scale, _ = ops.act_quant(self.x, torch.int8, self.qmax, "regular", self.rot_group, None, False,
                                    perm_block, act_impl, ops.plane_run(self.s_rel is not None))
        table = level_table(self.codebook, self.device) if self.s_rel is not None else None
        return ops.w4a8_mm(q, self.packed, scale, self.w_scale, self.bias, self.s_rel, table, self.group_size,
                           perm_block, self.out_dtype, mm_impl)

    def _kitchen(self) -> torch.Tensor:
        import comfy_kitchen as ck

        if self.s_rel is not None:
            return ck.w4a8_int8_linear(self.x, self.packed, self.s_rel, self.w_scale, codebook=self.codebook,
                                       correction=self.correction, bias=self.bias, group_size=self.group_size,
                                       convrot_groupsize=self.rot_group, out_dtype=self.out_dtype)
        out = ck.convrot_w4a4_linear(self.x.to(self.out_dtype), self.packed, self.w_scale, bias=self.bias,
                                     convrot_groupsize=self.rot_group)
        return out.to(self.out_dtype)

    def _dequant(self) -> torch.Tensor:
        if self.s_rel is None:
            weight = unpack_int4_signed(self.packed).float() * self.w_scale.reshape(-1, 1)
        else:
            n, k = self.packed.shape[0], self.packed.shape[1] * 2
            levels = decode_w4a8_levels(self.packed, self.s_rel, self.codebook, self.group_size).float()
            weight = levels.view(n, k // self.group_size, self.group_size) * self.w_scale.view(n, 1, 1)
            if self.correction is not None:
                weight = weight + self.correction.t().unsqueeze(-1).float()
            weight = weight.view(n, k)
        compute = self.x.dtype if self.x.dtype in (torch.float16, torch.bfloat16) and self.x.is_cuda else torch.float32
        x_rot = rotate_blocks(self.x.float(), "regular", self.rot_group).to(compute)
        out = torch.nn.functional.linear(x_rot, weight.to(compute)).float()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(self.out_dtype)


class _TritonPlanBase:
    """A Triton decision's steady-state call: ``plan(x2d, packed, w_scale, bias, s_rel, codebook, correction)``
    (``x2d`` may be a prologue: the act-quant kernel computes it from its sources), its launches replayed
    per kind of input (``kernels/replay.py``)."""

    __slots__ = ("config", "qmax", "rot_group", "group_size", "out_dtype", "replays")

    def __init__(self, config, qmax, rot_group, group_size, out_dtype):
        self.config, self.qmax, self.rot_group, self.group_size, self.out_dtype = (config, qmax, rot_group,
                                                                                  group_size, out_dtype)
        self.replays = PlanReplays()

    def __call__(self, x, packed, w_scale, bias, s_rel, codebook, correction):
        if packed.dtype != torch.int8:
            packed = packed.view(torch.int8)
        if w_scale.dtype != torch.float32 or not w_scale.is_contiguous():
            w_scale = w_scale.reshape(-1).float()
        table = level_table(codebook, packed.device) if s_rel is not None else None
        key, sources = input_kind(x)
        return self.replays.run(key, (*sources, packed, w_scale, bias, s_rel, table),
                                lambda: self._launch(x, packed, w_scale, bias, s_rel, table), last_only=True)[-1]


class _TritonW4Plan(_TritonPlanBase):
    """The act-quant kernel (codes permuted for the W4 kernel's planes) + the W4 GEMM with one tile config."""

    __slots__ = ()

    def _launch(self, x, packed, w_scale, bias, s_rel, table) -> tuple:
        from .triton_act_quant import act_quant_triton
        from .triton_w4_gemm import w4a8_mm_triton

        config = self.config
        q, scale, _ = act_quant_triton(x, torch.int8, self.qmax, "regular", self.rot_group, None, False, config.block_k,
                                       perm_run=ops.plane_run(s_rel is not None))
        return q, scale, w4a8_mm_triton(q, packed, scale, w_scale, bias, s_rel, table, self.group_size,
                                        self.out_dtype, config)


EXPAND = "triton:expand-"


class _ExpandW4Plan(_TritonPlanBase):
    """The act-quant kernel (codes in natural order) + the weight expanded to INT8 + the W8A8 GEMM."""

    __slots__ = ()

    def _launch(self, x, packed, w_scale, bias, s_rel, table) -> tuple:
        from .triton_act_quant import act_quant_triton
        from .triton_w4_expand import expand_w4_int8
        from .triton_w8a8_gemm import w8a8_mm_triton

        q, scale, _ = act_quant_triton(x, torch.int8, self.qmax, "regular", self.rot_group, None, False, 0)
        levels = expand_w4_int8(packed, s_rel, table, self.group_size)
        return q, scale, levels, w8a8_mm_triton(q, levels, scale, w_scale, bias, None, None, self.out_dtype,
                                                self.config)
