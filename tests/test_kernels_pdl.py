"""Programmatic dependent launch (``kernels/pdl.py``): when a device uses it, and what the sm_90 code does.

The CPU interpreter never lowers a kernel, so the kernels are compiled for sm_90 offline (Triton's own
ptxas, no GPU) in a subprocess without ``TRITON_INTERPRET``: with ``PDL`` the GEMMs wait on
``griddepcontrol.wait`` before their K loop, before their first store, and the activation
quantization lets them start (``griddepcontrol.launch_dependents``) before its first load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lowbit.kernels import pdl


def test_no_pdl_off_the_gpu_before_sm90_or_when_switched_off(monkeypatch):
    assert not pdl.pdl_enabled(torch.device("cpu"))
    assert "sm_90" in pdl.pdl_problem((8, 9))
    monkeypatch.setenv("LOWBIT_PDL", "0")
    assert pdl.pdl_problem((9, 0)) == "LOWBIT_PDL=0"
    assert pdl.pdl_options(False) == {}
    assert pdl.pdl_options(True) == {"launch_pdl": True}


def test_sm90_with_this_triton(monkeypatch):
    monkeypatch.delenv("LOWBIT_PDL", raising=False)
    expected = None if pdl._HAS_GDC and pdl._triton_has_launch_pdl() else pdl.pdl_problem((9, 0))
    assert pdl.pdl_problem((9, 0)) == expected
    if expected is not None:
        assert "launch_pdl" in expected


_COMPILE = textwrap.dedent("""
    import json, re, sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from lowbit.kernels.triton_w8a8_gemm import _w8a8_mm_kernel
    from lowbit.kernels.triton_w4_gemm import _w4a8_mm_kernel, kernel_constexprs
    from lowbit.kernels.triton_act_quant import _act_quant_kernel
    from lowbit.kernels.gemm_config import GemmConfig

    target = GPUTarget("cuda", 90, 32)

    def build(kernel, runtime, constexprs, **options):
        names = kernel.arg_names
        assert len(names) == len(runtime) + len(constexprs), names
        signature = {**dict(zip(names, runtime)), **{key: "constexpr" for key in constexprs}}
        attrs = {(i,): [["tt.divisibility", 16]] for i, t in enumerate(runtime) if t.startswith("*")}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                                  options=dict(num_warps=4, **options))
        ptx = compiled.asm["ptx"]
        return {"wait": ptx.find("griddepcontrol.wait"), "trigger": ptx.find("griddepcontrol.launch_dependents"),
                "first_store": min([i for i in (ptx.find("st.global"), ptx.find("cp.async.bulk.tensor")) if i >= 0],
                                   default=-1),
                "first_load": min([i for i in (ptx.find("ld.global"), ptx.find("cp.async")) if i >= 0], default=-1),
                "first_mma": ptx.find("mma"),
                "launch_pdl": bool(getattr(compiled.metadata, "launch_pdl", False))}

    out = {}
    gemm_runtime = ["*i8", "*i8", "*bf16", "*fp32", "*fp32", "*bf16", "*fp32", "*fp32"] + ["i32"] * 6
    for flag in (False, True):
        out[f"w8a8 {flag}"] = build(_w8a8_mm_kernel, gemm_runtime, dict(
            B_SCALE_PER_N=True, HAS_BIAS=True, HAS_SHIFT=False, ACC_INT32=True, EVEN_K=True, BLOCK_M=64,
            BLOCK_N=64, BLOCK_K=64, GROUP_M=8, PDL=flag), num_stages=2, **({"launch_pdl": True} if flag else {}))
    config = GemmConfig(64, 64, 64, 8, 4, 2)
    out["w4 True"] = build(_w4a8_mm_kernel, ["*i8", "*i8", "*bf16", "*fp32", "*fp32", "*bf16", "*i8", "*i8"]
                           + ["i32"] * 7, kernel_constexprs(config, codebook=False, group_size=16, has_bias=True,
                                                            use_ptx=True, tma_a=False, tma_w=False, tma_store=False,
                                                            pdl=True), num_stages=2, launch_pdl=True)
    aq_runtime = ["*bf16", "*i8", "*fp32", "*fp32", "*fp32", "*fp16", "*fp16", "*fp16", "*fp32"] + ["i32"] * 5 + \\
                 ["fp32", "fp32"]
    for flag in (False, True):
        out[f"act_quant {flag}"] = build(_act_quant_kernel, aq_runtime, dict(
            BLOCK_M=4, BLOCK_K=1024, HAS_SMOOTH=False, CENTER=False, ROTATE=False, TWO_STAGE=False, ROT_IMPL=0,
            PRECISE=False, ROUND_IN=False, OUT_FP8=False, PERM_BLOCK=0, R_BLOCK=0, HW_FP8_CAST=True, PDL=flag))
    print(json.dumps(out))
""")


def _ptxas_available() -> bool:
    try:
        import triton

        path = triton.knobs.nvidia.ptxas.path
    except Exception:  # noqa: BLE001 - no NVIDIA backend in this Triton
        return False
    return bool(path) and os.path.isfile(path)


@pytest.mark.skipif(not _ptxas_available(), reason="Triton's NVIDIA backend (ptxas) is not installed")
@pytest.mark.skipif(pdl.pdl_problem((9, 0)) is not None, reason="this Triton has no launch_pdl / gdc ops")
def test_sm90_code_waits_before_reading_and_lets_the_gemm_start_early():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    off, on = found["w8a8 False"], found["w8a8 True"]
    assert off["wait"] < 0 and not off["launch_pdl"]
    for name in ("w8a8 True", "w4 True"):
        row = found[name]
        assert row["launch_pdl"], name
        assert 0 <= row["wait"] < row["first_mma"], (name, row)  # the wait comes before the K loop's products
        assert row["first_store"] < 0 or row["wait"] < row["first_store"], (name, row)
    assert 0 <= on["wait"] < on["first_load"], on  # no operand is read before the wait
    assert found["act_quant False"]["trigger"] < 0
    trigger = found["act_quant True"]
    assert 0 <= trigger["trigger"] < trigger["first_load"], trigger
