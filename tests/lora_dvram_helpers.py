"""ComfyUI's Dynamic VRAM (``ModelPatcherDynamic``) on a machine without a GPU, for the LoRA tests.

Only comfy-aimdo's allocator and the CUDA host-registration calls are replaced: a VRAM allocation is a
CPU byte buffer with a residency signature (evicted on ``partially_unload``), a pinned host buffer is a
growable CPU byte buffer, and ``cudaHostRegister`` always succeeds. Everything else - the patcher (clone,
partially_load, load, detach), its cast (``cast_bias_weight`` -> ``cast_modules_with_vbar`` ->
``resolve_cast_module_with_vbar``) and its pin stacks (``comfy/pinned_memory.py``) - is ComfyUI's own.
The patcher loads to ``cpu:0`` (weights stay where they are, and ComfyUI does not reroute it to a plain
ModelPatcher as it does for ``cpu``); layers are cast for ``meta`` (that device only steers ComfyUI onto
its vbar path; the bytes land in the fake allocation). Import after ``require_comfy()``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import comfy.cli_args
import comfy.model_management
import comfy.model_patcher
import comfy.ops
import comfy.utils
import comfy_aimdo.host_buffer
import comfy_aimdo.model_vbar
import comfy_aimdo.torch
from comfy_kitchen.tensor import QuantizedTensor

LOAD_DEVICE = torch.device("cpu", 0)  # not == torch.device("cpu"): ComfyUI gives it a vbar
CAST_DEVICE = torch.device("meta")  # any device but the weights' own sends cast_bias_weight down the vbar path


class _Allocation(tuple):
    """One module's VRAM allocation: bytes, and the signature of its current residency (None: evicted).
    A ``(vbar, offset, size)`` tuple, as comfy-aimdo's ``ModelVBAR.alloc`` returns: ComfyUI 0.31+ reads
    the offset and size to span a block's layers with one range (``_v_block``)."""

    def __new__(cls, vbar, offset: int, size: int):
        allocation = super().__new__(cls, (vbar, offset, size))
        allocation.buffer = torch.zeros(size, dtype=torch.uint8)
        allocation.signature = None
        return allocation

    __hash__ = object.__hash__  # identity, as for comfy-aimdo's tuples of distinct offsets

    def __eq__(self, other):
        return self is other


class FakeVBAR:
    _signatures = itertools.count(1)

    def __init__(self, size, device_index):
        self.allocations: list[_Allocation] = []
        self.offset = 0

    def prioritize(self):
        pass

    def alloc(self, size):
        self.allocations.append(_Allocation(self, self.offset, int(size)))
        self.offset += int(size)
        return self.allocations[-1]

    def loaded_size(self):
        return sum(a.buffer.numel() for a in self.allocations if a.signature is not None)

    def free_memory(self, size):
        freed = self.loaded_size()
        for allocation in self.allocations:
            allocation.signature = None
        return freed


def _fault(allocation):  # page the allocation in; a page faulted in afresh gets a new signature
    if allocation.signature is None:
        allocation.signature = next(FakeVBAR._signatures)
    return allocation.signature


class FakeHostBuffer:
    """comfy-aimdo's growable pinned host buffer: ``size`` bytes in use out of a CPU byte buffer."""

    def __init__(self, *args, **kwargs):
        self.size = 0
        self.bytes = torch.zeros(0, dtype=torch.uint8)

    def extend(self, size, register=False):
        self.size += int(size)
        if self.size > self.bytes.numel():
            grown = torch.zeros(max(self.size, 2 * self.bytes.numel()), dtype=torch.uint8)
            grown[: self.bytes.numel()] = self.bytes
            self.bytes = grown

    def truncate(self, offset, do_unregister=False):
        self.size = offset


class _FakeCudart:
    @staticmethod
    def cudaHostRegister(pointer, size, flags):
        return 0

    @staticmethod
    def cudaHostUnregister(pointer):
        return 0


class DynamicPatcher(comfy.model_patcher.ModelPatcherDynamic):
    """ModelPatcherDynamic itself; only its ``__new__`` no longer turns a CPU load device into a ModelPatcher."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)


def _fake_allocator(monkeypatch):
    monkeypatch.setattr(comfy_aimdo.model_vbar, "ModelVBAR", FakeVBAR)
    monkeypatch.setattr(comfy_aimdo.model_vbar, "vbar_fault", _fault)
    monkeypatch.setattr(comfy_aimdo.model_vbar, "vbar_signature_compare", lambda new, old: new is not None and new == old)
    monkeypatch.setattr(comfy_aimdo.model_vbar, "vbar_unpin", lambda allocation: None)
    monkeypatch.setattr(comfy_aimdo.torch, "aimdo_to_tensor", lambda allocation, device: allocation.buffer)
    monkeypatch.setattr(comfy_aimdo.host_buffer, "HostBuffer", FakeHostBuffer)


@pytest.fixture
def fake_aimdo(monkeypatch):
    """The fake allocator, pinned memory off (ComfyUI's ``--disable-pinned-memory``)."""
    _fake_allocator(monkeypatch)
    monkeypatch.setattr(comfy.cli_args.args, "disable_pinned_memory", True)


@pytest.fixture
def fake_aimdo_pinned(monkeypatch):
    """The fake allocator with pinned host copies on: ComfyUI's pin stacks run, over fake host buffers."""
    _fake_allocator(monkeypatch)
    monkeypatch.setattr(comfy.cli_args.args, "disable_pinned_memory", False)
    monkeypatch.setattr(comfy_aimdo.torch, "hostbuf_to_tensor", lambda hostbuf: hostbuf.bytes)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: _FakeCudart)
    monkeypatch.setattr(comfy.model_management, "MAX_PINNED_MEMORY", 1 << 40)
    monkeypatch.setattr(comfy.model_management, "TOTAL_PINNED_MEMORY", 0)
    monkeypatch.setattr(comfy.model_management, "ensure_pin_budget", lambda size, **kwargs: True)


_LOADED: dict = {}  # model -> the patcher of it last loaded


def switch_to(patcher, previous=None):
    """What ``load_models_gpu`` does when a clone replaces another on the device: detach the other without
    unpatching it, then ``partially_load`` this one."""
    if previous is not None:
        previous.detach(unpatch_all=False)
    patcher.partially_load(LOAD_DEVICE, 1e32)
    _LOADED[patcher.model] = patcher


def release(patcher) -> None:
    """End of a test: detach what is loaded while the fakes are still in place; no patcher of the model
    unpins anything when collected later."""
    loaded = _LOADED.pop(patcher.model, None)
    if loaded is not None:
        loaded.detach(unpatch_all=False)
    patcher.model.dynamic_patchers.clear()


def module_at(patcher, layer):
    return comfy.utils.get_attr(patcher.model, f"diffusion_model.{layer}")


def cast(patcher, layer) -> torch.Tensor:
    """The weight the layer runs with: ComfyUI's cast of it, as LowBit's quantized forward asks for it."""
    module = module_at(patcher, layer)
    assert hasattr(module, "_v"), f"{layer} is not streamed through the vbar; the test would not test it"
    weight, bias, stream = comfy.ops.cast_bias_weight(
        module, input=None, dtype=module.weight.dtype, device=CAST_DEVICE, bias_dtype=torch.bfloat16,
        offloadable=True, compute_dtype=torch.bfloat16, want_requant=True)
    comfy.ops.uncast_bias_weight(module, weight, bias, stream)
    assert isinstance(weight, QuantizedTensor)
    return weight.dequantize().float().clone()


def adapter_lora_files(root, weight: torch.Tensor, layer: str, extra_lowrank=None):
    """A plain LoRA, a LoHa and a DoRA on ``layer`` (float ``weight``) saved as bf16 files under ``root``;
    returns ``entries(*names) -> [LoraEntry]``. ``extra_lowrank(r)`` adds tensors to the plain LoRA's file,
    drawn from the same seeded generator ``r(*shape, scale=...)`` right after its own."""
    from safetensors.torch import save_file

    from lowbit.nodes.lora_nodes import LoraEntry

    (n, k), s, gen = weight.shape, float(weight.std()), torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    prefix = f"lora_unet_{layer.replace('.', '_')}"
    lowrank = {f"{prefix}.lora_down.weight": r(8, k) / k**0.5, f"{prefix}.lora_up.weight": r(n, 8, scale=0.5 * s)}
    lowrank.update(extra_lowrank(r) if extra_lowrank else {})
    files = {
        "lowrank": lowrank,
        "loha": {f"{prefix}.hada_w1_a": r(n, 4, scale=0.3), f"{prefix}.hada_w1_b": r(4, k, scale=0.3),
                 f"{prefix}.hada_w2_a": r(n, 4, scale=0.3), f"{prefix}.hada_w2_b": r(4, k, scale=s),
                 f"{prefix}.alpha": torch.tensor(4.0)},
        "dora": {f"{prefix}.lora_down.weight": r(8, k) / k**0.5, f"{prefix}.lora_up.weight": r(n, 8, scale=0.5 * s),
                 f"{prefix}.dora_scale": weight.norm(dim=1, keepdim=True) * 1.3},
    }
    for name, tensors in files.items():
        save_file({key: v.to(torch.bfloat16).contiguous() for key, v in tensors.items()}, str(root / f"{name}.safetensors"))
    return lambda *names: [LoraEntry(name, str(root / f"{name}.safetensors"), 1.0) for name in names]
