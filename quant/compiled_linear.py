"""Every LowBit quantized linear as one ``torch.library`` custom op, so ``torch.compile`` traces it.

``lowbit::quantized_linear(x, qdata, param_tensors, bias, input_scale, spec, backend)`` runs
``codec.linear`` for the weight that ``qdata``, ``param_tensors`` and the ``spec`` string describe.
Under ``torch.compile`` the graph holds this one opaque node per layer, with a fake (meta)
implementation that only computes the output shape, instead of tracing the weight's tensor subclass
through comfy-kitchen's ``__torch_dispatch__`` and its backend registry. That gives:

* every format compiles with ``fullgraph=True``, including the native 4-bit ones whose kitchen
  handlers cannot run on fake tensors (they build constants on the real CPU);
* the compiled model runs exactly the eager kernels (the body *is* ``codec.linear``, measured
  dispatcher included), so compiled and eager outputs of a layer are bit-identical;
* guards see only plain tensors and a few constants (format, shapes, group sizes), so blocks of
  equal shapes share one compiled graph and nothing about LoRA strengths is ever guarded.

``spec`` is a string built by :func:`linear_spec` from the weight's non-tensor layout parameters,
with Python operations Dynamo can trace (no ``json``); the op parses it (cached) back into the
layout's ``Params``. :func:`quantized_linear` is what callers use: the op while compiling, the
codec directly otherwise (a custom op's Python dispatch costs tens of microseconds per call).

Nothing here imports ComfyUI.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import importlib
from typing import Any

import torch
from comfy_kitchen.tensor import QuantizedTensor

from ..kernels.backend import Backend, active_backend
from ..kernels.dispatch import current_dispatcher
from .errors import LowBitError

SPEC_VERSION = "lowbit-linear-v1"
_SEP = "\x1f"  # between the spec's parts (never inside a repr of the values it holds)
_FIELD_SEP = "\x1e"  # between field entries
#: dtypes passed to the op as their bytes (``uint8`` views): torch's schema checker and some CPU
#: kernels cannot compare or copy float8 tensors, and a byte view is free
_BYTE_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                       "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, name))
#: kernel backends ``backend`` may name (as nodes/comfy_ops.KERNEL_BACKENDS)
BACKENDS = ("auto", "kitchen", "eager")


class CompiledLinearError(LowBitError):
    """A spec string that does not describe a LowBit weight."""


# ---- the spec string (built while Dynamo traces) ---------------------------------------------------

def linear_spec(format_name: str, weight: QuantizedTensor) -> str:
    """The constant part of ``weight`` as one string: format, layout, Params class and the values of
    its non-tensor fields (tensor fields are passed to the op as tensors, in :func:`param_tensors`' order).

    Written with f-strings and ``repr`` only, which Dynamo folds to a constant while tracing.
    """
    params = weight._params
    params_cls = type(params)
    tensor_fields = []
    values = []
    for field in dataclasses.fields(params):
        value = getattr(params, field.name)
        if isinstance(value, torch.Tensor):
            tensor_fields.append(field.name)
        else:
            values.append(f"{field.name}={value!r}")
    byte_views = [f"{i}:{t.dtype!r}" for i, t in enumerate([weight._qdata, *param_tensors(weight)])
                  if t.dtype in _BYTE_DTYPES]
    return _SEP.join((SPEC_VERSION, format_name, weight._layout_cls,
                      f"{params_cls.__module__}:{params_cls.__qualname__}", ",".join(tensor_fields),
                      _FIELD_SEP.join(values), ",".join(byte_views)))


def param_tensors(weight: QuantizedTensor) -> list[torch.Tensor]:
    """The tensor fields of ``weight``'s Params, in declaration order (as :func:`linear_spec` names them)."""
    params = weight._params
    out = []
    for field in dataclasses.fields(params):
        value = getattr(params, field.name)
        if isinstance(value, torch.Tensor):
            out.append(value)
    return out


@dataclasses.dataclass(frozen=True)
class _Spec:
    format_name: str
    layout: str
    params_cls: type
    tensor_fields: tuple[str, ...]
    values: dict[str, Any]
    byte_views: dict[int, torch.dtype]  # tensor index (0: qdata, i + 1: tensor field i) -> its real dtype

    @property
    def out_features(self) -> int:
        shape = self.values["orig_shape"]
        return int(shape[1] if self.values.get("transposed", False) else shape[0])


@functools.lru_cache(maxsize=1024)
def parse_spec(spec: str) -> _Spec:
    """The :class:`_Spec` a :func:`linear_spec` string describes (cached: one parse per distinct layer kind)."""
    parts = spec.split(_SEP)
    if len(parts) != 7 or parts[0] != SPEC_VERSION:
        raise CompiledLinearError(
            f"not a LowBit linear spec (expected {SPEC_VERSION!r} and 7 parts, found {spec[:80]!r}); "
            f"it is built by lowbit.quant.compiled_linear.linear_spec")
    _, format_name, layout, cls_path, tensor_fields, values, byte_views = parts
    module_name, _, qualname = cls_path.partition(":")
    params_cls: Any = importlib.import_module(module_name)
    for name in qualname.split("."):
        params_cls = getattr(params_cls, name)
    parsed = {}
    for entry in values.split(_FIELD_SEP) if values else ():
        name, _, text = entry.partition("=")
        try:
            parsed[name] = _literal(text)
        except (ValueError, SyntaxError) as err:
            raise CompiledLinearError(f"{format_name}: layout parameter {name}={text} cannot be passed through "
                                      f"torch.compile (only numbers, strings, tuples, None and dtypes can)") from err
    views = {}
    for entry in byte_views.split(",") if byte_views else ():
        index, _, dtype = entry.partition(":")
        views[int(index)] = _literal(dtype)
    return _Spec(format_name, layout, params_cls, tuple(f for f in tensor_fields.split(",") if f), parsed, views)


def _literal(text: str):
    if text.startswith("torch."):  # a dtype: repr(torch.bfloat16) == "torch.bfloat16"
        value = getattr(torch, text[len("torch."):], None)
        if not isinstance(value, torch.dtype):
            raise CompiledLinearError(f"linear spec value {text!r} is not a torch dtype")
        return value
    return ast.literal_eval(text)


def rebuild_weight(qdata: torch.Tensor, tensors: list[torch.Tensor], spec: _Spec,
                   dtype: torch.dtype | None = None) -> QuantizedTensor:
    """The ``QuantizedTensor`` that ``qdata``, ``tensors`` and ``spec`` describe (with ``orig_dtype``
    ``dtype`` when given: what ``weight.to(dtype=...)`` gives, without its ``__torch_dispatch__`` walk)."""
    if len(tensors) != len(spec.tensor_fields):
        raise CompiledLinearError(f"{spec.format_name}: the spec names tensor fields {spec.tensor_fields} but "
                                  f"{len(tensors)} tensors were passed")
    qdata, *tensors = [t.view(spec.byte_views[i]) if i in spec.byte_views else t
                       for i, t in enumerate([qdata, *tensors])]
    values = spec.values if dtype is None else {**spec.values, "orig_dtype": dtype}
    params = spec.params_cls(**values, **dict(zip(spec.tensor_fields, tensors)))
    return QuantizedTensor(qdata, spec.layout, params)


#: (spec, device, dtype, in features, qdata contiguous) -> the codec's bound runner for such calls, or
#: None where the codec offers none (bounded: a model has a few dozen distinct layer kinds)
_RUNNERS: dict[tuple, Any] = {}
_MAX_RUNNERS = 4096


def _bound_runner(spec: str, parsed: _Spec, x: torch.Tensor, weight: QuantizedTensor):
    """``codec.bind_linear``'s runner for calls like this one, bound once per kind of call.

    Whether a codec binds depends only on what the key holds (the weight's format, layout, shape and
    dtypes are in the spec string), so the runner serves every layer of that kind: it computes what
    ``codec.linear`` computes, bit for bit, without the per-call checks.
    """
    key = (spec, x.device, x.dtype, x.shape[-1], weight._qdata.is_contiguous())
    try:
        return _RUNNERS[key]
    except KeyError:
        pass
    from .formats import get_format

    runner = get_format(parsed.format_name).bind_linear(x, weight)
    if len(_RUNNERS) < _MAX_RUNNERS:
        _RUNNERS[key] = runner
    return runner


def _run(format_name: str, x, weight: QuantizedTensor, bias, input_scale, backend: str) -> torch.Tensor:
    from .formats import get_format

    if weight.dtype != x.dtype:
        weight = weight.to(dtype=x.dtype)  # metadata only (the output dtype), as ComfyUI's forward does
    with backend_scope(backend):
        out = get_format(format_name).linear(x, weight, bias, input_scale)
    return out if out.dtype == x.dtype else out.to(x.dtype)


# ---- kernel backend scope ---------------------------------------------------------------------------

@contextlib.contextmanager
def backend_scope(name: str):
    """Run LowBit's and comfy-kitchen's kernels inside the block on backend ``name`` (``auto``: as chosen)."""
    if name not in BACKENDS:
        raise CompiledLinearError(f"unknown kernel backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        yield
        return
    from ..kernels.backend import force_backend

    with contextlib.ExitStack() as stack:
        stack.enter_context(force_backend(name))
        if name == "eager":
            import comfy_kitchen as ck

            stack.enter_context(ck.registry.use_backend("eager"))
        yield


# ---- the op -----------------------------------------------------------------------------------------

def _quantized_linear_impl(x: torch.Tensor, qdata: torch.Tensor, param_tensors: list[torch.Tensor],
                           bias: torch.Tensor | None, input_scale: torch.Tensor | None, spec: str,
                           backend: str) -> torch.Tensor:
    parsed = parse_spec(spec)
    # the fake promises x's dtype and a fresh tensor (every codec's linear returns a new tensor)
    weight = rebuild_weight(qdata, list(param_tensors), parsed, dtype=x.dtype)
    if backend == "auto" and input_scale is None and active_backend() is Backend.AUTO:
        # A compiled graph calls this once per layer and step: the codec's bound runner skips the
        # per-call checks (on an H200 host the op cost 187 us a call against 99 us for codec.linear,
        # and a compiled int8 Flux step was bound by its CPU: 100 ms of GPU work, 130-170 ms of wall).
        runner = _bound_runner(spec, parsed, x, weight)
        if runner is not None:
            if bias is not None and bias.dtype != x.dtype:
                bias = bias.to(x.dtype)
            out = runner(x, weight, bias)
            return out if out.dtype == x.dtype else out.to(x.dtype)
    return _run(parsed.format_name, x, weight, bias, input_scale, backend)


def _quantized_linear_fake(x, qdata, param_tensors, bias, input_scale, spec, backend):
    return x.new_empty((*x.shape[:-1], parse_spec(spec).out_features))


def _define(name: str, impl, fake):
    """``torch.ops.lowbit.<name>``, defined with its fake once per process: the package can be imported
    twice under different names (``lowbit`` and ComfyUI's custom-node module name)."""
    try:
        return getattr(torch.ops.lowbit, name)
    except (AttributeError, RuntimeError):
        pass
    op = torch.library.custom_op(f"lowbit::{name}", impl, mutates_args=())
    op.register_fake(fake)
    return getattr(torch.ops.lowbit, name)


quantized_linear_op = _define("quantized_linear", _quantized_linear_impl, _quantized_linear_fake)


# ---- the same op, its input ``[a | gelu(b)]`` given as ``a`` and ``b`` (quant/compile_fusion.py) --------

def gelu_input(a: torch.Tensor | None, b: torch.Tensor, approximate: str) -> torch.Tensor:
    """``cat([a, gelu(b)], -1)``, or ``gelu(b)`` without ``a``: the input the fused op stands for (the
    GELU written straight into its columns of the result: two kernels, not three)."""
    if a is None:
        return torch.nn.functional.gelu(b, approximate=approximate)
    out = b.new_empty((*b.shape[:-1], a.shape[-1] + b.shape[-1]), dtype=torch.promote_types(a.dtype, b.dtype))
    out[..., :a.shape[-1]] = a
    torch._C._nn.gelu(b, approximate=approximate, out=out[..., a.shape[-1]:])
    return out


def _quantized_linear_gelu_impl(a: torch.Tensor | None, b: torch.Tensor, qdata: torch.Tensor,
                                param_tensors: list[torch.Tensor], bias: torch.Tensor | None,
                                input_scale: torch.Tensor | None, spec: str, backend: str,
                                approximate: str) -> torch.Tensor:
    fusable = backend == "auto" and input_scale is None and active_backend() is Backend.AUTO
    if fusable:
        out = _fused_gelu_linear(a, b, qdata, param_tensors, bias, spec, approximate)
        if out is not None:
            return out
    plans = current_dispatcher().fast_plans
    settled = len(plans)
    out = _quantized_linear_impl(gelu_input(a, b, approximate), qdata, param_tensors, bias, input_scale, spec, backend)
    if fusable and len(plans) != settled:  # it settled a plan: the first call gives every later call's bits
        fused = _fused_gelu_linear(a, b, qdata, param_tensors, bias, spec, approximate)
        if fused is not None:
            return fused
    return out


def _fused_gelu_linear(a, b, qdata, param_tensors, bias, spec, approximate) -> torch.Tensor | None:
    """The GELU (and the concatenation) computed inside the activation quantization
    (``FormatCodec.prologue_linear``), where the format has such a path and the dispatcher settled the
    unfused call on kernels that take it (``None`` otherwise)."""
    from ..kernels.prologue import GeluPrologue
    from .formats import get_format

    if a is not None and (a.shape[:-1] != b.shape[:-1] or a.dtype != b.dtype):
        return None
    parsed = parse_spec(spec)
    weight = rebuild_weight(qdata, list(param_tensors), parsed, dtype=b.dtype)
    if bias is not None and bias.dtype != b.dtype:
        bias = bias.to(b.dtype)
    prologue = GeluPrologue(b.reshape(-1, b.shape[-1]), None if a is None else a.reshape(-1, a.shape[-1]), approximate)
    out = get_format(parsed.format_name).prologue_linear(prologue, weight, bias)
    return None if out is None else out.reshape(*b.shape[:-1], out.shape[-1])


def _quantized_linear_gelu_fake(a, b, qdata, param_tensors, bias, input_scale, spec, backend, approximate):
    return b.new_empty((*b.shape[:-1], parse_spec(spec).out_features))


quantized_linear_gelu_op = _define("quantized_linear_gelu", _quantized_linear_gelu_impl,
                                   _quantized_linear_gelu_fake)


# ---- dequantize, as an op -----------------------------------------------------------------------------

def _dequantize_weight_impl(qdata: torch.Tensor, param_tensors: list[torch.Tensor], spec: str) -> torch.Tensor:
    parsed = parse_spec(spec)
    out = rebuild_weight(qdata, list(param_tensors), parsed).dequantize().to(parsed.values["orig_dtype"])
    inputs = {t.untyped_storage().data_ptr() for t in (qdata, *param_tensors)}
    # an op's output may not alias its inputs (a layout could hand back a view of its data)
    return out.clone() if out.untyped_storage().data_ptr() in inputs else out.contiguous()


def _dequantize_weight_fake(qdata, param_tensors, spec):
    values = parse_spec(spec).values
    return qdata.new_empty(tuple(values["orig_shape"]), dtype=values["orig_dtype"])


dequantize_weight_op = _define("dequantize_weight", _dequantize_weight_impl, _dequantize_weight_fake)


def dequantize_weight(format_name: str, weight: QuantizedTensor) -> torch.Tensor:
    """``weight.dequantize()`` in its ``orig_dtype``, compile-safe.

    While ``torch.compile`` traces, this is the ``lowbit::dequantize_weight`` op, whose body runs only on
    real tensors: comfy-kitchen's 4-bit dequantize (``w4a4``, ``w4a8``) multiplies by a Hadamard matrix
    kept in a per-process cache, a real tensor that a fake-tensor trace cannot take in (and a first call
    under fake tensors would leave a fake one in that cache). Otherwise it is ``weight.dequantize()``.
    ``format_name`` is the weight's ``quant.formats.FORMATS`` key (it goes into the op's spec string).
    """
    if torch.compiler.is_compiling():
        device = weight._qdata.device
        return dequantize_weight_op(_as_bytes(weight._qdata, device), [_as_bytes(t, device)
                                    for t in param_tensors(weight)], linear_spec(format_name, weight))
    return weight.dequantize().to(weight._params.orig_dtype)


def _as_bytes(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    t = t.to(device)
    return t.view(torch.uint8) if t.dtype in _BYTE_DTYPES else t


def op_arguments(format_name: str, x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None = None,
                 input_scale: torch.Tensor | None = None, backend: str = "auto") -> tuple:
    """The arguments of ``lowbit::quantized_linear`` for one call: the weight's tensors on ``x``'s device
    (float8 ones as byte views), the bias in ``x``'s dtype, the spec string."""
    device = x.device
    if bias is not None:
        bias = bias.to(device=device, dtype=x.dtype)
    if input_scale is not None:
        input_scale = input_scale.to(device)
    return (x, _as_bytes(weight._qdata, device), [_as_bytes(t, device) for t in param_tensors(weight)], bias,
            input_scale, linear_spec(format_name, weight), backend)


def quantized_linear(format_name: str, x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None = None,
                     input_scale: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """``codec.linear(x, weight, bias, input_scale)`` on kernel ``backend``, compile-safe.

    While ``torch.compile`` traces, this is the ``lowbit::quantized_linear`` op (weight tensors moved
    to ``x``'s device, bias cast to ``x``'s dtype, as ComfyUI's cast would); otherwise the codec runs
    directly. The output has ``x``'s dtype.
    """
    if torch.compiler.is_compiling():
        return quantized_linear_op(*op_arguments(format_name, x, weight, bias, input_scale, backend))
    if bias is not None and (bias.dtype != x.dtype or bias.device != x.device):
        bias = bias.to(device=x.device, dtype=x.dtype)  # as the op path does (and ComfyUI's cast)
    return _run(format_name, x, weight, bias, input_scale, backend)


__all__ = ["CompiledLinearError", "backend_scope", "dequantize_weight", "dequantize_weight_op", "gelu_input",
           "linear_spec", "op_arguments", "param_tensors", "parse_spec", "quantized_linear", "quantized_linear_gelu_op",
           "quantized_linear_op", "rebuild_weight"]
