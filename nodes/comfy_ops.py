"""ComfyUI adapter: Linear layers that run every LowBit format inside ComfyUI's model machinery.

Stable API (the loader, the in-memory quantizer, the save and report nodes use it):

``LowBitOpsConfig``
    Frozen, validated settings of one load: compute dtype, kernel backend, which comfy_quant
    formats run dequantized on this hardware. Never stored in a global or a shared class.
``lowbit_ops(config) -> ops class``
    A per-load factory, like ComfyUI's ``comfy.ops.mixed_precision_ops(...)`` (whose class it
    subclasses, so ComfyUI's casting, offload streams, lowvram streaming, Dynamic VRAM and weight
    patches keep working). Pass it as ``model_options["custom_operations"]``. Its ``Linear`` loads
    any ``<layer>.comfy_quant`` that a LowBit codec reads (LowBit's own formats and the native ones)
    through that codec, and hands formats only ComfyUI knows (nvfp4, mxfp8, e5m2) to ComfyUI's loader.
``lowbit_linear_class(cls, classes)``
    The per-model subclass of an existing ComfyUI Linear class that runs LowBit's forward; the
    in-memory quantizer swaps a module's ``__class__`` to it (one instance at a time, never a global).
``is_lowbit_linear(module)``
    Whether ``module`` holds a weight LowBit runs (``module.lowbit_format`` names its codec).

Run time, per layer holding a LowBit weight: when the weight is quantized and no weight function
(LoRA/lowvram patch) is pending, ComfyUI's ``cast_bias_weight`` brings the weight to the compute
device *still quantized* and the format's codec computes ``codec.linear(x, w, bias, input_scale)``
(each format's own activation handling). Otherwise ComfyUI's own path runs: cast, dequantize,
apply the patches, float ``F.linear``. Per-instance attributes: ``lowbit_format`` (codec name),
``lowbit_config`` (the ``LowBitOpsConfig``), and ComfyUI's ``quant_format``/``layout_type``.

A layer may carry ComfyUI's ``pre_quant_scale`` (SmoothQuant smoothing, ``[in_features]``; see
``quant/calibration_pre_quant.py``): a parameter like ``input_scale`` (loaded from and written to
the checkpoint, moved with the module), applied exactly as stock ComfyUI applies it: the input is
multiplied by it, in the input's dtype, before any of the paths above (and before the compiled
op, so ``torch.compile`` traces the multiply). The stored weight is ``W diag(1 / pre_quant_scale)``,
so weight patches (LoRA) are applied to ``dequantize(weight) * pre_quant_scale``, the original
weight's space, and divided back before requantizing.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import weakref
from dataclasses import dataclass

import torch

import comfy.model_management
import comfy.ops
from comfy_kitchen.tensor import QuantizedTensor

from ..kernels.dispatch import current_dispatcher
from ..quant.compiled_linear import quantized_linear
from ..quant.deferred import DeferredInput, defer_gelu, defer_layer_norm, defer_swiglu, defer_swiglu_pair
from ..quant.errors import CheckpointFormatError, LowBitError, UnknownFormatError
from ..quant.formats import FormatCodec, format_for_comfy_quant, get_format
from ..quant.layouts.base import form_prologue_linear, form_settled_linear
from ..quant.native import COMFY_QUANT, decode_comfy_quant, layer_tensors
from .flux_attention import flux_block_classes
from .joint_attention import FusedJointAttentionMixin, joint_attention_classes, norm_forwards, run_every_op
from .rms_norm import block_norm_sites, norm_mixin
from .swiglu_ffn import swiglu_feed_forward_classes

log = logging.getLogger(__name__)

OPS_CONFIG_VERSION = 1
#: kernel backends a user can pick; "auto" lets LowBit/kitchen choose per call
KERNEL_BACKENDS = ("auto", "kitchen", "eager")
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: per-module attributes the in-memory quantizer and the loader set (read by model_quant)
FORMAT_ATTR = "lowbit_format"
CONFIG_ATTR = "lowbit_config"
RUNNER_ATTR = "_lowbit_runner"  # (weakref to the weight, device, in_features, input_scale, runner or None)
FORM_ATTR = "_lowbit_form_cache"  # (weakref to the weight, device, in_features, codec.prologue_form or None)
PRE_QUANT_SCALE = "pre_quant_scale"  # as quant.calibration_pre_quant and ComfyUI name it
#: where ModelPatcherDynamic leaves a patched module's pending weight patch (comfy.ops' vbar cast applies it)
LOWVRAM_PATCH_ATTR = "weight_lowvram_function"
#: tensors a LowBit layer may carry next to its codec's own
EXTRA_LAYER_TENSORS = ("input_scale", PRE_QUANT_SCALE)


@dataclass(frozen=True)
class LowBitOpsConfig:
    """Settings of one load (or one in-memory quantization). Validates itself.

    ``compute_dtype``: dtype quantized weights report (``QuantizedTensor.dtype``) and float layers
    of a loaded file are stored in; ``None`` leaves it to ComfyUI (the model's manual-cast dtype).
    ``backend``: one of :data:`KERNEL_BACKENDS`. ``dequantize_formats``: ``comfy_quant`` format
    strings (``"float8_e4m3fn"``...) that run as dequantized weight × float activation on this
    hardware, ComfyUI's ``disabled`` list (see :func:`default_dequantize_formats`). ``fuse_inputs``:
    the model's GELUs, SwiGLUs and affine-free LayerNorms hand their outputs to the next LowBit linear
    uncomputed, which computes them inside its activation quantization (:func:`install_input_fusion`).
    """

    compute_dtype: torch.dtype | None = None
    backend: str = "auto"
    dequantize_formats: frozenset[str] = frozenset()
    fuse_inputs: bool = True
    version: int = OPS_CONFIG_VERSION

    def __post_init__(self):
        if self.version != OPS_CONFIG_VERSION:
            raise LowBitError(f"ops config version {self.version} is not supported (expected {OPS_CONFIG_VERSION})")
        if self.backend not in KERNEL_BACKENDS:
            raise LowBitError(f"unknown kernel backend {self.backend!r}; choose one of {', '.join(KERNEL_BACKENDS)}")
        if not isinstance(self.fuse_inputs, bool):
            raise LowBitError(f"fuse_inputs must be True or False, got {self.fuse_inputs!r}")
        if self.compute_dtype is not None and self.compute_dtype not in COMPUTE_DTYPES:
            raise LowBitError(f"compute_dtype must be float16, bfloat16 or float32 (or None for ComfyUI's choice), "
                              f"got {self.compute_dtype}")
        object.__setattr__(self, "dequantize_formats", frozenset(str(f) for f in self.dequantize_formats))

    def to_dict(self) -> dict:
        return {"compute_dtype": None if self.compute_dtype is None else str(self.compute_dtype).replace("torch.", ""),
                "backend": self.backend, "dequantize_formats": sorted(self.dequantize_formats),
                "fuse_inputs": self.fuse_inputs, "version": self.version}

    @classmethod
    def from_dict(cls, data: dict) -> "LowBitOpsConfig":
        dtype = data.get("compute_dtype")
        return cls(compute_dtype=None if dtype is None else getattr(torch, dtype), backend=data.get("backend", "auto"),
                   dequantize_formats=frozenset(data.get("dequantize_formats", ())),
                   fuse_inputs=bool(data.get("fuse_inputs", True)), version=data.get("version", OPS_CONFIG_VERSION))


def default_dequantize_formats(device: torch.device) -> frozenset[str]:
    """The ``comfy_quant`` formats ComfyUI itself would run dequantized on ``device``.

    Mirrors ``comfy.ops.pick_operations``: FP8 needs FP8 tensor cores, nvfp4/mxfp8 need Blackwell. Newer
    ComfyUI says it itself (``comfy.ops.get_disabled_quant_formats``, which also lists the INT8 formats on
    devices without INT8 compute): where it exists, its list is taken as well.
    LowBit's own ``lowbit_fp8_rowwise`` is never listed: its linear is exact on any device.
    """
    mm = comfy.model_management
    disabled = set()
    comfy_says = getattr(comfy.ops, "get_disabled_quant_formats", None)
    if comfy_says is not None:
        disabled |= {str(fmt) for fmt in comfy_says(device)}
    if not mm.supports_fp8_compute(device):
        disabled |= {"float8_e4m3fn", "float8_e5m2"}
    if not getattr(mm, "supports_nvfp4_compute", lambda d: False)(device):
        disabled.add("nvfp4")
    if not getattr(mm, "supports_mxfp8_compute", lambda d: False)(device):
        disabled.add("mxfp8")
    return frozenset(disabled)


@contextlib.contextmanager
def kernel_backend(name: str):
    """Run the LowBit and comfy-kitchen kernels inside the block on backend ``name``.

    ``auto`` changes nothing. ``eager`` forces kitchen's pure-torch backend (and LowBit's eager
    kernels where ``kernels/backend.py`` provides ``force_backend``); ``kitchen`` forces kitchen's
    own linear for every format.
    """
    if name == "auto":
        yield
        return
    with contextlib.ExitStack() as stack:
        try:
            from ..kernels.backend import force_backend
        except ImportError:
            force_backend = None
        if force_backend is not None:
            stack.enter_context(force_backend(name))
        if name == "eager":
            import comfy_kitchen as ck

            stack.enter_context(ck.registry.use_backend("eager"))
        yield


def is_lowbit_linear(module: torch.nn.Module) -> bool:
    return module.__dict__.get(FORMAT_ATTR) is not None and isinstance(module._parameters.get("weight"), QuantizedTensor)


def module_codec(module: torch.nn.Module) -> FormatCodec | None:
    """The codec that runs ``module``'s weight, or ``None`` when LowBit does not run it."""
    name = module.__dict__.get(FORMAT_ATTR)
    return get_format(name) if name is not None else None


_ABSENT = object()


def _module_attr(module: torch.nn.Module, name: str, default=None):
    """``getattr(module, name, default)`` for an instance attribute, parameter, buffer or plain class
    attribute of a Module, without ``nn.Module.__getattr__`` raising (and ``getattr`` catching) for an
    absent name: a LowBit layer asks for several optional attributes on every call."""
    d = module.__dict__
    value = d.get(name, _ABSENT)
    if value is _ABSENT:
        value = d["_parameters"].get(name, _ABSENT)
        if value is _ABSENT:
            value = d["_buffers"].get(name, _ABSENT)
            if value is _ABSENT:
                value = getattr(type(module), name, default)
                if isinstance(value, property):  # not a plain attribute: ask the instance
                    value = getattr(module, name, default)
    return value


def _where_input_is(weight, bias, like: torch.Tensor) -> bool:
    """Whether ``weight`` and ``bias`` (``None`` allowed) are on ``like``'s device and in its dtype: the steady-state
    lanes run on them as they are, with no cast."""
    device, dtype = like.device, like.dtype
    return weight.device == device and weight.dtype == dtype and (
        bias is None or (bias.device == device and bias.dtype == dtype))


def _in_original_space(weight: torch.Tensor, scale: torch.Tensor, functions) -> torch.Tensor:
    """``functions`` (weight patches) applied to ``weight * scale`` and the result divided back by ``scale``."""
    s = scale.to(device=weight.device, dtype=torch.float32)
    out = weight.float() * s
    for f in functions:
        out = f(out)
    return (out.float() / s).to(weight.dtype)


class LowVramPatchInOriginalSpace:
    """A Dynamic-VRAM ``LowVramPatch`` that patches ``weight * pre_quant_scale`` and divides back.

    Put in the module's ``weight_lowvram_function`` only while LowBit casts the layer. ComfyUI's vbar
    cast also prefetches and pins the patch's own tensors (LoRA factors) through this object: every
    attribute but the call is the wrapped patch's, and the pinned-copy record ``_pins`` is the wrapped
    patch's dict, so a wrapper made for one cast never pins a second copy of the factors.
    """

    is_lowvram_patch = True

    def __init__(self, patch, scale: torch.Tensor):
        self.__dict__["_pins"] = patch.__dict__.setdefault("_pins", {})
        self.patch, self.scale = patch, scale

    def __getattr__(self, name):  # only for names not set here: the patch's key, pin state, prepare...
        return getattr(self.__dict__["patch"], name)

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        return _in_original_space(weight, self.scale, (self.patch,))


class LowBitLinearMixin:
    """LowBit's forward, weight-patch hooks, state dict and device moves for a ComfyUI Linear.

    Mixed in front of a ComfyUI Linear class (a ``comfy.ops.CastWeightBiasOp``). A module whose
    ``lowbit_format`` is unset behaves exactly like that class.
    """

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, input, *args, **kwargs):
        if isinstance(input, DeferredInput):  # a GELU / LayerNorm output not computed yet (quant/deferred.py)
            # (the class's forward, not self.forward: ComfyUI's weight-adapter bypass replaces the
            # instance's forward with a wrapper that calls this one and adds its own term)
            if args or kwargs:
                return LowBitLinearMixin.forward(self, input.materialize(), *args, **kwargs)
            if "_v" in self.__dict__:  # Dynamic VRAM: the weight comes from ComfyUI's vbar cast on every call
                out = self._lowbit_dynamic_prologue_forward(input)
                return LowBitLinearMixin.forward(self, input.materialize()) if out is None else out
            out = self._lowbit_prologue_forward(input)
            if out is not None:
                return out
            # No settled plan yet: the unfused call measures and settles one. Where it is a plan the
            # prologue runs on, run that: a first call gives the bits of every later one (a seed gives
            # the same image on the first run of a workflow as on the next). A call that registered
            # no plan (a layer whose plan takes no prologue, already settled) is not tried twice.
            plans = current_dispatcher().fast_plans
            settled = len(plans)
            out = LowBitLinearMixin.forward(self, input.materialize())
            fused = self._lowbit_prologue_forward(input) if len(plans) != settled else None
            return out if fused is None else fused
        codec = module_codec(self)
        if codec is None or not isinstance(_module_attr(self, "weight"), QuantizedTensor):
            return super().forward(input, *args, **kwargs)
        run_every_op()
        if input.numel() == 0 and input.dim() >= 2 and input.shape[:-1].numel() == 0:
            # no rows (a routed expert that no token chose): nothing to compute, and kitchen's activation
            # quantizers do not take an empty input
            return input.new_empty((*input.shape[:-1], self.weight.shape[0]))
        input = self._lowbit_pre_quant(input)
        config: LowBitOpsConfig = self.__dict__.get(CONFIG_ATTR) or LowBitOpsConfig()
        if self._lowbit_runs_quantized(input, config):
            if torch.compiler.is_compiling() and not hasattr(self, "_v"):
                # one opaque custom op with a fake: torch.compile traces it (see quant/compiled_linear.py)
                return quantized_linear(codec.spec.name, input, self.weight, self.bias,
                                        getattr(self, "input_scale", None), config.backend)
            bound = self._lowbit_resident_runner(input, codec, config)
            if bound is not None:
                runner, weight, bias, form = bound
                if form is not None:  # the settled plan straight from the layer's weight form
                    out = form_settled_linear(form, input, bias)
                    if out is not None:
                        return out
                return runner(input, weight, bias)
            return self._lowbit_quantized_forward(input, codec, config)
        return self._lowbit_dequantized_forward(input)

    def _lowbit_prologue_forward(self, input: DeferredInput):
        """The linear of a deferred input with the input computed inside the activation quantization
        (``codec.prologue_linear``), where the steady-state path would run (weights resident in the input's
        dtype, no patches, no forced backend, no smoothing scales); ``None`` otherwise."""
        codec = module_codec(self)
        if codec is None or not isinstance(_module_attr(self, "weight"), QuantizedTensor) or "_v" in self.__dict__:
            return None
        config: LowBitOpsConfig = self.__dict__.get(CONFIG_ATTR) or LowBitOpsConfig()
        src = input.prologue.source
        if (config.backend != "auto" or _module_attr(self, PRE_QUANT_SCALE) is not None
                or _module_attr(self, "input_scale") is not None or not self._lowbit_runs_quantized(src, config)):
            return None
        weight, bias = self._parameters.get("weight"), self._parameters.get("bias")
        if not _where_input_is(weight, bias, src):
            return None
        form = self._lowbit_weight_form(codec, weight, src, input.prologue.shape[1])
        if form is None:
            return None
        run_every_op()
        return self._lowbit_form_prologue(form, input, bias)

    def _lowbit_dynamic_prologue_forward(self, input: DeferredInput):
        """Under Dynamic VRAM (the layer has a vbar slot, ``_v``): the linear of a deferred input through
        :meth:`_lowbit_quantized_forward` (ComfyUI's vbar cast, then the fused path on the quantized weight it
        hands back), where the steady-state path's conditions hold; ``None`` otherwise (the caller
        materializes the input and takes the ordinary forward)."""
        codec = module_codec(self)
        if codec is None or not isinstance(_module_attr(self, "weight"), QuantizedTensor):
            return None
        config: LowBitOpsConfig = self.__dict__.get(CONFIG_ATTR) or LowBitOpsConfig()
        if (config.backend != "auto" or _module_attr(self, PRE_QUANT_SCALE) is not None
                or _module_attr(self, "input_scale") is not None
                or not self._lowbit_runs_quantized(input.prologue.source, config)):
            return None
        run_every_op()
        return self._lowbit_quantized_forward(input, codec, config)

    def _lowbit_vbar_form(self, codec: FormatCodec, config: LowBitOpsConfig, weight, bias, like: torch.Tensor, k: int):
        """The weight form (``codec.prologue_form``) of the weight Dynamic VRAM's cast handed back, for inputs of
        ``k`` features, where the steady-state path would run on it: a quantized weight in ``like``'s dtype and on
        its device, no forced backend, no ``input_scale``, outside ``torch.compile`` tracing; ``None`` otherwise.

        The layer's resident VRAM copy (``_v_weight``: the same object on every call until the vbar evicts it)
        keeps its form (:meth:`_lowbit_weight_form`). A streamed weight is a new tensor in a cast buffer on each
        call: its form is made for the call and not kept (it would hold the buffer), so a layer computes the same
        bits whether it streams or stays resident."""
        if (not isinstance(weight, QuantizedTensor) or config.backend != "auto" or not _where_input_is(weight, bias, like)
                or _module_attr(self, "input_scale") is not None or torch.compiler.is_compiling()):
            return None
        if weight is self.__dict__.get("_v_weight"):
            return self._lowbit_weight_form(codec, weight, like, k)
        return codec.prologue_form(like.new_empty((0, k)), weight)

    def _lowbit_weight_form(self, codec: FormatCodec, weight, like: torch.Tensor, k: int):
        """``codec.prologue_form`` of ``weight`` for inputs of ``k`` features on ``like``'s device and dtype: the
        per-weight checks made once and kept per weight (weakly), device and features (``FORM_ATTR``)."""
        cached = self.__dict__.get(FORM_ATTR)
        if cached is None or cached[0]() is not weight or cached[1] != like.device or cached[2] != k:
            cached = (weakref.ref(weight), like.device, k, codec.prologue_form(like.new_empty((0, k)), weight))
            self.__dict__[FORM_ATTR] = cached
        return cached[3]

    def _lowbit_resident_runner(self, input, codec: FormatCodec, config: LowBitOpsConfig):
        """``(runner, weight, bias, form)`` for a layer whose weights already live where ``input`` is, else ``None``
        (``form``: the weight's form for the settled-plan lane, ``None`` with an ``input_scale``).

        The steady state of a fully loaded model: weight and bias already on the input's device and in
        its dtype, no patch functions (checked by the caller), not Dynamic VRAM, no forced backend.
        ``comfy.ops.cast_bias_weight`` would hand back the same tensors, so it is skipped (low-VRAM
        streaming leaves the weight on the offload device, which takes the full path). The codec's bound runner
        (:meth:`FormatCodec.bind_linear`) is kept per weight, device, dtype and ``input_scale``,
        so the next call goes straight to the kernels; a new weight (LoRA merge, device move)
        binds again. The weight is referenced weakly: the cache never keeps a replaced weight alive.
        """
        if config.backend != "auto" or "_v" in self.__dict__:
            return None
        weight, bias = self._parameters.get("weight"), self._parameters.get("bias")
        if not _where_input_is(weight, bias, input):
            return None
        device = input.device
        input_scale = _module_attr(self, "input_scale")
        cached = self.__dict__.get(RUNNER_ATTR)
        if (cached is None or cached[0]() is not weight or cached[1] != device or cached[2] != input.shape[-1]
                or cached[3] is not input_scale):
            cached = (weakref.ref(weight), device, input.shape[-1], input_scale,
                      codec.bind_linear(input, weight, input_scale))
            self.__dict__[RUNNER_ATTR] = cached
        if cached[4] is None:
            return None
        form = self._lowbit_weight_form(codec, weight, input, input.shape[-1]) if input_scale is None else None
        return cached[4], weight, bias, form

    def _lowbit_pre_quant(self, input):
        """``input * pre_quant_scale`` in the input's dtype, as stock ComfyUI applies it (``input`` without one)."""
        scale = _module_attr(self, PRE_QUANT_SCALE)
        if scale is None:
            return input
        if isinstance(input, QuantizedTensor):
            input = input.dequantize()
        # the same cast as stock's cast_to_device(scale, input.device, input.dtype), written so Dynamo traces it
        return input * scale.to(device=input.device, dtype=input.dtype)

    def _lowbit_runs_quantized(self, input, config: LowBitOpsConfig) -> bool:
        return not (
            isinstance(input, QuantizedTensor)
            or (config.dequantize_formats and _module_attr(self, "quant_format") in config.dequantize_formats)
            or _module_attr(self, "_full_precision_mm", False)
            or _module_attr(self, "comfy_force_cast_weights", False)
            or len(_module_attr(self, "weight_function", ())) > 0 or len(_module_attr(self, "bias_function", ())) > 0
            or (input.requires_grad and torch.is_grad_enabled())  # training: float path has autograd
        )

    def _lowbit_quantized_forward(self, input, codec: FormatCodec, config: LowBitOpsConfig):
        """The linear through ComfyUI's cast (offloading, low-VRAM streaming, Dynamic VRAM). ``input`` may be a
        deferred input (Dynamic VRAM, :meth:`_lowbit_dynamic_prologue_forward`). Under Dynamic VRAM the call
        takes the steady-state lanes a resident layer takes without it, on the quantized weight the cast hands
        back (the vbar's resident copy or a streamed one, :meth:`_lowbit_vbar_form`): the settled plan from the
        weight's form, a deferred input computed inside the activation quantization; so both loadings give the
        same bits. Anything else (and a first call, which settles the plan) runs ``codec.linear``."""
        deferred = isinstance(input, DeferredInput)
        like = input.prologue.source if deferred else input
        if self._parameters.get(PRE_QUANT_SCALE) is None:  # no patch space to switch (a context costs µs per call)
            weight, bias, offload_stream = self._lowbit_cast(like)
        else:
            with self._lowbit_patches_in_original_space():
                weight, bias, offload_stream = self._lowbit_cast(like)
        try:
            k = input.prologue.shape[1] if deferred else input.shape[-1]
            form = self._lowbit_vbar_form(codec, config, weight, bias, like, k) if "_v" in self.__dict__ else None
            if form is not None:
                out = (self._lowbit_form_prologue(form, input, bias) if deferred
                       else form_settled_linear(form, input, bias))
                if out is not None:
                    return out
            x = input.materialize() if deferred else input
            if not isinstance(weight, QuantizedTensor):  # ComfyUI dequantized it (CPU-side Dynamic VRAM)
                return torch.nn.functional.linear(x, weight.to(x.dtype), bias)
            if weight.dtype != x.dtype:
                weight = weight.to(dtype=x.dtype)  # metadata only: the output dtype
            input_scale = getattr(self, "input_scale", None)
            if input_scale is not None:
                input_scale = comfy.model_management.cast_to_device(input_scale, x.device, None)
            plans = current_dispatcher().fast_plans if deferred and form is not None else None
            settled = None if plans is None else len(plans)
            with kernel_backend(config.backend):
                out = codec.linear(x, weight, bias, input_scale)
            if plans is not None and len(plans) != settled:
                # the call settled a plan: from now on the fused path runs; run it now too, so that the first
                # call gives the bits of every later one (as the resident lane does)
                fused = self._lowbit_form_prologue(form, input, bias)
                out = out if fused is None else fused
            return out
        finally:
            comfy.ops.uncast_bias_weight(self, weight, bias, offload_stream)

    def _lowbit_cast(self, like: torch.Tensor):
        # Same cast as ComfyUI's weight-only-quant path: keep the weight's own dtype so the
        # QuantizedTensor moves to the device still quantized; want_requant keeps a Dynamic-VRAM
        # layer quantized when a LoRA is patched in while it streams.
        return comfy.ops.cast_bias_weight(self, input=None, dtype=self.weight.dtype, device=like.device,
                                          bias_dtype=like.dtype, offloadable=True, compute_dtype=like.dtype,
                                          want_requant=True)

    @staticmethod
    def _lowbit_form_prologue(form, input: DeferredInput, bias):
        out = form_prologue_linear(form, input.prologue, bias)
        return None if out is None else out.reshape(*input.lead_shape, out.shape[-1])

    def _lowbit_dequantized_forward(self, input):
        if isinstance(input, QuantizedTensor):
            input = input.dequantize()
        with self._lowbit_patches_in_original_space():
            weight, bias, offload_stream = comfy.ops.cast_bias_weight(self, input, offloadable=True,
                                                                      compute_dtype=input.dtype)
        try:
            if isinstance(weight, QuantizedTensor):
                weight = weight.dequantize()
            return torch.nn.functional.linear(input, weight.to(input.dtype), bias)
        finally:
            comfy.ops.uncast_bias_weight(self, weight, bias, offload_stream)

    @contextlib.contextmanager
    def _lowbit_patches_in_original_space(self):
        """While casting, run the pending weight patches (LoRA) on ``weight * pre_quant_scale``, the
        space their deltas are in, and divide the result back to the stored (smoothed) space.

        Two kinds of pending patch reach ``comfy.ops.cast_bias_weight``: ``weight_function`` (the
        regular patcher's low-VRAM patches, weight wrappers) and, under Dynamic VRAM,
        ``weight_lowvram_function`` (the ``LowVramPatch`` that ``ModelPatcherDynamic.load`` leaves on
        every patched module; its vbar cast applies it to the streamed weight and requantizes).
        """
        scale = self._parameters.get(PRE_QUANT_SCALE)
        functions = self.weight_function
        lowvram = self.__dict__.get(LOWVRAM_PATCH_ATTR)
        if scale is None or (not functions and lowvram is None):
            yield
            return
        if functions:
            self.weight_function = [lambda weight: _in_original_space(weight, scale, functions)]
        if lowvram is not None:
            self.__dict__[LOWVRAM_PATCH_ATTR] = LowVramPatchInOriginalSpace(lowvram, scale)
        try:
            yield
        finally:
            self.weight_function = functions
            if lowvram is not None:
                self.__dict__[LOWVRAM_PATCH_ATTR] = lowvram

    # ---- weight patches (ModelPatcher.patch_weight_to_device uses convert_/set_weight) -------
    def convert_weight(self, weight, inplace=False, **kwargs):
        weight = weight.dequantize() if isinstance(weight, QuantizedTensor) else weight
        scale = self._parameters.get(PRE_QUANT_SCALE) if module_codec(self) is not None else None
        if scale is not None:  # the original weight's space, where patch deltas apply
            weight = (weight.float() * scale.to(device=weight.device, dtype=torch.float32)).to(weight.dtype)
        return weight

    def set_weight(self, weight, inplace_update=False, seed=None, return_weight=False, **kwargs):
        self._lowbit_forget_forms()
        codec = module_codec(self)
        if codec is None:
            parent = getattr(super(), "set_weight", None)
            if parent is not None:
                return parent(weight, inplace_update=inplace_update, seed=seed, return_weight=return_weight, **kwargs)
            weight = weight.to(self.weight.dtype)
        else:
            scale = self._parameters.get(PRE_QUANT_SCALE)
            if scale is not None:  # back to the stored (smoothed) space, see convert_weight
                weight = weight.float() / scale.to(device=weight.device, dtype=torch.float32)
            # fp8_rowwise layers keep their calibrated outlier channels through a patch (a merged LoRA)
            index = getattr(getattr(self.weight, "_params", None), "outlier_index", None)
            weight = requantize(codec, weight, dtype=self.weight.dtype, seed=seed or 0,
                                layer=self.__dict__.get("seed_key", ""),
                                options={} if index is None else {"outlier_channels": index})
        if return_weight:
            return weight
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    # ---- checkpoint form ---------------------------------------------------------------------
    def state_dict(self, *args, destination=None, prefix="", keep_vars=False, **kwargs):
        codec = module_codec(self)
        if codec is None or not isinstance(self.weight, QuantizedTensor):
            return super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars, **kwargs)
        sd = destination if destination is not None else {}
        if self.bias is not None:
            sd[f"{prefix}bias"] = self.bias if keep_vars else self.bias.detach()
        sd.update(layer_tensors(codec, prefix[:-1], self.weight))
        for name in EXTRA_LAYER_TENSORS:
            value = self._parameters.get(name)
            if value is not None:
                sd[f"{prefix}{name}"] = value if keep_vars else value.detach()
        return sd

    # ---- device moves: re-wrap QuantizedTensor parameters (Module._apply cannot set .data) ---
    def _lowbit_forget_forms(self) -> None:
        """Drop the per-layer caches that hold the weight's tensors (a moved or replaced weight must not
        stay allocated through them, e.g. on the GPU after ComfyUI unloaded the model)."""
        self.__dict__.pop(FORM_ATTR, None)
        self.__dict__.pop(RUNNER_ATTR, None)

    def _apply(self, fn, recurse=True):
        self._lowbit_forget_forms()
        if module_codec(self) is None:
            return super()._apply(fn, recurse)
        if recurse:
            for child in self.children():
                child._apply(fn)
        for key, param in self._parameters.items():
            if param is None:
                continue
            moved = fn(param)
            if not torch.is_inference_mode_enabled() and moved.is_inference():
                moved = moved.clone()
            self._parameters[key] = torch.nn.Parameter(moved, requires_grad=False)
        for key, buf in self._buffers.items():
            if buf is not None:
                self._buffers[key] = fn(buf)
        return self


_SEEDLESS_WARNED: set[str] = set()


def requantize(codec: FormatCodec, weight: torch.Tensor, *, dtype: torch.dtype, seed: int = 0,
               layer: str = "", options: dict | None = None) -> QuantizedTensor:
    """Quantize a patched float ``weight`` back to ``codec``'s format (ComfyUI's ``set_weight``).

    ``seed > 0`` asks for stochastic rounding, as ComfyUI does when it merges a LoRA into a
    quantized weight; a format that cannot round stochastically here rounds to nearest (logged once).
    ``options``: the format's own quantize options the layer was made with (fp8_rowwise's outlier channels).
    """
    compute_dtype = dtype if dtype in COMPUTE_DTYPES else torch.bfloat16
    options = options or {}
    try:
        return codec.quantize(weight, compute_dtype=compute_dtype, seed=seed, **options)
    except ValueError:
        if seed <= 0:
            raise
        if codec.spec.name not in _SEEDLESS_WARNED:
            _SEEDLESS_WARNED.add(codec.spec.name)
            log.warning("LowBit: %s cannot round stochastically with this comfy-kitchen; patched weights "
                        "(e.g. %s) are rounded to nearest", codec.spec.name, layer or "a LoRA layer")
        return codec.quantize(weight, compute_dtype=compute_dtype, seed=0, **options)


def lowbit_linear_class(base: type, classes: dict[type, type]) -> type:
    """The subclass of ComfyUI Linear class ``base`` that runs LowBit weights, one per model.

    ``classes`` is the caller's per-model cache (so every layer of one model shares one class and
    no class outlives the model that made it).
    """
    if issubclass(base, LowBitLinearMixin):
        return base
    cls = classes.get(base)
    if cls is None:
        bases = (LowBitLinearMixin, base)
        if not issubclass(base, comfy.ops.CastWeightBiasOp):  # a plain torch Linear: give it ComfyUI's cast hooks
            bases = (LowBitLinearMixin, base, comfy.ops.CastWeightBiasOp)
        cls = type(f"LowBit{base.__name__}", bases, {"__module__": __name__})
        classes[base] = cls
    return cls


class DeferredGELUMixin:
    """An ``nn.GELU`` whose output may be a deferred input (``quant/deferred.py``)."""

    def forward(self, input):
        return defer_gelu(input, self.approximate)


class DeferredProjGELUMixin:
    """A GELU module that owns its projection, ``gelu(self.proj(x))`` (Qwen-Image's ``GELU``; LTX's ``GELU_approx``,
    tanh), whose output may be a deferred input (``quant/deferred.py``): the next LowBit linear (the MLP's
    down-projection) computes the GELU inside its activation quantization."""

    def forward(self, x):
        return defer_gelu(self.proj(x), getattr(self, "approximate", "tanh"))


class DeferredLayerNormMixin:
    """An affine-free LayerNorm (torch's or ComfyUI's) whose output may be a deferred input
    (``quant/deferred.py``); with weights, patches or other arguments it is its class's own."""

    def forward(self, input, *args, **kwargs):
        if (not args and not kwargs and self.weight is None and self.bias is None and len(self.normalized_shape) == 1
                and not getattr(self, "weight_function", None) and not getattr(self, "bias_function", None)
                and isinstance(input, torch.Tensor) and input.dim() >= 2
                and input.shape[-1] == self.normalized_shape[0]):
            out = defer_layer_norm(input, self.eps)
            if out is not None:
                run_every_op()
                return out
        return super().forward(input, *args, **kwargs)


class DeferredSwiGLUMixin:
    """Flux 2's ``SiLUActivation`` (``silu(x1) * x2`` of the two halves of ``x``) whose output may be a deferred
    input (``quant/deferred.py``); with another gate function, or hooks on it, it is its class's own."""

    def forward(self, x):
        gate_fn = getattr(self, "gate_fn", None)
        if type(gate_fn) is torch.nn.SiLU and not (gate_fn._forward_hooks or gate_fn._forward_pre_hooks
                                                    or "forward" in gate_fn.__dict__):
            return defer_swiglu(x)
        return super().forward(x)


class DeferredGatedFeedForwardMixin:
    """Lumina 2's and Z-Image's ``FeedForward`` (``w2(silu(w1(x)) * w3(x))``) whose gating may hand ``w2`` a
    deferred input (``quant/deferred.py``); in fp16, where ComfyUI clamps the product to fp16's range, the
    class's own gating runs."""

    def _forward_silu_gating(self, x1, x3):
        if x1.dtype != torch.float16:
            out = defer_swiglu_pair(x1, x3)
            if out is not None:
                return out
        return super()._forward_silu_gating(x1, x3)


@functools.lru_cache(maxsize=None)
def _gated_feed_forward_class() -> type | None:
    """ComfyUI's Lumina ``FeedForward`` (Lumina 2, Z-Image), where this ComfyUI has it and its
    ``_forward_silu_gating(x1, x3)`` computes ``silu(x1) * x3`` outside fp16 (checked once on small tensors:
    the deferral stands for exactly that)."""
    try:
        cls = importlib.import_module("comfy.ldm.lumina.model").FeedForward
        gen = torch.Generator().manual_seed(0)
        x1, x3 = torch.randn(3, 8, generator=gen), torch.randn(3, 8, generator=gen)
        with torch.no_grad():
            ok = all(torch.equal(cls._forward_silu_gating(None, x1.to(dt), x3.to(dt)),
                                 torch.nn.functional.silu(x1.to(dt)) * x3.to(dt))
                     for dt in (torch.float32, torch.bfloat16))
    except Exception:  # absent, or another signature: such modules keep their own gating
        return None
    return cls if ok else None


#: ComfyUI's GELU modules that own their projection: (module, class name)
_PROJ_GELUS = (("comfy.ldm.qwen_image.model", "GELU"), ("comfy.ldm.lightricks.model", "GELU_approx"))


@functools.lru_cache(maxsize=None)
def _proj_gelu_classes() -> frozenset:
    """Those of ``_PROJ_GELUS`` this ComfyUI has whose ``forward(x)`` computes ``gelu(self.proj(x))`` at their
    ``approximate`` (``"tanh"`` where they have none), checked once on a small instance for every approximation
    they take, in fp32 and bf16 (the deferral stands for exactly that)."""
    found = []
    for module_name, name in _PROJ_GELUS:
        try:
            cls = getattr(importlib.import_module(module_name), name)
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(3, 8, generator=gen)
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                module = cls(8, 16, operations=torch.nn)  # torch's own Linear: a plain projection
            approximations = ("none", "tanh") if hasattr(module, "approximate") else ("tanh",)
            ok = True
            for approximate in approximations:
                if hasattr(module, "approximate"):
                    module.approximate = approximate
                for dtype in (torch.float32, torch.bfloat16):
                    m, xd = module.to(dtype), x.to(dtype)
                    with torch.no_grad():
                        ok = ok and torch.equal(m(xd), torch.nn.functional.gelu(m.proj(xd), approximate=approximate))
        except Exception:  # absent, or another signature: such modules keep their own forward
            continue
        if ok:
            found.append(cls)
    return frozenset(found)


@functools.lru_cache(maxsize=None)
def _swiglu_activation_class() -> type | None:
    """ComfyUI's Flux 2 ``SiLUActivation``, where this ComfyUI has it and it computes ``silu(x1) * x2`` of
    ``x.chunk(2, -1)`` (checked once on a small tensor: the deferral stands for exactly that)."""
    try:
        cls = importlib.import_module("comfy.ldm.flux.layers").SiLUActivation
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            ok = torch.equal(cls()(x), torch.nn.functional.silu(x[:, :4]) * x[:, 4:])
    except Exception:  # absent, or another signature: such modules keep their own forward
        return None
    return cls if ok else None


def _deferring_class(base: type, mixin: type, classes: dict[type, type]) -> type:
    cls = classes.get(base)
    if cls is None:
        cls = type(f"LowBit{base.__name__}", (mixin, base), {"__module__": __name__})
        classes[base] = cls
    return cls


def install_input_fusion(diffusion_model: torch.nn.Module, classes: dict[type, type]) -> int:
    """Let the model's GELUs, SwiGLUs and affine-free LayerNorms hand their outputs to LowBit linears uncomputed.

    Swaps the ``__class__`` of every exact ``nn.GELU``, of every exact Flux 2 ``SiLUActivation``, Lumina
    ``FeedForward`` (Lumina 2, Z-Image; where ComfyUI has them: the gating of the latter), three-linear SwiGLU MLP
    (HiDream, Krea 2, SeedVR, MMDiT's SwiGLU variant: ``nodes/swiglu_ffn.py``) and GELU module with its
    own projection (Qwen-Image's ``GELU``, LTX's ``GELU_approx``: ``gelu(proj(x))``), of Qwen-Image's joint
    ``Attention`` and Flux's double and single stream blocks (their q, k, v made in one pass:
    ``nodes/joint_attention.py``, ``nodes/flux_attention.py``), of the RMSNorms in front of Lumina 2's, Z-Image's
    and Krea 2's attention and MLP (``nodes/rms_norm.py``) and of every LayerNorm
    without weights whose class computes plain ``F.layer_norm`` (torch's, ComfyUI's ops) to a per-model subclass
    (``classes``: the caller's per-model cache; nothing global changes). Their outputs become deferred inputs
    (``quant/deferred.py``): a LowBit linear that takes one computes it inside its activation quantization;
    anything else gets the computed tensor. Subclasses with forwards of their own
    (e.g. a norm that upcasts) are left alone. Returns how many modules were swapped (0 on a second call).
    """
    layer_norm_forwards = norm_forwards(torch.nn.LayerNorm)
    swiglu, gated_ffn = _swiglu_activation_class(), _gated_feed_forward_class()
    proj_gelus = _proj_gelu_classes() or frozenset()
    swiglu_ffns = swiglu_feed_forward_classes() or {}
    joint_attentions = joint_attention_classes() or frozenset()
    flux_blocks = dict(flux_block_classes() or ())
    norm_sites = block_norm_sites()
    swapped = 0
    for module in diffusion_model.modules():
        cls = type(module)
        for name in norm_sites.get(cls, ()):  # the RMSNorms in front of a block's attention and MLP
            norm = getattr(module, name, None)
            mixin = None if norm is None else norm_mixin(norm)
            if mixin is not None:
                norm.__class__ = _deferring_class(type(norm), mixin, classes)
                swapped += 1
        if cls in flux_blocks:
            module.__class__ = _deferring_class(cls, flux_blocks[cls], classes)
        elif cls is torch.nn.GELU:
            module.__class__ = _deferring_class(cls, DeferredGELUMixin, classes)
        elif swiglu is not None and cls is swiglu:
            module.__class__ = _deferring_class(cls, DeferredSwiGLUMixin, classes)
        elif gated_ffn is not None and cls is gated_ffn:
            module.__class__ = _deferring_class(cls, DeferredGatedFeedForwardMixin, classes)
        elif cls in swiglu_ffns:
            module.__class__ = _deferring_class(cls, swiglu_ffns[cls], classes)
        elif cls in proj_gelus:
            module.__class__ = _deferring_class(cls, DeferredProjGELUMixin, classes)
        elif cls in joint_attentions:
            module.__class__ = _deferring_class(cls, FusedJointAttentionMixin, classes)
        elif (isinstance(module, torch.nn.LayerNorm) and not isinstance(module, DeferredLayerNormMixin)
              and cls.forward in layer_norm_forwards and module.weight is None and module.bias is None):
            module.__class__ = _deferring_class(cls, DeferredLayerNormMixin, classes)
        else:
            continue
        swapped += 1
    return swapped


def lowbit_ops(config: LowBitOpsConfig) -> type:
    """The ops class of one load: ComfyUI's mixed-precision ops whose Linear runs every LowBit format.

    ``config`` is captured by this call's classes only; two loads never share settings.
    """
    if not isinstance(config, LowBitOpsConfig):
        raise TypeError(f"lowbit_ops needs a LowBitOpsConfig, got {type(config).__name__}")
    base = comfy.ops.mixed_precision_ops({}, config.compute_dtype, disabled=sorted(config.dequantize_formats))

    class LowBitOps(base):
        class Linear(LowBitLinearMixin, base.Linear):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.lowbit_config = config
                self.lowbit_format = None

            def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs):
                raw = state_dict.get(f"{prefix}{COMFY_QUANT}")
                codec = None if raw is None else _codec_for_layer(prefix[:-1], raw)
                if codec is None:  # float layer, or a format only ComfyUI runs
                    return base.Linear._load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                                                              missing_keys, unexpected_keys, error_msgs)
                _load_lowbit_weight(self, codec, state_dict, prefix, config)
                torch.nn.Module._load_from_state_dict(self, state_dict, prefix, local_metadata, strict,
                                                      missing_keys, unexpected_keys, error_msgs)
                for key in (f"{prefix}weight", *(f"{prefix}{name}" for name in EXTRA_LAYER_TENSORS)):
                    if key in missing_keys:
                        missing_keys.remove(key)

    LowBitOps.__name__ = LowBitOps.__qualname__ = "LowBitOps"
    return LowBitOps


def _codec_for_layer(layer: str, raw: torch.Tensor) -> FormatCodec | None:
    conf = decode_comfy_quant(layer, raw)
    try:
        return format_for_comfy_quant(conf)
    except UnknownFormatError:
        from comfy.quant_ops import QUANT_ALGOS

        if conf["format"] in QUANT_ALGOS:
            return None  # ComfyUI's own loader reads it (nvfp4, mxfp8, float8_e5m2)
        readable = sorted({*QUANT_ALGOS, *(c.spec.native_format for c in _all_codecs())})
        raise CheckpointFormatError(
            f"layer {layer!r} is quantized as {conf['format']!r}, which neither LowBit nor this ComfyUI reads "
            f"(readable: {', '.join(readable)}). Update ComfyUI-LowBit, or re-export the file in one of those formats."
        ) from None


def _all_codecs():
    from ..quant.formats import FORMATS

    return FORMATS.values()


def _load_lowbit_weight(module, codec: FormatCodec, state_dict, prefix: str, config: LowBitOpsConfig) -> None:
    """Pop the layer's ``comfy_quant`` and weight tensors and set ``module.weight`` through ``codec``."""
    layer = prefix[:-1]
    conf = decode_comfy_quant(layer, state_dict.pop(f"{prefix}{COMFY_QUANT}"))
    entries = {}
    for key in list(state_dict):
        if key.startswith(prefix):
            suffix = key[len(prefix):]
            if "." not in suffix and suffix != "bias":
                entries[suffix] = state_dict.pop(key)
    known = {*codec.tensor_keys, *EXTRA_LAYER_TENSORS}
    ignored = sorted(set(entries) - known)
    if ignored:
        log.warning("LowBit: layer %s (%s): ignoring unexpected tensors %s", layer, codec.spec.name, ignored)
    compute_dtype = config.compute_dtype or module.factory_kwargs.get("dtype") or torch.bfloat16
    qt = codec.from_state_dict(layer, entries, conf, compute_dtype)
    device = module.factory_kwargs.get("device")
    if device is not None:
        qt = qt.to(device=device)
    module.weight = torch.nn.Parameter(qt, requires_grad=False)
    input_scale = entries.get("input_scale")
    if input_scale is not None:
        module.register_parameter("input_scale", torch.nn.Parameter(input_scale.float(), requires_grad=False))
    scale = entries.get(PRE_QUANT_SCALE)
    if scale is not None:
        set_pre_quant_scale(module, scale, layer=layer, device=device)
    module.lowbit_format = codec.spec.name
    module.quant_format = conf["format"]
    module.layout_type = qt._layout_cls
    module._full_precision_mm_config = bool(conf.get("full_precision_matrix_mult", False))
    if module._full_precision_mm_config:
        module._full_precision_mm = True


def set_pre_quant_scale(module: torch.nn.Module, scale: torch.Tensor | None, *, layer: str = "",
                        device=None) -> None:
    """Give ``module`` the ``pre_quant_scale`` parameter (``None`` removes it), kept in its own dtype as
    stock ComfyUI keeps it; ``device``: where to put it (default: where the weight is)."""
    if scale is None:
        module._parameters.pop(PRE_QUANT_SCALE, None)
        return
    in_features = module.weight.shape[1]
    if (not isinstance(scale, torch.Tensor) or not scale.is_floating_point() or tuple(scale.shape) != (in_features,)
            or isinstance(scale, QuantizedTensor)):
        raise CheckpointFormatError(
            f"layer {layer or type(module).__name__}: pre_quant_scale must be a float vector of the layer's "
            f"{in_features} input features, found {type(scale).__name__} {tuple(getattr(scale, 'shape', ()))}; "
            f"the file is damaged or was written for another model")
    device = module.weight.device if device is None else device
    module.register_parameter(PRE_QUANT_SCALE, torch.nn.Parameter(scale.detach().to(device=device),
                                                                  requires_grad=False))


def mark_quantized(module: torch.nn.Module, codec: FormatCodec, weight: QuantizedTensor,
                   config: LowBitOpsConfig) -> None:
    """Make ``module`` (already of a :func:`lowbit_linear_class`) hold ``weight`` and run it as ``codec``."""
    module.weight = torch.nn.Parameter(weight, requires_grad=False)
    module.lowbit_format = codec.spec.name
    module.lowbit_config = config
    module.quant_format = codec.spec.native_format
    module.layout_type = weight._layout_cls
    if "_full_precision_mm" not in module.__dict__:
        module._full_precision_mm = False


__all__ = [
    "KERNEL_BACKENDS", "LowBitOpsConfig", "LowBitLinearMixin", "default_dequantize_formats", "is_lowbit_linear",
    "kernel_backend", "lowbit_linear_class", "lowbit_ops", "mark_quantized", "module_codec", "requantize",
    "set_pre_quant_scale",
]
