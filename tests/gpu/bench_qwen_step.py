"""A Qwen-Image step in real ComfyUI (random weights): bf16 against LowBit's formats, its MLP GELUs fused or not.

Usage (from the repository root)::

  python tests/gpu/bench_qwen_step.py --size 20b --modes int8_convrot int8_convrot+noswiglu bf16+attn --out r.json
  python tests/gpu/bench_qwen_step.py --size tiny --device cpu --iters 1   # CPU smoke run

A Qwen-Image model of the chosen size (ComfyUI's ``QwenImage`` at 20B: 60 dual-stream blocks of width 3072, 24 heads
of 128, MLP 12288, a 3584-wide Qwen2.5-VL text; built from a random bf16 state dict by ComfyUI's own loader:
matrices N(0, 1 / fan-in), RMSNorm scales 1, other vectors N(0, 0.02^2)) is run at 1024x1024 (a 128x128 latent of
16 channels, one frame: 4096 image tokens) with 256 text tokens, batch 1, eager. Modes, rounds and the report as
``bench_flux2_step.py``: ``+unfused`` computes every input as written; ``+noswiglu`` keeps the MLPs' ``GELU``
modules (``gelu(proj(x))``, tanh) as written, the norms fused (the GELU's share of the fusion); ``+noqkv`` keeps
ComfyUI's own attention forward (its q, k, v not made in one pass: ``nodes/joint_attention.py``); ``bf16+qkv`` runs
the bf16 model with that one-pass attention (its ``Attention`` modules swapped for its steps only). The tiny size is
``tests/comfy``'s Qwen-Image layout at width 256.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "comfy"))  # comfy_helpers: TINY_QWEN, random_weights
import bench_flux2_step as fused_step  # noqa: E402

#: the model's settings beside the tiny layout's, latent side (pixels / 8), text tokens
SIZES = {
    "20b": dict(num_layers=60, num_attention_heads=24, attention_head_dim=128, joint_attention_dim=3584, side=128,
                txt=256),
    "tiny": dict(side=8, txt=16),
}
#: the RMSNorm scales (q/k norms and the text input's), set to 1
NORM_SCALES = ("norm_q.weight", "norm_k.weight", "norm_added_q.weight", "norm_added_k.weight", "txt_norm.weight")


def build(size: str, device: torch.device):
    import comfy.ldm.qwen_image.model as qwen_model
    import comfy.ops
    from comfy_helpers import TINY_QWEN, load_tiny_qwen, random_weights

    config = {**TINY_QWEN, **{k: v for k, v in SIZES[size].items() if k not in ("side", "txt")}}
    sd = random_weights(lambda: qwen_model.QwenImageTransformer2DModel(**config, device="meta",
                                                                       operations=comfy.ops.disable_weight_init),
                        device=device)
    for key, value in sd.items():
        if key.endswith(NORM_SCALES):
            sd[key] = torch.ones_like(value)
    return load_tiny_qwen(sd)


def inputs(size: str, device: torch.device, dtype: torch.dtype, seed: int = 1):
    s = SIZES[size]  # one frame of 16 channels
    return fused_step.random_inputs((16, 1, s["side"], s["side"]), s["txt"], s.get("joint_attention_dim", 64), device,
                                    dtype, seed)


@contextlib.contextmanager
def one_pass_attention(diffusion_model):
    """The model's Qwen-Image ``Attention`` modules in LowBit's one-pass class while the block runs, then back."""
    from lowbit.nodes.comfy_ops import _deferring_class
    from lowbit.nodes.joint_attention import FusedJointAttentionMixin, joint_attention_classes

    classes, swapped = {}, []
    for module in diffusion_model.modules():
        if type(module) in joint_attention_classes():
            swapped.append((module, type(module)))
            module.__class__ = _deferring_class(type(module), FusedJointAttentionMixin, classes)
    try:
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls


def main(argv=None) -> int:
    args = fused_step.parse_args(__doc__.split("\n\n")[0], SIZES, "20b", argv, extra_flags=("noqkv",),
                                 float_flags=("qkv",))
    device = torch.device(args.device)
    return fused_step.compare_modes(args, lambda: build(args.size, device),
                                    lambda dtype: inputs(args.size, device, dtype), "_proj_gelu_classes",
                                    {"size": args.size, **SIZES[args.size]},
                                    flag_patches={"noqkv": ("joint_attention_classes", frozenset)},
                                    float_flags={"qkv": one_pass_attention})


if __name__ == "__main__":
    raise SystemExit(main())
