"""Kernel Tuner (LowBit): measure the kernel choices for the model's own layer shapes, keep them, show them.

The kernel dispatcher (``kernels/dispatch.py``) times its candidates – our Triton GEMMs (one per tile
configuration), ``torch._int_mm`` / ``_scaled_mm``, comfy-kitchen's op, dequantize + float matmul –
the first time a (format, GPU, token bucket, N, K) is seen, and keeps the winner in ComfyUI's user
directory (``user/lowbit/kernel_dispatch.json``). Left alone, that happens during the first sampling
step. This node does it up front, for every distinct (format, N, K) among the model's quantized
layers and every token count asked for:

* it runs one layer of that shape, LowBit's own forward, on a random input of M rows, so the
  dispatcher measures and records the choice (``remeasure``: the choice on record is dropped first);
* on a CUDA device it then times that layer and bf16 ``F.linear`` of the same shape, in GPU time
  (the calls queued ahead, so the CPU's launch cost, which a CUDA graph or a busy GPU hides, does
  not count), and shows a table with the choice and the ratio.

Token counts are rows of the activation. For Flux- and SD3-class models an image has
``(width / 16) * (height / 16)`` image tokens (1024² → 4096) and the text stream adds its own
(Flux: 256 or 512), and the dispatcher decides per power-of-two bucket of M (4096 + 512 = 4608 →
8192). On the CPU nothing is measured: the table lists what runs (the dispatcher's default order).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from comfy_api.latest import io, ui

from . import CATEGORY
from .common import NodeInputError, progress_bar

DEFAULT_TOKENS = "256, 1024, 4096"
MAX_TOKENS = 65536


@dataclass(frozen=True)
class TuneRow:
    format: str
    n: int
    k: int
    layers: int  # how many of the model's layers have this format and shape
    m: int
    key: str | None  # the dispatcher's key (None: the call did not go through the dispatcher)
    choice: str | None
    ours_us: float | None = None  # GPU µs per call on CUDA (None on the CPU)
    bf16_us: float | None = None

    @property
    def speedup(self) -> float | None:
        return self.bf16_us / self.ours_us if self.ours_us and self.bf16_us else None


def parse_tokens(text: str) -> list[int]:
    """``"256, 1024 4096"`` → ``[256, 1024, 4096]`` (each 1 to 65536, duplicates dropped, in order)."""
    parts = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    if not parts:
        raise NodeInputError(f"tokens: give at least one token count, e.g. {DEFAULT_TOKENS!r}")
    values = []
    for part in parts:
        if not part.isdigit() or not 1 <= int(part) <= MAX_TOKENS:
            raise NodeInputError(f"tokens: {part!r} is not a whole number from 1 to {MAX_TOKENS} "
                                 f"(expected a list like {DEFAULT_TOKENS!r})")
        if int(part) not in values:
            values.append(int(part))
    return values


def layer_groups(model_patcher) -> list[tuple[str, str, int, int, int]]:
    """``(format, first layer name, N, K, layer count)`` per distinct (format, N, K), largest first."""
    from .model_quant import quantized_layers

    groups: dict[tuple[str, int, int], list[str]] = {}
    for name, fmt, weight in quantized_layers(model_patcher):
        n, k = (int(d) for d in weight.shape)
        groups.setdefault((fmt, n, k), []).append(name)
    ordered = sorted(groups.items(), key=lambda item: (-item[0][1] * item[0][2], item[0]))
    return [(fmt, names[0], n, k, len(names)) for (fmt, n, k), names in ordered]


def tune(model_patcher, tokens: list[int], *, remeasure: bool = False, progress=None) -> list[TuneRow]:
    """Run each (format, N, K) group's first layer at each token count (see the module docstring)."""
    import comfy.model_management

    from ..kernels.dispatch import current_dispatcher, gpu_time_us, m_bucket
    from .model_quant import diffusion_model_of

    groups = layer_groups(model_patcher)
    if not groups:
        raise NodeInputError("the model has no quantized layers LowBit runs: connect the MODEL output of Quantize "
                             "Model (LowBit), Quantize with Policy (LowBit) or Load Diffusion Model (LowBit)")
    comfy.model_management.load_models_gpu([model_patcher])
    device = model_patcher.load_device
    dm = diffusion_model_of(model_patcher)
    dispatcher = current_dispatcher()
    rows, total, done = [], len(groups) * len(tokens), 0
    for fmt, name, n, k, count in groups:
        module = dm.get_submodule(name)
        weight = module._parameters["weight"]
        dtype = getattr(getattr(weight, "_params", None), "orig_dtype", None) or torch.bfloat16
        w = bias = None
        if device.type == "cuda":  # the bf16 layer of the same shape, once per group
            w = torch.randn(n, k, device=device, dtype=dtype) / k**0.5
            bias = torch.zeros(n, device=device, dtype=dtype) if module.bias is not None else None
        for m in tokens:
            # made where it runs, in its dtype (no fp32 copy on the host: 65536 x 15360 would be 4 GB)
            x = torch.randn(m, k, generator=torch.Generator(device=device).manual_seed(m), device=device, dtype=dtype)
            if remeasure:
                suffix = f"|m{m_bucket(m)}|n{n}|k{k}"
                for key in [key for key in dispatcher.decisions if key.endswith(suffix)]:
                    dispatcher.decisions.pop(key)
            dispatcher.forget_fast_plans()  # the call below takes the full path, which records its choice
            dispatcher.last_choice = None
            with torch.no_grad():
                module(x)
                key, choice = dispatcher.last_choice or (None, None)
                ours = bf16 = None
                if w is not None:
                    ours = gpu_time_us(lambda: module(x))
                    bf16 = gpu_time_us(lambda: torch.nn.functional.linear(x, w, bias))
            rows.append(TuneRow(fmt, n, k, count, m, key, choice, ours, bf16))
            done += 1
            if progress is not None:
                progress(done, total)
    dispatcher.save()
    return rows


def format_table(rows: list[TuneRow], device: str, cache_path: str | None) -> str:
    measured = any(r.ours_us is not None for r in rows)
    kept = f", kept in `{cache_path}`" if cache_path else ", not kept (no cache file)"
    lines = [f"**Kernel choices on {device}**{kept}", ""]
    if not measured:
        lines += ["Nothing is measured off a CUDA GPU: each shape runs the dispatcher's default implementation.", ""]
    head = "| format | N x K | layers | tokens (bucket) | implementation |"
    rule = "|---|---|---:|---|---|"
    if measured:
        head += " LowBit GPU µs | bf16 GPU µs | x bf16 |"
        rule += "---:|---:|---:|"
    lines += [head, rule]
    from ..kernels.dispatch import m_bucket

    for r in rows:
        choice = r.choice or "not dispatched (comfy-kitchen's own path)"
        line = f"| {r.format} | {r.n} x {r.k} | {r.layers} | {r.m} ({m_bucket(r.m)}) | {choice} |"
        if measured:
            line += (f" {r.ours_us:.1f} | {r.bf16_us:.1f} | {r.speedup:.2f} |" if r.speedup is not None
                     else " – | – | – |")
        lines.append(line)
    return "\n".join(lines)


class LowBitKernelTuner(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowBitKernelTuner",
            display_name="Kernel Tuner (LowBit)",
            category=CATEGORY,
            description="Measure which kernel runs each of the model's quantized layer shapes fastest on this GPU, "
                        "for the token counts you sample at, and keep the choices (ComfyUI's user directory) so "
                        "sampling starts with them. Shows each choice and its speed against bf16. The model passes "
                        "through unchanged.",
            inputs=[
                io.Model.Input("model", tooltip="A quantized model (Quantize Model, Quantize with Policy or Load "
                               "Diffusion Model, LowBit)."),
                io.String.Input("tokens", default=DEFAULT_TOKENS,
                                tooltip="Token counts (activation rows) to tune for, comma-separated. Flux / SD3: "
                                "(width/16)*(height/16) image tokens (1024x1024: 4096), plus the text stream's "
                                "(Flux: 256 or 512; Qwen-Image: the prompt's own token count). Choices are kept per "
                                "power-of-two bucket. The per-block modulation linears see one row per image in "
                                "the batch: add 1 to tune them too."),
                io.Boolean.Input("remeasure", default=False,
                                 tooltip="Drop the choices on record for these shapes and measure them again (after "
                                 "a driver, Triton or LowBit update, or if the GPU was busy the first time)."),
            ],
            outputs=[io.Model.Output("model", tooltip="The same model."),
                     io.String.Output("table", tooltip="The choices as a markdown table.")],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, model, tokens: str, remeasure: bool) -> io.NodeOutput:
        from ..kernels.dispatch import current_dispatcher

        counts = parse_tokens(tokens)
        rows = tune(model, counts, remeasure=remeasure, progress=progress_bar("Kernel Tuner"))
        device = model.load_device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        cache = current_dispatcher().cache_path
        table = format_table(rows, name, str(cache) if cache is not None else None)
        return io.NodeOutput(model, table, ui=ui.PreviewText(table))
