"""The 4-bit weight expanded to INT8 (``kernels/triton_w4_expand.py``) alone, at each column step, on a GPU.

For each issue shape: the expand kernel in 128- and 256-column steps (``do_bench``, each output checked equal
to the dispatcher's own call's), beside a plain copy of an ``N x K`` INT8 tensor for scale. Codebook weights
(``asym_w4a8_int8``: random codes, random fp8 group scales, the default codebook's level table)::

    python tests/gpu/bench_w4_expand.py --out expand.json
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

SHAPES = ((3072, 3072), (9216, 3072), (12288, 3072), (3072, 12288), (15360, 3072))
log = logging.getLogger("bench_w4_expand")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rep-ms", type=int, default=100)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import torch
    import triton

    from lowbit.kernels import triton_w4_expand as te
    from lowbit.kernels.w4_linear import level_table

    if not torch.cuda.is_available():
        raise SystemExit("bench_w4_expand.py needs a CUDA device")
    dev = torch.device("cuda")
    table = level_table(None, dev)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "block_n": te.BLOCK_N, "shapes": {}}
    for n, k in SHAPES:
        packed = torch.randint(-128, 128, (n, k // 2), dtype=torch.int8, device=dev)
        s_rel = torch.randint(0x30, 0x48, (n, k // 16), dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
        ref = te.expand_w4_int8(packed, s_rel, table, 16)
        src, dst = torch.empty_like(ref), torch.empty_like(ref)
        row = {"copy_nk_us": triton.testing.do_bench(lambda: dst.copy_(src), rep=a.rep_ms) * 1e3}
        for block_k in (128, 256):
            def run(block_k=block_k):
                return te.expand_w4_int8(packed, s_rel, table, 16, block_k=block_k)

            row[f"step_{block_k}_us"] = triton.testing.do_bench(run, rep=a.rep_ms) * 1e3
            row[f"step_{block_k}_equal"] = bool(torch.equal(run(), ref))
        row["read_write_gbps_256"] = (n * k // 2 + n * k // 16 + n * k) / row["step_256_us"] / 1e3
        report["shapes"][f"{n}x{k}"] = row
        log.info("%5d x %5d  copy %.1f us  128 columns %.1f us  256 columns %.1f us  (equal: %s, %s)", n, k,
                 row["copy_nk_us"], row["step_128_us"], row["step_256_us"], row["step_128_equal"],
                 row["step_256_equal"])
    Path(a.out).write_text(json.dumps(report, indent=1))
    return 0 if all(r["step_128_equal"] and r["step_256_equal"] for r in report["shapes"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
