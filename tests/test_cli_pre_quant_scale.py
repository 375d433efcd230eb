"""The command line with SmoothQuant smoothing: ``calibrate`` writes ``pre_quant_scale`` by default, and
``quantize --policy`` stores the smoothed weight and the scale, so the file LowBit's loader reads runs
exactly like the model Quantize with Policy makes in memory from the same policy.

Runs ``python -m lowbit`` in subprocesses on the tiny Flux; needs ComfyUI (calibrate runs the model, and
the written file is loaded through LowBit's loader); skipped without it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent / "comfy"))
from comfy_helpers import comfyui_path, load_stock, require_comfy, run_flux, sqnr_db, tiny_flux_bf16  # noqa: E402

require_comfy()

from lowbit import cli  # noqa: E402
from lowbit.nodes.calibrate import apply_policy  # noqa: E402
from lowbit.nodes.loader import LoadSettings, load_lowbit_diffusion_model  # noqa: E402
from lowbit.nodes.model_quant import native_state_dict  # noqa: E402
from lowbit.nodes.report import pre_quant_scales_of  # noqa: E402
from lowbit.quant.calibrate import SMOOTHING_MODES, load_policy_file  # noqa: E402
from lowbit.quant.calibration_measure import smoothed_weight  # noqa: E402
from lowbit.quant.checkpoint import load_quantized, save_checkpoint  # noqa: E402
from lowbit.quant.formats import get_format  # noqa: E402

log = logging.getLogger(__name__)
#: one LowBit-own format (may carry a pre_quant_scale on stock ComfyUI) and one native (may not)
CALIBRATE = ("--budget", "1GB", "--candidates", "int8_quarot,int8", "--steps", "2", "--resolution", "128",
             "--objective", "layer_output", "-q")


def _lowbit(args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "COMFYUI_PATH": str(comfyui_path())}
    env.pop("COLUMNS", None)
    return subprocess.run([sys.executable, "-m", "lowbit", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env=env)


@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    """tiny Flux (bf16) -> ``calibrate`` (default smoothing) -> ``quantize --policy``, all through the CLI."""
    folder = tmp_path_factory.mktemp("cli_smoothing")
    src = save_checkpoint(tiny_flux_bf16(), folder / "tiny_flux_bf16.safetensors")
    for args in (["calibrate", src.name, "policy.json", *CALIBRATE],
                 ["quantize", src.name, "smoothed.safetensors", "--policy", "policy.json", "-q"]):
        run = _lowbit(args, folder)
        assert run.returncode == 0, f"lowbit {' '.join(args)} -> {run.returncode}\n{run.stderr}"
    policy, calibration = load_policy_file(folder / "policy.json")
    return src, folder / "smoothed.safetensors", policy, calibration


def test_smoothing_choices_are_the_calibration_modes():
    assert cli.SMOOTHING_CHOICES == SMOOTHING_MODES
    assert cli.build_parser().parse_args(["calibrate", "a", "b", "--budget", "1GB"]).smoothing == "write"


def test_quantize_with_a_smoothed_policy_writes_the_scale_and_the_smoothed_weight(cli_files):
    src, out, policy, calibration = cli_files
    assert calibration.config.smoothing == "write"  # the default
    scales = calibration.pre_quant_scales()
    assert scales, "smoothing lowers no layer's error by 5 % on the tiny Flux: the premise of this test"
    formats = policy.layer_format_map
    assert {formats[name] for name in scales} == {"int8_quarot"}  # never int8: stock ComfyUI would drop it
    loaded = load_quantized(out)
    assert {k[: -len(".pre_quant_scale")] for k in loaded.tensors if k.endswith(".pre_quant_scale")} == set(scales)
    source = tiny_flux_bf16()
    codec = get_format("int8_quarot")
    for name, scale in scales.items():
        stored = loaded.tensors[f"{name}.pre_quant_scale"]
        assert stored.dtype == scale.dtype and torch.equal(stored, scale)
        expected = codec.quantize(smoothed_weight(source[f"{name}.weight"].float(), scale))
        assert torch.equal(loaded.layers[name].dequantize(), expected.dequantize()), name
    unsmoothed = next(n for n, f in formats.items() if f == "int8_quarot" and n not in scales)
    assert torch.equal(loaded.layers[unsmoothed].dequantize(),
                       codec.quantize(source[f"{unsmoothed}.weight"].float()).dequantize())


def test_the_cli_file_reloads_to_the_in_memory_calibrated_model(cli_files):
    """Bit-identical: both paths quantize ``W diag(1 / s)`` from the same bf16 weights with the same codec,
    and both run ``linear(x * s, W_stored)``; any difference would be a bug, not rounding."""
    _, out, policy, calibration = cli_files
    scales = calibration.pre_quant_scales()
    float_model = load_stock(tiny_flux_bf16())
    in_memory = apply_policy(float_model, policy, calibration.input_scales(), pre_quant_scales=scales)
    memory_state = native_state_dict(in_memory)
    file_state = load_file(out)
    for name in scales:
        for suffix in ("weight", "pre_quant_scale"):
            assert torch.equal(file_state[f"{name}.{suffix}"], memory_state[f"{name}.{suffix}"].cpu()), (name, suffix)
    reloaded = load_lowbit_diffusion_model(str(out), LoadSettings(mode="native"))
    assert set(pre_quant_scales_of(reloaded)) == set(scales)
    expected = run_flux(in_memory)
    assert torch.equal(run_flux(reloaded), expected)
    float_output = run_flux(float_model)
    unsmoothed = apply_policy(float_model, policy, calibration.input_scales())
    log.warning("tiny Flux via the CLI, %d of %d layers smoothed: %.2f dB with pre_quant_scale, %.2f dB without",
                len(scales), len(policy.layer_format_map), sqnr_db(float_output, expected),
                sqnr_db(float_output, run_flux(unsmoothed)))
