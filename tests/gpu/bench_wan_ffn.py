"""An MLP that ComfyUI computes with ``linear_input_act``, in real ComfyUI: bf16, ComfyUI's fused call and LowBit's.

Usage (from the repository root)::

  python tests/gpu/bench_wan_ffn.py --out wan_ffn.json
  python tests/gpu/bench_wan_ffn.py --model minimax --out minimax_mlp.json
  python tests/gpu/bench_wan_ffn.py --device cpu --sizes tiny --tokens 64 --iters 2   # CPU smoke run

ComfyUI's ``WanFeedForward`` computes ``ffn.2`` as ``comfy.ops.linear_input_act(ffn[2], ffn[0](x), "gelu_tanh")``,
and MiniMax H3's ``MLP`` computes ``fc2`` as ``linear_input_act(fc2, fc1(x), "swiglu")``: for an INT8 weight,
kitchen's INT8 linear with the activation inside its activation quantizer, without calling the layer. LowBit
routes that call through its layer (``nodes/input_act.py``), and computes the GELU or the SwiGLU inside its own
activation quantization. Per size (a one-block model with random bf16 weights, loaded by ComfyUI, quantized by
Quantize Model's core, ``int8_convrot`` unless ``--mode`` says otherwise) and token count, the median time of the
whole MLP module:

* ``bf16``: the float model's;
* ``stock_fused``: the quantized module with ComfyUI's own class (what LowBit's layers got before the routing);
* ``lowbit``: the quantized module as LowBit leaves it (routed; the activation computed in LowBit's act-quant
  kernel);
* ``lowbit_unfused`` (``--unfused``): routed, with the activation computed by torch first (``fuse_inputs=False``);

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
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "comfy"))  # comfy_helpers.random_weights
import bench_flux_step as bench  # noqa: E402
from bench_wan_step import SIZES, wan_state_dict  # noqa: E402


#: MiniMax H3 widths: hidden, FFN (fc2's input), heads of 128 (the released model: 5376, 14336, 56)
MINIMAX_SIZES = {"h3": (5376, 14336, 56), "tiny": (256, 256, 2)}


def one_block_wan(dim: int, ffn: int, heads: int, device: torch.device):
    import comfy.sd

    return comfy.sd.load_diffusion_model_state_dict(wan_state_dict(dim, ffn, heads, 1, device))


def one_block_minimax(hidden: int, ffn: int, heads: int, device: torch.device):
    import comfy.ldm.minimax.model as minimax_model
    import comfy.ops
    import comfy.sd
    from comfy_helpers import random_weights

    return comfy.sd.load_diffusion_model_state_dict(random_weights(lambda: minimax_model.MiniMaxH3Model(
        hidden_size=hidden, num_layers=1, token_refiner_num_layers=1, num_attention_heads=heads,
        attention_head_dim=128, ffn_hidden_size=ffn, text_dim=hidden, device="meta",
        operations=comfy.ops.disable_weight_init), device=device))


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
    p.add_argument("--model", default="wan", choices=("wan", "minimax"))
    p.add_argument("--sizes", nargs="+", default=None,
                   help=f"wan: {sorted(SIZES)} (default 1.3b 14b); minimax: {sorted(MINIMAX_SIZES)} (default h3)")
    p.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    p.add_argument("--mode", default="int8_convrot")
    p.add_argument("--unfused", action="store_true", help="also time the routed module with fuse_inputs=False")
    p.add_argument("--device", default="cuda")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    bench.import_comfy(args.device)
    import comfy.model_management

    from lowbit.nodes.input_act import ROUTED_ATTR
    from lowbit.nodes.model_quant import quantize_model
    from lowbit.quant.policy import Policy

    if args.model == "wan":
        import comfy.ldm.wan.model as wan_model

        sizes, build, stock_class = SIZES, one_block_wan, wan_model.WanFeedForward
        mlp_of = lambda model: model.model.diffusion_model.blocks[0].ffn  # noqa: E731
    else:
        import comfy.ldm.minimax.model as minimax_model

        sizes, build, stock_class = MINIMAX_SIZES, one_block_minimax, minimax_model.MLP
        mlp_of = lambda model: model.model.diffusion_model.blocks[0].mlp  # noqa: E731
    chosen = args.sizes or (["1.3b", "14b"] if args.model == "wan" else ["h3"])
    if any(size not in sizes for size in chosen):
        p.error(f"--sizes for {args.model}: {sorted(sizes)}")
    device = torch.device(args.device)
    rows = []
    for size in chosen:
        dim, ffn_dim, heads = sizes[size]
        float_model = build(dim, ffn_dim, heads, device)
        quantized = {"lowbit": quantize_model(float_model, Policy(mode=args.mode))}
        if args.unfused:
            quantized["lowbit_unfused"] = quantize_model(float_model, Policy(mode=args.mode), fuse_inputs=False)
        comfy.model_management.load_models_gpu([float_model, *quantized.values()])
        float_mlp = mlp_of(float_model)
        for tokens in args.tokens:
            lead = (1, tokens) if args.model == "wan" else (tokens,)  # MiniMax's blocks run on [tokens, hidden]
            x = torch.randn(*lead, dim, device=device, dtype=float_mlp.fc1.weight.dtype if args.model == "minimax"
                            else float_mlp[0].weight.dtype, generator=torch.Generator(device=device).manual_seed(tokens))
            row = {"model": args.model, "size": size, "dim": dim, "ffn_dim": ffn_dim, "tokens": tokens,
                   "mode": args.mode}
            with torch.no_grad():
                ref = float_mlp(x).float()
                row["bf16_us"] = timed(lambda: float_mlp(x), device, args.iters)
                runs = [("stock_fused", quantized["lowbit"], stock_class), ("lowbit", quantized["lowbit"], None)]
                runs += [("lowbit_unfused", quantized["lowbit_unfused"], None)] if args.unfused else []
                for name, model, cls in runs:
                    mlp = mlp_of(model)
                    routed = type(mlp)
                    assert getattr(routed, ROUTED_ATTR, False), "the quantized model's MLP is not routed"
                    mlp.__class__ = cls or routed
                    try:
                        out = mlp(x).float()
                        row[f"{name}_us"] = timed(lambda: mlp(x), device, args.iters)
                    finally:
                        mlp.__class__ = routed
                    row[f"{name}_err"] = float((out - ref).norm() / ref.norm())
                    row[f"{name}_x_bf16"] = row["bf16_us"] / row[f"{name}_us"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        del float_model, quantized
        comfy.model_management.unload_all_models()  # before the next size's models
    if args.out:
        report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  "torch": torch.__version__, "rows": rows}
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
