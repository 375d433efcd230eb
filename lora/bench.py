"""GPU measurements of the LoRA modes (issue Show 4), on Flux-12B-shaped layers with random weights.

* step-time overhead: one Flux double-block stream plus one single block, run as quantized linears
  (``codec.linear``), without LoRA, with Dynamic banks of 1 and 4 LoRAs (rank 32), and with the 4
  LoRAs merged stochastically (same layout, so the expected overhead is zero);
* merge time: a Stochastic stack of 4 rank-32 LoRAs merged into every linear layer of a Flux-12B-sized
  model (19 double + 38 single blocks), layer by layer as the node does.

Run: ``python -m lowbit.lora.bench [--format int8_convrot] [--tokens 4096] [--blocks 19 38]``; prints
one JSON object. Small ``--hidden`` values make it a quick CPU smoke run.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import torch

from ..quant.formats import get_format
from .delta import LowRankDelta
from .dynamic import LoraBank, apply
from .stochastic import layer_seed, merge_deltas


def flux_block_shapes(hidden: int = 3072, mlp_ratio: int = 4) -> dict[str, list[tuple[int, int]]]:
    """``[out, in]`` of the linears of one double-block stream and of one single block."""
    mlp = hidden * mlp_ratio
    return {
        "double_stream": [(3 * hidden, hidden), (hidden, hidden), (mlp, hidden), (hidden, mlp), (6 * hidden, hidden)],
        "single": [(3 * hidden + mlp, hidden), (hidden, hidden + mlp), (3 * hidden, hidden)],
    }


def _loras(shape, count: int, rank: int, device, seed: int) -> list[LowRankDelta]:
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n, k = shape
    return [LowRankDelta(down=(torch.randn(rank, k, generator=gen) / k**0.5).to(device),
                         up=(torch.randn(n, rank, generator=gen) * 0.01).to(device), alpha=float(rank),
                         source=f"lora{i}") for i in range(count)]


def _time(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    """Median seconds per call after warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def step_overhead(fmt: str, hidden: int, tokens: int, rank: int, device, dtype, iters: int) -> dict:
    codec = get_format(fmt)
    shapes = [s for group in flux_block_shapes(hidden).values() for s in group]
    gen = torch.Generator(device="cpu").manual_seed(0)
    layers = []
    for i, shape in enumerate(shapes):
        weight = (torch.randn(shape, generator=gen) / shape[1] ** 0.5).to(device, dtype)
        qt = codec.quantize(weight, compute_dtype=dtype)
        loras = _loras(shape, 4, rank, device, seed=i)
        layers.append({
            "shape": shape, "base": qt,
            "bank1": LoraBank.build([("a", loras[0])], shape, dtype=dtype, device=device),
            "bank4": LoraBank.build([(d.source, d) for d in loras], shape, dtype=dtype, device=device),
            "merged": merge_deltas(codec, qt, loras, seed=layer_seed(1, str(i))).weight,
        })
    inputs = {k: torch.randn(tokens, k, device=device, dtype=dtype) for k in {s[1] for s in shapes}}

    def run(weight_key: str, bank_key: str | None):
        def step():
            for layer in layers:
                x = inputs[layer["shape"][1]]
                y = codec.linear(x, layer[weight_key])
                if bank_key is not None:
                    y = y + apply(x, layer[bank_key])
            return y
        return step

    with torch.no_grad():
        base = _time(run("base", None), device, iters)
        result = {"format": fmt, "tokens": tokens, "rank": rank, "base_ms": base * 1e3}
        for name, step in (("dynamic_1", run("base", "bank1")), ("dynamic_4", run("base", "bank4")),
                           ("stochastic_4", run("merged", None))):
            seconds = _time(step, device, iters)
            result[f"{name}_ms"] = seconds * 1e3
            result[f"{name}_overhead_pct"] = 100.0 * (seconds / base - 1.0)
    return result


def merge_time(fmt: str, hidden: int, blocks: tuple[int, int], rank: int, device, dtype) -> dict:
    """Seconds to merge a stack of 4 LoRAs into every linear of a Flux-shaped model (weights made first)."""
    codec = get_format(fmt)
    shapes = flux_block_shapes(hidden)
    layer_shapes = [s for _ in range(blocks[0]) for _ in range(2) for s in shapes["double_stream"]]
    layer_shapes += [s for _ in range(blocks[1]) for s in shapes["single"]]
    gen = torch.Generator(device="cpu").manual_seed(0)
    model, stacks = [], []
    for i, shape in enumerate(layer_shapes):  # random weights, quantized on the device (not timed)
        weight = (torch.randn(shape, generator=gen, dtype=torch.float32) / shape[1] ** 0.5).to(device, dtype)
        model.append(codec.quantize(weight, compute_dtype=dtype))
        stacks.append(_loras(shape, 4, rank, device, seed=i))
        del weight
    params = sum(n * k for n, k in layer_shapes)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    with torch.no_grad():
        for i, (qt, loras) in enumerate(zip(model, stacks)):
            model[i] = merge_deltas(codec, qt, loras, seed=layer_seed(1, str(i))).weight
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"format": fmt, "layers": len(layer_shapes), "params_billion": params / 1e9,
            "merge_seconds": time.perf_counter() - start}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="int8_convrot")
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--blocks", type=int, nargs=2, default=(19, 38), metavar=("DOUBLE", "SINGLE"))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--skip-merge", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    out = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "step": step_overhead(args.format, args.hidden, args.tokens, args.rank, device, dtype, args.iters)}
    if not args.skip_merge:
        out["merge"] = merge_time(args.format, args.hidden, tuple(args.blocks), args.rank, device, dtype)
    return out


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
