"""Show 4: bad inputs fail with a clear message, and nothing is written or overwritten."""

from __future__ import annotations

import pickle

import pytest
import torch
from safetensors.torch import save_file

from checkpoint_helpers import leftovers, write_raw_safetensors
from lowbit.quant.checkpoint import inspect_checkpoint, load_quantized, open_checkpoint, save_checkpoint
from lowbit.quant.convert import convert_file
from lowbit.quant.errors import (CheckpointFormatError, NonFiniteWeightError, OutputExistsError, UnknownFormatError)
from lowbit.quant.formats import FORMATS, get_format
from lowbit.quant.native import encode_comfy_quant
from lowbit.quant.policy import Policy

INT8 = Policy(mode="int8", preset="generic")


def float_model(**extra) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    sd = {f"blocks.{i}.lin.weight": torch.randn(64, 256, generator=gen).to(torch.bfloat16) for i in range(3)}
    sd.update({f"blocks.{i}.lin.bias": torch.zeros(64, dtype=torch.bfloat16) for i in range(3)})
    sd.update(extra)
    return sd


def readers():
    """Every public way to open a file; each must refuse a broken one the same way."""
    return {
        "open_checkpoint": lambda p: open_checkpoint(p).close(),
        "load_quantized": load_quantized,
        "inspect_checkpoint": inspect_checkpoint,
        "convert_file": lambda p: convert_file(p, p.parent / "out.safetensors", INT8),
    }


def quant_layers_of(path):
    with open_checkpoint(path) as reader:
        return reader.quant_layers


def assert_refused(path, *patterns):
    for name, read in readers().items():
        with pytest.raises(CheckpointFormatError) as err:
            read(path)
        message = str(err.value)
        assert str(path) in message, f"{name}: message does not name the file: {message}"
        for pattern in patterns:
            assert pattern in message, f"{name}: {pattern!r} not in {message!r}"
    assert not (path.parent / "out.safetensors").exists()
    assert leftovers(path.parent) == []


# ---- files that are not (complete) safetensors ------------------------------------------------------

def test_truncated_data_is_refused_before_reading(tmp_path):
    good = tmp_path / "good.safetensors"
    save_file(float_model(), good)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size * 6 // 10])
    assert_refused(cut, "truncated", "download it again", f"should be {good.stat().st_size} bytes")


@pytest.mark.parametrize("size", [0, 5, 12])
def test_truncated_header_is_refused(tmp_path, size):
    good = tmp_path / "good.safetensors"
    save_file(float_model(), good)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:size])
    assert_refused(cut, "truncated")


def test_torch_zip_checkpoint_is_refused(tmp_path):
    path = tmp_path / "model.ckpt"
    torch.save({"state_dict": float_model()}, path)
    assert_refused(path, "not a safetensors file", "zip archive", "convert it to .safetensors")


def test_pickle_checkpoint_is_refused(tmp_path):
    path = tmp_path / "model.pt"
    with open(path, "wb") as f:
        pickle.dump({"weight": [1.0, 2.0]}, f, protocol=4)
    assert_refused(path, "not a safetensors file", "pickle")


def test_random_bytes_are_refused(tmp_path):
    path = tmp_path / "noise.safetensors"
    path.write_bytes(bytes(range(7, 250)) * 40)
    assert_refused(path, "not a safetensors file", "header length")


def test_header_length_beyond_file_is_refused(tmp_path):
    path = write_raw_safetensors(tmp_path / "h.safetensors", {"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
                                 b"\0" * 4, header_len=10_000)
    assert_refused(path, "truncated", "header claims 10000 bytes")


def test_data_offsets_beyond_file_are_refused(tmp_path):
    header = {"x": {"dtype": "F32", "shape": [64, 64], "data_offsets": [0, 16384]}}
    path = write_raw_safetensors(tmp_path / "o.safetensors", header, b"\0" * 100)
    assert_refused(path, "truncated", "'x'")


@pytest.mark.parametrize("raw", [b'{"x": \xff\xfe}', b'{"x": {"dtype": "F32", ', b'{"a": 1, "a": 2}'])
def test_invalid_header_json_is_refused(tmp_path, raw):
    import struct

    path = tmp_path / "j.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)
    assert_refused(path, "header is not UTF-8 JSON")


@pytest.mark.parametrize("entry, pattern", [
    ({"dtype": "F4X", "shape": [2], "data_offsets": [0, 2]}, "dtype 'F4X'"),
    ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "needs 12 bytes"),
    ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "non-negative"),
    ({"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}, "begin <= end"),
])
def test_malformed_header_entry_is_refused(tmp_path, entry, pattern):
    path = write_raw_safetensors(tmp_path / "e.safetensors", {"x": entry}, b"\0" * 8)
    assert_refused(path, "'x'", pattern)


# ---- unknown formats and malformed quantization data ------------------------------------------------

def test_unknown_mode_lists_the_known_ones():
    with pytest.raises(UnknownFormatError) as err:
        Policy(mode="int3")
    assert "'int3'" in str(err.value) and all(name in str(err.value) for name in (*FORMATS, "int4_mixed"))


def quantized_layer_file(tmp_path, comfy_quant: torch.Tensor):
    qt = get_format("int8").quantize(torch.randn(64, 256))
    tensors = {f"blocks.0.lin.{k}": v for k, v in get_format("int8").state_dict(qt).items()}
    tensors["blocks.0.lin.comfy_quant"] = comfy_quant
    tensors["blocks.0.lin.bias"] = torch.zeros(64)
    return save_checkpoint(tensors, tmp_path / "q.safetensors")


def test_unknown_comfy_quant_format_names_the_layer(tmp_path):
    path = quantized_layer_file(tmp_path, encode_comfy_quant({"format": "int3_magic"}))
    with pytest.raises(CheckpointFormatError) as err:
        load_quantized(path)
    message = str(err.value)
    assert "blocks.0.lin" in message and "int3_magic" in message and "int8_tensorwise" in message
    assert {u.format for u in inspect_checkpoint(path).formats} == {"int3_magic (unsupported)"}


@pytest.mark.parametrize("raw", [b'{"format": "int8_tensorwise"', b"\xff\xfe not utf8", b'["int8"]', b'{"format": 8}'])
def test_malformed_comfy_quant_names_the_layer(tmp_path, raw):
    path = quantized_layer_file(tmp_path, torch.tensor(list(raw), dtype=torch.uint8))
    open_checkpoint(path).close()  # opening reads the header only; the layer's JSON is read on demand:
    read_quant_layers = {"quant_layers": quant_layers_of}
    for name, read in {**readers(), **read_quant_layers}.items():
        if name == "open_checkpoint":
            continue
        with pytest.raises(CheckpointFormatError) as err:
            read(path)
        assert "blocks.0.lin.comfy_quant" in str(err.value), f"{name}: {err.value}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.safetensors"]


# ---- weights that cannot or must be quantized ---------------------------------------------------------

@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weight_leaves_no_partial_output(tmp_path, bad):
    sd = float_model()
    sd["blocks.1.lin.weight"][5, 7] = bad
    src = tmp_path / "src.safetensors"
    save_file(sd, src)
    existing = tmp_path / "out.safetensors"
    existing.write_bytes(b"the user's previous conversion")
    with pytest.raises(NonFiniteWeightError) as err:
        convert_file(src, existing, INT8, overwrite=True)
    message = str(err.value)
    assert "'blocks.1.lin'" in message and "NaN/Inf" in message and "keep-float" in message
    assert "nothing was written" in message and str(existing) in message
    assert existing.read_bytes() == b"the user's previous conversion"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors", "src.safetensors"]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_zero_rows_and_zero_weights_quantize_cleanly(tmp_path, fmt):
    gen = torch.Generator().manual_seed(1)
    row = torch.randn(256, 512, generator=gen)
    row[3] = 0
    sd = {"blocks.0.zero_row.weight": row.to(torch.bfloat16),
          "blocks.0.all_zero.weight": torch.zeros(256, 512, dtype=torch.bfloat16)}
    src = tmp_path / "src.safetensors"
    save_file(sd, src)
    report = convert_file(src, tmp_path / "out.safetensors", Policy(mode=fmt, preset="generic"))
    assert report.layer_counts == {fmt: 2}
    loaded = load_quantized(report.output)
    x = torch.randn(4, 512, generator=gen).to(torch.bfloat16)
    for layer, qt in loaded.layers.items():
        params = qt._params
        for name in params._tensor_fields():
            value = getattr(params, name)
            if value is not None:
                assert torch.isfinite(value.float()).all(), f"{fmt} {layer}: non-finite {name}"
        weight = qt.dequantize().float()
        assert not torch.isnan(weight).any()
        out = get_format(fmt).linear(x, qt).float()
        assert torch.isfinite(out).all(), f"{fmt} {layer}: linear gives NaN/Inf"
        if layer.endswith("all_zero"):
            assert torch.count_nonzero(weight) == 0 and torch.count_nonzero(out) == 0
        else:
            assert torch.count_nonzero(weight[3]) == 0 and torch.count_nonzero(out[:, 3]) == 0
            assert torch.count_nonzero(weight[4]) > 0


# ---- output paths -----------------------------------------------------------------------------------

def test_existing_output_is_not_overwritten(tmp_path):
    src = tmp_path / "src.safetensors"
    save_file(float_model(), src)
    dst = tmp_path / "dst.safetensors"
    dst.write_bytes(b"keep me")
    with pytest.raises(OutputExistsError) as err:
        convert_file(src, dst, INT8)
    message = str(err.value)
    assert str(dst) in message and "overwrite=True" in message and "--overwrite" in message and "another name" in message
    assert dst.read_bytes() == b"keep me"
    assert leftovers(tmp_path) == []

    report = convert_file(src, dst, INT8, overwrite=True)
    assert report.layer_counts == {"int8": 3}
    assert load_quantized(dst).formats == {f"blocks.{i}.lin": "int8" for i in range(3)}
    assert leftovers(tmp_path) == []


def test_output_equal_to_input_is_refused_even_with_overwrite(tmp_path):
    src = tmp_path / "src.safetensors"
    save_file(float_model(), src)
    before = src.read_bytes()
    for dst in (src, tmp_path / "." / "src.safetensors"):
        with pytest.raises(OutputExistsError, match="is the input file.*another output name"):
            convert_file(src, dst, INT8, overwrite=True)
    assert src.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src.safetensors"]


def test_missing_output_folder_is_reported(tmp_path):
    src = tmp_path / "src.safetensors"
    save_file(float_model(), src)
    with pytest.raises(FileNotFoundError, match="output folder .*nope.* does not exist"):
        convert_file(src, tmp_path / "nope" / "out.safetensors", INT8)
