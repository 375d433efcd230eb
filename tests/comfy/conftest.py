"""Fixtures shared by the in-process ComfyUI tests (each test module skips itself without ComfyUI)."""

from __future__ import annotations

import pytest

from comfy_helpers import load_stock, run_flux, tiny_flux_bf16


@pytest.fixture(scope="module")
def float_model():
    """The tiny bf16 Flux, loaded by stock ComfyUI."""
    return load_stock(tiny_flux_bf16())


@pytest.fixture(scope="module")
def float_output(float_model):
    return run_flux(float_model)


@pytest.fixture(scope="module")
def zimage():
    """The tiny Z-Image, loaded by stock ComfyUI, and its denoiser output."""
    from comfy_helpers import load_tiny_zimage, run_zimage

    model = load_tiny_zimage()
    return model, run_zimage(model)


@pytest.fixture(scope="module")
def krea2():
    """The tiny Krea 2, loaded by stock ComfyUI, and its denoiser output."""
    from comfy_helpers import load_tiny_krea2, run_krea2

    model = load_tiny_krea2()
    return model, run_krea2(model)


@pytest.fixture
def models_dir(tmp_path, monkeypatch):
    """A private models/diffusion_models folder for the loader nodes."""
    import folder_paths

    folder = tmp_path / "diffusion_models"
    folder.mkdir()
    exts = folder_paths.folder_names_and_paths["diffusion_models"][1]
    monkeypatch.setitem(folder_paths.folder_names_and_paths, "diffusion_models", ([str(folder)], exts))
    monkeypatch.setattr(folder_paths, "filename_list_cache", {})
    return folder


@pytest.fixture
def launches(monkeypatch):
    """The one-pass q, k, v kernel's launches, as ``(rows, first row)`` a launch (the kernel still runs)."""
    from lowbit.kernels import triton_joint_heads

    calls = []
    real = triton_joint_heads.joint_qkv_part_triton

    def spy(part, row0, heads, freqs, *outs):
        calls.append((part.q.shape[1], row0))
        return real(part, row0, heads, freqs, *outs)

    monkeypatch.setattr(triton_joint_heads, "joint_qkv_part_triton", spy)
    return calls
