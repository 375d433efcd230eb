"""Save Quantized Model's pieces, in-process: workflow metadata, run-time-state refusal, streaming writer.

Imports the node module (which needs ComfyUI's ``comfy_api``), so it skips when ComfyUI is absent.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from comfy_server import comfyui_path, import_node_module

COMFY = comfyui_path()
pytestmark = pytest.mark.skipif(COMFY is None, reason="ComfyUI not found: set COMFYUI_PATH or clone it to ~/ComfyUI")


@pytest.fixture(scope="module")
def save():
    return import_node_module("save")


@pytest.fixture
def metadata_flag():
    from comfy.cli_args import args

    before = args.disable_metadata
    yield args
    args.disable_metadata = before


def test_metadata_holds_prompt_and_workflow_unless_disabled(save, metadata_flag):
    prompt = {"1": {"class_type": "LowBitSaveQuantizedModel", "inputs": {}}}
    extra = {"workflow": {"nodes": [1], "links": []}}
    metadata_flag.disable_metadata = False
    meta = save.workflow_metadata(prompt, extra)
    assert json.loads(meta["prompt"]) == prompt and json.loads(meta["workflow"]) == extra["workflow"]
    metadata_flag.disable_metadata = True
    assert save.workflow_metadata(prompt, extra) is None


def _patcher(**state):
    base = {"patches": {}, "hook_patches": {}, "weight_wrapper_patches": {}, "object_patches": {}, "injections": {}}
    return SimpleNamespace(**{**base, **state})


def test_runtime_state_is_refused_with_the_fix(save):
    assert save.runtime_state(_patcher()) == []
    save.check_savable(_patcher())
    lora = _patcher(patches={"diffusion_model.blocks.0.proj.weight": [object()]})
    with pytest.raises(save.RuntimeStateError) as err:
        save.check_savable(lora)
    message = str(err.value)
    assert "1 pending weight patch" in message and "diffusion_model.blocks.0.proj.weight" in message
    assert "before* Quantize Model (LowBit)" in message
    assert save.runtime_state(_patcher(injections={"lowbit_lora": []})) == []  # an emptied injection slot
    assert any("lowbit_lora" in p for p in save.runtime_state(_patcher(injections={"lowbit_lora": [object()]})))
    sampling = _patcher(object_patches={"model_sampling": object()})
    assert save.runtime_state(sampling) == []  # a sampling setting is not a weight: saved without it
    save.check_savable(sampling)
    assert save.unsaved_settings(sampling) == ["model_sampling"]
    assert isinstance(err.value, ValueError)  # LowBit's user errors are ValueErrors


def test_writer_streams_every_tensor_and_never_overwrites(save, tmp_path):
    from lowbit.quant.errors import OutputExistsError

    tensors = {"a.weight": torch.randint(-127, 127, (64, 32), dtype=torch.int8),
               "a.weight_scale": torch.rand(64, 1), "a.comfy_quant": torch.tensor([123, 125], dtype=torch.uint8),
               "b.bias": torch.randn(7, dtype=torch.bfloat16)}
    seen = []
    path = tmp_path / "model_00001_.safetensors"
    count = save.write_checkpoint(tensors, str(path), {"prompt": "{}"}, progress=seen.append)
    assert count == 4 and seen == [1, 2, 3, 4]
    back = load_file(str(path))
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"prompt": "{}"}
    with pytest.raises(OutputExistsError):
        save.write_checkpoint({"x": torch.zeros(1)}, str(path), None)
    assert torch.equal(load_file(str(path))["a.weight"], tensors["a.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name], "a temp file was left behind"
