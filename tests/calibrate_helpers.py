"""A small model with planted sensitive layers, for the calibration tests (no ComfyUI).

``PlantedStack``: ``depth`` residual blocks ``h <- h + 0.5 * lin(layer_norm(h) * gains)``; the
blocks in ``planted`` get a few input channels multiplied by ``gain`` (and the matching weight
columns divided by it, so the float function is an ordinary block): heavy outlier input channels
of the kind trained diffusion transformers have, which 4-bit activation quantization handles much
worse than 8-bit. Layers are named ``blocks.<i>.lin``, so the structural ``int4_mixed`` ranking
(edge blocks first) gives INT8 to the first and last blocks, not to the planted middle ones.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from lowbit.quant.formats import get_format

WIDTH = 512  # a multiple of the 256-wide rotations of w4a4 / int8_convrot
DEPTH = 8
PLANTED = (3, 4)
OUTLIER_CHANNELS = 2
GAIN = 220.0


class Block(nn.Module):
    def __init__(self, generator: torch.Generator, gains: torch.Tensor):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(WIDTH, WIDTH, generator=generator) / WIDTH**0.5 / gains[None, :])
            self.lin.bias.copy_(torch.randn(WIDTH, generator=generator) * 0.02)
        self.register_buffer("gains", gains)

    def forward(self, h):
        return h + 0.5 * self.lin(nn.functional.layer_norm(h, (WIDTH,)) * self.gains)


class PlantedStack(nn.Module):
    def __init__(self, seed: int = 0, planted=PLANTED, gain: float = GAIN):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        blocks = []
        for i in range(DEPTH):
            gains = torch.ones(WIDTH)
            if i in planted:
                gains[torch.randperm(WIDTH, generator=generator)[:OUTLIER_CHANNELS]] = gain
            blocks.append(Block(generator, gains))
        self.blocks = nn.ModuleList(blocks)

    def forward(self, h):
        for block in self.blocks:
            h = block(h)
        return h

    def linears(self) -> dict[str, nn.Linear]:
        return {f"blocks.{i}.lin": block.lin for i, block in enumerate(self.blocks)}

    def shapes(self) -> dict[str, tuple[int, int]]:
        return {f"{name}.weight": tuple(lin.weight.shape) for name, lin in self.linears().items()}


class CodecLinear(nn.Module):
    """A Linear run through a format codec, as LowBit runs it (compute dtype bf16)."""

    def __init__(self, linear: nn.Linear, fmt: str, input_scale: float | None = None):
        super().__init__()
        self.codec = get_format(fmt)
        self.weight_q = self.codec.quantize(linear.weight.detach(), compute_dtype=torch.bfloat16)
        self.bias = linear.bias.detach()
        self.input_scale = None if input_scale is None else torch.tensor(input_scale, dtype=torch.float32)

    def forward(self, x):
        return self.codec.linear(x.to(torch.bfloat16), self.weight_q, None, self.input_scale).float() + self.bias


def quantized_copy(model: PlantedStack, formats: dict[str, str], input_scales: dict[str, float] | None = None):
    """A copy of ``model`` whose named Linears run in the given formats ("float" keeps one as is)."""
    out = copy.deepcopy(model)
    for name, fmt in formats.items():
        if fmt == "float":
            continue
        parent, attr = name.rsplit(".", 1)
        block = out.get_submodule(parent)
        setattr(block, attr, CodecLinear(getattr(block, attr), fmt, (input_scales or {}).get(name)))
    return out


def output_error(reference_model, model, x) -> float:
    with torch.no_grad():
        reference = reference_model(x)
        return float((model(x) - reference).norm() / reference.norm())


def output_probe(model: nn.Module, inputs: list[torch.Tensor]):
    """``calibrate``'s ``output_error``: layer name -> probe measuring the model's relative output error on
    ``inputs`` with that layer computing the given replacement product (plus its own bias)."""
    with torch.no_grad():
        references = [model(x) for x in inputs]
    modules = dict(model.named_modules())

    def for_layer(name):
        module = modules[name]

        def probe(replacement) -> float:
            handle = module.register_forward_hook(lambda m, args, out: replacement(args[0]) + m.bias)
            try:
                with torch.no_grad():
                    outputs = [model(x) for x in inputs]
            finally:
                handle.remove()
            noise = sum(float((o - r).double().pow(2).sum()) for o, r in zip(outputs, references))
            return (noise / sum(float(r.double().pow(2).sum()) for r in references)) ** 0.5

        return probe

    return for_layer
