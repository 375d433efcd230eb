"""What every LowBit format file provides: a :class:`FormatSpec` and a :class:`FormatCodec`.

A *format* is what a user picks (``int8_convrot``, ``fp8_rowwise``, ...). Its codec turns a float
weight into a comfy-kitchen ``QuantizedTensor`` (of a kitchen layout, or of one of our own
layouts registered with kitchen), runs the linear for it, and reads/writes the native checkpoint
form: the per-layer ``<layer>.comfy_quant`` JSON plus the layout's tensors, keyed exactly as
ComfyUI keys them (``weight``, ``weight_scale``, ...).

Nothing here imports ComfyUI.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple

import torch
from comfy_kitchen.tensor import QuantizedTensor, dequantize_args, register_layout_op

from ...kernels.backend import Backend, BackendUnavailableError, active_backend
from ...kernels.w4_linear import w4_prologue_linear, w4_settled_linear
from ...kernels.w8a8_linear import w8a8_prologue_linear, w8a8_settled_linear
from ..errors import CheckpointFormatError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FormatSpec:
    """Static facts about one format (the registry's row)."""

    name: str
    description: str
    layout: str  # comfy-kitchen layout registry name of the weight tensor
    weight_bits: int
    activation: str  # how activations are quantized at run time
    native_format: str  # the ``format`` written into ``comfy_quant``
    stock_loadable: bool  # stock ComfyUI (>= 0.30) loads files of this format by itself
    in_features_multiple: int = 1  # K must be a multiple of this
    out_features_multiple: int = 1  # N must be a multiple of this
    fallback: str | None = None  # format used for a layer whose shape this one cannot take
    min_sm: tuple[int, int] | None = None  # GPU capability for fast kernels (None: any)
    min_kitchen: str = "0.2.27"

    def shape_problem(self, shape: tuple[int, ...]) -> str | None:
        """Why a weight of ``shape`` cannot use this format, or ``None`` when it can."""
        if len(shape) != 2:
            return f"{self.name} quantizes 2-D linear weights, got shape {tuple(shape)}"
        n, k = shape
        if k % self.in_features_multiple:
            return f"{self.name} needs in_features divisible by {self.in_features_multiple}, got {k}"
        if n % self.out_features_multiple:
            return f"{self.name} needs out_features divisible by {self.out_features_multiple}, got {n}"
        return None


class W8A8Form(NamedTuple):
    """A weight as LowBit's W8A8 kernels take it (``kernels/w8a8_linear.py``)."""

    fmt: str  # dispatch format: "int8" or "fp8_rowwise"
    codes: torch.Tensor  # int8 / e4m3 [N, K]
    scale: torch.Tensor  # [N] / [N, 1] / scalar
    rotation: str = "none"
    group_size: int = 0
    smooth: torch.Tensor | None = None
    center_rowsum: torch.Tensor | None = None


class W4Form(NamedTuple):
    """A 4-bit weight as LowBit's W4 kernels take it (``kernels/w4_linear.py``)."""

    fmt: str  # dispatch format: "w4a4/a4", "w4a4/a8" or "w4a8"
    packed: torch.Tensor  # int8 [N, K / 2]
    scale: torch.Tensor  # [N]
    rot_group: int
    s_rel: torch.Tensor | None = None
    codebook: torch.Tensor | None = None
    correction: torch.Tensor | None = None
    group_size: int = 0


class FormatCodec:
    """Quantize, run and (de)serialize one format. Subclasses set ``spec`` and override hooks."""

    spec: FormatSpec
    #: checkpoint suffixes this format stores next to ``weight`` (``weight_scale``, ...)
    tensor_keys: tuple[str, ...] = ("weight", "weight_scale")

    # ---- quantization -------------------------------------------------------------------
    def quantize(self, weight: torch.Tensor, *, compute_dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> QuantizedTensor:
        """Quantize a float ``[out, in]`` weight. ``seed > 0`` asks for stochastic rounding."""
        problem = self.spec.shape_problem(tuple(weight.shape))
        if problem:
            raise ValueError(problem)
        qdata, params = self._quantize(weight.float(), seed=seed)
        params = dataclasses.replace(params, orig_dtype=compute_dtype, orig_shape=tuple(weight.shape))
        return QuantizedTensor(qdata, self.spec.layout, params)

    def _quantize(self, weight: torch.Tensor, *, seed: int) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    # ---- run time -----------------------------------------------------------------------
    def linear(self, x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None = None,
               input_scale: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias`` with this format's activation quantization."""
        return torch.nn.functional.linear(x, weight, bias)

    def bind_linear(self, x: torch.Tensor, weight: QuantizedTensor,
                    input_scale: torch.Tensor | None = None) -> LinearRunner | None:
        """A shortcut for repeated :meth:`linear` calls with this ``weight`` (or ``None``).

        ``runner(x, weight, bias)`` computes what ``linear(x, weight, bias, input_scale)`` computes, for
        inputs like ``x`` (same device, dtype and features) and this very weight, without the
        ``F.linear`` -> ``__torch_dispatch__`` -> handler walk and the per-call checks. Callers that
        run one layer many times (the ComfyUI ops) bind once per weight and reuse it.
        For our own layouts it is the function registered by :func:`register_linear_family`.
        """
        if type(self).linear is not FormatCodec.linear or not plain_call(x, weight):
            return None
        fn = _LINEAR_FNS.get(weight._layout_cls)
        if fn is None or getattr(weight._params, "transposed", False) or weight._qdata.device != x.device:
            return None
        return fn

    def may_be_plain_w8a8(self, values: Mapping[str, Any], tensor_fields: tuple[str, ...]) -> bool:
        """Whether weights of this format with these layout parameters (non-tensor ``values``, names of
        the tensor fields) can be plain W8A8 products (:meth:`plain_w8a8`): what a compile pass asks
        before it routes a layer to the fused activation kernels, from the layer's spec alone."""
        return False

    def plain_w8a8(self, x: torch.Tensor, weight: QuantizedTensor) -> tuple[str, torch.Tensor, torch.Tensor] | None:
        """``(dispatch format, codes [N, K], weight scale)`` when a call like ``linear(x, weight)`` is a
        plain W8A8 product on LowBit's kernels: per-token INT8 or e4m3 activation codes with no
        smoothing, centring, rotation or outlier columns (what ``w8a8_linear.w8a8_gelu_linear`` takes);
        ``None`` for every other format or weight."""
        return None

    def w8a8_form(self, x: torch.Tensor, weight: QuantizedTensor) -> W8A8Form | None:
        """How a call like ``linear(x, weight)`` runs on LowBit's W8A8 kernels: the dispatch format, the
        codes and scale, and the activation pre-processing (:class:`W8A8Form`); ``None`` where it does not
        (another format, a weight or call the kernels do not take). By default the plain products of
        :meth:`plain_w8a8`."""
        plain = self.plain_w8a8(x, weight)
        return None if plain is None else W8A8Form(*plain)

    def prologue_form(self, x: torch.Tensor, weight: QuantizedTensor) -> W8A8Form | W4Form | None:
        """What :func:`form_prologue_linear` needs to run calls like ``linear(x, weight)`` with ``x`` given as
        a prologue: :meth:`w8a8_form` by default (the 4-bit formats give a :class:`W4Form`); ``None`` where
        the format, weight or call has no fused path."""
        return self.w8a8_form(x, weight)

    def prologue_linear(self, prologue, weight: QuantizedTensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """``linear(prologue.materialize(), weight, bias)`` (2-D, ``[M, N]``) with the prologue computed
        inside the activation quantization (``kernels/prologue.py``), or ``None`` where this format, weight or
        call has no fused path yet (the caller materializes the input and runs :meth:`linear`)."""
        form = self.prologue_form(prologue.source.new_empty((0, prologue.shape[1])), weight)  # no data: the checks
        return None if form is None else form_prologue_linear(form, prologue, bias)

    # ---- checkpoint form ----------------------------------------------------------------
    def comfy_quant(self, qt: QuantizedTensor) -> dict:
        """The per-layer ``comfy_quant`` JSON object for ``qt``."""
        return {"format": self.spec.native_format}

    def state_dict(self, qt: QuantizedTensor) -> dict[str, torch.Tensor]:
        """Tensors to store, keyed relative to the layer prefix (``weight``, ``weight_scale``...)."""
        return qt.state_dict("weight")

    def matches(self, conf: Mapping) -> bool:
        """Whether a ``comfy_quant`` object describes this format."""
        return conf.get("format") == self.spec.native_format

    def from_state_dict(self, layer: str, tensors: Mapping[str, torch.Tensor], conf: Mapping,
                        compute_dtype: torch.dtype = torch.bfloat16) -> QuantizedTensor:
        """Rebuild the quantized weight of ``layer`` from its stored tensors and JSON."""
        raise NotImplementedError


# ---- helpers shared by the format files ---------------------------------------------------

def conf_value(conf: Mapping, key: str, default):
    """A ``comfy_quant`` option, read at top level or under ``params`` as ComfyUI does."""
    params = conf.get("params")
    if not isinstance(params, Mapping):
        params = {}
    return conf.get(key, params.get(key, default))


def require(layer: str, tensors: Mapping[str, torch.Tensor], key: str, fmt: str) -> torch.Tensor:
    value = tensors.get(key)
    if value is None:
        raise CheckpointFormatError(
            f"layer {layer!r} is marked {fmt} but has no {key!r} tensor; the file is incomplete or "
            f"was written by a different tool. Re-export it, or load it as float."
        )
    return value


def check_matrix(layer: str, tensor: torch.Tensor, fmt: str, dtypes: tuple[torch.dtype, ...],
                 key: str = "weight") -> None:
    """A stored 2-D tensor of one of ``dtypes``, or a :class:`CheckpointFormatError` saying otherwise."""
    if tensor.dim() != 2 or tensor.dtype not in dtypes:
        expected = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise CheckpointFormatError(
            f"layer {layer!r} ({fmt}): {key!r} must be a 2-D {expected} tensor, "
            f"found {str(tensor.dtype).replace('torch.', '')} of shape {tuple(tensor.shape)}"
        )


def check_numel(layer: str, tensor: torch.Tensor, fmt: str, key: str, allowed: tuple[int, ...]) -> None:
    if tensor.numel() not in allowed:
        raise CheckpointFormatError(
            f"layer {layer!r} ({fmt}): {key!r} has {tensor.numel()} values, expected "
            + " or ".join(str(a) for a in allowed)
        )


#: ``runner(x, weight, bias) -> out``: see :meth:`FormatCodec.bind_linear`
LinearRunner = Callable[[torch.Tensor, QuantizedTensor, "torch.Tensor | None"], torch.Tensor]
#: layout registry name -> the ``linear_fn`` given to :func:`register_linear_family`
_LINEAR_FNS: dict[str, LinearRunner] = {}


def plain_call(x, weight) -> bool:
    return (not isinstance(x, QuantizedTensor) and isinstance(weight, QuantizedTensor)
            and active_backend() is Backend.AUTO)


def form_prologue_linear(form: W8A8Form | W4Form, prologue, bias: torch.Tensor | None) -> torch.Tensor | None:
    """:meth:`FormatCodec.prologue_linear` for a weight whose :meth:`~FormatCodec.prologue_form` is ``form``
    (callers that run one layer many times keep the form instead of checking the weight per call)."""
    if type(form) is W4Form:
        return w4_prologue_linear(form.fmt, prologue, form.packed, form.scale, bias, prologue.source.dtype,
                                  form.rot_group, form.s_rel, form.codebook, form.correction, form.group_size)
    return w8a8_prologue_linear(form.fmt, prologue, form.codes, form.scale, bias, prologue.source.dtype,
                                form.rotation, form.group_size, form.smooth, form.center_rowsum)


def form_settled_linear(form: W8A8Form | W4Form, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """``linear(x)`` of a weight whose :meth:`~FormatCodec.prologue_form` is ``form``, on the plan the dispatcher
    settled for calls like it (the bits of the full path), or ``None`` where none is settled yet (a first call,
    a forced backend, ``torch.compile`` tracing): the caller runs its full path, which measures and settles.
    For callers that run one layer many times and keep its form."""
    x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if type(form) is W4Form:
        out = w4_settled_linear(form.fmt, x2d, form.packed, form.scale, bias, x.dtype, form.rot_group, form.s_rel,
                                form.codebook, form.correction, form.group_size)
    else:
        out = w8a8_settled_linear(form.fmt, x2d, form.codes, form.scale, bias, x.dtype, form.rotation,
                                  form.group_size, form.smooth, form.center_rowsum)
    if out is None or x.dim() == 2:
        return out
    return out.reshape(*x.shape[:-1], out.shape[-1])


def own_w8a8_form(x, weight, layout: str, **pre) -> W8A8Form | None:
    """:meth:`FormatCodec.w8a8_form` of one of our INT8 layouts (``pre``: its rotation, group, smoothing,
    centring), where the registered linear would run on the W8A8 kernels: a plain call, an untransposed
    contiguous int8 matrix of ``x``'s width on ``x``'s device."""
    qdata = weight._qdata
    if (not plain_call(x, weight) or weight._layout_cls != layout or getattr(weight._params, "transposed", False)
            or qdata.device != x.device or qdata.dtype != torch.int8 or qdata.dim() != 2
            or qdata.shape[1] != x.shape[-1] or not qdata.is_contiguous()):
        return None
    return W8A8Form("int8", qdata, weight._params.scale, **pre)


def register_linear_family(layout_cls: type, layout_name: str,
                           linear_fn: Callable[[torch.Tensor, QuantizedTensor, torch.Tensor | None], torch.Tensor]) -> None:
    """Register ``t``/``linear``/``mm``/``addmm`` for one of our weight layouts.

    ``linear_fn(x, w, bias)`` computes ``x @ w.T + bias`` for an untransposed weight ``w``.
    ``mm(x, w.t())`` and ``addmm(b, x, w.t())`` (how ``F.linear`` decomposes) reuse it; any other
    use of the weight falls back to dequantization.
    """
    _LINEAR_FNS[layout_name] = linear_fn

    @register_layout_op(torch.ops.aten.t.default, layout_cls)
    def _t(qt, args, kwargs):
        tensor = args[0]
        old = tensor._params
        params = dataclasses.replace(old, orig_shape=(old.orig_shape[1], old.orig_shape[0]),
                                     transposed=not old.transposed)
        return QuantizedTensor(tensor._qdata, layout_name, params)

    def _is_weight(w) -> bool:
        return isinstance(w, QuantizedTensor) and w._layout_cls == layout_name

    @register_layout_op(torch.ops.aten.linear.default, layout_cls)
    def _linear(qt, args, kwargs):
        x, w = args[0], args[1]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        if isinstance(x, QuantizedTensor) or not _is_weight(w) or w._params.transposed:
            return torch.nn.functional.linear(*dequantize_args((x, w, bias)))
        return linear_fn(x, w, bias)

    @register_layout_op(torch.ops.aten.mm.default, layout_cls)
    def _mm(qt, args, kwargs):
        x, w = args[0], args[1]
        if isinstance(x, QuantizedTensor) or not _is_weight(w) or not w._params.transposed:
            return torch.mm(*dequantize_args((x, w)))
        return linear_fn(x, _untransposed(w, layout_name), None)

    @register_layout_op(torch.ops.aten.addmm.default, layout_cls)
    def _addmm(qt, args, kwargs):
        bias, x, w = args[0], args[1], args[2]
        plain = kwargs.get("beta", 1) == 1 and kwargs.get("alpha", 1) == 1
        if (isinstance(x, QuantizedTensor) or not _is_weight(w) or not w._params.transposed or not plain
                or (isinstance(bias, torch.Tensor) and bias.dim() != 1)):
            return torch.addmm(*dequantize_args(args), **dequantize_args(kwargs))
        return linear_fn(x, _untransposed(w, layout_name), bias)


def _untransposed(w: QuantizedTensor, layout_name: str) -> QuantizedTensor:
    p = w._params
    params = dataclasses.replace(p, orig_shape=(p.orig_shape[1], p.orig_shape[0]), transposed=False)
    return QuantizedTensor(w._qdata, layout_name, params)


def flatten_rows(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``[..., K]`` → ``[M, K]`` plus the leading shape to restore."""
    return x.reshape(-1, x.shape[-1]), tuple(x.shape[:-1])


# ---- comfy-kitchen layouts run on LowBit's kernels -----------------------------------------------

#: what LowBit's kernels raise when they refuse a call: a shape, dtype or parameter they do not take
#: (``ValueError``), a forced backend that cannot run it (``BackendUnavailableError``)
_KERNEL_REFUSALS = (ValueError, BackendUnavailableError, NotImplementedError)
_warned_failures: set[tuple[str, str]] = set()


def kitchen_weight_problem(x: torch.Tensor, weight, layouts: tuple[str, ...]) -> str | None:
    """Why the linear of ``x`` and a kitchen-layout ``weight`` cannot go to LowBit's kernels as is.

    ``None`` when it can: a plain input, a ``QuantizedTensor`` of one of ``layouts`` (kitchen registry
    names) stored untransposed and contiguous on ``x``'s device, and no forced ``kitchen`` backend
    (which means kitchen's own linear).
    The format's codec adds its own checks (dtypes, scale shapes, layout options).
    """
    if isinstance(x, QuantizedTensor):
        return "the input is itself quantized"
    if not isinstance(weight, QuantizedTensor) or weight._layout_cls not in layouts:
        return f"the weight is not a {' or '.join(layouts)} QuantizedTensor"
    if getattr(weight._params, "transposed", False):
        return "the weight is transposed"
    qdata = weight._qdata
    if not qdata.is_contiguous() or qdata.dim() != 2:
        return f"the weight's storage is not a contiguous matrix (shape {tuple(qdata.shape)})"
    if qdata.device != x.device:
        return f"the weight is on {qdata.device}, the input on {x.device}"
    if active_backend() is Backend.KITCHEN:
        return "the kitchen backend is forced"
    return None


def linear_on_kernel(fmt: str, problem: str | None, kernel: Callable[[], torch.Tensor],
                     kitchen: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``kernel()`` when ``problem`` is ``None`` and the kernel takes the call, else ``kitchen()``.

    ``kitchen`` is the format's comfy-kitchen path (``F.linear`` on the ``QuantizedTensor``, through
    kitchen's handler). Falling back is never an error: a refusal (a shape or option the kernels do
    not take, a forced backend that cannot run it) is logged at debug level; any other kernel failure
    (a bug, an unsupported GPU) is logged once per format and error type as a warning.
    """
    if problem is None:
        try:
            return kernel()
        except torch.cuda.OutOfMemoryError:
            raise
        except _KERNEL_REFUSALS as err:
            problem = f"LowBit's kernel refused it ({type(err).__name__}: {err})"
        except RuntimeError as err:
            key = (fmt, type(err).__name__)
            if key not in _warned_failures:
                _warned_failures.add(key)
                log.warning("LowBit's %s kernel failed (%s: %s); running comfy-kitchen's linear instead",
                            fmt, type(err).__name__, err)
            return kitchen()
    if log.isEnabledFor(logging.DEBUG):
        log.debug("LowBit %s linear runs comfy-kitchen's path: %s", fmt, problem)
    return kitchen()


class KitchenKernelCodec(FormatCodec):
    """A codec over a comfy-kitchen layout whose linear runs on LowBit's kernels when they take the call.

    Otherwise kitchen's own path runs (:func:`linear_on_kernel`). Subclasses name the kitchen
    layouts their weights may carry (``kernel_layouts``), say what else a call or a weight must
    satisfy (``_call_problem``, ``_weight_problem``), run the kernel (``_kernel_linear``) and, where
    kitchen's path needs more than ``F.linear`` on the ``QuantizedTensor``, override
    ``_kitchen_linear``.
    """

    #: kitchen registry names of the layouts this format's weights may have
    kernel_layouts: tuple[str, ...] = ()

    def linear(self, x, weight, bias=None, input_scale=None):
        return linear_on_kernel(self.spec.name, self._kernel_problem(x, weight, input_scale),
                                lambda: self._kernel_linear(x, weight, bias),
                                lambda: self._kitchen_linear(x, weight, bias, input_scale))

    def bind_linear(self, x, weight, input_scale=None):
        """:meth:`FormatCodec.bind_linear` for a kitchen layout: when LowBit's kernels take calls like
        this one, a runner that goes straight to them (keeping :func:`linear_on_kernel`'s fallback to
        kitchen's path if a kernel fails); ``None`` when the call runs kitchen's path anyway."""
        if not plain_call(x, weight) or self._kernel_problem(x, weight, input_scale) is not None:
            return None
        name = self.spec.name

        def run(x, weight, bias):
            return linear_on_kernel(name, None, lambda: self._kernel_linear(x, weight, bias),
                                    lambda: self._kitchen_linear(x, weight, bias, input_scale))

        return run

    def _kernel_problem(self, x, weight, input_scale=None) -> str | None:
        """Why this call cannot run on LowBit's kernels (``None`` when it can)."""
        return (self._call_problem(x, input_scale) or kitchen_weight_problem(x, weight, self.kernel_layouts)
                or self._weight_problem(x, weight._qdata, weight._params))

    def _call_problem(self, x, input_scale) -> str | None:
        return None

    def _weight_problem(self, x, qdata: torch.Tensor, params) -> str | None:
        return None

    def _kernel_linear(self, x, weight, bias):
        raise NotImplementedError

    def _kitchen_linear(self, x, weight, bias, input_scale):
        return torch.nn.functional.linear(x, weight, bias)

