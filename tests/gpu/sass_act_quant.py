"""The variants of ``bench_act_quant.py`` compiled for an H100/H200 (sm_90) without a GPU: their cost on paper.

Not a pytest file. Runs on any machine with Triton's NVIDIA backend (no GPU, no CUDA driver)::

    python tests/gpu/sass_act_quant.py --out aq_sass.json

Each variant goes through the real ``act_quant_triton`` wrapper with CPU tensors; its launch is
intercepted and the kernel compiled for ``cuda:90`` instead. From the cubin (Triton's bundled
``cuobjdump``) it reports registers per thread, shared memory, spills, the static instruction count,
and two estimates: programs per SM (the tightest of registers, shared memory and warps) and
warp-instructions per element of the row (the static count times the warps over the elements a
program covers: its rows times K, or times one chunk for the chunked kernel, whose loop bodies run
once per chunk). A GPU issues about 1e12 warp-instructions a second (132 SMs × 4 × ~1.9 GHz), so
``instructions_per_element × M × K / 1e12`` bounds the time from below; timing on the GPU decides.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import bench_act_quant as bench

SM90_REGISTERS = 65536
SM90_SHARED = 232448  # bytes a block may use on an H100/H200
SM90_WARPS = 64


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="aq_sass.json", help="JSON report path")
    parser.add_argument("--k", type=int, nargs="+", default=[3072, 12288, 15360], help="feature counts")
    parser.add_argument("--m", type=int, default=4096, help="token count (only caps the rows a program takes)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from lowbit.kernels import triton_act_quant as aq
    from lowbit.kernels import triton_act_quant_split as aq_split
    from lowbit.kernels.reference import FP8

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    launchers = {"pow2": aq._LAUNCHER, "pieces": aq_split._PIECES_LAUNCHER, "chunks": aq_split._CHUNKED_LAUNCHER}
    target = GPUTarget("cuda", 90, 32)
    results = []

    def compile_launch(kernel, args_, constexprs, options):
        names = kernel.arg_names
        signature, attrs = {}, {}
        for i, (name, value) in enumerate(zip(names, args_)):
            if isinstance(value, torch.Tensor):
                signature[name] = "*" + {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                                         torch.int8: "i8", torch.int32: "i32", FP8: "fp8e4nv"}[value.dtype]
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(value, float):
                signature[name] = "fp32"
            else:
                signature[name] = "i32"
                if value % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        first = len(args_)
        for name in constexprs:
            signature[name] = "constexpr"
        source = ASTSource(fn=kernel, signature=signature, attrs=attrs,
                           constexprs={(first + j,): v for j, v in enumerate(constexprs.values())})
        return triton.compile(source, target=target, options=dict(options))

    for k in args.k:
        for codes in ("int8", "fp8"):
            for rotation, group in bench.ROTATIONS:
                out_dtype = FP8 if codes == "fp8" else torch.int8
                x = torch.zeros(args.m, k, dtype=torch.bfloat16)
                first, second = bench.PLAIN if rotation == "none" else bench.ROTATED
                variants = [v for v in first + second if codes == "fp8" or v.precise_fp8]
                if rotation == "sylvester":  # the same kernels as regular 256 (both two-stage)
                    continue
                for variant in variants:
                    row = {"k": k, "codes": codes, "rotation": rotation, "label": variant.label}
                    captured = {}

                    def capture(grid, args_, constexprs, **options):
                        captured.update(args=args_, constexprs=constexprs, options=options)

                    try:
                        for launcher in launchers.values():
                            launcher.launch = capture
                        aq.act_quant_triton(x, out_dtype, 448.0 if codes == "fp8" else 127.0, rotation, group, None,
                                            False, tile_elements=variant.tile_elements, num_warps=variant.num_warps,
                                            rotate_impl=variant.rotate_impl, split=variant.split, chunk=variant.chunk,
                                            num_stages=variant.num_stages, precise_fp8=variant.precise_fp8,
                                            max_registers=variant.max_registers)
                    except Exception as err:
                        row["error"] = f"{type(err).__name__}: {err}"[:300]
                    finally:
                        for launcher in launchers.values():
                            launcher.__dict__.pop("launch", None)  # the class's own launch again
                    if "args" in captured:
                        kernel = launchers[variant.split].kernel
                        # as launched on a GPU: the hardware's FP8 cast and rounding (the CPU tensors said otherwise)
                        constexprs = {**captured["constexprs"], "HW_FP8_CAST": True}
                        try:
                            row.update(_resources(compile_launch(kernel, captured["args"], constexprs,
                                                                 captured["options"]), cuobjdump))
                            c, warps = captured["constexprs"], captured["options"]["num_warps"]
                            covered = c["BLOCK_M"] * (c["CHUNK"] if "CHUNK" in c else k)
                            row["instructions_per_element"] = round(row["sass_instructions"] * warps / covered, 3)
                            row["programs_per_sm"] = min(
                                SM90_REGISTERS // max(1, row["registers"] * 32 * warps),
                                SM90_SHARED // row["shared_bytes"] if row["shared_bytes"] else 32,
                                SM90_WARPS // warps, 32)
                            row["block_m"], row["num_warps"] = c["BLOCK_M"], warps
                        except Exception as err:
                            row["error"] = f"{type(err).__name__}: {err}"[:300]
                    results.append(row)
                    print(_line(row), flush=True)
    Path(args.out).write_text(json.dumps({"target": "cuda sm_90", "triton": triton.__version__, "results": results},
                                         indent=1))
    print(f"JSON report: {Path(args.out).resolve()}")
    return 0


def _resources(compiled, cuobjdump: Path) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(cuobjdump), "-res-usage", str(path)], capture_output=True, text=True).stdout
        sass = subprocess.run([str(cuobjdump), "-sass", str(path)], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", usage)
    instructions = sum(1 for line in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", line))
    return {"registers": int(found.group(1)), "stack_bytes": int(found.group(2)), "local_bytes": int(found.group(3)),
            "shared_bytes": compiled.metadata.shared, "sass_instructions": instructions}


def _line(row: dict) -> str:
    head = f"k={row['k']:<6} {row['codes']:<4} {row['rotation']:<8} {row['label']:<40}"
    if "error" in row:
        return f"{head} FAILED {row['error'][:150]}"
    return (f"{head} regs {row['registers']:3d} stack {row['stack_bytes']:4d} smem {row['shared_bytes']:6d} "
            f"programs/SM {row['programs_per_sm']:2d} (x{row['num_warps']} warps, {row['block_m']} rows) "
            f"warp-instr/elem {row['instructions_per_element']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
