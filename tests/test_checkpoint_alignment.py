"""The checkpoint writer keeps tensor data 64-byte aligned in the file (issue "nodes", Show 1c).

Stock ComfyUI on the CPU loads a ``.safetensors`` file through ``safe_open`` and computes with views
into the memory-mapped file. CPU matmul kernels (MKL's GEMV on AVX-512 here) round an operand at an
offset of 8 bytes differently from one at the 64-byte alignment PyTorch's allocator gives, so a
saved model sampled other last bits than the in-memory model it was saved from, amplified by INT8
activation rounding to a visibly different latent. These tests pin the file layout and its effect.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from lowbit.quant.checkpoint import CheckpointWriter, open_checkpoint, save_checkpoint
from lowbit.quant.native import encode_comfy_quant

ALIGN = 64


def layer_tensors() -> dict[str, torch.Tensor]:
    """Float weights a single-token Linear multiplies (the GEMV path), mixed with odd-sized tensors."""
    gen = torch.Generator().manual_seed(3)
    return {
        "a.comfy_quant": encode_comfy_quant({"format": "int8_tensorwise"}),  # odd-sized uint8
        "a.weight": torch.randint(-128, 128, (64, 64), generator=gen, dtype=torch.int8),
        "a.weight_scale": torch.tensor(0.01),  # 4 bytes
        "mod.weight": torch.randn(512, 256, generator=gen),
        "mod.bias": torch.randn(512, generator=gen),
        "odd.bias": torch.randn(5, generator=gen),  # 20 bytes
        "final.weight": torch.randn(64, 64, generator=gen),
        "final.bias": torch.randn(64, generator=gen).to(torch.bfloat16),
        "norm.scale": torch.randn(24, generator=gen).to(torch.bfloat16),  # 48 bytes
    }


def _write(tmp_path, how: str):
    tensors = layer_tensors()
    path = tmp_path / f"{how}.safetensors"
    if how == "save_checkpoint":
        save_checkpoint(tensors, path, metadata={"prompt": "{}"})
    else:  # the default reserve, and a reserve the header outgrows (the file is rewritten once)
        reserve = {"default_reserve": 64 << 10, "header_outgrows_reserve": 0}[how]
        with CheckpointWriter(path, metadata={"workflow": "x" * 1001}, header_reserve=reserve) as writer:
            writer.update(tensors)
    return path, tensors


@pytest.mark.parametrize("how", ["save_checkpoint", "default_reserve", "header_outgrows_reserve"])
def test_tensor_data_starts_at_64_byte_file_offsets(tmp_path, how):
    path, tensors = _write(tmp_path, how)
    with open_checkpoint(path) as reader:
        assert reader.data_start % ALIGN == 0, f"tensor data starts at byte {reader.data_start}"
        misaligned = {k: reader.data_start + i.begin for k, i in reader.tensors.items()
                      if i.nbytes % ALIGN == 0 and (reader.data_start + i.begin) % ALIGN}
        assert misaligned == {}, f"tensors off {ALIGN}-byte file offsets: {misaligned}"
        # the odd-sized rest still sits at a multiple of its element size
        assert all((reader.data_start + i.begin) % i.dtype.itemsize == 0 for i in reader.tensors.values())
    with safe_open(str(path), framework="pt") as f:  # stock ComfyUI's CPU path: views into the mapped file
        for key in ("mod.weight", "mod.bias", "final.weight", "a.weight"):
            mapped = f.get_tensor(key)
            assert torch.equal(mapped, tensors[key])
            offset = mapped.data_ptr() % ALIGN
            assert offset == 0, f"{key} is mapped at an address {offset} mod {ALIGN}"


@pytest.mark.parametrize("how", ["save_checkpoint", "default_reserve"])
def test_linear_on_mapped_weights_matches_allocated_weights_bit_for_bit(tmp_path, how):
    """A single-token Linear on the weights as stock ComfyUI maps them equals the same weights in
    freshly allocated memory (what a model quantized in memory holds), bit for bit."""
    path, tensors = _write(tmp_path, how)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(4))
    with safe_open(str(path), framework="pt") as f:
        weight, bias = f.get_tensor("mod.weight"), f.get_tensor("mod.bias")
        mapped = torch.nn.functional.linear(x, weight, bias)
        allocated = torch.nn.functional.linear(x, weight.clone(), bias.clone())
    assert torch.equal(mapped, allocated)
    assert torch.equal(allocated, torch.nn.functional.linear(x, tensors["mod.weight"], tensors["mod.bias"]))
