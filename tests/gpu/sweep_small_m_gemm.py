"""GEMM alone at small M, every candidate config the dispatcher has (split-K included), CUDA-graph time.

For each M and issue shape: bf16 ``F.linear``, then the INT8 W8A8 GEMM, the signed-nibble W4 GEMM and the
codebook W4 GEMM through each of their candidate configs, each as a CUDA-graph replay (GPU time alone,
operands warm in L2 as in a step's back-to-back layers). Before timing, each config's output is compared
bit for bit with a one-program config's, five launches in a row (a split-K share that raced its tile's
sum, or a lock left counting, shows up as a mismatch). One JSON report::

    python tests/gpu/sweep_small_m_gemm.py --m 256,512 --out sweep.json

``--shapes mod`` takes the per-block modulation linears of Flux and Qwen-Image instead (one row a call at
batch 1: ``--m 1,2``), and ``--extra`` adds configs the dispatcher does not have yet, by name, to every kind.
``--also-join`` measures each W4 config a second time with its decoded planes joined (``GemmConfig.join``: one
dot a K step), compared bit for bit with the two-dot config's output.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

SHAPES = {"issue": ((3072, 3072), (9216, 3072), (12288, 3072), (3072, 12288), (15360, 3072)),
          "mod": ((18432, 3072), (9216, 3072))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", default="256", help="comma-separated token counts")
    p.add_argument("--rep-ms", type=int, default=40)
    p.add_argument("--kinds", default="int8,w4,w4cb", help="comma-separated subset of int8, w4, w4cb")
    p.add_argument("--shapes", default="issue", choices=sorted(SHAPES))
    p.add_argument("--extra", default="", help="comma-separated config names measured besides the candidates")
    p.add_argument("--also-join", action="store_true",
                   help="W4 kinds: also measure every config with its two decoded planes joined (GemmConfig.join)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("sweep_small_m_gemm: needs a CUDA GPU (it times CUDA graphs)", file=sys.stderr)
        return 2
    import triton.testing

    from lowbit.kernels.backend import capability
    from lowbit.kernels.gemm_config import GemmConfig, w4_candidates, w8a8_candidates
    from lowbit.kernels.reference import FP8, w4a8_level_table
    from lowbit.kernels.triton_w4_gemm import _ptx_checked, w4a8_mm_triton
    from lowbit.kernels.triton_w8a8_gemm import w8a8_mm_triton

    device = torch.device("cuda")
    cap = capability(device)
    kinds = args.kinds.split(",")
    extra = [GemmConfig.from_name(name) for name in args.extra.split(",") if name]
    rows, failures = [], []
    start = time.perf_counter()

    def w4_configs(configs):
        configs = list(dict.fromkeys(configs))
        if not args.also_join:
            return configs
        return configs + [dataclasses.replace(c, join=True) for c in configs if not c.join]

    def graph_us(fn):
        return triton.testing.do_bench_cudagraph(fn, rep=args.rep_ms, return_mode="median") * 1000.0

    from comfy_kitchen.backends.eager import w4a8_int8 as ck_w4a8
    table = w4a8_level_table(torch.tensor(ck_w4a8._FIXED_LUT), device)
    for m in (int(v) for v in args.m.split(",")):
        for n, k in SHAPES[args.shapes]:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=device, dtype=torch.bfloat16) / k ** 0.5
            bias = torch.randn(n, device=device, dtype=torch.bfloat16)
            row = {"m": m, "n": n, "k": k, "bf16_us": graph_us(lambda: torch.nn.functional.linear(x, w, bias))}
            a = torch.randint(-127, 128, (m, k), device=device, dtype=torch.int8)
            sa = torch.rand(m, 1, device=device) * 1e-3
            b8 = torch.randint(-127, 128, (n, k), device=device, dtype=torch.int8)
            sb = torch.rand(n, device=device) * 1e-3
            packed = torch.randint(-128, 128, (n, k // 2), device=device, dtype=torch.int8)
            s_rel = (torch.rand(n, k // 16, device=device) * 60 + 4).to(FP8)
            jobs = []
            if "int8" in kinds:
                jobs += [("int8", c, lambda c=c: w8a8_mm_triton(a, b8, sa, sb, bias, None, None, torch.bfloat16, c))
                         for c in dict.fromkeys([*w8a8_candidates(cap, m), *extra])]
            for kind, codebook in (("w4", False), ("w4cb", True)):
                if kind in kinds:
                    operands = (s_rel, table) if codebook else (None, None)
                    jobs += [(kind, c, lambda c=c, operands=operands: w4a8_mm_triton(
                                a, packed, sa, sb, bias, *operands, 16, torch.bfloat16, c))
                             for c in w4_configs(w4_candidates(cap, m, codebook=codebook) + extra)]
            reference = {}
            for kind, config, fn in jobs:
                name = f"{kind} {config.name}"
                try:
                    outs = [fn() for _ in range(5)]
                    one_dot = config.split_k == 1 and not config.join and not config.stream_k
                    ref = reference.setdefault((kind, config.block_k), outs[0] if one_dot else None)
                    same = all(torch.equal(o, outs[0]) for o in outs)
                    if ref is not None and not one_dot:  # split-K, stream-K, joined planes: the plain config's bits
                        same = same and torch.equal(outs[0], ref)
                    if not same:
                        failures.append(f"m={m} n={n} k={k} {name}: outputs differ")
                    row[name] = graph_us(fn)
                except Exception as err:  # report and go on
                    failures.append(f"m={m} n={n} k={k} {name}: {type(err).__name__}: {str(err)[:200]}")
            rows.append(row)
            best = {kind: min(((t, name) for name, t in row.items() if name.startswith(kind + " ")), default=None)
                    for kind in kinds}
            print(f"m={m} n={n} k={k} bf16 {row['bf16_us']:.1f}us " + "  ".join(
                f"{kind}: {row['bf16_us'] / t:.2f}x {name.split(' ', 1)[1]}" for kind, (t, name) in
                ((kd, b) for kd, b in best.items() if b)), flush=True)
    summary = {}
    for m in sorted({r["m"] for r in rows}):
        for kind in kinds:
            subsets = {"with split-K": lambda c: True, "without split-K": lambda c: c.split_k == 1}
            if args.also_join and kind != "int8":
                subsets.update({"two dots a K step": lambda c: not c.join, "joined planes": lambda c: c.join})
            for label, keep in subsets.items():
                ratios = []
                for r in (r for r in rows if r["m"] == m):
                    times = [t for name, t in r.items() if name.startswith(kind + " ")
                             and keep(GemmConfig.from_name(name.split(" ", 1)[1]))]
                    if times:
                        ratios.append(r["bf16_us"] / min(times))
                if ratios:
                    summary[f"m={m} {kind} {label}"] = math.exp(sum(map(math.log, ratios)) / len(ratios))
    for key, value in summary.items():
        print(f"geomean vs bf16, {key}: {value:.3f}x")
    failures += [f"the PTX codebook decode disagreed with the gathers (the gathers were timed): {key}"
                 for key, verdict in _ptx_checked.items() if not verdict]
    for line in failures:
        print("FAILED", line)
    Path(args.out).write_text(json.dumps({"script": "sweep_small_m_gemm", "rows": rows, "summary": summary,
                                          "failures": failures, "wall_s": time.perf_counter() - start}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
