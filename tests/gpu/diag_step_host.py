"""Where an eager Flux step's CPU time goes, by module class (not a pytest file).

Usage (from the repository root, on a CUDA GPU, about three minutes for three modes)::

  python tests/gpu/diag_step_host.py --modes bf16 int8_convrot int8_convrot+unfused --out host.json

The model and input are ``bench_flux_step.py``'s (Flux.1-dev-sized, random weights, the real
ComfyUI Flux class, 1024x1024, batch 1), with the Attention Backend node's backend. Per mode:

* ``host_ms``: the CPU time of one step (from the call until the model returns, without waiting
  for the GPU), the median of ``--steps`` warm steps; ``gpu_ms``: the same steps' GPU time (CUDA
  events, each step synchronised). Where ``host_ms`` is the larger, the step is bound by its CPU.
* ``self_ms``: with a forward pre- and post-hook on every module, each module class's *self* time
  per step (its forward's time minus its child modules'), in one more step. The hooks cost CPU time
  themselves (a few µs a module call), so read the differences between modes, not the totals.

``+unfused`` quantizes with ``fuse_inputs=False`` (norms and GELUs computed by torch, not inside the
activation quantization), as in ``bench_flux_step.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_flux_step as bench  # noqa: E402


class SelfTimes:
    """Global forward hooks that add each module call's self time to its class name."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.stack: list[list] = []
        self.handles = []

    def __enter__(self):
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        def pre(module, args):
            self.stack.append([type(module).__name__, time.perf_counter(), 0.0])

        def post(module, args, out):
            name, start, children = self.stack.pop()
            elapsed = time.perf_counter() - start
            self.totals[name] += elapsed - children
            self.calls[name] += 1
            if self.stack:
                self.stack[-1][2] += elapsed

        self.handles = [register_module_forward_pre_hook(pre), register_module_forward_hook(post)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def measure(dm, args, options, device, steps: int) -> dict:
    x, t, ctx, y, g = args
    opts = {"transformer_options": dict(options)} if options else {}

    def step():
        return dm(x, t, ctx, y=y, guidance=g, **opts)

    with torch.inference_mode():
        for _ in range(3):
            step()
        torch.cuda.synchronize(device)
        host, gpu = [], []
        for _ in range(steps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            step()
            host.append((time.perf_counter() - t0) * 1e3)
            end.record()
            end.synchronize()
            gpu.append(start.elapsed_time(end))
        with SelfTimes() as st:
            t0 = time.perf_counter()
            step()
            hooked = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize(device)
    top = sorted(st.totals.items(), key=lambda kv: -kv[1])
    return {"host_ms": round(statistics.median(host), 2), "gpu_ms": round(statistics.median(gpu), 2),
            "host_ms_all": [round(v, 2) for v in host], "hooked_step_ms": round(hooked, 2),
            "self_ms": {name: {"ms": round(v * 1e3, 2), "calls": st.calls[name]} for name, v in top}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(bench.SIZES), default="dev")
    p.add_argument("--modes", nargs="+", default=["bf16", "int8_convrot", "int8_convrot+unfused"])
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("diag_step_host.py times CUDA steps: it needs a CUDA GPU (none here)", file=sys.stderr)
        sys.exit(2)
    device = torch.device("cuda")
    bench.import_comfy(device.type)
    from lowbit.nodes.model_quant import quantize_model
    from lowbit.quant.policy import Policy

    base = bench.build_flux(a.size, device)
    args = bench.inputs(a.size, device)
    options = bench.attention_options(a.attention_backend)
    report = {"size": a.size, "device": torch.cuda.get_device_name(device), "torch": torch.__version__, "modes": {}}
    for mode in a.modes:
        fmt, flags = bench.parse_mode(mode)
        if fmt == "bf16":
            row = measure(base.model.diffusion_model, args, options, device, a.steps)
        else:
            q = quantize_model(base, Policy(mode=fmt), fuse_inputs="unfused" not in flags)
            row = measure(q.model.diffusion_model, args, options, device, a.steps)
            del q
            bench.free(device)
        report["modes"][mode] = row
        print(mode, json.dumps({k: v for k, v in row.items() if k != "self_ms"}),
              json.dumps(dict(list(row["self_ms"].items())[:12])), flush=True)
        if a.out:
            Path(a.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
