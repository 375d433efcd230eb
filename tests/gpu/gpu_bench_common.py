"""Pieces shared by the whole-model GPU measurement scripts in ``tests/gpu`` (not a pytest file).

* :func:`common_args` / :func:`setup`: the flags every script takes (``--size``, ``--device``,
  ``--iters``, ``--out``...) and the ComfyUI import in the right order (``--device cpu`` sets
  ComfyUI's ``--cpu`` before ``comfy.model_management`` is imported);
* :class:`Report`: the JSON report, rewritten after every phase so a run cut short keeps its numbers;
* :func:`time_call`: the median of ``iters`` calls after ``warmup`` calls, timed with CUDA events on
  a GPU (``perf_counter`` on the CPU);
* :func:`denoiser_call`: one call of a ComfyUI ``ModelPatcher``'s denoiser the way a sampler makes it
  (``apply_model`` with the patcher's wrappers in ``transformer_options``), weights loaded first
  through ComfyUI's model management (which also runs the patcher's injections: LoRA hooks, merges).

The Flux model itself (random weights, outlier input channels, the real ComfyUI class) comes from
``bench_flux_step.build_flux``; sizes from ``bench_flux_step.SIZES``.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

import bench_flux_step

log = logging.getLogger("gpu_bench")
SIZES = bench_flux_step.SIZES


def common_args(parser: argparse.ArgumentParser, *, iters: int = 5) -> argparse.ArgumentParser:
    parser.add_argument("--size", choices=sorted(SIZES), default="dev",
                        help="model size: dev = Flux.1-dev (12B, 1024x1024 image), tiny = CPU smoke run")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--iters", type=int, default=iters, help="timed calls per measurement (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls before each measurement")
    parser.add_argument("--grad-mode", choices=("inference", "no_grad"), default="inference",
                        help="inference: torch.inference_mode, as ComfyUI runs its nodes; no_grad: torch.no_grad")
    parser.add_argument("--attention", choices=("comfy", "pytorch"), default="comfy",
                        help="comfy: the attention ComfyUI picks for the device (PyTorch SDPA on an NVIDIA GPU); "
                             "pytorch: force ComfyUI's attention_pytorch (SDPA), as the compile tests do on the CPU")
    parser.add_argument("--out", default="", help="JSON report path (default: <script>_<size>.json here)")
    return parser


def setup(args: argparse.Namespace, script: str) -> tuple[torch.device, "Report"]:
    """Logging, ComfyUI imported for ``args.device``, and an empty report at ``args.out``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    device = torch.device(args.device)
    bench_flux_step.import_comfy(device.type)
    import comfy.ldm.flux.math
    import comfy.ldm.modules.attention

    if args.attention == "pytorch":
        comfy.ldm.flux.math.optimized_attention = comfy.ldm.modules.attention.attention_pytorch
    path = Path(args.out or f"{script}_{args.size}.json")
    report = Report(path, {
        "script": script, "size": args.size, "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "iters": args.iters, "warmup": args.warmup, "grad_mode": args.grad_mode,
        "timer": "cuda events, median" if device.type == "cuda" else "perf_counter, median",
        "attention": getattr(comfy.ldm.flux.math.optimized_attention, "__name__", "?"),
    })
    report.save()
    return device, report


def grad_mode(name: str):
    return torch.inference_mode() if name == "inference" else torch.no_grad()


class Report:
    """A JSON object written to ``path`` on every :meth:`save` (through a temporary file, so a run
    killed while writing leaves the previous version, never half a file)."""

    def __init__(self, path: Path, data: dict):
        self.path, self.data = Path(path), data

    def __setitem__(self, key, value):
        self.data[key] = value

    def __getitem__(self, key):
        return self.data[key]

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=_jsonable))
        os.replace(tmp, self.path)

    def finish(self) -> dict:
        self.save()
        print(json.dumps(self.data, indent=2, default=_jsonable))
        print(f"JSON report: {self.path.resolve()}")
        return self.data


def _jsonable(value):
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (torch.dtype, torch.device, Path)):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall(fn: Callable[[], object], device: torch.device) -> tuple[float, object]:
    """Seconds one call of ``fn`` takes end to end (device work included), and its result."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def time_call(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 1) -> tuple[float, object]:
    """Median seconds of ``iters`` calls of ``fn`` after ``warmup`` calls, and the last call's result."""
    out = None
    for _ in range(max(0, warmup)):
        out = fn()
    sync(device)
    times = []
    for _ in range(max(1, iters)):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def flux_inputs(size: str, device: torch.device, seed: int = 1, sigma: float = 0.5) -> dict:
    """Keyword inputs of ``BaseModel.apply_model`` for the Flux of ``size`` at its benchmark resolution."""
    x, _, ctx, y, guidance = bench_flux_step.inputs(size, device, seed)
    return {"x": x, "t": torch.full((1,), sigma, device=device), "c_crossattn": ctx, "y": y, "guidance": guidance}


def load(model_patcher) -> None:
    """Load ``model_patcher`` as a sampler does (ComfyUI's model management; runs its injections)."""
    import comfy.model_management

    comfy.model_management.load_models_gpu([model_patcher])


def denoiser_call(model_patcher, inputs: dict) -> Callable[[], torch.Tensor]:
    """A callable running one denoiser call of ``model_patcher`` on ``inputs``, as ComfyUI's sampler does."""
    model = model_patcher.model
    # the patcher's transformer_options (an attention override...) as the sampler copies them, plus its wrappers
    options = {**model_patcher.model_options.get("transformer_options", {}), "wrappers": model_patcher.wrappers}  # comfy.sampler_helpers passes the patcher's wrappers so

    def call():
        return model.apply_model(inputs["x"], inputs["t"], c_crossattn=inputs["c_crossattn"], y=inputs["y"],
                                 guidance=inputs["guidance"], transformer_options=options)

    return call


def rel_err(test: torch.Tensor, ref: torch.Tensor) -> float:
    return float((test.double() - ref.double()).norm() / ref.double().norm())


def sqnr_db(test: torch.Tensor, ref: torch.Tensor) -> float:
    err = rel_err(test, ref)
    return math.inf if err == 0 else -20 * math.log10(err)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def unload_all() -> None:
    import comfy.model_management

    comfy.model_management.unload_all_models()


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 1024**3 if device.type == "cuda" else None


def stored_bytes(model_patcher) -> int:
    """Bytes of the diffusion model in ComfyUI's native checkpoint form (what Save would write)."""
    from lowbit.nodes.model_quant import native_state_dict

    return sum(t.numel() * t.element_size() for t in native_state_dict(model_patcher).values())
