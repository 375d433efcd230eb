"""A transformer MLP in real ComfyUI: bf16, ComfyUI's own fused call where it has one, and LowBit's.

Usage (from the repository root)::

  python tests/gpu/bench_wan_ffn.py --out wan_ffn.json
  python tests/gpu/bench_wan_ffn.py --model minimax --unfused --out minimax_mlp.json
  python tests/gpu/bench_wan_ffn.py --model flux2 --unfused --out flux2_mlp.json
  python tests/gpu/bench_wan_ffn.py --model zimage --unfused --out zimage_mlp.json
  python tests/gpu/bench_wan_ffn.py --model krea2 --unfused --out krea2_mlp.json
  python tests/gpu/bench_wan_ffn.py --model hidream --unfused --out hidream_mlp.json
  python tests/gpu/bench_wan_ffn.py --device cpu --sizes tiny --tokens 64 --iters 2   # CPU smoke run

ComfyUI's ``WanFeedForward`` computes ``ffn.2`` as ``comfy.ops.linear_input_act(ffn[2], ffn[0](x), "gelu_tanh")``,
and MiniMax H3's ``MLP`` computes ``fc2`` as ``linear_input_act(fc2, fc1(x), "swiglu")``: for an INT8 weight,
kitchen's INT8 linear with the activation inside its activation quantizer, without calling the layer. LowBit
routes that call through its layer (``nodes/input_act.py``), and computes the GELU or the SwiGLU inside its own
activation quantization. Flux 2's double blocks run ``Linear -> SiLUActivation -> Linear`` (no fused call in
ComfyUI); LowBit defers the SwiGLU to the second linear's activation quantization the same way, and so it does for
Z-Image's ``FeedForward``, ``w2(silu(w1(x)) * w3(x))``, from the two linears' outputs, and for the MLPs that
compute that product in their ``forward`` (Krea 2's ``SwiGLU``; HiDream's ``FeedForwardSwiGLU``, timed here as a
dual-stream block's whole MoE MLP). Per size (a
one-block model with random bf16 weights, loaded by ComfyUI, quantized by Quantize Model's core,
``int8_convrot`` unless ``--mode`` says otherwise) and token count, the median time of the whole MLP module:

* ``bf16``: the float model's;
* ``stock_fused`` (Wan, MiniMax): the quantized module with ComfyUI's own class (what LowBit's layers got before
  the routing);
* ``lowbit``: the quantized module as LowBit leaves it (the activation computed in LowBit's act-quant kernel);
* ``lowbit_unfused`` (``--unfused``): the same with the activation computed by torch first (``fuse_inputs=False``);

and each one's relative error against bf16.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
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


#: Flux 2 widths: hidden, MLP hidden (the second linear's input), heads of 128 (dev: 6144, 18432, 48; klein 4B:
#: 3072, 9216, 24)
FLUX2_SIZES = {"dev": (6144, 18432, 48), "klein": (3072, 9216, 24), "tiny": (256, 768, 2)}


def one_block_flux2(hidden: int, ffn: int, heads: int, device: torch.device):
    import comfy.ldm.flux.model as flux_model
    import comfy.ops
    import comfy.sd
    from comfy_helpers import TINY_FLUX2, random_weights

    config = dict(TINY_FLUX2, hidden_size=hidden, num_heads=heads, mlp_ratio=ffn / hidden, depth=1,
                  depth_single_blocks=1)
    return comfy.sd.load_diffusion_model_state_dict(random_weights(lambda: flux_model.Flux(
        **config, device="meta", operations=comfy.ops.disable_weight_init), device=device))


#: Z-Image widths: hidden, FFN (w2's input: the 8/3 multiplier rounded up to 256), heads of 128 (6B: 3840, 10240, 30)
ZIMAGE_SIZES = {"6b": (3840, 10240, 30), "tiny": (256, 768, 2)}


def one_block_zimage(hidden: int, ffn: int, heads: int, device: torch.device):
    import comfy.ldm.lumina.model as lumina_model
    import comfy.ops
    from comfy_helpers import TINY_ZIMAGE, load_tiny_zimage, random_weights

    config = dict(TINY_ZIMAGE, dim=hidden, n_heads=heads, n_kv_heads=heads, n_layers=1)
    model = load_tiny_zimage(random_weights(lambda: lumina_model.NextDiT(
        **config, device="meta", operations=comfy.ops.disable_weight_init), device=device))
    assert model.model.diffusion_model.layers[0].feed_forward.w2.in_features == ffn
    return model


#: Krea 2 widths: hidden, MLP (its down-projection's input: 8/3 x 4 rounded up to 128), heads of 128 (the released
#: model: 6144, 16384, 48, GQA with 12 kv heads)
KREA2_SIZES = {"k2": (6144, 16384, 48), "tiny": (256, 768, 2)}


def one_block_krea2(hidden: int, ffn: int, heads: int, device: torch.device):
    from comfy_helpers import TINY_KREA2, load_tiny_krea2, tiny_weights

    config = dict(TINY_KREA2, features=hidden, heads=heads, kvheads=max(1, heads // 4), layers=1)
    model = load_tiny_krea2(tiny_weights("comfy.ldm.krea2.model", "SingleStreamDiT", config, device))
    assert model.model.diffusion_model.blocks[0].mlp.down.in_features == ffn
    return model


#: HiDream widths: hidden, a routed expert's MLP (its w2's input), heads of 128 (I1: 2560, 6912, 20); the module
#: timed is a dual-stream block's MoE MLP: the shared expert and 4 routed ones, 2 active per token
HIDREAM_SIZES = {"i1": (2560, 6912, 20), "tiny": (256, 768, 2)}


def one_block_hidream(hidden: int, ffn: int, heads: int, device: torch.device):
    from comfy_helpers import TINY_HIDREAM, load_tiny_hidream, tiny_weights

    layout = dict(TINY_HIDREAM, num_attention_heads=heads, num_single_layers=0, llama_layers=[0])
    model = load_tiny_hidream(tiny_weights("comfy.ldm.hidream.model", "HiDreamImageTransformer2DModel", layout,
                                           device), layout)
    assert model.model.diffusion_model.double_stream_blocks[0].block.ff_i.experts[0].w2.in_features == ffn
    return model


@dataclasses.dataclass(frozen=True)
class Model:
    sizes: dict
    default_sizes: tuple
    build: object  # (hidden, ffn, heads, device) -> ModelPatcher
    mlp: object  # diffusion model -> the MLP module
    stock_class: object  # () -> ComfyUI's own class of the MLP module, whose fused call LowBit routes; or None
    first_weight: object  # MLP -> its first linear's weight (the model's compute dtype)
    rows: object  # tokens -> the leading dims of the MLP's input


def _models() -> dict[str, Model]:
    return {
        "wan": Model(SIZES, ("1.3b", "14b"), one_block_wan, lambda dm: dm.blocks[0].ffn,
                     lambda: importlib.import_module("comfy.ldm.wan.model").WanFeedForward, lambda mlp: mlp[0].weight,
                     lambda tokens: (1, tokens)),
        "minimax": Model(MINIMAX_SIZES, ("h3",), one_block_minimax, lambda dm: dm.blocks[0].mlp,
                         lambda: importlib.import_module("comfy.ldm.minimax.model").MLP, lambda mlp: mlp.fc1.weight,
                         lambda tokens: (tokens,)),  # MiniMax's blocks run on [tokens, hidden]
        "flux2": Model(FLUX2_SIZES, ("dev", "klein"), one_block_flux2, lambda dm: dm.double_blocks[0].img_mlp,
                       None, lambda mlp: mlp[0].weight, lambda tokens: (1, tokens)),  # SiLUActivation, no fused call
        "zimage": Model(ZIMAGE_SIZES, ("6b",), one_block_zimage, lambda dm: dm.layers[0].feed_forward, None,
                        lambda mlp: mlp.w1.weight, lambda tokens: (1, tokens)),  # w2(silu(w1(x)) * w3(x))
        "krea2": Model(KREA2_SIZES, ("k2",), one_block_krea2, lambda dm: dm.blocks[0].mlp, None,
                       lambda mlp: mlp.gate.weight, lambda tokens: (1, tokens)),  # down(silu(gate(x)) * up(x))
        "hidream": Model(HIDREAM_SIZES, ("i1",), one_block_hidream, lambda dm: dm.double_stream_blocks[0].block.ff_i,
                         None, lambda mlp: mlp.shared_experts.w1.weight, lambda tokens: (1, tokens)),  # MoE of those
    }


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
    models = _models()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="wan", choices=sorted(models))
    p.add_argument("--sizes", nargs="+", default=None,
                   help="; ".join(f"{name}: {sorted(m.sizes)} (default {' '.join(m.default_sizes)})"
                                  for name, m in models.items()))
    p.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    p.add_argument("--mode", default="int8_convrot")
    p.add_argument("--unfused", action="store_true", help="also time the quantized module with fuse_inputs=False")
    p.add_argument("--device", default="cuda")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    spec = models[args.model]
    chosen = args.sizes or list(spec.default_sizes)
    if any(size not in spec.sizes for size in chosen):
        p.error(f"--sizes for {args.model}: {sorted(spec.sizes)}")
    bench.import_comfy(args.device)
    import comfy.model_management

    from lowbit.nodes.input_act import ROUTED_ATTR
    from lowbit.nodes.model_quant import quantize_model
    from lowbit.quant.policy import Policy

    stock_class = spec.stock_class() if spec.stock_class else None
    device = torch.device(args.device)
    rows = []
    for size in chosen:
        dim, ffn_dim, heads = spec.sizes[size]
        float_model = spec.build(dim, ffn_dim, heads, device)
        quantized = {"lowbit": quantize_model(float_model, Policy(mode=args.mode))}
        if args.unfused:
            quantized["lowbit_unfused"] = quantize_model(float_model, Policy(mode=args.mode), fuse_inputs=False)
        comfy.model_management.load_models_gpu([float_model, *quantized.values()])
        float_mlp = spec.mlp(float_model.model.diffusion_model)
        for tokens in args.tokens:
            x = torch.randn(*spec.rows(tokens), dim, device=device, dtype=spec.first_weight(float_mlp).dtype,
                            generator=torch.Generator(device=device).manual_seed(tokens))
            row = {"model": args.model, "size": size, "dim": dim, "ffn_dim": ffn_dim, "tokens": tokens,
                   "mode": args.mode}
            with torch.no_grad():
                ref = float_mlp(x).float()
                row["bf16_us"] = timed(lambda: float_mlp(x), device, args.iters)
                runs = [("stock_fused", quantized["lowbit"], stock_class)] if stock_class else []
                runs += [("lowbit", quantized["lowbit"], None)]
                runs += [("lowbit_unfused", quantized["lowbit_unfused"], None)] if args.unfused else []
                for name, model, cls in runs:
                    mlp = spec.mlp(model.model.diffusion_model)
                    own = type(mlp)
                    if stock_class:
                        assert getattr(own, ROUTED_ATTR, False), "the quantized model's MLP is not routed"
                    mlp.__class__ = cls or own
                    try:
                        out = mlp(x).float()
                        row[f"{name}_us"] = timed(lambda: mlp(x), device, args.iters)
                    finally:
                        mlp.__class__ = own
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
