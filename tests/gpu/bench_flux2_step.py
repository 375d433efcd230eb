"""A Flux.2 step in real ComfyUI (random weights): bf16 against LowBit's formats, its SwiGLUs fused or not.

Usage (from the repository root)::

  python tests/gpu/bench_flux2_step.py --size klein4b --modes int8_convrot int8_convrot+unfused --out r.json
  python tests/gpu/bench_flux2_step.py --size tiny --device cpu --iters 1   # CPU smoke run

A Flux.2 model of the chosen size (ComfyUI's ``Flux2``, built from a random bf16 state dict by ComfyUI's own
loader: matrices N(0, 1 / fan-in), norm scales 1, other vectors N(0, 0.02^2)) is run at 1024x1024 (a 64x64
latent of 128 channels: 4096 image tokens) with 512 text tokens, batch 1, eager. Per mode: the median time of
one diffusion-model forward (every model resident; ``--rounds`` rounds over the modes in turn, each timing
``--iters`` steps: the median of the rounds' medians), its speed-up over bf16 measured in the same run, and its
output's relative error against bf16's. A mode is a format, quantized by Quantize Model's core with the preset
ComfyUI's model picks; ``+unfused`` quantizes with ``fuse_inputs=False`` (the norms and SwiGLUs computed as
written instead of inside the activation quantization: an A/B of that fusion); ``+noswiglu`` fuses the norms
only (the SwiGLUs' share); ``+attn`` (``bf16+attn`` too) runs with the Attention Backend (LowBit) node's choice,
on the same quantized model as the mode without it (so a run holds one model per format and fusion flags).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from unittest import mock
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "comfy"))  # comfy_helpers: TINY_FLUX2, random_weights
import bench_flux_step as bench  # noqa: E402

#: hidden width, heads of 128, double and single blocks, text width (klein 4B: Qwen3 4B's three layers), latent
#: side (tokens per side), text tokens
SIZES = {
    "klein4b": dict(hidden_size=3072, num_heads=24, depth=5, depth_single_blocks=20, context_in_dim=7680, side=64,
                    txt=512),
    "tiny": dict(hidden_size=256, num_heads=2, depth=1, depth_single_blocks=1, context_in_dim=64, side=8, txt=16),
}


def build(size: str, device: torch.device):
    import comfy.ldm.flux.model as flux_model
    import comfy.ops
    import comfy.sd
    from comfy_helpers import TINY_FLUX2, random_weights

    s = SIZES[size]
    config = dict(TINY_FLUX2, guidance_embed=False,
                  **{k: s[k] for k in ("hidden_size", "num_heads", "depth", "depth_single_blocks", "context_in_dim")})
    sd = random_weights(lambda: flux_model.Flux(**config, device="meta", operations=comfy.ops.disable_weight_init),
                        device=device)
    for key, value in sd.items():
        if key.endswith(("norm.scale", "norm.weight")):
            sd[key] = torch.ones_like(value)
    return comfy.sd.load_diffusion_model_state_dict(sd)


def random_inputs(latent_shape: tuple, txt: int, text_width: int, device: torch.device, dtype: torch.dtype,
                  seed: int = 1):
    """A random latent of ``latent_shape`` and text context of ``txt`` x ``text_width`` (batch 1), timestep 0.5, no
    pooled vector or guidance, in ``dtype``: ``bench_flux_step.step_time``'s arguments."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(1, *latent_shape, generator=gen, device=device).to(dtype)
    ctx = torch.randn(1, txt, text_width, generator=gen, device=device).to(dtype)
    return x, torch.full((1,), 0.5, device=device, dtype=dtype), ctx, None, None


def inputs(size: str, device: torch.device, dtype: torch.dtype, seed: int = 1):
    """Latent, timestep, text context (and no pooled vector or guidance: klein has neither) in the model's dtype."""
    s = SIZES[size]
    return random_inputs((128, s["side"], s["side"]), s["txt"], s["context_in_dim"], device, dtype, seed)


def parse_args(description: str, sizes: dict, default_size: str, argv=None, extra_flags=(),
               float_flags=()) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--size", choices=sorted(sizes), default=default_size)
    p.add_argument("--modes", nargs="+", default=["int8_convrot", "int8_convrot+unfused"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--iters", type=int, default=10, help="timed steps per mode and round (their median)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over every mode, in turn (the median of rounds)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one step per mode (GPU kernel time by category and the top kernels)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    for mode in args.modes:
        flags = mode.split("+")[1:]
        bf16 = mode.split("+")[0] == "bf16"
        if len(set(flags)) != len(flags) or not set(flags) <= {"unfused", "noswiglu", "attn", *extra_flags} | (
                set(float_flags) if bf16 else set()) \
                or {"unfused", "noswiglu"} <= set(flags) or (bf16 and not flags) \
                or (bf16 and not set(flags) <= {"attn", *float_flags}) or (not bf16 and set(flags) & set(float_flags)):
            p.error(f"a mode is a format, optionally +unfused or +noswiglu, and +attn (bf16: only +attn); got {mode!r}")
    return args


def compare_modes(args, build_model, step_inputs, swiglu_class: str, report: dict, call=None,
                  flag_patches=None, float_flags=None) -> int:
    """The shared body of the fused-step benches: ``build_model()`` (a ModelPatcher, after ComfyUI is imported),
    ``step_inputs(dtype)`` (``bench_flux_step.step_time``'s arguments), ``swiglu_class`` (the ``comfy_ops`` function
    whose ``None`` keeps the model's SwiGLU modules in their own class: ``+noswiglu``), ``call`` (``diffusion model ->
    callable`` taking ``step_time``'s arguments, where the model's forward takes others), ``flag_patches`` (a mode flag
    -> ``(comfy_ops function, its stand-in)`` while that mode's model is quantized: ``parse_args``' ``extra_flags``),
    ``float_flags`` (a flag of bf16 modes -> ``diffusion model -> context manager`` around each of its steps)."""
    bench.import_comfy(args.device)
    import comfy.model_management

    from lowbit.nodes import comfy_ops
    from lowbit.nodes.model_quant import quantize_model
    from lowbit.quant.policy import Policy

    device = torch.device(args.device)
    base = build_model()
    step_args = step_inputs(base.model.get_dtype())  # bf16 on a GPU (fp32 on the CPU)
    models, built_by = {"bf16": base}, {"bf16": "bf16"}
    quantized = {}  # one model per format and fusion flags (+attn only changes the attention a step runs)
    for mode in args.modes:
        fmt, *flags = mode.split("+")
        if fmt == "bf16":
            models[mode], built_by[mode] = base, "bf16"
            continue
        key = (fmt, frozenset(flags) - {"attn"})
        if key not in quantized:
            with contextlib.ExitStack() as stack:
                if "noswiglu" in flags:  # the model's SwiGLU modules keep their own class
                    stack.enter_context(mock.patch.object(comfy_ops, swiglu_class, lambda: None))
                for flag, (name, stand_in) in (flag_patches or {}).items():
                    if flag in flags:
                        stack.enter_context(mock.patch.object(comfy_ops, name, stand_in))
                quantized[key] = (mode, quantize_model(base, Policy(mode=fmt), fuse_inputs="unfused" not in flags))
        built_by[mode], models[mode] = quantized[key]
    comfy.model_management.load_models_gpu(list({id(m): m for m in models.values()}.values()))  # all resident
    # +attn: the Attention Backend (LowBit) node's override, one chooser per mode
    options = {mode: bench.attention_options("auto") if "attn" in mode.split("+")[1:] else None for mode in models}
    times = {mode: [] for mode in models}
    outputs = {}
    def around(mode, dm):  # a bf16 mode's float flags (the same model, something swapped for its steps)
        stack = contextlib.ExitStack()
        if mode.split("+")[0] == "bf16":
            for flag, context in (float_flags or {}).items():
                if flag in mode.split("+")[1:]:
                    stack.enter_context(context(dm))
        return stack

    for _ in range(args.rounds):  # every mode once a round, in turn: a slow phase of the machine hits all alike
        for mode, model in models.items():
            dm = model.model.diffusion_model
            with around(mode, dm):
                step_s, outputs[mode] = bench.step_time(dm if call is None else call(dm), step_args, device,
                                                        args.iters, options[mode])
            times[mode].append(step_s)
    bf16_s = statistics.median(times["bf16"])
    rows = []
    for mode, model in models.items():
        step_s = statistics.median(times[mode])
        rows.append({"mode": mode, "model": built_by[mode], "step_s": step_s, "rounds_s": times[mode],
                     "speedup": bf16_s / step_s,
                     "rel_err": bench.rel_err(outputs[mode], outputs["bf16"])})
        if args.profile:
            from profile_flux_step import profile_step

            dm = model.model.diffusion_model
            fn = dm if call is None else call(dm)
            x, t, ctx, y, g = step_args
            opts = {"transformer_options": dict(options[mode])} if options[mode] else {}
            with around(mode, dm):
                rows[-1]["profile"] = profile_step(lambda: fn(x, t, ctx, y=y, guidance=g, **opts), device)
        if options[mode]:
            rows[-1]["attention"] = bench.attention_report(options[mode])
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "profile"} |
                         ({"by_category_ms": rows[-1]["profile"]["by_category_ms"]} if args.profile else {})),
              flush=True)
    if args.out:
        report = {**report, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  "torch": torch.__version__, "rows": rows}
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    return 0


def main(argv=None) -> int:
    args = parse_args(__doc__.split("\n\n")[0], SIZES, "klein4b", argv)
    device = torch.device(args.device)
    return compare_modes(args, lambda: build(args.size, device), lambda dtype: inputs(args.size, device, dtype),
                         "_swiglu_activation_class", {"size": args.size, **SIZES[args.size]})


if __name__ == "__main__":
    raise SystemExit(main())
