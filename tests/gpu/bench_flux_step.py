"""Whole-model measurements on a Flux.1-dev-sized model (random weights, real ComfyUI Flux class).

One run, one JSON report (``--out``), every ratio against bf16 measured in the same process:

* quantize: wall time of ``Quantize Model``'s core (``nodes.model_quant.quantize_model``) per mode;
* step: median time of one diffusion-model forward at 1024x1024 (4096 image + 512 text tokens,
  batch 1, eager) per mode, its speed-up over bf16 and its relative output error against the
  bf16 output on the same input;
* offload (``--offload-cap-gb``): bf16 and one quantized mode loaded through ComfyUI's model
  management with the VRAM budget capped below the model's size (partial loading, weight
  streaming); step time and peak VRAM.

A mode ending in ``+attn`` (``bf16+attn``, ``fp8_rowwise+attn``...) runs with the Attention Backend
(LowBit) node's override (``--attention-backend``, default ``auto``: the fastest exact backend,
measured). Its row has ``speedup`` against stock bf16 and ``speedup_vs_bf16_same_attention``
against ``bf16+attn`` when that was measured too. A format followed by ``+unfused``
(``fp8_rowwise+unfused+attn``) is quantized with ``fuse_inputs=False``: its norms and GELUs are
computed as written instead of inside the activation quantization (an A/B of that fusion; it also leaves the
blocks' q, k, v to ComfyUI's ops). ``+noqkv`` keeps that fusion but leaves Flux's double and single blocks as
ComfyUI's: their q, k, v made by ComfyUI's ops instead of in one pass (``nodes/flux_attention.py``).
``+noreplay`` runs with the kernels' launch replays switched off (``kernels/launcher.py``: every call
builds its launches' arguments); ``+floatmods`` keeps the per-block modulation linears in bf16
(``Policy.extra_keep_float``); ``+actmods`` runs the model under a kernel dispatcher that does not compute calls
of at most 16 rows weight-only (``Dispatcher.few_rows_weight_only``; ``kernels/triton_w8a16_gemm.py``), so the
modulation linears' one-row inputs are quantized as before (an A/B of its speed and error); ``+absmax`` quantizes ``w4a4`` weights with comfy-kitchen's abs-max row
scales (``Policy.w4a4_scales``) instead of the searched ones; ``+dvram`` loads the mode's model as ComfyUI does by default on NVIDIA GPUs,
through Dynamic VRAM (comfy-aimdo's ``ModelPatcherDynamic``: weights in RAM, a resident copy in the model's
VRAM "vbar", every layer cast per call; ``bf16+dvram`` is stock bf16 loaded that way, a second copy of the
model); ``+gptq`` quantizes through the GPTQ Quantize Model node's core (``nodes/gptq.py``: stand-in prompts
sampled at the node's resolution, seeds other than the evaluated input's, the node's defaults unless
``--gptq-damp``, ``--gptq-prompts`` or ``--gptq-steps``), so the row's error is GPTQ's and its speed the
format's. Flags combine in any order: ``int8_convrot+floatmods+attn``.

``--rounds R`` (> 0) keeps every mode's model and, after the per-mode pass, times them again in ``R``
interleaved rounds (two consecutive steps of each mode per round, in turn), so that a slow phase of the
GPU or the host hits every mode alike: ``step_s_interleaved`` and ``speedup_interleaved`` (the second
step of each pair, against bf16's) in each row, and each step's host time (until the forward returned,
all its work enqueued: a step whose host time nears its step time waited for the CPU). The first step
of each pair follows another model's step, as no sampler does (the host's caches hold the other
model's objects): ``..._cold`` keys.

Not a pytest file (GPU only). ``--size tiny --device cpu`` is a quick smoke run of the same code.
Usage: ``python tests/gpu/bench_flux_step.py --size dev --modes int8_convrot fp8_rowwise --out r.json``
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger("bench_flux_step")

SIZES = {
    # hidden, double, single, context, vec, image tokens side (latent/2), text tokens
    "dev": dict(hidden_size=3072, depth=19, depth_single_blocks=38, context_in_dim=4096, vec_in_dim=768, side=64, txt=512),
    "tiny": dict(hidden_size=128, depth=2, depth_single_blocks=2, context_in_dim=32, vec_in_dim=16, side=4, txt=8),
}


def import_comfy(device: str, dynamic_vram: bool = False):
    """ComfyUI's modules, set up as its ``main.py`` does (``dynamic_vram``: comfy-aimdo loaded before anything
    touches CUDA and its devices initialised, for ``+dvram`` modes)."""
    comfy_path = os.environ.get("COMFYUI_PATH", os.path.expanduser("~/ComfyUI"))
    sys.path.insert(0, comfy_path)
    import comfy.cli_args

    comfy.cli_args.args.cpu = device == "cpu"
    if dynamic_vram:
        import comfy_aimdo.control

        comfy_aimdo.control.init()
    import comfy.model_management
    import comfy.model_patcher  # noqa: F401
    import comfy.supported_models  # noqa: F401

    if dynamic_vram:
        import comfy.memory_management
        import comfy_aimdo.control

        devices = comfy.model_management.get_all_torch_devices()
        try:
            ok = comfy_aimdo.control.init_devices((d.index, 0) for d in devices)
        except TypeError:  # comfy-aimdo 0.4.9's protocol
            ok = comfy_aimdo.control.init_devices(d.index for d in devices)
        if not ok:
            raise SystemExit("+dvram modes: comfy-aimdo could not initialise the GPU")
        comfy.memory_management.aimdo_enabled = True


def load_dynamic(model, device: torch.device):
    """``model`` (a ComfyUI BaseModel) moved to RAM and loaded by ComfyUI's model manager through Dynamic VRAM
    (``ModelPatcherDynamic``), as a default ComfyUI on an NVIDIA GPU loads a diffusion model."""
    import comfy.model_management
    import comfy.model_patcher

    if device.index is None:  # a vbar belongs to one numbered device
        device = comfy.model_management.get_torch_device()
    model.to("cpu")
    patcher = comfy.model_patcher.ModelPatcherDynamic(model, load_device=device, offload_device=torch.device("cpu"))
    comfy.model_management.load_models_gpu([patcher])
    return patcher


def vbar_residency(dm) -> dict:
    """How many of the model's vbar-managed layers (``_v``) are resident in VRAM (``_v_signature``) now."""
    staged = [m for m in dm.modules() if hasattr(m, "_v")]
    return {"layers": len(staged), "resident": sum(getattr(m, "_v_signature", None) is not None for m in staged)}


def build_flux(size: str, device: torch.device, seed: int = 0):
    """A ModelPatcher over a Flux model of ``size`` with random bf16 weights (outlier input channels)."""
    import comfy.memory_management
    import comfy.model_patcher
    import comfy.supported_models

    s = SIZES[size]
    unet_config = {
        "image_model": "flux", "in_channels": 16, "out_channels": 16, "vec_in_dim": s["vec_in_dim"],
        "context_in_dim": s["context_in_dim"], "hidden_size": s["hidden_size"], "mlp_ratio": 4.0,
        "num_heads": s["hidden_size"] // 128, "depth": s["depth"], "depth_single_blocks": s["depth_single_blocks"],
        "axes_dim": [16, 56, 56], "theta": 10000, "patch_size": 2, "qkv_bias": True, "guidance_embed": True,
        "txt_ids_dims": [],
    }
    config = comfy.supported_models.Flux(unet_config)
    config.set_inference_dtype(torch.bfloat16, None)
    lazy = comfy.memory_management.aimdo_enabled
    comfy.memory_management.aimdo_enabled = False  # with it ComfyUI's layers wait for a state dict for weights
    try:
        model = config.get_model({}, device=device)
    finally:
        comfy.memory_management.aimdo_enabled = lazy
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.diffusion_model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 1 / math.sqrt(p.shape[1]), generator=gen)
                cols = torch.randint(0, p.shape[1], (max(1, p.shape[1] // 512),), device=device, generator=gen)
                p[:, cols] *= 8
            elif name.endswith("norm.weight") or name.endswith("scale"):
                p.fill_(1)
            else:
                p.normal_(0, 0.02, generator=gen)
    model.diffusion_model.to(dtype=torch.bfloat16)
    offload = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=offload)


def inputs(size: str, device: torch.device, seed: int = 1):
    s = SIZES[size]
    gen = torch.Generator(device=device).manual_seed(seed)
    side = s["side"] * 2  # latent side (patch 2)
    x = torch.randn(1, 16, side, side, generator=gen, device=device, dtype=torch.bfloat16)
    ctx = torch.randn(1, s["txt"], s["context_in_dim"], generator=gen, device=device, dtype=torch.bfloat16)
    y = torch.randn(1, s["vec_in_dim"], generator=gen, device=device, dtype=torch.bfloat16)
    t = torch.full((1,), 0.5, device=device, dtype=torch.bfloat16)
    g = torch.full((1,), 3.5, device=device, dtype=torch.bfloat16)
    return x, t, ctx, y, g


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_time(dm, args, device, iters: int, transformer_options: dict | None = None) -> tuple[float, torch.Tensor]:
    x, t, ctx, y, g = args
    opts = {"transformer_options": dict(transformer_options)} if transformer_options else {}
    with torch.inference_mode():
        out = dm(x, t, ctx, y=y, guidance=g, **opts)  # settles the kernel choices (measures them)
        dm(x, t, ctx, y=y, guidance=g, **opts)  # the steady-state plans' first calls (fused variants compile)
        sync(device)
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dm(x, t, ctx, y=y, guidance=g, **opts)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1000)
            else:
                t0 = time.perf_counter()
                dm(x, t, ctx, y=y, guidance=g, **opts)
                times.append(time.perf_counter() - t0)
    return statistics.median(times), out.float()


ATTN_SUFFIX = "+attn"
#: what a mode's ``+flag``s after the format switch (module docstring)
MODE_FLAGS = ("attn", "unfused", "noqkv", "noreplay", "floatmods", "actmods", "dvram", "absmax", "gptq")
FLOAT_MODULATION = r"(_mod|modulation)\.lin$"  # Flux's per-block modulation linears


def parse_mode(mode: str) -> tuple[str, set[str]]:
    """``"fp8_rowwise+unfused+attn"`` -> ``("fp8_rowwise", {"unfused", "attn"})``; unknown flags raise."""
    fmt, *flags = mode.split("+")
    unknown = set(flags) - set(MODE_FLAGS)
    if unknown:
        raise SystemExit(f"mode {mode!r}: unknown flags {sorted(unknown)} (known: {', '.join(MODE_FLAGS)})")
    if "gptq" in flags and ("unfused" in flags or fmt == "bf16"):
        raise SystemExit(f"mode {mode!r}: +gptq quantizes a format through the GPTQ node's core, which fuses the "
                         "inputs (no +unfused)")
    return fmt, set(flags)


@contextlib.contextmanager
def without_block_fusion():
    """Quantize with Flux's blocks left as ComfyUI's: q, k, v made by its own ops (``+noqkv`` modes)."""
    from lowbit.nodes import comfy_ops

    real = comfy_ops.flux_block_classes
    comfy_ops.flux_block_classes = tuple
    try:
        yield
    finally:
        comfy_ops.flux_block_classes = real


def one_pass_blocks(dm) -> int:
    """How many of the model's blocks make their q, k, v in one pass (``nodes/flux_attention.py``)."""
    from lowbit.nodes.flux_attention import FusedDoubleStreamBlockMixin, FusedSingleStreamBlockMixin

    return sum(isinstance(m, (FusedDoubleStreamBlockMixin, FusedSingleStreamBlockMixin)) for m in dm.modules())


class WithoutReplays:
    """A diffusion model called with the kernels' launch replays switched off (``+noreplay`` modes)."""

    def __init__(self, dm):
        self.dm = dm

    def __call__(self, *args, **kwargs):
        from lowbit.kernels.launcher import no_replays

        with no_replays():
            return self.dm(*args, **kwargs)


class WithDispatcher:
    """A diffusion model called under a kernel dispatcher of its own (``+actmods`` modes)."""

    def __init__(self, dm, dispatcher):
        self.dm, self.dispatcher = dm, dispatcher

    def __call__(self, *args, **kwargs):
        from lowbit.kernels.dispatch import use_dispatcher

        with use_dispatcher(self.dispatcher):
            return self.dm(*args, **kwargs)


def without_weight_only(like):
    """A dispatcher like ``like`` that computes calls of at most 16 rows as it does larger ones (activation
    quantized), not weight-only (``Dispatcher.few_rows_weight_only``)."""
    from lowbit.kernels.dispatch import Dispatcher

    return Dispatcher(gpu_tie=like.gpu_tie, few_rows_weight_only=False)


def one_step_s(dm, args, device, transformer_options: dict | None = None) -> tuple[float, float]:
    """Seconds of one forward (CUDA events on a GPU) and seconds until the forward returned on the host
    (all its work enqueued): when the two are close, the step waited for the CPU."""
    x, t, ctx, y, g = args
    opts = {"transformer_options": dict(transformer_options)} if transformer_options else {}
    with torch.inference_mode():
        if device.type != "cuda":
            t0 = time.perf_counter()
            dm(x, t, ctx, y=y, guidance=g, **opts)
            return (time.perf_counter() - t0,) * 2
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sync(device)
        start.record()
        t0 = time.perf_counter()
        dm(x, t, ctx, y=y, guidance=g, **opts)
        host = time.perf_counter() - t0
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000, host


def attention_options(backend: str) -> dict:
    """``transformer_options`` with the Attention Backend (LowBit) node's override for ``backend``."""
    from lowbit.kernels.attention import AttentionChooser, AttentionConfig
    from lowbit.nodes.attention import OVERRIDE_KEY, LowBitAttentionOverride

    return {OVERRIDE_KEY: LowBitAttentionOverride(AttentionChooser(AttentionConfig(backend=backend)))}


def attention_report(options: dict) -> list:
    from lowbit.nodes.attention import OVERRIDE_KEY

    chooser = options[OVERRIDE_KEY].chooser
    return [{**row, "calls": dict(chooser.calls)} for row in chooser.report()] or [{"calls": dict(chooser.calls)}]


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).norm() / ref.norm())


def free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="dev")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--modes", nargs="+", default=["int8", "int8_convrot", "int8_quarot", "int8_hadanorm", "fp8",
                                                  "fp8_rowwise", "w4a8", "w4a4"])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--rounds", type=int, default=0, help="interleaved rounds over all modes after the per-mode pass "
                   "(keeps every mode's model in memory)")
    p.add_argument("--offload-cap-gb", type=float, default=0.0, help="also run the capped-VRAM comparison")
    p.add_argument("--offload-mode", default="int8_convrot")
    p.add_argument("--attention-backend", default="auto", help="the Attention Backend node's backend for +attn modes")
    p.add_argument("--gpu-tie", type=float, default=None,
                   help="the kernel dispatcher's gpu_tie (GPU times this close: the least host time wins); "
                        "default: the dispatcher's own (0 = the least GPU time, as before it existed)")
    p.add_argument("--gptq-damp", type=float, default=None, help="+gptq modes: GPTQ's damp (default: the node's)")
    p.add_argument("--gptq-prompts", type=int, default=None, help="+gptq modes: stand-in prompts (default: the node's)")
    p.add_argument("--gptq-steps", type=int, default=None, help="+gptq modes: recorded steps (default: the node's)")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    dynamic = False
    for mode in a.modes:  # a typo fails before the model is built
        dynamic |= "dvram" in parse_mode(mode)[1]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    device = torch.device(a.device)
    if dynamic and device.type != "cuda":
        raise SystemExit("+dvram modes need a CUDA device (Dynamic VRAM is comfy-aimdo's)")
    import_comfy(device.type, dynamic)
    from lowbit.kernels.dispatch import Dispatcher, use_dispatcher

    dispatcher = Dispatcher() if a.gpu_tie is None else Dispatcher(gpu_tie=a.gpu_tie)
    with use_dispatcher(dispatcher):
        report = _run(a, device)
    report["dispatch"] = {"gpu_tie": dispatcher.gpu_tie, "decisions": dispatcher.decisions,
                          "gpu_timings_us": dispatcher.gpu_timings_us, "host_timings_us": dispatcher.host_timings_us}
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return report


def _run(a, device) -> dict:
    from lowbit.nodes.model_quant import quantize_model
    from lowbit.quant.policy import Policy

    report = {"size": a.size, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "modes": {}}
    t0 = time.perf_counter()
    base = build_flux(a.size, device)
    report["build_s"] = time.perf_counter() - t0
    dm = base.model.diffusion_model
    report["params"] = sum(p.numel() for p in dm.parameters())
    args = inputs(a.size, device)
    bf16_s, ref = step_time(dm, args, device, a.iters)
    report["bf16_step_s"] = bf16_s
    log.info("bf16 step %.4f s (%d params)", bf16_s, report["params"])
    kept = {"bf16": (dm, None)}
    for mode in a.modes:
        row = {}
        fmt, flags = parse_mode(mode)
        options = attention_options(a.attention_backend) if "attn" in flags else None
        fuse = "unfused" not in flags
        keep = (FLOAT_MODULATION,) if "floatmods" in flags else ()
        try:
            if fmt == "bf16" and "dvram" in flags:
                q = load_dynamic(build_flux(a.size, device).model, device)  # the same seed: the same weights
                qdm = q.model.diffusion_model
            elif fmt == "bf16":
                q, qdm = None, dm
            else:
                sync(device)
                t0 = time.perf_counter()
                policy = Policy(mode=fmt, extra_keep_float=keep, w4a4_scales="absmax" if "absmax" in flags else "mse")
                with without_block_fusion() if "noqkv" in flags else contextlib.nullcontext():
                    q = (gptq_model(base, policy, a) if "gptq" in flags
                         else quantize_model(base, policy, fuse_inputs=fuse))
                row.update(fuse_inputs=fuse, extra_keep_float=list(keep), w4a4_scales=policy.w4a4_scales)
                if "gptq" in flags:
                    row["gptq"] = gptq_record(q)
                sync(device)
                row["quantize_s"] = time.perf_counter() - t0
                qdm = q.model.diffusion_model
                row["one_pass_qkv_blocks"] = one_pass_blocks(qdm)
                row["weight_bytes"] = sum(getattr(p, "nbytes", p.numel() * p.element_size()) for p in qdm.parameters())
                if "dvram" in flags:
                    q = load_dynamic(q.model, device)
                qdm = WithoutReplays(qdm) if "noreplay" in flags else qdm
                if "actmods" in flags:
                    from lowbit.kernels.dispatch import current_dispatcher

                    qdm = WithDispatcher(qdm, without_weight_only(current_dispatcher()))
            step_s, out = step_time(qdm, args, device, a.iters, options)
            row.update(step_s=step_s, speedup=bf16_s / step_s, rel_err=rel_err(out, ref))
            if "dvram" in flags:
                row["vbar"] = vbar_residency(q.model.diffusion_model)
            same = report["modes"].get("bf16" + ATTN_SUFFIX, {}).get("step_s")
            if options is not None:
                row["attention"] = attention_report(options)
                if same and fmt != "bf16":
                    row["speedup_vs_bf16_same_attention"] = same / step_s
            if a.rounds > 0:
                kept[mode] = (qdm, options, q)
            del q, qdm, out
        except Exception as err:  # one mode failing must not lose the others' numbers
            log.exception("mode %s failed", mode)
            row["error"] = f"{type(err).__name__}: {err}"
        report["modes"][mode] = row
        log.info("%s: %s", mode, row)
        free(device)
        if a.out:  # partial results survive a run cut short
            Path(a.out).write_text(json.dumps(report, indent=2))
    if a.rounds > 0:
        interleaved(report, kept, args, device, a.rounds)
        kept.clear()
        free(device)
    if a.offload_cap_gb > 0 and device.type == "cuda":
        report["offload"] = offload_compare(base, a, args, device)
    return report


def gptq_model(base, policy, a):
    """``+gptq``: the model quantized by the GPTQ Quantize Model node's core (``nodes/gptq.py``), with the node's
    defaults (stand-in prompts sampled at the node's resolution, other seeds than the evaluated input) but
    ``--gptq-damp`` / ``--gptq-prompts`` / ``--gptq-steps``."""
    from lowbit.nodes import gptq as node
    from lowbit.quant.gptq import GPTQConfig

    def given(value, default):
        return default if value is None else value

    return node.gptq_quantize_model(
        base, policy, steps=given(a.gptq_steps, node.DEFAULT_STEPS),
        prompts=given(a.gptq_prompts, node.DEFAULT_PROMPTS), seed=100, gptq=GPTQConfig(damp=given(a.gptq_damp, node.DEFAULT_DAMP)))


def gptq_record(q) -> dict:
    """What the GPTQ node recorded about its rounding (the saved files' ``lowbit_gptq`` metadata)."""
    from lowbit.nodes.model_quant import model_info

    info = model_info(q)
    return dict(info.gptq) if info is not None and info.gptq else {}


def interleaved(report: dict, kept: dict, args, device, rounds: int) -> None:
    """Every kept mode timed in each round, in turn: two consecutive steps, as a sampler makes them. The
    second ("warm") step gives the medians and ratios in the report's rows; the first ("cold": the
    previous mode's model has just run, so the host's caches hold its objects) is kept as
    ``step_s_interleaved_cold_all`` / ``host_s_interleaved_cold_all``. ``+dvram`` rows also get their ratio
    against ``bf16+dvram`` (``bf16+dvram+attn`` for a ``+attn`` mode: ``speedup_interleaved_vs_bf16_dvram``) when
    it ran, and their vbar residency after the rounds."""
    times = {mode: [] for mode in kept}
    hosts = {mode: [] for mode in kept}
    cold = {mode: [] for mode in kept}
    cold_hosts = {mode: [] for mode in kept}
    for _ in range(rounds):
        for mode, (qdm, options, *_) in kept.items():
            step_s, host_s = one_step_s(qdm, args, device, options)
            cold[mode].append(step_s)
            cold_hosts[mode].append(host_s)
            step_s, host_s = one_step_s(qdm, args, device, options)
            times[mode].append(step_s)
            hosts[mode].append(host_s)
    bf16 = statistics.median(times["bf16"])
    report["bf16_host_s_interleaved"] = statistics.median(hosts["bf16"])
    report["bf16_step_s_interleaved"] = bf16
    report["bf16_step_s_interleaved_cold"] = statistics.median(cold["bf16"])
    for mode, ts in times.items():
        if mode == "bf16":
            continue
        row = report["modes"].setdefault(mode, {})
        row.update(step_s_interleaved=statistics.median(ts), speedup_interleaved=bf16 / statistics.median(ts),
                   step_s_interleaved_all=[round(t, 5) for t in ts],
                   host_s_interleaved_all=[round(t, 5) for t in hosts[mode]],
                   speedup_interleaved_cold=report["bf16_step_s_interleaved_cold"] / statistics.median(cold[mode]),
                   step_s_interleaved_cold_all=[round(t, 5) for t in cold[mode]],
                   host_s_interleaved_cold_all=[round(t, 5) for t in cold_hosts[mode]])
        if "dvram" in parse_mode(mode)[1]:
            row["vbar_after_rounds"] = vbar_residency(kept[mode][2].model.diffusion_model)
            same = "bf16+dvram+attn" if "attn" in parse_mode(mode)[1] else "bf16+dvram"  # bf16, same loading and attention
            if same in times and mode != same:
                row["speedup_interleaved_vs_bf16_dvram"] = statistics.median(times[same]) / row["step_s_interleaved"]
        log.info("%s interleaved: %.4f s, %.3fx (cold %.3fx)", mode, row["step_s_interleaved"],
                 row["speedup_interleaved"], row["speedup_interleaved_cold"])


def offload_compare(base, a, args, device) -> dict:
    """bf16 vs one quantized mode through ComfyUI's model management under a VRAM cap."""
    import comfy.model_management as mm
    from lowbit.nodes.model_quant import quantize_model
    from lowbit.quant.policy import Policy

    result = {"cap_gb": a.offload_cap_gb}
    q = quantize_model(base, Policy(mode=a.offload_mode))
    base.model.to("cpu")
    q.model.to("cpu")
    free(device)
    total = torch.cuda.get_device_properties(device).total_memory
    saved = mm.EXTRA_RESERVED_VRAM
    mm.EXTRA_RESERVED_VRAM = int(total - a.offload_cap_gb * 1024**3)
    try:
        for label, patcher in (("bf16", base), (a.offload_mode, q)):
            mm.unload_all_models()
            free(device)
            torch.cuda.reset_peak_memory_stats(device)
            mm.load_models_gpu([patcher])
            loaded = patcher.loaded_size() if hasattr(patcher, "loaded_size") else None
            step_s, _ = step_time(patcher.model.diffusion_model, args, device, a.iters)
            result[label] = {"step_s": step_s, "peak_vram_gb": torch.cuda.max_memory_allocated(device) / 1024**3,
                             "loaded_gb": None if loaded is None else loaded / 1024**3,
                             "model_gb": patcher.model_size() / 1024**3}
            log.info("offload %s: %s", label, result[label])
    finally:
        mm.EXTRA_RESERVED_VRAM = saved
        mm.unload_all_models()
    return result


if __name__ == "__main__":
    run()
