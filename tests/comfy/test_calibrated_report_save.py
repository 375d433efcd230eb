"""A model from Quantize with Policy keeps its calibration (issue 7): the Quantization Report lists
each layer's calibrated error (the one Calibrate Policy measured), and Save Quantized Model writes the
same ``lowbit_calibration`` summary as the CLI's ``quantize --policy``, in real ComfyUI on the tiny Flux."""

from __future__ import annotations

import json

import pytest
import torch

from comfy_helpers import require_comfy

require_comfy()

import folder_paths  # noqa: E402

from lowbit.nodes.calibrate import LowBitApplyPolicy, LowBitCalibratePolicy, apply_policy  # noqa: E402
from lowbit.nodes.model_quant import CalibrationRecord, quantize_model  # noqa: E402
from lowbit.nodes.report import LowBitQuantizationReport  # noqa: E402
from lowbit.nodes.save import LowBitSaveQuantizedModel  # noqa: E402
from lowbit.quant.calibrate import parse_policy  # noqa: E402
from lowbit.quant.calibration_apply import LOWBIT_CALIBRATION_KEY, convert_calibrated  # noqa: E402
from lowbit.quant.checkpoint import open_checkpoint, save_checkpoint  # noqa: E402
from lowbit.quant.policy import Policy  # noqa: E402

#: int8_quarot may carry a pre_quant_scale (LowBit's own format), so some layers come out smoothed;
#: w4a4 is the cheaper alternative every layer is measured in too
CALIBRATION = {"budget": "ratio:0.5", "candidates": "int8_quarot, w4a4", "steps": 2, "resolution": 128,
               "smoothing": "write", "objective": "model_output"}


@pytest.fixture(scope="module")
def calibrated(float_model):
    """(policy JSON, its parsed calibration, the model Quantize with Policy made from it)."""
    policy_json, _ = LowBitCalibratePolicy.execute(model=float_model, **CALIBRATION).result
    _, calibration = parse_policy(policy_json)
    model = LowBitApplyPolicy.execute(model=float_model, policy=policy_json).result[0]
    return policy_json, calibration, model


def _save(model, tmp_path, monkeypatch, prefix: str):
    """Run Save Quantized Model as ComfyUI's executor does (a class clone with its hidden inputs); the file."""
    monkeypatch.setattr(folder_paths, "get_output_directory", lambda: str(tmp_path))
    node = LowBitSaveQuantizedModel.PREPARE_CLASS_CLONE({"hidden_inputs": {"PROMPT": {}, "EXTRA_PNGINFO": {}}})
    node.execute(model=model, filename_prefix=prefix)
    (saved,) = tmp_path.glob(f"{prefix}_*.safetensors")
    return saved


def _table(report: str) -> tuple[list[str], dict[str, list[str]]]:
    """(header cells, ``layer -> cells``) of the report's markdown table."""
    lines = [line for line in report.splitlines() if line.startswith("| ")]
    split = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    return split[0], {cells[0]: cells for cells in split[1:]}


def test_report_lists_each_layers_calibrated_error(calibrated):
    _, calibration, model = calibrated
    assert calibration.pre_quant_scales(), "no layer smoothed on the tiny Flux: the premise of the smoothing column"
    record = model.model.lowbit_info.calibration
    assert record == CalibrationRecord.from_result(calibration)
    report = LowBitQuantizationReport.execute(model=model, measure_error=False).result[0]
    first = report.splitlines()[0]
    assert "*calibrated error*" in first and "objective model_output" in first, first
    assert f"{len(calibration.layers)} layer(s) calibrated to ratio:0.5" in first
    header, rows = _table(report)
    error_col, others_col = header.index("calibrated error"), header.index("other formats (calibrated)")
    smooth_col = header.index("pre_quant_scale: error with / without (calibrated)")
    for layer in calibration.layers:
        if layer.format == "float":
            assert layer.name not in rows
            continue
        cells = rows[layer.name]
        assert cells[1] == layer.format
        # what the choice minimised: the model-output error of the chosen format, as it runs (smoothed or not)
        assert float(cells[error_col]) == pytest.approx(layer.chosen.output_error, rel=1e-3)
        for m in layer.measured:
            if m.format != layer.format:
                assert f"{m.format} {m.output_error:.3e}" in cells[others_col]
        if layer.pre_quant_scale is not None:
            with_scale, without = (float(v) for v in cells[smooth_col].split(" / "))
            assert with_scale == pytest.approx(layer.chosen.smoothed_error, rel=1e-3)
            assert without == pytest.approx(layer.chosen.error, rel=1e-3) and with_scale < without
        else:
            assert cells[smooth_col] == "-"


def test_report_without_calibration_has_no_calibrated_column(float_model):
    model = quantize_model(float_model, Policy(mode="int8_convrot", preset="flux1"))
    report = LowBitQuantizationReport.execute(model=model, measure_error=False).result[0]
    assert model.model.lowbit_info.calibration is None
    assert "calibrated error" not in report


def test_saved_file_carries_the_clis_calibration_summary(float_model, calibrated, tmp_path, monkeypatch):
    _, calibration, model = calibrated
    saved = _save(model, tmp_path, monkeypatch, "calibrated")
    with open_checkpoint(saved) as reader:
        node_header = dict(reader.metadata)
    assert json.loads(node_header[LOWBIT_CALIBRATION_KEY]) == calibration.metadata_summary()
    # the CLI path (quantize --policy) on the same float weights writes the same string
    source = save_checkpoint({k: v.detach().cpu() for k, v in float_model.model.diffusion_model.state_dict().items()},
                             tmp_path / "float.safetensors")
    convert_calibrated(source, tmp_path / "cli.safetensors", calibration.policy,
                       input_scales=calibration.input_scales(), pre_quant_scales=calibration.pre_quant_scales(),
                       pre_quant_formats=calibration.config.pre_quant_formats,
                       calibration_summary=calibration.metadata_summary(), compute_dtype=torch.bfloat16)
    with open_checkpoint(tmp_path / "cli.safetensors") as reader:
        cli_header = dict(reader.metadata)
    assert node_header[LOWBIT_CALIBRATION_KEY] == cli_header[LOWBIT_CALIBRATION_KEY]
    assert json.loads(node_header["lowbit_policy"]) == json.loads(cli_header["lowbit_policy"])


def test_a_plain_policy_saves_no_calibration_summary(float_model, calibrated, tmp_path, monkeypatch):
    _, calibration, _ = calibrated
    plain = apply_policy(float_model, calibration.policy, calibration.input_scales())  # no calibration passed
    saved = _save(plain, tmp_path, monkeypatch, "plain")
    with open_checkpoint(saved) as reader:
        assert LOWBIT_CALIBRATION_KEY not in reader.metadata and "lowbit_policy" in reader.metadata
