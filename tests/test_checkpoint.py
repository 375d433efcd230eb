"""Checkpoint IO: the safetensors reader/writer and the native quantized forms ComfyUI reads."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from checkpoint_helpers import (SMALL_FLUX, assert_bit_equal, assert_qt_bit_equal, assert_state_dicts_bit_equal,
                                bits, comfy_utils, leftovers)
from lowbit.quant.checkpoint import (CheckpointWriter, inspect_checkpoint, load_quantized, open_checkpoint,
                                     save_checkpoint)
from lowbit.quant.demo import tiny_flux_state_dict
from lowbit.quant.errors import CheckpointFormatError, LowBitError, OutputExistsError
from lowbit.quant.formats import get_format
from lowbit.quant.native import encode_comfy_quant
from lowbit.quant.policy import Policy
from lowbit.quant.quantize import quantize_state_dict, quantize_weight


def assorted_tensors() -> dict[str, torch.Tensor]:
    """Every dtype a quantized checkpoint holds, odd sizes that break alignment, 0-d and empty tensors."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 40, generator=gen)
    return {
        "a.weight": w.to(torch.bfloat16),
        "a.comfy_quant": encode_comfy_quant({"format": "int8_tensorwise"}),  # odd-sized uint8
        "b.weight": (w * 50).to(torch.float8_e4m3fn),
        "b.weight_scale": torch.tensor(0.0123, dtype=torch.float32),  # 0-d scalar
        "c.weight": (w * 3).to(torch.float8_e5m2),
        "d.weight": torch.randint(-128, 128, (7, 9), generator=gen, dtype=torch.int8),  # 63 bytes
        "e.bias": torch.randn(5, generator=gen).half(),  # 10 bytes
        "f.mask": torch.tensor([True, False, True]),
        "g.steps": torch.tensor(7, dtype=torch.int64),
        "h.table": torch.randn(3, 3, generator=gen, dtype=torch.float64),
        "i.empty": torch.zeros(0, 4),
        "j.half_scalar": torch.tensor(1.5, dtype=torch.bfloat16),
        "k.ids": torch.arange(11, dtype=torch.int32),
    }


def test_save_is_standard_safetensors_bit_identical(tmp_path):
    tensors = assorted_tensors()
    path = save_checkpoint(tensors, tmp_path / "a.safetensors", metadata={"title": "x", "note": "é ü"})
    assert_state_dicts_bit_equal(load_file(path), tensors, "safetensors.load_file")
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"title": "x", "note": "é ü"}
    with open_checkpoint(path) as reader:
        assert_state_dicts_bit_equal({k: reader.read(k) for k in reader.keys()}, tensors, "reader")
        assert reader.metadata == {"title": "x", "note": "é ü"}
        assert reader.shapes() == {k: tuple(v.shape) for k, v in tensors.items()}
        assert reader.dtypes() == {k: v.dtype for k, v in tensors.items()}
        assert all(reader.nbytes(k) == v.numel() * v.element_size() for k, v in tensors.items())
        # every tensor starts at a multiple of its element size, as safetensors' own writer keeps them
        misaligned = [k for k, i in reader.tensors.items() if (reader.data_start + i.begin) % i.dtype.itemsize]
        assert misaligned == []
    assert leftovers(tmp_path) == []
    assert path.stat().st_mode & 0o777 == 0o666 & ~current_umask()  # not mkstemp's owner-only 0600


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_comfyui_load_torch_file_reads_it_back(tmp_path):
    utils = comfy_utils()
    tensors = assorted_tensors()
    path = save_checkpoint(tensors, tmp_path / "a.safetensors", metadata={"title": "x"})
    sd, metadata = utils.load_torch_file(str(path), return_metadata=True)
    assert_state_dicts_bit_equal(sd, tensors, "comfy.utils.load_torch_file")
    assert metadata == {"title": "x"}


def test_comfyui_aimdo_loader_reads_it_back(tmp_path):
    """ComfyUI's own header parser, used when its aimdo allocator is enabled (GPU machines)."""
    utils = comfy_utils()
    tensors = assorted_tensors()
    path = save_checkpoint(tensors, tmp_path / "a.safetensors", metadata={"title": "x"})
    try:
        sd, metadata = utils.load_safetensors(str(path))
    except (ImportError, RuntimeError) as err:
        pytest.skip(f"comfy-aimdo is not usable here: {err}")
    assert_state_dicts_bit_equal(sd, tensors, "comfy.utils.load_safetensors")
    assert metadata == {"title": "x"}


def test_streaming_writer_without_header_room_rewrites_once(tmp_path):
    tensors = assorted_tensors()
    with CheckpointWriter(tmp_path / "s.safetensors", metadata={"k": "v"}, header_reserve=0) as writer:
        for key, tensor in tensors.items():
            writer.add(key, tensor)
    assert_state_dicts_bit_equal(load_file(tmp_path / "s.safetensors"), tensors, "rewritten file")
    assert leftovers(tmp_path) == []


def test_writer_error_leaves_nothing(tmp_path):
    out = tmp_path / "o.safetensors"
    with pytest.raises(RuntimeError, match="boom"):
        with CheckpointWriter(out) as writer:
            writer.add("x", torch.ones(1000))
            assert writer.temp_path.exists() and writer.temp_path.parent == tmp_path
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []


def test_writer_validates_metadata_and_keys(tmp_path):
    with pytest.raises(LowBitError, match="strings to strings.*'n'.*json.dumps"):
        CheckpointWriter(tmp_path / "o.safetensors", metadata={"n": 3})
    with pytest.raises(LowBitError, match="already written"):
        with CheckpointWriter(tmp_path / "o.safetensors") as writer:
            writer.add("x", torch.ones(2))
            writer.add("x", torch.ones(2))
    assert list(tmp_path.iterdir()) == []


def test_save_refuses_existing_unless_overwrite(tmp_path):
    out = tmp_path / "o.safetensors"
    out.write_bytes(b"precious")
    with pytest.raises(OutputExistsError) as err:
        save_checkpoint({"x": torch.ones(3)}, out)
    assert str(out) in str(err.value) and "overwrite" in str(err.value) and "another name" in str(err.value)
    assert out.read_bytes() == b"precious"
    save_checkpoint({"x": torch.ones(3)}, out, overwrite=True)
    assert torch.equal(load_file(out)["x"], torch.ones(3))
    assert leftovers(tmp_path) == []


def test_reader_reads_only_the_header_on_open(tmp_path, monkeypatch):
    path = tmp_path / "a.safetensors"
    save_file({"big": torch.zeros(256, 256), "small": torch.ones(2)}, path)
    with open_checkpoint(path) as reader:
        assert reader.shapes() == {"big": (256, 256), "small": (2,)}
        assert reader.nbytes("big") == 256 * 256 * 4
        # only the header and the first bytes were read
        assert reader._file.tell() <= reader.data_start
        assert reader.quant_layers == {} and not reader.is_quantized


# ---- the native quantized forms --------------------------------------------------------------------

def test_comfy_quant_tensors_load_as_quantized_tensors(tmp_path):
    sd = tiny_flux_state_dict(SMALL_FLUX)
    out, plan = quantize_state_dict(sd, Policy(mode="int8_convrot"))
    path = save_checkpoint(out, tmp_path / "q.safetensors")
    loaded = load_quantized(path)
    assert set(loaded.layers) == {d.name for d in plan.quantized}
    assert set(loaded.formats.values()) == {"int8_convrot"}
    for layer, qt in loaded.layers.items():
        assert_qt_bit_equal(qt, quantize_weight(sd[f"{layer}.weight"], "int8_convrot"), layer)
    # every non-quantized entry comes back as stored; nothing of a quantized layer is left over
    expected_rest = {k: v for k, v in out.items()
                     if k.rpartition(".")[0] not in loaded.layers or k.endswith(".bias")}
    assert_state_dicts_bit_equal(loaded.tensors, expected_rest, "float tensors")


def legacy_scaled_fp8(prefix: str = "", marker_numel: int = 1):
    """A legacy scaled-fp8 state dict (as ComfyUI wrote before comfy_quant) and its float weights."""
    gen = torch.Generator().manual_seed(3)
    weights = {f"{prefix}blk.{i}.lin": torch.randn(64, 96, generator=gen) for i in range(3)}
    sd = {f"{prefix}scaled_fp8": torch.zeros(marker_numel, dtype=torch.float8_e4m3fn)}
    for i, (layer, w) in enumerate(weights.items()):
        scale = w.abs().amax() / 448.0
        sd[f"{layer}.weight"] = (w / scale).to(torch.float8_e4m3fn)
        sd[f"{layer}.scale_weight"] = scale.reshape(1)
        sd[f"{layer}.bias"] = torch.randn(64, generator=gen).to(torch.bfloat16)
        if i == 1:
            sd[f"{layer}.scale_input"] = torch.tensor([0.5])
        if i == 2:
            sd[f"{layer}.scale_input"] = torch.tensor([1.0])  # unit input scales are dropped
    sd[f"{prefix}plain.weight"] = torch.randn(16, 16, generator=gen).to(torch.float8_e4m3fn)  # fp8, no scale
    return sd, weights


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    ref, approx = ref.float(), approx.float()
    return float(10 * torch.log10(ref.pow(2).sum() / (ref - approx).pow(2).sum()))


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_legacy_scaled_fp8_is_read_as_comfyui_reads_it(tmp_path, prefix):
    sd, weights = legacy_scaled_fp8(prefix)
    path = tmp_path / "legacy.safetensors"
    save_file(sd, path)
    with open_checkpoint(path) as reader:
        assert reader.scaled_fp8_prefix == prefix and reader.is_quantized
        quant = reader.quant_layers
    assert {layer: q.conf for layer, q in quant.items()} == {layer: {"format": "float8_e4m3fn"} for layer in weights}

    loaded = load_quantized(path)
    assert set(loaded.formats.values()) == {"fp8"}
    for layer, w in weights.items():
        qt = loaded.layers[layer]
        assert_bit_equal(qt._qdata, sd[f"{layer}.weight"], f"{layer} qdata")
        assert float(qt._params.scale) == float(sd[f"{layer}.scale_weight"])
        assert sqnr_db(w, qt.dequantize()) > 25
    layers = list(weights)
    assert torch.equal(loaded.tensors[f"{layers[1]}.input_scale"], torch.tensor([0.5]))
    assert f"{layers[2]}.input_scale" not in loaded.tensors and f"{layers[2]}.scale_input" not in loaded.tensors
    assert f"{prefix}scaled_fp8" not in loaded.tensors
    assert loaded.tensors[f"{prefix}plain.weight"].dtype == torch.float8_e4m3fn  # unscaled fp8 stays a float weight
    assert not any(k.endswith(".scale_weight") for k in loaded.tensors)

    summary = inspect_checkpoint(path)
    assert summary.counts() == {"fp8": 3, "float": 1}


def test_legacy_scaled_fp8_matches_comfyui_convert_old_quants(tmp_path):
    utils = comfy_utils()
    sd, weights = legacy_scaled_fp8("model.diffusion_model.", marker_numel=2)
    path = tmp_path / "legacy.safetensors"
    save_file(sd, path)
    theirs, _ = utils.convert_old_quants(dict(sd), model_prefix="model.diffusion_model.", metadata={})
    their_confs = {k[: -len(".comfy_quant")]: json.loads(bytes(v.tolist())) for k, v in theirs.items()
                   if k.endswith(".comfy_quant")}
    with open_checkpoint(path) as reader:
        ours = {layer: q.conf for layer, q in reader.quant_layers.items()}
    assert ours == their_confs
    assert all(conf.get("full_precision_matrix_mult") is True for conf in ours.values())
    loaded = load_quantized(path)
    their_rest = {k: v for k, v in theirs.items()
                  if not k.endswith((".comfy_quant", ".weight_scale")) and k.rpartition(".")[0] not in weights
                  or k.endswith((".bias", ".input_scale"))}
    assert_state_dicts_bit_equal(loaded.tensors, their_rest, "tensors beside the fp8 layers")


def test_quantization_metadata_header_is_read(tmp_path):
    sd = tiny_flux_state_dict(SMALL_FLUX)
    out, plan = quantize_state_dict(sd, Policy(mode="fp8_rowwise"))
    confs = {k[: -len(".comfy_quant")]: json.loads(bytes(v.tolist())) for k, v in out.items() if k.endswith(".comfy_quant")}
    without = {k: v for k, v in out.items() if not k.endswith(".comfy_quant")}
    header = json.dumps({"format_version": "1.0", "layers": confs})
    path = save_checkpoint(without, tmp_path / "hdr.safetensors", metadata={"_quantization_metadata": header})
    with open_checkpoint(path) as reader:
        assert {layer: q.conf for layer, q in reader.quant_layers.items()} == confs
        assert all(q.source == "header _quantization_metadata" for q in reader.quant_layers.values())
    loaded = load_quantized(path)
    assert set(loaded.layers) == set(confs)
    for layer, qt in loaded.layers.items():
        assert_qt_bit_equal(qt, quantize_weight(sd[f"{layer}.weight"], "fp8_rowwise"), layer)
    assert inspect_checkpoint(path).counts() == plan.counts()


def test_quantization_metadata_header_overrides_comfy_quant_like_comfyui(tmp_path):
    w = torch.randn(64, 256)
    out = {f"l.{k}": v for k, v in get_format("int8").state_dict(quantize_weight(w, "int8")).items()}
    out["l.comfy_quant"] = encode_comfy_quant({"format": "nonsense"})
    header = json.dumps({"layers": {"l": {"format": "int8_tensorwise"}}})
    path = save_checkpoint(out, tmp_path / "o.safetensors", metadata={"_quantization_metadata": header})
    assert load_quantized(path).formats == {"l": "int8"}


def test_bad_quantization_metadata_header_names_the_problem(tmp_path):
    path = save_checkpoint({"l.weight": torch.ones(4, 4)}, tmp_path / "o.safetensors",
                           metadata={"_quantization_metadata": "{not json"})
    with pytest.raises(CheckpointFormatError, match="_quantization_metadata.*not valid JSON"):
        load_quantized(path)
    path = save_checkpoint({"l.weight": torch.ones(4, 4)}, tmp_path / "p.safetensors",
                           metadata={"_quantization_metadata": json.dumps({"layers": {"l": {"fmt": 1}}})})
    with pytest.raises(CheckpointFormatError, match="layer 'l'.*string 'format'"):
        load_quantized(path)


def test_inspect_counts_every_byte(tmp_path):
    sd = tiny_flux_state_dict(SMALL_FLUX)
    out, plan = quantize_state_dict(sd, Policy(mode="int4_mixed"))
    path = save_checkpoint(out, tmp_path / "q.safetensors", metadata={"title": "t"})
    summary = inspect_checkpoint(path)
    assert summary.counts() == plan.counts()
    assert summary.tensor_count == len(out)
    data_bytes = sum(v.numel() * v.element_size() for v in out.values())
    assert sum(u.bytes for u in summary.formats) + summary.other_bytes == data_bytes
    expected_w4a4 = sum(v.numel() * v.element_size() for k, v in out.items()
                        if plan.format_of(k.rpartition(".")[0]) == "w4a4" and not k.endswith(".bias"))
    assert {u.format: u.bytes for u in summary.formats}["w4a4"] == expected_w4a4
    assert summary.metadata == {"title": "t"}
    assert "w4a4" in summary.table() and "float" in summary.table()


def test_fp8_weights_stored_as_uint8_still_load(tmp_path):
    w = torch.randn(32, 64)
    qt = quantize_weight(w, "fp8")
    out = {"l.weight": qt._qdata.view(torch.uint8), "l.weight_scale": qt._params.scale,
           "l.comfy_quant": encode_comfy_quant({"format": "float8_e4m3fn"})}
    path = save_checkpoint(out, tmp_path / "u8.safetensors")
    assert_bit_equal(bits(load_quantized(path).layers["l"]._qdata), bits(qt._qdata), "fp8 bytes")
