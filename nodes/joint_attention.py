"""Qwen-Image's joint attention with its q, k and v made in one pass (``kernels/joint_heads.py``).

ComfyUI's Qwen-Image ``Attention.forward`` projects both streams, then views the projections as heads (a copy each
for q and k), normalizes q and k per head (four RMSNorms), concatenates the streams (three copies) and rotates q
and k (RoPE): about a dozen launches and three to five passes over each of the six projections, a fifth of a
quantized 20B step's GPU time. :func:`install_input_fusion` (``nodes/comfy_ops.py``) swaps such modules, per
model, to a subclass whose forward makes q, k, v with :func:`kernels.joint_heads.joint_qkv` (one launch per
stream) and is otherwise ComfyUI's: the same projections in the same order, the same mask, the same
``optimized_attention_masked`` call (so attention overrides still apply), the same output projections.

It runs ComfyUI's own forward instead where the kernel cannot run or is not the fast path (no Triton, the CPU
unless the Triton backend is forced, another backend forced),
while ``torch.compile`` traces (Inductor fuses these ops itself), where ``attn1_patch`` patches are set (they see
the joined q, k, v before the rotation), where a norm is not plain RMSNorm or has weight patches, and for a call
without rotary matrices or with a mask other than the ``[B, S_txt]`` text mask.
:func:`joint_attention_classes` checks once, on a small instance, that this ComfyUI's forward computes what the
fused one computes; where it does not (another version's forward), modules keep their own.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys

import torch

import comfy.ops

from ..kernels.joint_heads import JointPart, joint_qkv
from ..kernels.backend import Backend, active_backend, triton_problem

log = logging.getLogger(__name__)

_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", lambda: False)
_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")
_PROJECTIONS = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")


@functools.lru_cache(maxsize=None)
def norm_forwards(torch_norm: type) -> frozenset:
    """The forwards of ``torch_norm`` (``nn.LayerNorm``, ``nn.RMSNorm``) and of ComfyUI's ops class of that name:
    the ones that compute exactly the plain ``F.layer_norm`` / ``F.rms_norm`` a fused path stands for."""
    forwards = {torch_norm.forward}
    comfy_norm = getattr(getattr(comfy.ops, "disable_weight_init", None), torch_norm.__name__, None)
    if comfy_norm is not None:
        forwards.add(comfy_norm.forward)
    return frozenset(forwards)


def _plain_norm(norm) -> bool:
    """Whether ``norm`` is a plain RMSNorm over one dimension without weight patches (what the kernel stands for)."""
    return (type(norm).forward in norm_forwards(torch.nn.RMSNorm) and not getattr(norm, "weight_function", None)
            and not getattr(norm, "bias_function", None) and len(norm.normalized_shape) == 1)


def plain_head_norms(norms, head_dim: int) -> bool:
    """Whether every one of ``norms`` is a plain RMSNorm over ``head_dim`` without weight patches."""
    return all(_plain_norm(norm) and tuple(norm.normalized_shape) == (head_dim,) for norm in norms)


def run_every_op() -> None:
    """What ComfyUI's own ops call first (``comfy.ops.run_every_op``, where this ComfyUI has it: it stops the run when
    the user cancels it). LowBit calls it where it computes an op without that op's ComfyUI forward."""
    hook = getattr(comfy.ops, "run_every_op", None)
    if hook is not None:
        hook()


@contextlib.contextmanager
def cast_norm_weights(norms, like: torch.Tensor):
    """The norms' weights cast as ComfyUI's RMSNorm casts them (``cast_bias_weight`` where ``comfy_cast_weights``
    is set, released on exit), after the ``run_every_op`` ComfyUI's RMSNorm calls first."""
    run_every_op()
    casts = []
    try:
        for norm in norms:
            if norm.weight is not None and getattr(norm, "comfy_cast_weights", False):
                weight, bias, stream = comfy.ops.cast_bias_weight(norm, like, offloadable=True)
                casts.append((weight, (norm, weight, bias, stream)))
            else:
                casts.append((norm.weight, None))
        yield [weight for weight, _ in casts]
    finally:
        for _, release in casts:
            if release is not None:
                comfy.ops.uncast_bias_weight(*release)


def norm_eps(norm, like: torch.Tensor) -> float:
    """The epsilon ``F.rms_norm`` uses for ``norm`` on inputs like ``like``."""
    return norm.eps if norm.eps is not None else torch.finfo(like.dtype).eps


def one_pass_wanted(device: torch.device) -> bool:
    """Whether the one-pass kernel is the path to take on ``device``: on a GPU unless another backend is forced
    (``kernels.backend.force_backend``); on the CPU only with the Triton backend forced (the interpreter is a
    correctness tool there, not a fast path, as for the linears)."""
    backend = active_backend()
    return backend is Backend.TRITON or (backend is Backend.AUTO and device.type != "cpu")


def kernel_declines(x: torch.Tensor) -> bool:
    """Whether a fused preparation leaves this call to ComfyUI's ops: ``torch.compile`` tracing (Inductor fuses these
    ops itself; asked first, so that tracing reads nothing else), not :func:`one_pass_wanted`, no Triton for ``x``'s
    device, or activations of another dtype."""
    return (_is_compiling() or not one_pass_wanted(x.device) or triton_problem(x.device) is not None
            or x.dtype not in (torch.bfloat16, torch.float16, torch.float32))


def fused_joint_attention(module, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                          image_rotary_emb, transformer_options, *, reference: bool = False):
    """What ComfyUI's Qwen-Image ``Attention.forward`` returns, with q, k, v from :func:`joint_qkv`, or ``None``
    where the fused path does not apply (see the module docstring). ``reference`` runs the kernel's pure-torch
    definition and skips the checks of where the kernel runs (the install-time check)."""
    if (encoder_hidden_states is None or image_rotary_emb is None
            or "attn1_patch" in transformer_options.get("patches", {})):
        return None
    if encoder_hidden_states_mask is not None and encoder_hidden_states_mask.dim() != 2:
        return None  # the text mask [B, S_txt] is the one this forward expands; other masks are ComfyUI's to read
    if not reference and kernel_declines(hidden_states):
        return None
    heads = module.heads
    norms = [getattr(module, name) for name in _NORMS]
    if not plain_head_norms(norms, module.inner_dim // heads):
        return None
    img = [getattr(module, name)(hidden_states) for name in _PROJECTIONS[:3]]
    txt = [getattr(module, name)(encoder_hidden_states) for name in _PROJECTIONS[3:]]
    with cast_norm_weights(norms, img[0]) as (wq, wk, waq, wak):
        eps = [norm_eps(norm, img[0]) for norm in norms]
        parts = (JointPart(*txt, q_weight=waq, k_weight=wak, q_eps=eps[2], k_eps=eps[3]),
                 JointPart(*img, q_weight=wq, k_weight=wk, q_eps=eps[0], k_eps=eps[1]))
        q, k, v = joint_qkv(parts, heads, image_rotary_emb, reference=reference)
    return _attend(module, q, k, v, hidden_states.shape[1], encoder_hidden_states.shape[1],
                   encoder_hidden_states_mask, hidden_states, transformer_options)


def _attend(module, q, k, v, seq_img, seq_txt, txt_mask, hidden_states, transformer_options):
    """ComfyUI's steps after q, k, v: the text mask, ``optimized_attention_masked`` (looked up in the model's own
    module, as its forward does), the streams split and projected out."""
    base = model_module(type(module), "optimized_attention_masked")
    batch = hidden_states.shape[0]
    attn_mask = None
    if txt_mask is not None:
        attn_mask = torch.zeros((batch, 1, seq_txt + seq_img), dtype=hidden_states.dtype, device=hidden_states.device)
        attn_mask[:, 0, :seq_txt] = txt_mask
    joint = base.optimized_attention_masked(q, k, v, module.heads, attn_mask, transformer_options=transformer_options,
                                            skip_reshape=True)
    img_out = module.to_out[1](module.to_out[0](joint[:, seq_txt:, :]))
    return img_out, module.to_add_out(joint[:, :seq_txt, :])


@functools.lru_cache(maxsize=None)
def model_module(cls: type, name: str):
    """The module of the first class in ``cls``'s MRO whose module defines ``name``: the model's own (e.g.
    ``comfy.ldm.qwen_image.model`` for ``optimized_attention_masked``), whose function of that name its forward
    calls."""
    for c in cls.__mro__:
        module = sys.modules.get(c.__module__)
        if hasattr(module, name):
            return module
    raise TypeError(f"{cls.__name__} is not a module of a ComfyUI model that defines {name}")


class FusedJointAttentionMixin:
    """Qwen-Image's ``Attention`` whose q, k, v are made in one pass where it can (module docstring)."""

    def forward(self, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None,
                attention_mask=None, image_rotary_emb=None, transformer_options={}):
        out = fused_joint_attention(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
                                    image_rotary_emb, transformer_options)
        if out is None:
            return super().forward(hidden_states, encoder_hidden_states, encoder_hidden_states_mask, attention_mask,
                                   image_rotary_emb, transformer_options)
        return out


#: ComfyUI's joint attentions of this layout: (module, class name)
_JOINT_ATTENTIONS = (("comfy.ldm.qwen_image.model", "Attention"),)


@functools.lru_cache(maxsize=None)
def joint_attention_classes() -> frozenset:
    """Those of ``_JOINT_ATTENTIONS`` this ComfyUI has whose forward gives, on a small random instance with a text
    mask and without one, in fp32, what :func:`fused_joint_attention` gives (its pure-torch definition of q, k, v)."""
    return frozenset(cls for cls in (agreeing_class(module_name, name, _agrees)
                                     for module_name, name in _JOINT_ATTENTIONS) if cls is not None)


def agreeing_class(module_name: str, name: str, agrees) -> type | None:
    """ComfyUI's class ``module_name.name`` where this ComfyUI has it and ``agrees(cls)`` holds, else ``None``: a
    class that computes something else, is absent or takes other arguments keeps its own forward (logged)."""
    try:
        cls = getattr(importlib.import_module(module_name), name)
        if agrees(cls):
            return cls
        log.info("LowBit: this ComfyUI's %s.%s computes something else; its q, k, v stay unfused", module_name, name)
    except Exception as err:  # absent, or another signature
        log.debug("LowBit: %s.%s not fused (%s: %s)", module_name, name, type(err).__name__, err)
    return None


def _agrees(cls) -> bool:
    gen = torch.Generator().manual_seed(0)
    heads, d = 2, 16
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        module = cls(query_dim=32, dim_head=d, heads=heads, out_dim=32, bias=True, eps=1e-6, operations=torch.nn)
        for norm in _NORMS:
            getattr(module, norm).weight.copy_(torch.rand(d, generator=gen) + 0.5)
        for name, p in module.named_parameters():
            if not name.startswith("norm"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        x, txt = torch.randn(1, 5, 32, generator=gen), torch.randn(1, 3, 32, generator=gen)
        freqs = torch.randn(1, 1, 8, d // 2, 2, 2, generator=gen)
        for mask in (torch.tensor([[0.0, 0.0, -1e4]]), None):
            want = module(x, txt, mask, image_rotary_emb=freqs, transformer_options={})
            got = fused_joint_attention(module, x, txt, mask, freqs, {}, reference=True)
            if got is None or not all(torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(want, got)):
                return False
    return True
