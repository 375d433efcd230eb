"""Flux's double and single stream blocks with their attention's q, k and v made in one pass (``kernels/joint_heads.py``).

ComfyUI's ``DoubleStreamBlock`` and ``SingleStreamBlock`` (``comfy.ldm.flux.layers``: Flux 1 and 2, Chroma,
HunyuanVideo, Hunyuan3D use them) view each stream's ``qkv`` projection as heads, normalize q and k per head
(``QKNorm``: two RMSNorms, each copying its strided view first), concatenate text and image (double blocks: three
copies) and rotate q and k (the RoPE in ``comfy.ldm.flux.math.attention``): seven to eleven launches a block and
several passes over each projection, about a fifth of a quantized Flux-dev step's GPU time.
:func:`install_input_fusion` (``nodes/comfy_ops.py``) swaps these blocks, per model, to subclasses whose forward
makes q, k, v with :func:`kernels.joint_heads.joint_qkv` (one launch per stream) and is otherwise ComfyUI's: the
same modulation, norms and projections in the same order (so the norms and GELUs fused into the activation
quantization stay fused), the same ``attention`` call without its rotation (so attention overrides still apply),
the same ``attn1_output_patch`` patches, output projections, gates and residuals.

ComfyUI's own forward runs instead where the kernel cannot run or is not the fast path (no Triton, the CPU unless the
Triton backend is forced, another backend forced), while
``torch.compile`` traces, where ``attn1_patch`` patches are set (they see q, k, v before the rotation), where a
q/k norm is not plain RMSNorm or has weight patches, for calls without rotary matrices, and for calls with
arguments this forward does not know (a newer ComfyUI's). :func:`flux_block_classes` checks once, on small
instances, that this ComfyUI's forwards compute what the fused ones compute; where they do not, blocks keep theirs.
"""

from __future__ import annotations

import functools
import importlib

import torch

from ..kernels.joint_heads import JointPart, joint_qkv
from .joint_attention import (agreeing_class, cast_norm_weights, kernel_declines, model_module, norm_eps,
                              plain_head_norms)

_LAYERS = "comfy.ldm.flux.layers"


def _declines(block, x, pe, transformer_options, norms, reference: bool) -> bool:
    if pe is None or "attn1_patch" in transformer_options.get("patches", {}):
        return True
    if not reference and kernel_declines(x):
        return True
    return not plain_head_norms(norms, block.hidden_size // block.num_heads)


def _part(qkv: torch.Tensor, width: int, qk_norm, weights) -> JointPart:
    """One stream of ``qkv`` (``[B, S, 3 * width]``, or wider: its first ``3 * width`` channels, as ComfyUI's
    ``view(B, S, 3, H, D)`` reads them) and its ``QKNorm``."""
    q, k, v = qkv[..., :width], qkv[..., width:2 * width], qkv[..., 2 * width:3 * width]
    return JointPart(q, k, v, q_weight=weights[0], k_weight=weights[1],
                     q_eps=norm_eps(qk_norm.query_norm, q), k_eps=norm_eps(qk_norm.key_norm, q))


def _output_patches(attn, transformer_options, extra_options):
    for patch in transformer_options.get("patches", {}).get("attn1_output_patch", ()):
        attn = patch(attn, extra_options)
    return attn


def fused_double_block(block, img, txt, vec, pe, attn_mask=None, modulation_dims_img=None, modulation_dims_txt=None,
                       transformer_options={}, *, reference: bool = False):
    """What ComfyUI's ``DoubleStreamBlock.forward`` returns, with q, k, v from :func:`joint_qkv`, or ``None`` where
    the fused path does not apply (module docstring). ``reference`` runs the kernel's pure-torch definition and
    skips the checks of where the kernel runs (the install-time check)."""
    img_norm, txt_norm = block.img_attn.norm, block.txt_attn.norm
    norms = (txt_norm.query_norm, txt_norm.key_norm, img_norm.query_norm, img_norm.key_norm)
    if _declines(block, img, pe, transformer_options, norms, reference):
        return None
    layers = model_module(type(block), "apply_mod")
    apply_mod = layers.apply_mod
    if block.modulation:
        img_mod1, img_mod2 = block.img_mod(vec)
        txt_mod1, txt_mod2 = block.txt_mod(vec)
    else:
        (img_mod1, img_mod2), (txt_mod1, txt_mod2) = vec
    extra_options = transformer_options.copy()
    img_qkv = block.img_attn.qkv(apply_mod(block.img_norm1(img), (1 + img_mod1.scale), img_mod1.shift,
                                           modulation_dims_img))
    txt_qkv = block.txt_attn.qkv(apply_mod(block.txt_norm1(txt), (1 + txt_mod1.scale), txt_mod1.shift,
                                           modulation_dims_txt))
    width = block.hidden_size
    with cast_norm_weights(norms, img_qkv) as weights:
        parts = (_part(txt_qkv, width, txt_norm, weights[:2]), _part(img_qkv, width, img_norm, weights[2:]))
        q, k, v = joint_qkv(parts, block.num_heads, pe, reference=reference)
    del img_qkv, txt_qkv, parts
    extra_options["img_slice"] = [txt.shape[1], q.shape[2]]
    attn = layers.attention(q, k, v, pe=None, mask=attn_mask, transformer_options=transformer_options)
    del q, k, v
    attn = _output_patches(attn, transformer_options, extra_options)
    txt_attn, img_attn = attn[:, :txt.shape[1]], attn[:, txt.shape[1]:]

    img += apply_mod(block.img_attn.proj(img_attn), img_mod1.gate, None, modulation_dims_img)
    del img_attn
    img += apply_mod(block.img_mlp(apply_mod(block.img_norm2(img), (1 + img_mod2.scale), img_mod2.shift,
                                             modulation_dims_img)), img_mod2.gate, None, modulation_dims_img)
    txt += apply_mod(block.txt_attn.proj(txt_attn), txt_mod1.gate, None, modulation_dims_txt)
    del txt_attn
    txt += apply_mod(block.txt_mlp(apply_mod(block.txt_norm2(txt), (1 + txt_mod2.scale), txt_mod2.shift,
                                             modulation_dims_txt)), txt_mod2.gate, None, modulation_dims_txt)
    if txt.dtype == torch.float16:
        txt = torch.nan_to_num(txt, nan=0.0, posinf=65504, neginf=-65504)
    return img, txt


def fused_single_block(block, x, vec, pe, attn_mask=None, modulation_dims=None, transformer_options={}, *,
                       reference: bool = False):
    """What ComfyUI's ``SingleStreamBlock.forward`` returns, with q, k, v from :func:`joint_qkv`, or ``None`` where
    the fused path does not apply (as :func:`fused_double_block`)."""
    norms = (block.norm.query_norm, block.norm.key_norm)
    if _declines(block, x, pe, transformer_options, norms, reference):
        return None
    layers = model_module(type(block), "apply_mod")
    apply_mod = layers.apply_mod
    mod = block.modulation(vec)[0] if block.modulation else vec
    extra_options = transformer_options.copy()
    qkv, mlp = torch.split(block.linear1(apply_mod(block.pre_norm(x), (1 + mod.scale), mod.shift, modulation_dims)),
                           [3 * block.hidden_size, block.mlp_hidden_dim_first], dim=-1)
    with cast_norm_weights(norms, qkv) as weights:
        q, k, v = joint_qkv((_part(qkv, block.hidden_size, block.norm, weights),), block.num_heads, pe,
                            reference=reference)
    del qkv
    attn = layers.attention(q, k, v, pe=None, mask=attn_mask, transformer_options=transformer_options)
    del q, k, v
    attn = _output_patches(attn, transformer_options, extra_options)
    if block.yak_mlp:
        half = block.mlp_hidden_dim_first // 2
        mlp = block.mlp_act(mlp[..., half:]) * mlp[..., :half]
    else:
        mlp = block.mlp_act(mlp)
    output = block.linear2(torch.cat((attn, mlp), 2))
    x += apply_mod(output, mod.gate, None, modulation_dims)
    if x.dtype == torch.float16:
        x = torch.nan_to_num(x, nan=0.0, posinf=65504, neginf=-65504)
    return x


class FusedDoubleStreamBlockMixin:
    """Flux's ``DoubleStreamBlock`` whose q, k, v are made in one pass where it can (module docstring)."""

    def forward(self, img, txt, vec, pe, attn_mask=None, modulation_dims_img=None, modulation_dims_txt=None,
                transformer_options={}, **kwargs):
        out = None if kwargs else fused_double_block(self, img, txt, vec, pe, attn_mask, modulation_dims_img,
                                                     modulation_dims_txt, transformer_options)
        if out is None:
            return super().forward(img, txt, vec, pe, attn_mask=attn_mask, modulation_dims_img=modulation_dims_img,
                                   modulation_dims_txt=modulation_dims_txt, transformer_options=transformer_options,
                                   **kwargs)
        return out


class FusedSingleStreamBlockMixin:
    """Flux's ``SingleStreamBlock`` whose q, k, v are made in one pass where it can (module docstring)."""

    def forward(self, x, vec, pe, attn_mask=None, modulation_dims=None, transformer_options={}, **kwargs):
        out = None if kwargs else fused_single_block(self, x, vec, pe, attn_mask, modulation_dims,
                                                     transformer_options)
        if out is None:
            return super().forward(x, vec, pe, attn_mask=attn_mask, modulation_dims=modulation_dims,
                                   transformer_options=transformer_options, **kwargs)
        return out


#: ComfyUI's Flux blocks: class name -> (fused mixin, fused forward)
_BLOCKS = {"DoubleStreamBlock": (FusedDoubleStreamBlockMixin, fused_double_block),
           "SingleStreamBlock": (FusedSingleStreamBlockMixin, fused_single_block)}


@functools.lru_cache(maxsize=None)
def flux_block_classes() -> tuple[tuple[type, type], ...]:
    """``(ComfyUI's block class, its fused mixin)`` for those of ``_BLOCKS`` this ComfyUI has whose forward gives, on
    small random instances (with modulation and without, GELU and SwiGLU MLPs, with a mask and without) in fp32,
    what the fused forward gives with its pure-torch definition of q, k, v."""
    found = ((agreeing_class(_LAYERS, name, functools.partial(_agrees, fused=fused)), mixin)
             for name, (mixin, fused) in _BLOCKS.items())
    return tuple((cls, mixin) for cls, mixin in found if cls is not None)


def _agrees(cls, fused) -> bool:
    gen = torch.Generator().manual_seed(0)
    width, heads, d = 32, 2, 16
    double = fused is fused_double_block
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for variant in ({}, {"modulation": False, "mlp_silu_act": True}):
            kwargs = dict(qkv_bias=True, **variant) if double else variant
            block = cls(width, heads, mlp_ratio=2.0, operations=torch.nn, **kwargs)
            for pname, p in block.named_parameters():
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5 if "norm" in pname
                        else torch.randn(p.shape, generator=gen) * 0.3)
            img, txt = torch.randn(1, 5, width, generator=gen), torch.randn(1, 3, width, generator=gen)
            vec = torch.randn(1, width, generator=gen)
            if not variant.get("modulation", True):  # the per-block modulation handed in (Chroma, Flux 2)
                mods = torch.randn(6 if double else 3, 1, 1, width, generator=gen)
                mod_out = importlib.import_module(_LAYERS).ModulationOut
                vec = (((mod_out(*mods[:3]), mod_out(*mods[3:])),) * 2) if double else mod_out(*mods)
            pe = torch.randn(1, 1, 8, d // 2, 2, 2, generator=gen)
            mask = torch.zeros(1, 1, 8, 8)
            mask[..., -1] = -1e4
            for attn_mask in (mask, None):
                args = (img.clone(), txt.clone(), vec, pe) if double else (torch.cat((txt, img), 1), vec, pe)
                want = block(*args, attn_mask=attn_mask, transformer_options={})
                args = (img.clone(), txt.clone(), vec, pe) if double else (torch.cat((txt, img), 1), vec, pe)
                got = fused(block, *args, attn_mask=attn_mask, transformer_options={}, reference=True)
                want, got = (want, got) if double else ((want,), (got,))
                if got is None or not all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(want, got)):
                    return False
    return True
