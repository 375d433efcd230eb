"""Where a settled quantized linear's CPU time goes, launch by launch (not a pytest file).

Usage (from the repository root, on a CUDA GPU, about a minute)::

  python tests/gpu/bench_launch_host.py --out host.json

For each format, at M = 16 (GPU work far below the CPU's, so the times below are CPU time) and
N = K = 3072, after the dispatcher has settled and the launch replay is recorded:

* ``call_us``: one call of the linear (the settled plan's replay), against ``bf16_us``, one
  ``F.linear`` of the same shape;
* per Triton launch of the call (taken with replays off): ``run_us``, the compiled kernel's launcher
  with the arguments as LowBit passes them (tensors and host TMA descriptors); ``run_int_ptrs_us``,
  the same with each tensor passed as its address (Triton's C launcher then skips the tensor's
  ``data_ptr`` method and its ``cuPointerGetAttribute`` check); ``descriptors`` how many arguments
  are TMA descriptors, which Triton's launcher encodes again on every launch;
* ``empty_us``: one ``torch.empty`` of the output's size.

``raw_pointers`` records ``LOWBIT_REPLAY_RAW_POINTERS`` (``0``: the replays pass tensors, not addresses);
``call_us_by_raw_pointers`` times the call with the replays passing tensors, passing addresses, passing
addresses with their scratch tensors carved out of one allocation, and that with Triton's C launch function
called directly (descriptors encoded once per address), alternately, ``--rounds`` times each in
the same process (the medians, every round, and whether each variant gave the ordinary launches' bits).

Every time is the median of ``--repeats`` rounds of ``--calls`` back-to-back calls, with a device
synchronisation between rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch


def host_us(fn, calls: int, repeats: int) -> float:
    """Median over ``repeats`` of the mean CPU time of ``calls`` consecutive calls of ``fn`` (µs)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return round(statistics.median(rounds), 2)


def launch_rows(fn, x, calls: int, repeats: int) -> list[dict]:
    from lowbit.kernels import launcher as L

    with L.no_replays(), L.capture_launches() as launches:
        fn(x)
    rows = []
    stream = L._raw_stream(torch.cuda.current_device())
    for tl, key, grid, args, constexprs in launches:
        entry = tl._compiled.get(key) if key is not None else None
        row = {"kernel": tl._name(), "grid": list(grid),
               "tensors": sum(isinstance(a, torch.Tensor) for a in args),
               "descriptors": sum(isinstance(getattr(a, "base", None), torch.Tensor) for a in args)}
        if entry is None:
            row["note"] = "not compiled through the fast path"
            rows.append(row)
            continue
        run, function, packed = entry
        g = tuple(grid) + (1,) * (3 - len(grid))
        tail = tuple(constexprs.values())
        ints = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
        row["run_us"] = host_us(lambda: run(*g, stream, function, packed, None, None, None, *args, *tail),
                                calls, repeats)
        row["run_int_ptrs_us"] = host_us(lambda: run(*g, stream, function, packed, None, None, None, *ints, *tail),
                                         calls, repeats)
        rows.append(row)
    return rows


VARIANTS = {"tensors": (False, False, False), "addresses": (True, False, False),
            "addresses_pooled": (True, True, False), "addresses_pooled_direct": (True, True, True)}


def interleaved_raw_pointers(fn, calls: int, repeats: int, rounds: int) -> dict:
    """``call_us`` with the replays passing tensors, passing addresses, passing addresses with their scratch
    pooled, and also calling Triton's C launch function directly (``launcher._compile_replay``'s ``raw_pointers``,
    ``pool`` and ``direct``), alternately, ``rounds`` times each:
    every replay is generated again for each variant. Also whether each variant's output is bit for bit the
    ordinary launches' (``launcher.no_replays``)."""
    import gc

    from lowbit.kernels import launcher

    replays = [o for o in gc.get_objects() if isinstance(o, launcher.LaunchReplay)]
    with launcher.no_replays():
        ordinary = fn()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    same: dict[str, bool] = {}
    try:
        for _ in range(rounds):
            for name, (raw, pool, direct) in VARIANTS.items():
                for r in replays:
                    r.fn = launcher._compile_replay(r, raw_pointers=raw, pool=pool, direct=direct)
                times[name].append(host_us(fn, calls, repeats))
                same[name] = same.get(name, True) and torch.equal(fn(), ordinary)
    finally:
        for r in replays:
            r.fn = None
    out = {name: round(statistics.median(v), 2) for name, v in times.items()}
    out.update({f"{name}_all": v for name, v in times.items()})
    out["bits_equal_to_ordinary"] = same
    out["direct_launches_recognized"] = [launcher._direct_launch(step[0], step[6]) is not None
                                         for r in replays for step in r.steps]
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", nargs="+", default=["int8", "int8_convrot", "fp8_rowwise", "w4a4", "w4a8"])
    p.add_argument("--m", type=int, default=16)
    p.add_argument("--n", type=int, default=3072)
    p.add_argument("--k", type=int, default=3072)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--rounds", type=int, default=5, help="alternations of the raw-pointer A/B")
    p.add_argument("--cache", default="", help="the dispatcher's decision file (reused by a second run)")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_launch_host.py measures CUDA launches: it needs a CUDA GPU (none here)", file=sys.stderr)
        sys.exit(2)
    import triton

    from lowbit.kernels.bench import Problem
    from lowbit.kernels.dispatch import Dispatcher, use_dispatcher

    device = torch.device("cuda")
    problem = Problem(a.n, a.k, device)
    x = torch.randn(a.m, a.k, device=device, dtype=torch.bfloat16)
    report = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "raw_pointers": os.environ.get("LOWBIT_REPLAY_RAW_POINTERS", "1"),
              "triton": triton.__version__, "m": a.m, "n": a.n, "k": a.k,
              "bf16_us": host_us(lambda: torch.nn.functional.linear(x, problem.w_bf16, problem.bias), a.calls,
                                 a.repeats),
              "empty_us": host_us(lambda: torch.empty((a.m, a.n), dtype=torch.bfloat16, device=device), a.calls,
                                  a.repeats),
              "formats": {}}
    dispatcher = Dispatcher(cache_path=a.cache or None)
    for fmt in a.formats:
        fn = problem.ours(fmt)
        with use_dispatcher(dispatcher):
            for _ in range(4):  # settles, then the plan's first call, its recording and a replay
                fn(x)
            row = {"call_us": host_us(lambda: fn(x), a.calls, a.repeats),
                   "launches": launch_rows(fn, x, a.calls, a.repeats)}
            row["call_us_by_raw_pointers"] = interleaved_raw_pointers(lambda: fn(x), a.calls, a.repeats, a.rounds)
        row["decision"] = {k: v for k, v in dispatcher.decisions.items() if f"|n{a.n}|k{a.k}" in k}
        report["formats"][fmt] = row
        print(fmt, json.dumps(row), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "formats"}))
    return report


if __name__ == "__main__":
    main()
