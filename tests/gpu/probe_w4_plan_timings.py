"""How the dispatcher's three timings read for a few codebook W4 plans at M = 256, each measured three times.

A probe, not a benchmark: for each shape, the ``w4a8`` steady-state plans of ``PLANS`` (what a model's later steps
run, launch replays included) are timed as the dispatcher times them (``dispatch._time_us``: sustained,
``_gpu_time_us``: GPU alone, ``_host_time_us``: the CPU's cost to enqueue a call), three rounds in turn, and each
plan's replay kinds are reported. First, the activation quantization alone (ConvRot 256, INT8 codes) with its
columns permuted for 0-, 128- and 256-column K steps, CUDA-graph time. One JSON report::

    python tests/gpu/probe_w4_plan_timings.py --out plan_timings.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import sweep_w4_gemm as sweep

SHAPES = ((3072, 3072), (3072, 12288))
PLANS = ("triton:128x64x256-g8-w4-s3-tma-tmastore-join", "triton:128x64x128-g8-w4-s4-tma-tmastore-join",
         "triton:expand-64x128x128-g8-w4-s4-tma-tmastore", "triton:256x64x256-g8-w8-s3-tma-tmastore-k2-join",
         "triton:128x32x128-g8-w4-s4-tma-tmastore-k2-join")
log = logging.getLogger("probe_w4_plan_timings")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, default=256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch

    if not torch.cuda.is_available():
        print("probe_w4_plan_timings.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import comfy_kitchen as ck

    from lowbit.kernels import dispatch
    from lowbit.kernels.reference import INT8_MAX
    from lowbit.kernels.triton_act_quant import act_quant_triton
    from lowbit.kernels.w4_linear import _W4Plan

    dev = torch.device("cuda")
    report = {"device": torch.cuda.get_device_name(dev), "m": args.m, "act_quant_us": {}, "plans": {}}
    for k in sorted({k for _, k in SHAPES}):
        x = torch.randn(args.m, k, device=dev, dtype=torch.bfloat16)
        for perm in (0, 128, 256):
            us = sweep.time_us([lambda: act_quant_triton(x, torch.int8, 127.0, "regular", 256, None, False, perm,
                                                         perm_run=4 if perm else 1)] * 20, dev, 20)
            report["act_quant_us"][f"k={k} perm={perm}"] = us
            log.info("act-quant M=%d K=%d columns permuted in blocks of %d: %.2f us", args.m, k, perm, us)
    for n, k in SHAPES:
        qdata, s_rel, s_channel, _, codebook = ck.quantize_w4a8_int8_weight(torch.randn(n, k, device=dev) / k**0.5)
        x = torch.randn(args.m, k, device=dev, dtype=torch.bfloat16)
        w_scale = s_channel.reshape(-1).float()
        maker = _W4Plan(x, qdata, w_scale, None, torch.bfloat16, 256, qmax=INT8_MAX, s_rel=s_rel, codebook=codebook,
                        correction=None, group_size=16)
        plans = {name: maker.make_fast(name) for name in PLANS}
        for round_ in range(args.rounds):
            for name, plan in plans.items():
                def call(plan=plan):
                    return plan(x, qdata, w_scale, None, s_rel, codebook, None)

                reading = {"sustained_us": dispatch._time_us(call, 2, 5), "gpu_us": dispatch._gpu_time_us(call, 5),
                           "host_us": dispatch._host_time_us(call, 5)}
                entry = report["plans"].setdefault(f"{n}x{k} {name}", {"rounds": []})
                entry["rounds"].append(reading)
                entry["replays"] = {str(key): type(v).__name__ for key, v in plan.replays.entries.items()}
                log.info("%dx%d round %d %s: sustained %.1f us, GPU %.1f us, host %.1f us", n, k, round_, name,
                         reading["sustained_us"], reading["gpu_us"], reading["host_us"])
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
