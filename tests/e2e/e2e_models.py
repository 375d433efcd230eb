"""Tiny model and LoRA files for the end-to-end tests, written without importing ComfyUI.

* Flux: ``quant/demo.py``'s tiny Flux, with ``context_in_dim=1024`` so that the stock
  ``LotusConditioning`` node (a fixed ``[1, 2, 1024]`` embedding, no text encoder needed) conditions it.
* SD3 (MMDiT): keys and shapes of ``comfy.ldm.modules.diffusionmodules.mmdit.MMDiT`` as ComfyUI's
  ``detect_unet_config`` reads them (``depth`` blocks of width ``64 * depth``, ``num_heads = depth``;
  the last block's context stream is ``pre_only``).
* LoRA: ComfyUI's plain ``<key>.lora_up.weight`` / ``lora_down.weight`` / ``alpha`` form, keyed
  ``diffusion_model.<layer>``, with :func:`bake_lora` computing the weights it should produce.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

import torch
from safetensors.torch import save_file

from lowbit.quant.demo import TinyFluxConfig, tiny_flux_state_dict

#: width of the stock LotusConditioning embedding ([1, 2, 1024])
LOTUS_CONTEXT_WIDTH = 1024
#: one double and one single block keep a CPU sampling step short (kitchen's eager int8 matmul is slow on CPU)
FLUX_CONFIG = TinyFluxConfig(context_in_dim=LOTUS_CONTEXT_WIDTH, depth=1, depth_single_blocks=1)


def write_safetensors(tensors: Mapping[str, torch.Tensor], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    return path


def tiny_flux(seed: int = 0) -> dict[str, torch.Tensor]:
    """The bf16 tiny Flux state dict the Flux tests load (``UNETLoader`` detects it as Flux)."""
    return tiny_flux_state_dict(FLUX_CONFIG, seed=seed, dtype=torch.bfloat16)


# ---- SD3 --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TinySD3Config:
    depth: int = 4  # MMDiT: hidden = 64 * depth, heads = depth (4: width 256, so ConvRot's groups of 256 apply)
    in_channels: int = 16
    patch_size: int = 2
    context_width: int = 64  # context_embedder input (SD3: 4096)
    pooled_width: int = 32  # y_embedder input (SD3: 2048)
    pos_embed_max_size: int = 16  # patches per side the stored pos_embed covers
    mlp_ratio: float = 4.0

    @property
    def hidden_size(self) -> int:
        return 64 * self.depth


def sd3_shapes(cfg: TinySD3Config) -> dict[str, tuple[int, ...]]:
    h, p = cfg.hidden_size, cfg.patch_size
    mlp = int(h * cfg.mlp_ratio)
    shapes: dict[str, tuple[int, ...]] = {
        "x_embedder.proj.weight": (h, cfg.in_channels, p, p), "x_embedder.proj.bias": (h,),
        "pos_embed": (1, cfg.pos_embed_max_size ** 2, h),
    }

    def linear(name, out_f, in_f):
        shapes[f"{name}.weight"] = (out_f, in_f)
        shapes[f"{name}.bias"] = (out_f,)

    linear("t_embedder.mlp.0", h, 256)
    linear("t_embedder.mlp.2", h, h)
    linear("y_embedder.mlp.0", h, cfg.pooled_width)
    linear("y_embedder.mlp.2", h, h)
    linear("context_embedder", h, cfg.context_width)
    for i in range(cfg.depth):
        for stream in ("context_block", "x_block"):
            b = f"joint_blocks.{i}.{stream}"
            pre_only = stream == "context_block" and i == cfg.depth - 1
            linear(f"{b}.attn.qkv", 3 * h, h)
            if not pre_only:
                linear(f"{b}.attn.proj", h, h)
                linear(f"{b}.mlp.fc1", mlp, h)
                linear(f"{b}.mlp.fc2", h, mlp)
            linear(f"{b}.adaLN_modulation.1", (2 if pre_only else 6) * h, h)
    linear("final_layer.linear", p * p * cfg.in_channels, h)
    linear("final_layer.adaLN_modulation.1", 2 * h, h)
    return shapes


def tiny_sd3(cfg: TinySD3Config | None = None, seed: int = 0,
             dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Random weights (std ``1/sqrt(fan_in)``) for :func:`sd3_shapes`, deterministic for a seed."""
    cfg = cfg or TinySD3Config()
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for key, shape in sd3_shapes(cfg).items():
        if len(shape) >= 2 and key != "pos_embed":
            fan_in = 1
            for d in shape[1:]:
                fan_in *= d
            w = torch.randn(shape, generator=gen) / fan_in ** 0.5
        else:
            w = torch.randn(shape, generator=gen) * 0.02
        out[key] = w.to(dtype)
    return out


# ---- LoRA ---------------------------------------------------------------------------------------

def tiny_lora(state_dict: Mapping[str, torch.Tensor], layers: Iterable[str], *, rank: int = 4,
              alpha: float = 4.0, scale: float = 1.0, seed: int = 1) -> dict[str, torch.Tensor]:
    """A LoRA for ``layers`` of ``state_dict``: ``delta = scale * up @ down * alpha / rank`` per layer.

    ``scale`` sizes the update relative to the weight (its Frobenius norm ratio is about ``scale``).
    """
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in layers:
        weight = state_dict[f"{layer}.weight"].float()
        n, k = weight.shape
        down = torch.randn(rank, k, generator=gen) / k ** 0.5
        up = torch.randn(n, rank, generator=gen) / rank ** 0.5
        # ||up @ down||_F ~ sqrt(n); match the weight's norm times ``scale``
        up *= scale * weight.norm() / (up @ down).norm()
        out[f"diffusion_model.{layer}.lora_down.weight"] = down.to(torch.bfloat16)
        out[f"diffusion_model.{layer}.lora_up.weight"] = (up * rank / alpha).to(torch.bfloat16)
        out[f"diffusion_model.{layer}.alpha"] = torch.tensor(alpha)
    return out


def lora_delta(lora: Mapping[str, torch.Tensor], layer: str, strength: float = 1.0) -> torch.Tensor:
    """The float weight update ComfyUI applies for ``layer`` at ``strength``."""
    up = lora[f"diffusion_model.{layer}.lora_up.weight"].float()
    down = lora[f"diffusion_model.{layer}.lora_down.weight"].float()
    alpha = float(lora[f"diffusion_model.{layer}.alpha"])
    return strength * (alpha / down.shape[0]) * (up @ down)


def lora_layers(lora: Mapping[str, torch.Tensor]) -> list[str]:
    suffix = ".lora_up.weight"
    return sorted(k[len("diffusion_model."):-len(suffix)] for k in lora if k.endswith(suffix))


def bake_lora(state_dict: Mapping[str, torch.Tensor], lora: Mapping[str, torch.Tensor],
              strength: float = 1.0) -> dict[str, torch.Tensor]:
    """``state_dict`` with the LoRA merged into its float weights (in float32, stored back as bf16)."""
    out = dict(state_dict)
    for layer in lora_layers(lora):
        key = f"{layer}.weight"
        out[key] = (state_dict[key].float() + lora_delta(lora, layer, strength)).to(state_dict[key].dtype)
    return out
