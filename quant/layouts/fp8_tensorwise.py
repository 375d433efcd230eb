"""``fp8``: comfy-kitchen's native per-tensor FP8 (e4m3) layout, W8A8.

The weight is e4m3 with one fp32 scale; the activation is quantized per tensor at run time (to the
stored ``input_scale`` when the file has one, else to its own abs-max), and the product runs on
FP8 tensor cores (``_scaled_mm``) where the GPU has them.
Native ``comfy_quant``: ``{"format": "float8_e4m3fn"}``; tensors ``weight`` (float8_e4m3fn
``[N, K]``), ``weight_scale`` (fp32 scalar), optional ``input_scale``. Stock ComfyUI loads and runs it.

K and N must be multiples of 16: kitchen's FP8 GEMM (``torch._scaled_mm``) refuses other shapes on
the GPU, so a layer of another shape stays float rather than be written as a file stock ComfyUI
cannot run.

Note: stock ComfyUI quantizes activations with a unit scale when a layer has no ``input_scale``;
LowBit uses the activation's abs-max instead (no clipping above 448), so the two can differ in the
last bits on such files.

Run time (:meth:`Fp8TensorwiseCodec.linear`):

* on a CUDA device, for a layer without ``input_scale``: LowBit's ``kernels.fp8_gemm.fp8_rowwise_linear``
  with the stored per-tensor weight scale. Activations get one scale per token instead of one per
  tensor: each token's scale fits its own range, so small tokens no longer sink into e4m3's
  subnormals. The measured dispatcher picks our Triton kernel or ``torch._scaled_mm`` with row-wise
  scales.
* a layer with a stored ``input_scale`` (a calibrated static activation scale): exactly as before,
  the activation quantized to that scale and kitchen's FP8 linear (``F.linear``), as stock ComfyUI
  runs it.
* on the CPU: as before (activation abs-max per tensor, kitchen's linear), so CPU results stay
  comfy-kitchen's bit for bit.
"""

from __future__ import annotations

import torch
from comfy_kitchen.tensor import QuantizedTensor, TensorCoreFP8Layout

from ...kernels.fp8_gemm import fp8_rowwise_linear
from .base import FormatSpec, KitchenKernelCodec, check_matrix, check_numel, require

LAYOUT = "TensorCoreFP8Layout"
FP8 = torch.float8_e4m3fn
#: registry names an e4m3 weight of this format has (ComfyUI's loader uses its own subclass' name)
WEIGHT_LAYOUTS = (LAYOUT, "TensorCoreFP8E4M3Layout")
#: device types on which a layer without ``input_scale`` runs LowBit's per-token FP8 kernel
KERNEL_DEVICE_TYPES = frozenset({"cuda"})


class Fp8TensorwiseCodec(KitchenKernelCodec):
    spec = FormatSpec(
        name="fp8",
        description="W8A8 FP8 e4m3, per-tensor weight scale, per-tensor activation scale",
        layout=LAYOUT, weight_bits=8, activation="fp8 e4m3 per-tensor (dynamic or stored input_scale)",
        native_format="float8_e4m3fn", stock_loadable=True, in_features_multiple=16, out_features_multiple=16,
        min_sm=(8, 9),
    )

    def _quantize(self, weight, *, seed):
        scale = weight.abs().amax().clamp(min=1e-12) / torch.finfo(FP8).max
        if seed > 0:
            import comfy_kitchen as ck
            generator = torch.Generator(device=weight.device).manual_seed(int(seed))
            noise = torch.randint(0, 256, weight.shape, generator=generator, device=weight.device, dtype=torch.uint8)
            qdata = ck.stochastic_rounding_fp8(weight / scale, noise, FP8)
            params = TensorCoreFP8Layout.Params(scale=scale.float(), orig_dtype=weight.dtype, orig_shape=tuple(weight.shape))
            return qdata, params
        return TensorCoreFP8Layout.quantize(weight, scale=scale, dtype=FP8)

    kernel_layouts = WEIGHT_LAYOUTS

    def _call_problem(self, x, input_scale) -> str | None:
        if input_scale is not None:
            return "the layer has a static input_scale (kept, as stock ComfyUI uses it)"
        if x.device.type not in KERNEL_DEVICE_TYPES:
            return f"inputs on {x.device.type} keep kitchen's per-tensor activation scale"
        return None

    def _weight_problem(self, x, qdata, p) -> str | None:
        if qdata.dtype != FP8 or qdata.shape[1] != x.shape[-1]:
            return f"weight {qdata.dtype} {tuple(qdata.shape)} does not fit an input of {x.shape[-1]} features"
        if not isinstance(p.scale, torch.Tensor) or p.scale.numel() != 1:
            return "the weight scale is not one fp32 value"
        return None

    def _kernel_linear(self, x, weight, bias):
        """``x @ W.T + bias`` in ``x``'s dtype; see the module docstring for which kernel runs."""
        return fp8_rowwise_linear(x, weight._qdata, weight._params.scale, bias, out_dtype=x.dtype)

    def _kitchen_linear(self, x, weight, bias, input_scale):
        return _kitchen_linear(x, weight, bias, input_scale)

    def may_be_plain_w8a8(self, values, tensor_fields):
        return True

    def plain_w8a8(self, x, weight):
        if self._kernel_problem(x, weight) is not None:
            return None
        return "fp8_rowwise", weight._qdata, weight._params.scale

    def from_state_dict(self, layer, tensors, conf, compute_dtype=torch.bfloat16):
        weight = require(layer, tensors, "weight", self.spec.name)
        if weight.dtype == torch.uint8:  # legacy files store the fp8 bytes as uint8
            weight = weight.view(FP8)
        check_matrix(layer, weight, self.spec.name, (FP8,))
        scale = require(layer, tensors, "weight_scale", self.spec.name).float()
        check_numel(layer, scale, self.spec.name, "weight_scale", (1,))
        params = TensorCoreFP8Layout.Params(scale=scale.reshape(()), orig_dtype=compute_dtype, orig_shape=tuple(weight.shape))
        return QuantizedTensor(weight, LAYOUT, params)


def _kitchen_linear(x: torch.Tensor, weight: QuantizedTensor, bias: torch.Tensor | None,
                    input_scale: torch.Tensor | None) -> torch.Tensor:
    """The activation quantized per tensor (to ``input_scale``, else its abs-max), kitchen's FP8 linear."""
    x2d = x.reshape(-1, x.shape[-1])
    scale = input_scale if input_scale is not None else x2d.abs().amax().float().clamp(min=1e-12) / torch.finfo(FP8).max
    # kitchen's class itself, not the registry name: ComfyUI re-registers that name with a subclass
    qdata, params = TensorCoreFP8Layout.quantize(x2d, scale=scale.to(device=x.device, dtype=torch.float32), dtype=FP8)
    qx = QuantizedTensor(qdata, LAYOUT, params)
    if bias is not None and x.dtype == torch.float32:
        # torch._scaled_mm takes no bias with an fp32 output (a ValueError kitchen does not catch)
        out = torch.nn.functional.linear(qx, weight) + bias.to(torch.float32)
    else:
        out = torch.nn.functional.linear(qx, weight, bias)
    return out.reshape(*x.shape[:-1], out.shape[-1])


FP8_TENSORWISE = Fp8TensorwiseCodec()
