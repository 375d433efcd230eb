"""Every W4 GEMM config (gemm_config's W4 lists plus the TMA variants below) against bf16 ``F.linear``.

Not a pytest file. On an sm_90 GPU, from the repository root, with the package importable as ``lowbit``::

    python tests/gpu/sweep_w4_gemm.py --out w4.json

For M in {4096, 1024, 256} and the issue's five N x K shapes, both weight kinds (signed nibbles as
``convrot_w4a4`` stores them; codebook levels with FP8 group scales as ``asym_w4a8_int8``), it times
the W4 GEMM alone (INT8 activation codes given, bias on, bf16 out; the activation quantization is not
in the time) and ``F.linear`` in bf16 with the same bias: the median of CUDA-graph replays, each
graph cycling through enough weight copies (``--rotate-mb``) that the weights come from HBM, not L2.

Checks, recorded per config rather than raised:

* phase 1, in ``--workers`` subprocesses (they compile every kernel in parallel, and a kernel that
  crashes its CUDA context takes only its worker down): at M x N = 256 x 3072 and 208 x 3056
  (partial tiles), each written into a view of a larger NaN-filled buffer: every tile written,
  nothing past the shape, and the output within one bf16 step of the fp64 reference;
* phase 2, at every measured shape: the output is bit for bit the pointer-epilogue kernel's
  (``reference_config``), which is itself checked against the fp64 reference.

The run stops starting new shapes after ``--budget-s`` seconds (the rest is marked skipped); the JSON
report is rewritten after every shape. ``--smoke`` runs the same code on the CPU in Triton's
interpreter at a tiny shape (minutes per config there: pass ``--configs``). ``--compile-only`` needs
no GPU: it compiles every config for sm_90 with Triton's bundled ptxas and reports shared memory,
registers and spill stores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T0 = time.monotonic()

SHAPES = ((3072, 3072), (9216, 3072), (12288, 3072), (3072, 12288), (15360, 3072))  # (N, K)
MS = (4096, 1024, 256)
KINDS = ("nibbles", "codebook")
GROUP = 16  # codebook group size (asym_w4a8_int8's default)
# The TMA variants proposed for gemm_config's W4 lists. Offline sm_90 compiles (``--compile-only``, Triton
# 3.8): all fit in shared memory; with nibbles none spills a register; with the codebook the 4-warp 128-row
# and the 128x256 tiles spill 24-448 bytes (the table gathers), the 8-warp 128x128 / 256x128 ones nothing.
NEW_VARIANTS = (
    # M > 1024
    "128x128x128-g8-w4-s3-tma-tmastore", "128x128x128-g8-w8-s3-tma-tmastore",
    "128x256x128-g8-w8-s3-tma-tmastore-sub", "256x128x128-g8-w8-s3-tma-tmastore-sub",
    "128x256x128-g8-w8-s3-tma-persistent-tmastore-sub", "256x128x128-g8-w8-s3-tma-persistent-tmastore-sub",
    "128x128x128-g8-w4-s4-swap-tma-tmastore", "128x128x128-g8-w8-s4-swap-tma-tmastore",
    "128x256x128-g8-w8-s3-swap-tma-tmastore-sub",
    "256x128x128-g8-w8-s3-swap-tma-tmastore-sub", "128x256x128-g8-w8-s3-tmastore-sub",
    "256x128x128-g8-w8-s3-tmastore-sub", "128x256x128-g8-w8-s3-tma",
    # M <= 1024
    "64x128x128-g8-w4-s4-tma-tmastore", "64x128x128-g8-w8-s4-tma-tmastore", "128x128x128-g8-w4-s4-tma-tmastore",
    "64x128x128-g8-w4-s4-swap-tma-tmastore",
    "128x64x128-g8-w4-s4-tma-tmastore", "64x256x128-g8-w8-s3-tma-tmastore-sub",
)
SMOKE_MS, SMOKE_SHAPES = (37,), ((72, 256),)


def candidate_names(only: list[str] | None) -> list[str]:
    from lowbit.kernels import gemm_config

    listed = [c.name for c in (*getattr(gemm_config, "_W4_LARGE", ()), *getattr(gemm_config, "_W4_SMALL", ()))]
    names = list(dict.fromkeys([*listed, *NEW_VARIANTS]))
    return [n for n in names if n in only] + [n for n in only if n not in names] if only else names


ALT = "+alt-weight-load"  # a variant name suffix: the packed weight tile read the other way (TMA <-> pointers)


def variant_names(names: list[str], kind: str, alt_kinds) -> list[str]:
    """``names``, plus for a kind in ``alt_kinds`` each ``tma`` config with the other weight-tile load
    than the kernel's default for that kind (``triton_w4_gemm._TMA_WEIGHT``)."""
    alts = []
    for name in names if kind in alt_kinds else ():
        try:
            if parse_config(name).tma:
                alts.append(name + ALT)
        except ValueError:
            pass  # a bad name: reported by its own entry
    return names + alts


@contextlib.contextmanager
def weight_load(kind: str, alt: bool):
    """Inside: the kernel reads the packed weight tile of ``kind`` the other way when ``alt``."""
    from lowbit.kernels import triton_w4_gemm

    codebook = kind == "codebook"
    saved = triton_w4_gemm._TMA_WEIGHT[codebook]
    triton_w4_gemm._TMA_WEIGHT[codebook] = saved != alt
    try:
        yield
    finally:
        triton_w4_gemm._TMA_WEIGHT[codebook] = saved


def reference_config(m: int):
    """The pointer-epilogue config every output is compared with (the dispatcher's unmeasured default)."""
    from lowbit.kernels.gemm_config import default_config

    return default_config(m, "w4")


# ---- problems -----------------------------------------------------------------------------------

def make_problem(m: int, n: int, k: int, kind: str, device, seed: int = 0) -> dict:
    import torch

    from lowbit.kernels.reference import FP8, w4a8_level_table

    g = torch.Generator(device=device).manual_seed(seed)
    problem = {
        "a": torch.randint(-127, 128, (m, k), generator=g, device=device, dtype=torch.int8),
        "packed": torch.randint(-128, 128, (n, k // 2), generator=g, device=device, dtype=torch.int8),
        "a_scale": torch.rand(m, 1, generator=g, device=device) / (127 * k**0.5) + 1e-6,
        "w_scale": torch.rand(n, generator=g, device=device) / 4 + 1e-3,
        "bias": torch.randn(n, generator=g, device=device).to(torch.bfloat16),
        "s_rel": None, "table": None,
    }
    if kind == "codebook":
        problem["s_rel"] = (torch.rand(n, k // GROUP, generator=g, device=device) * 60 + 4).to(FP8)
        problem["table"] = w4a8_level_table(None, device)
    return problem


def weight_of(problem: dict):
    from lowbit.kernels.ops import decode_w4_reference

    return decode_w4_reference(problem["packed"], problem["s_rel"], problem["table"], GROUP)


def fp64_reference(problem: dict):
    from lowbit.kernels.reference import scaled_mm_reference

    import torch

    return scaled_mm_reference(problem["a"], weight_of(problem), problem["a_scale"], problem["w_scale"],
                               problem["bias"], None, None, torch.float32)


def run_w4(problem: dict, a_perm, config, out, packed=None, w_scale=None, s_rel=None, alt: bool = False):
    from lowbit.kernels.triton_w4_gemm import w4a8_mm_triton

    with weight_load("codebook" if problem["s_rel"] is not None else "nibbles", alt):
        return w4a8_mm_triton(a_perm, problem["packed"] if packed is None else packed, problem["a_scale"],
                              problem["w_scale"] if w_scale is None else w_scale, problem["bias"],
                              problem["s_rel"] if s_rel is None else s_rel, problem["table"], GROUP, out.dtype,
                              config, out=out)


def parse_config(name: str):
    """The GemmConfig of a variant name (its ``ALT`` suffix dropped)."""
    from lowbit.kernels.gemm_config import GemmConfig

    return GemmConfig.from_name(name.removesuffix(ALT))


# ---- timing -------------------------------------------------------------------------------------

def time_us(calls: list, device, replays: int) -> float:
    """Median microseconds a call: CUDA-graph replays of ``calls`` on a GPU, ``perf_counter`` on the CPU."""
    import torch

    if device.type != "cuda":
        calls[0]()
        times = []
        for _ in range(replays):
            start = time.perf_counter()
            for call in calls:
                call()
            times.append((time.perf_counter() - start) / len(calls) * 1e6)
        return statistics.median(times)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(calls))
    del graph
    return statistics.median(times)


def copies_for(nbytes: int, rotate_mb: float) -> int:
    return max(1, min(64, math.ceil(rotate_mb * 2**20 / max(1, nbytes))))


def is_cuda_fatal(err: BaseException) -> bool:
    text = str(err)
    return any(s in text for s in ("illegal memory access", "illegal instruction", "misaligned address",
                                   "unspecified launch failure", "device-side assert", "CUDA error"))


# ---- phase 1: the workers -----------------------------------------------------------------------

def worker_problems(smoke: bool) -> list[tuple[int, int, int]]:
    """(M, N, K): the measured shapes' specialization (all multiples of 16, so these compiles are the
    ones phase 2 finds in Triton's cache); the second has partial tiles in M and N for every config."""
    return [(37, 72, 256), (21, 40, 256)] if smoke else [(256, 3072, 3072), (208, 3056, 3072)]


def worker_main(args) -> int:
    import torch

    device = torch.device(args.device)
    from lowbit.kernels.ops import permute_columns, plane_run

    tasks = [tuple(t.split("@")) for t in args.tasks.split(",") if t]
    problems = {(shape, kind): make_problem(*shape, kind, device, seed=1) for shape in worker_problems(args.smoke)
                for kind in {kind for _, kind in tasks}}
    references = {key: fp64_reference(p) for key, p in problems.items()}
    with open(args.result, "a") as log:
        def emit(**row):
            log.write(json.dumps(row) + "\n")
            log.flush()

        for name, kind in tasks:
            emit(task=[name, kind], state="start")
            row = {"checks": []}
            try:
                config = parse_config(name)
                for shape in worker_problems(args.smoke):
                    m, n, k = shape
                    problem, reference = problems[(shape, kind)], references[(shape, kind)]
                    # a row stride of a multiple of 16 elements, as the measured outputs have: the same
                    # specialization (Triton's divisibility-by-16 of each integer argument), the same compile
                    buffer = torch.full((m + 3, -(-(n + 5) // 16) * 16), float("nan"), device=device,
                                        dtype=torch.bfloat16)
                    out = buffer[:m, :n]
                    start = time.perf_counter()
                    run_w4(problem, permute_columns(problem["a"], config.block_k, plane_run(kind == "codebook")), config, out,
                           alt=name.endswith(ALT))
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    first_s = time.perf_counter() - start
                    rest = buffer.clone()
                    rest[:m, :n] = 0
                    diff = (out.float() - reference).abs()
                    # one bf16 step, plus room for the fp32 epilogue's rounding where bias and product cancel
                    step = reference.abs() * 2**-7 + 1e-4 * reference.pow(2).mean().sqrt()
                    row["checks"].append({
                        "m": m, "n": n, "k": k, "first_call_s": round(first_s, 3),
                        "unwritten": int(out.isnan().sum()), "written_outside": int((~rest.isnan()).sum() - m * n),
                        "beyond_one_bf16_step": int((diff > step).sum()),
                        "max_rel_err": float((diff / reference.abs().clamp_min(1e-6)).max()),
                    })
                ok = all(c["unwritten"] == 0 and c["written_outside"] == 0 and c["beyond_one_bf16_step"] == 0
                         for c in row["checks"])
                emit(task=[name, kind], state="done", ok=ok, **row)
            except Exception as err:  # noqa: BLE001 - recorded per config
                emit(task=[name, kind], state="error", error=f"{type(err).__name__}: {str(err)[:500]}", **row)
                if is_cuda_fatal(err):
                    return 3  # the context is gone: the remaining tasks go to a fresh worker
    return 0


def run_workers(names: list[str], kinds, args, deadline: float) -> dict:
    """``{(name, kind): result row}`` from ``args.workers`` subprocesses, re-spawning for tasks a dead
    worker did not reach (up to three rounds)."""
    pending = [(name, kind) for kind in kinds for name in variant_names(names, kind, args.alt_kinds)]
    results: dict = {}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.smoke:
        env["TRITON_INTERPRET"] = "1"
    with tempfile.TemporaryDirectory(prefix="sweep_w4_") as tmp:
        for round_ in range(3):
            if not pending or time.monotonic() > deadline:
                break
            slices = [pending[i::args.workers] for i in range(args.workers)]
            procs = []
            for i, tasks in enumerate(s for s in slices if s):
                path = Path(tmp) / f"r{round_}w{i}.jsonl"
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--device", args.device,
                       "--tasks", ",".join(f"{n}@{k}" for n, k in tasks), "--result", str(path)]
                cmd += ["--smoke"] if args.smoke else []
                log_path = path.with_suffix(".log")  # a file, not a pipe: a chatty worker never blocks
                with open(log_path, "w") as log:
                    procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), path, log_path))
            for proc, path, log_path in procs:
                killed = False
                try:
                    proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                    killed = True
                output = log_path.read_text(errors="replace")
                rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
                started = None
                for row in rows:
                    key = tuple(row["task"])
                    if row["state"] == "start":
                        started = key
                    else:
                        results[key] = row
                        started = None
                if started is not None and not killed:  # it died inside this task
                    results[started] = {"state": "error", "error": f"worker exited ({proc.returncode}) in this task: "
                                                                   f"{output[-800:]}"}
                if proc.returncode not in (0, 3) and not rows:
                    print(f"worker failed before its first task (exit {proc.returncode}):\n{output[-2000:]}",
                          file=sys.stderr)
            pending = [task for task in pending if task not in results]
    for task in pending:  # measured anyway in phase 2 (compiled there)
        results[task] = {"state": "unchecked", "why": "phase 1 out of time, or its workers failed"}
    return results


# ---- without a GPU: offline sm_90 compiles ------------------------------------------------------

def offline_compile(name: str, kind: str, arch: int = 90) -> dict:
    """Compile one variant for ``sm_<arch>`` on any machine (Triton's own ptxas; no GPU, no interpreter):
    its shared memory, three facts of its TTGIR (``decode_blocks``, ``staged_i8_tiles``, ``dot_waits``), and
    with ``ptxas -v`` its registers and spill stores. The signature is what the launcher passes at the
    measured shapes (16-aligned pointers and sizes, bf16 output and bias)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget

    from lowbit.kernels.triton_w4_gemm import _w4a8_mm_kernel as kernel
    from lowbit.kernels.triton_w4_gemm import _TMA_WEIGHT, kernel_constexprs

    config = parse_config(name)
    tma_store = config.tma_store
    half, store_n = config.block_k // 2, config.block_n // (2 if tma_store and config.subtile else 1)
    codebook = kind == "codebook"
    a_block = config.block_k if config.join else half  # joined planes: the activation tile in one copy
    runtime = [f"tensordesc<i8[{config.block_m}, {a_block}]>" if config.tma else "*i8", None,
               f"tensordesc<bf16[{config.block_m}, {store_n}]>" if tma_store else "*bf16",
               "*fp32", "*fp32", "*bf16", "*u8" if codebook else "*i8", "*i8", "*i32", "*i32"] + ["i32"] * 8
    tma_w = config.tma and (_TMA_WEIGHT[codebook] != name.endswith(ALT))
    constexprs = kernel_constexprs(config, codebook=codebook, group_size=GROUP, has_bias=True, use_ptx=True,
                                   tma_a=config.tma, tma_w=tma_w, tma_store=tma_store,
                                   splits=1 if config.persistent else config.split_k, stream_k=config.stream_k)
    runtime[1] = f"tensordesc<i8[{config.block_n}, {half}]>" if tma_w else "*i8"
    if len(kernel.arg_names) != len(runtime) + len(constexprs):
        raise RuntimeError(f"the kernel's parameters changed: {kernel.arg_names}; update offline_compile")
    signature = {**dict(zip(kernel.arg_names, runtime)), **{key: "constexpr" for key in constexprs}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(runtime) if not t.startswith("tensordesc")}
    start = time.perf_counter()
    compiled = triton.compile(triton.compiler.ASTSource(kernel, signature, constexprs, attrs),
                              target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    ttgir = compiled.asm["ttgir"]
    row = {"shared_bytes": compiled.metadata.shared, "fits_sm90": compiled.metadata.shared <= 227 * 1024,
           "compile_s": round(time.perf_counter() - start, 2),
           # the inline-PTX decode blocks in the kernel, and the int8 tiles made in registers and then written to
           # shared memory (a decoded plane on its way to a wgmma operand in shared memory)
           "decode_blocks": ttgir.count("tt.elementwise_inline_asm"),
           "staged_i8_tiles": len(re.findall(r"ttg\.local_alloc %\S+ : \(tensor<[0-9x]+xi8", ttgir)),
           # the waits for wgmma groups (one per dot: Triton keeps no INT8 wgmma in flight)
           "dot_waits": ttgir.count("ttng.warp_group_dot_wait")}
    ptxas = getattr(getattr(getattr(triton, "knobs", None), "nvidia", None), "ptxas", None)
    ptxas = getattr(ptxas, "path", None)
    if ptxas and os.path.isfile(ptxas):
        with tempfile.TemporaryDirectory() as tmp:
            ptx = Path(tmp) / "kernel.ptx"
            ptx.write_text(compiled.asm["ptx"])
            log = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}a", str(ptx), "-o", str(Path(tmp) / "k.cubin")],
                                 capture_output=True, text=True).stderr
        regs, spills = re.search(r"Used (\d+) registers", log), re.search(r"(\d+) bytes spill stores", log)
        row.update(registers=int(regs.group(1)) if regs else None, spill_store_bytes=int(spills.group(1)) if spills
                   else None)
    return row


def _offline_task(task: tuple[str, str]) -> tuple[str, dict]:
    name, kind = task
    try:
        return f"{name}/{kind}", offline_compile(name, kind)
    except Exception as err:  # noqa: BLE001 - recorded per config
        return f"{name}/{kind}", {"error": f"{type(err).__name__}: {str(err)[:500]}"}


def compile_only(names: list[str], args) -> dict:
    """Every config and weight kind compiled offline for sm_90, in ``args.workers`` processes."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    tasks = [(name, kind) for kind in args.kinds for name in variant_names(names, kind, args.alt_kinds)]
    with ProcessPoolExecutor(max(1, args.workers), mp_context=multiprocessing.get_context("spawn")) as pool:
        return dict(pool.map(_offline_task, tasks))


# ---- phase 2: the measurements ------------------------------------------------------------------

def measure_shape(m, n, k, names, prechecks, args, device) -> dict:
    row = {"m": m, "n": n, "k": k, "bf16_us": bf16_linear_us(m, n, k, args, device)}
    row["kinds"] = {kind: measure_kind(m, n, k, kind, names, prechecks, args, device, row["bf16_us"])
                    for kind in args.kinds}
    return row


def bf16_linear_us(m, n, k, args, device) -> float:
    import torch
    import torch.nn.functional as F

    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    weight = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5
    bias = torch.randn(n, device=device, dtype=torch.bfloat16)
    weights = [weight] + [weight.clone() for _ in range(copies_for(weight.numel() * 2, args.rotate_mb) - 1)]
    calls = [lambda w=w: F.linear(x, w, bias) for w in weights] * max(1, -(-args.calls // len(weights)))
    return time_us(calls, device, args.replays)


def measure_kind(m, n, k, kind, names, prechecks, args, device, bf16_us) -> dict:
    """Every config on one problem: bit-exact against the pointer-epilogue reference, and timed."""
    import torch

    from lowbit.kernels.ops import permute_columns, plane_run

    entry = {"configs": {}}
    problem = make_problem(m, n, k, kind, device)
    perms = {}

    def perm(block_k):
        if block_k not in perms:
            perms[block_k] = permute_columns(problem["a"], block_k, plane_run(kind == "codebook"))
        return perms[block_k]

    ref_config = reference_config(m)
    entry["reference_config"] = ref_config.name
    expected = None
    try:
        expected = run_w4(problem, perm(ref_config.block_k), ref_config,
                          torch.empty((m, n), device=device, dtype=torch.bfloat16))
        exact = fp64_reference(problem).double()
        entry["reference_rel_err_vs_fp64"] = float((expected.double() - exact).norm() / exact.norm())
    except Exception as err:  # noqa: BLE001 - recorded; the configs are still timed
        entry["reference_error"] = f"{type(err).__name__}: {str(err)[:300]}"
    rotated = [(problem["packed"], problem["w_scale"], problem["s_rel"])]
    nbytes = problem["packed"].numel() + (problem["s_rel"].numel() if problem["s_rel"] is not None else 0)
    for _ in range(copies_for(nbytes, args.rotate_mb) - 1):
        rotated.append(tuple(t.clone() if t is not None else None for t in rotated[0]))
    out = torch.empty((m, n), device=device, dtype=torch.bfloat16)
    for name in variant_names(names, kind, args.alt_kinds):
        alt = name.endswith(ALT)
        result = entry["configs"].setdefault(name, {})
        check = prechecks.get((name, kind), {})
        if check.get("state") == "error":
            result["error"] = "phase 1: " + check["error"]
            continue
        if time.monotonic() > args.deadline:
            result["skipped"] = "time budget"
            continue
        try:
            config = parse_config(name)
            a_perm = perm(config.block_k)
            poisoned = torch.full((m, n), float("nan"), device=device, dtype=torch.bfloat16)
            start = time.perf_counter()
            got = run_w4(problem, a_perm, config, poisoned, alt=alt)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            result["first_call_s"] = round(time.perf_counter() - start, 3)  # long: compiled here, not in phase 1
            if expected is not None:
                result["bit_exact"] = bool(torch.equal(got, expected))
                result["max_abs_diff"] = float((got.float() - expected.float()).abs().nan_to_num(math.inf).max())
            calls = [lambda c=c, a=a_perm, cfg=config, alt=alt: run_w4(problem, a, cfg, out, *c, alt=alt)
                     for c in rotated]
            result["us"] = time_us(calls * max(1, -(-args.calls // len(calls))), device, args.replays)
            result["speedup_vs_bf16"] = bf16_us / result["us"]
            if check.get("state") == "done" and not check.get("ok"):
                result["phase1_failed"] = check["checks"]
        except Exception as err:  # noqa: BLE001 - recorded per config
            result["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            if is_cuda_fatal(err):
                raise
    timed = {name: r["us"] for name, r in entry["configs"].items() if "us" in r and r.get("bit_exact", True)}
    if timed:
        entry["best"] = min(timed, key=timed.get)
        entry["best_us"] = timed[entry["best"]]
        entry["best_speedup_vs_bf16"] = bf16_us / entry["best_us"]
    return entry


def summarize(rows: list[dict]) -> dict:
    """Per M and kind: each config's geometric-mean speedup over bf16 across the shapes it ran on all
    of, and the best config per shape."""
    summary = {}
    for m in sorted({r["m"] for r in rows}, reverse=True):
        at_m = [r for r in rows if r["m"] == m and "kinds" in r]
        for kind in KINDS:
            entries = [(r, r["kinds"][kind]) for r in at_m if kind in r["kinds"]]
            if not entries:
                continue
            geo = {}
            for name in dict.fromkeys(name for _, e in entries for name in e["configs"]):
                speedups = [e["configs"].get(name, {}).get("speedup_vs_bf16") for _, e in entries]
                if speedups and all(s is not None for s in speedups):
                    geo[name] = math.exp(sum(math.log(s) for s in speedups) / len(speedups))
            summary[f"m{m}/{kind}"] = {
                "geomean_speedup_vs_bf16": dict(sorted(geo.items(), key=lambda kv: -kv[1])),
                "best_per_shape": {f"{r['n']}x{r['k']}": e.get("best") for r, e in entries},
            }
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="sweep_w4_gemm.json")
    p.add_argument("--device", default=None, help="default: cuda (cpu with --smoke)")
    p.add_argument("--configs", nargs="*", default=None, help="only these config names (default: all)")
    p.add_argument("--workers", type=int, default=min(14, max(1, (os.cpu_count() or 2) - 2)),
                   help="phase-1 subprocesses (0: no phase 1; kernels then compile during phase 2)")
    p.add_argument("--budget-s", type=float, default=105.0, help="no new work after this many seconds")
    p.add_argument("--worker-budget-s", type=float, default=45.0, help="phase 1 ends after this many seconds")
    p.add_argument("--rotate-mb", type=float, default=None,
                   help="weight bytes cycled through per graph (default 128; an H200's L2 is 50 MB)")
    p.add_argument("--calls", type=int, default=None, help="calls per CUDA graph, at least (default 10)")
    p.add_argument("--replays", type=int, default=None, help="graph replays, median reported (default 5)")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS,
                   help="weight kinds to compile or measure (default: both)")
    p.add_argument("--alt-kinds", nargs="*", default=["codebook"], choices=KINDS,
                   help=f"weight kinds whose tma configs are also run as '<config>{ALT}' (the packed weight "
                        "tile read the other way than the kernel's default for the kind)")
    p.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shape, one call timed")
    p.add_argument("--compile-only", action="store_true",
                   help="no GPU needed: compile every config for sm_90 and report shared memory, registers, spills")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tasks", default="", help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    for name, default, smoke in (("rotate_mb", 128.0, 0.0), ("calls", 10, 1), ("replays", 5, 1)):
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else default)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.worker:
        return worker_main(args)
    if args.compile_only:
        os.environ.pop("TRITON_INTERPRET", None)  # a real compile (children inherit this environment)
        import triton

        report = {"script": "sweep_w4_gemm --compile-only", "arch": "sm_90a", "triton": triton.__version__,
                  "signature": "16-aligned pointers and sizes, bf16 bias and output, group size 16",
                  "results": compile_only(candidate_names(args.configs), args)}
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"JSON report: {Path(args.out).resolve()}")
        return 0

    import torch
    import triton

    from lowbit.kernels.triton_w4_gemm import _TMA_WEIGHT

    device = torch.device(args.device)
    args.deadline = T0 + args.budget_s
    names = candidate_names(args.configs)
    report = {
        "script": "sweep_w4_gemm", "torch": torch.__version__, "triton": triton.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        "timer": ("CUDA-graph replay, median per call" if device.type == "cuda" else "perf_counter, median"),
        "what": "W4 GEMM alone (INT8 codes given, bias, bf16 out) vs bf16 F.linear with bias",
        "rotate_mb": args.rotate_mb, "calls": args.calls, "replays": args.replays, "group_size": GROUP,
        "configs": names, "new_variants": [n for n in NEW_VARIANTS if n in names],
        "alt_weight_load": {kind: f"'<config>{ALT}': the tma config with the packed weight tile read "
                                  f"{'through pointers' if default else 'by TMA'} (the kernel's default: "
                                  f"{'TMA' if default else 'pointers'})"
                            for kind, default in ((kind, _TMA_WEIGHT[kind == "codebook"]) for kind in args.alt_kinds)},
    }
    out_path = Path(args.out)

    def save():
        report["elapsed_s"] = round(time.monotonic() - T0, 1)
        tmp = out_path.with_name(out_path.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=2))
        os.replace(tmp, out_path)

    save()
    prechecks = {}
    if args.workers > 0:
        prechecks = run_workers(names, args.kinds, args, min(args.deadline, T0 + args.worker_budget_s))
        report["phase1"] = {f"{name}/{kind}": row for (name, kind), row in sorted(prechecks.items())}
        report["phase1_s"] = round(time.monotonic() - T0, 1)
        save()
    rows = report.setdefault("results", [])
    ms, shapes = (SMOKE_MS, SMOKE_SHAPES) if args.smoke else (MS, SHAPES)
    for m in ms:
        for n, k in shapes:
            if time.monotonic() > args.deadline:
                rows.append({"m": m, "n": n, "k": k, "skipped": "time budget"})
                continue
            try:
                rows.append(measure_shape(m, n, k, names, prechecks, args, device))
            except Exception as err:  # noqa: BLE001 - a dead CUDA context: stop, keep what was measured
                rows.append({"m": m, "n": n, "k": k, "error": f"{type(err).__name__}: {str(err)[:500]}"})
                report["stopped"] = "CUDA context lost"
                save()
                break
            report["summary"] = summarize(rows)
            save()
            print(f"[{time.monotonic() - T0:5.1f}s] M={m} {n}x{k}: bf16 {rows[-1].get('bf16_us', 0):.1f} us, best "
                  + ", ".join(f"{kind} {e.get('best')} {e.get('best_us', 0):.1f} us"
                              for kind, e in rows[-1].get("kinds", {}).items()), flush=True)
        else:
            continue
        break
    report["summary"] = summarize(rows)
    save()
    print(f"JSON report: {out_path.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
