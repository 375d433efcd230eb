"""The few-row W8A16 kernel (``kernels/triton_w8a16_gemm.py``): tile configs, the rotation kernel, and the whole
few-row linear against the quantized-activation path and bf16, CUDA-graph time.

Every timed call reads its weight from HBM: each measurement cycles through copies of the weight (and of bf16's)
totalling more than the GPU's L2, as a step's layers do. Per (N, K) shape, M and weight kind (INT8, FP8):

* ``configs``: the W8A16 product alone (``w8a16_mm_triton``, unrotated) through each tile config of ``--grid``
  (block N x block K x warps x stages, 16 rows), each checked against ``weight_only_reference`` first;
* ``rotate_us``: the rotation kernel alone (ConvRot 256) per ``super_blocks``;
* ``linear``: bf16 ``F.linear``, the dispatcher's choice among the quantized-activation candidates only, and among
  the weight-only ones only (each with the dispatcher's own measurement: the linear as a model calls it), for
  ``int8``, ``int8_convrot`` and ``fp8_rowwise``.

One JSON report::

    python tests/gpu/sweep_w8a16.py --m 1,16 --out w8a16.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

SHAPES = {"mod": ((18432, 3072), (9216, 3072), (6144, 3072)),
          "issue": ((3072, 3072), (9216, 3072), (12288, 3072), (3072, 12288), (15360, 3072))}
L2_BYTES = 60 * 2**20  # the H200's 50 MB L2, with a margin


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", default="1,16", help="comma-separated row counts (at most 16)")
    p.add_argument("--shapes", default="mod,issue", help=f"comma-separated subset of {', '.join(SHAPES)}")
    p.add_argument("--grid", default="32,64,128/128,256,512/4/3,4,6",
                   help="block N values / block K values / warps / stages, each comma-separated")
    p.add_argument("--rep-ms", type=int, default=30)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("sweep_w8a16 needs a CUDA GPU")
    sys.path.insert(0, str(Path(__file__).resolve().parents[2].parent))
    import triton.testing

    from lowbit.kernels import dispatch
    from lowbit.kernels.fp8_gemm import fp8_rowwise_linear
    from lowbit.kernels.gemm_config import GemmConfig, w8a16_candidates
    from lowbit.kernels.int8_gemm import int8_linear
    from lowbit.kernels.reference import FP8, weight_only_reference
    from lowbit.kernels.triton_w8a16_gemm import rotate_rows_triton, w8a16_mm_triton

    device = torch.device("cuda")
    cap = torch.cuda.get_device_capability(device)
    bn, bk, warps, stages = ([int(v) for v in part.split(",")] for part in args.grid.split("/"))
    configs = [c for c in (GemmConfig(16, n, k, 1, w, s) for n, k, w, s in itertools.product(bn, bk, warps, stages))
               if c.fits(cap, 2.0, 1.0)]

    def timed(calls) -> float:
        """µs per call of a list of calls replayed in one CUDA graph (each on its own weight copy)."""
        return triton.testing.do_bench_cudagraph(lambda: [c() for c in calls], rep=args.rep_ms,
                                                 return_mode="median") * 1000.0 / len(calls)

    shapes = [s for name in args.shapes.split(",") for s in SHAPES[name]]
    report = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "rows": []}
    for (n, k), m in itertools.product(dict.fromkeys(shapes), [int(v) for v in args.m.split(",")]):
        copies = max(2, -(-L2_BYTES // (n * k)))
        x = torch.randn(m, k, device=device).to(torch.bfloat16)
        w_bf16 = [torch.randn(n, k, device=device, dtype=torch.bfloat16) / k**0.5 for _ in range(max(2, copies // 2))]
        bias = torch.randn(n, device=device, dtype=torch.bfloat16) * 0.1
        scale = torch.rand(n, device=device) * 1e-3 + 1e-4
        row = {"n": n, "k": k, "m": m, "copies": copies,
               "bf16_us": timed([lambda w=w: torch.nn.functional.linear(x, w, bias) for w in w_bf16])}
        del w_bf16
        for kind in ("int8", "fp8"):
            ws = [torch.randint(-127, 128, (n, k), device=device, dtype=torch.int8) if kind == "int8" else
                  (torch.randn(n, k, device=device) * 60).clamp(-448, 448).to(FP8) for _ in range(copies)]
            ref = weight_only_reference(x, ws[0], scale, bias, torch.bfloat16)
            results = {}
            for cfg in configs:
                out = w8a16_mm_triton(x, ws[0], scale, bias, torch.bfloat16, cfg)
                rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                if rel > 2**-7:
                    results[cfg.name] = f"wrong: rel err {rel:.1e}"
                    continue
                results[cfg.name] = timed([lambda w=w, c=cfg: w8a16_mm_triton(x, w, scale, bias, torch.bfloat16, c)
                                           for w in ws])
            best = min((v, name) for name, v in results.items() if isinstance(v, float))
            row[f"{kind}_configs_us"] = results
            row[f"{kind}_best"] = {"config": best[1], "us": best[0], "vs_bf16": row["bf16_us"] / best[0]}
            print(f"n={n} k={k} m={m} {kind}: bf16 {row['bf16_us']:.1f} us, best {best[1]} {best[0]:.1f} us "
                  f"({row['bf16_us'] / best[0]:.2f}x)", flush=True)
            linears = {"int8": [("int8", lambda w, xx: int8_linear(xx, w, scale, bias)),
                                ("int8_convrot", lambda w, xx: int8_linear(xx, w, scale, bias, rotation="regular",
                                                                           group_size=256))],
                       "fp8": [("fp8_rowwise", lambda w, xx: fp8_rowwise_linear(xx, w, scale, bias))]}[kind]
            for fmt, linear in linears:
                for label, keep in (("quantized", lambda name: not name.startswith("dequant")),
                                    ("weight_only", lambda name: name.startswith("dequant:"))):
                    chosen = _choose(dispatch, linear, ws[0], x, keep, cap)
                    row[f"{fmt}_{label}"] = {"choice": chosen[0], "us": timed([lambda w=w: linear(w, x) for w in ws])}
                    chosen[1].__exit__(None, None, None)
                print(f"    {fmt}: quantized {row[f'{fmt}_quantized']}, weight-only {row[f'{fmt}_weight_only']}",
                      flush=True)
            del ws
        row["rotate_us"] = {sb: timed([lambda sb=sb: rotate_rows_triton(x, "regular", 256, sb)])
                            for sb in (1, 2, 4) if k % (256 * sb) == 0 or sb == 1}
        report["rows"].append(row)
        Path(args.out).write_text(json.dumps(report, indent=2))
    report["w8a16_candidates"] = [c.name for c in w8a16_candidates(cap)]
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


def _choose(dispatch, linear, w, x, keep, cap):
    """A fresh dispatcher that offers only the candidates ``keep`` accepts (the others entered as ``broken``), made
    current (the caller exits it), after it measured ``linear``: ``(its choice, the entered context)``."""
    names = set()

    class Recorder(dispatch.Dispatcher):
        def choose(self, key, candidates, device):
            names.update(candidates)
            return super().choose(key, {k: v for k, v in candidates.items() if keep(k)} or candidates, device)
    d = Recorder()
    ctx = dispatch.use_dispatcher(d)
    ctx.__enter__()
    linear(w, x)
    choice = next(iter(d.decisions.values()), None)
    return choice, ctx


if __name__ == "__main__":
    raise SystemExit(main())
