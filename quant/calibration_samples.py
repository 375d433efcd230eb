"""Bounded samples of Linear-layer inputs, recorded while a model runs (for calibration).

:func:`record_linear_inputs` hooks the named modules of any ``torch.nn.Module`` for the length of a
``with`` block; each forward call adds its input rows (the last dimension is the feature axis) to
that layer's :class:`InputSampler`. A sampler keeps

* a uniform random sample of at most ``max_rows`` rows over *all* calls (each row gets a seeded
  random key and the rows with the smallest keys are kept, so the sample does not depend on how
  the rows were batched), copied to the CPU in the dtype they arrived in;
* the per-channel abs-max over every row seen (not only the sampled ones): what a static FP8
  ``input_scale`` and SmoothQuant's channel maxima are made of.

Nothing here knows about ComfyUI or any model architecture.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch
from comfy_kitchen.tensor import QuantizedTensor

from .errors import LowBitError

DEFAULT_MAX_ROWS = 256


@dataclass(frozen=True)
class ActivationSample:
    """What calibration knows about one layer's inputs."""

    rows: torch.Tensor  # [m, K] sampled input rows (CPU), m <= max_rows
    channel_amax: torch.Tensor  # [K] float32 abs-max of each input channel over every row seen
    rows_seen: int  # rows the layer processed while recording
    calls: int  # forward calls recorded

    @property
    def amax(self) -> float:
        """Abs-max over every input value seen."""
        return float(self.channel_amax.max()) if self.channel_amax.numel() else 0.0


class InputSampler:
    """Accumulates one layer's :class:`ActivationSample` (see the module docstring)."""

    def __init__(self, max_rows: int = DEFAULT_MAX_ROWS, seed: int = 0):
        if isinstance(max_rows, bool) or not isinstance(max_rows, int) or max_rows < 1:
            raise LowBitError(f"max_rows must be a positive integer (rows kept per layer), got {max_rows!r}")
        self.max_rows = max_rows
        self._generator = torch.Generator().manual_seed(int(seed))
        self._rows: torch.Tensor | None = None
        self._keys: torch.Tensor | None = None
        self._amax: torch.Tensor | None = None
        self.rows_seen = 0
        self.calls = 0

    def add(self, x: torch.Tensor) -> None:
        """Record one forward call's input ``x`` (``[..., K]``, any device)."""
        if isinstance(x, QuantizedTensor):
            x = x.dequantize()
        x = x.detach().reshape(-1, x.shape[-1])
        n = x.shape[0]
        self.calls += 1
        if n == 0:
            return
        amax = x.abs().amax(dim=0).float().cpu()
        self._amax = amax if self._amax is None else torch.maximum(self._amax, amax)
        self.rows_seen += n
        keys = torch.rand(n, generator=self._generator)
        if n > self.max_rows:  # only the smallest keys of this call can survive
            keys, order = torch.topk(keys, self.max_rows, largest=False, sorted=False)
            rows = x[order.to(x.device)]
        else:
            rows = x
        rows = rows.to("cpu", copy=True)
        if self._rows is None:
            self._rows, self._keys = rows, keys
        else:
            self._rows = torch.cat([self._rows, rows.to(self._rows.dtype)])
            self._keys = torch.cat([self._keys, keys])
        if self._rows.shape[0] > self.max_rows:
            self._keys, keep = torch.topk(self._keys, self.max_rows, largest=False, sorted=False)
            self._rows = self._rows[keep]

    def sample(self) -> ActivationSample:
        if self._rows is None:
            raise LowBitError("no input was recorded for this layer: the model never called it while calibrating")
        order = torch.argsort(self._keys)  # a fixed row order, whatever order the merges left
        return ActivationSample(rows=self._rows[order].clone(), channel_amax=self._amax.clone(),
                                rows_seen=self.rows_seen, calls=self.calls)


@contextlib.contextmanager
def record_linear_inputs(modules: Mapping[str, torch.nn.Module], *, max_rows: int = DEFAULT_MAX_ROWS,
                         seed: int = 0) -> Iterator[dict[str, InputSampler]]:
    """Record the inputs of ``modules`` (name -> module) while the block runs.

    Yields ``{name: InputSampler}``; call ``.sample()`` on each afterwards. Layer ``i`` (in the
    order of ``modules``) samples with seed ``seed + i``. The hooks are removed when the block
    ends, also on error.
    """
    samplers = {name: InputSampler(max_rows, seed + i) for i, name in enumerate(modules)}
    handles = []
    try:
        for name, module in modules.items():
            sampler = samplers[name]
            handles.append(module.register_forward_pre_hook(
                lambda _module, args, sampler=sampler: sampler.add(args[0]) if args else None))
        yield samplers
    finally:
        for handle in handles:
            handle.remove()
