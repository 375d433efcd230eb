"""Reading back what the server wrote (latents, saved checkpoints) and comparing it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from comfy_server import ComfyServer, PromptResult
from lowbit.quant.native import COMFY_QUANT, decode_comfy_quant, load_layer


def sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    """``10 log10(|ref|^2 / |ref - other|^2)`` in float64; ``inf`` when equal."""
    reference, other = reference.double(), other.double()
    noise = (reference - other).pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(reference.pow(2).sum() / noise))


def saved_latent(server: ComfyServer, result: PromptResult, node_id: str) -> torch.Tensor:
    """The latent a stock ``SaveLatent`` node wrote in ``result``."""
    entries = result.outputs[node_id]["latents"]
    assert len(entries) == 1, entries
    return load_file(str(server.output_file(entries[0])))["latent_tensor"].float()


def saved_model_path(server: ComfyServer, result: PromptResult, node_id: str) -> Path:
    """The file Save Quantized Model (LowBit) reported in ``result``."""
    entries = result.outputs[node_id]["models"]
    assert len(entries) == 1, entries
    path = server.output_file(entries[0])
    assert path.is_file(), f"{path} was reported but does not exist"
    return path


def file_metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}


def dequantized_weights(path: Path) -> dict[str, tuple[str, torch.Tensor]]:
    """``layer -> (native format, float32 weight)`` for every quantized layer of a native checkpoint."""
    tensors = load_file(str(path))
    out = {}
    for key, value in tensors.items():
        if not key.endswith("." + COMFY_QUANT):
            continue
        layer = key[: -len(COMFY_QUANT) - 1]
        conf = decode_comfy_quant(layer, value)
        entries = {k[len(layer) + 1:]: v for k, v in tensors.items()
                   if k.startswith(layer + ".") and k != key and "." not in k[len(layer) + 1:]}
        codec, qt = load_layer(layer, entries, conf, compute_dtype=torch.float32)
        out[layer] = (codec.spec.name, qt.dequantize().float())
    return out


def workflow_from_metadata(metadata: dict[str, str]) -> tuple[dict, dict | None]:
    """The API prompt and the UI workflow stored in a saved file's metadata."""
    prompt = json.loads(metadata["prompt"]) if metadata.get("prompt") else {}
    workflow = json.loads(metadata["workflow"]) if "workflow" in metadata else None
    return prompt, workflow


def report_formats(report: str) -> dict[str, str]:
    """``layer -> format`` from the markdown table of Quantization Report (LowBit)."""
    rows = {}
    for line in report.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) >= 2 and cells[0] != "layer":
            rows[cells[0]] = cells[1]
    return rows


def planned_formats(state_dict, mode: str) -> dict[str, str]:
    """``layer -> format`` LowBit's policy plans for a float state dict (preset detected from its keys)."""
    from lowbit.quant.policy import Policy

    plan = Policy(mode=mode).plan({k: tuple(v.shape) for k, v in state_dict.items()})
    return {d.name: d.format for d in plan.quantized}
