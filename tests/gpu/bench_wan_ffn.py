"""Wan 2.1's feed-forward in real ComfyUI: bf16, ComfyUI's fused ``linear_input_act`` and LowBit's routed layer.

Usage (from the repository root)::

  python tests/gpu/bench_wan_ffn.py --out wan_ffn.json
  python tests/gpu/bench_wan_ffn.py --device cpu --sizes tiny --tokens 64 --iters 2   # CPU smoke run

ComfyUI's ``WanFeedForward`` computes ``ffn.2`` as ``comfy.ops.linear_input_act(ffn[2], ffn[0](x), "gelu_tanh")``:
for an INT8 weight, kitchen's INT8 linear with the GELU inside its activation quantizer, without calling the
layer. LowBit routes that call through its layer (``nodes/input_act.py``). Per Wan size (a one-block Wan 2.1
model with random bf16 weights, loaded by ComfyUI, quantized by Quantize Model's core in ``int8_convrot``) and
token count, the median time of the whole feed-forward module:

* ``bf16``: the float model's;
* ``stock_fused``: the quantized module with ComfyUI's own class (what LowBit's layers got before the routing);
* ``lowbit``: the quantized module as LowBit leaves it (routed; the GELU computed in LowBit's act-quant kernel);

and each one's relative error against bf16.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_flux_step as bench  # noqa: E402
from bench_wan_step import SIZES, wan_state_dict  # noqa: E402


def one_block_wan(dim: int, ffn: int, heads: int, device: torch.device):
    import comfy.sd

    return comfy.sd.load_diffusion_model_state_dict(wan_state_dict(dim, ffn, heads, 1, device))


def timed(fn, device: torch.device, iters: int) -> float:
    for _ in range(2):
        fn()
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=max(50, iters * 10), return_mode="median")) * 1000
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["1.3b", "14b"], choices=list(SIZES))
    p.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    p.add_argument("--device", default="cuda")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    bench.import_comfy(args.device)
    import comfy.ldm.wan.model as wan_model
    import comfy.model_management

    from lowbit.nodes.input_act import ROUTED_ATTR
    from lowbit.nodes.model_quant import quantize_model
    from lowbit.quant.policy import Policy

    device = torch.device(args.device)
    rows = []
    for size in args.sizes:
        dim, ffn_dim, heads = SIZES[size]
        float_model = one_block_wan(dim, ffn_dim, heads, device)
        quantized = quantize_model(float_model, Policy(mode="int8_convrot"))
        comfy.model_management.load_models_gpu([float_model, quantized])
        float_ffn = float_model.model.diffusion_model.blocks[0].ffn
        ffn = quantized.model.diffusion_model.blocks[0].ffn
        routed = type(ffn)
        assert getattr(routed, ROUTED_ATTR, False), "the quantized model's FFN is not routed"
        for tokens in args.tokens:
            x = torch.randn(1, tokens, dim, device=device, dtype=float_ffn[0].weight.dtype,
                            generator=torch.Generator(device=device).manual_seed(tokens))
            row = {"size": size, "dim": dim, "ffn_dim": ffn_dim, "tokens": tokens}
            with torch.no_grad():
                ref = float_ffn(x).float()
                row["bf16_us"] = timed(lambda: float_ffn(x), device, args.iters)
                for name, cls in (("stock_fused", wan_model.WanFeedForward), ("lowbit", routed)):
                    ffn.__class__ = cls
                    try:
                        out = ffn(x).float()
                        row[f"{name}_us"] = timed(lambda: ffn(x), device, args.iters)
                    finally:
                        ffn.__class__ = routed
                    row[f"{name}_err"] = float((out - ref).norm() / ref.norm())
                    row[f"{name}_x_bf16"] = row["bf16_us"] / row[f"{name}_us"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        comfy.model_management.unload_all_models()  # before the next size's models
    if args.out:
        report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  "torch": torch.__version__, "rows": rows}
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
