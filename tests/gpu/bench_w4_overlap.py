"""The codebook W4 weight expanded and multiplied in one launch (``overlap_w4_gemm.py``, an experiment) against the two
launches it would replace (``triton_w4_expand`` then the W8A8 GEMM), the in-register W4 GEMM and bf16, GEMM alone.

Not a pytest file; needs a CUDA GPU::

    python tests/gpu/bench_w4_overlap.py --m 256 1024 --out overlap.json

For every issue shape and config (the INT8 format's candidates for the M bucket that run one program an output
tile), both ways of running the expanded weight are timed as CUDA-graph replays over enough weight copies that
each call reads its packed weight from HBM (``sweep_w4_gemm.time_us``, ``copies_for``), and the overlapped
output and levels are compared bit for bit with the two launches', five launches in a row and after the graph
replays (the launch's counters must come back to zero every time). The in-register W4 GEMM is timed over its
own candidate list for scale. Exits 1 if any output differs, 2 without a GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from pathlib import Path

import sweep_w4_gemm as sweep

SHAPES = [(3072, 3072), (9216, 3072), (12288, 3072), (3072, 12288), (15360, 3072)]
log = logging.getLogger("bench_w4_overlap")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--shapes", nargs="*", default=None, help="NxK pairs (default: the issue shapes)")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--calls", type=int, default=24)
    p.add_argument("--rotate-mb", type=float, default=256.0)
    p.add_argument("--configs", nargs="*", default=None, help="GEMM config names (default: the dispatcher's list)")
    p.add_argument("--no-in-register", action="store_true", help="skip the in-register W4 GEMM's configs")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import torch

    if not torch.cuda.is_available():
        print("bench_w4_overlap.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    from lowbit.kernels.backend import capability
    from lowbit.kernels.gemm_config import GemmConfig, w4_candidates
    from lowbit.kernels.ops import permute_columns, plane_run
    from lowbit.kernels.triton_w4_expand import expand_w4_int8
    from overlap_w4_gemm import w4_overlap_candidates, w4_overlap_mm
    from lowbit.kernels.triton_w8a8_gemm import split_k_workspace, w8a8_mm_triton

    device = torch.device("cuda")
    cap = capability(device)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else SHAPES
    report = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
              "rows": []}
    all_equal = True
    for m in args.m:
        for n, k in shapes:
            prob = sweep.make_problem(m, n, k, "codebook", device)
            a, packed, s_rel, table = prob["a"], prob["packed"], prob["s_rel"], prob["table"]
            a_scale, w_scale, bias = prob["a_scale"].reshape(-1), prob["w_scale"], prob["bias"]
            copies = sweep.copies_for(packed.numel(), args.rotate_mb)
            weights = [(packed, s_rel)] + [(packed.clone(), s_rel.clone()) for _ in range(copies - 1)]
            reps = max(1, -(-args.calls // len(weights)))
            out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
            row = {"m": m, "n": n, "k": k, "bf16_us": sweep.bf16_linear_us(m, n, k, args, device),
                   "two_launches": {}, "overlap": {}, "in_register": {}, "equal": {}}
            configs = ([GemmConfig.from_name(c) for c in args.configs] if args.configs
                       else w4_overlap_candidates(cap, m))
            for config in configs:
                name = config.name

                def two(pk=packed, sr=s_rel, config=config):
                    levels = expand_w4_int8(pk, sr, table, 16)
                    return levels, w8a8_mm_triton(a, levels, a_scale, w_scale, bias, None, None, torch.bfloat16,
                                                  config, out=out)

                def fused(pk=packed, sr=s_rel, config=config):
                    return w4_overlap_mm(a, pk, sr, table, 16, a_scale, w_scale, bias, torch.bfloat16, config,
                                         out=out)

                try:
                    ref_levels, ref = (t.clone() for t in two())
                    equal = True
                    for _ in range(5):
                        levels, got = fused()
                        equal &= torch.equal(levels, ref_levels) and torch.equal(got, ref)
                    torch.cuda.synchronize()
                    row["two_launches"][name] = sweep.time_us(
                        [lambda w=w, c=config: two(*w, config=c) for w in weights] * reps, device, args.replays)
                    row["overlap"][name] = sweep.time_us(
                        [lambda w=w, c=config: fused(*w, config=c) for w in weights] * reps, device, args.replays)
                    levels, got = fused()
                    equal &= torch.equal(levels, ref_levels) and torch.equal(got, ref)
                    held = split_k_workspace(device, 1, 2)
                    equal &= int(held[1].abs().sum()) == 0  # counters and flags back to zero
                except Exception as err:  # noqa: BLE001 - recorded per config
                    if sweep.is_cuda_fatal(err):
                        raise
                    row["equal"][name] = f"{type(err).__name__}: {str(err)[:300]}"
                    all_equal = False
                    continue
                row["equal"][name] = bool(equal)
                all_equal &= bool(equal)
            if not args.no_in_register:
                a_perm_cache = {}
                for config in w4_candidates(cap, m, codebook=True):
                    if config.block_k not in a_perm_cache:
                        a_perm_cache[config.block_k] = permute_columns(a, config.block_k, plane_run(True))
                    a_perm = a_perm_cache[config.block_k]
                    try:
                        row["in_register"][config.name] = sweep.time_us(
                            [lambda w=w, c=config: sweep.run_w4(prob, a_perm, c, out, packed=w[0], s_rel=w[1])
                             for w in weights] * reps, device, args.replays)
                    except Exception as err:  # noqa: BLE001
                        if sweep.is_cuda_fatal(err):
                            raise
                        row["in_register"][config.name] = None
            best = {part: min((v for v in row[part].values() if v), default=math.nan)
                    for part in ("two_launches", "overlap", "in_register")}
            row["best_vs_bf16"] = {part: row["bf16_us"] / v for part, v in best.items()}
            report["rows"].append(row)
            log.info("M %5d  %5d x %5d  bf16 %.1f us | best: two launches %.1f (%.2fx)  overlap %.1f (%.2fx)  "
                     "in-register %.1f (%.2fx)  equal %s", m, n, k, row["bf16_us"], best["two_launches"],
                     row["best_vs_bf16"]["two_launches"], best["overlap"], row["best_vs_bf16"]["overlap"],
                     best["in_register"], row["best_vs_bf16"]["in_register"],
                     all(v is True for v in row["equal"].values()))
            Path(args.out).write_text(json.dumps(report, indent=1))
    for m in args.m:
        rows = [r for r in report["rows"] if r["m"] == m]
        geo = {part: math.exp(sum(math.log(r["best_vs_bf16"][part]) for r in rows) / len(rows))
               for part in ("two_launches", "overlap", "in_register") if all(r["best_vs_bf16"][part] > 0 for r in rows)}
        report.setdefault("geomean_vs_bf16", {})[str(m)] = geo
        log.info("M %d geomean against bf16: %s", m, {k: round(v, 3) for k, v in geo.items()})
    Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if all_equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
