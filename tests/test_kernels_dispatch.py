"""Backend selection and the measured dispatcher: forcing, caching to JSON, choosing by measurement,
and recording why a backend is missing."""

from __future__ import annotations

from kernels_helpers import randint8, randn

import json
import logging

import pytest
import torch

from lowbit.kernels import backend as backend_mod
from lowbit.kernels import dispatch
from lowbit.kernels.backend import Backend, BackendUnavailableError, active_backend, force_backend
from lowbit.kernels.dispatch import CACHE_VERSION, DispatchKey, Dispatcher, m_bucket, use_dispatcher
from lowbit.kernels.int8_gemm import int8_linear

KEY = DispatchKey("int8", (9, 0), 256, 3072, 3072)


def test_force_backend_nests_and_restores():
    assert active_backend() is Backend.AUTO
    with force_backend("eager"):
        assert active_backend() is Backend.EAGER
        with force_backend(Backend.TRITON):
            assert active_backend() is Backend.TRITON
        assert active_backend() is Backend.EAGER
    assert active_backend() is Backend.AUTO
    with pytest.raises(ValueError):
        with force_backend("cuda-magic"):
            pass


def test_m_buckets():
    assert [m_bucket(m) for m in (1, 16, 17, 256, 257, 4096, 5000, 16384, 10**6)] == \
        [16, 16, 32, 256, 512, 4096, 8192, 16384, 32768]
    assert KEY.as_str() == "int8|sm90|m256|n3072|k3072"


def _measuring(monkeypatch, timings):
    """A dispatcher that 'measures' on the CPU with fixed timings (µs) per candidate name."""
    d = Dispatcher(repeats=1, warmup=0)
    monkeypatch.setattr(Dispatcher, "_can_measure", lambda self, device: True)

    def fake_time(fn, warmup, repeats):
        return timings[fn()]
    monkeypatch.setattr(dispatch, "_time_us", fake_time)
    return d


def _gpu_timing(monkeypatch, gpu):
    """Fixed GPU-only timings (µs) per candidate name; returns the names that were GPU-timed."""
    asked = []

    def fake_gpu_time(fn, repeats):
        name = fn()
        asked.append(name)
        if name not in gpu:
            raise RuntimeError("no GPU time")
        return gpu[name]
    monkeypatch.setattr(dispatch, "_gpu_time_us", fake_gpu_time)
    return asked


def test_a_sustained_tie_goes_to_the_least_gpu_time(monkeypatch, tmp_path):
    """Host-bound calls time alike; among those within 5 % of the fastest, the GPU time decides."""
    d = _measuring(monkeypatch, {"a": 30.0, "b": 31.0, "c": 40.0})
    asked = _gpu_timing(monkeypatch, {"a": 19.0, "b": 10.0, "c": 5.0})
    d.cache_path = tmp_path / "dispatch.json"
    assert d.choose(KEY, {n: (lambda n=n: n) for n in "abc"}, torch.device("cpu")) == "b"
    assert sorted(asked) == ["a", "b"]  # c is 33 % slower sustained: not a tie, never GPU-timed
    data = json.loads(d.cache_path.read_text())
    assert data["gpu_timings_us"] == {KEY.as_str(): {"a": 19.0, "b": 10.0}}
    assert Dispatcher(cache_path=d.cache_path).gpu_timings_us == data["gpu_timings_us"]


def test_a_gpu_tie_across_backends_goes_to_the_least_host_time(monkeypatch, tmp_path):
    """GPU times of different backends within 5 % of the least (a weight-bound product): the backend that
    enqueues its work with the least CPU time wins, with its fastest config; only each backend's fastest
    GPU-tied candidate is host-timed (configs of one backend launch alike); the host times are kept."""
    names = ("kitchen", "triton:a", "triton:b", "triton:c")
    d = _measuring(monkeypatch, {"kitchen": 30.0, "triton:a": 31.0, "triton:b": 31.5, "triton:c": 32.0})
    _gpu_timing(monkeypatch, {"kitchen": 10.0, "triton:a": 10.4, "triton:b": 10.2, "triton:c": 12.0})
    hosted = []

    def fake_host_time(fn, repeats):
        name = fn()
        hosted.append(name)
        return {"kitchen": 90.0, "triton:a": 1.0, "triton:b": 25.0, "triton:c": 5.0}[name]

    monkeypatch.setattr(dispatch, "_host_time_us", fake_host_time)
    d.cache_path = tmp_path / "dispatch.json"
    assert d.choose(KEY, {n: (lambda n=n: n) for n in names}, torch.device("cpu")) == "triton:b"
    assert sorted(hosted) == ["kitchen", "triton:b"]  # triton:c is 20 % slower on the GPU; a is b's backend
    data = json.loads(d.cache_path.read_text())
    assert data["host_timings_us"] == {KEY.as_str(): {"kitchen": 90.0, "triton:b": 25.0}}
    assert Dispatcher(cache_path=d.cache_path).host_timings_us == data["host_timings_us"]

    hosted.clear()  # one backend alone within the GPU tie: its least sustained time there, nothing host-timed
    d = _measuring(monkeypatch, {"triton:a": 31.5, "triton:b": 31.0, "kitchen": 30.0})
    _gpu_timing(monkeypatch, {"triton:a": 10.2, "triton:b": 10.4, "kitchen": 20.0})
    assert d.choose(KEY, {n: (lambda n=n: n) for n in names[:3]}, torch.device("cpu")) == "triton:b" and not hosted

    def no_host_time(fn, repeats):
        raise RuntimeError("no host time")

    d = _measuring(monkeypatch, {"kitchen": 30.0, "triton:a": 31.0})
    _gpu_timing(monkeypatch, {"kitchen": 10.0, "triton:a": 10.4})
    monkeypatch.setattr(dispatch, "_host_time_us", no_host_time)  # the GPU time's choice stands
    assert d.choose(KEY, {n: (lambda n=n: n) for n in names[:2]}, torch.device("cpu")) == "kitchen"
    d = _measuring(monkeypatch, {"kitchen": 30.0, "triton:a": 31.0})
    _gpu_timing(monkeypatch, {"kitchen": 10.0, "triton:a": 10.4})
    monkeypatch.setattr(dispatch, "_host_time_us", fake_host_time)
    d.gpu_tie = 0.0  # switched off: the least GPU time, as before
    assert d.choose(KEY, {n: (lambda n=n: n) for n in names[:2]}, torch.device("cpu")) == "kitchen"


def test_the_fastest_backends_configs_are_gpu_timed_within_the_wider_tie(monkeypatch):
    """A host-bound call's sustained times of one backend's configs can spread by noise: those within
    ``backend_tie`` (25 %) of the fastest are GPU-timed too, another backend's only within ``tie``."""
    timings = {"triton:lucky": 30.0, "triton:b": 36.0, "triton:far": 40.0, "kitchen": 36.0}
    d = _measuring(monkeypatch, timings)
    asked = _gpu_timing(monkeypatch, {"triton:lucky": 20.0, "triton:b": 10.0, "triton:far": 1.0, "kitchen": 1.0})
    names = {n: (lambda n=n: n) for n in timings}
    assert d.choose(KEY, names, torch.device("cpu")) == "triton:b"
    assert sorted(asked) == ["triton:b", "triton:lucky"]  # far: 33 % slower; kitchen: another backend, 20 %
    d = _measuring(monkeypatch, timings)
    asked = _gpu_timing(monkeypatch, {"triton:lucky": 20.0, "triton:b": 10.0})
    d.backend_tie = 0.0  # switched off: no tie at all, the sustained fastest
    assert d.choose(KEY, names, torch.device("cpu")) == "triton:lucky" and asked == []


def test_a_reading_outside_the_ties_gets_a_second_look(monkeypatch):
    """Host noise only adds time: a candidate read outside the ties but under twice the fastest is measured once
    more and keeps the lesser reading, so one inflated reading cannot keep it from the GPU-time tie-break; one
    read twice as slow or slower is not measured again, and a second reading that fails keeps the first."""
    readings = {"triton:a": [30.0], "triton:noisy": [50.0, 31.0], "triton:slow": [60.0, 1.0]}
    timed = []

    def fake_time(fn, warmup, repeats):
        name = fn()
        timed.append(name)
        values = readings[name]
        return values.pop(0) if len(values) > 1 else values[0]

    d = Dispatcher(repeats=1, warmup=0)
    monkeypatch.setattr(Dispatcher, "_can_measure", lambda self, device: True)
    monkeypatch.setattr(dispatch, "_time_us", fake_time)
    asked = _gpu_timing(monkeypatch, {"triton:a": 19.0, "triton:noisy": 10.0, "triton:slow": 1.0})
    assert d.choose(KEY, {n: (lambda n=n: n) for n in readings}, torch.device("cpu")) == "triton:noisy"
    assert sorted(timed) == ["triton:a", "triton:noisy", "triton:noisy", "triton:slow"]
    assert sorted(asked) == ["triton:a", "triton:noisy"]
    assert d.timings_us[KEY.as_str()] == {"triton:a": 30.0, "triton:noisy": 31.0, "triton:slow": 60.0}

    d = Dispatcher(repeats=1, warmup=0)
    calls = []

    def failing_second(fn, warmup, repeats):
        name = fn()
        calls.append(name)
        if name == "triton:noisy" and calls.count(name) > 1:
            raise RuntimeError("gone")
        return {"triton:a": 30.0, "triton:noisy": 50.0}[name]

    monkeypatch.setattr(dispatch, "_time_us", failing_second)
    assert d.choose(KEY, {n: (lambda n=n: n) for n in ("triton:a", "triton:noisy")}, torch.device("cpu")) == "triton:a"
    assert d.timings_us[KEY.as_str()]["triton:noisy"] == 50.0
    d = Dispatcher(repeats=1, warmup=0, recheck=0.0)  # switched off: one reading each
    calls.clear()
    assert d.choose(KEY, {n: (lambda n=n: n) for n in ("triton:a", "triton:noisy")}, torch.device("cpu")) == "triton:a"
    assert sorted(calls) == ["triton:a", "triton:noisy"]


def test_gpu_tied_configs_go_to_the_least_sustained_time(monkeypatch):
    """Within ``gpu_tie`` (5 %) of the least GPU time, the least sustained time wins (a config 1 % faster on
    the GPU but slower to launch loses); a config more than 5 % faster on the GPU still wins."""
    d = _measuring(monkeypatch, {"triton:plain": 58.0, "triton:tma": 66.0})
    _gpu_timing(monkeypatch, {"triton:plain": 14.1, "triton:tma": 13.9})
    assert d.choose(KEY, {n: (lambda n=n: n) for n in ("triton:plain", "triton:tma")}, torch.device("cpu")) \
        == "triton:plain"
    d = _measuring(monkeypatch, {"triton:plain": 58.0, "triton:tma": 66.0})
    _gpu_timing(monkeypatch, {"triton:plain": 14.1, "triton:tma": 12.0})
    assert d.choose(KEY, {n: (lambda n=n: n) for n in ("triton:plain", "triton:tma")}, torch.device("cpu")) \
        == "triton:tma"


def test_no_tie_no_gpu_timing_and_a_failed_gpu_timing_keeps_the_sustained_choice(monkeypatch):
    d = _measuring(monkeypatch, {"a": 30.0, "b": 10.0})
    asked = _gpu_timing(monkeypatch, {"a": 1.0, "b": 50.0})
    assert d.choose(KEY, {n: (lambda n=n: n) for n in "ab"}, torch.device("cpu")) == "b" and asked == []
    d = _measuring(monkeypatch, {"a": 10.2, "b": 10.0})
    asked = _gpu_timing(monkeypatch, {"a": 3.0})  # b cannot be GPU-timed: a is the only GPU time
    assert d.choose(KEY, {n: (lambda n=n: n) for n in "ab"}, torch.device("cpu")) == "a"
    d = _measuring(monkeypatch, {"a": 10.2, "b": 10.0})
    _gpu_timing(monkeypatch, {})  # no GPU time at all: the sustained choice stands
    assert d.choose(KEY, {n: (lambda n=n: n) for n in "ab"}, torch.device("cpu")) == "b"
    assert KEY.as_str() not in d.gpu_timings_us


def test_choose_measures_and_remembers(monkeypatch, tmp_path):
    d = _measuring(monkeypatch, {"a": 30.0, "b": 10.0, "c": 20.0})
    d.cache_path = tmp_path / "sub" / "dispatch.json"
    name = d.choose(KEY, {n: (lambda n=n: n) for n in "abc"}, torch.device("cpu"))
    assert name == "b" and d.decisions[KEY.as_str()] == "b"
    data = json.loads(d.cache_path.read_text())
    assert data["version"] == CACHE_VERSION and data["decisions"] == {KEY.as_str(): "b"}
    assert data["timings_us"][KEY.as_str()]["c"] == 20.0
    # a new dispatcher on the same file starts with the decision and measures nothing
    again = Dispatcher(cache_path=d.cache_path)
    assert again.choose(KEY, {"a": lambda: "a", "b": lambda: "b"}, torch.device("cpu")) == "b"


def test_a_measurement_times_each_candidate_through_its_steady_state_plan(monkeypatch):
    """With the plan arguments given, ``dispatch.run`` times each candidate's steady-state plan on them (what
    a model's later steps run, launch replays included), not its full path; without them, the full path."""
    timed = []
    d = Dispatcher(repeats=1, warmup=0, measure=True)
    monkeypatch.setattr(Dispatcher, "_can_measure", lambda self, device: True)

    def fake_time(fn, warmup, repeats):
        out = fn()
        timed.append(out)
        return {"plan a": 20.0, "plan b": 10.0, "full a": 5.0, "full b": 50.0}[out]
    monkeypatch.setattr(dispatch, "_time_us", fake_time)
    x = torch.zeros(256, 64)

    def make(name):
        return lambda: f"full {name}"

    def make_fast(name):
        return lambda tag, x: f"plan {name}" if tag == "args" and x.shape == (256, 64) else "wrong"

    with use_dispatcher(d):
        out = dispatch.run("int8", x, 32, lambda: ["a", "b"], make, dict, ("key",), make_fast, ("args", x))
    assert sorted(timed) == ["plan a", "plan b"] and d.decisions["int8|sm00|m256|n32|k64"] == "b"
    assert out == "full b"  # this call itself: the chosen candidate's full path (its plan is registered)
    d = Dispatcher(repeats=1, warmup=0, measure=True)
    timed.clear()
    with use_dispatcher(d):
        dispatch.run("int8", x, 32, lambda: ["a", "b"], make, dict, ("key",), make_fast)
    assert sorted(timed) == ["full a", "full b"] and d.decisions["int8|sm00|m256|n32|k64"] == "a"


def test_failing_candidates_are_recorded_not_raised(monkeypatch):
    d = _measuring(monkeypatch, {"ok": 5.0})

    def broken():
        raise RuntimeError("no such kernel here")
    assert d.choose(KEY, {"broken": broken, "ok": lambda: "ok"}, torch.device("cpu")) == "ok"
    assert "no such kernel" in d.failures[KEY.as_str()]["broken"]
    with pytest.raises(BackendUnavailableError, match="every implementation failed"):
        d.choose(DispatchKey("x", (9, 0), 16, 1, 1), {"broken": broken, "also": broken}, torch.device("cpu"))


def test_without_cuda_the_first_candidate_runs_unmeasured():
    d = Dispatcher()
    assert d.choose(KEY, {"first": lambda: 1 / 0, "second": lambda: 1 / 0}, torch.device("cpu")) == "first"
    assert d.decisions == {}


def test_unreadable_or_old_cache_is_ignored(tmp_path, caplog):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert Dispatcher(cache_path=bad).decisions == {}
    assert "unreadable" in caplog.text
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"version": CACHE_VERSION + 1, "decisions": {"k": "v"}}))
    assert Dispatcher(cache_path=old).decisions == {}


@pytest.mark.parametrize("version, dropped, kept, rows", [
    # before the 16-row tiles (M <= 32), the row bands (17 <= M <= 512) and weight-only few rows (M <= 16)
    (2, ("int8|sm90|m16|n18432|k3072", "w4a8|sm90|m32|n9216|k3072", "int8|sm90|m256|n3072|k3072",
         "w4a4/a4|sm90|m512|n3072|k12288"), ("int8|sm90|m1024|n3072|k3072", "fp8_rowwise|sm90|m4096|n3072|k3072"),
     "0 < M <= 512"),
    # before the row bands and weight-only few rows
    (3, ("int8|sm90|m16|n18432|k3072", "w4a8|sm90|m32|n9216|k3072", "int8|sm90|m64|n3072|k3072",
         "w4a4/a4|sm90|m512|n3072|k12288"), ("int8|sm90|m1024|n3072|k3072",), "0 < M <= 512"),
    # before weight-only few rows only: M > 16 keeps its choices
    (4, ("int8|sm90|m16|n18432|k3072", "fp8_rowwise|sm90|m16|n3072|k3072"),
     ("w4a8|sm90|m32|n9216|k3072", "int8|sm90|m64|n3072|k3072", "int8|sm90|m1024|n3072|k3072"), "0 < M <= 16"),
])
def test_older_cache_measures_the_changed_buckets_again(tmp_path, caplog, version, dropped, kept, rows):
    """An older file keeps its choices for the M buckets whose candidates did not change since; the others
    are measured again (and the file is rewritten as the current version)."""
    old = tmp_path / f"v{version}.json"
    keys = dropped + kept
    old.write_text(json.dumps({"version": version, "decisions": {k: f"triton:{i}" for i, k in enumerate(keys)},
                               "timings_us": {k: {f"triton:{i}": 1.0 + i} for i, k in enumerate(keys)},
                               "gpu_timings_us": {dropped[0]: {"triton:0": 1.0}}, "broken": {}}))
    with caplog.at_level(logging.INFO, logger="lowbit.kernels.dispatch"):
        d = Dispatcher(cache_path=old)
    assert d.decisions == {k: f"triton:{keys.index(k)}" for k in kept}
    assert set(d.timings_us) == set(kept) and d.gpu_timings_us == {}
    assert "measured again" in caplog.text
    assert rows in caplog.text
    d.save()
    data = json.loads(old.read_text())
    assert data["version"] == CACHE_VERSION == 5 and set(data["decisions"]) == set(kept)


def test_older_cache_buckets_to_measure_again_are_real_buckets():
    """Every bucket a version bump measures again is one the dispatcher keys by; the current version has none."""
    from lowbit.kernels.dispatch import M_BUCKETS, REMEASURED

    assert CACHE_VERSION not in REMEASURED
    for buckets in REMEASURED.values():
        assert set(buckets) <= set(M_BUCKETS)
        assert all(m_bucket(b) == b for b in buckets)


def test_linear_uses_the_cached_choice_and_recovers_from_a_stale_one():
    x, w = randn(4, 64, seed=1, dtype=torch.bfloat16), randint8(8, 64, seed=2)
    scale = torch.full((8, 1), 1e-2)
    key = DispatchKey("int8", (0, 0), 16, 8, 64).as_str()
    d = Dispatcher(decisions={key: "dequant"})
    with use_dispatcher(d):
        dequant = int8_linear(x, w, scale)
    with force_backend(Backend.DEQUANT):
        assert torch.equal(dequant, int8_linear(x, w, scale))
    stale = Dispatcher(decisions={key: "triton:999x1x1-g1-w1-s1"})
    with use_dispatcher(stale):
        out = int8_linear(x, w, scale)  # the stale name fails, is dropped, and the call still answers
    assert key not in stale.decisions and out.shape == (4, 8)


def test_forcing_an_unavailable_backend_says_why(monkeypatch):
    x, w = randn(4, 64, seed=1, dtype=torch.bfloat16), torch.zeros(8, 64).to(torch.float8_e4m3fn)
    from lowbit.kernels.fp8_gemm import fp8_rowwise_linear

    with force_backend(Backend.KITCHEN), pytest.raises(BackendUnavailableError, match="kitchen"):
        fp8_rowwise_linear(x, w, torch.ones(8, 1))


def test_missing_triton_is_recorded_not_raised(monkeypatch):
    backend_mod.triton_status.cache_clear()
    monkeypatch.setitem(__import__("sys").modules, "triton", None)  # "import triton" now fails
    try:
        status = backend_mod.triton_status()
        assert not status.available and "cannot be imported" in status.reason
        assert "cannot be imported" in backend_mod.triton_problem(torch.device("cpu"))
        x, w = randn(4, 64, seed=1, dtype=torch.bfloat16), randint8(8, 64, seed=2)
        out = int8_linear(x, w, torch.full((8, 1), 1e-2))  # AUTO still answers, without Triton
        assert out.shape == (4, 8)
        with force_backend(Backend.TRITON), pytest.raises(BackendUnavailableError, match="cannot be imported"):
            int8_linear(x, w, torch.full((8, 1), 1e-2))
    finally:
        backend_mod.triton_status.cache_clear()


def test_triton_problem_explains_old_gpus(monkeypatch):
    monkeypatch.setattr(backend_mod, "capability", lambda device: (7, 5))
    assert "8.0" in backend_mod.triton_problem(torch.device("cuda", 0))
    monkeypatch.setattr(backend_mod, "capability", lambda device: (8, 6))
    assert backend_mod.triton_problem(torch.device("cuda", 0)) is None
    assert "8.9" in backend_mod.triton_problem(torch.device("cuda", 0), needs_fp8=True)
