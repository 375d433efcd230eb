"""The example workflows shipped in ``docs/workflows/``: built here as API graphs, written in UI format.

Run ``python tests/e2e/docs_workflows.py`` to regenerate the JSON files: it starts a headless
ComfyUI (``$COMFYUI_PATH`` or ``~/ComfyUI``) to read ``/object_info``, which decides sockets, widget
order and defaults. ``test_docs_workflows.py`` checks the committed files load against the real
server's node set and match what this module generates.

The graphs are the real thing a user runs (Flux.1-dev with its usual text encoders and VAE, by
their usual file names); the tiny-model e2e tests run the same LowBit wiring.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

from e2e_workflows import Graph
from ui_workflow import api_to_ui

DOCS_DIR = Path(__file__).resolve().parents[2] / "docs" / "workflows"
FLUX_FILE = "flux1-dev.safetensors"
PROMPT = "a red fox in fresh snow, morning light, photograph"


def _flux_sampling(g: Graph, model: list, image_prefix: str) -> None:
    """Text encoders, empty latent, KSampler, VAE decode and SaveImage around ``model``."""
    clip = g.add("DualCLIPLoader", clip_name1="clip_l.safetensors", clip_name2="t5xxl_fp16.safetensors",
                 type="flux").out()
    text = g.add("CLIPTextEncode", clip=clip, text=PROMPT).out()
    positive = g.add("FluxGuidance", conditioning=text, guidance=3.5).out()
    negative = g.add("ConditioningZeroOut", conditioning=text).out()
    latent = g.add("EmptySD3LatentImage", width=1024, height=1024, batch_size=1).out()
    sampled = g.add("KSampler", model=model, positive=positive, negative=negative, latent_image=latent, seed=0,
                    steps=20, cfg=1.0, sampler_name="euler", scheduler="simple", denoise=1.0).out()
    vae = g.add("VAELoader", vae_name="ae.safetensors").out()
    image = g.add("VAEDecode", samples=sampled, vae=vae).out()
    g.add("SaveImage", images=image, filename_prefix=image_prefix)


def quantize_in_memory() -> Graph:
    """Stock loader, then Quantize Model (LowBit): any checkpoint, quantized when the workflow runs."""
    g = Graph()
    unet = g.add("UNETLoader", unet_name=FLUX_FILE, weight_dtype="default").out()
    model = g.add("LowBitQuantizeModel", model=unet, mode="int8_convrot").out()
    g.add("LowBitQuantizationReport", model=model, measure_error=False)
    _flux_sampling(g, model, "LowBit/int8_convrot")
    return g


def load_on_the_fly() -> Graph:
    """Load Diffusion Model (LowBit): quantizes layer by layer while loading (low peak memory)."""
    g = Graph()
    model = g.add("LowBitLoadDiffusionModel", unet_name=FLUX_FILE, mode="int4_mixed").out()
    _flux_sampling(g, model, "LowBit/int4_mixed")
    return g


def lora_quantize_save() -> Graph:
    """Bake a LoRA into the weights, quantize, and save a native checkpoint for later runs."""
    g = Graph()
    unet = g.add("UNETLoader", unet_name=FLUX_FILE, weight_dtype="default").out()
    lora = g.add("LoraLoaderModelOnly", model=unet, lora_name="my_flux_lora.safetensors", strength_model=1.0).out()
    model = g.add("LowBitQuantizeModel", model=lora, mode="int8_convrot").out()
    g.add("LowBitQuantizationReport", model=model, measure_error=True)
    g.add("LowBitSaveQuantizedModel", model=model, filename_prefix="diffusion_models/flux1-dev-my-lora-int8_convrot")
    return g


def load_saved_checkpoint() -> Graph:
    """Run a file written by Save Quantized Model: LowBit's loader reads every LowBit format."""
    g = Graph()
    model = g.add("LowBitLoadDiffusionModel", unet_name="flux1-dev-my-lora-int8_convrot_00001_.safetensors",
                  mode="native").out()
    _flux_sampling(g, model, "LowBit/saved")
    return g


def fast_sampling() -> Graph:
    """The speed path: a saved checkpoint, its kernel choices measured up front (Kernel Tuner), the
    fastest attention per shape, and the blocks compiled with CUDA graphs (reduce-overhead)."""
    g = Graph()
    model = g.add("LowBitLoadDiffusionModel", unet_name="flux1-dev-my-lora-int8_convrot_00001_.safetensors",
                  mode="native").out()
    # 1024x1024: 4096 image tokens, 512 text tokens, 4608 in the single blocks
    model = g.add("LowBitKernelTuner", model=model, tokens="512, 4096, 4608", remeasure=False).out()
    model = g.add("LowBitAttentionBackend", model=model, backend="auto").out()
    model = g.add("LowBitCompileQuantizedModel", model=model, backend="inductor", mode="reduce-overhead").out()
    _flux_sampling(g, model, "LowBit/fast")
    return g


WORKFLOWS: dict[str, Callable[[], Graph]] = {
    "quantize_in_memory": quantize_in_memory,
    "load_on_the_fly": load_on_the_fly,
    "lora_quantize_save": lora_quantize_save,
    "load_saved_checkpoint": load_saved_checkpoint,
    "fast_sampling": fast_sampling,
}


def render(object_info: dict) -> dict[str, str]:
    """File name -> JSON text of every docs workflow."""
    return {f"{name}.json": json.dumps(api_to_ui(build().api(), object_info), indent=1) + "\n"
            for name, build in WORKFLOWS.items()}


def main() -> int:
    import tempfile

    from comfy_server import ComfyServer, comfyui_path

    comfy_dir = comfyui_path()
    if comfy_dir is None:
        print("ComfyUI not found: set COMFYUI_PATH", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as tmp:
        server = ComfyServer(Path(tmp), comfy_dir, with_test_nodes=False).start()
        try:
            files = render(server.object_info())
        finally:
            server.stop()
    DOCS_DIR.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (DOCS_DIR / name).write_text(text, encoding="utf-8")
        print(f"wrote {DOCS_DIR / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
