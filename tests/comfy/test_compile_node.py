"""Compile Quantized Model (LowBit) in real ComfyUI, in-process, inductor on the CPU (issue 6, Show 1).

A tiny Flux (two double and two single blocks) quantized by LowBit is compiled with
``fullgraph=True``: every format through ComfyUI's LowBit Linear (aot_eager, exact), one format
end to end on inductor and through a real KSampler. Measured: the compiled output against eager, the
number of graphs Dynamo builds (``torch._dynamo.utils.counters``: one per block class), and that
after warm-up a Dynamic LoRA strength change, a swap to other LoRAs of the same ranks and a
resolution change build none.

ComfyUI's CPU attention (sub-quadratic, which asks psutil for free memory) cannot be traced; the
tests use ComfyUI's PyTorch attention, what a CUDA install runs.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from comfy_helpers import load_stock, require_comfy, sqnr_db

require_comfy()

import comfy.ldm.flux.math  # noqa: E402
import comfy.ldm.modules.attention  # noqa: E402
import comfy.model_management  # noqa: E402
import comfy.sd  # noqa: E402
from comfy_kitchen.tensor import QuantizedTensor  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from lowbit.nodes.compile import (WRAPPER_KEY, CompileSettings, LowBitCompileQuantizedModel,  # noqa: E402
                                  compile_model, compile_wrapper, demoted_clone, repeated_blocks)
from lowbit.nodes.lora_nodes import LoraEntry, apply_lora_stack  # noqa: E402
from lowbit.nodes.model_quant import model_info, quantize_model  # noqa: E402
from lowbit.quant.demo import TinyFluxConfig, tiny_flux_state_dict  # noqa: E402
from lowbit.quant.formats import FORMATS  # noqa: E402
from lowbit.quant.policy import Policy  # noqa: E402

FLUX = TinyFluxConfig(depth=2, depth_single_blocks=2)
LORA_LAYERS = ("double_blocks.0.img_attn.qkv", "double_blocks.1.txt_mlp.0", "single_blocks.0.linear1",
               "single_blocks.1.linear2")


@pytest.fixture(autouse=True)
def pytorch_attention(monkeypatch):
    monkeypatch.setattr(comfy.ldm.flux.math, "optimized_attention", comfy.ldm.modules.attention.attention_pytorch)


@pytest.fixture(scope="module")
def flux_sd():
    return tiny_flux_state_dict(FLUX, seed=0)


#: Compiled blocks run the norms and GELUs as written (inductor fuses them its own way), while an eager
#: model computes them inside the activation quantization (quant/deferred.py): the same codes but where
#: the last bit of the row variance differs. Tests that compare compiled with eager bits, or closer
#: than that, quantize without the eager fusion.
UNFUSED = {"fuse_inputs": False}


@pytest.fixture(scope="module")
def quantized(flux_sd):
    return quantize_model(load_stock(flux_sd), Policy(mode="int8_convrot"), **UNFUSED)


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def run(model_patcher, *, size: int = 16, seed: int = 0) -> torch.Tensor:
    """One denoiser call as a sampler makes it: the model loaded by ComfyUI's model manager, the inputs
    on its load device (CPU inputs would make a GPU run mix devices, or send a Dynamic VRAM layer down
    ComfyUI's CPU-side dequantize), the patcher's wrappers in ``transformer_options``."""
    comfy.model_management.load_models_gpu([model_patcher])
    dev = model_patcher.load_device
    gen = torch.Generator().manual_seed(seed)
    x, context, y = (torch.randn(1, 16, size, size, generator=gen), torch.randn(1, 8, 64, generator=gen),
                     torch.randn(1, 32, generator=gen))
    with torch.no_grad():
        out = model_patcher.model.apply_model(
            x.to(dev), torch.full((1,), 0.6, device=dev), c_crossattn=context.to(dev), y=y.to(dev),
            guidance=torch.full((1,), 3.5, device=dev),
            transformer_options={"wrappers": model_patcher.wrappers})  # as comfy.sampler_helpers passes them
    return out.float().cpu()


def eager_twin(compiled):
    """The compiled branch's own model run without the compile wrapper: its exact eager reference (under
    Dynamic VRAM the model before the node is another model, which ComfyUI casts in another way)."""
    from comfy.patcher_extension import WrappersMP

    twin = compiled.clone()
    twin.remove_wrappers_with_key(WrappersMP.APPLY_MODEL, WRAPPER_KEY)
    return twin


def assert_compiles_outside_dynamic_vram(compiled) -> None:
    """What the node must hand the compiler: a regular ModelPatcher whose layers carry no Dynamic VRAM
    allocation (``_v``: their weights would stream through comfy-aimdo inside the graph)."""
    assert not compiled.is_dynamic()
    streamed = [name for name, m in compiled.model.named_modules() if hasattr(m, "_v")]
    assert not streamed, f"layers still under Dynamic VRAM: {streamed[:3]}"


def lora_file(path, seed: int, rank: int = 4, layers=LORA_LAYERS) -> LoraEntry:
    sd = tiny_flux_state_dict(FLUX, seed=0)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in layers:
        n, k = sd[f"{layer}.weight"].shape
        tensors[f"diffusion_model.{layer}.lora_down.weight"] = (torch.randn(rank, k, generator=gen) / k**0.5).bfloat16()
        tensors[f"diffusion_model.{layer}.lora_up.weight"] = (torch.randn(n, rank, generator=gen) * 0.3).bfloat16()
    save_file(tensors, str(path))
    return LoraEntry(path.name, str(path), 1.0)


def with_strength(entry: LoraEntry, strength: float) -> LoraEntry:
    return LoraEntry(entry.lora_name, entry.path, strength)


FULLGRAPH = CompileSettings(backend="inductor", fullgraph=True)


def test_settings_validate():
    with pytest.raises(ValueError, match="backend"):
        CompileSettings(backend="tvm")
    with pytest.raises(ValueError, match="inductor"):
        CompileSettings(backend="aot_eager", mode="max-autotune")
    with pytest.raises(ValueError, match="recompile_limit"):
        CompileSettings(recompile_limit=0)
    with pytest.raises(ValueError, match="fuse_gelu must be true or false"):
        CompileSettings(fuse_gelu="yes")
    assert CompileSettings.from_dict(FULLGRAPH.to_dict()) == FULLGRAPH
    unfused = CompileSettings(fuse_gelu=False)
    assert CompileSettings.from_dict(unfused.to_dict()) == unfused and unfused.compile_key() != FULLGRAPH.compile_key()
    # a settings dict written before fuse_gelu existed still loads (fused: the default)
    old = {k: v for k, v in FULLGRAPH.to_dict().items() if k != "fuse_gelu"}
    assert CompileSettings.from_dict(old) == FULLGRAPH


def test_schema_inputs_all_have_tooltips():
    schema = LowBitCompileQuantizedModel.define_schema()
    assert schema.node_id == "LowBitCompileQuantizedModel"
    assert [i.id for i in schema.inputs] == ["model", "backend", "mode", "scope", "dynamic", "fullgraph",
                                             "recompile_limit"]
    assert all(i.tooltip for i in schema.inputs)


def test_repeated_blocks_found(quantized):
    names = [name for name, _ in repeated_blocks(quantized.model.diffusion_model)]
    assert names == ["double_blocks", "single_blocks"]


def test_node_returns_a_clone_and_compiles_lazily(quantized):
    before = graphs()
    (out,) = LowBitCompileQuantizedModel.execute(quantized, backend="inductor", fullgraph=True).args
    assert out is not quantized and compile_wrapper(out) is not None and compile_wrapper(quantized) is None
    assert graphs() == before, "the node itself must not compile; the first sampling call does"


def test_compiled_matches_eager_and_blocks_share_one_trace(quantized, flux_sd):
    reference = run(quantized)
    float_out = run(load_stock(flux_sd))
    compiled = compile_model(quantized, FULLGRAPH)
    before = graphs()
    out = run(compiled)
    wrapper = compile_wrapper(compiled)
    assert wrapper.state.failure is None
    assert_compiles_outside_dynamic_vram(compiled)
    # 2 double + 2 single blocks: one graph per block class, not per block
    assert graphs() - before == 2
    assert wrapper.state.regions == ("DoubleStreamBlock", "SingleStreamBlock")
    # The compiled blocks run the eager kernels (one lowbit::quantized_linear per layer), but inductor
    # fuses the element-wise ops around them, and a last-bit change in an activation can flip its
    # per-token INT8 rounding: measured on the CPU, the float model compiled is 131 dB from its eager
    # output while this W8A8 model compiled is 47.1 dB from its own (quantization noise: 31.2 dB).
    # How far those flips go depends on the device's kernels, not on the quantization noise (the old
    # bound, 15 dB below it, was the CPU's margin), so the check is what matters to a user: the
    # compile's deviation sits at least 6 dB below the quantization noise and leaves the compiled
    # model within 1 dB of eager's distance to the float model. A real mismatch (a dropped LoRA or
    # pre_quant_scale, a wrong kernel) deviates by about the quantization noise or more.
    # The kernels themselves are the same on every device: the op's body runs at run time, outside
    # Dynamo's trace, so the measured dispatcher gives it eager's cached decision for the key (the fake
    # runs while tracing). On CUDA the flips are more (Triton's fp16 ConvRot rotation): an H200 measured
    # the compile 38.6-38.8 dB from eager with quantization noise 33.2-33.6 dB (margin 5.0-5.6 dB), the CPU
    # 47.1 vs 31.2 dB. Under Dynamic VRAM on ComfyUI 0.33 (kitchen 0.2.31) the same H200 gave 38.1 dB with
    # noise 35.3 dB (margin 2.8 dB): which kernel the dispatcher measured fastest moves the noise, not the
    # compile's flips. A mismatch sits at about the quantization noise (margin <= 0 dB), so CUDA is bounded
    # 2 dB below it and the CPU 6 dB.
    quant_noise = sqnr_db(float_out, reference)
    margin_db = 2 if compiled.load_device.type == "cuda" else 6
    assert sqnr_db(reference, out) > quant_noise + margin_db  # the compile adds at most ~1-2 dB of error
    assert sqnr_db(float_out, out) > quant_noise - 1
    # a second call, new inputs of the same shape: no new graph
    run(compiled, seed=1)
    assert graphs() - before == 2


def test_plain_w8a8_mlps_take_their_gelu_input_fused(flux_sd, caplog):
    """An int8 Flux: the single blocks' linear2(cat(attn, gelu(mlp))) and the double blocks' two MLPs are
    rewritten to the fused op (``quant/compile_fusion.py``); the compiled output stays with eager's."""
    model = quantize_model(load_stock(flux_sd), Policy(mode="int8"))
    reference = run(model)
    quant_noise = sqnr_db(run(load_stock(flux_sd)), reference)
    compiled = compile_model(model, FULLGRAPH)
    # inductor's caches off: a graph found there skips the pass, and so its log line
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False), caplog.at_level(logging.INFO):
        out = run(compiled)
    assert compile_wrapper(compiled).state.failure is None
    fused = sorted(int(r.getMessage().split()[2]) for r in caplog.records if "take their GELU input fused" in r.getMessage())
    assert fused == [1, 2]  # a single block's linear2; a double block's img and txt MLPs
    assert sqnr_db(reference, out) > quant_noise + 3


@pytest.mark.parametrize("fmt", tuple(FORMATS))
def test_every_format_traces_fullgraph_in_comfyui(fmt):
    """ComfyUI's LowBit Linear under Dynamo, every format: one graph per block class, and (aot_eager
    changes no numerics) exactly the eager output."""
    model = quantize_model(load_stock(tiny_flux_state_dict(FLUX, seed=0)), Policy(mode=fmt), **UNFUSED)
    compiled = compile_model(model, CompileSettings(backend="aot_eager", fullgraph=True))
    reference = run(eager_twin(compiled))
    before = graphs()
    out = run(compiled)
    state = compile_wrapper(compiled).state
    assert state.failure is None and state.regions == ("DoubleStreamBlock", "SingleStreamBlock")
    assert_compiles_outside_dynamic_vram(compiled)
    assert graphs() - before == 2
    assert torch.equal(out, reference)


def test_no_recompiles_for_lora_strength_swap_or_resolution(quantized, tmp_path):
    first = lora_file(tmp_path / "a.safetensors", seed=1)
    second = lora_file(tmp_path / "b.safetensors", seed=2)  # same layers and ranks, other values
    base = run(quantized)

    def lora_model(entries):
        return apply_lora_stack(quantized, entries, "dynamic")[0]

    # warm-up: the blocks were compiled without hooks by the tests above (or are compiled now); the
    # LoRA hooks must not be skipped (Dynamo does not guard empty hook dicts by default)
    warm = run(compile_model(lora_model([first]), FULLGRAPH))
    warm_eager = run(lora_model([first]))
    assert sqnr_db(warm_eager, warm) > sqnr_db(warm_eager, base) + 10
    before = graphs()
    for label, entries in (("strength 0.3", [with_strength(first, 0.3)]),
                           ("strength -1", [with_strength(first, -1.0)]),
                           ("swap", [second]),
                           ("swap back", [first])):
        compiled = compile_model(lora_model(entries), FULLGRAPH)
        out = run(compiled)
        assert compile_wrapper(compiled).state.failure is None
        assert graphs() == before, f"{label}: {graphs() - before} new graphs"
        # the compiled model follows the change: far closer to its own eager output than the LoRA's effect
        eager = run(lora_model(entries))
        lora_effect = sqnr_db(eager, base)
        assert lora_effect < 30, f"{label}: the test LoRA is too weak to tell ({lora_effect:.1f} dB)"
        assert sqnr_db(eager, out) > lora_effect + 10, f"{label}: compiled output does not follow the LoRA"

    # another resolution: the warm-up ran a 16x16 latent (64 image tokens); 24x24 (144) reuses the graph
    out = run(compile_model(lora_model([first]), FULLGRAPH), size=24)
    assert sqnr_db(run(lora_model([first]), size=24), out) > 30
    assert graphs() == before


def test_failure_falls_back_to_eager_with_a_warning(quantized, caplog):
    compiled = compile_model(quantized, CompileSettings(backend="eager", fullgraph=True))
    reference = run(eager_twin(compiled))
    dm = compiled.model.diffusion_model
    block = dm.double_blocks[0]
    original = type(block).forward

    def broken_forward(self, *args, **kwargs):  # a graph break fullgraph=True refuses
        torch._dynamo.graph_break()
        return original(self, *args, **kwargs)

    broken = type("BrokenBlock", (type(block),), {"forward": broken_forward})
    classes = [type(b) for b in dm.double_blocks]
    try:
        for b in dm.double_blocks:
            b.__class__ = broken
        with caplog.at_level(logging.WARNING):
            out = run(compiled)
    finally:
        for b, cls in zip(dm.double_blocks, classes):
            b.__class__ = cls
    state = compile_wrapper(compiled).state
    assert state.failure is not None and "Unsupported" in state.failure
    assert any("runs uncompiled (eager)" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(out, reference)
    # later calls go straight to eager
    calls = state.calls
    run(compiled)
    assert state.calls == calls + 1 and state.failure is not None


def sample(model_patcher, steps: int = 2, cfg: float = 1.0) -> torch.Tensor:
    """A real KSampler run (the path that merges the patcher's wrappers into transformer_options)."""
    import comfy.sample

    gen = torch.Generator().manual_seed(0)
    positive = [[torch.randn(1, 8, 64, generator=gen), {"pooled_output": torch.randn(1, 32, generator=gen)}]]
    negative = [[torch.randn(1, 8, 64, generator=gen), {"pooled_output": torch.randn(1, 32, generator=gen)}]]
    latent = torch.zeros(1, 16, 16, 16)
    noise = torch.randn(1, 16, 16, 16, generator=gen)
    return comfy.sample.sample(model_patcher, noise, steps, cfg, "euler", "simple", positive, negative, latent,
                               disable_pbar=True, seed=0).float()


def test_ksampler_compiles_at_the_first_sampling_call(quantized):
    reference = sample(quantized, cfg=2.0)
    compiled = compile_model(quantized, FULLGRAPH)
    wrapper = compile_wrapper(compiled)
    assert wrapper.state.calls == 0
    out = sample(compiled, cfg=2.0)  # cond and uncond batched: batch 2
    assert wrapper.state.calls >= 2 and wrapper.state.failure is None
    assert_compiles_outside_dynamic_vram(compiled)
    assert wrapper.state.regions == ("DoubleStreamBlock", "SingleStreamBlock")
    assert sqnr_db(reference, out) > 30
    before = graphs()
    sample(compiled, cfg=2.0)
    assert graphs() == before


def test_recompile_limit_is_raised_never_lowered():
    from lowbit.nodes.compile import raise_recompile_limits

    config = torch._dynamo.config
    # config.patch restores both values on exit (monkeypatch's restore leaves torch's config module broken)
    with config.patch(recompile_limit=8, accumulated_recompile_limit=256):
        raise_recompile_limits(32)
        assert (config.recompile_limit, config.accumulated_recompile_limit) == (32, 256)
        raise_recompile_limits(16)
        assert config.recompile_limit == 32
        raise_recompile_limits(64)
        assert (config.recompile_limit, config.accumulated_recompile_limit) == (64, 512)


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune-no-cudagraphs"])
def test_every_compile_mode_compiles(mode):
    """Each of the node's modes reaches inductor (torch.compile refuses a mode together with options, and
    the node passes its guard filter as an option). On the CPU inductor skips CUDA graphs by itself."""
    from lowbit.nodes.compile import compiled_forward, mode_options

    assert mode_options(mode) and mode_options("default") == {}

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x, transformer_options=None):
            return torch.nn.functional.gelu(self.lin(x)) * 2

    block = Block()
    x = torch.randn(3, 8)
    torch._dynamo.reset()
    counters.clear()
    fn = compiled_forward(Block, CompileSettings(mode=mode, fullgraph=True))
    with torch.no_grad():
        torch.testing.assert_close(fn(block, x, transformer_options={"i": 1}), block(x))
    assert graphs() == 1


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_cuda_graph_modes_compile_blocks_on_copies_of_their_inputs(mode):
    """Inductor's CUDA graphs skip graphs that mutate their inputs, and ComfyUI's blocks add into theirs
    in place: with a CUDA-graph mode the compiled block works on copies (the caller's tensor keeps its
    values, the output is the same); other modes leave the block as written."""
    from lowbit.nodes.compile import compiled_forward

    class AddsInPlace(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, img, transformer_options=None):
            img += self.lin(img)
            return img * 2

    block = AddsInPlace()
    x = torch.randn(3, 8)
    expected = block(x.clone())
    torch._dynamo.reset()
    fn = compiled_forward(AddsInPlace, CompileSettings(mode=mode, fullgraph=True))
    before = x.clone()
    with torch.no_grad():
        out = fn(block, x)
    torch.testing.assert_close(out, expected)
    assert torch.equal(x, before) == (mode == "reduce-overhead")


@contextlib.contextmanager
def as_dynamic(model_patcher):
    """A clone that says it is a Dynamic VRAM patcher (real ones need CUDA and comfy-aimdo), with a layer
    holding a stand-in for aimdo's per-layer allocation ``_v`` while the block runs. The GPU run with
    ``LOWBIT_TEST_DYNAMIC_VRAM=1`` exercises the real ones through the tests above."""
    clone = model_patcher.clone()
    if clone.is_dynamic():  # LOWBIT_TEST_DYNAMIC_VRAM=1 on a GPU: the real thing
        yield clone
        return
    clone.is_dynamic = lambda: True
    layer = clone.model.diffusion_model.double_blocks[0].img_attn.qkv
    layer._v = object()
    try:
        yield clone
    finally:
        del layer._v


def test_dynamic_vram_float_model_is_rebuilt_by_its_loader_as_stock_does(flux_sd):
    calls = []

    def loader(state_dict, disable_dynamic=False):
        calls.append(disable_dynamic)
        return comfy.sd.load_diffusion_model_state_dict(dict(state_dict), disable_dynamic=disable_dynamic)

    with as_dynamic(load_stock(flux_sd)) as dynamic:
        dynamic.cached_patcher_init = (loader, (flux_sd,))
        demoted = demoted_clone(dynamic)
    assert calls == [True] and not demoted.is_dynamic()
    assert demoted.model is not dynamic.model


def storage(t: torch.Tensor) -> int:
    return (t._qdata if isinstance(t, QuantizedTensor) else t).data_ptr()


def test_dynamic_vram_lowbit_model_becomes_a_regular_copy_sharing_its_weights(quantized):
    reference = run(quantized)
    with as_dynamic(quantized) as dynamic:
        dynamic.cached_patcher_init = (pytest.fail, ("a LowBit model must not be rebuilt (re-quantized) to compile",))
        demoted = demoted_clone(dynamic)
        assert_compiles_outside_dynamic_vram(demoted)
    assert demoted.model is not dynamic.model and demoted.parent is None
    assert demoted.clone_base_uuid != dynamic.clone_base_uuid
    assert model_info(demoted) is model_info(quantized)
    source = dict(dynamic.model.diffusion_model.named_parameters())
    copied = dict(demoted.model.diffusion_model.named_parameters())
    assert copied.keys() == source.keys()
    assert all(copied[k] is not p and storage(copied[k]) == storage(p) for k, p in source.items())
    # the same kernels on the same weights (bit-identical on the CPU; a GPU's cuBLAS may pick another
    # algorithm for buffers Dynamic VRAM placed elsewhere); a lost patch or weight is < 40 dB
    assert sqnr_db(reference, run(demoted)) > 60


def test_dynamic_vram_copy_casts_weights_left_in_the_file_dtype(flux_sd):
    """A Dynamic VRAM load assigns the file's tensors (a file in another dtype than the model's stays in
    it); a regular load copies them into the model's dtype, and so does the copy (an uncast weight would
    not even run: a layer without ComfyUI's cast calls F.linear with mixed dtypes)."""
    stock = load_stock(flux_sd)
    layer = stock.model.diffusion_model.single_blocks[1].linear2
    model_dtype = layer.weight_comfy_model_dtype
    assert layer.weight.dtype == model_dtype
    file_dtype = torch.float16 if model_dtype != torch.float16 else torch.float32
    original = layer.weight
    layer.weight = torch.nn.Parameter(original.detach().to(file_dtype), requires_grad=False)  # as assign=True
    try:
        with as_dynamic(stock) as dynamic:
            demoted = demoted_clone(dynamic)  # no loader recipe: the copy
        copied = demoted.model.diffusion_model.single_blocks[1].linear2.weight
        assert copied.dtype == model_dtype and torch.equal(copied, layer.weight.to(model_dtype))
        assert layer.weight.dtype == file_dtype  # the source is left as it is
        out = run(demoted)
        layer.weight = torch.nn.Parameter(copied.detach().clone(), requires_grad=False)
        assert sqnr_db(run(stock), out) > 60  # as in the test above
    finally:
        layer.weight = original


def test_not_dynamic_is_a_plain_clone(quantized):
    if quantized.is_dynamic():
        pytest.skip("the model runs under Dynamic VRAM (LOWBIT_TEST_DYNAMIC_VRAM=1): the node copies it instead; "
                    "test_dynamic_vram_lowbit_model_becomes_a_regular_copy_sharing_its_weights covers that")
    clone = demoted_clone(quantized)
    assert clone.model is quantized.model and not clone.is_dynamic()
