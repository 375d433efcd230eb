"""Compiled step time per format on a Flux.1-dev-sized model in real ComfyUI (issue 6, Show 2).

Usage (from the repository root; prints the JSON report's path at the end):
  python tests/gpu/bench_compile_step.py --size dev --out compile.json     # bf16 int8_convrot fp8_rowwise w4a4 int8
  python tests/gpu/bench_compile_step.py --size dev --modes bf16 int8_convrot w4a8 --out compile.json
  python tests/gpu/bench_compile_step.py --size tiny --device cpu --backend aot_eager --iters 1   # CPU smoke run

Per mode (``bf16`` = the float model, else a format quantized by Quantize Model's core), in one process,
on the same inputs, compiled the way the Compile Quantized Model node compiles
(``nodes.compile.compile_model``: an ``APPLY_MODEL`` wrapper compiling each repeated block class once,
inductor, dynamic token dimensions, at the first denoiser call):

* eager step: the median denoiser call (``apply_model``, 1024x1024 at dev size, batch 1) uncompiled;
* first call: the first compiled denoiser call, compile included (``compile_s`` = it minus one eager step);
* compiled step: the median compiled denoiser call after warm-up;
* graphs: Dynamo graphs compiled by the first call (one per block class when nothing breaks the
  graph) and during the timed calls (``recompiles``, expected 0); ``failure``: set when the node fell
  back to eager (the compiled numbers are then eager numbers);
* speed-ups against compiled bf16 and eager bf16, and each output's error against eager bf16.

A mode ending in ``+attn`` (``bf16+attn``, ``fp8_rowwise+attn``...) runs through the Attention Backend
(LowBit) node (``--attention-backend``, default ``auto``); its row also has
``speedup_vs_compiled_bf16_same_attention`` against ``bf16+attn`` when that was measured.

Dynamo is reset before each mode (``--keep-dynamo`` does not), so each first compile costs what it costs
in a fresh ComfyUI session (inductor's on-disk caches are kept: a second run of the script compiles faster).
"""

from __future__ import annotations

import argparse
import sys

import torch

import bench_flux_step
from bench_flux_step import ATTN_SUFFIX
from gpu_bench_common import (common_args, denoiser_call, flux_inputs, free, grad_mode, peak_gb, rel_err, reset_peak,
                              setup, time_call, wall)

DEFAULT_MODES = ("bf16", "int8_convrot", "fp8_rowwise", "w4a4", "int8")  # most wanted first
TARGET_SPEEDUP = 1.5


def graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def host_profile(call, device, calls: int) -> dict:
    """Where the host's time goes in ``calls`` compiled steps: the CPU time to enqueue them against the time
    until the GPU is done (equal when the step is bound by the CPU), and a cProfile of the calls (top
    functions by own time and by cumulative time)."""
    import cProfile
    import io
    import pstats
    import time

    from gpu_bench_common import sync

    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        call()
    enqueued = time.perf_counter() - start
    sync(device)
    done = time.perf_counter() - start
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        call()
    prof.disable()
    sync(device)
    out = {"enqueue_ms_per_step": enqueued / calls * 1e3, "done_ms_per_step": done / calls * 1e3}
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).strip_dirs().sort_stats(order).print_stats(30)
        out[f"cprofile_{order}"] = [line for line in text.getvalue().splitlines() if line.strip()][-32:]
    return out


def measure_mode(mode: str, base, inputs, settings, device, a, report, refs: dict) -> None:
    from lowbit.nodes.compile import compile_model, compile_wrapper
    from lowbit.nodes.model_quant import quantize_model, quantized_layers
    from lowbit.quant.policy import Policy

    from lowbit.kernels.attention import AttentionConfig
    from lowbit.nodes.attention import apply_attention_backend, attention_override

    row = report["modes"].setdefault(mode, {})
    reset_peak(device)
    fmt = mode[:-len(ATTN_SUFFIX)] if mode.endswith(ATTN_SUFFIX) else mode
    # The models are built/quantized on the device and never loaded through ComfyUI's model management:
    # a sampler's load would be a no-op for weights already there, and unloading would copy them to the host.
    if fmt == "bf16":
        patcher = base
    else:
        row["quantize_s"], patcher = wall(lambda: quantize_model(base, Policy(mode=fmt)), device)
        row["quantized_layers"] = len(quantized_layers(patcher))
    if fmt != mode:
        patcher = apply_attention_backend(patcher, AttentionConfig(backend=a.attention_backend))
    eager_s, eager_out = time_call(denoiser_call(patcher, inputs), device, a.iters, a.warmup)
    row["eager_step_ms"] = eager_s * 1e3
    if mode == "bf16":
        refs["bf16"] = eager_out.float()
    reference = refs["bf16"]
    row["eager_rel_err_vs_bf16"] = rel_err(eager_out.float(), reference)
    report.save()

    if not a.keep_dynamo:
        torch._dynamo.reset()
    compiled = compile_model(patcher, settings)
    call = denoiser_call(compiled, inputs)
    before = graphs()
    row["first_call_s"], _ = wall(call, device)
    row["compile_s"] = row["first_call_s"] - eager_s
    first = graphs()
    step_s, out = time_call(call, device, a.iters, a.warmup)
    state = compile_wrapper(compiled).state
    row.update(compiled_step_ms=step_s * 1e3, graphs_first_call=first - before, recompiles=graphs() - first,
               failure=state.failure, regions=list(state.regions),
               compiled_rel_err_vs_bf16=rel_err(out.float(), reference),
               compiled_vs_eager_rel=rel_err(out.float(), eager_out.float()),
               compiled_speedup_vs_eager=eager_s / step_s, peak_vram_gb=peak_gb(device))
    if a.cprofile:
        row["host"] = host_profile(call, device, a.cprofile)
    bf16 = report["modes"].get("bf16", {})
    if "compiled_step_ms" in bf16 and not bf16.get("failure"):
        row["speedup_vs_compiled_bf16"] = bf16["compiled_step_ms"] / row["compiled_step_ms"]
    if "eager_step_ms" in bf16:
        row["eager_speedup_vs_eager_bf16"] = bf16["eager_step_ms"] / row["eager_step_ms"]
    same = report["modes"].get("bf16" + ATTN_SUFFIX, {})
    if fmt != mode and fmt != "bf16":
        if "compiled_step_ms" in same and not same.get("failure"):
            row["speedup_vs_compiled_bf16_same_attention"] = same["compiled_step_ms"] / row["compiled_step_ms"]
        if "eager_step_ms" in same:
            row["eager_speedup_vs_eager_bf16_same_attention"] = same["eager_step_ms"] / row["eager_step_ms"]
    if fmt != mode:
        override = attention_override(patcher)
        row["attention"] = {"decisions": override.chooser.report(), "calls": dict(override.chooser.calls)}
    del compiled, patcher


def summarize(report) -> dict:
    rows = {m: r for m, r in report["modes"].items()
            if not m.startswith("bf16") and "speedup_vs_compiled_bf16" in r and not r.get("failure")}
    if not rows:
        return {"best": None}
    best = max(rows, key=lambda m: rows[m]["speedup_vs_compiled_bf16"])
    speedup = rows[best]["speedup_vs_compiled_bf16"]
    return {"best": best, "best_speedup_vs_compiled_bf16": speedup, "target": TARGET_SPEEDUP,
            "target_met": speedup >= TARGET_SPEEDUP,
            "failures": {m: r["failure"] for m, r in report["modes"].items() if r.get("failure")}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(p)
    p.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES),
                   help="bf16 and/or quantization formats (bf16 first: the speed-ups are against it)")
    p.add_argument("--backend", default="inductor", help="the node's backend input")
    p.add_argument("--compile-mode", default="default", help="the node's mode input")
    p.add_argument("--scope", default="blocks", help="the node's scope input (blocks or diffusion_model)")
    p.add_argument("--dynamic", default="tokens", help="the node's dynamic input (tokens or static)")
    p.add_argument("--fullgraph", action="store_true", help="the node's fullgraph input")
    p.add_argument("--keep-dynamo", action="store_true", help="do not reset Dynamo between modes")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="also profile the host side of N compiled steps per mode (enqueue vs done time, cProfile)")
    p.add_argument("--attention-backend", default="auto", help="the Attention Backend node's backend for +attn modes")
    p.add_argument("--no-fuse-gelu", action="store_true", help="compile without the GELU + act-quant fusion pass")
    a = p.parse_args(argv)
    device, report = setup(a, "bench_compile_step")
    from lowbit.nodes.compile import CompileSettings

    settings = CompileSettings(backend=a.backend, mode=a.compile_mode, scope=a.scope, dynamic=a.dynamic,
                               fullgraph=a.fullgraph, fuse_gelu=not a.no_fuse_gelu)
    first = [m for m in ("bf16", "bf16" + ATTN_SUFFIX) if m in a.modes]  # the baselines run first
    modes = first + [m for m in a.modes if m not in first]
    report.data.update(compile=settings.to_dict(), reset_dynamo_per_mode=not a.keep_dynamo, modes={})
    with grad_mode(a.grad_mode):
        report["build_s"], base = wall(lambda: bench_flux_step.build_flux(a.size, device), device)
        report["params"] = sum(t.numel() for t in base.model.diffusion_model.parameters())
        inputs = flux_inputs(a.size, device)
        refs = {}  # the eager bf16 output: the reference of every error
        if "bf16" not in modes:
            refs["bf16"] = denoiser_call(base, inputs)().float()
        for mode in modes:
            try:
                measure_mode(mode, base, inputs, settings, device, a, report, refs)
            except Exception as err:  # one mode failing must not lose the others' numbers
                bench_flux_step.log.exception("mode %s failed", mode)
                report["modes"].setdefault(mode, {})["error"] = f"{type(err).__name__}: {err}"
            free(device)
            report["summary"] = summarize(report)
            report.save()
    return report.finish()


if __name__ == "__main__":
    main()
    sys.exit(0)
