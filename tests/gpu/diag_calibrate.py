"""Does calibration measure each layer as the calibrated model later runs it? (tiny Flux, real ComfyUI)

Usage (from the repository root; < 2 minutes on a GPU, about as long on the CPU)::

  python tests/gpu/diag_calibrate.py --device cuda --out diag.json
  python tests/gpu/diag_calibrate.py --device cpu --out diag.json
  python tests/gpu/diag_calibrate.py --device cpu --act-bits 8 --out diag.json   # Hopper's w4a4 numerics, emulated

On the tiny Flux of ``tests/comfy`` (``comfy_helpers.tiny_flux_bf16``, loaded by stock ComfyUI), the
way ``tests/comfy/test_calibrate_node.py::test_calibrated_beats_structural_int4_mixed_at_the_same_budget``
runs it:

1. structural ``int4_mixed`` (flux1, ratio 0.3) and its stored bytes;
2. ``nodes.calibrate.calibrate_model`` at that byte budget (model-output objective, smoothing off),
   keeping the recorded layer inputs and denoiser calls it measured on;
3. the calibrated policy applied (``apply_policy``), and then per layer:

   * ``chosen``, the ``measured`` layer error (what calibration saw for the chosen format) and the
     measured model-output error;
   * ``runtime``: the error of the calibrated model's own Linear (``module(x)``: LowBit's forward,
     with ComfyUI's casts, ``pre_quant_scale`` and ``input_scale``) on the same recorded rows, against
     ``x W^T`` in fp32 (bias removed, as calibration measures);
   * ``by_m``: each candidate format's ``codec.linear`` error fed ``m`` rows a call (``m`` = 1, 8, 64
     on the first 64 recorded rows; ``all``: every recorded row in one call, as calibration measures):
     the kernel dispatcher decides per row-count bucket, so a format whose numerics depend on the
     bucket shows it here;
   * ``mismatch``: ``runtime / measured`` (far from 1: calibration measured something else);

4. whole-model SQNR (dB) against the float model: structural and calibrated, on ``run_flux``'s
   input (the tests' number) and on the denoiser calls calibration recorded (the probe's own
   setting), and what the probes predict for each (the root-sum-square of the measured model-output
   errors of the layers' formats): calibrated above structural in the prediction but not on the
   calls means the probes measured the layers unlike the model runs them;
5. the kernel dispatcher's decisions (which implementation each format and shape ran).

``--backend`` forces one kernel backend for everything (``eager``, ``dequant``, ``triton``...);
``--act-bits 8`` makes ``w4a4`` quantize activations to 8 bits as it does on Hopper (a CPU emulation).
Prints a table and writes the JSON report (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
COMFY_TESTS = HERE.parent / "comfy"
M_SIZES = (1, 8, 64)  # rows a call in by_m, on the first CHUNK_ROWS recorded rows
CHUNK_ROWS = 64
MISMATCH = 1.5  # runtime / measured beyond this (or below its inverse) is flagged


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="diag_calibrate.json")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--resolution", type=int, default=128)
    p.add_argument("--ratio", type=float, default=0.3, help="structural int4_mixed's INT8 share (sets the budget)")
    p.add_argument("--candidates", default="w4a4, int8_convrot")
    p.add_argument("--smoothing", default="off", choices=("off", "measure", "write"))
    p.add_argument("--backend", default="auto", help="force one kernel backend (auto: the dispatcher decides)")
    p.add_argument("--act-bits", default="auto", choices=("auto", "4", "8"),
                   help="w4a4 activation bits (auto: as the device runs it; 8 on the CPU emulates Hopper)")
    return p.parse_args(argv)


def _import_comfy(device: str):
    os.environ["LOWBIT_TEST_DEVICE"] = device
    sys.path.insert(0, str(COMFY_TESTS))
    import comfy_helpers

    if comfy_helpers._import_comfy() is None:
        raise SystemExit("ComfyUI not found: set COMFYUI_PATH to a ComfyUI checkout (or clone it to ~/ComfyUI)")
    return comfy_helpers


def _rel(reference: torch.Tensor, output: torch.Tensor) -> float:
    reference = reference.double()
    return float((output.double() - reference).norm() / reference.norm())


def _db(rel: float) -> float:
    return math.inf if rel == 0 else -20 * math.log10(rel)


@contextlib.contextmanager
def _act_bits(bits: str):
    """``w4a4`` runs with ``bits``-bit activations inside the block (``auto``: unchanged)."""
    if bits == "auto":
        yield
        return
    import lowbit.quant.layouts.w4a4_convrot as w4a4

    original = w4a4.act_bits
    w4a4.act_bits = lambda linear_dtype, device: int(bits)
    try:
        yield
    finally:
        w4a4.act_bits = original


def _capture_calibration():
    """Patch ``nodes.calibrate.calibrate`` to keep the samples and the model-output probe it is given."""
    import lowbit.nodes.calibrate as node

    seen = {}
    inner = node.calibrate

    def calibrate(weights, samples, config, **kwargs):
        seen["samples"] = dict(samples)
        probe = kwargs.get("output_error")
        seen["probe"] = getattr(probe, "__self__", None)
        return inner(weights, samples, config, **kwargs)

    node.calibrate = calibrate
    return seen, lambda: setattr(node, "calibrate", inner)


def _codec_errors(weight, rows, fmt, device) -> dict[str, float]:
    """``codec.linear`` error of ``fmt`` on ``rows`` fed ``m`` rows a call, for each ``m`` of M_SIZES and all."""
    from lowbit.quant.formats import get_format

    codec = get_format(fmt)
    w = weight.to(device=device, dtype=torch.float32)
    x = rows.to(device=device, dtype=torch.bfloat16)
    qt = codec.quantize(w, compute_dtype=torch.bfloat16)
    reference = torch.nn.functional.linear(x.float(), w)
    out = {}
    head = x[:CHUNK_ROWS]
    for m in M_SIZES:
        if m <= head.shape[0]:
            got = torch.cat([codec.linear(chunk, qt, None, None).float() for chunk in head.split(m)])
            out[str(m)] = _rel(reference[:CHUNK_ROWS], got)
    out["all"] = _rel(reference, codec.linear(x, qt, None, None).float())
    return out


def _runtime_error(module, weight, bias, rows, device) -> float:
    """The calibrated model's own Linear on ``rows`` (bias removed) against ``x W^T`` in fp32."""
    x = rows.to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        got = module(x).float()
    if bias is not None:
        got = got - bias.to(device=device, dtype=torch.float32)
    return _rel(torch.nn.functional.linear(x.float(), weight.to(device=device, dtype=torch.float32)), got)


def _on_calls(dm, calls) -> list[torch.Tensor]:
    with torch.no_grad():
        return [dm(*args, **kwargs).float() for args, kwargs in calls]


def _calls_error(outputs, references) -> float:
    noise = sum(float((o - r).double().pow(2).sum()) for o, r in zip(outputs, references))
    power = sum(float(r.double().pow(2).sum()) for r in references)
    return math.sqrt(noise / power)


def main(argv=None) -> dict:
    a = _args(argv)
    helpers = _import_comfy(a.device)
    import comfy.model_management

    from lowbit.kernels.backend import force_backend
    from lowbit.kernels.dispatch import current_dispatcher
    from lowbit.nodes.calibrate import apply_policy, calibrate_model
    from lowbit.nodes.model_quant import native_state_dict, quantize_model
    from lowbit.quant.calibrate import CalibrationConfig
    from lowbit.quant.calibration_choose import Budget
    from lowbit.quant.policy import Policy

    start = time.perf_counter()
    device = comfy.model_management.get_torch_device()
    report = {"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "torch": torch.__version__, "backend": a.backend, "act_bits": a.act_bits, "steps": a.steps,
              "resolution": a.resolution, "candidates": a.candidates, "smoothing": a.smoothing}
    with force_backend(a.backend), _act_bits(a.act_bits), torch.no_grad():
        float_model = helpers.load_stock(helpers.tiny_flux_bf16())
        float_output = helpers.run_flux(float_model)
        structural = quantize_model(float_model, Policy(mode="int4_mixed", preset="flux1", int4_mixed_ratio=a.ratio))
        budget = sum(t.numel() * t.element_size() for t in native_state_dict(structural).values())
        seen, restore = _capture_calibration()
        try:
            config = CalibrationConfig(budget=Budget("bytes", budget), candidates=a.candidates, smoothing=a.smoothing)
            result = calibrate_model(float_model, config, steps=a.steps, resolution=a.resolution)
        finally:
            restore()
        samples, probe = seen["samples"], seen["probe"]
        calibrated = apply_policy(float_model, result.policy, result.input_scales(),
                                  pre_quant_scales=result.pre_quant_scales())
        report["budget_bytes"] = budget
        report["counts"] = {"structural": _counts(structural), "calibrated": result.counts()}

        # whole model, on run_flux's input and on calibration's recorded denoiser calls
        whole = report["whole_model_sqnr_db"] = {}
        for label, model in (("structural", structural), ("calibrated", calibrated)):
            whole[f"{label}_run_flux"] = helpers.sqnr_db(float_output, helpers.run_flux(model))
        if probe is not None:
            comfy.model_management.load_models_gpu([float_model])
            references = _on_calls(float_model.model.diffusion_model, probe._calls)
            for label, model in (("structural", structural), ("calibrated", calibrated)):
                comfy.model_management.load_models_gpu([model])
                outputs = _on_calls(model.model.diffusion_model, probe._calls)
                whole[f"{label}_calibration_calls"] = _db(_calls_error(outputs, references))
            planned = {name: fmt for name, fmt, _ in _layers(structural)}
            for label, formats in (("structural", planned), ("calibrated", result.policy.layer_format_map)):
                errors = [l.by_format[formats[l.name]].output_error for l in result.layers
                          if formats.get(l.name) in l.by_format]
                whole[f"{label}_predicted_from_probes"] = _db(math.sqrt(sum(e * e for e in errors)))

        # per layer
        comfy.model_management.load_models_gpu([calibrated])
        float_dm, cal_dm = float_model.model.diffusion_model, calibrated.model.diffusion_model
        layers = report["layers"] = {}
        for layer in result.layers:
            source = float_dm.get_submodule(layer.name)
            weight = source.weight.detach().float()
            rows = samples[layer.name].rows
            row = {"chosen": layer.format, "rows": int(rows.shape[0]), "measured": layer.chosen.layer_error,
                   "measured_output": layer.chosen.output_error,
                   "runtime": _runtime_error(cal_dm.get_submodule(layer.name), weight, source.bias, rows, device)}
            row["mismatch"] = row["runtime"] / row["measured"] if row["measured"] else math.inf
            row["by_format"] = {m.format: {"measured": m.layer_error, "measured_output": m.output_error,
                                           "by_m": _codec_errors(weight, rows, m.format, device)}
                                for m in layer.measured if m.format != "float"}
            layers[layer.name] = row
        flagged = [n for n, r in layers.items() if not 1 / MISMATCH <= r["mismatch"] <= MISMATCH]
        report["flagged_layers"] = flagged
        dispatcher = current_dispatcher()
        report["dispatch"] = {"decisions": dict(dispatcher.decisions), "timings_us": dict(dispatcher.timings_us),
                              "failures": dict(dispatcher.failures)}
    report["seconds"] = time.perf_counter() - start
    _print(report)
    path = Path(a.out)
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"JSON report: {path.resolve()}")
    return report


def _layers(model_patcher):
    from lowbit.nodes.model_quant import quantized_layers

    return quantized_layers(model_patcher)


def _counts(model_patcher) -> dict[str, int]:
    out: dict[str, int] = {}
    for _, fmt, _ in _layers(model_patcher):
        out[fmt] = out.get(fmt, 0) + 1
    return dict(sorted(out.items()))


def _print(report: dict) -> None:
    print(f"device {report['device']} ({report['gpu'] or 'cpu'}), backend {report['backend']}, "
          f"w4a4 act_bits {report['act_bits']}; budget {report['budget_bytes']:,} bytes")
    print("counts:", json.dumps(report["counts"]))
    formats = sorted({f for r in report["layers"].values() for f in r["by_format"]})
    head = f"{'layer':34} {'chosen':13} {'measured':>9} {'runtime':>9} {'ratio':>6} {'model':>9}"
    head += "".join(f" {f + ' m=' + m:>19}" for f in formats for m in (*map(str, M_SIZES), "all"))
    print(head)
    for name, r in report["layers"].items():
        line = (f"{name:34} {r['chosen']:13} {r['measured']:9.3e} {r['runtime']:9.3e} {r['mismatch']:6.2f} "
                f"{r['measured_output'] or 0:9.3e}")
        for f in formats:
            by_m = r["by_format"].get(f, {}).get("by_m", {})
            line += "".join(f" {by_m.get(m, float('nan')):19.3e}" for m in (*map(str, M_SIZES), "all"))
        print(line + ("   <-- mismatch" if name in report["flagged_layers"] else ""))
    print("whole model SQNR (dB):", json.dumps({k: round(v, 2) for k, v in report["whole_model_sqnr_db"].items()}))
    decisions = report["dispatch"]["decisions"]
    if decisions:
        print("dispatcher decisions:")
        for key, value in sorted(decisions.items()):
            print(f"  {key} -> {value}")
    print(f"{len(report['flagged_layers'])} layer(s) run far from what calibration measured: "
          f"{', '.join(report['flagged_layers']) or 'none'}; {report['seconds']:.0f} s")


if __name__ == "__main__":
    main()
