"""Kernel Tuner (LowBit) on the Flux model of ``bench_flux_step`` (not a pytest file).

Builds the Flux-dev-sized model (random weights, the real ComfyUI Flux class), quantizes it to each
``--modes`` format and runs the Kernel Tuner node's ``execute`` at ``--tokens`` (1024²: 4096 image
tokens, 512 text tokens, 4608 in the single blocks), with a fresh dispatcher whose cache is
``--cache``. Writes each format's markdown table to ``--out`` (JSON) and prints them.

Usage: ``python tests/gpu/tune_flux.py --modes fp8_rowwise int8_convrot --out tune.json``
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

import bench_flux_step as bfs


def run(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(bfs.SIZES), default="dev")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--modes", nargs="+", default=["fp8_rowwise", "int8_convrot"])
    p.add_argument("--tokens", default="512, 4096, 4608")
    p.add_argument("--cache", default="kernel_dispatch.json")
    p.add_argument("--out", default="tune_flux.json")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    device = torch.device(a.device)
    bfs.import_comfy(device.type)
    from lowbit.kernels.dispatch import Dispatcher, use_dispatcher
    from lowbit.nodes.kernel_tuner import LowBitKernelTuner
    from lowbit.nodes.model_quant import quantize_model
    from lowbit.quant.policy import Policy

    base = bfs.build_flux(a.size, device)
    report = {"size": a.size, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "tokens": a.tokens, "modes": {}}
    for mode in a.modes:
        model = quantize_model(base, Policy(mode=mode))
        start = time.perf_counter()
        with use_dispatcher(Dispatcher(cache_path=a.cache)):
            table = LowBitKernelTuner.execute(model=model, tokens=a.tokens, remeasure=False).result[1]
        report["modes"][mode] = {"seconds": round(time.perf_counter() - start, 1), "table": table}
        print(f"## {mode} ({report['modes'][mode]['seconds']} s)\n{table}\n", flush=True)
        del model
        Path(a.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    run()
