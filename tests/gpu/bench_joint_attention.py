"""Qwen-Image's attention preparation: ComfyUI's ops against LowBit's one-pass q/k/v (``kernels/joint_heads.py``).

Usage (from the repository root)::

  python tests/gpu/bench_joint_attention.py --out r.json
  python tests/gpu/bench_joint_attention.py --device cpu --img 64 --txt 16 --heads 2   # CPU smoke (interpreter)

At Qwen-Image 20B's shapes (24 heads of 128, 4096 image and 256 text tokens, bf16, batch 1) it times, with
``triton.testing.do_bench`` (medians):

* ``prep``: from the six projections to q, k, v, as ComfyUI's ``Attention.forward`` computes them (views, the
  ``.contiguous`` copies, four ``RMSNorm`` modules, three ``torch.cat``, ComfyUI's ``apply_rope1`` on q and k),
  against :func:`joint_qkv` (two launches) and its pure-torch definition;
* ``attention``: the whole module (bf16 ``torch.nn`` linears, ComfyUI's attention) with ComfyUI's forward and with
  LowBit's fused one (``nodes/joint_attention.py``).

It reports the largest difference of the fused q, k, v from ComfyUI's, relative to each tensor's largest value,
and the bytes the fused kernel moves per call as GB/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_flux_step as bench  # noqa: E402


def _time(fn, device, reps: int) -> float:
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=reps, return_mode="median")) * 1e3  # µs
    import time

    times = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--img", type=int, default=4096)
    p.add_argument("--txt", type=int, default=256)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rep-ms", type=int, default=200)
    p.add_argument("--sweep", action="store_true",
                   help="also time the kernel at other token blocks, head groups and warp counts")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    bench.import_comfy(args.device)
    import comfy.ldm.qwen_image.model as qwen_model

    from lowbit.kernels.joint_heads import JointPart, joint_qkv
    from lowbit.kernels.reference import joint_qkv_reference
    from lowbit.nodes.comfy_ops import install_input_fusion
    from lowbit.nodes.joint_attention import FusedJointAttentionMixin

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    width, d = args.heads * args.head_dim, args.head_dim
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        attn = qwen_model.Attention(query_dim=width, dim_head=d, heads=args.heads, out_dim=width, bias=True, eps=1e-6,
                                    operations=torch.nn)
        for name, param in attn.named_parameters():
            param.copy_(torch.rand(d, generator=gen) + 0.5 if name.startswith("norm")
                        else torch.randn(param.shape, generator=gen) / (width ** 0.5 if param.dim() == 2 else 50))
    attn = attn.to(device=device, dtype=dtype).requires_grad_(False)
    img = torch.randn(1, args.img, width, generator=gen).to(device, dtype)
    txt = torch.randn(1, args.txt, width, generator=gen).to(device, dtype)
    total = args.img + args.txt
    angles = torch.rand(1, 1, total, d // 2, generator=gen) * 6.28
    cos, sin = angles.cos(), angles.sin()
    freqs = torch.stack([cos, -sin, sin, cos], dim=-1).reshape(1, 1, total, d // 2, 2, 2).to(device, dtype)
    with torch.no_grad():
        proj_img = [getattr(attn, n)(img) for n in ("to_q", "to_k", "to_v")]
        proj_txt = [getattr(attn, n)(txt) for n in ("add_q_proj", "add_k_proj", "add_v_proj")]
    parts = (JointPart(*proj_txt, q_weight=attn.norm_added_q.weight, k_weight=attn.norm_added_k.weight),
             JointPart(*proj_img, q_weight=attn.norm_q.weight, k_weight=attn.norm_k.weight))

    def comfy_prep():
        def heads(t):
            return t.view(1, t.shape[1], args.heads, -1).transpose(1, 2)

        q = torch.cat([attn.norm_added_q(heads(proj_txt[0]).contiguous()), attn.norm_q(heads(proj_img[0]).contiguous())], 2)
        k = torch.cat([attn.norm_added_k(heads(proj_txt[1]).contiguous()), attn.norm_k(heads(proj_img[1]).contiguous())], 2)
        v = torch.cat([heads(proj_txt[2]), heads(proj_img[2])], 2)
        return qwen_model.apply_rope1(q, freqs), qwen_model.apply_rope1(k, freqs), v

    with torch.no_grad():
        want, got = comfy_prep(), joint_qkv(parts, args.heads, freqs)
        diffs = {n: float((a.float() - b.float()).abs().max() / b.float().abs().max()) for n, a, b in zip("qkv", got, want)}
        rows = {"comfy_prep_us": _time(comfy_prep, device, args.rep_ms),
                "fused_prep_us": _time(lambda: joint_qkv(parts, args.heads, freqs), device, args.rep_ms),
                "reference_prep_us": _time(lambda: joint_qkv_reference(parts, args.heads, freqs), device, args.rep_ms)}
        moved = 2 * 3 * total * width * img.element_size() + freqs.numel() * freqs.element_size()
        rows["fused_prep_GBps"] = moved / (rows["fused_prep_us"] * 1e-6) / 1e9
        rows["comfy_attention_us"] = _time(lambda: attn(img, txt, None, image_rotary_emb=freqs), device, args.rep_ms)
        install_input_fusion(attn, {})
        assert isinstance(attn, FusedJointAttentionMixin)
        rows["fused_attention_us"] = _time(lambda: attn(img, txt, None, image_rotary_emb=freqs), device, args.rep_ms)
        if args.sweep:
            from lowbit.kernels import triton_joint_heads as kernel

            chosen = (kernel.BLOCK_S, kernel.HEADS_PER_PROGRAM, kernel.NUM_WARPS)
            rows["sweep"] = []
            for block in (8, 16, 32):
                for group in (2, 4, 8, 24):
                    for warps in (2, 4, 8):
                        kernel.BLOCK_S, kernel.HEADS_PER_PROGRAM, kernel.NUM_WARPS = block, group, warps
                        rows["sweep"].append({"block_s": block, "heads": group, "warps": warps,
                                              "us": _time(lambda: joint_qkv(parts, args.heads, freqs), device, 50)})
            kernel.BLOCK_S, kernel.HEADS_PER_PROGRAM, kernel.NUM_WARPS = chosen
            rows["sweep"].sort(key=lambda r: r["us"])
    rows["prep_speedup"] = rows["comfy_prep_us"] / rows["fused_prep_us"]
    rows["attention_speedup"] = rows["comfy_attention_us"] / rows["fused_attention_us"]
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "shape": vars(args), "max_rel_diff": diffs, **rows}
    print(json.dumps(report, indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
