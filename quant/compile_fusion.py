"""A graph pass for ``torch.compile``: a quantized linear fed ``gelu(b)`` or ``cat([a, gelu(b)], -1)``
takes ``b`` (and ``a``) instead, through ``lowbit::quantized_linear_gelu``.

Transformer MLPs compute ``linear2(gelu(h))``; Flux's single blocks ``linear2(cat((attn, gelu(mlp)), 2))``.
Compiled as written, inductor writes the GELU's output (and the concatenation) in full in bf16, and
the quantized linear's activation quantization reads it back. The fused op hands ``a`` and the
pre-activation ``b`` to one kernel (the act-quant kernel's GELU prologue, ``kernels/prologue.py``)
that applies the GELU, quantizes the row and writes only the codes: the bf16 intermediate is never
stored. (Eager models get the same fusion through ``quant/deferred.py``.)

The pass runs on Dynamo's graph before inductor lowers it (inductor's ``pre_grad_custom_pass``): there
``torch.cat``, the GELU and ``torch.ops.lowbit.quantized_linear`` are still single nodes. A match
needs the GELU (and the concatenation) to feed only the linear, and the concatenation to be along
the last dimension of tensors of one dtype. Everything else is left as it is. Only layers whose format can take the fused
kernels are rewritten (plain ``int8``, ``fp8``, ``fp8_rowwise``: the rotated and 4-bit formats keep
inductor's GELU kernel). The op itself falls back to ``gelu`` + ``cat`` + ``quantized_linear`` wherever
the fused kernel does not apply at run time, so a rewrite never changes what is computed, only how
(``quant/compiled_linear.py``).

Nothing here imports ComfyUI.
"""

from __future__ import annotations

import hashlib
import logging
import operator
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

try:  # torch >= 2.6: a pass with a uuid keeps inductor's FX graph cache usable
    from torch._inductor.custom_graph_pass import CustomGraphPass as _PassBase
except ImportError:  # pragma: no cover - older torch
    _PassBase = object

_GELU_TARGETS = {F.gelu, getattr(torch._C._nn, "gelu", F.gelu)}
_CAT_TARGETS = {torch.cat, getattr(torch, "concat", torch.cat), getattr(torch, "concatenate", torch.cat)}


def supported() -> bool:
    """Whether this torch's inductor takes a pre-grad custom pass."""
    try:
        import torch._inductor.config as config
    except ImportError:  # pragma: no cover
        return False
    return hasattr(config, "pre_grad_custom_pass")


def _linear_targets() -> set:
    from .compiled_linear import quantized_linear_op

    return {quantized_linear_op, quantized_linear_op.default}


def _example(node) -> torch.Tensor | None:
    value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _only_user(node: torch.fx.Node, user: torch.fx.Node) -> bool:
    return list(node.users) == [user]


def _gelu_input(node, user: torch.fx.Node) -> tuple[torch.fx.Node, str] | None:
    """``(b, approximate)`` when ``node`` is ``gelu(b)`` used by ``user`` alone."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target not in _GELU_TARGETS:
        return None
    if not _only_user(node, user) or len(node.args) != 1 or set(node.kwargs) - {"approximate"}:
        return None
    approximate = node.kwargs.get("approximate", "none")
    b = node.args[0]
    if approximate not in ("none", "tanh") or not isinstance(b, torch.fx.Node):
        return None
    return b, approximate


def _cat_parts(node, user: torch.fx.Node) -> tuple[list, int] | None:
    """``(tensors, dim)`` when ``node`` is a ``torch.cat`` used by ``user`` alone."""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function" or node.target not in _CAT_TARGETS:
        return None
    if not _only_user(node, user) or not node.args or set(node.kwargs) - {"dim"}:
        return None
    tensors = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or not isinstance(dim, int):
        return None
    return list(tensors), dim


def fusable_spec(spec) -> bool:
    """Whether the layer a ``lowbit::quantized_linear`` spec string describes can take the fused kernels
    (a plain W8A8 format: ``int8``, ``fp8``, ``fp8_rowwise`` without outlier channels). Other layers keep
    inductor's own GELU kernel: the op's unfused fallback would only be slower."""
    from .compiled_linear import CompiledLinearError, parse_spec
    from .formats import get_format

    if not isinstance(spec, str):
        return False
    try:
        parsed = parse_spec(spec)
        codec = get_format(parsed.format_name)
    except (CompiledLinearError, KeyError, ValueError, ImportError, AttributeError):
        return False
    return codec.may_be_plain_w8a8(parsed.values, parsed.tensor_fields)


def match(linear: torch.fx.Node) -> tuple[torch.fx.Node | None, torch.fx.Node, str] | None:
    """``(a, b, approximate)`` when ``linear``'s input is ``gelu(b)`` (``a`` is ``None``) or
    ``cat([a, gelu(b)], -1)``, each used by the linear alone, and the layer's format can take the fused
    kernels (:func:`fusable_spec`); ``None`` otherwise."""
    if linear.kwargs or len(linear.args) != 7 or not fusable_spec(linear.args[5]):
        return None
    x = linear.args[0]
    direct = _gelu_input(x, linear)
    if direct is not None:
        return None, direct[0], direct[1]
    parts = _cat_parts(x, linear)
    if parts is None:
        return None
    tensors, dim = parts
    if len(tensors) != 2 or not all(isinstance(t, torch.fx.Node) for t in tensors):
        return None
    a, g = tensors
    inner = _gelu_input(g, x)
    if inner is None:
        return None
    b, approximate = inner
    ea, eb, ex = _example(a), _example(b), _example(x)
    if ea is None or eb is None or ex is None:
        return None  # without shapes and dtypes the dimension and the dtype cannot be checked
    if dim not in (-1, ex.dim() - 1) or ea.dtype != eb.dtype or ea.dim() != eb.dim():
        return None
    return a, b, approximate


class GeluLinearFusion(_PassBase):
    """The pass (an inductor ``pre_grad_custom_pass``): rewrites every match, counts them in ``fused``."""

    def __init__(self):
        self.fused = 0

    def __call__(self, graph: torch.fx.Graph) -> None:
        from .compiled_linear import quantized_linear_gelu_op

        targets = _linear_targets()
        count = 0
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in targets:
                continue
            found = match(node)
            if found is None:
                continue
            a, b, approximate = found
            x = node.args[0]
            with graph.inserting_before(node):
                fused = graph.call_function(quantized_linear_gelu_op, (a, b, *node.args[1:], approximate))
            fused.meta.update(node.meta)
            node.replace_all_uses_with(fused)
            graph.erase_node(node)
            _erase_unused(graph, x)
            count += 1
        if count:
            self.fused += count
            log.info("LowBit compile: %d quantized linear(s) take their GELU input fused", count)

    def uuid(self) -> bytes:
        """Changes with this file (inductor's cache key for graphs this pass has seen)."""
        return hashlib.sha256(Path(__file__).read_bytes()).digest()


def _erase_unused(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Erase ``node`` and then its inputs that were left without users (a cat, then its gelu)."""
    stack = [node]
    while stack:
        current = stack.pop()
        if current.users or current.op != "call_function" or current.target is operator.getitem:
            continue
        inputs = [arg for arg in current.all_input_nodes]
        graph.erase_node(current)
        stack.extend(n for n in inputs if n.target in _GELU_TARGETS or n.target in _CAT_TARGETS)


__all__ = ["GeluLinearFusion", "fusable_spec", "match", "supported"]
