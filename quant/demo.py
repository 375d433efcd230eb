"""A small Flux.1-architecture checkpoint with random weights, for the demo and the tests.

Keys and shapes follow ComfyUI's ``comfy.ldm.flux.model.Flux`` (what ``UNETLoader`` detects as
Flux), built without importing ComfyUI. Linear weights are Gaussian with std ``1/sqrt(fan_in)`` and
a few input channels scaled up, like the outlier channels of trained diffusion transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TinyFluxConfig:
    hidden_size: int = 256  # Flux uses 3072; head dim is fixed at 128 (axes 16+56+56)
    depth: int = 2  # double blocks (Flux: 19)
    depth_single_blocks: int = 2  # single blocks (Flux: 38)
    in_channels: int = 16
    context_in_dim: int = 64  # T5 width (Flux: 4096)
    vec_in_dim: int = 32  # CLIP pooled width (Flux: 768)
    mlp_ratio: float = 4.0
    guidance_embed: bool = True
    outlier_channels: int = 4
    outlier_gain: float = 8.0

    def __post_init__(self):
        if self.hidden_size % 128:
            raise ValueError(f"hidden_size must be a multiple of 128 (Flux's head dim), got {self.hidden_size}")


def flux_shapes(cfg: TinyFluxConfig) -> dict[str, tuple[int, ...]]:
    """Every key of the Flux state dict with its shape."""
    h, mlp = cfg.hidden_size, int(cfg.hidden_size * cfg.mlp_ratio)
    head = 128
    shapes: dict[str, tuple[int, ...]] = {}

    def linear(name, out_f, in_f):
        shapes[f"{name}.weight"] = (out_f, in_f)
        shapes[f"{name}.bias"] = (out_f,)

    linear("img_in", h, cfg.in_channels * 4)
    for emb, width in (("time_in", 256), ("vector_in", cfg.vec_in_dim)) + ((("guidance_in", 256),) if cfg.guidance_embed else ()):
        linear(f"{emb}.in_layer", h, width)
        linear(f"{emb}.out_layer", h, h)
    linear("txt_in", h, cfg.context_in_dim)
    for i in range(cfg.depth):
        for stream in ("img", "txt"):
            b = f"double_blocks.{i}.{stream}"
            linear(f"{b}_mod.lin", 6 * h, h)
            linear(f"{b}_attn.qkv", 3 * h, h)
            shapes[f"{b}_attn.norm.query_norm.weight"] = (head,)
            shapes[f"{b}_attn.norm.key_norm.weight"] = (head,)
            linear(f"{b}_attn.proj", h, h)
            linear(f"{b}_mlp.0", mlp, h)
            linear(f"{b}_mlp.2", h, mlp)
    for i in range(cfg.depth_single_blocks):
        b = f"single_blocks.{i}"
        linear(f"{b}.linear1", 3 * h + mlp, h)
        linear(f"{b}.linear2", h, h + mlp)
        shapes[f"{b}.norm.query_norm.weight"] = (head,)
        shapes[f"{b}.norm.key_norm.weight"] = (head,)
        linear(f"{b}.modulation.lin", 3 * h, h)
    linear("final_layer.linear", cfg.in_channels * 4, h)
    linear("final_layer.adaLN_modulation.1", 2 * h, h)
    return shapes


def tiny_flux_state_dict(cfg: TinyFluxConfig | None = None, seed: int = 0,
                         dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Random weights for :func:`flux_shapes` (deterministic for a seed)."""
    cfg = cfg or TinyFluxConfig()
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for key, shape in flux_shapes(cfg).items():
        if len(shape) == 2:
            w = torch.randn(shape, generator=gen) / shape[1] ** 0.5
            if cfg.outlier_channels:
                cols = torch.randperm(shape[1], generator=gen)[: cfg.outlier_channels]
                w[:, cols] *= cfg.outlier_gain
        elif key.endswith("norm.weight"):
            w = torch.ones(shape)
        else:
            w = torch.randn(shape, generator=gen) * 0.02
        out[key] = w.to(dtype)
    return out
