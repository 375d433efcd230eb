"""Test-only ComfyUI nodes for LowBit's end-to-end tests; never shipped with the pack.

``LowBitTestConditioning`` (why it exists): the tiny Flux model gets its conditioning from the stock ``LotusConditioning`` node
(no inputs, a fixed ``[1, 2, 1024]`` text embedding, no pooled output: Flux substitutes zeros for a
missing pooled vector). SD3 reads ``pooled_output`` unconditionally, and every stock node that makes
one needs a real CLIP file (hundreds of MB), so the SD3 tests use this node instead: a seeded random
text embedding plus pooled vector of the widths the tiny model was built with.

``LowBitTestModelDigest``: see its docstring.
"""

import torch


class LowBitTestConditioning:
    CATEGORY = "LowBit/testing"
    FUNCTION = "make"
    RETURN_TYPES = ("CONDITIONING",)
    DESCRIPTION = "Seeded random text embedding [1, tokens, width] with a pooled vector [1, pooled_width]."

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "tokens": ("INT", {"default": 4, "min": 1, "max": 512}),
            "width": ("INT", {"default": 64, "min": 1, "max": 8192}),
            "pooled_width": ("INT", {"default": 32, "min": 0, "max": 8192}),
            "seed": ("INT", {"default": 0, "min": 0, "max": 2**31 - 1}),
        }}

    def make(self, tokens, width, pooled_width, seed):
        gen = torch.Generator().manual_seed(seed)
        context = torch.randn(1, tokens, width, generator=gen)
        extra = {"pooled_output": torch.randn(1, pooled_width, generator=gen)} if pooled_width else {}
        return ([[context, extra]],)


NODE_CLASS_MAPPINGS = {"LowBitTestConditioning": LowBitTestConditioning}


class LowBitTestModelDigest:
    """A MODEL's weights (dtype and a float64 checksum of each parameter, dequantized) and, for the
    tiny Flux, the diffusion model's output on a fixed random input, as JSON UI text: lets a test
    compare two models the server holds without reading its memory."""

    CATEGORY = "LowBit/testing"
    FUNCTION = "digest"
    RETURN_TYPES = ()
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "flux_forward": ("BOOLEAN", {"default": False})}}

    def digest(self, model, flux_forward):
        import json

        import comfy.model_management

        weights = {}
        for name, module in model.model.diffusion_model.named_modules():
            for pname, param in module._parameters.items():
                if param is not None:
                    value = param.dequantize() if hasattr(param, "dequantize") else param
                    weights[f"{name}.{pname}"] = [str(param.dtype), float(value.double().sum())]
        out = {"weights": weights, "manual_cast": str(getattr(model.model, "manual_cast_dtype", None))}
        if flux_forward:
            comfy.model_management.load_models_gpu([model])
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(1, 16, 8, 8, generator=gen)
            context = torch.randn(1, 2, 1024, generator=gen)
            with torch.no_grad():
                y = model.model.diffusion_model(x, torch.tensor([0.5]), context, guidance=torch.tensor([3.5]))
            out["forward"] = y.double().flatten().tolist()
        return {"ui": {"text": [json.dumps(out)]}}


NODE_CLASS_MAPPINGS["LowBitTestModelDigest"] = LowBitTestModelDigest
