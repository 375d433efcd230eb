"""``python -m lowbit bench kernels``: every format's linear vs bf16 ``F.linear`` and vs comfy-kitchen.

One run prints one table. Each row is one (N, K, M); each format column is our linear *including
activation quantization*, run through the measured dispatcher (its decisions are written to
``--cache``), as a speed-up over bf16 ``F.linear`` on the same inputs (> 1 is faster), with
comfy-kitchen's own linear for the same format beside it. Times are medians of
``triton.testing.do_bench`` (CUDA events, L2 flushed before every call). The last lines give the
geometric means the issue's targets are stated in.

``--verify`` first checks every Triton kernel against its eager reference on the GPU (odd shapes,
poisoned outputs) and stops with exit code 1 if one disagrees.
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
from .reference import FP8, w4a8_level_table
from .w4_linear import w4a4_linear, w4a8_linear

log = logging.getLogger(__name__)

SHAPE_SETS = {
    # (N, K) pairs; the first set is the acceptance set (Flux-dev / Qwen-Image widths)
    "issue": [(3072, 3072), (9216, 3072), (12288, 3072), (3072, 12288), (15360, 3072)],
    "flux": [(3072, 3072), (9216, 3072), (12288, 3072), (3072, 12288), (21504, 3072), (3072, 15360)],
    "wan": [(5120, 5120), (13824, 5120), (5120, 13824)],
    "qwen": [(3072, 3072), (12288, 3072), (3072, 12288)],
    "tiny": [(256, 512), (384, 768)],
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


# ---- parallel pre-compilation ------------------------------------------------------------------

def _warm_job(job: tuple[str, int, int, str]) -> str:
    """Compile every candidate of one (format, M bucket, K) in this worker process (fills Triton's
    on-disk cache, so the timed process only loads kernels)."""
    fmt, m, k, device_name = job
    device = torch.device(device_name)
    problem = Problem(256, k, device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    start = time.perf_counter()
    try:
        with use_dispatcher(Dispatcher(warmup=1, repeats=1)):
            problem.ours(fmt)(x)
    except Exception as err:
        return f"warm {fmt} m={m} k={k} failed: {type(err).__name__}: {err}"[:300]
    return f"warm {fmt} m={m} k={k} {time.perf_counter() - start:.1f}s"


def prewarm(formats: list[str], shapes: list[tuple[int, int]], device: torch.device, workers: int) -> None:
    """Compile the kernels the benchmark will use in ``workers`` processes at once."""
    import concurrent.futures
    import multiprocessing

    jobs = [(fmt, m, k, str(device)) for k in sorted({k for _, k in shapes}) for m in (256, 4096) for fmt in formats]
    start = time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        for line in pool.map(_warm_job, jobs):
            print(line, flush=True)
    print(f"pre-compiled {len(jobs)} jobs in {time.perf_counter() - start:.0f}s", flush=True)


# ---- CPU launch overhead ------------------------------------------------------------------------

def launch_overhead(device: torch.device, n: int = 3072, k: int = 3072, m: int = 256, calls: int = 300) -> list[str]:
    """CPU time to enqueue one call (µs, no synchronization inside the loop) of bf16 ``F.linear``, of
    each format's linear and of its pieces, plus a profile of the INT8 linear's Python."""
    import cProfile
    import io
    import pstats

    from . import ops
    from .gemm_config import default_config

    problem = Problem(n, k, device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    dispatcher = Dispatcher()
    q, scale, _ = ops.act_quant(x, torch.int8, 127.0, "none", 0, None, False, 0, "triton")
    cfg = default_config(m).name
    pieces = {
        "bf16 F.linear": lambda: torch.nn.functional.linear(x, problem.w_bf16, problem.bias),
        "act_quant launch": lambda: ops.act_quant(x, torch.int8, 127.0, "none", 0, None, False, 0, "triton"),
        "w8a8 gemm launch": lambda: ops.w8a8_mm(q, problem.w_int8, scale, problem.w_scale.reshape(-1), problem.bias,
                                                None, None, torch.bfloat16, cfg),
        "torch.empty x3": lambda: (torch.empty(m, k, device=device), torch.empty(m, 1, device=device),
                                   torch.empty(m, n, device=device)),
    }
    for fmt in FORMATS:
        pieces[f"{fmt} linear"] = (lambda fn: lambda: fn(x))(problem.ours(fmt))
    kitchen = problem.kitchen("int8")
    pieces["kitchen int8_linear"] = lambda: kitchen(x)
    lines = []
    with use_dispatcher(dispatcher):
        for name, fn in pieces.items():
            try:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize(device)
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                cpu = (time.perf_counter() - start) / calls * 1e6
                torch.cuda.synchronize(device)
                lines.append(f"overhead {name:<24} {cpu:7.1f} us CPU per call")
            except Exception as err:
                lines.append(f"overhead {name} FAILED {type(err).__name__}: {err}"[:200])
            print(lines[-1], flush=True)
        profiler = cProfile.Profile()
        fn = problem.ours("int8")
        profiler.enable()
        for _ in range(calls):
            fn(x)
        profiler.disable()
    torch.cuda.synchronize(device)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(14)
    for line in text.getvalue().splitlines():
        if line.strip():
            lines.append("profile " + line[:160])
            print(lines[-1], flush=True)
    return lines


# ---- component sweep (tuning data) ------------------------------------------------------------

def sweep(device: torch.device, shapes: list[tuple[int, int]], m: int, rep_ms: int) -> list[str]:
    """Time the pieces separately at one M: act-quant variants (vs plain torch), every GEMM config
    alone, and cuBLAS ``_int_mm`` / ``_scaled_mm`` alone, each against bf16. Returns report lines."""
    from .gemm_config import w4_candidates, w8a8_candidates
    from .reference import act_quant_reference
    from .triton_act_quant import act_quant_triton
    from .triton_w4_gemm import w4a8_mm_triton
    from .triton_w8a8_gemm import w8a8_mm_triton

    timer = _timer(device, rep_ms)
    cap = capability(device)
    lines = []

    def out(line):
        print(line, flush=True)
        lines.append(line)

    for k in sorted({k for _, k in shapes}):
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        gbytes = m * k * 3 / 1e9
        t = timer(lambda: act_quant_reference(x, torch.int8, None, "none", 0, None, False))
        out(f"act_quant m={m} k={k} torch-reference {t:.1f}us")
        for rotation, group in (("none", 0), ("regular", 256), ("sylvester", 128)):
            for tile, warps in ((None, None), (4096, 4), (16384, 8)):
                for perm in (0, 128) if rotation == "regular" and tile is None else (0,):
                    try:
                        t = timer(lambda: act_quant_triton(x, torch.int8, 127.0, rotation, group, None, False, perm,
                                                           tile_elements=tile, num_warps=warps))
                        out(f"act_quant m={m} k={k} {rotation}{group or ''} tile={tile or 'auto'} warps={warps or 'auto'} perm={perm} "
                            f"{t:.1f}us {gbytes / t * 1e6:.0f}GB/s")
                    except Exception as err:
                        out(f"act_quant m={m} k={k} {rotation} tile={tile} FAILED {type(err).__name__}: {err}"[:300])
    for n, k in shapes:
        p = Problem(n, k, device)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        bf16 = timer(lambda: torch.nn.functional.linear(x, p.w_bf16, p.bias))
        q, s, _ = act_quant_reference(x, torch.int8, None, "none", 0, None, False)
        qf, sf, _ = act_quant_reference(x, FP8, None, "none", 0, None, False)
        ws = p.w_scale.reshape(-1)
        res = {"bf16": bf16}
        for name, fn in (("_int_mm", lambda: torch._int_mm(q, p.w_int8.t())),
                         ("_scaled_mm", lambda: torch._scaled_mm(qf, p.w_fp8.t(), scale_a=sf, scale_b=ws.reshape(1, -1),
                                                                 bias=p.bias, out_dtype=torch.bfloat16))):
            try:
                res[name] = timer(fn)
            except Exception as err:
                out(f"gemm {name} FAILED {type(err).__name__}: {err}"[:300])
        for cfg in w8a8_candidates(cap, m):
            for label, a, b, sa in (("int8", q, p.w_int8, s), ("fp8", qf, p.w_fp8, sf)):
                try:
                    res[f"{label} {cfg.name}"] = timer(lambda: w8a8_mm_triton(a, b, sa, ws, p.bias, None, None,
                                                                              torch.bfloat16, cfg))
                except Exception as err:
                    out(f"gemm {label} {cfg.name} FAILED {type(err).__name__}: {err}"[:300])
        table = level_table_for(p)
        for cfg in w4_candidates(cap, m):
            for label, s_rel in (("w4", None), ("w4cb", p.s_rel)):
                try:
                    res[f"{label} {cfg.name}"] = timer(lambda: w4a8_mm_triton(  # codes' order does not matter for time
                        q, p.packed, s, p.w4_scale, p.bias, s_rel, table if s_rel is not None else None, 16,
                        torch.bfloat16, cfg))
                except Exception as err:
                    out(f"gemm {label} {cfg.name} FAILED {type(err).__name__}: {err}"[:300])
        flops = 2 * m * n * k
        for name, t in sorted(res.items(), key=lambda kv: kv[1]):
            out(f"gemm m={m} n={n} k={k} {name:<34} {t:8.1f}us {flops / t / 1e6:7.0f} TOPS {bf16 / t:5.2f}x bf16")
    return lines


def level_table_for(problem: "Problem") -> torch.Tensor:
    return w4a8_level_table(problem.codebook, problem.device)


# ---- verification -------------------------------------------------------------------------------

def verify(device: torch.device) -> list[str]:
    """Every Triton kernel against its eager reference on ``device``; returns the failures."""
    from . import ops
    from .gemm_config import w4_candidates, w8a8_candidates
    from .reference import act_quant_reference, int8_accumulate_reference
    from .triton_act_quant import act_quant_triton
    from .triton_w4_gemm import w4a8_mm_triton
    from .triton_w8a8_gemm import w8a8_mm_triton

    failures = []
    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else (9, 0)
    torch.manual_seed(1)

    def check(name, ok, detail=""):
        print(f"verify {'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
        if not ok:
            failures.append(f"{name} {detail}")

    for m, k, rotation, group, fp8, smooth, center, *perm in [
        (300, 3072, "none", 0, False, False, False), (300, 3072, "none", 0, True, False, False),
        (257, 3072, "regular", 256, False, False, False), (64, 12288, "regular", 256, True, False, False),
        (129, 3072, "sylvester", 128, False, True, True), (33, 5120, "sylvester", 128, False, False, False),
        (8, 13824, "regular", 256, False, False, False), (17, 1000, "none", 0, False, False, True),
        (100, 3072, "regular", 256, False, False, False, 128)]:
        x = (torch.randn(m, k, device=device) * 3).to(torch.bfloat16)
        x[0, 5] = 80.0  # an outlier channel
        sm = torch.rand(k, device=device) + 0.5 if smooth else None
        dt = FP8 if fp8 else torch.int8
        poison = torch.full((m, k), 77 if not fp8 else 0, device=device, dtype=torch.int8)
        if fp8:
            poison = torch.full((m, k), float("nan"), device=device).to(FP8)
        perm_block = perm[0] if perm else 0
        q, s, mu = act_quant_triton(x, dt, 448.0 if fp8 else 127.0, rotation, group, sm, center, perm_block, out=poison)
        qr, sr, mr = act_quant_reference(x, dt, None, rotation, group, sm, center)
        qr = ops.permute_columns(qr, perm_block)
        diff = (q.float() - qr.float()).abs()
        frac = (diff > 0).float().mean().item()
        # without rotation or centring the codes are exact; the fused rotation is accurate to ~2^-12 of the
        # row maximum (fp16 operands), so a few codes sit one step away from the fp32 reference
        exact = rotation == "none" and not center
        near = (diff <= qr.float().abs() * 0.125 + 2**-9).all().item() if fp8 else diff.max().item() <= 1
        ok = bool(torch.isfinite(q.float()).all()) and (frac == 0 if exact else frac < 0.03 and near)
        scale_ok = torch.allclose(s, sr, rtol=1e-6 if exact else 2**-10)
        check(f"act_quant m={m} k={k} {rotation}{group} {'fp8' if fp8 else 'int8'} smooth={smooth} center={center} "
              f"perm={perm_block}", ok and scale_ok, f"codes differing {frac:.2e}, max {diff.max().item():.3g}, "
              f"scale rel {((s - sr).abs() / sr).max().item():.1e}, near {near}")

    def close_bf16(out, ref):  # same fp32 math, rounded once to bf16 (an FMA may move the last bit)
        diff = (out.float() - ref.float()).abs()
        return torch.isfinite(out.float()).all().item() and (diff <= ref.float().abs() * 2**-7 + 1e-6).all().item()

    # exact int32 accumulators (fp32 out, unit scales): one small and one large config, plus a ragged K
    for m, n, k, cfg in [(300, 384, 3072, w8a8_candidates(cap, 300)[0]), (4096, 3072, 3072, w8a8_candidates(cap, 4096)[0]),
                         (77, 200, 1000, w8a8_candidates(cap, 77)[0])]:
        a = torch.randint(-127, 128, (m, k), device=device, dtype=torch.int8)
        b = torch.randint(-127, 128, (n, k), device=device, dtype=torch.int8)
        poison = torch.full((m, n), float("nan"), device=device)
        out = w8a8_mm_triton(a, b, torch.ones(m, 1, device=device), torch.ones(n, device=device), None, None, None,
                             torch.float32, cfg, out=poison)
        # int32 accumulators are exact; both sides round them to fp32 once, so the results are equal
        check(f"int8 gemm exact m={m} n={n} k={k} {cfg.name}",
              torch.isfinite(out).all().item() and torch.equal(out, int8_accumulate_reference(a, b).float()))
    # every benchmark config (bf16 out, bias: the variants the benchmark compiles) against the reference
    for m, n, k in [(1000, 3072, 3072), (4096, 3072, 3072)]:
        a = torch.randint(-127, 128, (m, k), device=device, dtype=torch.int8)
        b = torch.randint(-127, 128, (n, k), device=device, dtype=torch.int8)
        sa, sb = torch.rand(m, 1, device=device) * 1e-3, torch.rand(n, device=device) * 1e-3
        bias = torch.randn(n, device=device, dtype=torch.bfloat16)
        ref = ops.w8a8_mm(a, b, sa, sb, bias, None, None, torch.bfloat16, "eager")
        af = (torch.randn(m, k, device=device) * 30).to(FP8)
        bf = (torch.randn(n, k, device=device) * 30).to(FP8)
        ref_f = ops.w8a8_mm(af, bf, sa, sb, bias, None, None, torch.bfloat16, "eager") if cap >= (8, 9) else None
        for cfg in w8a8_candidates(cap, m):
            out = w8a8_mm_triton(a, b, sa, sb, bias, None, None, torch.bfloat16, cfg)
            check(f"int8 gemm m={m} n={n} k={k} {cfg.name}", close_bf16(out, ref))
            if ref_f is not None:
                out = w8a8_mm_triton(af, bf, sa, sb, bias, None, None, torch.bfloat16, cfg)
                rel = ((out.float() - ref_f.float()).norm() / ref_f.float().norm()).item()
                check(f"fp8 gemm m={m} n={n} k={k} {cfg.name}", rel < 1e-2, f"rel err {rel:.1e}")

    for m, n, k in [(300, 384, 3072), (4096, 3072, 3072)]:
        a = torch.randint(-127, 128, (m, k), device=device, dtype=torch.int8)
        packed = torch.randint(-128, 128, (n, k // 2), device=device, dtype=torch.int8)
        s_rel = (torch.rand(n, k // 16, device=device) * 60 + 4).to(FP8)
        table = w4a8_level_table(torch.tensor(FP8_CODEBOOK), device)
        sa, sw = torch.rand(m, 1, device=device) * 1e-3, torch.rand(n, device=device) * 1e-2
        bias = torch.randn(n, device=device, dtype=torch.bfloat16)
        for codebook in (False, True):
            args = (s_rel, table) if codebook else (None, None)
            ref = ops.w4a8_mm(a, packed, sa, sw, bias, *args, 16, 0, torch.bfloat16, "eager")
            for cfg in w4_candidates(cap, m):
                poison = torch.full((m, n), float("nan"), device=device, dtype=torch.bfloat16)
                a_perm = ops.permute_columns(a, cfg.block_k)
                out = w4a8_mm_triton(a_perm, packed, sa, sw, bias, *args, 16, torch.bfloat16, cfg, out=poison)
                check(f"w4 gemm codebook={codebook} m={m} n={n} k={k} {cfg.name}", close_bf16(out, ref))
    return failures


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
    if device.type == "cuda":
        print(f"device {torch.cuda.get_device_name(device)} sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}, "
              f"torch {torch.__version__}, {triton_status().reason}", flush=True)
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
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": lines, "sweep": sweep_lines,
                                               "overhead": overhead_lines,
                                               "decisions": dispatcher.decisions,
                                               "timings_us": dispatcher.timings_us, "failures": dispatcher.failures},
                                              indent=1, default=str))
    return 1 if args.verify and failures else 0


if __name__ == "__main__":
    sys.exit(main())
