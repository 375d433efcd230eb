"""What a linear's input is made of, when it is not a tensor yet: the act-quant kernel's prologues.

In a transformer block the input of a quantized linear is usually the output of a cheap pointwise or
row-wise op that the previous kernel wrote to memory in bf16 just for the activation quantization to
read it back: the MLP's GELU, Flux's ``cat((attention, gelu(mlp)), -1)``, the gated MLP's
``silu(gate) * up`` (ComfyUI's ``"swiglu"``; Flux 2's, also after the attention output), and the block's
``LayerNorm`` followed by the adaptive modulation ``shift + norm(x) * (1 + scale)``. A prologue
describes such an input by its sources; ``triton_act_quant.act_quant_triton(prologue=...)`` computes
it in registers from the sources, row by row, and quantizes it in the same pass, so the bf16
intermediate is never stored.

* :class:`GeluPrologue` - ``[a | gelu(b)]`` (``a`` may be absent): ``a`` ``[M, Ka]``, ``b`` ``[M, Kb]``.
* :class:`SwigluPrologue` - ``[a | silu(gate) * up]`` of ``x = [gate | up]`` ``[M, 2H]`` (the gate first, as
  ComfyUI's ``comfy.ops.INPUT_ACT_EAGER["swiglu"]`` and Flux 2's ``SiLUActivation`` split it), or of a gate
  ``x`` ``[M, H]`` and an ``up`` ``[M, H]`` given apart (a gated MLP written as two linears, Lumina 2's and
  Z-Image's ``w2(silu(w1(x)) * w3(x))``); ``a`` may be absent.
* :class:`NormModPrologue` - ``shift + layer_norm(x) * mult`` (no affine weights, as the DiT blocks
  use it; ``mult`` and ``shift`` may be absent): ``x`` ``[M, K]``, ``mult``/``shift`` one row of ``K``
  values per batch element, each batch element ``rows_per_batch`` consecutive rows of ``x``. With ``rms``
  the norm is ``rms_norm(x, weight)`` (Lumina 2's and Z-Image's ``x * (1 + scale)``, Krea 2's
  ``(1 + scale) * norm + shift``: ``two_step``, the product rounded before the shift is added).

Each rounds what it computes to the input's dtype where the unfused graph stores a tensor (after the
GELU; after the SiLU and after the gating product; after the normalization - an RMSNorm's weight
applied before that rounding, as torch's fused ``rms_norm`` does - and after the modulation, and after each
of its two steps where ``two_step``),
so the codes are those of the tensor the unfused graph would quantize, up to the last bit of ``tanh``, of
the SiLU's exponential or of the row variance.
:meth:`materialize` is that unfused graph in torch (the reference, and the fallback wherever a kernel
does not take the call). Nothing here imports Triton or ComfyUI.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

GELU_APPROXIMATIONS = ("none", "tanh")


class PrologueError(ValueError):
    """Sources that do not describe a prologue input (shapes, dtypes or devices that disagree)."""


class _AfterInput:
    """What the prologues ``[a | f(source)]`` share: ``a`` (optional, 2-D) is copied in front of the computed
    columns. A subclass gives ``source``, ``a``, ``_width`` (the computed columns) and ``_compute(out)``."""

    def _check_a(self):
        src = self.source
        if self.a is not None and (self.a.dim() != 2 or self.a.shape[0] != src.shape[0]
                                   or self.a.dtype != src.dtype or self.a.device != src.device):
            raise PrologueError(f"a must be 2-D with the same rows, dtype and device as the source, got "
                                f"{(tuple(self.a.shape), self.a.dtype)} and {(tuple(src.shape), src.dtype)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.source.shape[0], self._width + (0 if self.a is None else self.a.shape[1])

    def materialize(self) -> torch.Tensor:
        if self.a is None:
            return self._compute(None)
        out = self.source.new_empty(self.shape)
        ka = self.a.shape[1]
        out[:, :ka] = self.a
        self._compute(out[:, ka:])
        return out


@dataclass(frozen=True, eq=False)
class GeluPrologue(_AfterInput):
    """``cat([a, gelu(b, approximate)], -1)`` (``gelu(b)`` when ``a`` is None); 2-D sources, unit column stride."""

    b: torch.Tensor
    a: torch.Tensor | None = None
    approximate: str = "tanh"

    def __post_init__(self):
        if self.approximate not in GELU_APPROXIMATIONS:
            raise PrologueError(f"GELU approximate={self.approximate!r} is not one of {GELU_APPROXIMATIONS}")
        if self.b.dim() != 2:
            raise PrologueError(f"b must be 2-D, got {tuple(self.b.shape)}")
        self._check_a()

    @property
    def source(self) -> torch.Tensor:
        return self.b

    @property
    def _width(self) -> int:
        return self.b.shape[1]

    def _compute(self, out: torch.Tensor | None) -> torch.Tensor:
        if out is None:
            return F.gelu(self.b, approximate=self.approximate)
        return torch._C._nn.gelu(self.b, approximate=self.approximate, out=out)


@dataclass(frozen=True, eq=False)
class SwigluPrologue(_AfterInput):
    """``cat([a, silu(gate) * up], -1)`` (``silu(..) * ..`` alone when ``a`` is None): a gated MLP's hidden state
    before its down-projection. The gate and up halves are ``x`` ``[M, 2H]``, the gate first (ComfyUI's
    ``"swiglu"``, and Flux 2's ``SiLUActivation``), or, with ``up`` given, ``x`` is the gate ``[M, H]`` and ``up``
    ``[M, H]`` (two linears' outputs, Lumina 2's and Z-Image's ``FeedForward``); 2-D sources, unit column stride."""

    x: torch.Tensor
    a: torch.Tensor | None = None
    up: torch.Tensor | None = None

    def __post_init__(self):
        if self.up is None:
            if self.x.dim() != 2 or self.x.shape[1] % 2 or self.x.shape[1] == 0:
                raise PrologueError(f"x must be 2-D [M, 2H] (gate, then up), got {tuple(self.x.shape)}")
        elif (self.x.dim() != 2 or self.x.shape[1] == 0 or self.up.shape != self.x.shape
              or self.up.dtype != self.x.dtype or self.up.device != self.x.device):
            raise PrologueError(f"the gate and up must be 2-D [M, H] of one dtype and device, got "
                                f"{(tuple(self.x.shape), self.x.dtype)} and {(tuple(self.up.shape), self.up.dtype)}")
        self._check_a()

    @property
    def source(self) -> torch.Tensor:
        return self.x

    @property
    def _width(self) -> int:
        return self.x.shape[1] if self.up is not None else self.x.shape[1] // 2

    def gate_and_up(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x.chunk(2, dim=-1) if self.up is None else (self.x, self.up)

    def _compute(self, out: torch.Tensor | None) -> torch.Tensor:
        gate, up = self.gate_and_up()
        if out is None:
            return F.silu(gate).mul_(up)  # ComfyUI's eager form: the SiLU stored, then the product in place
        return torch.mul(F.silu(gate), up, out=out)


@dataclass(frozen=True, eq=False)
class NormModPrologue:
    """``shift + norm(x) * mult`` per row; ``mult``/``shift``: ``[B, K]`` (row ``i`` of ``x`` uses
    row ``i // rows_per_batch``), ``[1, K]`` (every row) or None (1 / 0). ``x``: 2-D, unit column stride.

    ``norm`` is ``layer_norm(x, eps)`` without affine weights, or with ``rms`` ``rms_norm(x, weight, eps)``:
    ``weight`` (``[K]``, optional) of ``x``'s dtype is torch's ``F.rms_norm(x, (K,), weight, eps)``; an fp32
    ``weight`` is ``F.rms_norm(x.float(), (K,), weight, eps).to(x.dtype)`` (Krea 2's RMSNorm). Either way the
    normalized row times the weight is rounded once, or with ``round_before_weight`` (a weight of ``x``'s dtype,
    where torch's ``rms_norm`` runs its composite form) the normalized row is rounded, then times the weight
    (``quant/deferred.rms_norm_weight_rounding`` finds which). ``two_step``: ``norm * mult`` rounded, then ``+ shift``
    (two ops, as Krea 2 writes it) instead of one ``addcmul``."""

    x: torch.Tensor
    eps: float
    mult: torch.Tensor | None = None
    shift: torch.Tensor | None = None
    rows_per_batch: int = 0  # 0: the modulation rows apply to every row (one batch element)
    rms: bool = False
    weight: torch.Tensor | None = None
    two_step: bool = False
    round_before_weight: bool = False  # torch's composite rms_norm: the normalized row rounded, then times weight

    def __post_init__(self):
        if self.x.dim() != 2:
            raise PrologueError(f"x must be 2-D, got {tuple(self.x.shape)}")
        m, k = self.x.shape
        batches = None
        for name, t in (("mult", self.mult), ("shift", self.shift)):
            if t is None:
                continue
            if t.dim() != 2 or t.shape[1] != k or t.dtype != self.x.dtype or t.device != self.x.device:
                raise PrologueError(f"{name} must be [B, {k}] {self.x.dtype} on {self.x.device}, got "
                                    f"{tuple(t.shape)} {t.dtype} on {t.device}")
            if batches not in (None, t.shape[0]):
                raise PrologueError(f"mult and shift have {batches} and {t.shape[0]} rows")
            batches = t.shape[0]
        rpb = self.rows_per_batch
        if batches not in (None, 1) and (rpb <= 0 or rpb * batches != m):
            raise PrologueError(f"{batches} modulation rows do not split {m} rows into batch elements of {rpb}")
        w = self.weight
        if w is not None:
            if not self.rms:
                raise PrologueError("a norm weight is for the RMSNorm prologue (rms=True) only")
            if self.round_before_weight and w.dtype != self.x.dtype:
                raise PrologueError("round_before_weight is torch's composite rms_norm with a weight of x's dtype")
            if (w.shape != (k,) or w.device != self.x.device or w.dtype not in (self.x.dtype, torch.float32)
                    or w.stride(0) != 1):
                raise PrologueError(f"weight must be a contiguous [{k}] of {self.x.dtype} or float32 on "
                                    f"{self.x.device}, got {tuple(w.shape)} {w.dtype} on {w.device}")

    @classmethod
    def checked_by_caller(cls, x: torch.Tensor, eps: float, mult: torch.Tensor | None = None,
                          shift: torch.Tensor | None = None, rows_per_batch: int = 0, rms: bool = False,
                          weight: torch.Tensor | None = None, two_step: bool = False,
                          round_before_weight: bool = False) -> "NormModPrologue":
        """The prologue without ``__post_init__``'s checks, for a caller that has made them already (the
        deferred norms build two per modulated norm on every call)."""
        new = object.__new__(cls)
        # the fields straight into the instance dict (what the frozen dataclass's __init__ stores), in one call
        new.__dict__.update(x=x, eps=eps, mult=mult, shift=shift, rows_per_batch=rows_per_batch, rms=rms,
                            weight=weight, two_step=two_step, round_before_weight=round_before_weight)
        return new

    @property
    def source(self) -> torch.Tensor:
        return self.x

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.x.shape)

    def _per_row(self, t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] == 1:
            return t
        return t.repeat_interleave(self.rows_per_batch, dim=0)

    def normalized(self) -> torch.Tensor:
        """The norm's output, before the modulation (what the model's norm module returns)."""
        k = self.x.shape[1]
        if not self.rms:
            return F.layer_norm(self.x, (k,), None, None, self.eps)
        w = self.weight
        if w is not None and w.dtype != self.x.dtype:  # an fp32 weight: the norm computed in fp32
            return F.rms_norm(self.x.float(), (k,), w, self.eps).to(self.x.dtype)
        if self.round_before_weight:  # what torch computes where it found so (or is told: the tests)
            return F.rms_norm(self.x, (k,), None, self.eps) * w
        return F.rms_norm(self.x, (k,), w, self.eps)

    def materialize(self) -> torch.Tensor:
        out = self.normalized()
        if self.mult is None and self.shift is None:
            return out
        if self.shift is None:
            return out * self._per_row(self.mult)
        if self.mult is None:
            return out + self._per_row(self.shift)
        if self.two_step:
            return out * self._per_row(self.mult) + self._per_row(self.shift)
        return torch.addcmul(self._per_row(self.shift), out, self._per_row(self.mult))


Prologue = GeluPrologue | SwigluPrologue | NormModPrologue
PROLOGUES = (GeluPrologue, SwigluPrologue, NormModPrologue)  # for isinstance

__all__ = ["GELU_APPROXIMATIONS", "GeluPrologue", "NormModPrologue", "PROLOGUES", "Prologue", "PrologueError",
           "SwigluPrologue"]
