"""The Gluon W4 GEMM (``kernels/gluon_w4_gemm.py``) against the Triton W4 GEMM and bf16, GEMM alone.

Not a pytest file; needs an sm_90 GPU::

    python tests/gpu/sweep_w4_gluon.py --m 256 1024 --out w4_gluon.json

For every shape (the issue's (N, K) pairs), weight kind (codebook, signed nibbles) and config, it
checks the Gluon output bit for bit against the Triton kernel's (its unmeasured default config) and
times both, and bf16 ``F.linear`` on the same shape: CUDA-graph replays over enough weight copies
that each call reads its weight from HBM (``sweep_w4_gemm.time_us``, ``copies_for``). Exits 2 without
a usable GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import sweep_w4_gemm as sweep

SHAPES = [(3072, 3072), (9216, 3072), (12288, 3072), (3072, 12288), (15360, 3072)]
GLUON = ["128x64x128-g8-w4-s4", "256x64x128-g8-w4-s3", "128x64x128-g8-w4-s3-ws", "128x64x128-g8-w4-s4-ws",
         "256x64x128-g8-w4-s3-ws", "128x128x128-g8-w4-s3-ws", "128x64x128-g8-w4-s3-ws-k2", "256x64x128-g8-w4-s3-ws-k2",
         "64x64x128-g8-w4-s4-ws"]
# the codebook decode's parts, timed by leaving them out (kernels/gluon_w4_gemm.py's DECODE; wrong sums)
DIAG = {"no-scale-load": 1, "no-table-load": 2, "neither": 3}
TRITON = {"codebook": ["128x64x128-g8-w4-s4-tma-tmastore", "256x128x128-g8-w8-s3-tma-tmastore-sub",
                       "128x64x128-g8-w4-s4-tma-tmastore-k4"],
          "nibbles": ["64x128x128-g8-w4-s4-swap", "128x128x128-g8-w4-s4-swap", "64x128x128-g8-w4-s4-swap-k2"]}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--kinds", nargs="+", default=list(sweep.KINDS))
    parser.add_argument("--configs", nargs="+", default=GLUON, help="Gluon configs (GemmConfig names)")
    parser.add_argument("--diag", nargs="*", default=["128x64x128-g8-w4-s4"],
                        help="configs (among --configs, one-partition) whose codebook decode is also timed without "
                             "its loads (DIAG)")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--calls", type=int, default=48)
    parser.add_argument("--rotate-mb", type=float, default=256.0)
    parser.add_argument("--out", default="w4_gluon.json")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("sweep_w4_gluon.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from lowbit.kernels.gemm_config import GemmConfig
    from gluon_w4_gemm import gluon_problem, w4a8_mm_gluon

    device = torch.device("cuda")
    problem = gluon_problem(device)
    if problem:
        print(f"sweep_w4_gluon.py: {problem}", file=sys.stderr)
        return 2
    report = {"device": torch.cuda.get_device_name(device), "rows": []}
    for m in args.m:
        for n, k in SHAPES:
            row = {"m": m, "n": n, "k": k, "bf16_us": sweep.bf16_linear_us(m, n, k, args, device)}
            for kind in args.kinds:
                prob = sweep.make_problem(m, n, k, kind, device)
                ref_cfg = sweep.reference_config(m)
                ref = sweep.run_w4(prob, _perm(prob["a"], ref_cfg.block_k, kind), ref_cfg,
                                   torch.empty(m, n, device=device, dtype=torch.bfloat16))
                copies = sweep.copies_for(prob["packed"].numel(), args.rotate_mb)
                packs = [prob["packed"]] + [prob["packed"].clone() for _ in range(copies - 1)]
                out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
                entry = {"triton": {}, "gluon": {}, "bits": {}}

                def timed(call, limit=200):
                    """Median µs of ``call(packed)`` over the weight copies (CUDA-graph replays), or the error."""
                    try:
                        calls = [lambda p=p: call(p) for p in packs] * max(1, -(-args.calls // len(packs)))
                        return round(sweep.time_us(calls, device, args.replays), 2)
                    except Exception as err:  # noqa: BLE001 - recorded per config
                        return f"{type(err).__name__}: {str(err)[:limit]}"

                for name in TRITON[kind]:
                    cfg = GemmConfig.from_name(name)
                    ap = _perm(prob["a"], cfg.block_k, kind)
                    entry["triton"][name] = timed(lambda p, ap=ap, cfg=cfg: sweep.run_w4(prob, ap, cfg, out, packed=p))
                for name in args.configs:
                    cfg = GemmConfig.from_name(name)
                    ap = _perm(prob["a"], cfg.block_k, kind)

                    def gluon(p, ap=ap, cfg=cfg, decode=0, into=out):
                        return w4a8_mm_gluon(ap, p, prob["a_scale"], prob["w_scale"], prob["bias"], prob["s_rel"],
                                             prob["table"], sweep.GROUP, torch.bfloat16, cfg, out=into, decode=decode)
                    try:
                        got = gluon(prob["packed"], into=None)
                        torch.cuda.synchronize()
                    except Exception as err:  # noqa: BLE001 - recorded per config
                        entry["gluon"][name] = f"{type(err).__name__}: {str(err)[:300]}"
                        continue
                    entry["bits"][name] = bool(torch.equal(got, ref))
                    if not entry["bits"][name]:
                        diff = (got.float() - ref.float()).abs()
                        entry["bits"][name + ":maxdiff"] = float(diff.max())
                        entry["bits"][name + ":ndiff"] = int((diff > 0).sum())
                    entry["gluon"][name] = timed(gluon, 300)
                    if kind == "codebook" and name in args.diag:
                        for label, mode in DIAG.items():
                            entry.setdefault("diag", {})[f"{name}/{label}"] = timed(
                                lambda p, mode=mode, gluon=gluon: gluon(p, decode=mode))
                # the best config's ratio; for Gluon only configs whose output was the Triton kernel's bit for bit
                exact = {k: v for k, v in entry["gluon"].items() if entry["bits"].get(k)}
                best = lambda d: min((v for v in d.values() if isinstance(v, float)), default=float("nan"))
                entry["best_triton_x"] = round(row["bf16_us"] / best(entry["triton"]), 3)
                entry["best_gluon_x"] = round(row["bf16_us"] / best(exact), 3)
                row[kind] = entry
                print(f"M={m} N={n} K={k} {kind}: bf16 {row['bf16_us']:.1f} us, triton best "
                      f"{entry['best_triton_x']}x, gluon best {entry['best_gluon_x']}x, bits {entry['bits']}",
                      flush=True)
                print("   ", entry["gluon"], entry.get("diag", ""), flush=True)
            report["rows"].append(row)
            Path(args.out).write_text(json.dumps(report, indent=1))
    for m in args.m:
        for kind in args.kinds:
            rows = [r[kind] for r in report["rows"] if r["m"] == m and kind in r]
            geo = lambda key: math.exp(statistics.fmean(math.log(r[key]) for r in rows))
            report.setdefault("summary", {})[f"m{m}/{kind}"] = {"triton": round(geo("best_triton_x"), 3),
                                                                "gluon": round(geo("best_gluon_x"), 3)}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report.get("summary"), indent=1))
    return 0


def _perm(a, block_k: int, kind: str):
    """``a``'s columns in blocks of ``block_k``, in the W4 kernels' plane order for the weight ``kind``."""
    from lowbit.kernels.ops import permute_columns, plane_run

    return permute_columns(a, block_k, plane_run(kind == "codebook"))


if __name__ == "__main__":
    sys.exit(main())
