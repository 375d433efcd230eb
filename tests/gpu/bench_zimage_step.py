"""A Z-Image step in real ComfyUI (random weights): bf16 against LowBit's formats, its gated MLPs fused or not.

Usage (from the repository root)::

  python tests/gpu/bench_zimage_step.py --size 6b --modes int8_convrot int8_convrot+nonorm bf16+attn --out r.json
  python tests/gpu/bench_zimage_step.py --size tiny --device cpu --iters 1   # CPU smoke run

A Z-Image model of the chosen size (ComfyUI's ``ZImage`` at 6B: width 3840, 30 layers, two noise and two context
refiners, FFN 10240; built from a random bf16 state dict by ComfyUI's own loader: matrices N(0, 1 / fan-in), norm
scales 1, other vectors N(0, 0.02^2)) is run at 1024x1024 (a 128x128 latent of 16 channels: 4096 image tokens)
with 512 text tokens, batch 1, eager. Modes, rounds and the report as ``bench_flux2_step.py``: ``+unfused``
computes every input as written; ``+noswiglu`` keeps the ``FeedForward`` gating ``silu(w1(x)) * w3(x)`` as written
(its share of the fusion); ``+nonorm`` keeps the blocks' RMSNorms and their modulation as written
(``nodes/rms_norm.py``: their share). The tiny size is ``tests/comfy``'s Z-Image layout at width 256.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "comfy"))  # comfy_helpers: TINY_ZIMAGE, random_weights
import bench_flux2_step as fused_step  # noqa: E402

#: NextDiT settings beside the tiny layout's, latent side (pixels / 8), text tokens (Z-Image: Qwen3 4B, 2560 wide)
SIZES = {
    "6b": dict(dim=3840, n_layers=30, n_heads=30, n_kv_heads=30, cap_feat_dim=2560, pad_tokens_multiple=32, side=128,
               txt=512),
    "tiny": dict(side=16, txt=16),
}


def build(size: str, device: torch.device):
    import comfy.ldm.lumina.model as lumina_model
    import comfy.ops
    from comfy_helpers import TINY_ZIMAGE, load_tiny_zimage, random_weights

    config = {**TINY_ZIMAGE, **{k: v for k, v in SIZES[size].items() if k not in ("side", "txt")}}
    sd = random_weights(lambda: lumina_model.NextDiT(**config, device="meta", operations=comfy.ops.disable_weight_init),
                        device=device)
    for key, value in sd.items():
        if key.endswith(("norm1.weight", "norm2.weight", "norm.weight", "cap_embedder.0.weight")):  # RMSNorm scales
            sd[key] = torch.ones_like(value)
    return load_tiny_zimage(sd)


def inputs(size: str, device: torch.device, dtype: torch.dtype, seed: int = 1):
    s = SIZES[size]
    return fused_step.random_inputs((16, s["side"], s["side"]), s["txt"], s.get("cap_feat_dim", 64), device, dtype,
                                    seed)


def with_text_tokens(dm, tokens: int):
    """``bench_flux_step.step_time`` calls ``dm(x, t, ctx, y=, guidance=)``; NextDiT takes the text token count."""
    return lambda x, t, ctx, y=None, guidance=None, **kwargs: dm(x, t, ctx, tokens, **kwargs)


def main(argv=None) -> int:
    args = fused_step.parse_args(__doc__.split("\n\n")[0], SIZES, "6b", argv, extra_flags=("nonorm",))
    device = torch.device(args.device)
    return fused_step.compare_modes(args, lambda: build(args.size, device),
                                    lambda dtype: inputs(args.size, device, dtype), "_gated_feed_forward_class",
                                    {"size": args.size, **SIZES[args.size]},
                                    call=lambda dm: with_text_tokens(dm, SIZES[args.size]["txt"]),
                                    flag_patches={"nonorm": ("block_norm_sites", dict)})


if __name__ == "__main__":
    raise SystemExit(main())
