"""Attention candidates at diffusion-transformer shapes: speed against bf16 SDPA, error against fp32.

Not a pytest file. On a CUDA machine::

    python tests/gpu/bench_attention.py --out attention.json

For each shape (batch, heads, tokens, head_dim) it times, with ``triton.testing.do_bench`` medians
in one process: PyTorch SDPA with its default backend choice and with each backend forced, and
the lossy candidates of ``lowbit.kernels.attention`` (comfy-kitchen's INT8 attention, where installed). Errors are relative L2 against an
fp32 SDPA on the same inputs, on two data sets: plain ``randn`` and "dit-like" Q/K (per-channel
log-normal scales, as RMSNorm weights give, and a shared key offset, which is softmax-invariant but
widens K's range).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger("bench_attention")

SHAPES = {
    "flux_1024": (1, 24, 4608, 128),
    "flux_512": (1, 24, 1280, 128),
    "wan_480p": (1, 40, 32760, 128),
}


def make_inputs(shape, kind: str, device, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    b, h, s, d = shape
    q, k, v = (torch.randn(shape, generator=gen, device=device) for _ in range(3))
    if kind == "dit":
        q_scale = torch.exp(0.7 * torch.randn(1, h, 1, d, generator=gen, device=device))
        k_scale = torch.exp(0.7 * torch.randn(1, h, 1, d, generator=gen, device=device))
        q = q * q_scale
        k = k * k_scale + 2.0 * torch.randn(1, h, 1, d, generator=gen, device=device)
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def reference(q, k, v):
    out = torch.empty_like(q, dtype=torch.float32)
    for i in range(q.shape[1]):  # one head at a time keeps the fp32 score matrix small
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            out[:, i:i + 1] = F.scaled_dot_product_attention(q[:, i:i + 1].float(), k[:, i:i + 1].float(),
                                                             v[:, i:i + 1].float())
    return out


def rel_err(test, ref) -> float:
    return float((test.float() - ref).norm() / ref.norm())


def sdpa_candidates():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def forced(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v)
        return run

    return {
        "sdpa_default": lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
        "sdpa_flash": forced(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": forced(SDPBackend.CUDNN_ATTENTION),
        "sdpa_efficient": forced(SDPBackend.EFFICIENT_ATTENTION),
    }


def lowbit_candidates():
    try:
        from lowbit.kernels import attention
    except ImportError as err:  # the module may not exist in older trees
        log.warning("lowbit.kernels.attention unavailable: %s", err)
        return {}
    return {f"lowbit_{name}": fn for name, fn in attention.candidates().items() if name not in attention.SDPA_BACKENDS}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["flux_1024", "flux_512", "wan_480p"], choices=sorted(SHAPES))
    parser.add_argument("--compile-check", action="store_true",
                        help="also trace each LowBit candidate with torch.compile(fullgraph=True)")
    parser.add_argument("--out", default="bench_attention.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import triton.testing

    device = torch.device("cuda")
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device), "shapes": {}}
    candidates = {**sdpa_candidates(), **lowbit_candidates()}
    for name in args.shapes:
        shape = SHAPES[name]
        b, h, s, d = shape
        flops = 4 * b * h * s * s * d
        row = report["shapes"][name] = {"shape": shape, "candidates": {}}
        data = {kind: make_inputs(shape, kind, device) for kind in ("randn", "dit")}
        refs = {kind: reference(*data[kind]) for kind in data} if s <= 8192 else {}
        base = None
        for cname, fn in candidates.items():
            entry = row["candidates"][cname] = {}
            try:
                q, k, v = data["randn"]
                ms = triton.testing.do_bench(lambda: fn(q, k, v), warmup=50, rep=300, return_mode="median")
                entry["ms"] = ms
                entry["tflops"] = flops / ms / 1e9
                if cname == "sdpa_default":
                    base = ms
                entry["speed_vs_sdpa_default"] = base / ms if base else None
                for kind, ref in refs.items():
                    entry[f"rel_err_{kind}"] = rel_err(fn(*data[kind]), ref)
                if args.compile_check and cname.startswith("lowbit_"):
                    torch._dynamo.reset()
                    compiled = torch.compile(fn, fullgraph=True)
                    entry["compiled_matches_eager"] = bool(
                        rel_err(compiled(q, k, v), fn(q, k, v).float()) < 1e-3)
            except Exception as err:  # a candidate that cannot run here is reported, not fatal
                entry["error"] = f"{type(err).__name__}: {err}"[:400]
            log.info("%s %s %s", name, cname, json.dumps(entry))
        Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
