"""Calibration time and output error vs int4_mixed at equal memory, Flux.1-dev-sized, real ComfyUI (issue 7, Show 3).

Usage (from the repository root; prints the JSON report's path at the end):
  python tests/gpu/bench_calibrate.py --size dev --out calibrate.json                 # the node's defaults
  python tests/gpu/bench_calibrate.py --size dev --objective layer_output --smoothing off --out calibrate.json
  python tests/gpu/bench_calibrate.py --size tiny --device cpu --steps 1 --resolution 128 --iters 1   # CPU smoke run

In one process, on a Flux.1-dev-sized ComfyUI Flux with random bf16 weights (``bench_flux_step.build_flux``):

1. the bf16 model's outputs on held-out inputs (``--eval-inputs`` denoiser calls at the benchmark
   resolution, 1024x1024 at dev size, other seeds, text embeddings and noise levels than calibration uses);
2. structural ``int4_mixed`` (Quantize Model's core, ``Policy(mode="int4_mixed")``): its stored bytes
   (ComfyUI's native checkpoint form) and its output error against bf16 on the held-out inputs;
3. calibration as the Calibrate Policy node / ``lowbit calibrate`` run it (``nodes.calibrate.calibrate_model``:
   real ComfyUI sampling steps on a stand-in embedding, then per layer and candidate the layer error,
   and with the default ``model_output`` objective the replayed model-output error), with the byte
   budget set to structural int4_mixed's stored bytes (``--budget`` overrides), timed end to end;
4. the calibrated policy applied (Quantize with Policy's core, ``nodes.calibrate.apply_policy``): its
   stored bytes and its output error on the same held-out inputs (its ``quantize_s`` includes ComfyUI
   unloading the bf16 model that calibration's sampling loaded, as it would in the app).

Errors are ``||out - bf16|| / ||bf16||`` over all held-out calls together (and as SQNR in dB). The
calibrated policy file is written next to the report (``<out>.policy.json``). Target: calibration
<= 5 minutes, lower error than int4_mixed at no more bytes.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

import bench_flux_step
from gpu_bench_common import (common_args, denoiser_call, flux_inputs, free, grad_mode, load, peak_gb, reset_peak,
                              setup, stored_bytes, time_call, unload_all, wall)

TARGET_SECONDS = 300.0
EVAL_SIGMAS = (0.9, 0.6, 0.3, 0.75, 0.45, 0.15)


def held_out_inputs(size: str, device: torch.device, count: int) -> list[dict]:
    """``count`` denoiser inputs at the benchmark resolution; seeds far from calibration's (which uses 0)."""
    return [flux_inputs(size, device, seed=1000 + i, sigma=EVAL_SIGMAS[i % len(EVAL_SIGMAS)]) for i in range(count)]


def outputs(model_patcher, inputs: list[dict]) -> list[torch.Tensor]:
    return [denoiser_call(model_patcher, x)().float() for x in inputs]


def output_error(model_patcher, inputs: list[dict], references: list[torch.Tensor]) -> dict:
    """The relative error of the model's outputs against ``references`` (all calls together, and per call)."""
    outs = outputs(model_patcher, inputs)
    noise = sum(float((o - r).double().pow(2).sum()) for o, r in zip(outs, references))
    power = sum(float(r.double().pow(2).sum()) for r in references)
    per_call = [float((o - r).double().norm() / r.double().norm()) for o, r in zip(outs, references)]
    error = math.sqrt(noise / power)
    return {"rel_err": error, "sqnr_db": -20 * math.log10(error) if error > 0 else math.inf,
            "rel_err_per_call": per_call}


def format_counts(model_patcher) -> dict[str, int]:
    from lowbit.nodes.model_quant import quantized_layers

    counts: dict[str, int] = {}
    for _, fmt, _ in quantized_layers(model_patcher):
        counts[fmt] = counts.get(fmt, 0) + 1
    return dict(sorted(counts.items()))


def measure_quantized(label: str, make, inputs, references, device, a, report) -> dict:
    """Quantize with ``make()``, load it as a sampler would, and record bytes, formats, step and error."""
    row = report["results"].setdefault(label, {})
    row["quantize_s"], model = wall(make, device)
    row["bytes"] = stored_bytes(model)
    row["gib"] = row["bytes"] / 2**30
    row["formats"] = format_counts(model)
    load(model)
    row.update(output_error(model, inputs, references))
    row["step_ms"] = time_call(denoiser_call(model, inputs[0]), device, a.iters, a.warmup)[0] * 1e3
    report.save()
    del model
    unload_all()
    free(device)
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(p, iters=3)
    p.add_argument("--budget", default="int4_mixed",
                   help="'int4_mixed' (default): structural int4_mixed's stored bytes; else a calibration budget "
                        "('7 GB', 'ratio:0.2')")
    p.add_argument("--ratio", type=float, default=0.2, help="structural int4_mixed's INT8 share (int4_mixed_ratio)")
    p.add_argument("--candidates", default="w4a4, int8_convrot", help="the node's candidates input")
    p.add_argument("--steps", type=int, default=4, help="the node's steps input")
    p.add_argument("--resolution", type=int, default=512, help="the node's resolution input (calibration latent)")
    p.add_argument("--rows", type=int, default=256, help="the node's rows_per_layer input")
    p.add_argument("--smoothing", choices=("measure", "off"), default="measure", help="the node's smoothing input")
    p.add_argument("--objective", choices=("model_output", "layer_output"), default="model_output",
                   help="the node's objective input")
    p.add_argument("--eval-inputs", type=int, default=3, help="held-out denoiser calls the errors are measured on")
    a = p.parse_args(argv)
    device, report = setup(a, "bench_calibrate")
    report.data.update(target_seconds=TARGET_SECONDS, results={})
    try:
        with grad_mode(a.grad_mode):
            run(a, device, report)
    except Exception as err:  # keep what was measured, and say what failed
        report["error"] = f"{type(err).__name__}: {err}"
        report.save()
        raise
    return report.finish()


def run(a: argparse.Namespace, device: torch.device, report) -> None:
    from lowbit.nodes.calibrate import apply_policy, calibrate_model
    from lowbit.nodes.model_quant import quantize_model
    from lowbit.quant.calibrate import CalibrationConfig
    from lowbit.quant.policy import Policy

    report["build_s"], base = wall(lambda: bench_flux_step.build_flux(a.size, device), device)
    report["params"] = sum(t.numel() for t in base.model.diffusion_model.parameters())
    report["bf16_bytes"] = stored_bytes(base)
    inputs = held_out_inputs(a.size, device, a.eval_inputs)
    # the bf16 model runs where it was built, unloaded: loading it would make quantize_model unload it
    references = outputs(base, inputs)
    report["bf16_step_ms"] = time_call(denoiser_call(base, inputs[0]), device, a.iters, a.warmup)[0] * 1e3
    report["eval"] = {"inputs": len(inputs), "sigmas": [float(x["t"][0]) for x in inputs],
                      "latent_shape": list(inputs[0]["x"].shape)}
    report.save()

    structural = Policy(mode="int4_mixed", int4_mixed_ratio=a.ratio)
    int4 = measure_quantized("int4_mixed", lambda: quantize_model(base, structural), inputs, references,
                             device, a, report)

    budget = str(int4["bytes"]) if a.budget == "int4_mixed" else a.budget
    config = CalibrationConfig(budget=budget, candidates=a.candidates, smoothing=a.smoothing,
                               rows_per_layer=a.rows)
    cal = report["calibration"] = {"config": config.to_dict(), "budget_from": a.budget, "objective": a.objective,
                                   "steps": a.steps, "resolution": a.resolution}
    report.save()
    reset_peak(device)
    cal["seconds"], result = wall(lambda: calibrate_model(base, config, steps=a.steps, resolution=a.resolution,
                                                          objective=a.objective), device)
    cal.update(minutes=cal["seconds"] / 60, within_target=cal["seconds"] <= TARGET_SECONDS,
               summary=result.summary(), layers=len(result.layers), counts=result.counts(),
               budget_bytes=result.budget_bytes, fixed_bytes=result.fixed_bytes, used_bytes=result.used_bytes,
               planned_total_bytes=result.used_bytes + result.fixed_bytes, source=result.source,
               peak_vram_gb=peak_gb(device))
    policy_path = report.path.with_name(report.path.stem + ".policy.json")
    result.save(policy_path, overwrite=True)
    cal["policy_file"] = policy_path.name  # next to this report (no machine path in the record)
    report.save()

    calibrated = measure_quantized("calibrated", lambda: apply_policy(base, result.policy, result.input_scales()),
                                   inputs, references, device, a, report)
    report["summary"] = {
        "calibration_s": cal["seconds"], "calibration_within_5_min": cal["within_target"],
        "int4_mixed_bytes": int4["bytes"], "calibrated_bytes": calibrated["bytes"],
        "calibrated_fits_int4_mixed_bytes": calibrated["bytes"] <= int4["bytes"],
        "int4_mixed_rel_err": int4["rel_err"], "calibrated_rel_err": calibrated["rel_err"],
        "error_ratio_calibrated_over_int4_mixed": calibrated["rel_err"] / int4["rel_err"],
        "sqnr_gain_db": calibrated["sqnr_db"] - int4["sqnr_db"],
    }


if __name__ == "__main__":
    main()
    sys.exit(0)
