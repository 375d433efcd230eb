"""The act-quant kernel's variants at Flux shapes: time per call and agreement with the original path.

Not a pytest file. On a CUDA machine, from the repository root (``lowbit`` importable)::

    python tests/gpu/bench_act_quant.py --out aq.json

For M in {4096, 4608}, K in {3072, 12288, 15360}, INT8 and FP8 codes and rotation none / regular
256 / sylvester 128, it times every variant of ``lowbit.kernels.triton_act_quant.act_quant_triton``
(``rotate_impl`` "permute" = the original path, "batched", "tf32", "dense"; ``split`` "pow2" = whole rows
padded to a power of two (the original), "pieces" = whole rows as power-of-two pieces over the real
K, "chunks" = the two-pass loop) at a few (tile_elements, num_warps) settings, as the median of
CUDA-graph replays. Each graph cycles through enough input/output buffers that they do not
fit in L2 together (the first read of ``x`` comes from memory, as in a model). Every variant's codes
and scales are compared with the original path's (fraction of equal codes, largest code difference,
largest relative scale difference) and with the fp32 reference (largest code difference).

First ``--compile-workers`` processes compile every variant at once into Triton's on-disk cache
(about 130 kernels; the timing process then finds them there). Variants run in two passes: the first
(baselines and the likely winners) for every shape, then HadaNorm cases (smoothed + centred) and the
rest while ``--budget-s`` lasts; a variant that fails (compile, resources) is recorded with its error
and the run goes on. The JSON report is rewritten after every shape, so a run cut short keeps what
it measured. ``--device cpu`` runs a tiny smoke version in the Triton interpreter (no timing meaning).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

log = logging.getLogger("bench_act_quant")

L2_FLUSH_BYTES = 150e6  # buffers per graph: their codes and activations together exceed an H200's 50 MB L2 three times
CALLS_PER_GRAPH = 8


@dataclass(frozen=True)
class Variant:
    rotate_impl: str  # "permute" (original), "batched", "tf32", "dense"
    split: str  # "pow2" (original: whole rows padded to a power of two), "pieces", "chunks"
    tile_elements: int | None = None  # None: the kernel's default
    num_warps: int | None = None
    chunk: int = 1024  # split="chunks" only
    num_stages: int | None = None  # split="chunks" only (the loop's pipelining); None: Triton's default
    precise_fp8: bool = True  # False: FP8 rotation with hi operands only (one product a stage)
    max_registers: int | None = None  # the compiler's register cap per thread (maxnreg)

    @property
    def label(self) -> str:
        split = f"chunks{self.chunk}" if self.split == "chunks" else self.split
        extra = "" if self.num_stages is None else f"/s{self.num_stages}"
        extra += "" if self.precise_fp8 else "/fp8hi"
        extra += "" if self.max_registers is None else f"/r{self.max_registers}"
        return f"{self.rotate_impl}/{split}/tile{self.tile_elements or 'auto'}/w{self.num_warps or 'auto'}{extra}"


V = Variant
BASELINE = V("permute", "pow2")
# pass 1: the original path and the variants most likely to win (by their sm_90 SASS: instructions per
# element, registers, shared memory); pass 2: the rest of the sweep, while the time budget lasts
ROTATED = (
    [BASELINE, V("batched", "pow2"), V("tf32", "pow2"), V("batched", "pieces"), V("tf32", "pieces"),
     V("tf32", "pieces", None, 4), V("tf32", "pieces", None, 16), V("tf32", "chunks", 1024, 4, 1024, 1),
     V("permute", "pow2", precise_fp8=False), V("tf32", "pieces", precise_fp8=False)],
    [V("permute", "pow2", None, 4), V("batched", "pow2", None, 4), V("tf32", "pow2", None, 16),
     V("permute", "pieces"), V("batched", "pieces", None, 16), V("batched", "pieces", None, 4),
     V("tf32", "pieces", 8192, 8), V("tf32", "pieces", 8192, 16), V("tf32", "pieces", max_registers=80),
     V("tf32", "pieces", None, 16, max_registers=64), V("tf32", "pieces", 8192, 8, max_registers=80),
     V("dense", "pow2"), V("batched", "chunks", 1024, 4, 1024), V("batched", "chunks", 4096, 8, 1024),
     V("tf32", "chunks", 2048, 4, 2048, 1), V("tf32", "chunks", 4096, 8, 1024, 1),
     V("permute", "chunks", 1024, 4, 1024),
     V("dense", "chunks", 4096, 8, 1024, 1), V("batched", "pieces", precise_fp8=False),
     V("tf32", "pieces", None, 16, precise_fp8=False)],
)
PLAIN = (
    [BASELINE, V("permute", "pieces"), V("permute", "chunks", 4096, 4, 1024)],
    [V("permute", "pow2", 8192, 8), V("permute", "pieces", 8192, 8), V("permute", "pieces", None, 16),
     V("permute", "chunks", 2048, 4, 2048)],
)
# pass 2 extras: HadaNorm (smoothed + centred, sylvester 128) and W4A4 activations (INT4 range, regular 256, codes
# in the 4-bit GEMM's nibble-plane order: perm_block 128)
EXTRA = [BASELINE, V("tf32", "pieces"), V("batched", "pieces"), V("tf32", "pieces", None, 4)]
W4A4_PERM_BLOCK = 128
ROTATIONS = (("regular", 256), ("sylvester", 128), ("none", 0))  # ConvRot first: the W8A8 target


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_act_quant.json", help="JSON report path")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run in the Triton interpreter")
    parser.add_argument("--size", choices=("flux", "tiny"), default=None,
                        help="flux: the shapes above (default on cuda); tiny: M 24, K 768 and 1280 (default on cpu)")
    parser.add_argument("--m", type=int, nargs="+", default=None, help="token counts (default 4096 4608)")
    parser.add_argument("--k", type=int, nargs="+", default=None, help="feature counts (default 3072 12288 15360)")
    parser.add_argument("--iters", type=int, default=15, help="timed graph replays per variant (median reported)")
    parser.add_argument("--budget-s", type=float, default=70.0,
                        help="no new variant starts after this many seconds (imports and compiling included)")
    parser.add_argument("--pass1-only", action="store_true", help="skip the second pass of variants")
    parser.add_argument("--compile-workers", type=int, default=8,
                        help="processes that compile every variant first, into Triton's cache (0: compile in turn)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    started = time.perf_counter()  # the budget counts the imports too
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    cpu = args.device == "cpu"
    if cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported
    import torch
    import triton

    from lowbit.kernels.reference import FP8, act_quant_reference
    from lowbit.kernels.triton_act_quant import DEFAULT_ROTATE_IMPL, DEFAULT_SPLIT

    device = torch.device(args.device)
    tiny = args.size == "tiny" or (args.size is None and cpu)
    ms = args.m or ([24] if tiny else [4096, 4608])
    ks = args.k or ([768, 1280] if tiny else [3072, 12288, 15360])
    report = {
        "script": "bench_act_quant", "torch": torch.__version__, "triton": triton.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter)",
        "default": {"rotate_impl": DEFAULT_ROTATE_IMPL, "split": DEFAULT_SPLIT},
        "timer": (f"median of {args.iters} CUDA-graph replays of {CALLS_PER_GRAPH}+ calls cycling through buffers "
                  f"of >= {L2_FLUSH_BYTES / 1e6:.0f} MB together; us per call" if not cpu else "perf_counter, 1 call"),
        "baseline": BASELINE.label, "results": [], "skipped": [], "best": {},
    }
    path = Path(args.out)

    def save():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, path)

    cases = [(m, k, codes, rotation, group, "") for codes in ("int8", "fp8") for rotation, group in ROTATIONS
             for k in ks for m in ms]
    extras = [(ms[0], k, "int8", rotation, group, extra) for extra, rotation, group in
              (("hadanorm", "sylvester", 128), ("w4a4", "regular", 256)) for k in ks]
    passes = [(0, cases)] if args.pass1_only or cpu else [(0, cases), (1, extras + cases)]
    if not cpu and args.compile_workers > 0:
        report["compile_s"] = _compile_everything(passes, args.compile_workers, started + args.budget_s * 0.6)
        log.info("variants compiled into Triton's cache in %.1f s", report["compile_s"])
    for pass_index, pass_cases in passes:
        for m, k, codes, rotation, group, extra in pass_cases:
            variants = _variants(pass_index, rotation, extra)
            out_dtype = FP8 if codes == "fp8" else torch.int8
            bench = _Case(torch, device, m, k, out_dtype, rotation, group, act_quant_reference, extra)
            for variant in variants:
                if not _runs(variant, pass_index, codes, extra):
                    continue
                row = {"m": m, "k": k, "codes": codes, "rotation": rotation, "group": group, "pass": pass_index + 1,
                       "extra": extra, "label": variant.label, "variant": asdict(variant)}
                if time.perf_counter() - started > args.budget_s:
                    report["skipped"].append(row)
                    continue
                row.update(bench.measure(variant, args.iters, cpu))
                report["results"].append(row)
                log.info("%s", _line(row))
            del bench
            _best(report)
            save()
    _best(report)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    save()
    _print_summary(report)
    print(f"JSON report: {path.resolve()}")
    return 0


def _variants(pass_index: int, rotation: str, extra: str) -> list:
    return EXTRA if extra else (PLAIN if rotation == "none" else ROTATED)[pass_index]


def _runs(variant: "Variant", pass_index: int, codes: str, extra: str) -> bool:
    """Whether a case runs this variant: the baseline once, FP8 precision only for FP8 codes."""
    return not ((pass_index == 1 and variant == BASELINE and not extra)
                or (codes == "int8" and not variant.precise_fp8))


def _compile_everything(passes, workers: int, deadline: float) -> float:
    """Compile every variant a run will time, in ``workers`` processes at once (Triton keeps them in
    its on-disk cache, where the timing process then finds them). Fails soft: whatever is not
    compiled by ``deadline`` is compiled when first timed."""
    import multiprocessing

    start = time.perf_counter()
    groups: dict[tuple, list] = {}  # one worker per (variant, codes, rotation): its K share kernels; pass 1 first
    for pass_index, cases in passes:
        for _, k, codes, rotation, group, extra in cases:
            if rotation == "sylvester" and not extra:
                continue  # the same kernels as regular 256 (both two-stage)
            for variant in _variants(pass_index, rotation, extra):
                job = (k, codes, rotation, group, extra, variant)
                jobs = groups.setdefault((variant, codes, rotation, extra), [])
                if _runs(variant, pass_index, codes, extra) and job not in jobs:
                    jobs.append(job)
    shares = [[] for _ in range(workers)]
    for i, jobs in enumerate(groups.values()):
        shares[i % workers].extend(jobs)
    pool = multiprocessing.get_context("spawn").Pool(workers)
    try:
        pool.map_async(_compile_share, shares).get(timeout=max(1.0, deadline - time.perf_counter()))
    except Exception as err:  # a timeout or a worker that died: the timing loop compiles the rest itself
        log.warning("compiling ahead stopped: %s: %s", type(err).__name__, err)
    finally:
        pool.terminate()
        pool.join()
    return round(time.perf_counter() - start, 1)


def _compile_share(jobs) -> None:
    """A compile worker: one launch of each variant on a 16-row input (the same kernels as 4096 rows)."""
    import torch

    from lowbit.kernels.reference import FP8
    from lowbit.kernels.triton_act_quant import act_quant_triton

    for k, codes, rotation, group, extra, variant in jobs:
        try:
            x = torch.zeros(16, k, dtype=torch.bfloat16, device="cuda")
            smooth = torch.ones(k, device="cuda") if extra == "hadanorm" else None
            act_quant_triton(x, FP8 if codes == "fp8" else torch.int8, _qmax(codes, extra), rotation, group, smooth,
                             extra == "hadanorm", W4A4_PERM_BLOCK if extra == "w4a4" else 0,
                             tile_elements=variant.tile_elements,
                             num_warps=variant.num_warps, rotate_impl=variant.rotate_impl, split=variant.split,
                             chunk=variant.chunk, num_stages=variant.num_stages, precise_fp8=variant.precise_fp8,
                             max_registers=variant.max_registers)
        except Exception:  # reported by the timing process, which meets the same error
            pass


def _qmax(codes: str, extra: str) -> float:
    return 448.0 if codes == "fp8" else 7.0 if extra == "w4a4" else 127.0


class _Case:
    """One shape and code format: its inputs (several buffers), the original path's codes, the reference's."""

    def __init__(self, torch, device, m, k, out_dtype, rotation, group, reference, extra=""):
        self.torch, self.device = torch, device
        self.m, self.k, self.out_dtype, self.rotation, self.group = m, k, out_dtype, rotation, group
        self.qmax = _qmax("fp8" if out_dtype != torch.int8 else "int8", extra)
        self.perm_block = W4A4_PERM_BLOCK if extra == "w4a4" else 0
        buffers = 1 if device.type == "cpu" else max(1, min(8, math.ceil(L2_FLUSH_BYTES / (m * k * 3))))
        gen = torch.Generator(device="cpu").manual_seed(m + k)
        self.smooth = (torch.rand(k, generator=gen) + 0.5).to(device) if extra == "hadanorm" else None
        self.center = extra == "hadanorm"
        self.xs, self.outs = [], []
        for i in range(buffers):
            x = torch.randn(m, k, generator=gen) * 2
            x[:, (torch.arange(8) * 997 + i) % k] *= 30.0  # a few outlier channels, as in real activations
            self.xs.append(x.to(device=device, dtype=torch.bfloat16))
            self.outs.append(torch.empty(m, k, dtype=out_dtype, device=device))
        self._baseline = None
        self._reference = reference

    def call(self, variant: "Variant", i: int = 0, out=True):
        from lowbit.kernels.triton_act_quant import act_quant_triton

        return act_quant_triton(self.xs[i], self.out_dtype, self.qmax, self.rotation, self.group, self.smooth,
                                self.center, self.perm_block, out=self.outs[i] if out else None, tile_elements=variant.tile_elements,
                                num_warps=variant.num_warps, rotate_impl=variant.rotate_impl, split=variant.split,
                                chunk=variant.chunk, num_stages=variant.num_stages, precise_fp8=variant.precise_fp8,
                                max_registers=variant.max_registers)

    def baseline(self):
        if self._baseline is None:
            self._baseline = self.call(BASELINE, out=False)
        return self._baseline

    def reference(self):
        if not isinstance(self._reference, tuple):
            from lowbit.kernels.ops import permute_columns

            q, scale, mean = self._reference(self.xs[0], self.out_dtype, self.qmax, self.rotation, self.group,
                                             self.smooth, self.center)
            self._reference = (permute_columns(q, self.perm_block), scale, mean)
        return self._reference

    def measure(self, variant: "Variant", iters: int, cpu: bool) -> dict:
        torch = self.torch
        row = {}
        try:
            start = time.perf_counter()
            q, scale, _ = self.call(variant, out=False)
            self._sync()
            row["first_call_s"] = round(time.perf_counter() - start, 3)
            row.update(self._agreement(q, scale, variant.precise_fp8))
            del q, scale
            row["us"] = self._time(variant, iters, cpu)
            row["gbps"] = round(self.m * self.k * 3 / row["us"] / 1e3, 1)
        except Exception as err:  # fail soft: a variant that does not compile or launch here is reported
            row["error"] = f"{type(err).__name__}: {err}"[:500]
            if self.device.type == "cuda":
                try:
                    torch.cuda.synchronize(self.device)
                except Exception as sync_err:  # the context is gone: nothing later can run
                    raise SystemExit(f"CUDA context lost after {variant.label}: {sync_err}") from err
        return row

    def _agreement(self, q, scale, precise_fp8: bool) -> dict:
        torch = self.torch
        q_base, scale_base, _ = self.baseline()
        q_ref, scale_ref, _ = self.reference()
        fp8 = self.out_dtype != torch.int8
        as_number = (lambda t: t.float()) if fp8 else (lambda t: t.int())
        diff_base = (as_number(q) - as_number(q_base)).abs()
        diff_ref = (as_number(q) - as_number(q_ref)).abs()
        equal = (q.view(torch.int8) == q_base.view(torch.int8)).float().mean().item()
        scale_rel = ((scale - scale_base).abs() / scale_base).max().item()
        scale_rel_ref = ((scale - scale_ref).abs() / scale_ref).max().item()
        if fp8:  # within one e4m3 step of the reference (relative 1/8, or the smallest subnormal)
            step = as_number(q_ref).abs() * 0.125 + 2**-9
            if not precise_fp8:  # or, hi-only operands: within 2^-11 of the row maximum (448 code units)
                step = torch.maximum(step, torch.full_like(step, self.qmax * 2**-11))
            near = bool((diff_ref <= step).all().item())
        else:
            near = diff_ref.max().item() <= 1
        ref_equal = (q.view(torch.int8) == q_ref.view(torch.int8)).float().mean().item()
        return {"codes_equal_vs_baseline": round(equal, 6), "codes_max_diff_vs_baseline": diff_base.max().item(),
                "scale_max_rel_vs_baseline": scale_rel, "codes_equal_vs_reference": round(ref_equal, 6),
                "codes_max_diff_vs_reference": diff_ref.max().item(), "scale_max_rel_vs_reference": scale_rel_ref,
                "ok": bool(near and ref_equal > 0.97 and scale_rel_ref <= 2**-10
                           and torch.isfinite(q.float()).all().item())}

    def _time(self, variant: "Variant", iters: int, cpu: bool) -> float:
        torch = self.torch
        if cpu:
            start = time.perf_counter()
            self.call(variant)
            return round((time.perf_counter() - start) * 1e6, 1)
        buffers = len(self.xs)
        calls = [i % buffers for i in range(max(CALLS_PER_GRAPH, buffers))]
        for i in range(buffers):
            self.call(variant, i)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in calls:
                self.call(variant, i)
        graph.replay()
        graph.replay()
        torch.cuda.synchronize(self.device)
        times = []
        for _ in range(max(1, iters)):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / len(calls))
        del graph
        return round(statistics.median(times), 2)

    def _sync(self):
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)


def _case_key(row: dict) -> str:
    extra = f"+{row['extra']}" if row.get("extra") else ""
    return f"m{row['m']} k{row['k']} {row['codes']} {row['rotation']}{row['group'] or ''}{extra}"


def _best(report: dict) -> None:
    """Per shape: the original path's time and the fastest variant whose codes passed the checks."""
    cases: dict[str, list[dict]] = {}
    for row in report["results"]:
        cases.setdefault(_case_key(row), []).append(row)
    best = {}
    for key, rows in cases.items():
        timed = [r for r in rows if "us" in r and r.get("ok")]
        base = next((r["us"] for r in rows if r["label"] == BASELINE.label and "us" in r), None)
        if not timed:
            continue
        top = min(timed, key=lambda r: r["us"])
        best[key] = {"best": top["label"], "us": top["us"], "baseline_us": base,
                     "speedup": round(base / top["us"], 3) if base else None,
                     "failed": [r["label"] for r in rows if "error" in r or not r.get("ok", False)]}
    report["best"] = best


def _line(row: dict) -> str:
    if "error" in row:
        return f"{_case_key(row):<32} {row['label']:<36} FAILED {row['error'][:160]}"
    return (f"{_case_key(row):<32} {row['label']:<36} {row['us']:9.2f} us {row['gbps']:7.1f} GB/s "
            f"equal {row['codes_equal_vs_baseline']:.4f} ref-diff {row['codes_max_diff_vs_reference']:.3g} "
            f"{'ok' if row['ok'] else 'NOT OK'} (first call {row['first_call_s']}s)")


def _print_summary(report: dict) -> None:
    print("\nfastest variant per shape (codes checked against the reference):")
    for key, best in report["best"].items():
        print(f"  {key:<32} {best['best']:<36} {best['us']:9.2f} us  original {best['baseline_us']} us  "
              f"x{best['speedup']}")
    if report["skipped"]:
        print(f"{len(report['skipped'])} variant runs skipped (over --budget-s)")


if __name__ == "__main__":
    sys.exit(main())
