"""Where one Flux step spends its GPU time, per format: a CUDA-profiler breakdown (not a pytest file).

For bf16 and each ``--modes`` entry, on the Flux model of ``bench_flux_step`` (random weights, the real
ComfyUI Flux class): two warm-up steps (the kernel dispatcher measures and settles on the first), then
one profiled step. It also measures the CPU cost of one linear layer's call (see
:func:`host_cost`): an eager step is as slow as the slower of its GPU work and its CPU launches. The report groups the CUDA kernel time into GEMM, activation quantization,
attention and the rest ("other": norms, modulation, RoPE, GELU, adds, copies), lists the top kernels,
and records the dispatcher's decisions for the mode, so a step that is slower than its linears
promise shows where the time went.

A mode's ``+unfused`` flag quantizes with ``fuse_inputs=False``, ``+noqkv`` leaves the blocks' q, k, v to
ComfyUI's ops, ``+floatmods`` keeps the modulation linears in bf16, ``+dvram`` loads the model through Dynamic VRAM (``bench_flux_step``'s flags; ``bf16+dvram`` is stock bf16
so loaded; the attention backend is ``--attention-backend`` here).

Usage: ``python tests/gpu/profile_flux_step.py --size dev --modes int8_convrot fp8_rowwise --out prof.json``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

import bench_flux_step as bfs

log = logging.getLogger("profile_flux_step")

#: kernel-name patterns per category, tried in order (first match wins)
CATEGORIES = (
    ("act_quant", re.compile(r"act_quant", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|softmax", re.I)),
    # cuBLAS 12.x/13.x names its Hopper GEMMs "nvjet_sm90_..." (bf16 F.linear, FP8 _scaled_mm)
    ("gemm", re.compile(r"gemm|_mm_|w8a8|w4a8|w4_|matmul|sm90_xmma|cutlass|int8_mm|scaled_mm|cublas|nvjet", re.I)),
)


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            return label
    return "other"


def profile_step(step, device) -> dict:
    """Two warm-up calls of ``step()`` (one denoiser step), then one under the CUDA profiler: totals per
    category and top kernels (ms)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        for _ in range(2):
            step()
        bfs.sync(device)
        walls = []
        for _ in range(3):  # wall time of a step (GPU work and CPU launches overlapped, as a sampler runs it)
            t0 = time.perf_counter()
            step()
            bfs.sync(device)
            walls.append((time.perf_counter() - t0) * 1000.0)
        activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            step()
            bfs.sync(device)
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if device.type == "cuda" and event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        if device.type != "cuda" and event.cpu_parent is not None:  # CPU smoke run: top-level ops only
            continue
        us = event.device_time if device.type == "cuda" else event.cpu_time
        per_kernel[event.name][0] += us / 1000.0
        per_kernel[event.name][1] += 1
    totals: dict[str, float] = defaultdict(float)
    for name, (ms, _) in per_kernel.items():
        totals[category(name)] += ms
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:25]
    return {
        "step_wall_ms": round(statistics.median(walls), 3),
        "total_ms": round(sum(totals.values()), 3),
        "by_category_ms": {k: round(v, 3) for k, v in sorted(totals.items())},
        "top_kernels": [{"name": name[:160], "ms": round(ms, 3), "calls": calls,
                         "category": category(name)} for name, (ms, calls) in top],
    }


def step_cprofile(step, device, top: int = 40) -> dict:
    """cProfile of one whole (warmed-up) step on the host: the functions with the most self time and the
    most cumulative time. Profiling slows every Python call, so read the shares, not the microseconds."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    with torch.inference_mode():
        step()
        bfs.sync(device)
        prof.enable()
        step()
        prof.disable()
        bfs.sync(device)
    out = {}
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).strip_dirs().sort_stats(order).print_stats(top)
        out[order] = [line for line in text.getvalue().splitlines() if line.strip()][-top - 1:]
    return out


def host_cost(layer, device, calls: int = 300) -> dict:
    """CPU cost of one call of ``layer`` (µs) with an input of 16 tokens, so the GPU work is negligible
    and the queue never throttles the CPU; for a LowBit layer also its format's ``codec.linear`` alone
    (the module's own wrapper is the difference) and a cProfile of the module calls (top 15 by self time)."""
    import cProfile
    import io
    import pstats

    x = torch.randn(1, 16, layer.in_features, device=device, dtype=torch.bfloat16)

    def per_call_us(fn) -> float:
        with torch.inference_mode():
            for _ in range(20):
                fn()
            bfs.sync(device)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            elapsed = time.perf_counter() - t0
            bfs.sync(device)
        return elapsed / calls * 1e6

    out = {"module_us": round(per_call_us(lambda: layer(x)), 2)}
    fmt = getattr(layer, "lowbit_format", None)
    if fmt:
        from lowbit.quant.compiled_linear import op_arguments, quantized_linear_op
        from lowbit.quant.formats import get_format

        codec = get_format(fmt)
        out["codec_linear_us"] = round(per_call_us(lambda: codec.linear(x, layer.weight, layer.bias)), 2)
        op_args = op_arguments(fmt, x, layer.weight, layer.bias)  # what a compiled graph calls per layer
        out["compiled_op_us"] = round(per_call_us(lambda: quantized_linear_op(*op_args)), 2)
        prof = cProfile.Profile()
        with torch.inference_mode():
            prof.enable()
            for _ in range(calls):
                layer(x)
            prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).strip_dirs().sort_stats("tottime").print_stats(15)
        out["cprofile"] = text.getvalue().splitlines()[-22:]
    return out


def step_factory(a, device):
    """``step(model_patcher)`` -> a zero-argument callable running one denoiser step of it: the diffusion
    model called directly (eager), or through ``apply_model`` with the Compile Quantized Model node's
    wrapper (``--compile``); through the Attention Backend node when ``--attention-backend`` is set."""
    import gpu_bench_common as common

    args = bfs.inputs(a.size, device)
    inputs = common.flux_inputs(a.size, device)

    def step(patcher):
        if a.attention_backend:
            from lowbit.kernels.attention import AttentionConfig
            from lowbit.nodes.attention import apply_attention_backend

            patcher = apply_attention_backend(patcher, AttentionConfig(backend=a.attention_backend))
        if a.compile:
            from lowbit.nodes.compile import CompileSettings, compile_model

            torch._dynamo.reset()
            return common.denoiser_call(compile_model(patcher, CompileSettings(mode=a.compile_mode)), inputs)
        x, t, ctx, y, g = args
        options = dict(patcher.model_options.get("transformer_options", {}))
        return lambda: patcher.model.diffusion_model(x, t, ctx, y=y, guidance=g, transformer_options=options)

    return step


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(bfs.SIZES), default="dev")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--modes", nargs="+", default=["int8_convrot", "fp8", "fp8_rowwise", "w4a8"])
    p.add_argument("--compile", action="store_true",
                   help="profile the step compiled as the Compile Quantized Model node compiles it (inductor)")
    p.add_argument("--compile-mode", default="default", help="the node's mode input with --compile (e.g. reduce-overhead)")
    p.add_argument("--attention-backend", default="",
                   help="run through the Attention Backend node with this backend (e.g. auto); default: off")
    p.add_argument("--host-profile", action="store_true",
                   help="also cProfile one whole step per mode on the host (where an eager step's CPU time goes)")
    p.add_argument("--out", default="profile_flux_step.json")
    a = p.parse_args(argv)
    dynamic = False
    for mode in a.modes:  # a typo, or a flag this profile does not apply, fails before the model is built
        fmt, flags = bfs.parse_mode(mode)
        if flags - {"unfused", "noqkv", "floatmods", "dvram"} or (fmt == "bf16" and flags != {"dvram"}):
            raise SystemExit(f"mode {mode!r}: only the +unfused, +noqkv, +floatmods and +dvram flags apply here "
                             "(bf16 only as bf16+dvram)")
        dynamic |= "dvram" in flags
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    device = torch.device(a.device)
    if dynamic and device.type != "cuda":
        raise SystemExit("+dvram modes need a CUDA device (Dynamic VRAM is comfy-aimdo's)")
    bfs.import_comfy(device.type, dynamic)
    from lowbit.kernels.dispatch import current_dispatcher
    from lowbit.nodes.model_quant import quantize_model
    from lowbit.quant.policy import Policy

    report = {"size": a.size, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "runs": {}}
    base = bfs.build_flux(a.size, device)
    report.update(compile=a.compile, attention_backend=a.attention_backend or None)
    step = step_factory(a, device)
    report["runs"]["bf16"] = profile_step(step(base), device)
    if a.host_profile:
        report["runs"]["bf16"]["host_step"] = step_cprofile(step(base), device)
    report["runs"]["bf16"]["host"] = host_cost(base.model.diffusion_model.double_blocks[0].img_attn.qkv, device)
    log.info("bf16: %s", report["runs"]["bf16"]["by_category_ms"])
    for mode in a.modes:
        try:
            fmt, flags = bfs.parse_mode(mode)  # "+unfused": norms and GELUs computed as written
            keep = (bfs.FLOAT_MODULATION,) if "floatmods" in flags else ()
            if fmt == "bf16":  # bf16+dvram: a second copy of the model (same seed, same weights)
                q = bfs.build_flux(a.size, device)
            else:
                with bfs.without_block_fusion() if "noqkv" in flags else contextlib.nullcontext():
                    q = quantize_model(base, Policy(mode=fmt, extra_keep_float=keep),
                                       fuse_inputs="unfused" not in flags)
            if "dvram" in flags:
                q = bfs.load_dynamic(q.model, device)
            before = set(current_dispatcher().decisions)
            row = profile_step(step(q), device)
            if a.host_profile:
                row["host_step"] = step_cprofile(step(q), device)
            row["host"] = host_cost(q.model.diffusion_model.double_blocks[0].img_attn.qkv, device)
            dispatcher = current_dispatcher()
            row["decisions"] = {k: v for k, v in dispatcher.decisions.items() if k not in before}
            row["timings_us"] = {k: dispatcher.timings_us.get(k) for k in row["decisions"]}
            del q
        except Exception as err:  # one mode failing must not lose the others
            log.exception("mode %s failed", mode)
            row = {"error": f"{type(err).__name__}: {err}"}
        report["runs"][mode] = row
        log.info("%s: %s", mode, row.get("by_category_ms", row.get("error")))
        bfs.free(device)
        Path(a.out).write_text(json.dumps(report, indent=2))
    Path(a.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
