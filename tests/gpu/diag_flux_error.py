"""Where a quantized Flux step's output error comes from (Flux.1-dev-sized model, real ComfyUI Flux class).

Usage (from the repository root, < 3 minutes on an H200)::

  python tests/gpu/diag_flux_error.py --size dev --modes fp8_rowwise int8_convrot --out err.json

The model and input are ``bench_flux_step.py``'s (random weights with outlier input channels, 1024x1024,
batch 1). For each mode, the relative L2 error of one forward against bf16, with:

* ``all``: every layer the preset quantizes, as the step benchmark runs it;
* ``weights_only``: the same layers, run by the ``dequant`` backend (the weight rounded as stored,
  the activation not quantized): the activations' share of the error is ``all`` minus this, in power;
* ``only:<group>``: one group of layers quantized, the others kept in bf16 (the groups below partition
  the quantized layers, so their errors, added in power, roughly give ``all``);
* ``all_but:<group>``: every group but one;
* ``weights_only:mod``: every layer quantized, the modulation linears run by the ``dequant`` backend (their
  weights rounded as stored, their one-row input not quantized: an INT8 or FP8 weight with a bf16 activation);
  ``only:mod+weights_only``: the modulation linears alone so, the rest in bf16 (their weights' share).

Layer groups (names relative to the diffusion model): ``mod`` (the per-block modulation linears,
one row a call at batch 1), ``double_attn`` (qkv and output projections of the double blocks),
``double_mlp``, ``single_linear1``, ``single_linear2``.

With ``--fp32``, also ``bf16_vs_fp32``: the bf16 model's own error against an fp32 copy of it (the same
weights; fp32 activations and attention): how far the bf16 reference itself is from exact arithmetic
on this model, for scale.

Also reported: ``bf16_self``, the error of a second bf16 forward with the Attention Backend node's
backend (what attention alone moves; ``--attention-backend``). Not a pytest file; ``--size tiny
--device cpu`` is a quick smoke run of the same code.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_flux_step as bench  # noqa: E402

log = logging.getLogger("diag_flux_error")

GROUPS = {
    "mod": r"^(double_blocks\.\d+\.(img|txt)_mod|single_blocks\.\d+\.modulation)\.lin$",
    "double_attn": r"^double_blocks\.\d+\.(img|txt)_attn\.(qkv|proj)$",
    "double_mlp": r"^double_blocks\.\d+\.(img|txt)_mlp\.\d+$",
    "single_linear1": r"^single_blocks\.\d+\.linear1$",
    "single_linear2": r"^single_blocks\.\d+\.linear2$",
}


def forward(dm, args, options=None) -> torch.Tensor:
    x, t, ctx, y, g = args
    opts = {"transformer_options": dict(options)} if options else {}
    with torch.inference_mode():
        return dm(x, t, ctx, y=y, guidance=g, **opts).float()


def bf16_vs_fp32(dm, args) -> float:
    """The relative error of ``dm`` (bf16) against an fp32 copy of it: the bf16 weights, exactly, in fp32, with
    fp32 inputs and compute. Both get the timestep and guidance in fp32, so that both embed the same values.
    (ComfyUI itself casts the guidance to the model's dtype, and ``timestep_embedding`` scales it by 1000 in
    that dtype: a bf16 model embeds guidance 3.5 as 3504, an fp32 one as 3500, a difference of inputs rather
    than of arithmetic.)"""
    import copy

    x, t, ctx, y, g = args
    ours = forward(dm, (x, t.float(), ctx, y, g.float()))
    dm32 = copy.deepcopy(dm).float()
    try:
        exact = forward(dm32, [a.float() for a in args])
    finally:
        del dm32
        if x.device.type == "cuda":
            torch.cuda.empty_cache()
    return bench.rel_err(ours, exact)


def variants(groups: list[str]) -> list[tuple[str, tuple[str, ...], bool | str]]:
    """(label, extra keep-float patterns, weights only: ``True`` for every layer, a group's name for its layers
    alone) per measured variant."""
    rows = [("all", (), False), ("weights_only", (), True)]
    rows += [(f"only:{g}", tuple(GROUPS[o] for o in groups if o != g), False) for g in groups]
    rows += [(f"all_but:{g}", (GROUPS[g],), False) for g in groups]
    if "mod" in groups:
        rows += [("weights_only:mod", (), "mod"),
                 ("only:mod+weights_only", tuple(GROUPS[o] for o in groups if o != "mod"), "mod")]
    return rows


def dequantized_forwards(dm, pattern: str, backend) -> int:
    """The layers of ``dm`` whose names match ``pattern`` run by the ``backend`` kernel backend (an instance
    ``forward`` that forces it around the class's); the number of layers."""
    import re
    import types

    from lowbit.kernels.backend import force_backend

    count = 0
    for name, module in dm.named_modules():
        if re.search(pattern, name) and isinstance(module, torch.nn.Linear):
            def forced(self, *a, _cls_forward=type(module).forward, **k):
                with force_backend(backend):
                    return _cls_forward(self, *a, **k)
            module.forward = types.MethodType(forced, module)
            count += 1
    return count


def run(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(bench.SIZES), default="dev")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--modes", nargs="+", default=["fp8_rowwise", "int8_convrot"])
    p.add_argument("--groups", nargs="+", default=list(GROUPS), choices=list(GROUPS))
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--fp32", action="store_true",
                   help="also the bf16 model's own error against an fp32 copy of it (same weights, fp32 compute)")
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    device = torch.device(a.device)
    bench.import_comfy(device.type)
    from comfy_kitchen.tensor import QuantizedTensor

    from lowbit.kernels.backend import Backend, force_backend
    from lowbit.nodes.model_quant import quantize_model
    from lowbit.quant.policy import Policy

    report = {"size": a.size, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "groups": {g: GROUPS[g] for g in a.groups}, "modes": {}}
    base = bench.build_flux(a.size, device)
    dm = base.model.diffusion_model
    args = bench.inputs(a.size, device)
    ref = forward(dm, args)
    report["bf16_self"] = bench.rel_err(forward(dm, args, bench.attention_options(a.attention_backend)), ref)
    if a.fp32:
        report["bf16_vs_fp32"] = bf16_vs_fp32(dm, args)
        log.info("bf16 against fp32: %.4f", report["bf16_vs_fp32"])
    for mode in a.modes:
        rows = {}
        for label, keep, weights_only in variants(a.groups):
            start = time.perf_counter()
            try:
                q = quantize_model(base, Policy(mode=mode, extra_keep_float=keep))
                qdm = q.model.diffusion_model
                layers = sum(1 for m in qdm.modules() if isinstance(getattr(m, "weight", None), QuantizedTensor))
                forced = 0
                if weights_only is True:
                    with force_backend(Backend.DEQUANT):
                        out = forward(qdm, args)
                else:
                    if weights_only:
                        forced = dequantized_forwards(qdm, GROUPS[weights_only], Backend.DEQUANT)
                    out = forward(qdm, args)
                rows[label] = {"rel_err": bench.rel_err(out, ref), "quantized_layers": layers,
                               "s": round(time.perf_counter() - start, 2)}
                if weights_only and weights_only is not True:
                    rows[label]["weights_only_layers"] = forced
                del q, qdm, out
            except Exception as err:  # one variant failing must not lose the others
                log.exception("%s %s failed", mode, label)
                rows[label] = {"error": f"{type(err).__name__}: {err}"[:500]}
            log.info("%s %s: %s", mode, label, rows[label])
            bench.free(device)
        report["modes"][mode] = rows
        if a.out:
            Path(a.out).write_text(json.dumps(report, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2))
        print(f"JSON report: {a.out}")
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    run()
