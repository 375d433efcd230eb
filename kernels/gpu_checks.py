"""GPU-side companions of the kernel benchmark (``python -m lowbit bench kernels`` options).

* :func:`verify` (``--verify``) – every Triton variant against its eager reference on the GPU:
  INT8 GEMM bit-exact, FP8 and rotation within tolerance, poisoned outputs, ragged shapes.
* :func:`launch_overhead` (``--overhead``) – the CPU cost of enqueuing each linear and its pieces.
* :func:`sweep` (``--sweep M``) – the pieces timed separately: act-quant variants, every GEMM config
  alone, cuBLAS ``_int_mm``/``_scaled_mm``.
* :func:`prewarm` (``--prewarm P``) – compile the benchmark's kernels in P processes first.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from .backend import capability
from .bench import FORMATS, FP8_CODEBOOK, Problem, _timer
from .dispatch import Dispatcher, use_dispatcher
from .reference import FP8, w4a8_level_table


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

def launch_overhead(device: torch.device, n: int = 3072, k: int = 3072, m: int = 256, calls: int = 1000) -> list[str]:
    """CPU time to enqueue one call (µs) of bf16 ``F.linear``, of each format's linear and of its
    pieces, with the steady-state fast paths (cached plan, direct launches of the compiled kernels)
    and without them; the outputs of both paths compared bit for bit; a profile of the INT8 linear.

    The GPU queue is kept non-empty (a GPU sleep ahead of every batch of 100 calls), so the time is
    the CPU's alone, as in a model's forward pass."""
    import cProfile
    import io
    import pstats

    from . import ops
    from .gemm_config import default_config
    from .launcher import slow_launches_only

    problem = Problem(n, k, device)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
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
    sleep = getattr(torch.cuda, "_sleep", None)

    def cpu_us(fn) -> float:
        total, done = 0.0, 0
        while done < calls:
            batch = min(100, calls - done)
            torch.cuda.synchronize(device)
            if sleep is not None:
                sleep(int(batch * 300_000))  # ~150 us of GPU time per call queued ahead
            start = time.perf_counter()
            for _ in range(batch):
                fn()
            total += time.perf_counter() - start
            done += batch
        torch.cuda.synchronize(device)
        return total / calls * 1e6

    lines = []

    def out(line):
        lines.append(line)
        print(line, flush=True)

    fast = Dispatcher()
    slow = Dispatcher(fast=False, decisions=fast.decisions)  # the same choices, every call the full path
    results: dict[str, dict[str, float]] = {}
    for name, fn in pieces.items():
        try:
            with use_dispatcher(fast):
                for _ in range(5):  # the first call measures the candidates
                    fn()
            for _ in range(2):  # alternated, best of two: the CPU's speed drifts
                for label, dispatcher in (("fast", fast), ("full", slow)):
                    with use_dispatcher(dispatcher), slow_launches_only() if label == "full" else _nothing():
                        fn()
                        us = cpu_us(fn)
                    results.setdefault(name, {})[label] = min(us, results.get(name, {}).get(label, us))
        except Exception as err:
            out(f"overhead {name} FAILED {type(err).__name__}: {err}"[:200])
    for name, res in results.items():
        out(f"overhead {name:<24} {res.get('fast', float('nan')):7.1f} us CPU per call "
            f"(without the fast paths {res.get('full', float('nan')):7.1f} us)")
    # the fast path gives the same bits as the full path (same kernels, same configs)
    for fmt in FORMATS:
        fn = problem.ours(fmt)
        with use_dispatcher(fast):
            hits = fast.fast_hits
            y_fast = fn(x)
            hit = fast.fast_hits > hits
        with use_dispatcher(Dispatcher(fast=False, decisions=dict(fast.decisions))), slow_launches_only():
            y_full = fn(x)
        same = torch.equal(y_fast, y_full)
        out(f"overhead check {fmt:<14} fast plan used {hit}, same bits as the full path {same}")
    profiler = cProfile.Profile()
    fn = problem.ours("int8")
    with use_dispatcher(fast):
        profiler.enable()
        for _ in range(calls):
            fn(x)
        profiler.disable()
    torch.cuda.synchronize(device)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
    for line in text.getvalue().splitlines():
        if line.strip():
            out("profile " + line[:160])
    return lines


@contextlib.contextmanager
def _nothing():
    yield


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
        for label, a, b, sa in (("int8", q, p.w_int8, s), ("fp8", qf, p.w_fp8, sf)):
            for cfg in w8a8_candidates(cap, m, fp8=label == "fp8"):
                try:
                    res[f"{label} {cfg.name}"] = timer(lambda: w8a8_mm_triton(a, b, sa, ws, p.bias, None, None,
                                                                              torch.bfloat16, cfg))
                except Exception as err:
                    out(f"gemm {label} {cfg.name} FAILED {type(err).__name__}: {err}"[:300])
        table = level_table_for(p)
        for label, s_rel in (("w4", None), ("w4cb", p.s_rel)):
            for cfg in w4_candidates(cap, m, codebook=s_rel is not None):
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
        (100, 3072, "regular", 256, False, False, False, 128),
        (100, 3072, "regular", 256, False, False, False, 128, 4)]:
        x = (torch.randn(m, k, device=device) * 3).to(torch.bfloat16)
        x[0, 5] = 80.0  # an outlier channel
        sm = torch.rand(k, device=device) + 0.5 if smooth else None
        dt = FP8 if fp8 else torch.int8
        poison = torch.full((m, k), 77 if not fp8 else 0, device=device, dtype=torch.int8)
        if fp8:
            poison = torch.full((m, k), float("nan"), device=device).to(FP8)
        perm_block, perm_run = (perm + [0, 1][len(perm):])[:2]
        q, s, mu = act_quant_triton(x, dt, 448.0 if fp8 else 127.0, rotation, group, sm, center, perm_block,
                                    out=poison, perm_run=perm_run)
        qr, sr, mr = act_quant_reference(x, dt, None, rotation, group, sm, center)
        qr = ops.permute_columns(qr, perm_block, perm_run)
        diff = (q.float() - qr.float()).abs()
        frac = (diff > 0).float().mean().item()
        # without rotation or centring the codes are exact; the fused rotation is accurate to ~2^-12 of the
        # row maximum (fp16 operands), so a few codes sit one step away from the fp32 reference
        exact = rotation == "none" and not center
        near = (diff <= qr.float().abs() * 0.125 + 2**-9).all().item() if fp8 else diff.max().item() <= 1
        ok = bool(torch.isfinite(q.float()).all()) and (frac == 0 if exact else frac < 0.03 and near)
        scale_ok = torch.allclose(s, sr, rtol=1e-6 if exact else 2**-10)
        check(f"act_quant m={m} k={k} {rotation}{group} {'fp8' if fp8 else 'int8'} smooth={smooth} center={center} "
              f"perm={perm_block}/{perm_run}", ok and scale_ok, f"codes differing {frac:.2e}, max {diff.max().item():.3g}, "
              f"scale rel {((s - sr).abs() / sr).max().item():.1e}, near {near}")

    from ..quant.compiled_linear import gelu_input
    from ..quant.deferred import defer_rms_norm
    from .prologue import GeluPrologue, NormModPrologue, SwigluPrologue

    # [a | gelu(b)] (b a column slice, as Flux's single blocks): the GELU is ours, not torch's, so a
    # value may round to the neighbouring bf16 and its code move one step
    for m, ka, kb, approximate, fp8 in [(4096, 3072, 12288, "tanh", False), (300, 3072, 12288, "tanh", True),
                                        (77, 0, 12288, "tanh", False), (33, 0, 5000, "none", True)]:
        wide = (torch.randn(m, 9216 + kb, device=device) * 2).to(torch.bfloat16)
        b = wide[:, 9216:]
        a = (torch.randn(m, ka, device=device) * 3).to(torch.bfloat16) if ka else None
        dt = FP8 if fp8 else torch.int8
        q, s, _ = act_quant_triton(GeluPrologue(b, a, approximate), dt, 448.0 if fp8 else 127.0, "none", 0, None,
                                   False)
        qr, sr, _ = act_quant_reference(gelu_input(a, b, approximate), dt)
        diff = (q.float() - qr.float()).abs()
        frac = (diff > 0).float().mean().item()
        near = (diff <= qr.float().abs() * 0.125 + 2**-9).all().item() if fp8 else diff.max().item() <= 1
        check(f"gelu act_quant m={m} ka={ka} kb={kb} {approximate} {'fp8' if fp8 else 'int8'}",
              bool(torch.isfinite(q.float()).all()) and frac < 1e-3 and near and torch.allclose(s, sr, rtol=2**-7),
              f"codes differing {frac:.2e}, max {diff.max().item():.3g}, scale rel {((s - sr).abs() / sr).max().item():.1e}")

    # the prologues against the same kernel on the materialized input (torch's GELU, SiLU, layer_norm, addcmul):
    # the last bit of tanh, of the SiLU's exponential or of the row variance may move a value to the
    # neighbouring bf16, and its code a step (MiniMax H3's MLP: 14336 = 56 x 256; Flux 2 dev's linear2: 6144 +
    # 18432 = 24576; Z-Image's w2: 10240)
    for m, k, rotation, group, fp8, batches, kind in [
            (4096, 3072, "none", 0, True, 1, "norm"), (4608, 3072, "regular", 256, False, 1, "norm"),
            (600, 3072, "sylvester", 128, False, 2, "norm"), (77, 5000, "none", 0, False, 1, "norm"),
            (4608, 15360, "regular", 256, False, 1, "gelu"), (300, 15360, "none", 0, True, 1, "gelu"),
            (4096, 14336, "regular", 256, False, 1, "swiglu"), (300, 14336, "none", 0, True, 1, "swiglu"),
            (77, 5000, "none", 0, False, 1, "swiglu"), (4096, 24576, "regular", 256, False, 1, "cat_swiglu"),
            (300, 12288, "none", 0, True, 1, "cat_swiglu"), (4096, 10240, "regular", 256, False, 1, "swiglu_pair"),
            (300, 10240, "none", 0, True, 1, "swiglu_pair"), (77, 5000, "none", 0, False, 1, "swiglu_pair"),
            # Z-Image's rms_norm(x, w) * (1 + scale) (3840), Krea 2's (1 + scale) * rms_norm(x.float(), 1 + s) +
            # shift (6144; fp32 weight, the product rounded before the sum)
            (4096, 3840, "regular", 256, False, 1, "rms"), (300, 3840, "none", 0, True, 2, "rms"),
            (4096, 6144, "regular", 256, False, 1, "rms_two_step"), (300, 6144, "none", 0, True, 1, "rms_two_step"),
            (77, 5000, "none", 0, False, 1, "rms_two_step")]:
        dt, qmax = (FP8, 448.0) if fp8 else (torch.int8, 127.0)
        if kind == "gelu":
            wide = (torch.randn(m, 9216 + k - 3072, device=device) * 2).to(torch.bfloat16)
            p = GeluPrologue(wide[:, 9216:], (torch.randn(m, 3072, device=device) * 3).to(torch.bfloat16), "tanh")
        elif kind == "swiglu":
            p = SwigluPrologue((torch.randn(m, 2 * k, device=device) * 3).to(torch.bfloat16))
        elif kind == "cat_swiglu":  # Flux 2's single blocks: [attention | swiglu(a column slice of linear1's output)]
            ka = k // 4
            wide = (torch.randn(m, 3 * ka + 2 * (k - ka), device=device) * 3).to(torch.bfloat16)
            p = SwigluPrologue(wide[:, 3 * ka:], (torch.randn(m, ka, device=device) * 2).to(torch.bfloat16))
        elif kind == "swiglu_pair":  # Z-Image's w2(silu(w1(x)) * w3(x)): the up half a tensor of its own
            gate, up = ((torch.randn(m, k, device=device) * 3).to(torch.bfloat16) for _ in range(2))
            p = SwigluPrologue(gate, up=up)
        else:
            x = (torch.randn(m, k, device=device) * 3 + 0.5).to(torch.bfloat16)
            mult = (1 + 0.3 * torch.randn(batches, k, device=device)).to(torch.bfloat16)
            shift = (0.5 * torch.randn(batches, k, device=device)).to(torch.bfloat16)
            rpb = m // batches if batches > 1 else 0
            if kind == "norm":
                p = NormModPrologue(x, 1e-6, mult, shift, rpb)
            elif kind == "rms":  # the weight in x's dtype, rounded as torch's rms_norm rounds it on this GPU
                w = (1 + 0.3 * torch.randn(k, device=device)).to(torch.bfloat16)
                d = defer_rms_norm(x, w, 1e-5)
                if d is None:
                    check(f"prologue rms m={m} k={k}: torch's rms_norm rounds as the kernel knows", False)
                    continue
                p = dataclasses.replace(d.prologue, mult=mult, rows_per_batch=rpb)
            else:
                w = 1 + 0.3 * torch.randn(k, device=device)
                p = NormModPrologue(x, 1e-5, mult, shift, rpb, rms=True, weight=w, two_step=True)
        q, s, _ = act_quant_triton(p, dt, qmax, rotation, group, None, False)
        qr, sr, _ = act_quant_triton(p.materialize(), dt, qmax, rotation, group, None, False, split="pow2")
        diff = (q.float() - qr.float()).abs()
        frac = (diff > 0).float().mean().item()
        # e4m3: a step (an eighth of the value) plus 2^-7 of the row's range: where shift + norm * mult
        # nearly cancels, one bf16 step of the norm (ours against torch's) is a large share of the sum
        # (measured: 3.0 against 3.5 code units, the exact value 3.29), the same share of INT8's coarser grid
        near = (diff <= qr.float().abs() * 0.125 + qmax * 2**-7).all().item() if fp8 else diff.max().item() <= 1
        check(f"prologue {type(p).__name__}{' ' + kind if kind.startswith('rms') else ''}"
              f" m={m} k={k} {rotation}{group} {'fp8' if fp8 else 'int8'}",
              bool(torch.isfinite(q.float()).all()) and frac < 1e-3 and near and torch.allclose(s, sr, rtol=2**-7),
              f"codes differing {frac:.2e}, max {diff.max().item():.3g}, scale rel {((s - sr).abs() / sr).max().item():.1e}")

    def close_bf16(out, ref):  # same fp32 math, rounded once to bf16 (an FMA may move the last bit)
        diff = (out.float() - ref.float()).abs()
        return torch.isfinite(out.float()).all().item() and (diff <= ref.float().abs() * 2**-7 + 1e-6).all().item()

    # exact int32 accumulators (fp32 out, unit scales): one small and one large config, plus a ragged K
    # every split-K config (twice at one shape: the second launch relies on the first leaving its locks at zero)
    split = [c for c in w8a8_candidates(cap, 256) if c.split_k > 1]
    for m, n, k, cfg in [(300, 384, 3072, w8a8_candidates(cap, 300)[0]), (4096, 3072, 3072, w8a8_candidates(cap, 4096)[0]),
                         (77, 200, 1000, w8a8_candidates(cap, 77)[0])] + [(256, 3072, 12288, c) for c in split] * 2 + [
                         (300, 384, 3072, c) for c in split] + [(77, 200, 1000, c) for c in split if not c.tma]:
        a = torch.randint(-127, 128, (m, k), device=device, dtype=torch.int8)
        b = torch.randint(-127, 128, (n, k), device=device, dtype=torch.int8)
        poison = torch.full((m, n), float("nan"), device=device)
        out = w8a8_mm_triton(a, b, torch.ones(m, 1, device=device), torch.ones(n, device=device), None, None, None,
                             torch.float32, cfg, out=poison)
        # int32 accumulators are exact; both sides round them to fp32 once, so the results are equal
        check(f"int8 gemm exact m={m} n={n} k={k} {cfg.name}",
              torch.isfinite(out).all().item() and torch.equal(out, int8_accumulate_reference(a, b).float()))
    # every benchmark config (bf16 out, bias: the variants the benchmark compiles) against the reference;
    # M = 5: the 16-row tiles offered for few rows; M = 20, 100 and 300: the tiles of the row bands
    for m, n, k in [(5, 3072, 3072), (20, 3072, 3072), (100, 3072, 3072), (300, 3072, 3072), (1000, 3072, 3072),
                    (4096, 3072, 3072)]:
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
            if ref_f is not None and cfg.split_k == 1:  # split-K sums INT8 only
                out = w8a8_mm_triton(af, bf, sa, sb, bias, None, None, torch.bfloat16, cfg)
                rel = ((out.float() - ref_f.float()).norm() / ref_f.float().norm()).item()
                check(f"fp8 gemm m={m} n={n} k={k} {cfg.name}", rel < 1e-2, f"rel err {rel:.1e}")

    for m, n, k in [(5, 384, 3072), (20, 384, 3072), (100, 384, 3072), (300, 384, 3072), (4096, 3072, 3072)]:
        a = torch.randint(-127, 128, (m, k), device=device, dtype=torch.int8)
        packed = torch.randint(-128, 128, (n, k // 2), device=device, dtype=torch.int8)
        s_rel = (torch.rand(n, k // 16, device=device) * 60 + 4).to(FP8)
        table = w4a8_level_table(torch.tensor(FP8_CODEBOOK), device)
        sa, sw = torch.rand(m, 1, device=device) * 1e-3, torch.rand(n, device=device) * 1e-2
        bias = torch.randn(n, device=device, dtype=torch.bfloat16)
        for codebook in (False, True):
            args = (s_rel, table) if codebook else (None, None)
            ref = ops.w4a8_mm(a, packed, sa, sw, bias, *args, 16, 0, torch.bfloat16, "eager")
            for cfg in w4_candidates(cap, m, codebook=codebook):
                a_perm = ops.permute_columns(a, cfg.block_k, ops.plane_run(codebook))
                # default: the codebook's first call checks its in-register decode against the gathers;
                # ptx=True: the in-register decode itself, whatever that check decided
                for ptx in (None, True) if codebook else (None,):
                    poison = torch.full((m, n), float("nan"), device=device, dtype=torch.bfloat16)
                    out = w4a8_mm_triton(a_perm, packed, sa, sw, bias, *args, 16, torch.bfloat16, cfg, out=poison,
                                         ptx=ptx)
                    check(f"w4 gemm codebook={codebook}{' ptx' if ptx else ''} m={m} n={n} k={k} {cfg.name}",
                          close_bf16(out, ref))
        from .triton_w4_expand import expand_w4_int8

        for codebook in (False, True):  # the weight expanded to INT8 (the "triton:expand-" candidates)
            args = (s_rel, table) if codebook else (None, None)
            expected = ops.decode_w4_reference(packed, *args, 16)
            for ptx in (None, True, False):
                levels = expand_w4_int8(packed, *args, 16, ptx=ptx)
                check(f"w4 expand codebook={codebook} ptx={ptx} n={n} k={k}", torch.equal(levels, expected))
    # the few-row W8A16 kernel (the "dequant:<config>" candidates) against its reference: Flux's modulation shapes
    # (one row, 18432 / 9216 x 3072), 16 rows, a ragged N, and every rotation it takes; every output written
    from .gemm_config import w8a16_candidates
    from .reference import weight_only_reference
    from .triton_w8a16_gemm import w8a16_mm_triton

    # (and HadaNorm's: smoothed, centred, Sylvester-rotated; a common offset per row for the centring to take out)
    for m, n, k, rotation, group, fp8, hadanorm in [
            (1, 18432, 3072, "regular", 256, False, False), (1, 9216, 3072, "none", 0, True, False),
            (16, 3072, 12288, "regular", 256, False, False), (3, 1000, 3072, "sylvester", 128, False, False),
            (7, 6144, 3072, "none", 0, False, False), (1, 18432, 3072, "sylvester", 128, False, True),
            (16, 3072, 12288, "sylvester", 128, False, True)]:
        x = (torch.randn(m, k, device=device) * 3 + (5.0 if hadanorm else 0.0)).to(torch.bfloat16)
        x[0, 5] = 80.0  # an outlier channel
        w = (torch.randn(n, k, device=device) * 60).clamp(-448, 448).to(FP8) if fp8 else \
            torch.randint(-127, 128, (n, k), device=device, dtype=torch.int8)
        sw, bias = torch.rand(n, device=device) * 1e-2, torch.randn(n, device=device, dtype=torch.bfloat16)
        smooth = torch.rand(k, device=device) + 0.5 if hadanorm else None
        rowsum = torch.randn(n, device=device) * 20 if hadanorm else None
        ref = weight_only_reference(x, w, sw, bias, torch.float32, rotation, group, smooth, rowsum)
        for cfg in w8a16_candidates(cap):
            poison = torch.full((m, n), float("nan"), device=device)
            out = w8a16_mm_triton(x, w, sw, bias, torch.float32, cfg, rotation, group, poison, smooth, rowsum)
            rel = ((out - ref).norm() / ref.norm()).item()
            # fp32 sums in another order; rotated: a value may round to the other side of a bf16 tie
            check(f"w8a16 m={m} n={n} k={k} {rotation}{group}{' hadanorm' if hadanorm else ''} "
                  f"{'fp8' if fp8 else 'int8'} {cfg.name}",
                  torch.isfinite(out).all().item() and rel < (1e-5 if rotation == "none" else 1e-4), f"rel err {rel:.1e}")
    _check_back_to_back(device, cap, check)
    from .triton_w4_expand import _ptx_checked as _expand_checked
    from .triton_w4_gemm import _ptx_checked
    from .triton_w8a8_gemm import _workspaces

    locks = [held[1] for held in _workspaces.values()]
    check("split-K locks all back at zero after the checks", bool(locks) and not any(t.any().item() for t in locks))

    rejected = [key for key, ok in (*_ptx_checked.items(), *_expand_checked.items()) if not ok]
    check("w4 codebook in-register decode accepted by every variant's first-call check", not rejected,
          f"{len(rejected)} of {len(_ptx_checked) + len(_expand_checked)} variants fell back to gathers")
    return failures


def _check_back_to_back(device: torch.device, cap: tuple[int, int], check, n: int = 3072, k: int = 3072,
                        rows: tuple[int, ...] = (256, 4096), configs: int = 3) -> None:
    """The act-quant and the GEMM launched back to back, as a linear runs them, inputs changing every call: each
    result must equal the one computed with the GPU synchronised between the two launches (a GEMM that read its
    codes early would read the previous call's, left at the same address by the allocator), eagerly and replayed
    in a CUDA graph. The first ``configs`` INT8 candidates and ``configs - 1`` codebook W4 candidates at each of
    the ``rows``. (Session 29 ran this against GEMMs launched with programmatic dependent launch.)"""
    from . import ops
    from .gemm_config import w4_candidates, w8a8_candidates
    from .triton_act_quant import act_quant_triton
    from .triton_w4_gemm import w4a8_mm_triton
    from .triton_w8a8_gemm import w8a8_mm_triton

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    b = torch.randint(-127, 128, (n, k), device=device, dtype=torch.int8)
    packed = torch.randint(-128, 128, (n, k // 2), device=device, dtype=torch.int8)
    s_rel = (torch.rand(n, k // 16, device=device) * 60 + 4).to(FP8)
    table = w4a8_level_table(torch.tensor(FP8_CODEBOOK), device)
    sb = torch.rand(n, device=device) * 1e-2
    bias = torch.randn(n, device=device, dtype=torch.bfloat16)
    gemms = []
    for m in rows:
        gemms += [(m, "int8", cfg) for cfg in w8a8_candidates(cap, m)[:configs]]
        gemms += [(m, "w4a8", cfg) for cfg in w4_candidates(cap, m, codebook=True)[:configs - 1]]
    for m, kind, cfg in gemms:
        xs = [(torch.randn(m, k, device=device) * (1 + i)).to(torch.bfloat16) for i in range(3)]

        def linear(x):
            if kind == "int8":
                q, s, _ = act_quant_triton(x, torch.int8, 127.0, "regular", 256, None, False)
                return w8a8_mm_triton(q, b, s, sb, bias, None, None, torch.bfloat16, cfg)
            q, s, _ = act_quant_triton(x, torch.int8, 127.0, "regular", 256, None, False, cfg.block_k,
                                       perm_run=ops.plane_run(True))
            return w4a8_mm_triton(q, packed, s, sb, bias, s_rel, table, 16, torch.bfloat16, cfg)

        expected = []
        for x in xs:
            sync()
            expected.append(linear(x))
            sync()
        eager = [linear(xs[i % 3]) for i in range(12)]
        sync()
        ok = all(torch.equal(out, expected[i % 3]) for i, out in enumerate(eager))
        if device.type == "cuda":
            static = xs[0].clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = linear(static)
            replays = []
            for i in range(6):
                static.copy_(xs[i % 3])
                graph.replay()
                replays.append(out.clone())
            sync()
            ok = ok and all(torch.equal(r, expected[i % 3]) for i, r in enumerate(replays))
        check(f"act_quant + {kind} gemm back to back m={m} {cfg.name}", ok)
