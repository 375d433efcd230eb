"""A Krea 2 step in real ComfyUI (random weights): bf16 against LowBit's formats, its block norms and MLPs fused or not.

Usage (from the repository root)::

  python tests/gpu/bench_krea2_step.py --modes bf16+attn int8_convrot+attn int8_convrot+nonorm+attn --out r.json
  python tests/gpu/bench_krea2_step.py --size tiny --device cpu --iters 1   # CPU smoke run

A Krea 2 model of the chosen size (ComfyUI's ``SingleStreamDiT`` at its defaults: width 6144, 28 blocks of 48 heads
and 12 KV heads, SwiGLU MLP 16384, a 12-layer text fusion of width 2560; built from a random bf16 state dict by
ComfyUI's own loader: matrices N(0, 1 / fan-in), vectors N(0, 0.02^2), so the norms' zero-centred scales are near
0) is run at 1024x1024 (a 128x128 latent of 16 channels: 4096 image tokens) with 512 text tokens, batch 1, eager.
Modes, rounds and the report as ``bench_flux2_step.py``: ``+unfused`` computes every input as written;
``+noswiglu`` keeps the MLPs' ``silu(gate) * up`` as written; ``+nonorm`` keeps the blocks' RMSNorms and their
modulation ``(1 + scale) * norm + shift`` as written (``nodes/rms_norm.py``: their share). The tiny size is
``tests/comfy``'s Krea 2 layout at width 256.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "comfy"))  # comfy_helpers: TINY_KREA2, random_weights
import bench_flux2_step as fused_step  # noqa: E402

#: SingleStreamDiT settings beside the tiny layout's (None: the class's default), latent side (pixels / 8), text tokens
SIZES = {
    "full": dict(features=6144, layers=28, heads=48, kvheads=12, txtlayers=12, txtdim=2560, side=128, txt=512),
    "tiny": dict(side=16, txt=16),
}


def _config(size: str) -> dict:
    from comfy_helpers import TINY_KREA2

    return {**TINY_KREA2, **{k: v for k, v in SIZES[size].items() if k not in ("side", "txt")}}


def build(size: str, device: torch.device):
    import comfy.ldm.krea2.model as krea2_model
    import comfy.ops
    from comfy_helpers import load_tiny_krea2, random_weights

    config = {k: v for k, v in _config(size).items() if k != "image_model"}
    sd = random_weights(lambda: krea2_model.SingleStreamDiT(**config, device="meta",
                                                            operations=comfy.ops.disable_weight_init), device=device)
    return load_tiny_krea2(sd)


def inputs(size: str, device: torch.device, dtype: torch.dtype, seed: int = 1):
    s, config = SIZES[size], _config(size)
    # the text context as ComfyUI hands it: (batch, tokens, text layers x text width)
    return fused_step.random_inputs((16, s["side"], s["side"]), s["txt"], config["txtlayers"] * config["txtdim"],
                                    device, dtype, seed)


def main(argv=None) -> int:
    args = fused_step.parse_args(__doc__.split("\n\n")[0], SIZES, "full", argv, extra_flags=("nonorm",))
    device = torch.device(args.device)
    return fused_step.compare_modes(args, lambda: build(args.size, device),
                                    lambda dtype: inputs(args.size, device, dtype), "swiglu_feed_forward_classes",
                                    {"size": args.size, **SIZES[args.size]},
                                    call=lambda dm: lambda x, t, ctx, y=None, guidance=None, **kw: dm(x, t, ctx, **kw),
                                    flag_patches={"nonorm": ("block_norm_sites", dict)})


if __name__ == "__main__":
    raise SystemExit(main())
