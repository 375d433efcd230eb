"""A plan's launch replays, one per kind of input (``launcher.LaunchReplay``).

A steady-state plan (``w8a8_linear._TritonW8A8Plan``, ``w4_linear``'s Triton plans) serves every layer
of its format and shapes. Per kind of input – a tensor of ``M`` rows and row stride, or a prologue
(``kernels/prologue.py``) of ``M`` rows with its GELU approximation or norm (kind, epsilon, weight) and batch
rows, or a SwiGLU of ``M`` rows (its up half given apart or not) – :class:`PlanReplays` runs the first call as usual
(it may compile a kernel, or check a variant against another), records the launches of the second, and
replays them from the third call on.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .launcher import LaunchReplay, capture_launches, replays_enabled
from .prologue import GeluPrologue, SwigluPrologue

_SEEN = object()  # one ordinary call made, the next one is recorded
_NONE = object()  # recorded, but its launches cannot be replayed
_MAX_KINDS = 64  # kinds of input kept per plan (changing resolutions): beyond that, start over


def input_kind(x) -> tuple[tuple, tuple]:
    """``(key, source tensors)`` of a plan's input: everything its launches' scalars and constexprs take from
    it besides the sources' dtypes, shapes and strides (which the replay checks itself)."""
    if isinstance(x, torch.Tensor):
        return (x.shape[0], x.stride(0)), (x,)
    if isinstance(x, GeluPrologue):
        return ("gelu", x.b.shape[0], x.approximate), (x.b, x.a)
    if isinstance(x, SwigluPrologue):
        if x.up is not None:  # the up half a tensor of its own
            return ("swiglu_pair", x.x.shape[0]), (x.x, x.a, x.up)
        return ("swiglu", x.x.shape[0]), (x.x, x.a)
    return (("norm", x.x.shape[0], x.eps, x.rows_per_batch, x.rms, x.weight is not None, x.two_step,
             x.round_before_weight),
            (x.x, x.mult, x.shift, x.weight))


class PlanReplays:
    """Per kind of input: ``run(key, inputs, launch)`` returns ``launch()``'s outputs (the tensors it
    allocated, in a fixed order), replayed where a recording exists and the inputs match it. With
    ``last_only`` the caller uses only the last output: a replay may return ``None`` for the others (their
    memory pooled, ``launcher._compile_replay``)."""

    __slots__ = ("entries",)

    def __init__(self):
        self.entries: dict = {}

    def run(self, key: tuple, inputs: Sequence[torch.Tensor | None],
            launch: Callable[[], Sequence[torch.Tensor]], last_only: bool = False) -> Sequence[torch.Tensor | None]:
        entry = self.entries.get(key)
        if entry is None:
            if len(self.entries) >= _MAX_KINDS:
                self.entries.clear()
            self.entries[key] = _SEEN
            return launch()
        if entry is _SEEN:
            if not replays_enabled():  # switched off for now: record a later call
                return launch()
            with capture_launches() as launches:
                outputs = launch()
            scratch = len(outputs) - 1 if last_only else 0
            self.entries[key] = LaunchReplay.build(launches, inputs, outputs, scratch) or _NONE
            return outputs
        if entry is not _NONE:
            outputs = entry.replay(inputs)
            if outputs is not None:
                return outputs
        return launch()
