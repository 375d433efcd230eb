"""``python -m lowbit bench kernels``: every format's linear vs bf16 ``F.linear`` and vs comfy-kitchen.

One run prints one table. Each row is one (N, K, M); each format column is our linear *including
activation quantization*, run through the measured dispatcher (its decisions are written to
``--cache``), as a speed-up over bf16 ``F.linear`` on the same inputs (> 1 is faster), with
comfy-kitchen's own linear for the same format beside it. Times are medians of
``triton.testing.do_bench`` (CUDA events, L2 flushed before every call). The last lines give the
geometric means the issue's targets are stated in.

``--verify``, ``--overhead``, ``--sweep`` and ``--prewarm`` run the GPU checks, launch-cost and
tuning measurements of ``kernels/gpu_checks.py`` first; a failed check is reported (exit code 1)
but the benchmark still runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from .backend import Backend, capability, force_backend, triton_status
from .dispatch import DispatchKey, Dispatcher, m_bucket, use_dispatcher
from .fp8_gemm import fp8_rowwise_linear
from .int8_gemm import int8_linear
from .reference import FP8
from .w4_linear import w4a4_linear, w4a8_linear

log = logging.getLogger(__name__)

SHAPE_SETS = {
    # (N, K) pairs; the first set is the acceptance set (Flux-dev / Qwen-Image widths)
    "issue": [(3072, 3072), (9216, 3072), (12288, 3072), (3072, 12288), (15360, 3072)],
    "flux": [(3072, 3072), (9216, 3072), (12288, 3072), (3072, 12288), (21504, 3072), (3072, 15360)],
    "wan": [(5120, 5120), (13824, 5120), (5120, 13824)],
    "qwen": [(3072, 3072), (12288, 3072), (3072, 12288)],
    "tiny": [(256, 512), (384, 768)],
    # the per-block modulation linears of Flux and Qwen-Image (6 x 3072 and 3 x 3072 outputs): one row a
    # call at batch 1, so they want --m 1,2
    "mod": [(18432, 3072), (9216, 3072)],
}
FORMATS = ("int8", "int8_convrot", "int8_quarot", "int8_hadanorm", "fp8_rowwise", "w4a4", "w4a4_a8", "w4a8")
DISPATCH_FORMAT = {"int8": "int8", "int8_convrot": "int8+regular256", "int8_quarot": "int8+sylvester128",
                   "int8_hadanorm": "int8+smooth+center+sylvester128", "fp8_rowwise": "fp8_rowwise",
                   "w4a4": "w4a4/a4", "w4a4_a8": "w4a4/a8", "w4a8": "w4a8"}
M_DEFAULT = (256, 1024, 4096, 8192)
FP8_CODEBOOK = (-0.980602, -0.794529, -0.638165, -0.500986, -0.377321, -0.263187, -0.155210, -0.050720,
                0.052541, 0.156985, 0.265284, 0.379533, 0.502636, 0.638953, 0.794876, 0.980671)


# ---- problem set-up -----------------------------------------------------------------------------

class Problem:
    """Random weights of every format for one (N, K) (codes, not zeros), on one device."""

    def __init__(self, n: int, k: int, device: torch.device, seed: int = 0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.n, self.k, self.device = n, k, device
        self.w_bf16 = (torch.randn(n, k, generator=g) / k**0.5).to(device, torch.bfloat16)
        self.bias = (torch.randn(n, generator=g) * 0.1).to(device, torch.bfloat16)
        self.w_int8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).to(device)
        self.w_scale = (torch.rand(n, 1, generator=g) * 1e-3 + 1e-4).to(device)
        self.w_fp8 = (torch.randn(n, k, generator=g) * 40).clamp(-448, 448).to(FP8).to(device)
        self.smooth = (torch.rand(k, generator=g) + 0.5).to(device)
        self.rowsum = torch.randn(n, generator=g).to(device)
        self.packed = torch.randint(-128, 128, (n, k // 2), generator=g, dtype=torch.int8).to(device)
        self.w4_scale = (torch.rand(n, generator=g) * 1e-2 + 1e-3).to(device)
        self.s_rel = (torch.rand(n, k // 16, generator=g) * 60 + 4).to(FP8).to(device)
        self.s_channel = (torch.rand(n, generator=g) * 1e-3 + 1e-4).to(device)
        self.codebook = torch.tensor(FP8_CODEBOOK, device=device)
        self._kitchen_fp8 = None

    def ours(self, fmt: str) -> Callable[[torch.Tensor], torch.Tensor]:
        b = self.bias
        table = {
            "int8": lambda x: int8_linear(x, self.w_int8, self.w_scale, b),
            "int8_convrot": lambda x: int8_linear(x, self.w_int8, self.w_scale, b, rotation="regular", group_size=256),
            "int8_quarot": lambda x: int8_linear(x, self.w_int8, self.w_scale, b, rotation="sylvester", group_size=128),
            "int8_hadanorm": lambda x: int8_linear(x, self.w_int8, self.w_scale, b, rotation="sylvester", group_size=128,
                                                   smooth=self.smooth, center_rowsum=self.rowsum),
            "fp8_rowwise": lambda x: fp8_rowwise_linear(x, self.w_fp8, self.w_scale, b),
            "w4a4": lambda x: w4a4_linear(x, self.packed, self.w4_scale, b, 256, act_bits=4),
            "w4a4_a8": lambda x: w4a4_linear(x, self.packed, self.w4_scale, b, 256, act_bits=8),
            "w4a8": lambda x: w4a8_linear(x, self.packed, self.s_rel, self.s_channel, self.codebook, None, b, 16, 256),
        }
        return table[fmt]

    def kitchen(self, fmt: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """comfy-kitchen's own linear for the format (what ComfyUI runs today), or ``None``."""
        import comfy_kitchen as ck
        from .hadamard import rotate_blocks

        b = self.bias
        if fmt == "int8":
            return lambda x: ck.int8_linear(x, self.w_int8, self.w_scale, b, x.dtype)
        if fmt == "int8_convrot":
            return lambda x: ck.int8_linear(x, self.w_int8, self.w_scale, b, x.dtype, convrot=True, convrot_groupsize=256)
        if fmt == "int8_quarot":  # how the layout ran before: torch rotation, then kitchen's int8_linear
            return lambda x: ck.int8_linear(rotate_blocks(x, "sylvester", 128), self.w_int8, self.w_scale, b, x.dtype)
        if fmt == "int8_hadanorm":
            def hadanorm(x):
                smoothed = x.float() * self.smooth
                mean = smoothed.mean(dim=-1, keepdim=True)
                centred = rotate_blocks(smoothed - mean, "sylvester", 128)
                out = ck.int8_linear(centred, self.w_int8, self.w_scale, None, torch.float32)
                return (out + mean * self.rowsum + b.float()).to(x.dtype)
            return hadanorm
        if fmt == "fp8_rowwise":  # kitchen has no row-wise FP8 linear: its per-tensor FP8 layout
            from comfy_kitchen.tensor import QuantizedTensor
            if self._kitchen_fp8 is None:
                self._kitchen_fp8 = QuantizedTensor.from_float(self.w_bf16, "TensorCoreFP8Layout")
            return lambda x: torch.nn.functional.linear(x, self._kitchen_fp8, b)
        if fmt == "w4a4":
            return lambda x: ck.convrot_w4a4_linear(x, self.packed, self.w4_scale, bias=b, convrot_groupsize=256)
        if fmt == "w4a8":
            return lambda x: ck.w4a8_int8_linear(x, self.packed, self.s_rel, self.s_channel, codebook=self.codebook,
                                                 bias=b, group_size=16, convrot_groupsize=256, out_dtype=x.dtype)
        return None


# ---- timing -------------------------------------------------------------------------------------

def _timer(device: torch.device, rep_ms: int, graph: bool = False):
    """Median µs per call: ``do_bench`` (eager launches, L2 flushed before each call), or with
    ``graph`` the replay of a CUDA graph of the calls (GPU time alone, no launch overhead)."""
    if device.type == "cuda":
        import triton.testing

        def cuda_time(fn):
            if graph:
                return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median") * 1000.0
            return triton.testing.do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median") * 1000.0
        return cuda_time

    def cpu_time(fn):
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[1] * 1e6
    return cpu_time


def _geomean(values: list[float]) -> float:
    values = [v for v in values if v and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


# ---- the benchmark ------------------------------------------------------------------------------

def run_bench(shapes: list[tuple[str, int, int]], ms: list[int], formats: list[str], device: torch.device,
              dispatcher: Dispatcher, rep_ms: int, with_kitchen: bool, graph: bool = False) -> list[dict]:
    timer = _timer(device, rep_ms)
    graph_timer = _timer(device, rep_ms, graph=True) if graph else None
    rows = []
    for set_name, n, k in shapes:
        problem = Problem(n, k, device)
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            bf16 = lambda: torch.nn.functional.linear(x, problem.w_bf16, problem.bias)  # noqa: E731
            row = {"set": set_name, "n": n, "k": k, "m": m, "bf16_us": timer(bf16)}
            if graph_timer:
                row["bf16_graph_us"] = graph_timer(bf16)
            for fmt in formats:
                fn = problem.ours(fmt)
                try:
                    with use_dispatcher(dispatcher):
                        fn(x)  # the dispatcher measures its candidates here on first sight of the shape
                        row[f"{fmt}_us"] = timer(lambda: fn(x))
                        if graph_timer:
                            row[f"{fmt}_graph_us"] = graph_timer(lambda: fn(x))
                    key = DispatchKey(DISPATCH_FORMAT[fmt], capability(device), m_bucket(m), n, k).as_str()
                    row[f"{fmt}_impl"] = dispatcher.decisions.get(key, "default (not measured)")
                except Exception as err:  # report and go on: one broken format must not hide the others
                    row[f"{fmt}_us"] = float("nan")
                    row[f"{fmt}_impl"] = f"error: {type(err).__name__}: {err}"[:200]
                    log.error("bench %s n=%d k=%d m=%d failed: %s", fmt, n, k, m, err)
                kitchen = problem.kitchen(fmt) if with_kitchen else None
                if kitchen is not None:
                    try:
                        row[f"{fmt}_kitchen_us"] = timer(lambda: kitchen(x))
                    except Exception as err:
                        row[f"{fmt}_kitchen_us"] = float("nan")
                        log.warning("kitchen %s n=%d k=%d m=%d failed: %s", fmt, n, k, m, err)
            rows.append(row)
            print(_format_row(row, formats), flush=True)
    return rows


def _ratio(row: dict, key: str) -> float:
    value = row.get(key)
    return row["bf16_us"] / value if value and math.isfinite(value) else float("nan")


def _format_header(formats: list[str]) -> str:
    cols = "".join(f"{fmt:>22}" for fmt in formats)
    return f"{'N':>6} {'K':>6} {'M':>5} {'bf16 us':>8}{cols}\n{'':>28}" + "".join(f"{'ours/kitchen x bf16':>22}" for _ in formats)


def _format_row(row: dict, formats: list[str]) -> str:
    cells = []
    for fmt in formats:
        ours, kit = _ratio(row, f"{fmt}_us"), _ratio(row, f"{fmt}_kitchen_us")
        cells.append(f"{ours:>12.2f}/{kit:<9.2f}" if math.isfinite(kit) else f"{ours:>12.2f}/{'-':<9}")
    return f"{row['n']:>6} {row['k']:>6} {row['m']:>5} {row['bf16_us']:>8.1f}" + "".join(f"{c:>22}" for c in cells)


def summary(rows: list[dict], formats: list[str]) -> list[str]:
    """Per shape set and M: each format's geometric-mean speed-up over bf16 (and its worst shape)."""
    lines = []
    for set_name, m in sorted({(r.get("set", ""), r["m"]) for r in rows}):
        at_m = [r for r in rows if r["m"] == m and r.get("set", "") == set_name]
        parts = []
        for fmt in formats:
            ours = _geomean([_ratio(r, f"{fmt}_us") for r in at_m])
            worst = min((_ratio(r, f"{fmt}_us") for r in at_m), default=float("nan"))
            kit = _geomean([_ratio(r, f"{fmt}_kitchen_us") for r in at_m])
            graph = _geomean([r["bf16_graph_us"] / r[f"{fmt}_graph_us"] for r in at_m
                              if r.get(f"{fmt}_graph_us") and r.get("bf16_graph_us")])
            parts.append(f"{fmt} {ours:.2f}x (min {worst:.2f}, kitchen {kit:.2f}x"
                         + (f", graph {graph:.2f}x)" if math.isfinite(graph) else ")"))
        lines.append(f"[{set_name}] M={m} geomean vs bf16: " + "; ".join(parts))
    return lines


# ---- command line ------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lowbit bench kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="issue", help=f"comma-separated shape sets: {', '.join(SHAPE_SETS)} (default issue)")
    p.add_argument("--m", default=",".join(map(str, M_DEFAULT)), help="comma-separated token counts M")
    p.add_argument("--formats", default=",".join(FORMATS), help=f"comma-separated subset of {', '.join(FORMATS)}")
    p.add_argument("--cache", default=None, help="dispatcher decision cache (JSON) to read and update")
    p.add_argument("--json", default=None, help="write every measurement to this JSON file")
    p.add_argument("--rep-ms", type=int, default=60, help="milliseconds of timed repetitions per measurement")
    p.add_argument("--no-kitchen", action="store_true", help="skip comfy-kitchen's linears")
    p.add_argument("--graph", action="store_true", help="also time ours and bf16 as CUDA-graph replays (GPU time only)")
    p.add_argument("--verify", action="store_true", help="check every Triton kernel against its reference first")
    p.add_argument("--sweep", type=int, default=0, metavar="M",
                   help="also time the pieces (act-quant variants, every GEMM config alone, cuBLAS) at this M")
    p.add_argument("--overhead", action="store_true", help="measure the CPU cost of launching each linear first")
    p.add_argument("--prewarm", type=int, default=0, metavar="P",
                   help="compile the benchmark's kernels in P worker processes first (saves wall time)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p


def _environment(device: torch.device) -> dict[str, str]:
    """What a measurement ran on, for the table's first line and the JSON file (numbers of two cards differ)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        capability = "".join(map(str, torch.cuda.get_device_capability(device)))
    else:
        name, capability = str(device), ""
    return {"device": name, "capability": capability, "torch": torch.__version__, "triton": triton_status().reason}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    device = torch.device(args.device)
    try:
        named = [(name.strip(), n, k) for name in args.shapes.split(",") for n, k in SHAPE_SETS[name.strip()]]
        shapes = list(dict.fromkeys((n, k) for _, n, k in named))
        ms = [int(v) for v in args.m.split(",")]
        formats = [f.strip() for f in args.formats.split(",")]
        unknown = [f for f in formats if f not in FORMATS]
        if unknown:
            raise KeyError(unknown[0])
    except (KeyError, ValueError) as err:
        print(f"lowbit bench kernels: bad argument ({err}); shape sets: {', '.join(SHAPE_SETS)}; "
              f"formats: {', '.join(FORMATS)}", file=sys.stderr)
        return 2
    environment = _environment(device)
    if device.type == "cuda":
        print(f"device {environment['device']} sm_{environment['capability']}, torch {environment['torch']}, "
              f"{environment['triton']}", flush=True)
    from .gpu_checks import launch_overhead, prewarm, sweep, verify

    failures = []
    if args.prewarm:
        prewarm(formats, shapes, device, args.prewarm)
    if args.verify:
        try:
            failures = verify(device)
        except Exception:  # a broken check must not hide the benchmark: report it and go on
            import traceback
            traceback.print_exc()
            failures = []
        if failures:
            print(f"{len(failures)} kernel check(s) failed (benchmarking anyway):\n  " + "\n  ".join(failures), flush=True)
    overhead_lines = launch_overhead(device) if args.overhead and device.type == "cuda" else []
    sweep_shapes = [shape for shape in shapes if shape in SHAPE_SETS["issue"]] or shapes
    sweep_lines = sweep(device, sweep_shapes, args.sweep, args.rep_ms) if args.sweep else []
    dispatcher = Dispatcher(cache_path=args.cache)
    print(_format_header(formats), flush=True)
    with force_backend(Backend.AUTO):
        rows = run_bench(named, ms, formats, device, dispatcher, args.rep_ms, not args.no_kitchen,
                         args.graph and device.type == "cuda")
    lines = summary(rows, formats)
    for line in lines:
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": environment,
                                               "verify": {"ran": args.verify, "failures": failures},
                                               "rows": rows, "summary": lines, "sweep": sweep_lines,
                                               "overhead": overhead_lines,
                                               "decisions": dispatcher.decisions,
                                               "timings_us": dispatcher.timings_us,
                                               "gpu_timings_us": dispatcher.gpu_timings_us,
                                               "failures": dispatcher.failures},
                                              indent=1, default=str))
    return 1 if args.verify and failures else 0


if __name__ == "__main__":
    sys.exit(main())
