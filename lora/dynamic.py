"""Dynamic mode: base weights untouched, each layer adds ``y += ((x @ down.T) * rank_scale) @ up.T``.

A :class:`LoraBank` holds every LoRA of one layer as one concatenated pair - ``down`` ``[R, K]`` and
``up`` ``[N, R]`` with ``R`` the sum of the ranks - plus a ``rank_scale`` vector ``[R]`` holding each
rank's ``strength * alpha / rank``. Changing a strength only rewrites that LoRA's entries of
``rank_scale`` (and its copy in the bank's dtype, ``rank_scale_c``, which the forward uses) in
place: no tensor is reallocated, nothing is re-quantized or reloaded, and a
compiled graph sees the same tensors. Changing the *set* of LoRAs builds a new bank (the base
weight is still untouched).

:func:`apply` takes the layer's input as the module receives it, before any rotation or smoothing
the quantized layout applies inside its own linear, so the LoRA term is exact for every format
(rotations are orthogonal and cancel in ``x @ W.T``; adding the term outside leaves the quantized
product as it was). A forward that only holds the rotated activation ``x H`` can use
:meth:`LoraBank.in_basis` (``down H``, so ``(x H)(down H).T = x down.T``).

:func:`add_into` is what a layer's forward hook uses: it accumulates the term into the layer's fresh
output with one ``addmm_`` (three small kernels per layer in all: ``x @ down.T``, the rank scale,
the accumulating product), so no ``[tokens, out]`` temporary is written and read back.

The bank is an ``nn.Module`` with non-persistent buffers: ``module.to(device)`` moves it in place and
it never appears in a state dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .delta import LowRankDelta
from .errors import LoraShapeError


@dataclass(frozen=True)
class RankRange:
    """Ranks ``start:stop`` of a bank belong to LoRA ``name``; ``unit_scale`` is its ``alpha / rank``."""

    name: str
    start: int
    stop: int
    unit_scale: float


class LoraBank(torch.nn.Module):
    """All LoRAs of one linear layer as one low-rank pair with a per-rank scale vector."""

    def __init__(self, down: torch.Tensor, up: torch.Tensor, rank_scale: torch.Tensor,
                 ranges: Sequence[RankRange], strengths: dict[str, float]):
        super().__init__()
        self.register_buffer("down", down, persistent=False)
        self.register_buffer("up", up, persistent=False)
        self.register_buffer("rank_scale", rank_scale, persistent=False)
        self.register_buffer("rank_scale_c", rank_scale.to(down.dtype), persistent=False)
        self.ranges: tuple[RankRange, ...] = tuple(ranges)
        self._strengths = dict(strengths)

    @classmethod
    def build(cls, entries: Sequence[tuple[str, LowRankDelta]], shape: tuple[int, int], *,
              dtype: torch.dtype = torch.float32, device=None, layer: str = "") -> "LoraBank":
        """One bank from ``(lora_name, delta)`` entries, in order, for a ``[out, in]`` weight of ``shape``.

        A LoRA may contribute several deltas to one layer (``to_q``/``to_k``/``to_v`` into a fused
        ``qkv``); they share its name and its strength (the first delta's ``strength``).
        """
        n, k = shape
        if not entries:
            raise ValueError(f"layer {layer!r}: a LoRA bank needs at least one LoRA")
        if device is None:  # where the (first) LoRA lives: its scales must be made there too
            device = entries[0][1].down.device
        downs, ups, ranges, strengths, scales = [], [], [], {}, []
        start = 0
        for name, delta in entries:
            delta.check_fits((n, k), layer)
            if strengths.setdefault(name, float(delta.strength)) != float(delta.strength):
                raise ValueError(f"layer {layer!r}: LoRA {name!r} has deltas at strengths {strengths[name]} and "
                                 f"{delta.strength}; one LoRA has one strength per bank")
            unit = delta.alpha_scale
            downs.append(delta.down.to(device=device, dtype=dtype))
            ups.append(delta.up_full(n, dtype=dtype, device=device))
            ranges.append(RankRange(name, start, start + delta.rank, unit))
            scales.append(torch.full((delta.rank,), strengths[name] * unit, dtype=torch.float32, device=device))
            start += delta.rank
        return cls(torch.cat(downs, 0).contiguous(), torch.cat(ups, 1).contiguous(), torch.cat(scales),
                   ranges, strengths)

    # ---- strengths ---------------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._strengths)

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    def strength(self, name: str) -> float:
        return self._strengths[self._known(name)]

    def set_strength(self, name: str, strength: float) -> None:
        """Set LoRA ``name``'s strength by rewriting its ``rank_scale`` entries in place."""
        self._strengths[self._known(name)] = float(strength)
        with torch.no_grad():
            for r in self.ranges:
                if r.name == name:
                    self.rank_scale[r.start:r.stop].fill_(float(strength) * r.unit_scale)
                    self.rank_scale_c[r.start:r.stop].fill_(float(strength) * r.unit_scale)

    def _known(self, name: str) -> str:
        if name not in self._strengths:
            raise KeyError(f"no LoRA named {name!r} in this bank; it holds {', '.join(self._strengths) or 'none'}")
        return name

    # ---- bases -------------------------------------------------------------------------------
    def in_basis(self, map_inputs: Callable[[torch.Tensor], torch.Tensor]) -> "LoraBank":
        """A bank whose ``down`` is ``map_inputs(down)`` (e.g. a Hadamard rotation), for rotated inputs.

        The new bank shares ``up`` and ``rank_scale`` with this one, so strength edits reach both.
        """
        down = map_inputs(self.down.float()).to(self.down.dtype)
        if down.shape != self.down.shape:
            raise LoraShapeError(f"map_inputs changed down's shape {tuple(self.down.shape)} to {tuple(down.shape)}")
        bank = LoraBank(down, self.up, self.rank_scale, self.ranges, self._strengths)
        bank.rank_scale_c = self.rank_scale_c  # shared too: a strength edit reaches both views
        bank._strengths = self._strengths  # one strength table for both views
        return bank

    def extra_repr(self) -> str:
        loras = ", ".join(f"{n}@{s:g}" for n, s in self._strengths.items())
        return f"rank={self.rank}, out={self.up.shape[0]}, in={self.down.shape[1]}, loras=[{loras}]"


def _hidden(x: torch.Tensor, bank: LoraBank) -> torch.Tensor:
    """``(x @ down.T) * rank_scale`` in the bank's dtype (the scale's copy in that dtype)."""
    hidden = torch.nn.functional.linear(x.to(bank.down.dtype), bank.down)
    return hidden.mul_(bank.rank_scale_c) if not hidden.requires_grad else hidden * bank.rank_scale_c


def apply(x: torch.Tensor, bank: LoraBank) -> torch.Tensor:
    """The LoRA term ``((x @ down.T) * rank_scale) @ up.T`` for input ``x`` ``[..., K]``, in ``x``'s dtype.

    Add it to the quantized layer's output (or let :func:`add_into` do it in place). Both products
    and the rank scale run in the bank's dtype.
    """
    return torch.nn.functional.linear(_hidden(x, bank), bank.up).to(x.dtype)


def add_into(out: torch.Tensor, x: torch.Tensor, bank: LoraBank) -> torch.Tensor:
    """``out + apply(x, bank)``, accumulated into ``out`` in place when that is safe.

    In place (one ``addmm_``, beta = 1) when ``out`` is a contiguous tensor of the bank's dtype that
    autograd does not track; otherwise a new tensor. Returns the result either way.
    """
    hidden = _hidden(x, bank)
    n = out.shape[-1]
    if (out.dtype == bank.up.dtype and out.is_contiguous() and not out.requires_grad
            and not hidden.requires_grad and out.device == hidden.device):
        out.view(-1, n).addmm_(hidden.reshape(-1, hidden.shape[-1]), bank.up.t())
        return out
    return out + torch.nn.functional.linear(hidden, bank.up).to(out.dtype)
