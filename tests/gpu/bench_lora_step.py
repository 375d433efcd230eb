"""LoRA step-time overhead on a Flux.1-dev-sized quantized model in real ComfyUI (issue 4, Show 4).

Usage (from the repository root; prints the JSON report's path at the end):
  python tests/gpu/bench_lora_step.py --size dev --out lora.json                      # int8_convrot
  python tests/gpu/bench_lora_step.py --size dev --formats int8_convrot fp8_rowwise --out lora.json
  python tests/gpu/bench_lora_step.py --size tiny --device cpu --iters 1 --warmup 1   # CPU smoke run

Per format, done the way the nodes do it, in one process, against the same inputs:

* the model: a Flux.1-dev-sized ComfyUI Flux with random bf16 weights (``bench_flux_step.build_flux``),
  quantized by Quantize Model's core (``nodes.model_quant.quantize_model``);
* the LoRAs: 4 random rank-32 LoRA files (ComfyUI key style, bf16) covering every Linear of the
  double and single blocks, applied by Apply LoRA Stack's core (``nodes.lora_nodes.apply_lora_stack``)
  and attached when ComfyUI loads the model (``load_models_gpu`` runs the patcher's injection:
  Dynamic hooks its banks, Stochastic merges);
* step: the median time of one denoiser call (``apply_model``, 1024x1024 at dev size, batch 1) with
  no LoRA, Dynamic with 1 and with 4 LoRAs, and Stochastic with 4 (merged), and each one's overhead
  over no LoRA (targets: Dynamic-4 <= 15 %, Stochastic-4 ~ 0 %);
* the Stochastic stack's apply time: the node's work from cold (LoRA files read and parsed) plus the
  merge ComfyUI's load runs, in seconds;
* sanity: how much the 4 LoRAs change the output (Dynamic-4 vs none) and how far Stochastic-4's
  output is from Dynamic-4's (the rounding noise of the merge).

The bf16 model's step time is measured in the same run for reference. The report is rewritten after
every measurement, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch

import bench_flux_step
from gpu_bench_common import (common_args, denoiser_call, flux_inputs, free, grad_mode, load, peak_gb, rel_err,
                              reset_peak, setup, time_call, unload_all, wall)

LORA_COUNT = 4
#: each LoRA's delta has about this size relative to the weight (random weights have std 1/sqrt(in))
LORA_RELATIVE_SIZE = 0.05
BLOCK_PREFIXES = ("double_blocks.", "single_blocks.")


def block_linears(diffusion_model) -> dict[str, tuple[int, int]]:
    """``{layer: (out, in)}`` of every Linear of the double and single blocks."""
    from lowbit.nodes.model_quant import linear_layers

    return {name: (m.out_features, m.in_features) for name, m in linear_layers(diffusion_model).items()
            if name.startswith(BLOCK_PREFIXES)}


def write_loras(folder: Path, layers: dict[str, tuple[int, int]], rank: int, device: torch.device):
    """``LORA_COUNT`` random LoRA files (``diffusion_model.<layer>.lora_up/down.weight`` + alpha) in ``folder``."""
    from safetensors.torch import save_file

    from lowbit.nodes.lora_nodes import LoraEntry

    gen = torch.Generator(device=device).manual_seed(1234)
    entries, total = [], 0
    for i in range(LORA_COUNT):
        tensors = {}
        for name, (n, k) in layers.items():
            down = torch.randn(rank, k, generator=gen, device=device) / math.sqrt(k)
            up = torch.randn(n, rank, generator=gen, device=device) * (LORA_RELATIVE_SIZE / math.sqrt(rank))
            tensors[f"diffusion_model.{name}.lora_down.weight"] = down.to(torch.bfloat16).cpu()
            tensors[f"diffusion_model.{name}.lora_up.weight"] = up.to(torch.bfloat16).cpu()
            tensors[f"diffusion_model.{name}.alpha"] = torch.tensor(float(rank))
        path = folder / f"bench_lora_{i}.safetensors"
        save_file(tensors, str(path))
        total += path.stat().st_size
        entries.append(LoraEntry(path.name, str(path), 1.0))
    return entries, total


def lora_injection(patcher):
    """The LowBit LoRA applier the stack added last (its Dynamic banks or Stochastic merge)."""
    from lowbit.nodes.lora_nodes import INJECTION_KEY

    return patcher.get_injections(INJECTION_KEY)[0].appliers[-1]


def measure_format(fmt: str, base, entries, inputs, device, a, report) -> None:
    from lowbit.nodes.lora_nodes import LORA_FILES, apply_lora_stack
    from lowbit.nodes.model_quant import quantize_model, quantized_layers
    from lowbit.quant.policy import Policy

    row = report["formats"].setdefault(fmt, {})
    reset_peak(device)
    row["quantize_s"], q = wall(lambda: quantize_model(base, Policy(mode=fmt)), device)
    row["quantized_layers"] = len(quantized_layers(q))
    report.save()
    # Stochastic right after "none", from cold (files read and parsed), so its apply time is the node's full work
    variants = (("none", 0, None), ("stochastic_4", LORA_COUNT, "stochastic"), ("dynamic_1", 1, "dynamic"),
                ("dynamic_4", LORA_COUNT, "dynamic"))
    outputs, steps = {}, {}
    for label, count, mode in variants:
        result = row.setdefault(label, {})
        patcher = q
        if mode is not None:
            if mode == "stochastic":
                LORA_FILES.clear()
            result["stack_node_s"], (patcher, _) = wall(
                lambda: apply_lora_stack(q, entries[:count], mode, a.merge_seed), device)
        result["load_s"], _ = wall(lambda: load(patcher), device)  # injection: banks built / weights merged
        if mode == "stochastic":
            merge = lora_injection(patcher).merge
            result.update(layers_merged=merge.merges, scales_grown=merge.rescaled)
            result["apply_s"] = result["stack_node_s"] + result["load_s"]
        elif mode == "dynamic":
            banks = lora_injection(patcher).loras.banks
            result.update(banks=len(banks), bank_mb=sum(b.down.nbytes + b.up.nbytes for b in banks.values()) / 2**20)
        step_s, out = time_call(denoiser_call(patcher, inputs), device, a.iters, a.warmup)
        steps[label], outputs[label] = step_s, out.float()
        result["step_ms"] = step_s * 1e3
        if label != "none":
            result["overhead_pct"] = 100.0 * (step_s / steps["none"] - 1.0)
        report.save()
    row["summary"] = {
        "none_ms": steps["none"] * 1e3,
        **{f"{label}_overhead_pct": row[label]["overhead_pct"] for label, _, mode in variants if mode},
        "stochastic_4_apply_s": row["stochastic_4"]["apply_s"],
        "dynamic_4_target_met": row["dynamic_4"]["overhead_pct"] <= 15.0,
        "lora_effect_rel": rel_err(outputs["dynamic_4"], outputs["none"]),
        "stochastic_vs_dynamic_rel": rel_err(outputs["stochastic_4"], outputs["dynamic_4"]),
        "peak_vram_gb": peak_gb(device),
    }
    unload_all()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(p)
    p.add_argument("--formats", nargs="+", default=["int8_convrot"], help="quantization formats to measure")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--merge-seed", type=int, default=0, help="Stochastic mode's merge_seed (the node's default 0)")
    p.add_argument("--lora-dir", default="", help="where the LoRA files are written (default: a temporary folder)")
    a = p.parse_args(argv)
    device, report = setup(a, "bench_lora_step")
    report.data.update(rank=a.rank, lora_count=LORA_COUNT, formats={})
    with grad_mode(a.grad_mode), tempfile.TemporaryDirectory(dir=a.lora_dir or None) as folder:
        report["build_s"], base = wall(lambda: bench_flux_step.build_flux(a.size, device), device)
        dm = base.model.diffusion_model
        report["params"] = sum(t.numel() for t in dm.parameters())
        inputs = flux_inputs(a.size, device)
        bf16_s, _ = time_call(denoiser_call(base, inputs), device, a.iters, a.warmup)
        report["bf16_step_ms"] = bf16_s * 1e3
        layers = block_linears(dm)
        report["lora_write_s"], (entries, size) = wall(lambda: write_loras(Path(folder), layers, a.rank, device),
                                                       device)
        report.data.update(lora_layers=len(layers), lora_file_mb=size / LORA_COUNT / 2**20)
        report.save()
        for fmt in a.formats:
            try:
                measure_format(fmt, base, entries, inputs, device, a, report)
            except Exception as err:  # one format failing must not lose the others' numbers
                bench_flux_step.log.exception("format %s failed", fmt)
                report["formats"].setdefault(fmt, {})["error"] = f"{type(err).__name__}: {err}"
                unload_all()
            free(device)
            report.save()
    return report.finish()


if __name__ == "__main__":
    main()
    sys.exit(0)
