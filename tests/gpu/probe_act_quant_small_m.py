"""The activation quantization at few rows (M = 256, 1024): how far each program shape is from a launch's floor.

A probe, not a benchmark. At M = 256 the act-quant kernel runs one row a program (256 programs) and costs about
3 µs of the `w4a8` linear's 17 µs at 3072 x 3072 (Session 42). For the linears' own cases – `w4a8` (ConvRot 256,
INT8 codes permuted for 256-column K steps in runs of 4), `convrot` (the same, natural order) and `int8` (no
rotation) – and K in {3072, 12288}, it times every variant of ``act_quant_triton`` in ``VARIANTS`` (row split,
program size, warps, rotation form) as the per-call time of a CUDA graph of 20 calls in a row on the same input
(warm in L2, as in the linear benchmark), and two floors launched the same way: an empty kernel of as many
programs, and a kernel that reads each row once and writes it back as bytes. Each variant's codes are compared
with the default's (fraction equal, largest difference). One JSON report::

    python tests/gpu/probe_act_quant_small_m.py --out aq_small_m.json
    python tests/gpu/probe_act_quant_small_m.py --quick --m 256 1024 4096 --cases w4a8 convrot int8 --out aq.json

``--quick`` times only the defaults, the padded row and the pieces at 2, 4 and 8 warps.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import sweep_w4_gemm as sweep

CASES = {  # name: (rotation, perm_block, perm_run)
    "w4a8": ("regular", 256, 4),
    "convrot": ("regular", 0, 1),
    "int8": ("none", 0, 1),
}
VARIANTS = [dict()] + [
    dict(split=split, tile_elements=te, num_warps=nw)
    for split in ("pow2", "pieces") for te in (4096, 8192) for nw in (2, 4, 8, 16)
] + [
    dict(split="chunks", chunk=chunk, tile_elements=chunk, num_warps=nw)
    for chunk in (512, 1024, 2048) for nw in (2, 4, 8)
] + [dict(rotate_impl=impl, split=split) for impl in ("tf32", "permute") for split in ("pow2", "pieces")]
QUICK = [dict(), dict(split="pow2"), dict(split="pieces")] + [dict(split="pieces", num_warps=nw) for nw in (2, 4, 8)]
log = logging.getLogger("probe_act_quant_small_m")


def _floors(m: int, k: int, dev, report: dict) -> None:
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _empty(x_ptr):
        pass

    @triton.jit
    def _copy(x_ptr, q_ptr, K, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        v = tl.load(x_ptr + row * K + cols, mask=cols < K, other=0.0)
        tl.store(q_ptr + row * K + cols, v.to(tl.int8), mask=cols < K)

    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    q = torch.empty(m, k, device=dev, dtype=torch.int8)
    block = triton.next_power_of_2(k)
    for nw in (4, 8):
        report[f"m={m} k={k} empty nw={nw}"] = sweep.time_us([lambda: _empty[(m,)](x, num_warps=nw)] * 20, dev, 20)
        report[f"m={m} k={k} copy nw={nw}"] = sweep.time_us(
            [lambda: _copy[(m,)](x, q, k, BLOCK=block, num_warps=nw)] * 20, dev, 20)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, nargs="+", default=[256])
    p.add_argument("--k", type=int, nargs="+", default=[3072, 12288])
    p.add_argument("--cases", nargs="+", default=["w4a8", "int8"], choices=list(CASES))
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run in the Triton interpreter")
    p.add_argument("--quick", action="store_true", help="only the defaults, pow2, and pieces at 2, 4 and 8 warps")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        log.error("probe_act_quant_small_m.py needs a CUDA GPU")
        return 2
    from lowbit.kernels.triton_act_quant import act_quant_triton

    dev = torch.device(args.device)
    report = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "floors_us": {}, "us": {},
              "codes": {}, "failures": {}}
    for m in args.m:
        for k in args.k:
            _floors(m, k, dev, report["floors_us"])
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            x[:, :: max(1, k // 16)] *= 20.0  # outlier channels, as in the models
            for case in args.cases:
                rotation, perm, run = CASES[case]
                base = None
                for variant in (QUICK if args.quick else VARIANTS):
                    label = f"m={m} k={k} {case} " + (",".join(f"{a}={b}" for a, b in variant.items()) or "default")

                    def call(variant=variant):
                        return act_quant_triton(x, torch.int8, 127.0, rotation, 256, None, False, perm,
                                                perm_run=run, **variant)
                    try:
                        codes = call()[0]
                        report["us"][label] = sweep.time_us([call] * 20, dev, 20)
                    except Exception as exc:  # noqa: BLE001 - a variant that cannot run is recorded, the probe goes on
                        report["failures"][label] = f"{type(exc).__name__}: {exc}"[:300]
                        continue
                    if base is None:
                        base = codes
                    diff = (codes.int() - base.int()).abs()
                    report["codes"][label] = {"equal": float((diff == 0).float().mean()), "max_diff": int(diff.max())}
                    log.info("%s: %.2f us", label, report["us"][label])
            Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
