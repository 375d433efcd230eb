"""Test-only ComfyUI node for LowBit's end-to-end tests; never shipped with the pack.

Why it exists: the tiny Flux model gets its conditioning from the stock ``LotusConditioning`` node
(no inputs, a fixed ``[1, 2, 1024]`` text embedding, no pooled output: Flux substitutes zeros for a
missing pooled vector). SD3 reads ``pooled_output`` unconditionally, and every stock node that makes
one needs a real CLIP file (hundreds of MB), so the SD3 tests use this node instead: a seeded random
text embedding plus pooled vector of the widths the tiny model was built with.
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
