"""Import real ComfyUI in-process for the tests under tests/comfy, or skip them with the reason.

ComfyUI is found through ``COMFYUI_PATH``, else ``~/ComfyUI``. It runs on the CPU unless
``LOWBIT_TEST_DEVICE=cuda`` is set (so the suite behaves the same on a GPU-less CI box); with
``LOWBIT_TEST_DYNAMIC_VRAM=1`` as well, Dynamic VRAM (comfy-aimdo) is switched on as ComfyUI's
``main.py`` does, so models load through ``ModelPatcherDynamic``.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest
import torch


def comfyui_path() -> Path | None:
    candidate = Path(os.environ.get("COMFYUI_PATH") or Path("~/ComfyUI").expanduser())
    return candidate if (candidate / "comfy" / "ops.py").is_file() else None


@functools.lru_cache(maxsize=1)
def _import_comfy():
    path = comfyui_path()
    if path is None:
        return None
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    import comfy.cli_args

    dynamic_vram = os.environ.get("LOWBIT_TEST_DYNAMIC_VRAM") == "1"
    if os.environ.get("LOWBIT_TEST_DEVICE", "cpu") == "cpu":
        comfy.cli_args.args.cpu = True
    elif dynamic_vram:  # main.py loads comfy-aimdo's library before anything touches CUDA
        import comfy_aimdo.control

        comfy_aimdo.control.init()
    import comfy.model_management
    import comfy.ops
    import comfy.sd
    import comfy.utils

    if dynamic_vram and not comfy.cli_args.args.cpu:
        _enable_dynamic_vram()
    return comfy


def _enable_dynamic_vram() -> None:
    """What ComfyUI's main.py does when comfy-aimdo works on this machine."""
    import comfy.memory_management
    import comfy.model_management
    import comfy.model_patcher
    import comfy_aimdo.control

    devices = comfy.model_management.get_all_torch_devices()
    try:
        ok = comfy_aimdo.control.init_devices((d.index, 0) for d in devices)
    except TypeError:
        ok = comfy_aimdo.control.init_devices(d.index for d in devices)
    if not ok:
        raise RuntimeError("LOWBIT_TEST_DYNAMIC_VRAM=1 but comfy-aimdo could not initialise the devices")
    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True


def require_comfy():
    """ComfyUI's ``comfy`` package, imported; skips the calling test module when ComfyUI is absent."""
    comfy = _import_comfy()
    if comfy is None:
        pytest.skip("ComfyUI not found: set COMFYUI_PATH to a ComfyUI checkout (or clone it to ~/ComfyUI)",
                    allow_module_level=True)
    return comfy


def device() -> torch.device:
    import comfy.model_management

    return comfy.model_management.get_torch_device()


def sqnr_db(reference: torch.Tensor, test: torch.Tensor) -> float:
    reference, test = reference.double(), test.double()
    noise = (reference - test).pow(2).mean()
    return float("inf") if noise == 0 else float(10 * torch.log10(reference.pow(2).mean() / noise))


# ---- the tiny Flux ----------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def tiny_flux_bf16() -> dict[str, torch.Tensor]:
    from lowbit.quant.demo import tiny_flux_state_dict

    return tiny_flux_state_dict(seed=0, dtype=torch.bfloat16)


def load_stock(state_dict: dict[str, torch.Tensor], **model_options):
    """A diffusion model built by stock ComfyUI from ``state_dict`` (a copy: ComfyUI pops keys)."""
    import comfy.sd

    model = comfy.sd.load_diffusion_model_state_dict(dict(state_dict), model_options=model_options)
    assert model is not None, "stock ComfyUI did not recognise the state dict as a diffusion model"
    return model


@functools.lru_cache(maxsize=4)
def flux_inputs(seed: int = 0, batch: int = 1):
    """Latent, timestep, text context, pooled vector and guidance for the tiny Flux (16x16 latent)."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(batch, 16, 16, 16, generator=gen),
        "t": torch.full((batch,), 0.6),
        "c_crossattn": torch.randn(batch, 8, 64, generator=gen),
        "y": torch.randn(batch, 32, generator=gen),
        "guidance": torch.full((batch,), 3.5),
    }


def run_flux(model_patcher, seed: int = 0) -> torch.Tensor:
    """One denoiser call of a Flux ModelPatcher, the way a sampler makes it (weights loaded first)."""
    import comfy.model_management

    inputs = flux_inputs(seed)
    comfy.model_management.load_models_gpu([model_patcher])
    dev = model_patcher.load_device
    with torch.no_grad():
        out = model_patcher.model.apply_model(inputs["x"].to(dev), inputs["t"].to(dev),
                                              c_crossattn=inputs["c_crossattn"].to(dev), y=inputs["y"].to(dev),
                                              guidance=inputs["guidance"].to(dev))
    return out.float().cpu()
