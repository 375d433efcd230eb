"""ComfyUI-LowBit: quantize diffusion models to INT8 / FP8 / 4-bit and run them fast.

As a ComfyUI custom node folder, ComfyUI imports this file and calls :func:`comfy_entrypoint`.
As the Python package ``lowbit`` (``pip install -e .``), importing it does not need ComfyUI.
"""

__version__ = "0.1.0"


async def comfy_entrypoint():
    """ComfyUI V3 entry point: returns the extension that lists LowBit's nodes."""
    from .nodes import LowBitExtension

    return LowBitExtension()
