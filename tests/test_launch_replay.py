"""Launch replays (``kernels/launcher.LaunchReplay``, ``kernels/replay.PlanReplays``): a steady-state plan's
third call of a kind of input relaunches the recorded kernels with the new tensors, and gives the
ordinary path's output bit for bit; anything it cannot vouch for takes the ordinary path.

On a GPU the recorded launches are compiled kernels. Here every launcher's "compiled kernel" runs the
same Triton kernel in the CPU interpreter (fixture ``interpreted``), so the fast launches and their
replays run the very argument lists a GPU would get, TMA descriptors included.
"""

from __future__ import annotations

import dataclasses
import math

from kernels_helpers import needs_triton_interpreter, randint8, randn

import pytest
import torch
from comfy_kitchen.backends.eager import w4a8_int8 as ck_w4a8

from lowbit.kernels import launcher
from lowbit.kernels.gemm_config import GemmConfig
from lowbit.kernels.launcher import LaunchReplay, TritonLauncher, capture_launches, constant_tensor
from lowbit.kernels.prologue import GeluPrologue, NormModPrologue
from lowbit.kernels.reference import FP8
from lowbit.kernels.replay import PlanReplays
from lowbit.kernels.w4_linear import _ExpandW4Plan, _TritonW4Plan, level_table
from lowbit.kernels.w8a8_linear import _TritonW8A8Plan, _WeightOnlyPlan

pytestmark = needs_triton_interpreter()

K, N = 256, 48
POINTER = GemmConfig(32, 32, 64, 4, 4, 2)
TMA_STORE_SUB = GemmConfig(32, 64, 64, 4, 4, 2, tma=True, persistent=True, tma_store=True, subtile=True)
TMA = GemmConfig(32, 32, 64, 4, 4, 2, tma=True, tma_store=True)


class Ran(list):
    broken = False  # set: every stand-in compiled kernel raises


def _fresh_launchers(monkeypatch, remember):
    """Every launcher starts with no compiled kernels and keeps ``remember``'s stand-ins; replays are on."""
    monkeypatch.setattr(TritonLauncher, "_remember", remember)
    for each in list(launcher._ALL):
        monkeypatch.setattr(each, "disabled_reason", None)
        monkeypatch.setattr(each, "_compiled", {})
    monkeypatch.setattr(launcher, "_replay_failure", [None])


@pytest.fixture
def interpreted(monkeypatch):
    """Every launcher keeps, per specialization, a stand-in compiled kernel that runs its Triton kernel in
    the interpreter with the arguments a compiled kernel's ``run`` receives. Returns the list of kernels run
    through those stand-ins (fast launches and replays)."""
    ran = Ran()

    def remember(self, key, compiled, constexprs):
        names = list(constexprs)

        def run(gx, gy, gz, stream, function, packed, metadata, enter, leave, *args):
            if ran.broken:
                raise RuntimeError("launcher API changed")
            ran.append(self.kernel)
            runtime, values = args[:len(args) - len(names)], args[len(args) - len(names):]
            self.kernel[(gx, gy, gz)](*runtime, **dict(zip(names, values)))

        self._compiled[key] = (run, None, None)

    _fresh_launchers(monkeypatch, remember)
    return ran


def _weights(fp8=False, seed=0):
    w = (randn(N, K, seed=seed) * 40).to(FP8) if fp8 else randint8(N, K, seed=seed)
    return {"weight": w, "scale": torch.rand(N, generator=torch.Generator().manual_seed(seed + 1)) / 64 + 1e-3,
            "bias": randn(N, seed=seed + 2, dtype=torch.bfloat16), "smooth": torch.rand(K) + 0.5,
            "rowsum": randn(N, seed=seed + 3)}


W8A8 = {  # name: (config, rotation, group, smooth + centre, fp8)
    "int8-pointer": (POINTER, "none", 0, False, False),
    "convrot-tma-persistent-sub": (TMA_STORE_SUB, "regular", 256, False, False),
    "hadanorm-tma": (TMA, "sylvester", 128, True, False),
    "fp8-tma-persistent-sub": (TMA_STORE_SUB, "none", 0, False, True),
    "int8-torch-mm": (None, "none", 0, False, False),
    # split-K: the kept workspace and locks are constants of the recording; K = 256 is 4 tiles, 2 shares
    "int8-split-k-pointer": (GemmConfig(16, 32, 64, 4, 4, 2, split_k=2), "none", 0, False, False),
    "hadanorm-split-k-tma": (GemmConfig(32, 32, 64, 4, 4, 2, tma=True, tma_store=True, split_k=3), "sylvester", 128,
                             True, False),
}


def _w8a8(name):
    config, rotation, group, smooth_center, fp8 = W8A8[name]
    plan = _TritonW8A8Plan(config, rotation, group, smooth_center, fp8, torch.bfloat16, scale_as_is=True)
    w = _weights(fp8)

    def call(x, weights=w):
        return plan(x, weights["weight"], weights["scale"], weights["bias"],
                    weights["smooth"] if smooth_center else None, weights["rowsum"] if smooth_center else None)
    return plan, call


def _inputs(kind, m, seed):
    x = randn(m, K, seed=seed, dtype=torch.bfloat16)
    if kind == "tensor":
        return x
    if kind == "gelu":
        return GeluPrologue(b=x[:, 64:].contiguous(), a=x[:, :64].contiguous(), approximate="tanh")
    mult, shift = randn(1, K, seed=seed + 1, dtype=torch.bfloat16), randn(1, K, seed=seed + 2, dtype=torch.bfloat16)
    return NormModPrologue(x, 1e-6, mult, shift)


def _launches() -> int:
    """Launches made through the launchers (a replay makes none)."""
    return sum(each.fast_launches + each.slow_launches for each in list(launcher._ALL))


def _ordinary(plan, x, call):
    """What the plan's ordinary path gives for ``x`` (a fresh plan has no recording; a fresh copy of a prologue
    holds no codes an earlier call left with it)."""
    saved, plan.replays = plan.replays, PlanReplays()
    try:
        return call(x if isinstance(x, torch.Tensor) else dataclasses.replace(x))
    finally:
        plan.replays = saved


@pytest.mark.parametrize("kind", ["tensor", "gelu", "norm"])
@pytest.mark.parametrize("name", list(W8A8))
def test_w8a8_replays_give_the_ordinary_bits(name, kind, interpreted):
    plan, call = _w8a8(name)
    m = 19
    call(_inputs(kind, m, seed=1))  # ordinary
    call(_inputs(kind, m, seed=2))  # recorded
    (key, replay), = plan.replays.entries.items()
    assert isinstance(replay, LaunchReplay), "the plan's launches must be replayable"
    for seed in (3, 4):
        x = _inputs(kind, m, seed=seed)
        before, launched = len(interpreted), _launches()
        replayed = call(x)
        assert len(interpreted) - before == len(replay.steps) == (1 if W8A8[name][0] is None else 2)
        assert _launches() == launched, "a replay launches without the launchers' argument handling"
        expected = _ordinary(plan, x, call)
        assert torch.equal(replayed, expected)
    # the replay serves every layer of the plan: another weight of the same shapes, its own bits
    other = _weights(W8A8[name][4], seed=10)
    x = _inputs(kind, m, seed=5)
    assert torch.equal(call(x, other), _ordinary(plan, x, lambda x: call(x, other)))


W4 = {  # name: (plan class, config, qmax, codebook)
    "w4a4-pointer": (_TritonW4Plan, GemmConfig(32, 32, 64, 4, 4, 2), 7.0, False),
    "w4a8-codebook-tma": (_TritonW4Plan, GemmConfig(32, 32, 64, 4, 4, 2, tma=True, tma_store=True), 127.0, True),
    "w4a8-expand-persistent": (_ExpandW4Plan, TMA_STORE_SUB, 127.0, True),
    "w4a4-split-k-swap": (_TritonW4Plan, GemmConfig(32, 32, 64, 4, 4, 2, swap_ab=True, split_k=2), 7.0, False),
    "w4a8-codebook-split-k-tma": (_TritonW4Plan, GemmConfig(32, 32, 64, 4, 4, 2, tma=True, tma_store=True, split_k=4),
                                  127.0, True),
}
CODEBOOK = torch.tensor(ck_w4a8._FIXED_LUT)


@pytest.mark.parametrize("kind", ["tensor", "norm"])
@pytest.mark.parametrize("name", list(W4))
def test_w4_replays_give_the_ordinary_bits(name, kind, interpreted):
    cls, config, qmax, codebook = W4[name]
    plan = cls(config, qmax, 256, 16, torch.bfloat16)
    packed = randint8(N, K // 2, seed=7, low=-128)
    w_scale = torch.rand(N, generator=torch.Generator().manual_seed(8)) / 64 + 1e-3
    s_rel = (torch.rand(N, K // 16, generator=torch.Generator().manual_seed(9)) * 60 + 4).to(FP8) if codebook else None
    bias = randn(N, seed=10, dtype=torch.bfloat16)

    def call(x):
        return plan(x, packed, w_scale, bias, s_rel, CODEBOOK if codebook else None, None)
    for seed in (1, 2):
        call(_inputs(kind, 21, seed))
    assert isinstance(next(iter(plan.replays.entries.values())), LaunchReplay)
    x = _inputs(kind, 21, 3)
    before, launched = len(interpreted), _launches()
    replayed = call(x)
    assert len(interpreted) > before and _launches() == launched
    assert torch.equal(replayed, _ordinary(plan, x, call))


@pytest.mark.parametrize("fp8,rotation,group,hadanorm", [(False, "regular", 256, False), (True, "none", 0, False),
                                                        (False, "sylvester", 128, True)],
                         ids=["convrot", "fp8", "hadanorm"])
def test_weight_only_replays_give_the_ordinary_bits(fp8, rotation, group, hadanorm, interpreted):
    """The few-row W8A16 plan (``dequant:<config>``): one launch (two with a rotation, or HadaNorm's smoothing and
    centring), replayed from the third call of a kind of input; another layer's weights (its own smoothing and row
    sums too) through the same recording."""
    plan = _WeightOnlyPlan(GemmConfig(16, 32, 256, 1, 4, 2), rotation, group, torch.bfloat16, scale_as_is=True)
    w = _weights(fp8)

    def call(x, weights=w):
        return plan(x, weights["weight"], weights["scale"], weights["bias"], weights["smooth"] if hadanorm else None,
                    weights["rowsum"] if hadanorm else None)
    for seed in (1, 2):
        call(_inputs("tensor", 3, seed))
    (_, replay), = plan.replays.entries.items()
    launches = 2 if rotation != "none" or hadanorm else 1
    assert isinstance(replay, LaunchReplay) and len(replay.steps) == launches
    x = _inputs("tensor", 3, 3)
    before, launched = len(interpreted), _launches()
    replayed = call(x)
    assert len(interpreted) - before == launches and _launches() == launched
    assert torch.equal(replayed, _ordinary(plan, x, call))
    other = _weights(fp8, seed=10)
    assert torch.equal(call(x, other), _ordinary(plan, x, lambda x: call(x, other)))


def test_every_launch_passes_the_constexprs_as_its_kernels_trailing_parameters(monkeypatch):
    """A compiled kernel's fast launch takes the constexprs last, in the kernel's order; a launch whose constexprs
    are in another order loses the fast launch on a GPU (logged, and slower: it happened to the act-quant kernel
    when a flag was added). The interpreter never builds a fast launch, so this checks every launch here: the
    W8A8 and W4 plans (GEMM and act-quant kernels) on a tensor and on every kind of prologue."""
    launches = []
    real = TritonLauncher.launch

    def spy(self, grid, args, constexprs, **options):
        launches.append((self.kernel, len(args), list(constexprs)))
        return real(self, grid, args, constexprs, **options)

    monkeypatch.setattr(TritonLauncher, "launch", spy)
    x = randn(21, K, seed=4, dtype=torch.bfloat16)
    w = (1 + randn(K, seed=5, scale=0.2)).float()
    rms = NormModPrologue(x, 1e-6, randn(1, K, seed=6, dtype=torch.bfloat16), randn(1, K, seed=7, dtype=torch.bfloat16),
                          rms=True, weight=w, two_step=True)
    inputs = [_inputs(kind, 21, 1) for kind in ("tensor", "gelu", "norm")] + [rms]
    for name in ("int8-pointer", "convrot-tma-persistent-sub", "fp8-tma-persistent-sub", "int8-split-k-pointer"):
        _, call = _w8a8(name)
        for x in inputs:
            call(x)
    for cls, config, qmax, codebook in W4.values():
        plan = cls(config, qmax, 256, 16, torch.bfloat16)
        s_rel = (torch.rand(N, K // 16, generator=torch.Generator().manual_seed(9)) * 60 + 4).to(FP8) if codebook \
            else None
        plan(inputs[0], randint8(N, K // 2, seed=7, low=-128), torch.rand(N) / 64 + 1e-3, None, s_rel,
             CODEBOOK if codebook else None, None)
    for rotation, group in (("none", 0), ("sylvester", 128)):
        _WeightOnlyPlan(GemmConfig(16, 32, 256, 1, 4, 2), rotation, group, torch.bfloat16, True)(
            inputs[0], randint8(N, K, seed=8), torch.rand(N) / 64 + 1e-3, None, None, None)
    assert len({id(kernel) for kernel, _, _ in launches}) >= 6
    for kernel, runtime, names in launches:
        assert list(kernel.arg_names[len(kernel.arg_names) - len(names):]) == names, kernel.fn.__name__
        assert runtime + len(names) == len(kernel.arg_names), kernel.fn.__name__


def test_inputs_unlike_the_recording_take_the_ordinary_path(interpreted):
    plan, call = _w8a8("convrot-tma-persistent-sub")
    for seed in (1, 2):
        call(_inputs("tensor", 19, seed))
    replay = next(iter(plan.replays.entries.values()))
    wide = randn(19, K + 8, seed=3, dtype=torch.bfloat16)
    strided = wide[:, :K]  # another row stride: its own kind of input, recorded after one ordinary call
    assert torch.equal(call(strided), _ordinary(plan, strided, call))
    misaligned = wide.reshape(-1)[1:1 + 19 * K].view(19, K)  # the recorded kind, but not 16-byte aligned
    assert replay.replay((misaligned, *([None] * 5))) is None
    w = _weights()
    assert replay.replay((misaligned.contiguous(), w["weight"], w["scale"], None, None, None)) is None  # no bias
    launched = _launches()
    assert torch.equal(call(misaligned), _ordinary(plan, misaligned, call))
    assert _launches() - launched == 4, "both calls launch through the launchers"


def test_a_tensor_of_no_known_role_makes_no_replay(interpreted):
    plan, _ = _w8a8("int8-pointer")
    w = _weights()
    x = _inputs("tensor", 19, 1)
    inputs = (x, w["weight"], w["scale"], w["bias"], None, None)
    plan._launch(*inputs)  # the stand-in compiled kernels
    with capture_launches() as launches:
        q, scale, out = plan._launch(*inputs)
    assert len(launches) == 2
    assert isinstance(LaunchReplay.build(launches, inputs, (q, scale, out)), LaunchReplay)
    assert LaunchReplay.build(launches, inputs, (q, out)) is None  # the codes' scales: a tensor nobody declared
    # one tensor in two roles: a later call may pass two different tensors there
    assert LaunchReplay.build(launches, (x, w["weight"], w["scale"], w["bias"], x, None), (q, scale, out)) is None


def test_constant_tensors_are_kept_and_others_are_not():
    kept = constant_tensor(torch.ones(3))
    assert launcher._is_constant(kept)
    assert not launcher._is_constant(torch.ones(3))
    assert not launcher._is_constant(kept.clone())


def test_a_failing_replay_switches_replays_off_and_the_call_still_runs(interpreted, monkeypatch, caplog):
    plan, call = _w8a8("int8-pointer")
    for seed in (1, 2):
        call(_inputs("tensor", 19, seed))
    assert isinstance(next(iter(plan.replays.entries.values())), LaunchReplay)
    x = _inputs("tensor", 19, 3)
    interpreted.broken = True  # the compiled kernels' launcher API "changed"
    with caplog.at_level("WARNING"):
        out = call(x)  # the replay fails; the ordinary path's fast launches fail too, then kernel[grid] runs
    assert "launch replay failed" in caplog.text and "using kernel[grid] from now on" in caplog.text
    assert not launcher.replays_enabled()
    interpreted.broken = False
    assert torch.equal(out, _ordinary(plan, x, call))
    other, call_other = _w8a8("int8-pointer")
    for seed in (1, 2):
        call_other(_inputs("tensor", 19, seed))
    assert not any(isinstance(e, LaunchReplay) for e in other.replays.entries.values())


def test_a_profiler_hook_takes_the_ordinary_path(interpreted, monkeypatch):
    plan, call = _w8a8("int8-pointer")
    for seed in (1, 2):
        call(_inputs("tensor", 19, seed))
    replay = next(iter(plan.replays.entries.values()))

    class Chain:
        calls = [object()]
    monkeypatch.setattr(launcher, "_hooks", [Chain(), Chain()])
    w = _weights()
    assert replay.replay((_inputs("tensor", 19, 3), w["weight"], w["scale"], w["bias"], None, None)) is None


class Addresses:
    """The tensors a raw-pointer replay may name by address, found again from the address (also an address
    inside one of them: pooled scratch)."""

    def __init__(self):
        self.tensors: list[torch.Tensor] = []
        self.raw_args = 0  # ints (and address-based descriptors) the stand-in kernels turned back into tensors
        self.allocations = 0  # torch.empty calls

    def add(self, *tensors):
        self.tensors.extend(t for t in tensors if isinstance(t, torch.Tensor))

    def tensor(self, address: int, like: torch.dtype) -> torch.Tensor:
        if address == 0:  # an empty tensor's address: a null pointer, never read
            return torch.zeros(0, dtype=like)
        known = [t for t in [*self.tensors, *(ref() for ref in launcher._constants.values())]
                 if t is not None and t.numel()]
        for t in known:
            if t.data_ptr() == address and t.element_size() == like.itemsize:
                return t if t.dtype == like else t.view(like)
        for t in known:
            size = t.numel() * t.element_size()
            if t.is_contiguous() and t.data_ptr() <= address < t.data_ptr() + size:
                offset = address - t.data_ptr()
                rest = (size - offset) // like.itemsize * like.itemsize
                return t.reshape(-1).view(torch.uint8)[offset:offset + rest].view(like)
        raise AssertionError(f"no known tensor at address {address:#x}")


@pytest.fixture
def raw_interpreted(monkeypatch):
    """Like ``interpreted``, and the stand-in compiled kernels also take a tensor argument as its address (an int),
    as a replay on a CUDA device passes it, and a TMA descriptor whose base is an address: each is mapped back to
    the known tensor at that address, viewed as the dtype that argument had in the launch that compiled the
    stand-in. The tensors a replay allocates are known too (and counted)."""
    addresses = Addresses()

    def remember(self, key, compiled, constexprs):
        names = list(constexprs)
        dtypes: dict[int, torch.dtype] = {}

        def run(gx, gy, gz, stream, function, packed, metadata, enter, leave, *args):
            runtime, values = list(args[:len(args) - len(names)]), args[len(args) - len(names):]
            for i, a in enumerate(runtime):
                base = getattr(a, "base", None)
                if isinstance(a, torch.Tensor) or isinstance(base, torch.Tensor):
                    dtypes[i] = a.dtype if isinstance(a, torch.Tensor) else base.dtype
                elif isinstance(base, launcher._Address):
                    start = addresses.tensor(base.data_ptr(), dtypes[i])
                    runtime[i] = type(a).from_tensor(start[:math.prod(a.shape)].view(tuple(a.shape)),
                                                     list(a.block_shape))
                    addresses.raw_args += 1
                elif type(a) is int and i in dtypes:
                    runtime[i] = addresses.tensor(a, dtypes[i])
                    addresses.raw_args += 1
            self.kernel[(gx, gy, gz)](*runtime, **dict(zip(names, values)))

        self._compiled[key] = (run, None, None)

    _fresh_launchers(monkeypatch, remember)
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        addresses.add(t)
        addresses.allocations += 1
        return t
    monkeypatch.setattr(torch, "empty", empty)
    return addresses


def _w4(name):
    cls, config, qmax, codebook = W4[name]
    plan = cls(config, qmax, 256, 16, torch.bfloat16)
    w = {"packed": randint8(N, K // 2, seed=7, low=-128),
         "w_scale": torch.rand(N, generator=torch.Generator().manual_seed(8)) / 64 + 1e-3,
         "s_rel": (torch.rand(N, K // 16, generator=torch.Generator().manual_seed(9)) * 60 + 4).to(FP8)
         if codebook else None,
         "bias": randn(N, seed=10, dtype=torch.bfloat16)}

    def call(x, weights=w):
        return plan(x, weights["packed"], weights["w_scale"], weights["bias"], weights["s_rel"],
                    CODEBOOK if codebook else None, None)
    return plan, call


RAW = {  # name: (plan maker, scratch tensors a call allocates besides its output)
    "int8-pointer": (_w8a8, 2),
    "convrot-tma-persistent-sub": (_w8a8, 2),  # the codes reach the GEMM through a TMA descriptor
    "hadanorm-split-k-tma": (_w8a8, 3),  # and the rows' means
    "w4a8-codebook-tma": (_w4, 2),
    "w4a8-expand-persistent": (_w4, 3),  # and the expanded weight
}


@pytest.mark.parametrize("pool", [False, True])
@pytest.mark.parametrize("kind", ["tensor", "norm"])
@pytest.mark.parametrize("name", list(RAW))
def test_a_replay_passing_addresses_gives_the_ordinary_bits(name, kind, pool, raw_interpreted):
    """On a CUDA device a replay passes every tensor argument as its address (``_compile_replay``'s
    ``raw_pointers``) and carves its scratch tensors out of one allocation (``pool``): the same kernels read
    and write the same data, so the same bits, with one ``torch.empty`` for the scratch instead of one each."""
    maker, scratch = RAW[name]
    plan, call = maker(name)
    for seed in (1, 2):
        call(_inputs(kind, 19, seed))
    (_, replay), = plan.replays.entries.items()
    assert isinstance(replay, LaunchReplay) and replay.scratch == scratch
    replay.fn = launcher._compile_replay(replay, raw_pointers=True, pool=pool)  # as a CUDA device's replay is made
    x = _inputs(kind, 19, 3)
    weights = call.__defaults__[0]  # the plan's weights
    raw_interpreted.add(x, *(getattr(x, f, None) for f in ("x", "mult", "shift", "a", "b")), *weights.values(),
                        level_table(CODEBOOK, x.device if isinstance(x, torch.Tensor) else x.x.device))
    before = raw_interpreted.allocations
    replayed = call(x)
    assert raw_interpreted.allocations - before == (2 if pool else scratch + 1)
    assert raw_interpreted.raw_args >= 6, "the replay passed its tensors by address"
    assert torch.equal(replayed, _ordinary(plan, x, call))


def test_a_pooled_replay_hands_back_only_the_result(raw_interpreted):
    plan, call = _w8a8("hadanorm-split-k-tma")
    for seed in (1, 2):
        call(_inputs("tensor", 19, seed))
    (_, replay), = plan.replays.entries.items()
    w = call.__defaults__[0]
    inputs = (_inputs("tensor", 19, 3), w["weight"], w["scale"].reshape(-1).float(), w["bias"], w["smooth"],
              w["rowsum"].float())
    raw_interpreted.add(*inputs)
    outputs = launcher._compile_replay(replay, raw_pointers=True, pool=True)(inputs, 0)
    assert outputs[:-1] == [None, None, None] and outputs[-1].shape == (19, N)
    unpooled = launcher._compile_replay(replay, raw_pointers=True, pool=False)(inputs, 0)
    assert all(isinstance(t, torch.Tensor) for t in unpooled) and torch.equal(unpooled[-1], outputs[-1])


def test_a_replay_passing_addresses_refuses_a_tensor_on_another_device(raw_interpreted):
    """Given an address, Triton's launcher no longer checks that it is device memory: the replay checks each
    input's device itself (here a replay recorded "on CUDA device 0" is handed CPU tensors)."""
    plan, call = _w8a8("int8-pointer")
    for seed in (1, 2):
        call(_inputs("tensor", 19, seed))
    (_, replay), = plan.replays.entries.items()
    w = call.__defaults__[0]
    inputs = (_inputs("tensor", 19, 3), w["weight"], w["scale"], w["bias"], None, None)
    raw_interpreted.add(*inputs)
    on_cpu = launcher._compile_replay(replay, raw_pointers=True)
    assert on_cpu(inputs, 0) is not None  # recorded on the CPU, given CPU tensors
    on_gpu = launcher._compile_replay(LaunchReplay(0, replay.device, replay.signatures, replay.allocs, replay.steps),
                                      raw_pointers=True)
    assert on_gpu(inputs, 0) is None


def _run_expanded(addresses: Addresses, kernel, names: list[str], dtypes: dict, described: list[int], grid: tuple,
                  flat) -> None:
    """Run ``kernel`` in the interpreter from the arguments a C launch function receives: each descriptor
    expanded (itself standing for its CUtensorMap, then its shape and strides), each tensor an address,
    the constexprs last. Descriptors and addresses are mapped back to the known tensors."""
    runtime, i = [], 0
    for position in range(len(kernel.arg_names) - len(names)):
        a = flat[i]
        if position in described:
            i += 1 + 2 * len(a.shape)
            start = addresses.tensor(a.base.data_ptr(), dtypes[position][1])
            a = type(a).from_tensor(start[:math.prod(a.shape)].view(tuple(a.shape)), list(a.block_shape))
            addresses.raw_args += 1
        else:
            i += 1
            if type(a) is int and position in dtypes:
                a = addresses.tensor(a, dtypes[position][1])
                addresses.raw_args += 1
        runtime.append(a)
    kernel[grid](*runtime, **dict(zip(names, flat[i:])))


def _fake_triton36_driver(addresses: Addresses, kernel, names: list[str], dtypes: dict, ran: list):
    """A stand-in for Triton 3.6's ``CudaLauncher`` around ``kernel``, as :func:`launcher._direct_launch` expects
    it: ``__call__(gridX, gridY, gridZ, stream, function, *args)``, a module with ``_BASE_ARGS_FORMAT`` and
    ``make_tensordesc_arg`` (here: the descriptor itself stands for its CUtensorMap), and ``launch``, the
    descriptor wrapper (``inner``) around a C-like launch function. That function rebuilds the kernel's
    arguments from the expanded list and runs the kernel in the interpreter."""
    import sys
    import types

    module = types.ModuleType("fake_triton36_driver")
    module._BASE_ARGS_FORMAT = "iiiKKppOOOOOO"
    module.encoded, module.python_calls = [], 0

    def make_tensordesc_arg(arg, metadata):
        module.encoded.append(arg.base.data_ptr())
        return [arg, *arg.shape, *arg.strides]
    module.make_tensordesc_arg = make_tensordesc_arg
    sys.modules[module.__name__] = module
    described = sorted(i for i, t in dtypes.items() if t[0] == "desc")

    def c_launch(gx, gy, gz, stream, function, coop, pdl, gscratch, pscratch, packed, meta, enter, leave, *flat):
        assert function is FUNCTION and packed is PACKED and gscratch is pscratch is meta is enter is leave is None
        _run_expanded(addresses, kernel, names, dtypes, described, (gx, gy, gz), flat)
        ran.append(kernel)

    def wrap(launcher, tensordesc_indices, tensordesc_meta):
        def inner(*args):  # as Triton 3.6's wrap_handle_tensordesc writes it
            final_args = list(args[:13])
            tensordesc_idx = 0
            for i, arg in enumerate(args[13:]):
                if i in tensordesc_indices:
                    final_args.extend(make_tensordesc_arg(arg, tensordesc_meta[tensordesc_idx]))
                    tensordesc_idx += 1
                else:
                    final_args.append(arg)
            return launcher(*final_args)
        return inner

    class CudaLauncher:
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid = launch_pdl = False

        def __init__(self):
            self.launch = wrap(c_launch, set(described), [{"swizzle": 128}] * len(described)) if described \
                else c_launch

        def __call__(self, gridX, gridY, gridZ, stream, function, *args):
            module.python_calls += 1
            self.launch(gridX, gridY, gridZ, stream, function, False, False, None, None, *args)
    CudaLauncher.__module__ = module.__name__
    return CudaLauncher(), module


def _fake_triton37_driver(addresses: Addresses, kernel, names: list[str], dtypes: dict, ran: list):
    """A stand-in for Triton 3.7's ``CudaLauncher`` (not installed here; its source): the generic ``__call__``
    and C launch function of 3.8, with 3.7's descriptor wrapper, whose closure holds ``tensordesc_indices`` and
    calls its module's two-argument ``make_tensordesc_arg`` (here the descriptor itself stands for its
    CUtensorMap)."""
    import sys
    import types

    module = types.ModuleType("fake_triton37_driver")
    module.encoded, module.python_calls = [], 0

    def make_tensordesc_arg(arg, metadata):
        assert metadata == {"swizzle": 128}
        module.encoded.append(arg.base.data_ptr())
        return [arg, *arg.shape, *arg.strides]
    module.make_tensordesc_arg = make_tensordesc_arg
    sys.modules[module.__name__] = module
    described = sorted(i for i, t in dtypes.items() if t[0] == "desc")

    def c_launch(gx, gy, gz, stream, function, coop, pdl, packed, meta, enter, leave, gscratch, pscratch, annotations,
                 signature, flat):
        assert annotations == "annotations" and signature == "signature"
        assert function is FUNCTION and packed is PACKED and meta is enter is leave is gscratch is pscratch is None
        _run_expanded(addresses, kernel, names, dtypes, described, (gx, gy, gz), flat)
        ran.append(kernel)

    def wrap(launcher, tensordesc_indices, tensordesc_meta):
        def inner(*args):  # as Triton 3.7's wrap_handle_tensordesc writes it
            base_args = args[:-1]
            kernel_args = args[-1]
            final_kernel_args = []
            tensordesc_idx = 0
            for i, arg in enumerate(kernel_args):
                if i in tensordesc_indices:
                    final_kernel_args.extend(make_tensordesc_arg(arg, tensordesc_meta[tensordesc_idx]))
                    tensordesc_idx += 1
                else:
                    final_kernel_args.append(arg)
            return launcher(*base_args, final_kernel_args)
        return inner

    class CudaLauncher:
        global_scratch_size = profile_scratch_size = 0
        launch_cooperative_grid = launch_pdl = False
        arg_annotations, kernel_signature = "annotations", "signature"

        def __init__(self):
            self.launch = wrap(c_launch, set(described), [{"swizzle": 128}] * len(described)) if described \
                else c_launch

        def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                     launch_enter_hook, launch_exit_hook, *args):
            module.python_calls += 1
            self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                        kernel_metadata, launch_metadata, launch_enter_hook, launch_exit_hook, None, None,
                        self.arg_annotations, self.kernel_signature, args)
    CudaLauncher.__module__ = module.__name__
    return CudaLauncher(), module


def _generic_triton_launcher(addresses: Addresses, kernel, names: list[str], dtypes: dict, ran: list):
    """The installed Triton's own ``CudaLauncher`` (Triton 3.7+: one generic C launch function) around ``kernel``:
    the real class, its real ``__call__`` and its real descriptor wrapper (``wrap_handle_tensordesc``), with two
    stand-ins – the C launch function, which checks the annotations and signature it is handed, rebuilds the
    kernel's arguments from the expanded tuple and runs the kernel in the interpreter, and
    ``make_tensordesc_arg``, where the descriptor itself stands for its CUtensorMap."""
    import inspect
    import types

    import triton
    import triton.backends.driver as generic_driver
    nvidia = pytest.importorskip("triton.backends.nvidia.driver")
    cls = nvidia.CudaLauncher
    if list(inspect.signature(cls.__call__).parameters) != launcher._CALL_GENERIC:
        pytest.skip(f"the installed Triton {triton.__version__} has no generic launcher")
    record = types.SimpleNamespace(encoded=[], python_calls=0)
    described = sorted(i for i, t in dtypes.items() if t[0] == "desc")
    run = cls.__new__(cls)

    def make_tensordesc_arg(arg, metadata, _=None):
        assert metadata == {"swizzle": 128}
        record.encoded.append(arg.base.data_ptr())
        return [arg, *arg.shape, *arg.strides]

    def c_launch(gx, gy, gz, stream, function, coop, pdl, packed, meta, enter, leave, gscratch, pscratch, annotations,
                 signature, flat):
        assert annotations is run.arg_annotations and signature is run.kernel_signature
        assert function is FUNCTION and packed is PACKED and meta is enter is leave is None
        assert gscratch is None and pscratch is None and coop is False and pdl is False
        _run_expanded(addresses, kernel, names, dtypes, described, (gx, gy, gz), flat)
        ran.append(kernel)

    signature = {name: "tensordesc<i8[32, 64]>" if i in described else "i32"
                 for i, name in enumerate(kernel.arg_names)}
    metas = [{"swizzle": 128}] * len(described)
    if hasattr(generic_driver, "wrap_handle_tensordesc_impl"):  # Triton 3.8+
        run.launch = generic_driver.wrap_handle_tensordesc_impl(c_launch, signature, metas, make_tensordesc_arg)
    else:  # Triton 3.7: the wrapper calls the module's make_tensordesc_arg
        pytest.MonkeyPatch().setattr(nvidia, "make_tensordesc_arg", make_tensordesc_arg)
        run.launch = nvidia.wrap_handle_tensordesc(c_launch, signature, metas)
    run.arg_annotations, run.kernel_signature = object(), object()
    run.num_ctas, run.gsan_enabled = 1, False
    run.global_scratch_size = run.profile_scratch_size = 0
    run.global_scratch_align = run.profile_scratch_align = 1
    run.launch_cooperative_grid = run.launch_pdl = False
    real_call = cls.__call__

    class Counted(cls):  # the real __call__, counted
        def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                     launch_enter_hook, launch_exit_hook, *args):
            record.python_calls += 1
            return real_call(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                             launch_enter_hook, launch_exit_hook, *args)
    Counted.__module__ = cls.__module__
    run.__class__ = Counted
    return run, record


def _check_direct_replay(name, raw_interpreted, monkeypatch, make_launcher):
    """A replay of ``name``'s plan whose recorded launches are ``make_launcher``'s stand-ins for Triton's
    ``CudaLauncher`` calls the C launch function itself, with each TMA descriptor already expanded, and encodes an
    address seen before only once. Same bits as the ordinary launches."""
    ran, drivers = [], []

    def remember(self, key, compiled, constexprs):
        names, dtypes = list(constexprs), {}

        def first(gx, gy, gz, stream, function, packed, metadata, enter, leave, *args):
            runtime = args[:len(args) - len(names)]
            for i, a in enumerate(runtime):
                if isinstance(a, torch.Tensor):
                    dtypes[i] = ("ptr", a.dtype)
                elif isinstance(getattr(a, "base", None), torch.Tensor):
                    dtypes[i] = ("desc", a.base.dtype)
            ran.append(self.kernel)
            self.kernel[(gx, gy, gz)](*runtime, **dict(zip(names, args[len(args) - len(names):])))
            if not isinstance(self._compiled[key][0], tuple):
                run, module = make_launcher(raw_interpreted, self.kernel, names, dtypes, ran)
                drivers.append(module)
                self._compiled[key] = (run, FUNCTION, PACKED)
        self._compiled[key] = (first, None, None)
    monkeypatch.setattr(TritonLauncher, "_remember", remember)
    plan, call = _w8a8(name)
    # the first call compiles (the stand-ins record the argument kinds), the second is recorded with the fakes
    call(_inputs("tensor", 19, 1))
    call(_inputs("tensor", 19, 2))
    (_, replay), = plan.replays.entries.items()
    assert isinstance(replay, LaunchReplay)
    assert all(launcher._direct_launch(step[0], step[6]) is not None for step in replay.steps)
    replay.fn = launcher._compile_replay(replay, raw_pointers=True)  # as a CUDA device's replay is made
    weights = call.__defaults__[0]
    raw_interpreted.add(*weights.values())
    n_descriptors = sum(kind == 2 for step in replay.steps for kind, _, _ in step[6])
    for seed in (3, 4):
        x = _inputs("tensor", 19, seed)
        raw_interpreted.add(x)
        before, encoded, python = len(ran), sum(len(d.encoded) for d in drivers), sum(d.python_calls for d in drivers)
        replayed = call(x)
        assert len(ran) - before == 2, "both kernels ran through the stand-in C launch"
        assert sum(d.python_calls for d in drivers) == python, "not through the launcher's Python"
        new = [a for d in drivers for a in d.encoded][encoded:]
        if seed == 3:
            assert len(new) == n_descriptors
            weight_described = weights["weight"].data_ptr() in new
            assert weight_described == (n_descriptors > 0)
        else:  # the weight's descriptor is the one encoded before (the codes' and output's may be new addresses)
            assert weights["weight"].data_ptr() not in new and len(new) <= max(0, n_descriptors - 1)
        assert torch.equal(replayed, _ordinary(plan, x, call))
    return drivers


FUNCTION, PACKED = object(), object()  # a compiled kernel's function handle and packed metadata, as recorded
DIRECT = ["int8-pointer", "convrot-tma-persistent-sub", "hadanorm-split-k-tma"]


@pytest.mark.parametrize("name", DIRECT)
def test_a_direct_replay_calls_the_c_launch_and_encodes_each_descriptor_once_per_address(name, raw_interpreted,
                                                                                           monkeypatch):
    """Triton 3.6's launcher (a stand-in of its shape: the C function is made for the kernel)."""
    _check_direct_replay(name, raw_interpreted, monkeypatch, _fake_triton36_driver)


@pytest.mark.parametrize("name", DIRECT)
def test_a_direct_replay_calls_triton37_generic_c_launch(name, raw_interpreted, monkeypatch):
    """Triton 3.7's launcher (a stand-in of its shape: the generic C function, 3.7's descriptor wrapper)."""
    _check_direct_replay(name, raw_interpreted, monkeypatch, _fake_triton37_driver)


@pytest.mark.parametrize("name", DIRECT)
def test_a_direct_replay_calls_triton_generic_c_launch(name, raw_interpreted, monkeypatch):
    """Triton 3.7+'s launcher, the installed Triton's real class and descriptor wrapper: its recorded launches ran
    through the real ``__call__`` (which hands the C function the annotations, the signature and the arguments
    as one tuple); the replays do not."""
    import triton.runtime

    monkeypatch.setattr(triton.runtime.driver, "_active", object())  # what __call__ looks up first (no GPU here)
    drivers = _check_direct_replay(name, raw_interpreted, monkeypatch, _generic_triton_launcher)
    assert sum(d.python_calls for d in drivers) >= 2, "the recorded (and ordinary) calls went through the real __call__"


def test_an_unknown_launcher_is_called_as_it_is():
    """A launcher of neither known form, or one that needs scratch memory, is not bypassed."""
    class Other:
        global_scratch_size = profile_scratch_size = 0

        def __call__(self, grid, stream, *args):
            pass

    assert launcher._direct_launch(Other(), ()) is None
    run, _ = _generic_launcher_without_kernel()
    assert launcher._direct_launch(run, ()) is not None
    run.global_scratch_size = 128
    assert launcher._direct_launch(run, ()) is None
    run.global_scratch_size, run.gsan_enabled = 0, True
    assert launcher._direct_launch(run, ()) is None


def _generic_launcher_without_kernel():
    def kernel():
        pass
    kernel.arg_names = []
    return _generic_triton_launcher(Addresses(), kernel, [], {}, [])
