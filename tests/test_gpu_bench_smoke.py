"""The whole-model GPU measurement scripts in ``tests/gpu`` run end to end at ``--size tiny --device cpu``.

Each script runs in its own process (as the GPU runs will), the three at once, one CPU thread each;
the test reads the JSON report each one wrote and checks that its measurements are there, finite, and
say what they must on any device (a LoRA changes the output and a Stochastic merge lands near Dynamic;
a compiled block class is one graph and never recompiles; the calibrated model is no larger than
int4_mixed). Speeds are not asserted: CPU timings of a tiny model say nothing.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

GPU_DIR = Path(__file__).resolve().parent / "gpu"
COMMON = ["--size", "tiny", "--device", "cpu", "--iters", "1", "--warmup", "1", "--attention", "pytorch"]
SCRIPTS = {
    "lora": ["bench_lora_step.py"],
    "compile": ["bench_compile_step.py", "--backend", "aot_eager", "--modes", "bf16", "int8_convrot"],
    "calibrate": ["bench_calibrate.py", "--steps", "1", "--resolution", "64", "--smoothing", "off",
                  "--eval-inputs", "2"],
}
TIMEOUT_S = 240


def _comfyui() -> Path | None:
    path = Path(os.environ.get("COMFYUI_PATH") or Path("~/ComfyUI").expanduser())
    return path if (path / "comfy" / "ops.py").is_file() else None


pytestmark = pytest.mark.skipif(_comfyui() is None, reason="ComfyUI not found: set COMFYUI_PATH to a ComfyUI "
                                                           "checkout (or clone it to ~/ComfyUI)")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{name: (exit code, output, report dict or None, report path)}`` of the three scripts, run concurrently."""
    out = tmp_path_factory.mktemp("gpu_bench_smoke")
    env = {**os.environ, "COMFYUI_PATH": str(_comfyui()), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = {}
    for name, (script, *extra) in SCRIPTS.items():
        cmd = [sys.executable, str(GPU_DIR / script), *COMMON, *extra, "--out", str(out / f"{name}.json")]
        procs[name] = subprocess.Popen(cmd, cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)
    results = {}
    for name, proc in procs.items():
        try:
            output, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        path = out / f"{name}.json"
        results[name] = (proc.returncode, output, json.loads(path.read_text()) if path.is_file() else None, path)
    return results


def _report(runs, name) -> dict:
    code, output, report, _ = runs[name]
    assert code == 0, f"{name} failed (exit {code}):\n{output[-4000:]}"
    assert report is not None, f"{name} wrote no JSON report"
    assert "JSON report: " in output and f"{name}.json" in output, "the script must print its report's path"
    _assert_finite(report, name)
    return report


def _assert_finite(value, where: str) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _assert_finite(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _assert_finite(item, f"{where}[{i}]")
    elif isinstance(value, float):
        assert math.isfinite(value), f"{where} is {value}"


def test_lora_step_overheads(runs):
    report = _report(runs, "lora")
    assert report["bf16_step_ms"] > 0 and report["lora_layers"] == 26  # 2 double x 10 + 2 single x 3 linears
    row = report["formats"]["int8_convrot"]
    assert "error" not in row
    for label in ("none", "stochastic_4", "dynamic_1", "dynamic_4"):
        assert row[label]["step_ms"] > 0 and row[label]["load_s"] >= 0
    for label in ("stochastic_4", "dynamic_1", "dynamic_4"):
        assert "overhead_pct" in row[label]
    assert row["stochastic_4"]["layers_merged"] == 26 and row["stochastic_4"]["apply_s"] > 0
    assert row["dynamic_1"]["banks"] == row["dynamic_4"]["banks"] == 26
    assert row["dynamic_4"]["bank_mb"] == pytest.approx(4 * row["dynamic_1"]["bank_mb"])
    summary = row["summary"]
    assert summary["lora_effect_rel"] > 0.02, "four LoRAs at strength 1 must change the output"
    # merging rounds once per weight: the merged model lands far nearer Dynamic than the LoRAs move it
    assert summary["stochastic_vs_dynamic_rel"] < summary["lora_effect_rel"] / 2


def test_compile_step_per_mode(runs):
    report = _report(runs, "compile")
    assert report["compile"]["backend"] == "aot_eager" and report["compile"]["scope"] == "blocks"
    for mode in ("bf16", "int8_convrot"):
        row = report["modes"][mode]
        assert "error" not in row and row["failure"] is None
        # a quantized model's blocks are the per-model subclasses that make q, k, v in one pass
        prefix = "" if mode == "bf16" else "LowBit"
        assert row["regions"] == [f"{prefix}DoubleStreamBlock", f"{prefix}SingleStreamBlock"]
        assert row["graphs_first_call"] == 2, "each block class must compile to one graph shared by its blocks"
        assert row["recompiles"] == 0
        assert row["compiled_vs_eager_rel"] == 0.0  # aot_eager changes no numerics
        assert row["first_call_s"] > 0 and row["compiled_step_ms"] > 0 and row["eager_step_ms"] > 0
    assert report["modes"]["bf16"]["speedup_vs_compiled_bf16"] == pytest.approx(1.0)
    assert 0 < report["modes"]["int8_convrot"]["compiled_rel_err_vs_bf16"] < 0.2
    assert report["summary"]["best"] == "int8_convrot" and "target_met" in report["summary"]


def test_calibration_against_int4_mixed(runs):
    from lowbit.quant.calibrate import load_policy_file

    report = _report(runs, "calibrate")
    int4, calibrated = report["results"]["int4_mixed"], report["results"]["calibrated"]
    assert report["calibration"]["seconds"] > 0 and report["calibration"]["objective"] == "model_output"
    assert report["calibration"]["budget_bytes"] + report["calibration"]["fixed_bytes"] == int4["bytes"]
    assert calibrated["bytes"] <= int4["bytes"] < report["bf16_bytes"]
    assert calibrated["bytes"] == report["calibration"]["planned_total_bytes"]
    assert sum(calibrated["formats"].values()) == sum(int4["formats"].values()) == report["calibration"]["layers"]
    for row in (int4, calibrated):
        assert 0 < row["rel_err"] < 1 and len(row["rel_err_per_call"]) == 2
    summary = report["summary"]
    assert summary["calibrated_fits_int4_mixed_bytes"] is True
    assert summary["error_ratio_calibrated_over_int4_mixed"] == pytest.approx(calibrated["rel_err"] / int4["rel_err"])
    # recorded by name only, next to the report (no machine path in a measurement record)
    policy, calibration = load_policy_file(runs["calibrate"][3].parent / report["calibration"]["policy_file"])
    assert calibration is not None and len(policy.layer_format_map) == report["calibration"]["layers"]


def test_profile_groups_cublas_nvjet_kernels_as_gemm(monkeypatch):
    """``profile_flux_step`` files each CUDA kernel under a category; cuBLAS's Hopper GEMMs are named
    ``nvjet_sm90_*`` (bf16 ``F.linear`` and FP8 ``_scaled_mm``) and must count as GEMM time."""
    monkeypatch.syspath_prepend(str(GPU_DIR))
    from profile_flux_step import category

    assert category("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN") == "gemm"
    assert category("nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_bias_TNT") == "gemm"
    assert category("_w8a8_mm_persistent_kernel") == "gemm"
    assert category("_act_quant_pieces_kernel") == "act_quant"
    assert category("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x") == "attention"
    assert category("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16>") == "other"


def test_flux_error_breakdown_groups_partition_the_quantized_layers(tmp_path):
    """``diag_flux_error.py`` at the tiny size: every variant ran (the modulation run weights-only too), the layer
    groups split the quantized layers exactly (``only:<g>`` counts add up to ``all``, ``all_but:<g>`` is the
    rest), keeping layers in bf16 never quantizes more of them, and the bf16 model is close to its fp32 copy."""
    out = tmp_path / "err.json"
    env = {**os.environ, "COMFYUI_PATH": str(_comfyui()), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(GPU_DIR / "diag_flux_error.py"), "--size", "tiny", "--device", "cpu",
                           "--modes", "int8_convrot", "--attention-backend", "math", "--fp32", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())
    _assert_finite(report, "diag")
    rows = report["modes"]["int8_convrot"]
    assert all("error" not in row for row in rows.values()), rows
    total = rows["all"]["quantized_layers"]
    groups = list(report["groups"])
    assert total > 0 and rows["weights_only"]["quantized_layers"] == total
    assert sum(rows[f"only:{g}"]["quantized_layers"] for g in groups) == total
    for g in groups:
        assert rows[f"only:{g}"]["quantized_layers"] > 0
        assert rows[f"all_but:{g}"]["quantized_layers"] == total - rows[f"only:{g}"]["quantized_layers"]
    # the modulation linears alone by the dequant backend: every layer (or the modulation's alone) quantized, the
    # modulation's run otherwise than in "all" (a different output)
    mod = rows["only:mod"]["quantized_layers"]
    forced, forced_alone = rows["weights_only:mod"], rows["only:mod+weights_only"]
    assert forced["quantized_layers"] == total and forced["weights_only_layers"] == mod
    assert forced_alone["quantized_layers"] == mod == forced_alone["weights_only_layers"]
    assert forced["rel_err"] != rows["all"]["rel_err"] and forced_alone["rel_err"] != rows["only:mod"]["rel_err"]
    assert all(row["rel_err"] > 0 for row in rows.values()) and report["bf16_self"] >= 0
    # bf16 against its fp32 copy, both embedding the same timestep and guidance: a rounding-sized error
    assert 0 < report["bf16_vs_fp32"] < 0.05


def test_gptq_diag_swaps_every_quantized_layer_and_changes_the_output(tmp_path):
    """``diag_gptq_flux.py`` at the tiny size: the calibration forward saw every quantized layer (the modulation
    linears one row per sample), the GPTQ models hold a rounded weight in every quantized layer (all but the
    modulation's for ``gptq_but_mod``), and GPTQ's output differs from round-to-nearest's."""
    out = tmp_path / "gptq.json"
    env = {**os.environ, "COMFYUI_PATH": str(_comfyui()), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(GPU_DIR / "diag_gptq_flux.py"), "--size", "tiny", "--device", "cpu",
                           "--modes", "int8_convrot", "--calib", "3", "--sequential", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())
    _assert_finite(report, "gptq diag")
    row = report["modes"]["int8_convrot"]
    assert report["rows_per_layer"]["min"] == 3 and report["sequential"] is True
    assert row["gptq_layers"] > row["gptq_but_mod_layers"] > 0
    assert row["gptq"] != row["rtn"] and row["gptq_weights_only"] != row["rtn_weights_only"]
    assert all(row[k] > 0 for k in ("rtn", "gptq", "gptq_but_mod", "rtn_weights_only", "gptq_weights_only"))


def test_flux_step_bench_interleaves_modes_and_switches_the_input_fusion_off(tmp_path):
    """``bench_flux_step``: a ``+unfused`` mode is quantized with ``fuse_inputs=False`` (``+noreplay``: launch
    replays off; ``+floatmods``: modulation linears kept in bf16; ``+actmods``: a dispatcher without the few-row weight-only
    kernel; ``+absmax``: kitchen's w4a4 scales; ``+noqkv``: the
    blocks keep ComfyUI's forward), and ``--rounds``
    times every kept mode again, each step's GPU and host time recorded (same output either way)."""
    out = tmp_path / "step.json"
    env = {**os.environ, "COMFYUI_PATH": str(_comfyui()), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(GPU_DIR / "bench_flux_step.py"), "--size", "tiny", "--device", "cpu", "--iters", "1",
           "--modes", "int8_convrot", "int8_convrot+unfused", "int8_convrot+noreplay", "int8_convrot+floatmods", "w4a4",
           "w4a4+absmax", "int8_convrot+noqkv", "int8_convrot+actmods", "--rounds", "2",
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    _assert_finite(report, "step")
    fused, unfused = report["modes"]["int8_convrot"], report["modes"]["int8_convrot+unfused"]
    no_replay = report["modes"]["int8_convrot+noreplay"]
    assert fused["fuse_inputs"] is True and unfused["fuse_inputs"] is False and no_replay["fuse_inputs"] is True
    blocks = 4  # the tiny Flux's two double and two single blocks
    assert (fused["one_pass_qkv_blocks"], unfused["one_pass_qkv_blocks"]) == (blocks, 0)
    assert report["modes"]["int8_convrot+noqkv"]["one_pass_qkv_blocks"] == 0
    assert report["modes"]["int8_convrot+noqkv"]["rel_err"] == fused["rel_err"]  # no Triton on this CPU: same forward
    assert no_replay["rel_err"] == fused["rel_err"], "launch replays change no bits"
    # the CPU offers no weight-only kernel (no interpreter here): its own dispatcher, the same forward
    assert report["modes"]["int8_convrot+actmods"]["rel_err"] == fused["rel_err"]
    float_mods = report["modes"]["int8_convrot+floatmods"]
    assert float_mods["extra_keep_float"] and float_mods["weight_bytes"] > fused["weight_bytes"]
    for row in (fused, unfused, no_replay):
        assert len(row["step_s_interleaved_all"]) == 2 and len(row["host_s_interleaved_all"]) == 2
        assert len(row["step_s_interleaved_cold_all"]) == 2 and row["speedup_interleaved_cold"] > 0
        assert row["speedup_interleaved"] > 0
    assert fused["rel_err"] == pytest.approx(unfused["rel_err"], rel=1e-3)
    searched, absmax = report["modes"]["w4a4"], report["modes"]["w4a4+absmax"]
    assert (searched["w4a4_scales"], absmax["w4a4_scales"], fused["w4a4_scales"]) == ("mse", "absmax", "mse")
    assert searched["rel_err"] != absmax["rel_err"]


def test_flux_step_bench_gptq_modes_round_through_the_gptq_node(tmp_path):
    """``+gptq``: the mode's model comes from the GPTQ node's core (stand-in prompts, the node's record), every
    rounded layer but the float modulation's with ``+floatmods``, and its output is not round-to-nearest's."""
    out = tmp_path / "step.json"
    env = {**os.environ, "COMFYUI_PATH": str(_comfyui()), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(GPU_DIR / "bench_flux_step.py"), "--size", "tiny", "--device", "cpu", "--iters", "1",
           "--modes", "int8_convrot", "int8_convrot+gptq", "int8_convrot+gptq+floatmods", "--gptq-steps", "1",
           "--gptq-prompts", "2", "--gptq-damp", "0.05", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    _assert_finite(report, "step")
    rtn, gptq, float_mods = (report["modes"][m] for m in ("int8_convrot", "int8_convrot+gptq",
                                                          "int8_convrot+gptq+floatmods"))
    assert "gptq" not in rtn
    assert gptq["gptq"]["damp"] == 0.05 and gptq["gptq"]["steps"] == 1
    assert gptq["gptq"]["conditioning"].startswith("2 stand-in")
    blocks = 4  # the tiny Flux's two double and two single blocks: 2 + 2 + 1 + 1 modulation linears
    assert gptq["gptq"]["layers"] - float_mods["gptq"]["layers"] == 6 == 2 * 2 + blocks // 2
    assert float_mods["weight_bytes"] > gptq["weight_bytes"]
    assert gptq["rel_err"] != rtn["rel_err"] and gptq["rel_err"] > 0


@pytest.mark.parametrize("modes, message", [(["int8+dvram"], "need a CUDA device"),
                                            (["int8", "int8+nosuch"], "unknown flags ['nosuch']"),
                                            (["int8+gptq+unfused"], "no +unfused"),
                                            (["bf16+gptq"], "quantizes a format")])
def test_flux_step_bench_refuses_what_it_cannot_run_before_building_the_model(tmp_path, modes, message):
    """A mode flag it does not know, or ``+dvram`` (comfy-aimdo's Dynamic VRAM) without a GPU: a clear error
    before the model is built and nothing written."""
    out = tmp_path / "step.json"
    env = {**os.environ, "COMFYUI_PATH": str(_comfyui()), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(GPU_DIR / "bench_flux_step.py"), "--size", "tiny", "--device", "cpu", "--modes", *modes,
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
    assert "bf16 step" not in proc.stderr and not out.exists()


@pytest.mark.parametrize("script", ["sweep_small_m_gemm.py", "bench_launch_host.py", "diag_step_host.py",
                                    "sweep_w4_gluon.py"])
def test_cuda_only_scripts_refuse_without_cuda(tmp_path, script):
    """The small-M GEMM sweep (CUDA graphs), the launch-cost bench, the step host diagnosis (CUDA launches and
    events) and the Gluon W4 GEMM sweep (sm_90 only): without a GPU each says so, exits 2 and writes nothing."""
    out = tmp_path / "report.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(GPU_DIR / script), "--out", str(out)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr, proc.stderr[-2000:]
    assert not out.exists()


def test_stock_agreement_diag_reports_every_backend_and_the_stock_run(tmp_path):
    """``diag_stock_agreement.py`` on the CPU: stock ComfyUI and LowBit run the same eager numerics there,
    so stock, ``auto`` and ``kitchen`` are the same bits (infinite agreement); ``dequant`` (no activation
    quantization) is closer to float; a backend that cannot run a LowBit-only format here says why, as
    does stock."""
    out = tmp_path / "agree.json"
    env = {**os.environ, "COMFYUI_PATH": str(_comfyui()), "OMP_NUM_THREADS": "1", "LOWBIT_TEST_DEVICE": "cpu"}
    done = subprocess.run([sys.executable, str(GPU_DIR / "diag_stock_agreement.py"), "--formats", "int8_convrot",
                           "fp8_rowwise", "--seeds", "2", "--out", str(out)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["seeds"] == [0, 1] and report["kitchen_backends"]["eager"]["available"]
    int8 = report["formats"]["int8_convrot"]
    assert int8["auto_vs_stock_db"] == [math.inf, math.inf]
    assert int8["kitchen"]["vs_float_db"] == int8["stock"]["vs_float_db"] == int8["auto"]["vs_float_db"]
    assert 20 < int8["auto"]["mean"] < int8["dequant"]["mean"]
    if env.get("TRITON_INTERPRET") == "1":  # Triton's interpreter: its fp16 rotation flips a few codes
        assert int8["triton"]["vs_float_db"] != int8["auto"]["vs_float_db"]
        assert abs(int8["triton"]["mean"] - int8["auto"]["mean"]) < 1.0
    else:  # a kitchen-layout format falls back to kitchen's path when the forced backend cannot run
        assert int8["triton"]["vs_float_db"] == int8["auto"]["vs_float_db"]
    fp8 = report["formats"]["fp8_rowwise"]
    assert "lowbit_fp8_rowwise" in fp8["stock"] and "auto_vs_stock_db" not in fp8
    assert isinstance(fp8["auto"], dict) and "int8_linear" in fp8["kitchen"]


@pytest.mark.parametrize("model", ["wan", "minimax", "flux2", "zimage", "krea2", "hidream"])
def test_mlp_bench_times_stock_routed_and_unfused_int8_mlps(tmp_path, model):
    """``bench_wan_ffn.py``: the quantized MLP (Wan's GELU feed-forward, MiniMax's, Flux 2's, Z-Image's, Krea 2's and
    HiDream's SwiGLU MLPs, HiDream's as its whole MoE MLP) through ComfyUI's fused call (Wan, MiniMax), through LowBit's layers and (``--unfused``) with their input
    computed first, all against the float MLP; on the CPU all run kitchen's eager INT8 numerics, so their errors
    agree."""
    stock_call = model in ("wan", "minimax")  # the others have no fused call of ComfyUI's
    out = tmp_path / "mlp.json"
    env = {**os.environ, "COMFYUI_PATH": str(_comfyui()), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(GPU_DIR / "bench_wan_ffn.py"), "--model", model, "--device", "cpu", "--sizes", "tiny",
           "--tokens", "16", "48", "--iters", "1", "--unfused", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["tokens"]) for r in rows] == [(model, 16), (model, 48)]
    timed = ("bf16", "lowbit", "lowbit_unfused") + (("stock_fused",) if stock_call else ())
    for row in rows:
        assert ("stock_fused_us" in row) == stock_call
        assert all(math.isfinite(row[f"{m}_us"]) and row[f"{m}_us"] > 0 for m in timed)
        assert 0 < row["lowbit_err"] < 0.05
        assert row["lowbit_unfused_err"] == row["lowbit_err"]  # the CPU computes the input either way
        if stock_call:
            assert math.isclose(row["lowbit_err"], row["stock_fused_err"], rel_tol=0.05)


@pytest.mark.parametrize("script", ["bench_flux2_step.py", "bench_zimage_step.py", "bench_qwen_step.py",
                                    "bench_krea2_step.py"])
def test_fused_step_bench_times_fused_and_unfused_modes_against_bf16(tmp_path, script):
    """``bench_flux2_step.py``, ``bench_zimage_step.py``, ``bench_qwen_step.py``, ``bench_krea2_step.py``: a tiny Flux 2
    / Z-Image / Qwen-Image / Krea 2
    built by ComfyUI's loader, bf16 and a format with and without its inputs fused, and bf16 and the format with the
    Attention Backend node (the format's on the model of the mode without it); on the CPU both compute the inputs
    as written, so their outputs agree; a mode with an unknown flag is refused before anything is built."""
    out = tmp_path / "step.json"
    env = {**os.environ, "COMFYUI_PATH": str(_comfyui()), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(GPU_DIR / script), "--size", "tiny", "--device", "cpu", "--iters", "1", "--rounds", "2"]
    modes = ["int8_convrot", "int8_convrot+unfused", "int8_convrot+noswiglu", "bf16+attn", "int8_convrot+attn"]
    proc = subprocess.run(cmd + ["--modes", *modes, "--out", str(out)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["bf16", *modes]
    assert all(math.isfinite(r["step_s"]) and r["step_s"] > 0 and len(r["rounds_s"]) == 2 for r in rows.values())
    assert 0 < rows["int8_convrot"]["rel_err"] < 0.05
    assert rows["int8_convrot+noswiglu"]["rel_err"] == rows["int8_convrot"]["rel_err"]
    # Qwen-Image's fused q/k/v (the interpreter runs it; unfused models keep ComfyUI's forward): fp32 rounding apart
    assert math.isclose(rows["int8_convrot+unfused"]["rel_err"], rows["int8_convrot"]["rel_err"], rel_tol=1e-4)
    # +attn: the Attention Backend node's choice per attention shape, reported; bf16 runs it on the same model
    assert rows["bf16+attn"]["attention"] and "attention" not in rows["bf16"]
    assert rows["bf16+attn"]["rel_err"] < 1e-3
    assert [rows[m]["model"] for m in ("bf16+attn", "int8_convrot+attn", "int8_convrot+noswiglu")] == \
        ["bf16", "int8_convrot", "int8_convrot+noswiglu"]
    assert rows["int8_convrot+attn"]["attention"] and 0 < rows["int8_convrot+attn"]["rel_err"] < 0.05
    for mode in ("int8_convrot+floatmods", "bf16+unfused"):
        proc = subprocess.run(cmd + ["--modes", mode], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
        assert proc.returncode == 2 and "optionally +unfused or +noswiglu" in proc.stderr, mode


@pytest.mark.parametrize("script", ["bench_zimage_step.py", "bench_krea2_step.py"])
def test_step_bench_nonorm_quantizes_a_model_of_its_own(tmp_path, script):
    """``+nonorm`` (Z-Image, Krea 2): a quantized model of its own whose block norms keep their classes; on the CPU
    without the interpreter nothing is deferred, so its output is the fused mode's. Flux 2's bench has no such flag."""
    out = tmp_path / "step.json"
    env = {**os.environ, "COMFYUI_PATH": str(_comfyui()), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0"}
    cmd = ["--size", "tiny", "--device", "cpu", "--iters", "1", "--rounds", "1"]
    proc = subprocess.run([sys.executable, str(GPU_DIR / script), *cmd, "--modes", "fp8_rowwise", "fp8_rowwise+nonorm",
                           "--out", str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["fp8_rowwise+nonorm"]["model"] == "fp8_rowwise+nonorm"
    assert 0 < rows["fp8_rowwise+nonorm"]["rel_err"] == rows["fp8_rowwise"]["rel_err"]
    proc = subprocess.run([sys.executable, str(GPU_DIR / "bench_flux2_step.py"), *cmd, "--modes", "fp8_rowwise+nonorm"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 2


def test_qwen_step_bench_keeps_comfyuis_attention_forward_for_noqkv(tmp_path):
    """``bench_qwen_step.py --modes fmt+noqkv``: the quantized model keeps ComfyUI's own Qwen-Image attention class
    (no q/k/v made in one pass), ``bf16+qkv`` the bf16 model with it swapped in; on the CPU without the interpreter
    the fused class runs ComfyUI's forward, so the outputs agree. Misplaced flags are refused."""
    out = tmp_path / "step.json"
    env = {**os.environ, "COMFYUI_PATH": str(_comfyui()), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "0"}
    cmd = ["--size", "tiny", "--device", "cpu", "--iters", "1", "--rounds", "1"]
    proc = subprocess.run([sys.executable, str(GPU_DIR / "bench_qwen_step.py"), *cmd, "--modes", "fp8_rowwise",
                           "fp8_rowwise+noqkv", "bf16+qkv", "--out", str(out)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["fp8_rowwise+noqkv"]["model"] == "fp8_rowwise+noqkv"  # a model of its own
    assert 0 < rows["fp8_rowwise+noqkv"]["rel_err"] == rows["fp8_rowwise"]["rel_err"]
    assert rows["bf16+qkv"]["model"] == "bf16" and rows["bf16+qkv"]["rel_err"] == 0.0  # the bf16 model, swapped
    for script, mode in (("bench_flux2_step.py", "fp8_rowwise+noqkv"), ("bench_qwen_step.py", "fp8_rowwise+qkv"),
                         ("bench_qwen_step.py", "bf16+noqkv")):
        proc = subprocess.run([sys.executable, str(GPU_DIR / script), *cmd, "--modes", mode], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S)
        assert proc.returncode == 2, (script, mode)


def test_wan_step_bench_runs_stock_and_lowbit_modes_on_the_same_weights(tmp_path):
    """``bench_wan_step.py``: stock ComfyUI's native ``int8_convrot`` and LowBit's, on the same random Wan; on the
    CPU both run kitchen's eager INT8 numerics, so their errors against bf16 agree; 4-bit is further off."""
    out = tmp_path / "wan_step.json"
    env = {**os.environ, "COMFYUI_PATH": str(_comfyui()), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(GPU_DIR / "bench_wan_step.py"), "--device", "cpu", "--size", "tiny", "--blocks", "1",
           "--frames", "1", "--height", "8", "--width", "8", "--text-tokens", "8", "--iters", "1", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    modes = json.loads(out.read_text())["modes"]
    assert set(modes) == {"bf16", "stock_int8_convrot", "int8_convrot", "fp8_rowwise", "w4a4"}
    assert modes["bf16"]["error"] == 0 and modes["bf16"]["x_bf16"] == 1
    assert all(math.isfinite(m["ms"]) and m["ms"] > 0 for m in modes.values())
    assert 0 < modes["int8_convrot"]["error"] < 0.05
    assert math.isclose(modes["int8_convrot"]["error"], modes["stock_int8_convrot"]["error"], rel_tol=0.05)
    assert modes["w4a4"]["error"] > modes["int8_convrot"]["error"]
