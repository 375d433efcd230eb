"""API-format ComfyUI workflows for the end-to-end tests, built with a tiny graph builder.

An API-format workflow maps node ids to ``{"class_type": ..., "inputs": {...}}``; an input that comes
from another node is ``[node_id, output_index]``. :class:`Graph` hands out ids and those references,
so a workflow reads top to bottom like the UI graph it stands for.
"""

from __future__ import annotations

from typing import Any

#: stock KSampler settings that keep a CPU run short: 2 Euler steps on an 8x8 latent (16 Flux/SD3 tokens)
SAMPLER = {"steps": 2, "cfg": 1.0, "sampler_name": "euler", "scheduler": "simple", "denoise": 1.0}
LATENT_SIZE = 64  # pixels; the latent is 8x8 (ComfyUI latents are 1/8 of the image size)


class Graph:
    """Builds an API-format workflow."""

    def __init__(self):
        self.nodes: dict[str, dict[str, Any]] = {}

    def add(self, class_type: str, **inputs) -> "Node":
        node_id = str(len(self.nodes) + 1)
        self.nodes[node_id] = {"class_type": class_type, "inputs": dict(inputs)}
        return Node(node_id)

    def api(self) -> dict[str, dict[str, Any]]:
        return {k: {"class_type": v["class_type"], "inputs": dict(v["inputs"])} for k, v in self.nodes.items()}


class Node:
    def __init__(self, node_id: str):
        self.id = node_id

    def out(self, index: int = 0) -> list:
        return [self.id, index]


# ---- building blocks --------------------------------------------------------------------------

def flux_conditioning(g: Graph) -> list:
    """A CONDITIONING for the tiny Flux without a text encoder: stock ``LotusConditioning``."""
    return g.add("LotusConditioning").out()


def sd3_conditioning(g: Graph, width: int, pooled_width: int) -> list:
    """SD3 needs a pooled vector no stock node makes without CLIP: the test-only node."""
    return g.add("LowBitTestConditioning", tokens=4, width=width, pooled_width=pooled_width, seed=0).out()


def sample_and_save(g: Graph, model: list, conditioning: list, prefix: str, *, seed: int = 42,
                    latent_node: str = "EmptySD3LatentImage") -> Node:
    """KSampler (2 steps) on an empty 16-channel latent, then stock ``SaveLatent`` under ``prefix``."""
    latent = g.add(latent_node, width=LATENT_SIZE, height=LATENT_SIZE, batch_size=1)
    sampled = g.add("KSampler", model=model, positive=conditioning, negative=conditioning,
                    latent_image=latent.out(), seed=seed, **SAMPLER)
    return g.add("SaveLatent", samples=sampled.out(), filename_prefix=f"latents/{prefix}")


def unet_loader(g: Graph, name: str) -> list:
    return g.add("UNETLoader", unet_name=name, weight_dtype="default").out()


# ---- the LowBit nodes, as the tests use them ---------------------------------------------------

def quantize(g: Graph, model: list, mode: str, **options) -> list:
    return g.add("LowBitQuantizeModel", model=model, mode=mode, **options).out()


def lowbit_loader(g: Graph, name: str, mode: str, **options) -> list:
    return g.add("LowBitLoadDiffusionModel", unet_name=name, mode=mode, **options).out()


def attention_backend(g: Graph, model: list, backend: str, **options) -> list:
    return g.add("LowBitAttentionBackend", model=model, backend=backend, **options).out()


def kernel_tuner(g: Graph, model: list, tokens: str = "16", remeasure: bool = False) -> Node:
    return g.add("LowBitKernelTuner", model=model, tokens=tokens, remeasure=remeasure)


def save_quantized(g: Graph, model: list, prefix: str) -> Node:
    return g.add("LowBitSaveQuantizedModel", model=model, filename_prefix=f"diffusion_models/{prefix}")


def report(g: Graph, model: list, measure_error: bool = False) -> Node:
    return g.add("LowBitQuantizationReport", model=model, measure_error=measure_error)
