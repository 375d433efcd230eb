"""One LoRA's change to one linear layer, as data: low-rank ``(down, up, alpha)`` or a dense diff.

Conventions (PEFT names): ``down`` is ``lora_A`` / kohya ``lora_down``, shape ``[rank, in_features]``;
``up`` is ``lora_B`` / kohya ``lora_up``, shape ``[rows, rank]``. The weight change is

    delta_W = strength * (alpha / rank) * up @ down        (alpha None: factor 1, as ComfyUI does)

``rows = (offset, length)`` places ``up``'s rows inside a fused weight (a diffusers ``to_q`` LoRA on
Flux's fused ``qkv``); ``None`` means all output rows. Everything here is pure torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence, Union

import torch

from .errors import LoraFormatError, LoraShapeError


@dataclass(frozen=True)
class LowRankDelta:
    """``strength * alpha/rank * up @ down`` placed at ``rows`` of the target weight."""

    down: torch.Tensor  # [rank, in_features]
    up: torch.Tensor  # [rows, rank]
    alpha: float | None = None
    strength: float = 1.0
    rows: tuple[int, int] | None = None  # (offset, length) in the target's output rows
    source: str = ""  # the LoRA key prefix it came from, for reports

    def __post_init__(self):
        if self.down.dim() != 2 or self.up.dim() != 2:
            raise LoraFormatError(
                f"LoRA {self.source or '(unnamed)'}: down and up must be 2-D matrices, found "
                f"{tuple(self.down.shape)} and {tuple(self.up.shape)} (conv LoRAs are handled by ComfyUI's adapters)")
        if self.down.shape[0] != self.up.shape[1]:
            raise LoraFormatError(
                f"LoRA {self.source or '(unnamed)'}: down has rank {self.down.shape[0]} but up has rank "
                f"{self.up.shape[1]}; the pair is from different layers or the file is damaged")
        if self.rows is not None:
            offset, length = self.rows
            if offset < 0 or length != self.up.shape[0]:
                raise LoraShapeError(
                    f"LoRA {self.source or '(unnamed)'}: rows {self.rows} do not fit up of shape {tuple(self.up.shape)}")

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])

    @property
    def alpha_scale(self) -> float:
        """``alpha / rank``, or 1 when the file has no alpha (ComfyUI's rule)."""
        return 1.0 if self.alpha is None else float(self.alpha) / self.rank

    @property
    def factor(self) -> float:
        """The scalar in front of ``up @ down``: ``strength * alpha / rank``."""
        return float(self.strength) * self.alpha_scale

    def with_strength(self, strength: float) -> "LowRankDelta":
        return dataclasses.replace(self, strength=float(strength))

    def check_fits(self, shape: tuple[int, int], layer: str = "") -> None:
        """Raise :class:`LoraShapeError` unless the delta fits a ``[out, in]`` weight of ``shape``."""
        n, k = shape
        offset, length = self.rows if self.rows is not None else (0, n)
        if self.down.shape[1] != k or self.up.shape[0] != length or offset + length > n:
            raise LoraShapeError(
                f"LoRA {self.source or '(unnamed)'} on layer {layer!r}: expected down [rank, {k}] and up "
                f"[{length}, rank] at rows {offset}..{offset + length} of a [{n}, {k}] weight, found down "
                f"{tuple(self.down.shape)} and up {tuple(self.up.shape)}. The LoRA was made for a different model.")

    def up_full(self, out_features: int, dtype=torch.float32, device=None) -> torch.Tensor:
        """``up`` padded with zero rows to ``[out_features, rank]`` (itself when ``rows`` is None)."""
        device = device if device is not None else self.up.device
        up = self.up.to(device=device, dtype=dtype)
        if self.rows is None:
            return up
        full = torch.zeros(out_features, self.rank, dtype=dtype, device=device)
        full[self.rows[0]: self.rows[0] + self.rows[1]] = up
        return full


@dataclass(frozen=True)
class DenseDelta:
    """A full ``[out, in]`` weight change (a ``diff`` patch, or what a LoHa/LoKr/DoRA adapter did)."""

    diff: torch.Tensor
    strength: float = 1.0
    source: str = ""

    def check_fits(self, shape: tuple[int, int], layer: str = "") -> None:
        if tuple(self.diff.shape) != tuple(shape):
            raise LoraShapeError(
                f"weight diff {self.source or '(unnamed)'} on layer {layer!r}: expected shape {tuple(shape)}, "
                f"found {tuple(self.diff.shape)}")


Delta = Union[LowRankDelta, DenseDelta]


def sum_deltas(deltas: Sequence[Delta], shape: tuple[int, int], *, device=None, layer: str = "",
               map_inputs=None) -> torch.Tensor:
    """The fp32 sum of ``deltas`` as one ``[out, in]`` matrix.

    ``map_inputs(m)`` (optional) maps any ``[*, in]`` matrix into the layer's stored basis along the
    input dimension (a Hadamard rotation, a division by smoothing factors). It is linear, so it is
    applied to each ``down`` (``rank x in``, cheap) instead of to the dense product.
    """
    n, k = shape
    total = torch.zeros(n, k, dtype=torch.float32, device=device)
    identity = map_inputs is None
    for delta in deltas:
        delta.check_fits(shape, layer)
        if isinstance(delta, DenseDelta):
            diff = delta.diff.to(device=device, dtype=torch.float32)
            total += float(delta.strength) * (diff if identity else map_inputs(diff))
            continue
        if delta.strength == 0:
            continue
        down = delta.down.to(device=device, dtype=torch.float32)
        if not identity:
            down = map_inputs(down)
        up = delta.up.to(device=device, dtype=torch.float32) * delta.factor
        if delta.rows is None:
            total.addmm_(up, down)
        else:
            offset, length = delta.rows
            total[offset: offset + length].addmm_(up, down)
    return total
