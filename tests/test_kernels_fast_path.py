"""The steady-state fast paths: the dispatcher's cached plans, direct launches of compiled Triton
kernels (and their fallback), host TMA descriptors, and configurations a GPU can never run."""

from __future__ import annotations

from kernels_helpers import needs_triton_interpreter, randint8, randn

import json

import pytest
import torch

from lowbit.kernels import dispatch, launcher
from lowbit.kernels.backend import Backend, force_backend
from lowbit.kernels.dispatch import DispatchKey, Dispatcher, use_dispatcher
from lowbit.kernels.fp8_gemm import FP8, fp8_rowwise_linear
from lowbit.kernels.gemm_config import default_config
from lowbit.kernels.int8_gemm import int8_linear
from lowbit.kernels.w4_linear import w4a4_linear


def _triton_decision(fmt: str, m: int, n: int, k: int, kind: str = "w8a8") -> Dispatcher:
    """A dispatcher whose recorded choice for this CPU shape is our Triton pair (run by the interpreter)."""
    key = DispatchKey(fmt, (0, 0), dispatch.m_bucket(m), n, k).as_str()
    return Dispatcher(decisions={key: "triton:" + default_config(m, kind).name})


CASES = [
    ("int8", lambda x, w: int8_linear(x, w["int8"], w["scale"], w["bias"])),
    ("int8+regular256", lambda x, w: int8_linear(x, w["int8"], w["scale"], w["bias"], rotation="regular",
                                                 group_size=256)),
    ("int8+smooth+center+sylvester128", lambda x, w: int8_linear(
        x, w["int8"], w["scale"], w["bias"], rotation="sylvester", group_size=128, smooth=w["smooth"],
        center_rowsum=w["rowsum"])),
    ("fp8_rowwise", lambda x, w: fp8_rowwise_linear(x, w["fp8"], w["scale"], w["bias"])),
    ("w4a4/a8", lambda x, w: w4a4_linear(x, w["packed"], w["scale"].reshape(-1), w["bias"], 256, act_bits=8)),
]


@pytest.fixture(scope="module")
def weights():
    n, k = 32, 256
    return {"int8": randint8(n, k, seed=1), "scale": torch.rand(n, 1) * 1e-2 + 1e-3,
            "bias": randn(n, seed=2, dtype=torch.bfloat16), "fp8": (randn(n, k, seed=3) * 40).to(FP8),
            "smooth": torch.rand(k) + 0.5, "rowsum": randn(n, seed=4), "packed": randint8(n, k // 2, seed=5, low=-128)}


@needs_triton_interpreter()
@pytest.mark.parametrize("fmt,call", CASES, ids=[c[0] for c in CASES])
def test_repeated_calls_run_the_cached_plan_and_match_the_first_call(fmt, call, weights):
    x = randn(5, 256, seed=6, dtype=torch.bfloat16)
    d = _triton_decision(fmt, 5, 32, 256, "w4" if fmt.startswith("w4") else "w8a8")
    with use_dispatcher(d):
        first = call(x, weights)  # full path: uses the decision and registers the plan
        assert d.fast_hits == 0 and len(d.fast_plans) == 1
        plan = next(iter(d.fast_plans.values()))
        assert type(plan).__name__.startswith("_Triton"), "a Triton decision runs as the two-kernel plan"
        again = call(x, weights)
        assert d.fast_hits == 1
        other = call(randn(40, 256, seed=7, dtype=torch.bfloat16), weights)  # another M bucket: not this plan
        assert d.fast_hits == 1 and other.shape == (40, 32)
    assert torch.equal(first, again)
    with force_backend(Backend.TRITON):  # the forced backend never takes a plan, and agrees
        assert torch.equal(call(x, weights), first)
    assert d.fast_hits == 1


def test_plans_follow_the_dispatcher_and_its_decisions(weights):
    x = randn(3, 256, seed=8, dtype=torch.bfloat16)
    d = Dispatcher()
    with use_dispatcher(d):
        expected = int8_linear(x, weights["int8"], weights["scale"])
        assert len(d.fast_plans) == 1  # nothing is measured on the CPU: the first candidate is settled
        assert torch.equal(int8_linear(x, weights["int8"], weights["scale"]), expected)
        assert d.fast_hits == 1
        # a wrong call never reaches a plan: it takes the full path and raises the usual error
        with pytest.raises(ValueError, match="features"):
            int8_linear(randn(3, 128, seed=9), weights["int8"], weights["scale"])
    other = Dispatcher()
    with use_dispatcher(other):  # plans belong to one dispatcher
        int8_linear(x, weights["int8"], weights["scale"])
        assert other.fast_hits == 0
    d.forget_fast_plans()
    assert d.fast_plans == {}
    off = Dispatcher(fast=False)
    with use_dispatcher(off):
        for _ in range(2):
            int8_linear(x, weights["int8"], weights["scale"])
    assert off.fast_plans == {} and off.fast_hits == 0


def test_a_failing_plan_is_dropped_and_the_full_path_answers(weights):
    x = randn(3, 256, seed=10, dtype=torch.bfloat16)
    d = Dispatcher()
    with use_dispatcher(d):
        expected = int8_linear(x, weights["int8"], weights["scale"])
        key = next(iter(d.fast_plans))

        def broken(*args):
            raise RuntimeError("stale plan")
        d.fast_plans[key] = broken
        assert torch.equal(int8_linear(x, weights["int8"], weights["scale"]), expected)
        assert d.fast_plans[key] is not broken  # re-registered by the full path


# ---- the launcher ---------------------------------------------------------------------------------

class _FakeCompiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self, fail: bool = False):
        self.fail, self.calls = fail, []

    def run(self, *args):
        if self.fail:
            raise TypeError("launcher takes other arguments")
        self.calls.append(args)


class _FakeJit:
    """``kernel[grid](*args, **kw)`` records the call and returns a compiled kernel, as Triton does."""

    arg_names = ["x_ptr", "n", "BLOCK"]

    def __init__(self, compiled):
        self.compiled, self.slow_calls = compiled, []

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.slow_calls.append((grid, args, kwargs))
            return self.compiled
        return call


@pytest.fixture
def compiled_mode(monkeypatch):
    """Pretend to be on a GPU with compiled kernels (no interpreter, a stream, a device)."""
    monkeypatch.setattr(launcher, "interpreting", lambda: False)
    monkeypatch.setattr(launcher, "_raw_stream", lambda index: 1234)
    monkeypatch.setattr(launcher, "_triton_launch_api_known", lambda: True)


def test_launcher_caches_the_compiled_kernel_and_launches_it_directly(compiled_mode):
    compiled = _FakeCompiled()
    jit = _FakeJit(compiled)
    fast = launcher.TritonLauncher(jit)
    x = torch.zeros(64)
    fast.launch((4,), (x, 64), {"BLOCK": 16}, num_warps=4)
    # compiled with FP fusion named (Triton 3.10 turns its default off; every kernel was checked with it on)
    assert len(jit.slow_calls) == 1 and jit.slow_calls[0][2] == {"BLOCK": 16, "num_warps": 4, "enable_fp_fusion": True}
    fast.launch((4,), (x, 64), {"BLOCK": 16}, num_warps=4)
    fast.launch((2, 3), (x, 64), {"BLOCK": 16}, num_warps=4)
    assert len(jit.slow_calls) == 1 and fast.fast_launches == 2
    assert compiled.calls[0] == (4, 1, 1, 1234, "fn", "meta", None, None, None, x, 64, 16)
    assert compiled.calls[1][:3] == (2, 3, 1)
    # a new specialization (another int, another constexpr, a misaligned tensor) goes through kernel[grid]
    fast.launch((4,), (x, 48), {"BLOCK": 16}, num_warps=4)
    fast.launch((4,), (x, 64), {"BLOCK": 32}, num_warps=4)
    fast.launch((4,), (x[1:], 64), {"BLOCK": 16}, num_warps=4)
    assert len(jit.slow_calls) == 4


def test_a_launch_that_names_fp_fusion_keeps_its_choice(compiled_mode):
    jit = _FakeJit(_FakeCompiled())
    fast = launcher.TritonLauncher(jit)
    x = torch.zeros(64)
    fast.launch((4,), (x, 64), {"BLOCK": 16}, num_warps=4, enable_fp_fusion=False)
    fast.launch((4,), (x, 64), {"BLOCK": 16}, num_warps=4)
    assert [call[2]["enable_fp_fusion"] for call in jit.slow_calls] == [False, True]  # two keys, two compiles


def test_a_failing_launcher_falls_back_to_kernel_grid(compiled_mode, caplog):
    jit = _FakeJit(_FakeCompiled(fail=True))
    fast = launcher.TritonLauncher(jit)
    x = torch.zeros(64)
    for _ in range(3):
        fast.launch((4,), (x, 64), {"BLOCK": 16}, num_warps=4)
    assert len(jit.slow_calls) == 3 and fast.fast_launches == 0  # every launch still happened
    assert "launcher takes other arguments" in fast.disabled_reason
    assert "kernel[grid] from now on" in caplog.text


def test_launcher_declines_what_it_cannot_launch(compiled_mode, monkeypatch):
    x = torch.zeros(64)
    old = launcher.TritonLauncher(_FakeJit(object()))  # a compiled kernel without run/function: feature detection
    old.launch((1,), (x, 64), {"BLOCK": 16})
    old.launch((1,), (x, 64), {"BLOCK": 16})
    assert old.fast_launches == 0 and "has no" in old.disabled_reason
    monkeypatch.setenv("LOWBIT_TRITON_FAST_LAUNCH", "0")
    off = launcher.TritonLauncher(_FakeJit(_FakeCompiled()))
    off.launch((1,), (x, 64), {"BLOCK": 16})
    off.launch((1,), (x, 64), {"BLOCK": 16})
    assert off.fast_launches == 0 and "LOWBIT_TRITON_FAST_LAUNCH" in off.disabled_reason
    with launcher.slow_launches_only():
        on = launcher.TritonLauncher(_FakeJit(_FakeCompiled()))
        assert on.disabled_reason is None  # made inside the block: not switched off by it


@needs_triton_interpreter()
def test_interpreted_kernels_always_launch_through_kernel_grid():
    from lowbit.kernels import triton_act_quant

    launcher = triton_act_quant._LAUNCHER
    x = randn(4, 112, seed=11)  # three power-of-two pieces: the default takes this (padded-row) kernel
    # the counters are the process's: other tests in this worker may have launched this kernel before
    fast, slow = launcher.fast_launches, launcher.slow_launches
    triton_act_quant.act_quant_triton(x, torch.int8, 127.0, "none", 0, None, False)
    assert "interpreter" in launcher.disabled_reason
    assert launcher.fast_launches == fast and launcher.slow_launches == slow + 1


def test_tma_descriptor_matches_from_tensor():
    pytest.importorskip("triton.tools.tensor_descriptor")
    from triton.tools.tensor_descriptor import TensorDescriptor

    t = torch.zeros(48, 256, dtype=torch.int8)
    ours, theirs = launcher.tma_descriptor(t, (32, 64)), TensorDescriptor.from_tensor(t, [32, 64])
    for field in ("shape", "strides", "block_shape"):
        assert tuple(getattr(ours, field)) == tuple(getattr(theirs, field)), field
    assert ours.padding == theirs.padding
    assert ours.base is t and launcher.specialization_key([ours]) == launcher.specialization_key([theirs])
    with pytest.raises(AssertionError):  # a row stride that TMA cannot take: Triton's own check
        launcher.tma_descriptor(torch.zeros(8, 24, dtype=torch.int8)[:, :20], (8, 16))


# ---- configurations a GPU can never run -----------------------------------------------------------

def test_out_of_resources_is_remembered_per_gpu_and_format_family(monkeypatch, tmp_path):
    monkeypatch.setattr(Dispatcher, "_can_measure", lambda self, device: True)
    monkeypatch.setattr(dispatch, "_time_us", lambda fn, warmup, repeats: fn())
    d = Dispatcher(cache_path=tmp_path / "dispatch.json")
    tried = []

    def too_big():
        tried.append("big")
        raise RuntimeError("OutOfResources: out of resource: shared memory, Required: 262144, Hardware limit: 232448")
    candidates = {"triton:big": too_big, "triton:ok": lambda: 5.0}
    key = DispatchKey("int8+regular256", (9, 0), 4096, 3072, 3072)
    assert d.choose(key, candidates, torch.device("cpu")) == "triton:ok"
    assert "shared memory" in d.broken["sm90"]["int8 triton:big"]
    # another shape of the family on this GPU: not tried again; another family or GPU: tried
    assert d.choose(DispatchKey("int8", (9, 0), 256, 9216, 3072), candidates, torch.device("cpu")) == "triton:ok"
    assert tried == ["big"]
    d.choose(DispatchKey("w4a4/a8", (9, 0), 256, 9216, 3072), candidates, torch.device("cpu"))
    d.choose(DispatchKey("int8", (10, 0), 256, 9216, 3072), candidates, torch.device("cpu"))
    assert tried == ["big"] * 3
    saved = json.loads((tmp_path / "dispatch.json").read_text())
    assert "int8 triton:big" in saved["broken"]["sm90"]
    assert Dispatcher(cache_path=tmp_path / "dispatch.json").is_broken(key, "triton:big")
