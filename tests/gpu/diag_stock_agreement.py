"""How close stock ComfyUI and LowBit are to the float model, per kernel backend and per input (tiny Flux).

Usage (from the repository root; about a minute on an H200, a few on a CPU)::

  LOWBIT_TEST_DEVICE=cuda python tests/gpu/diag_stock_agreement.py --formats int8_convrot int8 --seeds 6 --out agree.json

The model, inputs and loading are ``tests/comfy``'s (``comfy_helpers``: the tiny Flux, real ComfyUI,
``LOWBIT_TEST_DEVICE`` and ``COMFYUI_PATH`` as there). For each format, LowBit writes its native file
and stock ComfyUI loads it (formats stock ComfyUI cannot load report why); LowBit's in-memory model of
the same float weights then runs with each kernel backend forced (``auto`` is the dispatcher). Per input
seed it reports the SQNR (dB) of each output against the float model's, and of LowBit's ``auto`` output
against stock's; then the mean, least and greatest over the seeds.

It also records which comfy-kitchen backends are available and enabled, since stock ComfyUI runs
kitchen's CUDA kernels only where its CUDA backend is (kitchen built with its CUDA extension, torch cu130
or newer), and kitchen's eager numerics otherwise.

This is what the stock-comparison bounds in ``tests/comfy/comfy_helpers.py`` were measured with. Not a
pytest file.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("diag_stock_agreement")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--formats", nargs="+", default=["int8_convrot", "int8", "w4a4"])
    p.add_argument("--seeds", type=int, default=6, help="inputs 0 .. N-1")
    p.add_argument("--out", default="")
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error("--seeds must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "comfy"))
    from comfy_helpers import device, load_stock, require_comfy, run_flux, sqnr_db, tiny_flux_bf16

    require_comfy()
    import comfy.utils
    from comfy_kitchen.registry import registry

    from lowbit.kernels.backend import Backend, force_backend
    from lowbit.nodes.model_quant import quantize_model
    from lowbit.quant.checkpoint import save_checkpoint
    from lowbit.quant.policy import Policy
    from lowbit.quant.quantize import quantize_state_dict

    seeds = list(range(args.seeds))
    backends = {name: {"available": bool(v.get("available")), "disabled": bool(v.get("disabled"))}
                for name, v in registry.list_backends().items()}
    report = {"device": str(device()), "kitchen_backends": backends, "seeds": seeds, "formats": {}}
    log.info("device %s; comfy-kitchen backends %s", device(), backends)
    float_model = load_stock(tiny_flux_bf16())
    float_outs = [run_flux(float_model, seed=s) for s in seeds]

    with tempfile.TemporaryDirectory() as tmp:
        for fmt in args.formats:
            row: dict = {}
            outs: dict = {}
            try:
                state_dict, _ = quantize_state_dict(tiny_flux_bf16(), Policy(mode=fmt), device=device())
                path = save_checkpoint(state_dict, Path(tmp) / f"{fmt}.safetensors", overwrite=True)
                stock = load_stock(comfy.utils.load_torch_file(str(path)))
                outs["stock"] = [run_flux(stock, seed=s) for s in seeds]
            except Exception as err:  # a LowBit-only format, or a kitchen build that cannot run it
                row["stock"] = f"{type(err).__name__}: {err}"[:300]
            ours = quantize_model(float_model, Policy(mode=fmt))
            for backend in Backend:
                try:
                    with force_backend(backend):
                        outs[backend.value] = [run_flux(ours, seed=s) for s in seeds]
                except Exception as err:  # a backend that cannot run this format here
                    row[backend.value] = f"{type(err).__name__}: {err}"[:300]
            for name, values in outs.items():
                per_seed = [round(sqnr_db(f, o), 2) for f, o in zip(float_outs, values)]
                row[name] = {"vs_float_db": per_seed, "mean": round(statistics.mean(per_seed), 2),
                             "min": min(per_seed), "max": max(per_seed)}
            if "stock" in outs:
                row["auto_vs_stock_db"] = [round(sqnr_db(a, b), 2) for a, b in zip(outs["stock"], outs["auto"])]
            report["formats"][fmt] = row
            log.info("%s: %s", fmt, json.dumps({k: v["mean"] if isinstance(v, dict) else v for k, v in row.items()}))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
