"""A Wan 2.1 denoiser call in real ComfyUI: bf16, stock ComfyUI's native ``int8_convrot``, and LowBit's formats.

Usage (from the repository root)::

  python tests/gpu/bench_wan_step.py --out wan_step.json                  # 14B width, 4 blocks, 480x832x81
  python tests/gpu/bench_wan_step.py --device cpu --size tiny --frames 1 --height 8 --width 8 --iters 1   # smoke

The model is a Wan 2.1 t2v of the real width with ``--blocks`` of its blocks (random bf16 weights; the
per-block work is the real model's, so the ratios are a whole step's, less the embeddings and head). Modes:

* ``bf16``: the float model as ComfyUI loads it;
* ``stock_int8_convrot``: the same weights as a native ``int8_convrot`` state dict (``quantize_state_dict``),
  loaded by stock ComfyUI (kitchen's layers; its fused ``linear_input_act`` for the FFN);
* a LowBit format (``int8_convrot``, ``fp8_rowwise``, ``w4a4``...): the float model quantized by Quantize Model's
  core (LowBit's layers, kernels and routed FFN);
* any of them ending in ``+attn`` (``bf16+attn``, ``int8_convrot+attn``): with the Attention Backend (LowBit)
  node's attention (``--attention-backend``, default ``auto``).

Per mode: the median time of one ``apply_model`` call (CUDA events, after two warm-up calls that also settle the
kernel dispatcher), its ratio against bf16, and the relative error of its output against bf16's.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_flux_step as bench  # noqa: E402

SIZES = {"1.3b": (1536, 8960, 12), "14b": (5120, 13824, 40), "tiny": (256, 512, 2)}  # dim, ffn_dim, heads


def wan_state_dict(dim: int, ffn: int, heads: int, blocks: int, device: torch.device) -> dict[str, torch.Tensor]:
    import comfy.ldm.wan.model as wan_model
    import comfy.memory_management
    import comfy.ops

    lazy = getattr(comfy.memory_management, "aimdo_enabled", False)
    comfy.memory_management.aimdo_enabled = False  # with Dynamic VRAM on, ComfyUI's layers wait for a state dict
    try:
        shapes = wan_model.WanModel(model_type="t2v", dim=dim, ffn_dim=ffn, freq_dim=256, text_dim=4096,
                                    num_heads=heads, num_layers=blocks, in_dim=16, out_dim=16, device="meta",
                                    operations=comfy.ops.disable_weight_init).state_dict()
    finally:
        comfy.memory_management.aimdo_enabled = lazy
    gen = torch.Generator(device=device).manual_seed(0)
    sd = {}
    for key, t in shapes.items():
        value = torch.randn(t.shape, generator=gen, device=device)
        sd[key] = (value * (t.shape[-1] ** -0.5 if t.dim() >= 2 else 0.02)).to(torch.bfloat16).cpu()
    return sd


def timed_call(model_patcher, args, device: torch.device, iters: int,
               transformer_options: dict | None = None) -> tuple[float, torch.Tensor]:
    import comfy.model_management

    comfy.model_management.load_models_gpu([model_patcher])
    x, t, ctx = (a.to(model_patcher.load_device) for a in args)
    options = {"transformer_options": dict(transformer_options)} if transformer_options else {}

    def call():
        with torch.no_grad():
            return model_patcher.model.apply_model(x, t, c_crossattn=ctx, **options)

    out = None
    for _ in range(2):
        out = call()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            call()
            times.append((time.perf_counter() - begin) * 1000)
    return statistics.median(times), out.float().cpu()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="14b", choices=list(SIZES))
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--frames", type=int, default=21, help="latent frames (81 video frames: 21)")
    p.add_argument("--height", type=int, default=60, help="latent height (480 px: 60)")
    p.add_argument("--width", type=int, default=104, help="latent width (832 px: 104)")
    p.add_argument("--text-tokens", type=int, default=512)
    p.add_argument("--modes", nargs="+", default=["bf16", "stock_int8_convrot", "int8_convrot", "fp8_rowwise", "w4a4"])
    p.add_argument("--attention-backend", default="auto", help="the Attention Backend node's backend for +attn modes")
    p.add_argument("--device", default="cuda")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    bench.import_comfy(args.device)
    import comfy.model_management
    import comfy.sd

    from lowbit.nodes.model_quant import quantize_model
    from lowbit.quant.policy import Policy
    from lowbit.quant.quantize import quantize_state_dict

    device = torch.device(args.device)
    dim, ffn, heads = SIZES[args.size]
    sd = wan_state_dict(dim, ffn, heads, args.blocks, device)
    gen = torch.Generator().manual_seed(1)
    inputs = (torch.randn(1, 16, args.frames, args.height, args.width, generator=gen),
              torch.tensor([0.7]), torch.randn(1, args.text_tokens, 4096, generator=gen))
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "size": args.size, "blocks": args.blocks,
              "tokens": args.frames * (args.height // 2) * (args.width // 2), "modes": {}}
    float_model = comfy.sd.load_diffusion_model_state_dict(dict(sd))
    reference = None
    for mode in args.modes:
        started = time.perf_counter()
        fmt, attn = (mode[: -len("+attn")], True) if mode.endswith("+attn") else (mode, False)
        options = bench.attention_options(args.attention_backend) if attn else None
        if fmt == "bf16":
            patcher = float_model
        elif fmt == "stock_int8_convrot":
            quantized_sd, _ = quantize_state_dict(sd, Policy(mode="int8_convrot"), device=device)
            patcher = comfy.sd.load_diffusion_model_state_dict({k: v.cpu() for k, v in quantized_sd.items()})
            del quantized_sd
        else:
            patcher = quantize_model(float_model, Policy(mode=fmt))
        prepare_s = time.perf_counter() - started
        ms, out = timed_call(patcher, inputs, device, args.iters, options)
        if mode == "bf16":
            reference = out
        row = {"ms": ms, "prepare_s": prepare_s}
        if reference is not None:
            row["error"] = float((out - reference).norm() / reference.norm())
            row["x_bf16"] = (report["modes"]["bf16"]["ms"] if mode != "bf16" else ms) / ms
        report["modes"][mode] = row
        print(mode, json.dumps(row), flush=True)
        if patcher is not float_model:
            comfy.model_management.unload_all_models()
            del patcher
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
