"""Import real ComfyUI in-process for the tests under tests/comfy, or skip them with the reason.

ComfyUI is found through ``COMFYUI_PATH``, else ``~/ComfyUI``. It runs on the CPU unless
``LOWBIT_TEST_DEVICE=cuda`` is set (so the suite behaves the same on a GPU-less CI box); with
``LOWBIT_TEST_DYNAMIC_VRAM=1`` as well, Dynamic VRAM (comfy-aimdo) is switched on as ComfyUI's
``main.py`` does, so models load through ``ModelPatcherDynamic``.

ComfyUI's top-level ``nodes`` module (``<ComfyUI>/nodes.py``) shares its name with this repository's
``nodes/`` package; :func:`comfy_nodes` is the one way the tests get ComfyUI's (see there).

On the CPU, stock ComfyUI and LowBit run the same comfy-kitchen/eager numerics, so where both run
the same quantized weights their outputs are bit-identical and the tests say so; on CUDA they run
different kernels and :func:`assert_matches_stock` says what holds there instead.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from lowbit.kernels import dispatch, triton_act_quant


def comfyui_path() -> Path | None:
    candidate = Path(os.environ.get("COMFYUI_PATH") or Path("~/ComfyUI").expanduser())
    return candidate if (candidate / "comfy" / "ops.py").is_file() else None


@functools.lru_cache(maxsize=1)
def _import_comfy():
    path = comfyui_path()
    if path is None:
        return None
    _put_first_on_sys_path(path)
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
    _import_comfy_nodes(path)  # before any ComfyUI module (execution, comfy_extras...) does ``import nodes``
    return comfy


def _put_first_on_sys_path(path: Path) -> None:
    """ComfyUI's folder at ``sys.path[0]``, even when it is already further down.

    pytest-xdist workers (and ``python -m pytest``) put the working directory, this repository's root,
    at ``sys.path[0]``; a ComfyUI folder that came in through ``PYTHONPATH`` then sits behind it.
    """
    resolved = path.resolve()
    sys.path[:] = [p for p in sys.path if not p or Path(p).resolve() != resolved]
    sys.path.insert(0, str(path))


def _import_comfy_nodes(path: Path):
    """``<ComfyUI>/nodes.py`` as the top-level module ``nodes``, whatever ``sys.path`` holds.

    The repository root is the pytest rootdir and on ``sys.path`` (xdist puts it first), and LowBit's
    own ``nodes/`` package would answer ``import nodes`` there: ``nodes.NODE_CLASS_MAPPINGS`` and
    ``nodes.UNETLoader`` then do not exist. Loading the file by its path is unambiguous, and
    registering it in ``sys.modules`` first makes every later ``import nodes`` (ComfyUI's
    ``execution``, ``comfy_extras``...) get the same module.
    """
    expected = (path / "nodes.py").resolve()
    module = sys.modules.get("nodes")
    if module is not None and getattr(module, "__file__", None) and Path(module.__file__).resolve() == expected:
        return module
    sys.modules.pop("nodes", None)  # the wrong ``nodes`` (this repository's package), if one got in first
    spec = importlib.util.spec_from_file_location("nodes", expected)
    module = importlib.util.module_from_spec(spec)
    sys.modules["nodes"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop("nodes", None)
        raise
    return module


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


def comfy_nodes():
    """ComfyUI's ``nodes`` module (``NODE_CLASS_MAPPINGS``, ``UNETLoader``, ``common_ksampler``...),
    never this repository's ``nodes/`` package. Test modules use this instead of ``import nodes``."""
    require_comfy()
    return _import_comfy_nodes(comfyui_path())


def device() -> torch.device:
    import comfy.model_management

    return comfy.model_management.get_torch_device()


def on_cuda() -> bool:
    """Whether ComfyUI runs the models on a CUDA device (``LOWBIT_TEST_DEVICE=cuda``)."""
    return device().type == "cuda"


def dynamic_vram_on() -> bool:
    """Whether models load through Dynamic VRAM (comfy-aimdo's ``ModelPatcherDynamic``)."""
    import comfy.memory_management

    return on_cuda() and bool(getattr(comfy.memory_management, "aimdo_enabled", False))


def rel_error(test: torch.Tensor, reference: torch.Tensor) -> float:
    """``|test - reference| / |reference|`` (Frobenius norms, in fp32)."""
    return float((test.float() - reference.float()).norm() / reference.float().norm())


def sqnr_db(reference: torch.Tensor, test: torch.Tensor) -> float:
    reference, test = reference.double(), test.double()
    noise = (reference - test).pow(2).mean()
    return float("inf") if noise == 0 else float(10 * torch.log10(reference.pow(2).mean() / noise))


def random_weights(build, seed: int = 0, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """bf16 random weights for the model ``build()`` makes on the meta device with ComfyUI's
    ``disable_weight_init`` operations: matrices N(0, 1 / fan-in), vectors N(0, 0.02^2), drawn on ``device``
    (seeded), returned on the CPU. Dynamic VRAM is off while the model is built (with it on, ComfyUI's layers
    wait for a state dict)."""
    import comfy.memory_management

    lazy = getattr(comfy.memory_management, "aimdo_enabled", False)
    comfy.memory_management.aimdo_enabled = False
    try:
        shapes = build().state_dict()
    finally:
        comfy.memory_management.aimdo_enabled = lazy
    gen = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for key, t in shapes.items():
        value = torch.randn(t.shape, generator=gen, device=device)
        out[key] = (value * (t.shape[-1] ** -0.5 if t.dim() >= 2 else 0.02)).to(torch.bfloat16).cpu()
    return out


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


def run_flux(model_patcher, seed: int = 0, load: bool = True) -> torch.Tensor:
    """One denoiser call of a Flux ModelPatcher, the way a sampler makes it (weights loaded first;
    ``load=False``: run the model as ComfyUI's model manager left it, e.g. partly unloaded)."""
    import comfy.model_management

    inputs = flux_inputs(seed)
    if load:
        comfy.model_management.load_models_gpu([model_patcher])
    dev = model_patcher.load_device
    with torch.no_grad():
        out = model_patcher.model.apply_model(inputs["x"].to(dev), inputs["t"].to(dev),
                                              c_crossattn=inputs["c_crossattn"].to(dev), y=inputs["y"].to(dev),
                                              guidance=inputs["guidance"].to(dev))
    return out.float().cpu()


#: a tiny Flux 2 (ComfyUI's ``flux2``: SwiGLU MLPs, global modulation, 128 latent channels): width 256, two heads
TINY_FLUX2 = dict(image_model="flux2", axes_dim=[32, 32, 32, 32], num_heads=2, mlp_ratio=3.0, theta=2000,
                  out_channels=128, global_modulation=True, mlp_silu_act=True, qkv_bias=False, ops_bias=False,
                  default_ref_method="index", ref_index_scale=10.0, txt_ids_dims=[3], patch_size=1, in_channels=128,
                  hidden_size=256, context_in_dim=64, vec_in_dim=None, depth=1, depth_single_blocks=1,
                  guidance_embed=True, yak_mlp=False, txt_norm=False)


def tiny_weights(module_name: str, class_name: str, layout: dict,
                 device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """:func:`random_weights` (on ``device``) of ComfyUI's ``module_name.class_name`` built with ``layout``."""
    import comfy.ops

    cls = getattr(importlib.import_module(module_name), class_name)
    return random_weights(lambda: cls(**layout, device="meta", operations=comfy.ops.disable_weight_init),
                          device=device)


def load_detected(state_dict: dict[str, torch.Tensor], image_model: str, fill):
    """``state_dict`` loaded by stock ComfyUI, its detected config of ``image_model`` amended by
    ``fill(config, state_dict, key_prefix)`` for this load only (ComfyUI's detection fixes some widths to the
    released model's)."""
    import comfy.model_detection

    real = comfy.model_detection.detect_unet_config

    def detect(state_dict, key_prefix, *args, **kwargs):
        config = real(state_dict, key_prefix, *args, **kwargs)
        return fill(config, state_dict, key_prefix) if config and config.get("image_model") == image_model else config

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(comfy.model_detection, "detect_unet_config", detect)
        return load_stock(state_dict)


@functools.lru_cache(maxsize=1)
def tiny_flux2_bf16() -> dict[str, torch.Tensor]:
    return tiny_weights("comfy.ldm.flux.model", "Flux", TINY_FLUX2)


def _tiny_denoiser_call(model_patcher, channels: int, seed: int, extra_conds, frames: int | None = None,
                        text_width: int = 64) -> torch.Tensor:
    """One denoiser call on an 8x8 latent of ``channels`` (of ``frames``, for a model of video-shaped latents) with 16
    text tokens of ``text_width`` (timestep 0.7), weights loaded first; ``extra_conds(device)``: the model's other
    conditioning."""
    import comfy.model_management

    gen = torch.Generator().manual_seed(seed)
    shape = (1, channels, 8, 8) if frames is None else (1, channels, frames, 8, 8)
    x, context = torch.randn(*shape, generator=gen), torch.randn(1, 16, text_width, generator=gen)
    comfy.model_management.load_models_gpu([model_patcher])
    dev = model_patcher.load_device
    with torch.no_grad():
        out = model_patcher.model.apply_model(x.to(dev), torch.tensor([0.7], device=dev), c_crossattn=context.to(dev),
                                              **extra_conds(dev))
    return out.float().cpu()


def run_flux2(model_patcher, seed: int = 0) -> torch.Tensor:
    """One denoiser call of the tiny Flux 2 (an 8x8 latent, 16 text tokens), weights loaded first."""
    return _tiny_denoiser_call(model_patcher, 128, seed, lambda dev: {"guidance": torch.tensor([3.5], device=dev)})


#: Z-Image's layout (its modulation, RoPE axes, 8/3 FFN) at width 256: two heads of 128, FFN 768 (w2's input a
#: multiple of the ConvRot group); ComfyUI detects the Z-Image class by the width 3840, so it is a ``Lumina2`` here
TINY_ZIMAGE = dict(patch_size=2, in_channels=16, dim=256, n_layers=2, n_refiner_layers=2, n_heads=2, n_kv_heads=2,
                   multiple_of=256, ffn_dim_multiplier=8.0 / 3.0, norm_eps=1e-5, qk_norm=True, cap_feat_dim=64,
                   axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512], rope_theta=256.0, z_image_modulation=True,
                   time_scale=1000.0)


@functools.lru_cache(maxsize=1)
def tiny_zimage_bf16() -> dict[str, torch.Tensor]:
    return tiny_weights("comfy.ldm.lumina.model", "NextDiT", TINY_ZIMAGE)


def load_tiny_zimage(state_dict: dict[str, torch.Tensor] | None = None):
    """The tiny Z-Image (or ``state_dict``, a Lumina 2 family model), loaded by stock ComfyUI. ComfyUI's detection
    reads the Lumina 2 family's width, layers and text width from the keys and fills in the rest for the two widths
    it knows (2304, 3840); for the tiny width this fills in the tiny layout the same way, for this load only."""
    def fill(config, state_dict, key_prefix):
        return {**TINY_ZIMAGE, **config} if config.get("dim") == TINY_ZIMAGE["dim"] else config

    return load_detected(tiny_zimage_bf16() if state_dict is None else state_dict, "lumina2", fill)


def run_zimage(model_patcher, seed: int = 0) -> torch.Tensor:
    """One denoiser call of the tiny Z-Image (an 8x8 latent, 16 text tokens), weights loaded first."""
    return _tiny_denoiser_call(model_patcher, 16, seed, lambda dev: {"num_tokens": 16})


#: Qwen-Image's layout (its dual-stream blocks, modulation, tanh-GELU MLP of 4x, RoPE axes) at width 256: two heads of
#: 128, MLP 1024, two blocks, a 64-wide text; ComfyUI's detection reads only the blocks and the input width from the
#: keys and takes the rest from the class's defaults (the 20B's), so the tiny load fills those in
TINY_QWEN = dict(num_layers=2, num_attention_heads=2, attention_head_dim=128, joint_attention_dim=64)


@functools.lru_cache(maxsize=1)
def tiny_qwen_bf16() -> dict[str, torch.Tensor]:
    return tiny_weights("comfy.ldm.qwen_image.model", "QwenImageTransformer2DModel", TINY_QWEN)


def load_tiny_qwen(state_dict: dict[str, torch.Tensor] | None = None):
    """The tiny Qwen-Image (or ``state_dict``, one of another size), loaded by stock ComfyUI: its detection gives the
    blocks and the input width, and this fills in the heads and text width the keys show, for this load only."""
    def fill(config, state_dict, key_prefix):
        head = state_dict[f"{key_prefix}transformer_blocks.0.attn.norm_q.weight"].shape[0]
        width = state_dict[f"{key_prefix}img_in.weight"].shape[0]
        return {**config, "attention_head_dim": head, "num_attention_heads": width // head,
                "joint_attention_dim": state_dict[f"{key_prefix}txt_norm.weight"].shape[0]}

    return load_detected(tiny_qwen_bf16() if state_dict is None else state_dict, "qwen_image", fill)


def run_qwen(model_patcher, seed: int = 0) -> torch.Tensor:
    """One denoiser call of the tiny Qwen-Image (an 8x8 latent of one frame, 16 text tokens), weights loaded first."""
    return _tiny_denoiser_call(model_patcher, 16, seed, lambda dev: {}, frames=1)


#: Krea 2's layout (single-stream blocks, AdaLN-single modulation, GQA with QK-norm and sigmoid gates, SwiGLU MLPs,
#: text fusion over the text encoder's layers) at width 256: two heads of 128 (kv too), MLP 768, two blocks; the text
#: side one layer of 80 (its 20 heads of 4), the only widths ComfyUI's detection does not read from the keys
TINY_KREA2 = dict(image_model="krea2", features=256, channels=16, patch=2, layers=2, heads=2, kvheads=2, txtlayers=1,
                  txtdim=80)


@functools.lru_cache(maxsize=1)
def tiny_krea2_bf16() -> dict[str, torch.Tensor]:
    return tiny_weights("comfy.ldm.krea2.model", "SingleStreamDiT", TINY_KREA2)


def load_tiny_krea2(state_dict: dict[str, torch.Tensor] | None = None):
    """The tiny Krea 2 (or ``state_dict``, one of another size), loaded by stock ComfyUI (its detection reads the
    whole layout from the keys)."""
    return load_stock(tiny_krea2_bf16() if state_dict is None else state_dict)


def run_krea2(model_patcher, seed: int = 0) -> torch.Tensor:
    """One denoiser call of the tiny Krea 2 (an 8x8 latent, 16 text tokens of its one text layer), weights loaded
    first."""
    return _tiny_denoiser_call(model_patcher, 16, seed, lambda dev: {}, text_width=TINY_KREA2["txtdim"])


#: HiDream's layout (dual- then single-stream blocks, MoE MLPs of a shared and 4 routed SwiGLU experts, two active;
#: its text MLP; per-block text projections) at width 256: two heads of 128, one block of each kind, text widths 64;
#: ComfyUI's detection fixes the released model's widths (2560, 20 heads), so the tiny load fills the tiny ones in
TINY_HIDREAM = dict(image_model="hidream", patch_size=2, in_channels=16, out_channels=16, num_layers=1,
                    num_single_layers=1, attention_head_dim=128, num_attention_heads=2, caption_channels=[64, 64],
                    text_emb_dim=64, num_routed_experts=4, num_activated_experts=2, axes_dims_rope=[64, 32, 32],
                    max_resolution=[128, 128], llama_layers=[0, 1])


@functools.lru_cache(maxsize=1)
def tiny_hidream_bf16() -> dict[str, torch.Tensor]:
    return tiny_weights("comfy.ldm.hidream.model", "HiDreamImageTransformer2DModel", TINY_HIDREAM)


def load_tiny_hidream(state_dict: dict[str, torch.Tensor] | None = None, layout: dict | None = None):
    """The tiny HiDream (or ``state_dict`` of ``layout``, another size), loaded by stock ComfyUI with that layout in
    place of the widths its detection fixes."""
    return load_detected(tiny_hidream_bf16() if state_dict is None else state_dict, "hidream",
                         lambda config, state_dict, key_prefix: {**config, **(layout or TINY_HIDREAM)})


def run_hidream(model_patcher, seed: int = 0) -> torch.Tensor:
    """One call of the tiny HiDream's diffusion model (an 8x8 latent; 16 T5 tokens and 16 tokens of each of its two
    llama layers, all 64 wide; a pooled embedding; timestep 0.7), weights loaded first."""
    import comfy.model_management

    gen = torch.Generator().manual_seed(seed)
    x, context = torch.randn(1, 16, 8, 8, generator=gen), torch.randn(1, 16, 64, generator=gen)
    llama, pooled = torch.randn(1, 2, 16, 64, generator=gen), torch.randn(1, 64, generator=gen)
    comfy.model_management.load_models_gpu([model_patcher])
    dev, dm = model_patcher.load_device, model_patcher.model.diffusion_model
    dtype = model_patcher.model.get_dtype()
    with torch.no_grad():
        out = dm(x.to(dev, dtype), torch.tensor([0.7], device=dev), y=pooled.to(dev, dtype),
                 context=context.to(dev, dtype), encoder_hidden_states_llama3=llama.to(dev, dtype))
    return out.float().cpu()


def flux_runner(model_patcher, output_0: torch.Tensor | None = None):
    """``seed -> run_flux(model_patcher, seed)``, giving ``output_0`` for input 0 where it was already run."""
    return lambda seed: output_0 if seed == 0 and output_0 is not None else run_flux(model_patcher, seed)


# ---- stock ComfyUI against LowBit on the same quantized weights -------------------------------------

def assert_same_quantized_tensor(layer: str, ours, stock) -> None:
    """qdata and every params field bit-identical (compared on the CPU: a loaded model may hold them
    on the GPU); ``orig_dtype`` is each loader's compute dtype."""
    assert ours._qdata.dtype == stock._qdata.dtype, layer
    same_qdata = torch.equal(ours._qdata.cpu().view(torch.uint8), stock._qdata.cpu().view(torch.uint8))
    assert same_qdata, f"{layer}: qdata differs"
    assert type(ours._params).__name__ == type(stock._params).__name__, layer
    for field in dataclasses.fields(ours._params):
        if field.name == "orig_dtype":
            continue
        a, b = getattr(ours._params, field.name), getattr(stock._params, field.name)
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            assert a is not None and b is not None, f"{layer}: {field.name} present in one only"
            assert a.dtype == b.dtype and a.shape == b.shape, (layer, field.name, a.dtype, b.dtype, a.shape, b.shape)
            assert torch.equal(a.cpu().reshape(-1).view(torch.uint8), b.cpu().reshape(-1).view(torch.uint8)), \
                (layer, field.name)
        else:
            assert a == b, (layer, field.name, a, b)


def assert_same_quantized_weights(ours, stock) -> int:
    """Every quantized weight of ModelPatcher ``ours`` is in ``stock`` and bit-identical; returns how many."""
    from comfy_kitchen.tensor import QuantizedTensor

    stock_modules = dict(stock.model.diffusion_model.named_modules())
    count = 0
    for name, module in ours.model.diffusion_model.named_modules():
        weight = module._parameters.get("weight")
        if isinstance(weight, QuantizedTensor):
            assert isinstance(stock_modules[name].weight, QuantizedTensor), f"{name}: not quantized in stock ComfyUI"
            assert_same_quantized_tensor(name, weight, stock_modules[name].weight)
            count += 1
    assert count, "no quantized weight to compare"
    return count


#: CUDA only: the least SQNR (dB) between stock ComfyUI's output and LowBit's for the same quantized
#: weights (the tiny Flux's denoiser output, or its latents after a short sampling run).
#:
#: Why they differ at all: the weights are bit-identical and both sides compute
#: ``Q(rot(x)) @ W.T * scales + bias``, but stock ComfyUI runs comfy-kitchen's CUDA kernels and
#: LowBit its own Triton kernels (or, per shape, whatever its measured dispatcher found fastest:
#: kitchen, ``torch._int_mm``, or the dequantized weight with no activation quantization). The
#: activation codes then differ where the rotated value sits at a rounding boundary: kitchen rotates
#: bf16 activations, LowBit's kernel rotates with fp16 tensor-core operands (~2^-12 of the row
#: maximum), and the scale's reciprocal and the bf16 epilogue round differently. One flipped code
#: costs one activation step, so the per-layer disagreement is a fraction of the activation
#: quantization noise itself (measured on a 256-feature layer: 52 dB between the backends against
#: 42 dB between quantized and unquantized activations, tests/comfy/test_comfy_ops.py).
#:
#: The bound: the worst case is one side not quantizing activations at all in any layer (LowBit's
#: dispatcher may pick its dequantize candidate): measured on the CPU that is 31.9 dB (int8) and
#: 39.1 dB (int8_convrot) from the quantized run, and LowBit's fp16-rotation kernel against kitchen's
#: fp32 path (Triton interpreter) 43.4 / 39.2 dB. An H200 run measured ~37 dB (int8) and ~35-36 dB
#: (int8_convrot; max |diff| 0.45 / 0.375 on outputs up to ~8-12), the bf16 compute adding its own
#: roundings. So 30 dB: below every one of those, and still 5 dB and more above the formats' own error
#: against float (int8 26.9, int8_convrot 31.2 dB), which :func:`assert_matches_stock` also checks is
#: no worse on LowBit's side. 4-bit activations have 7 or 15 levels, so one flipped code moves a
#: value by 1/7 of its row range and the tiny model amplifies it: W4A4 measured 34 dB on an H200
#: (11 dB from float), so 20 dB; the W4A8 file quantizes only 2 layers: 51 dB measured, so 40 dB.
CUDA_STOCK_AGREEMENT_DB = {"int8": 30.0, "int8_convrot": 30.0, "w4a4": 20.0, "w4a8": 40.0}
#: CUDA, where stock ComfyUI runs comfy-kitchen's *eager* numerics (kitchen without its CUDA extension,
#: or ComfyUI turned that backend off: it does under torch older than cu130). INT8 is the same W8A8
#: arithmetic there (34.2 dB measured for int8_convrot on an H200). W4A4 is not: kitchen's eager
#: ``convrot_w4a4_linear`` quantizes activations to 4 bits whatever ``linear_dtype`` says, while its
#: CUDA kernels and LowBit use 8 on a GPU without INT4 tensor cores (16.5 dB apart on an H200, stock
#: the farther from float: 12.5 against 13.7 dB). ``None``: not the same numerics, so no agreement
#: bound; the float-error check below still holds.
STOCK_EAGER_AGREEMENT_DB = {"int8": 30.0, "int8_convrot": 30.0, "w4a4": None, "w4a8": 40.0}
#: CUDA only: how much farther from the float model LowBit's output may be than stock ComfyUI's, in the
#: mean over :func:`stock_comparison_seeds` inputs (the kernels' rounding differences are random, not a
#: bias: both are as close to float). One input is not enough: over six inputs on an H200, LowBit's
#: int8_convrot SQNR minus stock's ran from -1.2 to +1.9 dB per input (mean +0.4), int8 from -1.1 to
#: +2.0 (mean +0.2); input 0 alone was the -1.2.
CUDA_FLOAT_ERROR_SLACK_DB = 1.5


def stock_comparison_seeds() -> tuple[int, ...]:
    """The inputs stock ComfyUI and LowBit are compared on: one on the CPU (the same bits), four on CUDA."""
    return (0, 1, 2, 3) if on_cuda() else (0,)


def stock_runs_kitchen_cuda() -> bool:
    """Whether stock ComfyUI's quantized layers run comfy-kitchen's CUDA kernels here: a CUDA device,
    kitchen's CUDA backend registered, and not turned off (ComfyUI turns it off under torch < cu130)."""
    if not on_cuda():
        return False
    from comfy_kitchen.registry import registry

    return registry.is_available("cuda")


def assert_matches_stock(fmt: str, stock_run, lowbit_run, float_run=None, what: str = "output") -> None:
    """Stock ComfyUI's run against LowBit's run of the same quantized weights.

    Each ``*_run`` maps an input seed to an output (``functools.partial(run_flux, model)``); they are
    called for every seed of :func:`stock_comparison_seeds`. CPU: bit-identical (both run
    comfy-kitchen's eager numerics). CUDA: within :data:`CUDA_STOCK_AGREEMENT_DB` of each other on
    every input (:data:`STOCK_EAGER_AGREEMENT_DB` where stock runs kitchen's eager numerics) and, given
    ``float_run``, LowBit on average no more than :data:`CUDA_FLOAT_ERROR_SLACK_DB` farther from the
    float model than stock ComfyUI is. (That both sides load the same tensors and that LowBit matches
    itself bit for bit are checked separately.)
    """
    seeds = stock_comparison_seeds()
    stock_outs, lowbit_outs = [stock_run(s) for s in seeds], [lowbit_run(s) for s in seeds]
    if not on_cuda():
        for seed, stock_out, lowbit_out in zip(seeds, stock_outs, lowbit_outs):
            assert torch.equal(stock_out, lowbit_out), (
                f"{fmt} {what} (input {seed}): stock and LowBit differ on the CPU, "
                f"max |diff| {(stock_out - lowbit_out).abs().max():.3e}")
        return
    kitchen_cuda = stock_runs_kitchen_cuda()
    bound = (CUDA_STOCK_AGREEMENT_DB if kitchen_cuda else STOCK_EAGER_AGREEMENT_DB)[fmt]
    stock_numerics = "kitchen's CUDA kernels" if kitchen_cuda else "kitchen's eager numerics"
    for seed, stock_out, lowbit_out in zip(seeds, stock_outs, lowbit_outs):
        agreement = sqnr_db(stock_out, lowbit_out)
        assert bound is None or agreement > bound, (
            f"{fmt} {what} (input {seed}): stock ({stock_numerics}) vs LowBit {agreement:.1f} dB (want > {bound}), "
            f"max |diff| {(stock_out - lowbit_out).abs().max():.3e} on values up to {stock_out.abs().max():.2f}")
    if float_run is not None:
        float_outs = [float_run(s) for s in seeds]
        ours = [sqnr_db(f, o) for f, o in zip(float_outs, lowbit_outs)]
        stock = [sqnr_db(f, o) for f, o in zip(float_outs, stock_outs)]
        mean_ours, mean_stock = sum(ours) / len(ours), sum(stock) / len(stock)
        assert mean_ours > mean_stock - CUDA_FLOAT_ERROR_SLACK_DB, (
            f"{fmt} {what}: LowBit is {mean_ours:.1f} dB from float on average, stock ({stock_numerics}) "
            f"{mean_stock:.1f} dB (per input: LowBit {[round(v, 1) for v in ours]}, stock {[round(v, 1) for v in stock]})")


def one_pass_on_the_cpu(monkeypatch) -> None:
    """Where the tests run on the CPU (the Triton interpreter), let LowBit's one-pass attention preparations run as
    they do on a GPU (on the CPU they run only with the Triton backend forced, which would also put every linear in
    the interpreter)."""
    if device().type == "cpu":
        from lowbit.nodes import joint_attention

        monkeypatch.setattr(joint_attention, "one_pass_wanted", lambda dev: True)


def run_with_manual_cast_norms(norms, run, monkeypatch):
    """``run()`` with ``norms`` marked for manual casting, as a checkpoint loaded with manual-cast ops has them;
    returns its output and those of ``norms`` that ComfyUI's ``comfy.ops.cast_bias_weight`` was called for
    meanwhile, a call each (under Dynamic VRAM every other layer is cast through it too)."""
    import comfy.ops

    casts, marked = [], {id(norm) for norm in norms}
    real = comfy.ops.cast_bias_weight

    def spy(module, *args, **kwargs):
        if id(module) in marked:
            casts.append(module)
        return real(module, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(comfy.ops, "cast_bias_weight", spy)
        for norm in norms:
            norm.comfy_cast_weights = True
        try:
            return run(), casts
        finally:
            for norm in norms:
                del norm.comfy_cast_weights


@dataclasses.dataclass
class TritonFirst(dispatch.Dispatcher):
    """Settles every call on the first Triton candidate offered (the CPU measures nothing). The tiny models' calls
    have few rows: on a GPU those of at most 16 are quantized too (``few_rows_weight_only`` off), so they take the
    Triton kernels whose fused inputs these tests check, as larger calls do."""

    few_rows_weight_only: bool = False

    def choose(self, key, candidates, device):
        name = next((n for n in candidates if n.startswith("triton:")), None)
        if name is None:
            return super().choose(key, candidates, device)
        self.decisions[key.as_str()] = name
        return name


# ---- inputs computed inside the activation quantization ---------------------------------------------

def quantized_with_deferring(float_model, fmt: str, cls: type, mixin: type):
    """``float_model`` quantized to ``fmt`` by Quantize Model's core, and its modules of class ``cls``: every one
    swapped to the deferring ``mixin``, none of the float model's (the swap is per model)."""
    from lowbit.nodes.model_quant import quantize_model
    from lowbit.quant.policy import Policy

    model = quantize_model(float_model, Policy(mode=fmt))
    found = [m for m in model.model.diffusion_model.modules() if isinstance(m, cls)]
    assert found and all(isinstance(m, mixin) for m in found)
    assert not any(isinstance(m, mixin) for m in float_model.model.diffusion_model.modules())
    return model, found


def fused_and_unfused(model, run, monkeypatch):
    """``run(model)`` with every call computed as written, then twice with the fused plans settled: (unfused, the
    first fused run, the second, a count of the second's prologue kinds, and per fused call (share of codes
    differing from the same kernel on the computed input, all within a step, scale's relative difference,
    centring mean's difference))."""
    calls, differing = [], []
    real = triton_act_quant.act_quant_triton

    def spy(x, *args, **kwargs):
        out = real(x, *args, **kwargs)
        calls.append(x)
        if not isinstance(x, torch.Tensor):  # the same kernel on the input ComfyUI's graph computes
            ref = real(x.materialize(), *args, **{**kwargs, "split": "pow2"})
            codes, ref_codes = out[0].float(), ref[0].float()
            diff = (codes - ref_codes).abs()
            # one INT8 step; e4m3: a step plus 2^-7 of the range (where shift + norm * mult nearly cancels,
            # one bf16 step of the norm is a large share of the sum: kernels/gpu_checks.py)
            step = 1.0 if out[0].dtype == torch.int8 else ref_codes.abs() * 0.125 + 448 * 2**-7
            differing.append(((diff > 0).float().mean().item(), bool((diff <= step).all()),
                              ((out[1] - ref[1]).abs() / ref[1]).max().item(),
                              (out[2] - ref[2]).abs().max().item() if out[2].numel() else 0.0))
        return out

    monkeypatch.setattr(triton_act_quant, "act_quant_triton", spy)
    with dispatch.use_dispatcher(TritonFirst(measure=False, fast=False)):  # no settled plans: all computed
        unfused = run(model)
    assert calls and all(isinstance(x, torch.Tensor) for x in calls)
    with dispatch.use_dispatcher(TritonFirst(measure=False)):
        first = run(model)  # settles the plans: each first call runs the fused plan it settled
        calls.clear()
        differing.clear()
        fused = run(model)
    kinds = collections.Counter(type(x).__name__ + ("+a" if getattr(x, "a", None) is not None else "")
                                for x in calls if not isinstance(x, torch.Tensor))
    return unfused, first, fused, kinds, differing


def assert_fused_as_computed(float_output, unfused, first, fused, differing) -> None:
    assert torch.equal(first, fused)  # the first run gives the bits of the next (a seed, the same image)
    # every fused call: the codes of the input ComfyUI's own graph computes, but where the last bit of
    # tanh, of the SiLU's exponential or of the row variance moves a value to the neighbouring bf16 (then its
    # code moves one step)
    for frac, within_a_step, scale_rel, mean_diff in differing:
        assert frac < 1e-3 and within_a_step and scale_rel < 2**-7 and mean_diff < 1e-5
    # the output: as accurate as the unfused run (this random model amplifies a moved code, so the two
    # differ by more than the codes do)
    assert torch.isfinite(fused).all()
    quant_error = (unfused - float_output).pow(2).mean()
    assert (fused - float_output).pow(2).mean() <= 1.1 * quant_error
