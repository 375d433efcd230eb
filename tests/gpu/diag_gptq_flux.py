"""GPTQ rounding against round-to-nearest on the Flux step model: output error of one forward against bf16.

Usage (from the repository root, a few minutes on an H100 or H200)::

  python tests/gpu/diag_gptq_flux.py --size dev --modes int8_convrot fp8_rowwise --out gptq.json

The model and the evaluated input are ``bench_flux_step.py``'s (random weights with outlier input channels,
1024x1024, batch 1, timestep 0.5). Calibration is one forward of ``--calib`` other samples in one batch (other
latents, text, pooled vectors; timesteps spread over 0.2-0.8, none of them 0.5): a pre-hook on every layer the
policy quantizes takes the layer's input rows of that forward, forms ``H = X^T X`` and quantizes the bf16
weight with it at once (``quantize_weight(..., options={"hessian": H})``), so no Hessian is kept. Then, per
mode, the relative error against the bf16 forward of:

* ``rtn``: the model as ``quantize_model`` makes it (round to nearest), run as the step benchmark runs it;
* ``gptq``: the same model with every quantized weight replaced by its GPTQ-rounded one (same scales, same
  layout, same kernels);
* ``gptq_but_mod``: GPTQ everywhere but the modulation linears (they see one row per sample, ``--calib`` rows
  in all: their Hessian has that rank);
* ``*_weights_only``: the same weights run by the ``dequant`` backend (activations not quantized).

Not a pytest file; ``--size tiny --device cpu`` is a quick smoke run of the same code.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_flux_step as bench  # noqa: E402
from diag_flux_error import GROUPS, forward  # noqa: E402

log = logging.getLogger("diag_gptq_flux")


def calibration_inputs(size: str, device: torch.device, samples: int, seed: int = 2):
    """``samples`` inputs in one batch, unlike the evaluated one: other seeds, timesteps 0.2..0.8."""
    parts = [bench.inputs(size, device, seed=seed + i) for i in range(samples)]
    x, _, ctx, y, g = (torch.cat([p[j] for p in parts]) for j in range(5))
    t = torch.linspace(0.2, 0.8, samples, device=device).to(x.dtype) if samples > 1 else torch.full(
        (1,), 0.3, device=device, dtype=x.dtype)
    return x, t, ctx, y, g


def gptq_weights(dm, plans: dict, args, sequential: bool = False) -> tuple[dict, dict]:
    """``{mode: {layer: QuantizedTensor}}`` GPTQ-rounded on one forward of ``args``, and per layer the rows seen.
    ``sequential`` (one mode): each layer, once rounded, computes its output in that forward with its rounded
    weight (weights only), so the layers after it see inputs with the error of the layers before, as GPTQ's
    layer-by-layer order does."""
    from lowbit.quant.quantize import quantize_weight

    results = {mode: {} for mode in plans}
    rows: dict[str, int] = {}
    handles = []
    formats: dict[str, dict[str, str]] = {}
    for mode, plan in plans.items():
        for decision in plan.quantized:
            formats.setdefault(decision.name, {})[mode] = decision.format

    def hook_for(name):
        def hook(module, inputs):
            x = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
            h = x.T @ x
            rows[name] = rows.get(name, 0) + x.shape[0]
            weight = module.weight.float()
            for mode, fmt in formats[name].items():
                results[mode][name] = quantize_weight(weight, fmt, name=name, options={"hessian": h})
            del h, x
        return hook

    def rounded_output(name, mode):
        def hook(module, inputs, output):
            weight = results[mode][name].dequantize().to(inputs[0].dtype)
            return torch.nn.functional.linear(inputs[0], weight, None if module.bias is None else
                                              module.bias.to(inputs[0].dtype))
        return hook

    for name in formats:
        module = dm.get_submodule(name)
        handles.append(module.register_forward_pre_hook(hook_for(name)))
        if sequential:
            handles.append(module.register_forward_hook(rounded_output(name, next(iter(plans)))))
    try:
        forward(dm, args)
    finally:
        for handle in handles:
            handle.remove()
    return results, rows


def swap_weights(qdm, weights: dict, skip: str | None = None) -> int:
    """Put ``weights`` (``{layer: QuantizedTensor}``) into the quantized model's layers (before its first call)."""
    from lowbit.nodes.comfy_ops import mark_quantized
    from lowbit.quant.formats import get_format

    count = 0
    for name, qt in weights.items():
        if skip and re.search(skip, name):
            continue
        module = qdm.get_submodule(name)
        mark_quantized(module, get_format(module.lowbit_format), qt.to(device=module.weight.device),
                       module.lowbit_config)
        count += 1
    return count


def run(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(bench.SIZES), default="dev")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--modes", nargs="+", default=["int8_convrot", "fp8_rowwise"])
    p.add_argument("--calib", type=int, default=4, help="calibration samples (one batch)")
    p.add_argument("--sequential", action="store_true",
                   help="each rounded layer feeds the next its rounded output while calibrating (one mode only)")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if a.sequential and len(a.modes) != 1:
        p.error("--sequential rounds for one mode: give one --modes")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    device = torch.device(a.device)
    bench.import_comfy(device.type)
    from lowbit.kernels.backend import Backend, force_backend
    from lowbit.nodes.model_quant import plan_for, quantize_model
    from lowbit.quant.policy import Policy

    report = {"size": a.size, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "calibration_samples": a.calib, "sequential": a.sequential, "modes": {}}
    base = bench.build_flux(a.size, device)
    dm = base.model.diffusion_model
    args = bench.inputs(a.size, device)
    ref = forward(dm, args)
    plans = {mode: plan_for(base, Policy(mode=mode)) for mode in a.modes}
    start = time.perf_counter()
    weights, rows = gptq_weights(dm, plans, calibration_inputs(a.size, device, a.calib),
                                 a.sequential)
    report["gptq_s"] = round(time.perf_counter() - start, 1)
    report["rows_per_layer"] = {"min": min(rows.values()), "max": max(rows.values())}
    log.info("GPTQ: %.1f s, rows per layer %s", report["gptq_s"], report["rows_per_layer"])
    bench.free(device)
    for mode in a.modes:
        out = {}
        for label, skip in (("rtn", None), ("gptq", ""), ("gptq_but_mod", GROUPS["mod"])):
            q = quantize_model(base, Policy(mode=mode))
            qdm = q.model.diffusion_model
            if skip is not None:
                out[f"{label}_layers"] = swap_weights(qdm, weights[mode], skip or None)
            out[label] = bench.rel_err(forward(qdm, args), ref)
            if label != "gptq_but_mod":
                with force_backend(Backend.DEQUANT):
                    out[f"{label}_weights_only"] = bench.rel_err(forward(qdm, args), ref)
            log.info("%s %s: %s", mode, label, {k: v for k, v in out.items() if k.startswith(label)})
            del q, qdm
            bench.free(device)
        report["modes"][mode] = out
        if a.out:
            Path(a.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    run()
