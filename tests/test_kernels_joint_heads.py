"""The joint q/k/v kernel (``kernels/triton_joint_heads.py``) against its pure-torch definition.

On the CPU (Triton interpreter) bf16 and fp16 outputs are bit-identical to ``joint_qkv_reference`` and fp32 ones
within the reduction order's rounding; with ``LOWBIT_TEST_DEVICE=cuda`` the compiled kernel runs on the GPU and
may sit one rounding step away where the hardware's reciprocal square root differs. Ragged stream lengths, head
counts off the kernel's head groups, broadcast and longer rotary tables, and poisoned outputs (every row of a
stream written, no row of another) are covered.
"""

from __future__ import annotations

import os

from kernels_helpers import needs_triton_interpreter, randn

import pytest
import torch

from lowbit.kernels.joint_heads import JointPart, joint_qkv, kernel_problem
from lowbit.kernels.reference import joint_qkv_reference, rope_reference

ON_CUDA = os.environ.get("LOWBIT_TEST_DEVICE", "cpu").startswith("cuda") and torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_CUDA else "cpu")
pytestmark = [] if ON_CUDA else needs_triton_interpreter()


def _part(batch, seq, heads, d, dtype, seed, weights=(True, False)):
    q, k, v = (randn(batch, seq, heads * d, seed=seed + i, scale=3.0, dtype=dtype).to(DEVICE) for i in range(3))
    qw, kw = ((randn(d, seed=seed + 10 + i, dtype=torch.float32).abs() + 0.5).to(dtype).to(DEVICE) if w else None
              for i, w in enumerate(weights))
    return JointPart(q, k, v, q_weight=qw, k_weight=kw, q_eps=1e-6, k_eps=1e-5)


def _freqs(batch, seq, d, dtype, seed):
    return randn(batch, 1, seq, d // 2, 2, 2, seed=seed, dtype=dtype).to(DEVICE)


def _assert_matches(out, ref, dtype):
    for name, o, r in zip("qkv", out, ref):
        assert o.shape == r.shape and o.dtype == r.dtype and o.is_contiguous(), name
        assert torch.isfinite(o).all(), name
        if name == "v" or (dtype != torch.float32 and not ON_CUDA):
            assert torch.equal(o, r), name  # v is a copy; bf16/fp16 round the same fp32 values
        else:
            # a rounding step of the row's largest value: the rotation mixes a pair's errors
            step = torch.finfo(dtype).eps * r.float().abs().amax(-1, keepdim=True).clamp_min(1.0)
            assert ((o.float() - r.float()).abs() <= 4 * step).all(), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads,d,seqs", [(3, 32, (5, 21)), (10, 16, (17,)), (2, 128, (1, 33))])
def test_joint_qkv_matches_its_definition(dtype, heads, d, seqs):
    parts = tuple(_part(2, s, heads, d, dtype, seed=7 * i + heads) for i, s in enumerate(seqs))
    freqs = _freqs(1, sum(seqs), d, dtype, seed=heads)
    assert kernel_problem(parts, heads, freqs) is None
    _assert_matches(joint_qkv(parts, heads, freqs), joint_qkv_reference(parts, heads, freqs), dtype)


@pytest.mark.parametrize("freq_batch,extra_rows", [(2, 0), (1, 9), (2, 4)])
def test_rotary_tables_per_batch_and_longer_than_the_sequence(freq_batch, extra_rows):
    parts = (_part(2, 6, 4, 32, torch.bfloat16, seed=1, weights=(False, True)), _part(2, 11, 4, 32, torch.bfloat16, 2))
    freqs = _freqs(freq_batch, 17 + extra_rows, 32, torch.float32, seed=3)  # fp32 tables, as ComfyUI may hand over
    _assert_matches(joint_qkv(parts, 4, freqs), joint_qkv_reference(parts, 4, freqs), torch.bfloat16)


def test_without_norms_or_rotation_it_joins_the_heads():
    base = _part(1, 9, 2, 16, torch.float32, seed=5)
    part = JointPart(base.q, base.k, base.v, q_norm=False, k_norm=False)
    q, k, v = joint_qkv((part,), 2, None)
    for t, src in ((q, base.q), (k, base.k), (v, base.v)):
        assert torch.equal(t, src.view(1, 9, 2, 16).transpose(1, 2))


def test_every_row_of_a_stream_is_written_and_no_other():
    from lowbit.kernels.triton_joint_heads import joint_qkv_part_triton

    heads, d = 9, 32  # two head groups, the second short
    part = _part(2, 19, heads, d, torch.bfloat16, seed=11)  # 19 rows: a ragged second block
    freqs = _freqs(1, 30, d, torch.bfloat16, seed=12)
    outs = [torch.full((2, heads, 30, d), float("nan"), dtype=torch.bfloat16, device=DEVICE) for _ in range(3)]
    joint_qkv_part_triton(part, 7, heads, freqs, *outs)  # rows 7..25 of the joint sequence
    ref = joint_qkv_reference((part,), heads, freqs[:, :, 7:26])  # the stream's own rows of the table
    for o, r in zip(outs, ref):
        assert torch.isnan(o[:, :, :7]).all() and torch.isnan(o[:, :, 26:]).all()
    _assert_matches(tuple(o[:, :, 7:26].contiguous() for o in outs), ref, torch.bfloat16)


def test_strided_projections_of_one_fused_linear():
    qkv = randn(2, 13, 3 * 64, seed=4, dtype=torch.bfloat16).to(DEVICE)  # q, k, v as column slices (row stride 192)
    part = JointPart(qkv[..., :64], qkv[..., 64:128], qkv[..., 128:], q_eps=1e-6, k_eps=1e-6)
    freqs = _freqs(1, 13, 32, torch.bfloat16, seed=5)
    assert kernel_problem((part,), 2, freqs) is None
    _assert_matches(joint_qkv((part,), 2, freqs), joint_qkv_reference((part,), 2, freqs), torch.bfloat16)


@pytest.mark.parametrize("case", ["head size 24", "freqs too short", "freqs of another layout", "odd dtype",
                                  "mismatched v"])
def test_inputs_the_kernel_does_not_take_run_the_definition(case):
    heads, d = 2, 32
    part, freqs = _part(1, 8, heads, d, torch.bfloat16, seed=2), _freqs(1, 8, d, torch.bfloat16, seed=3)
    if case == "head size 24":
        part, freqs = _part(1, 8, heads, 24, torch.bfloat16, seed=2), _freqs(1, 8, 24, torch.bfloat16, seed=3)
    elif case == "freqs too short":
        freqs = freqs[:, :, :5]
    elif case == "freqs of another layout":
        freqs = freqs.transpose(-1, -2)
    elif case == "odd dtype":
        part = JointPart(*(t.double() for t in (part.q, part.k, part.v)), q_weight=None, k_weight=None)
        freqs = freqs.double()
    else:
        part = JointPart(part.q, part.k, part.v[:, :5], q_weight=part.q_weight)
    assert kernel_problem((part,), heads, freqs) is not None
    if case == "freqs too short":
        with pytest.raises(RuntimeError):  # as ComfyUI's own rotation raises
            joint_qkv((part,), heads, freqs)
        return
    _assert_matches(joint_qkv((part,), heads, freqs), joint_qkv_reference((part,), heads, freqs),
                    part.q.dtype if part.q.dtype != torch.float64 else torch.float32)


def test_rope_reference_is_comfyuis_rotation():
    import importlib

    x = randn(1, 2, 6, 16, seed=8)
    freqs = randn(1, 1, 6, 8, 2, 2, seed=9)
    try:
        comfy_rope = importlib.import_module("comfy.ldm.flux.math")._apply_rope1
    except Exception:  # no ComfyUI here: its formula, written out
        pairs = x.reshape(1, 2, 6, 8, 1, 2)
        want = (freqs[..., 0] * pairs[..., 0] + freqs[..., 1] * pairs[..., 1]).reshape(x.shape)
    else:
        want = comfy_rope(x, freqs)
    assert torch.allclose(rope_reference(x, freqs), want, atol=1e-6)
