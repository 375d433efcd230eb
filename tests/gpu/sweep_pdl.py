"""Programmatic dependent launch (``kernels/gdc.py``) on and off: act-quant + GEMM chains in CUDA graphs (CUDA only).

For each format kind (``int8_convrot``: rotated INT8 codes and the INT8 GEMM, ``fp8``: FP8 codes and the FP8
GEMM, ``w4a8``: rotated INT8 codes and the codebook W4 GEMM), M and issue shape, one tile config (the one a
dispatcher chose, from ``--decisions`` = a ``bench kernels --json`` file, else the first candidate) runs three
ways, in interleaved rounds:

* ``off``: both kernels launched the ordinary way;
* ``first``: the GEMM launched with PDL, the act-quant letting it start as its first instruction;
* ``last``: the same, the act-quant letting it start after its last store (what LowBit ships).

Each is timed as a CUDA graph of ``--chain`` linears on different inputs, back to back as a model's layers
run (GPU time per linear, the gaps between kernels included), and checked bit for bit against ``off``. ::

    python tests/gpu/sweep_pdl.py --decisions k.json --out pdl.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

SHAPES = ((3072, 3072), (12288, 3072), (3072, 12288), (15360, 3072))
VARIANTS = {"off": (False, 0), "first": (True, 1), "last": (True, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", default="32,256,1024")
    p.add_argument("--kinds", default="int8_convrot,fp8,w4a8")
    p.add_argument("--decisions", default=None)
    p.add_argument("--chain", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rep-ms", type=int, default=30)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import torch
    import triton.testing

    if not torch.cuda.is_available():
        print("sweep_pdl: needs a CUDA GPU", file=sys.stderr)
        return 2
    from lowbit.kernels import gdc, triton_act_quant, triton_act_quant_split, triton_w4_gemm, triton_w8a8_gemm
    from lowbit.kernels.bench import FP8_CODEBOOK
    from lowbit.kernels.gemm_config import GemmConfig, w4_candidates, w8a8_candidates
    from lowbit.kernels.reference import FP8, w4a8_level_table

    device = torch.device("cuda")
    cap = torch.cuda.get_device_capability(device)
    decisions = json.load(open(args.decisions))["decisions"] if args.decisions else {}
    prefix = {"int8_convrot": "int8+regular256", "fp8": "fp8_rowwise", "w4a8": "w4a8"}

    def use(variant):
        pdl, trigger = VARIANTS[variant]
        triton_w8a8_gemm.pdl_launch = triton_w4_gemm.pdl_launch = lambda d: pdl
        triton_act_quant.trigger_point = triton_act_quant_split.trigger_point = lambda d: trigger

    def config_for(kind, m, n, k):
        name = decisions.get(f"{prefix[kind]}|sm{cap[0]}{cap[1]}|m{m}|n{n}|k{k}", "")
        if name.startswith("triton:") and not name.startswith("triton:expand-"):
            return GemmConfig.from_name(name[len("triton:"):])
        return (w4_candidates(cap, m, codebook=True) if kind == "w4a8" else w8a8_candidates(cap, m))[0]

    rows, start = [], time.perf_counter()
    table = w4a8_level_table(torch.tensor(FP8_CODEBOOK), device)
    for m in (int(v) for v in args.m.split(",")):
        for n, k in SHAPES:
            xs = [(torch.randn(m, k, device=device) * 2).to(torch.bfloat16) for _ in range(args.chain)]
            bias = torch.randn(n, device=device, dtype=torch.bfloat16)
            sb = torch.rand(n, device=device) * 1e-2
            w8 = torch.randint(-127, 128, (n, k), device=device, dtype=torch.int8)
            wf = (torch.randn(n, k, device=device) * 30).to(FP8)
            packed = torch.randint(-128, 128, (n, k // 2), device=device, dtype=torch.int8)
            s_rel = (torch.rand(n, k // 16, device=device) * 60 + 4).to(FP8)
            bf = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
            bf16_us = triton.testing.do_bench_cudagraph(
                lambda: [torch.nn.functional.linear(x, bf, bias) for x in xs], rep=args.rep_ms) * 1e3 / args.chain
            for kind in args.kinds.split(","):
                cfg = config_for(kind, m, n, k)

                def linear(x, kind=kind, cfg=cfg):
                    if kind == "fp8":
                        q, s, _ = triton_act_quant.act_quant_triton(x, FP8, 448.0, "none", 0, None, False)
                        return triton_w8a8_gemm.w8a8_mm_triton(q, wf, s, sb, bias, None, None, torch.bfloat16, cfg)
                    if kind == "int8_convrot":
                        q, s, _ = triton_act_quant.act_quant_triton(x, torch.int8, 127.0, "regular", 256, None, False)
                        return triton_w8a8_gemm.w8a8_mm_triton(q, w8, s, sb, bias, None, None, torch.bfloat16, cfg)
                    q, s, _ = triton_act_quant.act_quant_triton(x, torch.int8, 127.0, "regular", 256, None, False,
                                                                cfg.block_k)
                    return triton_w4_gemm.w4a8_mm_triton(q, packed, s, sb, bias, s_rel, table, 16, torch.bfloat16, cfg)

                times = {v: [] for v in VARIANTS}
                outs = {}
                for _ in range(args.rounds):
                    for variant in VARIANTS:
                        use(variant)
                        outs[variant] = [linear(x) for x in xs]  # compiles, and the PTX decode's first check
                        times[variant].append(triton.testing.do_bench_cudagraph(
                            lambda: [linear(x) for x in xs], rep=args.rep_ms) * 1e3 / args.chain)
                same = {v: all(torch.equal(a, b) for a, b in zip(outs[v], outs["off"])) for v in VARIANTS}
                row = {"kind": kind, "m": m, "n": n, "k": k, "config": cfg.name, "bf16_us": round(bf16_us, 2),
                       **{f"{v}_us": round(statistics.median(t), 2) for v, t in times.items()},
                       **{f"{v}_rounds_us": [round(t, 2) for t in ts] for v, ts in times.items()},
                       "bit_exact": same}
                row.update({f"{v}_vs_off": round(row["off_us"] / row[f"{v}_us"], 3) for v in ("first", "last")})
                rows.append(row)
                print(f"{kind:13s} m={m:5d} {n:5d}x{k:<5d} {cfg.name:42s} bf16 {bf16_us:6.1f} off {row['off_us']:6.1f} "
                      f"first {row['first_us']:6.1f} last {row['last_us']:6.1f} us  exact {all(same.values())}",
                      flush=True)
    use("last")
    summary = {}
    for kind in args.kinds.split(","):
        for m in (int(v) for v in args.m.split(",")):
            sel = [r for r in rows if r["kind"] == kind and r["m"] == m]
            summary[f"{kind} m={m}"] = {v: round(statistics.geometric_mean([r["bf16_us"] / r[f"{v}_us"] for r in sel]), 3)
                                        for v in VARIANTS}
    for key, value in summary.items():
        print(f"geomean vs bf16 {key}: {value}")
    json.dump({"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
               "triton": triton.__version__, "have_gdc": gdc.HAVE_GDC, "rows": rows, "summary": summary,
               "elapsed_s": round(time.perf_counter() - start, 1)}, open(args.out, "w"), indent=1)
    return 0 if all(all(r["bit_exact"].values()) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
