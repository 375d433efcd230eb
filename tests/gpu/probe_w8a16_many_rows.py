"""The W8A16 kernel (``kernels/triton_w8a16_gemm.py``, built for at most 16 rows) at many rows, against bf16.

A probe, not a dispatcher candidate: would a weight-only 4-bit path (the codebook decoded to bf16, bf16 tensor
cores with fp32 sums, which Triton's pipeliner keeps in flight) beat the INT8 one at M = 256? Its INT8-weight
cousin bounds it from above: the weight converted in registers is cheaper than the codebook decode. Each issue
shape, an unrotated INT8 weight, every config of ``CONFIGS`` checked against an fp32 product (relative error
below 1e-2) and timed as CUDA-graph replays over weight copies larger than L2 (``sweep_w4_gemm.time_us``)::

    python tests/gpu/probe_w8a16_many_rows.py --m 256 --out w8a16_rows.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import sweep_w4_gemm as sweep

SHAPES = ((3072, 3072), (9216, 3072), (12288, 3072), (3072, 12288), (15360, 3072))
CONFIGS = ("128x64x64-g8-w4-s4", "128x64x128-g8-w4-s3", "128x128x64-g8-w8-s3", "128x128x64-g8-w4-s4",
           "64x128x64-g8-w4-s4", "128x256x64-g8-w8-s3", "256x128x64-g8-w8-s3", "64x64x128-g8-w4-s4",
           "128x32x128-g8-w4-s4", "256x64x64-g8-w8-s4")
log = logging.getLogger("probe_w8a16_many_rows")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, nargs="+", default=[256])
    p.add_argument("--rotate-mb", type=float, default=256.0)
    p.add_argument("--calls", type=int, default=24)
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch

    if not torch.cuda.is_available():
        print("probe_w8a16_many_rows.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from lowbit.kernels.gemm_config import GemmConfig
    from lowbit.kernels.triton_w8a16_gemm import w8a16_mm_triton

    dev = torch.device("cuda")
    report = {"device": torch.cuda.get_device_name(dev), "rows": {}}
    for m in args.m:
        for n, k in SHAPES:
            bf16 = sweep.bf16_linear_us(m, n, k, args, dev)
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w = torch.randint(-127, 128, (n, k), device=dev, dtype=torch.int8)
            w_scale = torch.rand(n, device=dev) * 1e-2
            bias = torch.randn(n, device=dev, dtype=torch.bfloat16)
            weights = [w] + [w.clone() for _ in range(sweep.copies_for(w.numel(), args.rotate_mb) - 1)]
            reps = max(1, -(-args.calls // len(weights)))
            ref = (x.float() @ w.float().t()) * w_scale + bias.float()
            row = {"bf16_us": bf16, "configs": {}}
            for name in CONFIGS:
                config = GemmConfig.from_name(name)
                try:
                    y = w8a16_mm_triton(x, w, w_scale, bias, torch.bfloat16, config)
                    err = ((y.float() - ref).norm() / ref.norm()).item()
                    us = sweep.time_us([lambda ww=ww, c=config: w8a16_mm_triton(x, ww, w_scale, bias, torch.bfloat16, c)
                                        for ww in weights] * reps, dev, args.replays)
                except Exception as e:  # noqa: BLE001 - recorded per config
                    row["configs"][name] = f"{type(e).__name__}: {str(e)[:200]}"
                    continue
                row["configs"][name] = {"us": us, "vs_bf16": bf16 / us, "rel_err": err, "ok": err < 1e-2}
            timed = [v for v in row["configs"].values() if isinstance(v, dict)]
            best = min(timed, key=lambda v: v["us"]) if timed else None
            report["rows"][f"{m}x{n}x{k}"] = row
            log.info("M %d  %5d x %5d  bf16 %.1f us  best W8A16 %s", m, n, k, bf16,
                     f"{best['us']:.1f} us ({best['vs_bf16']:.2f}x)" if best else "none ran")
    Path(args.out).write_text(json.dumps(report, indent=1))
    timed = [v for r in report["rows"].values() for v in r["configs"].values() if isinstance(v, dict)]
    return 0 if all(v["ok"] for v in timed) else 1


if __name__ == "__main__":
    raise SystemExit(main())
