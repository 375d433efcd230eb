"""The Quantization Report's numbers, checked in-process against the codecs (no server needed).

Imports ComfyUI (the node module needs ``comfy_api``), so it skips like the server tests when
ComfyUI is absent.
"""

from __future__ import annotations

import math

import pytest
import torch

from comfy_server import comfyui_path, import_node_module

COMFY = comfyui_path()
pytestmark = pytest.mark.skipif(COMFY is None, reason="ComfyUI not found: set COMFYUI_PATH or clone it to ~/ComfyUI")


@pytest.fixture(scope="module")
def report():
    return import_node_module("report")


@pytest.fixture(scope="module")
def layers():
    from lowbit.quant.quantize import quantize_weight

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 512, generator=gen) / 512 ** 0.5
    weight[:, :4] *= 8.0  # outlier input channels
    return [(f"diffusion_model.blocks.{i}.proj", fmt, quantize_weight(weight, fmt, compute_dtype=torch.float32))
            for i, fmt in enumerate(("int8", "int8_convrot", "w4a4"))]


def test_rows_count_stored_bytes_from_the_codec(report, layers):
    from lowbit.quant.formats import get_format

    rows = report.layer_rows(layers)
    assert [r.layer for r in rows] == ["blocks.0.proj", "blocks.1.proj", "blocks.2.proj"]
    for row, (_, fmt, qt) in zip(rows, layers):
        stored = sum(t.numel() * t.element_size() for t in get_format(fmt).state_dict(qt).values())
        assert row.stored_bytes == stored
        assert row.bf16_bytes == 256 * 512 * 2
        assert row.rel_error is None
    assert rows[2].stored_bytes < 0.3 * rows[2].bf16_bytes  # 4-bit
    assert 0.5 <= rows[0].stored_bytes / rows[0].bf16_bytes < 0.52  # 8-bit plus one scale per row


def test_measured_error_is_the_activation_path_error(report, layers):
    rows = report.layer_rows(layers, measure_error=True, probe_tokens=32, seed=3)
    errors = {r.format: r.rel_error for r in rows}
    # W8A8 adds 8-bit activation rounding (~40 dB); W4A4 rounds activations to 4 bits (~20 dB or worse)
    assert 0 < errors["int8_convrot"] < 0.03
    assert 0 < errors["int8"] < 0.05
    assert errors["w4a4"] > 3 * errors["int8_convrot"]
    again = report.layer_rows(layers, measure_error=True, probe_tokens=32, seed=3)
    assert [r.rel_error for r in again] == [r.rel_error for r in rows], "the probe is not seeded"


def test_table_totals(report, layers):
    rows = report.layer_rows(layers, measure_error=True, probe_tokens=8)
    table = report.format_table(rows, other_bytes=1000, measured=True)
    lines = table.splitlines()
    assert lines[0].startswith("| layer | format | shape | bf16 | stored | ratio | rel. output error | SQNR dB |")
    assert sum(line.startswith("| blocks.") for line in lines) == 3
    assert "quantized layers:** 3 (int8: 1, int8_convrot: 1, w4a4: 1)" in table
    before = sum(r.bf16_bytes for r in rows)
    assert f"{before / 2**10:.2f} KiB as bf16" in table
    worst = max(rows, key=lambda r: r.rel_error)
    assert f"({worst.layer}, {worst.format})" in table
    assert report._sqnr(0.01) == f"{-20 * math.log10(0.01):.1f}"
