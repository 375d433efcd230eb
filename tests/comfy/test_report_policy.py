"""Quantization Report (LowBit) names the policy a model was quantized with, and per layer the rule
that chose its format (issue 7: "the Quantization Report shows the chosen policy")."""

from __future__ import annotations

from comfy_helpers import require_comfy

require_comfy()

from lowbit.nodes.model_quant import LowBitModelInfo, quantize_model  # noqa: E402
from lowbit.nodes.report import LowBitQuantizationReport, policy_line  # noqa: E402
from lowbit.quant.policy import Policy  # noqa: E402

#: two layers a calibration put in other formats than the mode's (the rest take the mode)
CALIBRATED = {"double_blocks.0.img_attn.qkv": "w4a4", "single_blocks.1.linear2": "fp8"}


def _rows(report: str) -> dict[str, list[str]]:
    """``layer -> cells`` of the report's markdown table."""
    rows = {}
    for line in report.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] != "layer":
            rows[cells[0]] = cells
    return rows


def test_report_names_the_policy_and_the_rule_behind_each_format(float_model):
    policy = Policy(mode="int8_convrot", preset="flux1", layer_formats=CALIBRATED)
    quantized = quantize_model(float_model, policy)
    report = LowBitQuantizationReport.execute(model=quantized, measure_error=False).result[0]
    first = report.splitlines()[0]
    assert first.startswith("**policy:** mode int8_convrot, preset flux1 (quantized in memory)"), first
    assert f"{len(CALIBRATED)} layer(s) in calibrated formats" in first
    header = next(line for line in report.splitlines() if line.startswith("| layer |"))
    assert header.rstrip(" |").endswith("chosen by")
    rows = _rows(report)
    for name, fmt in CALIBRATED.items():
        assert rows[name][1] == fmt and rows[name][-1] == "layer_formats", rows[name]
    others = [cells for name, cells in rows.items() if name not in CALIBRATED]
    assert others and all(c[1] == "int8_convrot" and c[-1] == "mode" for c in others)


def test_policy_line_without_a_recorded_policy():
    assert policy_line(None) == "**policy:** none recorded (not quantized by LowBit)"
    assert policy_line(LowBitModelInfo(source="loaded native file")) == "**policy:** none recorded (loaded native file)"
