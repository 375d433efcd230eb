"""Programmatic dependent launch on and off, per format linear, in one process (not a pytest file).

For each format, (N, K) of the issue's shapes and M: the dispatcher settles its choice once, then the
same kernels are timed with ``LOWBIT_PDL`` off and on, alternating ``--rounds`` times, as CUDA-graph
replays (GPU time) and with ``do_bench`` (eager launches, L2 flushed). bf16 ``F.linear`` is timed in
the same rounds. Each on/off pair is also checked to give the same bits.

Usage: ``python tests/gpu/bench_pdl.py --m 256 1024 4096 --formats int8 int8_convrot fp8_rowwise --out pdl.json``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch


def _set_pdl(on: bool) -> None:
    from lowbit.kernels import pdl

    os.environ["LOWBIT_PDL"] = "1" if on else "0"
    pdl._device_pdl.cache_clear()


def _geomean(values):
    values = [v for v in values if v and math.isfinite(v)]
    return math.exp(sum(map(math.log, values)) / len(values)) if values else float("nan")


def run(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--formats", nargs="+", default=["int8", "int8_convrot", "int8_hadanorm", "fp8_rowwise", "w4a4_a8"])
    p.add_argument("--shapes", default="issue")
    p.add_argument("--rounds", type=int, default=3, help="off/on alternations (median reported)")
    p.add_argument("--rep-ms", type=int, default=25)
    p.add_argument("--budget-s", type=float, default=400.0, help="no new shape after this many seconds")
    p.add_argument("--out", default="bench_pdl.json")
    a = p.parse_args(argv)
    import triton.testing

    from lowbit.kernels.bench import SHAPE_SETS, Problem
    from lowbit.kernels.dispatch import Dispatcher, use_dispatcher
    from lowbit.kernels.pdl import pdl_problem

    device = torch.device("cuda")
    report = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "triton": triton.__version__, "pdl_problem": pdl_problem(torch.cuda.get_device_capability(device)),
              "rows": []}
    dispatcher = Dispatcher()
    start = time.perf_counter()
    shapes = [s for name in a.shapes.split(",") for s in SHAPE_SETS[name]]

    def graph_us(fn):
        return triton.testing.do_bench_cudagraph(fn, rep=a.rep_ms, return_mode="median") * 1000.0

    def eager_us(fn):
        return triton.testing.do_bench(fn, warmup=5, rep=a.rep_ms, return_mode="median") * 1000.0

    for n, k in ((s[-2], s[-1]) for s in shapes):
        if time.perf_counter() - start > a.budget_s:
            break
        problem = Problem(n, k, device)
        for m in a.m:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            bf16 = lambda: torch.nn.functional.linear(x, problem.w_bf16, problem.bias)  # noqa: E731
            row = {"n": n, "k": k, "m": m, "bf16_graph_us": [], "bf16_eager_us": []}
            fns = {fmt: problem.ours(fmt) for fmt in a.formats}
            with use_dispatcher(dispatcher):
                for fmt, fn in fns.items():
                    _set_pdl(True)
                    fn(x)  # settle the dispatcher's choice (and compile with PDL)
                    on = fn(x)
                    _set_pdl(False)
                    off = fn(x)
                    torch.cuda.synchronize()
                    row[f"{fmt}_same_bits"] = bool(torch.equal(on, off))
                    row.update({f"{fmt}_{mode}_{pdl}_us": [] for mode in ("graph", "eager") for pdl in ("off", "on")})
                for _ in range(a.rounds):
                    row["bf16_graph_us"].append(graph_us(bf16))
                    row["bf16_eager_us"].append(eager_us(bf16))
                    for fmt, fn in fns.items():
                        for pdl in ("off", "on"):
                            _set_pdl(pdl == "on")
                            row[f"{fmt}_graph_{pdl}_us"].append(graph_us(lambda: fn(x)))
                            row[f"{fmt}_eager_{pdl}_us"].append(eager_us(lambda: fn(x)))
            for key in [key for key in row if key.endswith("_us")]:
                row[key] = statistics.median(row[key])
            report["rows"].append(row)
            print(json.dumps({key: (round(v, 2) if isinstance(v, float) else v) for key, v in row.items()}), flush=True)
        Path(a.out).write_text(json.dumps(report, indent=2))
    summary = {}
    for m in a.m:
        rows = [r for r in report["rows"] if r["m"] == m]
        for fmt in a.formats:
            for mode in ("graph", "eager"):
                for pdl in ("off", "on"):
                    summary[f"m{m} {fmt} {mode} pdl {pdl}"] = round(_geomean(
                        [r[f"bf16_{mode}_us"] / r[f"{fmt}_{mode}_{pdl}_us"] for r in rows]), 3)
    report["geomean_vs_bf16"] = summary
    report["wall_s"] = time.perf_counter() - start
    Path(a.out).write_text(json.dumps(report, indent=2))
    for key, value in summary.items():
        print(f"{key}: {value}")
    return report


if __name__ == "__main__":
    run()
