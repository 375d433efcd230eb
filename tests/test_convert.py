"""The streaming converter: identical to in-memory quantization, metadata carried, bounded memory."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint_helpers import SMALL_FLUX, assert_qt_bit_equal, assert_state_dicts_bit_equal, leftovers
from lowbit.quant.checkpoint import CheckpointWriter, inspect_checkpoint, load_quantized, open_checkpoint
from lowbit.quant.convert import ConversionReport, convert_file
from lowbit.quant.demo import tiny_flux_state_dict
from lowbit.quant.errors import CheckpointFormatError, LowBitError
from lowbit.quant.formats import FORMATS
from lowbit.quant.native import decode_comfy_quant, load_layer
from lowbit.quant.policy import INT4_MODES, Policy
from lowbit.quant.quantize import quantize_state_dict, quantize_weight

SOURCE_METADATA = {"modelspec.title": "tiny flux", "modelspec.architecture": "flux-1-dev"}


@pytest.fixture(scope="module")
def flux_file(tmp_path_factory):
    sd = tiny_flux_state_dict(SMALL_FLUX, seed=5)
    path = tmp_path_factory.mktemp("src") / "flux.safetensors"
    save_file(sd, path, metadata=SOURCE_METADATA)
    return path, sd


@pytest.mark.parametrize("mode", [*FORMATS, *INT4_MODES])
def test_convert_file_equals_in_memory_quantization(flux_file, tmp_path, mode):
    src, sd = flux_file
    policy = Policy(mode=mode)
    calls = []
    report = convert_file(src, tmp_path / "out.safetensors", policy, progress=lambda d, t: calls.append((d, t)))

    # the state dict as safetensors and ComfyUI load the file (sorted keys), which the converter plans on
    expected, plan = quantize_state_dict(dict(sorted(sd.items())), policy)
    assert isinstance(report, ConversionReport)
    assert report.plan == plan and report.layer_counts == plan.counts()
    assert len(plan.quantized) > 0
    assert calls == [(i, len(sd)) for i in range(1, len(sd) + 1)]
    assert report.bytes_in == src.stat().st_size and report.bytes_out == report.output.stat().st_size
    assert report.bytes_out < report.bytes_in and report.seconds > 0

    # the file holds exactly the in-memory state dict, bit for bit
    assert_state_dicts_bit_equal(load_file(report.output), expected, f"{mode} file")
    # and every layer reads back as the QuantizedTensor of the in-memory result
    loaded = load_quantized(report.output)
    assert loaded.formats == {d.name: d.format for d in plan.quantized}
    for layer, qt in loaded.layers.items():
        entries = {k[len(layer) + 1:]: v for k, v in expected.items() if k.rpartition(".")[0] == layer}
        conf = decode_comfy_quant(layer, entries.pop("comfy_quant"))
        codec, in_memory = load_layer(layer, entries, conf)
        assert codec.spec.name == loaded.formats[layer]
        assert_qt_bit_equal(qt, in_memory, f"{mode}:{layer}")
    # which is what quantizing the weight made (checked on a few layers: w4a8 is slow on CPU)
    for layer in sorted(loaded.layers)[:3]:
        direct = quantize_weight(sd[f"{layer}.weight"], loaded.formats[layer])
        assert_qt_bit_equal(loaded.layers[layer], direct, f"{mode}:{layer} vs quantize_weight")

    metadata = loaded.metadata
    assert {k: metadata[k] for k in SOURCE_METADATA} == SOURCE_METADATA
    assert Policy.from_dict(json.loads(metadata["lowbit_policy"])) == policy
    assert json.loads(metadata["lowbit_plan"]) == {"mode": mode, "preset": plan.preset, "layers": plan.counts()}
    assert metadata["lowbit_version"]
    assert inspect_checkpoint(report.output).counts() == plan.counts()
    assert leftovers(tmp_path) == []


def test_the_policys_w4a4_scales_reach_every_w4a4_layer(flux_file, tmp_path):
    """``Policy.w4a4_scales="absmax"``: every w4a4 layer is comfy-kitchen's quantizer's, bit for bit, and
    differs from the default (searched) one; a per-layer ``quantize_options`` choice wins over the policy's."""
    src, sd = flux_file
    policy = Policy(mode="int4_full", w4a4_scales="absmax")
    report = convert_file(src, tmp_path / "absmax.safetensors", policy)
    loaded = load_quantized(report.output)
    w4 = sorted(layer for layer, fmt in loaded.formats.items() if fmt == "w4a4")
    assert w4 and Policy.from_dict(json.loads(loaded.metadata["lowbit_policy"])) == policy
    searched_differs = []
    for layer in w4:
        weight = sd[f"{layer}.weight"]
        assert_qt_bit_equal(loaded.layers[layer], quantize_weight(weight, "w4a4", options={"scales": "absmax"}), layer)
        searched_differs.append(not torch.equal(loaded.layers[layer]._params.scale,
                                                quantize_weight(weight, "w4a4")._params.scale))
    assert all(searched_differs)
    in_memory, _ = quantize_state_dict(dict(sorted(sd.items())), policy)
    assert_state_dicts_bit_equal(load_file(report.output), in_memory, "absmax file")

    def one_searched(layer, fmt):
        return {"scales": "mse"} if layer == w4[0] else {}

    mixed, _ = quantize_state_dict(sd, policy, quantize_options=one_searched)
    default, _ = quantize_state_dict(sd, Policy(mode="int4_full"))
    for layer in w4[:2]:
        source = default if layer == w4[0] else in_memory
        assert torch.equal(mixed[f"{layer}.weight_scale"], source[f"{layer}.weight_scale"]), layer


@pytest.mark.parametrize("mode", ["int8_hadanorm", "fp8_rowwise"])
def test_explicit_device_gives_the_same_file(flux_file, tmp_path, mode):
    """``device="cpu"`` takes the path a GPU does (the 16-bit weight handed over as is) and must match."""
    src, _ = flux_file
    default = convert_file(src, tmp_path / "default.safetensors", Policy(mode=mode))
    on_device = convert_file(src, tmp_path / "device.safetensors", Policy(mode=mode), device="cpu")
    assert_state_dicts_bit_equal(load_file(on_device.output), load_file(default.output), f"{mode} device=cpu")


def test_transform_weight_replaces_each_quantized_weight_before_quantizing(flux_file, tmp_path):
    """The hook sees every quantized layer once, with its format and float weight, and only those;
    what it returns is what gets quantized; every other tensor is written as read."""
    src, sd = flux_file
    policy = Policy(mode="int8_quarot")
    seen = {}

    def halve_columns(layer, fmt, weight):
        seen[layer] = (fmt, weight.dtype, tuple(weight.shape))
        out = weight.clone()
        out[:, ::2] *= 0.5
        return out

    report = convert_file(src, tmp_path / "t.safetensors", policy, transform_weight=halve_columns)
    assert seen == {d.name: ("int8_quarot", torch.float32, tuple(d.shape)) for d in report.plan.quantized}
    loaded, written = load_quantized(report.output), load_file(report.output)
    for layer in sorted(seen)[:3]:
        expected = sd[f"{layer}.weight"].float().clone()
        expected[:, ::2] *= 0.5
        assert_qt_bit_equal(loaded.layers[layer], quantize_weight(expected, "int8_quarot"), layer)
    kept = [k for k in sd if k.rpartition(".")[0] not in seen]
    assert kept and all(torch.equal(written[k], sd[k]) for k in kept)


def test_transform_weight_returning_a_wrong_shape_writes_nothing(flux_file, tmp_path):
    src, _ = flux_file
    with pytest.raises(LowBitError, match="transform_weight must return a float tensor of the weight's shape"):
        convert_file(src, tmp_path / "t.safetensors", Policy(mode="int8"), transform_weight=lambda l, f, w: w[:, 1:])
    assert leftovers(tmp_path) == [] and not (tmp_path / "t.safetensors").exists()


def test_converted_file_is_refused_as_a_source(flux_file, tmp_path):
    src, _ = flux_file
    first = convert_file(src, tmp_path / "q.safetensors", Policy(mode="int8")).output
    with pytest.raises(CheckpointFormatError) as err:
        convert_file(first, tmp_path / "again.safetensors", Policy(mode="fp8"))
    message = str(err.value)
    assert "already quantized" in message and "int8_tensorwise" in message and "original" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.safetensors"]


def test_legacy_scaled_fp8_source_is_refused(tmp_path):
    src = tmp_path / "legacy.safetensors"
    save_file({"scaled_fp8": torch.zeros(1, dtype=torch.float8_e4m3fn),
               "l.weight": torch.randn(64, 64).to(torch.float8_e4m3fn), "l.scale_weight": torch.ones(1)}, src)
    with pytest.raises(CheckpointFormatError, match="already quantized.*'l'.*legacy scaled_fp8.*bf16/fp16"):
        convert_file(src, tmp_path / "o.safetensors", Policy(mode="int8"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["legacy.safetensors"]


def test_fp8_source_converts_with_a_warning(tmp_path, caplog):
    src = tmp_path / "fp8.safetensors"
    save_file({"l.weight": torch.randn(64, 256).to(torch.float8_e4m3fn), "l.bias": torch.zeros(64)}, src)
    with caplog.at_level("WARNING", logger="lowbit.quant.convert"):
        report = convert_file(src, tmp_path / "o.safetensors", Policy(mode="int8", preset="generic"))
    assert report.layer_counts == {"int8": 1}
    assert "float8_e4m3fn" in caplog.text and "original" in caplog.text


# ---- Show 3: bounded memory on a >= 2 GB checkpoint -----------------------------------------------

ROWS, COLS, BIG_TENSORS = 4096, 6144, 43  # 48 MiB bf16 each, 2.02 GiB in all

CHILD = textwrap.dedent("""
    import json, resource, sys
    from lowbit.quant.convert import convert_file
    from lowbit.quant.policy import Policy

    def peak_rss():
        # Linux: VmHWM, this process's own high-water mark. ru_maxrss would do elsewhere, but on Linux
        # it is carried across exec from the forking parent (here: the whole pytest process).
        try:
            with open("/proc/self/status") as status:
                return next(int(l.split()[1]) * 1024 for l in status if l.startswith("VmHWM:"))
        except (OSError, StopIteration):
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)

    after_imports = peak_rss()
    report = convert_file(sys.argv[1], sys.argv[2], Policy(mode="int8", preset="generic"))
    print(json.dumps({"peak_rss": peak_rss(), "after_imports": after_imports, "seconds": report.seconds,
                      "counts": report.layer_counts, "bytes_out": report.bytes_out}))
""")


@pytest.mark.skipif(sys.platform == "win32", reason="resource.getrusage is POSIX-only")
def test_streaming_conversion_peak_rss_is_bounded(tmp_path):
    src = tmp_path / "big.safetensors"
    gen = torch.Generator().manual_seed(0)
    block = (torch.randn(ROWS, COLS, generator=gen) * 0.02).to(torch.bfloat16)
    largest = block.numel() * block.element_size()
    with CheckpointWriter(src, header_reserve=1 << 16) as writer:  # streamed: never 2 GB in this process
        for i in range(BIG_TENSORS):
            writer.add(f"blocks.{i}.linear.weight", block)
            writer.add(f"blocks.{i}.linear.bias", torch.zeros(ROWS, dtype=torch.bfloat16))
    del block
    assert src.stat().st_size >= 2 * 2**30

    dst = tmp_path / "big_int8.safetensors"
    result = subprocess.run([sys.executable, "-c", CHILD, str(src), str(dst)],
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    stats = json.loads(result.stdout.strip().splitlines()[-1])
    bound = 3 * largest + 2**30
    print(f"\nstreaming int8 conversion of {src.stat().st_size / 2**30:.2f} GiB: peak RSS "
          f"{stats['peak_rss'] / 2**20:.0f} MiB (bound {bound / 2**20:.0f} MiB, largest tensor "
          f"{largest / 2**20:.0f} MiB; {stats['after_imports'] / 2**20:.0f} MiB after imports), "
          f"{stats['seconds']:.1f} s")
    assert stats["counts"] == {"int8": BIG_TENSORS}
    assert stats["peak_rss"] < bound
    with open_checkpoint(dst) as reader:  # the output is complete and holds int8 weights
        assert reader.dtypes()["blocks.42.linear.weight"] == torch.int8
        assert reader.file_size == stats["bytes_out"]
    assert leftovers(tmp_path) == []
