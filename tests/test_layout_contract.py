"""The contract every format keeps, run for each entry of ``quant.formats.FORMATS``.

* quantize -> dequantize stays close to the weight (a per-format relative error bound);
* ``.to(dtype)``, ``.clone()``, ``.detach()`` and ``.t()`` keep the quantized weight and its results;
* ``mm(x, w.t())`` and ``addmm(bias, x, w.t())`` (how ``F.linear`` decomposes outside inference mode)
  give exactly what the format's linear gives;
* linear on 2-D and 3-D inputs, odd token counts, with and without bias, in ``no_grad`` and in
  ``inference_mode`` (where ``F.linear`` reaches the layout as ``aten.linear``), with K/N tails;
* the output dtype follows the input dtype;
* the native checkpoint form round-trips bit for bit;
* linear/mm/addmm never dequantize the weight;
* zero weight rows and zero activations give exact zeros;
* stochastic rounding (``seed > 0``) is unbiased.

kitchen's FP8 GEMM (the ``fp8`` format) needs the activation quantized too: the codec does that, and
``mm``/``addmm`` get the quantized activation, as ComfyUI's own ops give it. Handed a float activation,
kitchen dequantizes the FP8 weight instead (``test_kitchen_fp8_dequantizes_a_float_activation``).
"""

from __future__ import annotations


import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from comfy_kitchen.tensor import QuantizedTensor
from packaging.version import Version

from layout_helpers import (
    FORMAT_NAMES,
    activation,
    fp8_activation,
    gemm_operand,
    kitchen_version,
    legal_shape,
    outlier_weight,
    relative_error,
    spy_dequantize,
    sqnr_db,
)
from lowbit.quant.formats import get_format
from lowbit.quant.native import COMFY_QUANT, decode_comfy_quant, layer_tensors, load_layer

#: bound on ||dequantize(quantize(W)) - W|| / ||W|| for the outlier weight of ``legal_shape``
DEQUANT_MAX_RELATIVE_ERROR = {
    "int8": 0.015,
    "int8_convrot": 0.009,
    "int8_quarot": 0.009,
    "int8_hadanorm": 0.009,
    "fp8": 0.03,
    "fp8_rowwise": 0.03,
    "w4a4": 0.14,
    "w4a8": 0.08,
}
#: floor on the output SQNR (dB) of the small linear problems below
LINEAR_MIN_SQNR_DB = {
    "int8": 31.0,
    "int8_convrot": 36.0,
    "int8_quarot": 36.0,
    "int8_hadanorm": 36.0,
    "fp8": 26.0,
    "fp8_rowwise": 26.0,
    "w4a4": 12.5,
    "w4a8": 20.5,
}
LAYER = "double_blocks.0.img_attn.qkv"
GRAD_MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}

per_format = pytest.mark.parametrize("name", FORMAT_NAMES)


def test_bounds_cover_every_format():
    assert set(DEQUANT_MAX_RELATIVE_ERROR) == set(FORMAT_NAMES) == set(LINEAR_MIN_SQNR_DB)


@pytest.fixture(scope="module")
def weights():
    """Per format: (fp32 weight, its bf16-compute quantization), built once."""
    cache = {}

    def get(name):
        if name not in cache:
            codec = get_format(name)
            weight = outlier_weight(*legal_shape(codec), seed=11)
            cache[name] = weight, codec.quantize(weight, compute_dtype=torch.bfloat16)
        return cache[name]

    return get


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def param_tensors(qt: QuantizedTensor) -> dict[str, torch.Tensor]:
    return {key: value for key, value in vars(qt._params).items() if isinstance(value, torch.Tensor)}


# ---- quantize / dequantize ------------------------------------------------------------------

@per_format
def test_dequantize_is_close_to_the_weight(name):
    codec = get_format(name)
    weight = outlier_weight(*legal_shape(codec), seed=3)
    for compute_dtype in (torch.float32, torch.bfloat16):
        qweight = codec.quantize(weight, compute_dtype=compute_dtype)
        assert isinstance(qweight, QuantizedTensor) and qweight._layout_cls == codec.spec.layout
        assert qweight.shape == weight.shape and qweight.dtype == compute_dtype
        restored = qweight.dequantize()
        assert restored.shape == weight.shape and restored.dtype == compute_dtype
        assert relative_error(restored, weight) <= DEQUANT_MAX_RELATIVE_ERROR[name]


# ---- tensor ops -----------------------------------------------------------------------------

@per_format
def test_to_clone_detach_and_t_keep_the_quantized_weight(name, weights):
    codec = get_format(name)
    _, qweight = weights(name)
    x = activation(7, qweight.shape[1], seed=5)
    expected = codec.linear(x, qweight)

    as_half = qweight.to(torch.float16)
    assert isinstance(as_half, QuantizedTensor) and as_half.dtype == torch.float16
    assert as_half._layout_cls == qweight._layout_cls and same_bits(as_half._qdata, qweight._qdata)
    assert qweight.dtype == torch.bfloat16  # .to returned a new tensor

    cloned = qweight.clone()
    assert cloned._qdata.data_ptr() != qweight._qdata.data_ptr() and same_bits(cloned._qdata, qweight._qdata)
    for key, value in param_tensors(qweight).items():
        copy = param_tensors(cloned)[key]
        assert copy.data_ptr() != value.data_ptr() and same_bits(copy, value), key

    detached = qweight.detach()
    assert isinstance(detached, QuantizedTensor) and same_bits(detached._qdata, qweight._qdata)

    transposed = qweight.t()
    assert isinstance(transposed, QuantizedTensor) and transposed.shape == (qweight.shape[1], qweight.shape[0])
    back = transposed.t()
    assert back.shape == qweight.shape

    for variant in (as_half, cloned, detached, back):
        out = codec.linear(x, variant)
        assert out.dtype == x.dtype and same_bits(out, expected)


@per_format
@pytest.mark.parametrize("mode", list(GRAD_MODES))
def test_mm_and_addmm_equal_linear(name, mode, weights):
    """In ``inference_mode`` the weight is quantized inside the mode too: kitchen's view-like handlers
    (``t``, ``detach``) return new tensors, which torch refuses to version-count when an inference-mode
    call gets a weight made outside it ("Cannot set version_counter for inference tensor")."""
    codec = get_format(name)
    weight, qweight = weights(name)
    x = activation(7, weight.shape[1], seed=6)
    bias = activation(weight.shape[0], seed=7)
    with GRAD_MODES[mode]():
        if mode == "inference_mode":
            qweight = codec.quantize(weight, compute_dtype=torch.bfloat16)
        with spy_dequantize() as spy:
            expected = codec.linear(x, qweight)
            expected_bias = codec.linear(x, qweight, bias)
            by_mm = torch.mm(gemm_operand(name, x), qweight.t())
            by_addmm = torch.addmm(bias, gemm_operand(name, x), qweight.t())
    assert spy.calls == []
    assert same_bits(by_mm, expected)
    assert same_bits(by_addmm, expected_bias)


# ---- linear ---------------------------------------------------------------------------------

@per_format
@pytest.mark.parametrize("tokens", [1, 7, 33])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("mode", list(GRAD_MODES))
def test_linear_2d_and_3d(name, tokens, with_bias, mode, weights):
    codec = get_format(name)
    weight, qweight = weights(name)
    n, k = weight.shape
    x3 = activation(2, tokens, k, seed=tokens)
    x2 = x3.reshape(-1, k)
    bias = activation(n, seed=8) if with_bias else None
    reference = x2.double() @ weight.double().t() + (0 if bias is None else bias.double())
    with GRAD_MODES[mode](), spy_dequantize() as spy:
        out2 = codec.linear(x2, qweight, bias)
        out3 = codec.linear(x3, qweight, bias)
        # plain F.linear is the codec's linear for every format but fp8 (which quantizes x first)
        plain = F.linear(x3, qweight, bias) if name != "fp8" else None
    assert spy.calls == []
    assert out2.shape == (2 * tokens, n) and out3.shape == (2, tokens, n)
    assert out2.dtype == out3.dtype == x2.dtype
    assert same_bits(out3.reshape(-1, n), out2)
    if plain is not None:
        assert same_bits(plain, out3)
    assert sqnr_db(out2, reference) >= LINEAR_MIN_SQNR_DB[name]


@per_format
def test_the_dequantize_spy_sees_a_fallback(name, weights):
    """The "never dequantize" assertions above mean something: an op no layout handles is seen."""
    _, qweight = weights(name)
    with spy_dequantize() as spy:
        qweight * 1.0
    assert any(call.startswith("QuantizedTensor._dequant_and_fallback") for call in spy.calls)
    assert f"{qweight._layout_cls}.dequantize" in spy.calls


@pytest.mark.parametrize("name", ["int8_quarot", "int8_hadanorm", "fp8_rowwise"])
def test_the_dequantize_spy_sees_lowbits_dequantize_candidate(name, weights):
    """Our kernel dispatch can also run a layer as dequantize + float matmul; the spy sees that too."""
    backend = pytest.importorskip("lowbit.kernels.backend")
    codec = get_format(name)
    _, qweight = weights(name)
    x = activation(3, qweight.shape[1], seed=20)
    with backend.force_backend("dequant"), spy_dequantize() as spy:
        codec.linear(x, qweight)
    assert any(call.endswith("._dequant") for call in spy.calls)


def test_kitchen_fp8_dequantizes_a_float_activation(weights):
    """Recorded behaviour of comfy-kitchen: its FP8 layout runs the FP8 GEMM only when both operands
    are quantized; F.linear/mm/addmm with a float activation dequantize the weight. The ``fp8`` codec
    (and ComfyUI) quantize the activation first, so that never happens on our path."""
    codec = get_format("fp8")
    _, qweight = weights("fp8")
    x = activation(4, qweight.shape[1], seed=9)
    with spy_dequantize() as spy:
        F.linear(x, qweight)
    assert "TensorCoreFP8Layout.dequantize" in spy.calls
    with spy_dequantize() as spy:
        codec.linear(x, qweight)
        torch.mm(fp8_activation(x), qweight.t())
    assert spy.calls == []


@per_format
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_output_dtype_follows_input_dtype(name, dtype, weights):
    codec = get_format(name)
    weight, qweight = weights(name)
    x = activation(5, weight.shape[1], seed=10, dtype=dtype)
    bias = activation(weight.shape[0], seed=19, dtype=dtype)
    reference = x.double() @ weight.double().t()
    with spy_dequantize() as spy:
        # weight compute dtype (bf16) differs from the input's, and matches it after .to(dtype)
        out = codec.linear(x, qweight)
        matched = codec.linear(x, qweight.to(dtype))
        plain = F.linear(gemm_operand(name, x), qweight.to(dtype))
        with_bias = codec.linear(x, qweight, bias)
    assert spy.calls == []
    assert out.dtype == matched.dtype == plain.dtype == with_bias.dtype == dtype
    assert same_bits(out, matched) and same_bits(plain, out)
    assert sqnr_db(out, reference) >= LINEAR_MIN_SQNR_DB[name]
    assert sqnr_db(with_bias, reference + bias.double()) >= LINEAR_MIN_SQNR_DB[name]


# ---- checkpoint form ------------------------------------------------------------------------

@per_format
def test_native_state_dict_round_trips_bit_identically(name, weights):
    codec = get_format(name)
    _, qweight = weights(name)
    entries = layer_tensors(codec, LAYER, qweight)
    stored = codec.state_dict(qweight)
    assert set(stored) <= set(codec.tensor_keys) and "weight" in stored
    assert set(entries) == {f"{LAYER}.{key}" for key in stored} | {f"{LAYER}.{COMFY_QUANT}"}

    blob = safetensors.torch.save({key: value.contiguous() for key, value in entries.items()})
    loaded = safetensors.torch.load(blob)
    conf = decode_comfy_quant(LAYER, loaded.pop(f"{LAYER}.{COMFY_QUANT}"))
    assert conf == codec.comfy_quant(qweight)
    relative = {key[len(LAYER) + 1:]: value for key, value in loaded.items()}
    loaded_codec, restored = load_layer(LAYER, relative, conf, compute_dtype=torch.bfloat16)

    assert loaded_codec is codec
    assert restored._layout_cls == qweight._layout_cls and restored.shape == qweight.shape
    assert restored.dtype == torch.bfloat16
    again = codec.state_dict(restored)
    assert set(again) == set(stored)
    for key in stored:
        assert same_bits(again[key].reshape(stored[key].shape), stored[key]), key
    assert codec.comfy_quant(restored) == conf
    x = activation(3, qweight.shape[1], seed=12)
    bias = activation(qweight.shape[0], seed=13)
    assert same_bits(codec.linear(x, restored, bias), codec.linear(x, qweight, bias))


# ---- edge values ----------------------------------------------------------------------------

@per_format
def test_zero_weight_rows_and_zero_activation_give_exact_zeros(name):
    codec = get_format(name)
    n, k = legal_shape(codec)
    weight = outlier_weight(n, k, seed=14)
    weight[[0, 5, n - 1]] = 0.0
    qweight = codec.quantize(weight)
    x = activation(6, k, seed=15)
    bias = activation(n, seed=16)

    out = codec.linear(x, qweight)
    assert torch.isfinite(out).all()
    assert (out[:, [0, 5, n - 1]] == 0).all()

    zeros = torch.zeros(6, k, dtype=torch.bfloat16)
    assert (codec.linear(zeros, qweight) == 0).all()
    assert same_bits(codec.linear(zeros, qweight, bias), bias.expand(6, n).contiguous())

    all_zero = codec.quantize(torch.zeros(n, k))
    assert torch.isfinite(all_zero.dequantize()).all() and (all_zero.dequantize() == 0).all()
    assert (codec.linear(x, all_zero) == 0).all()


# ---- stochastic rounding --------------------------------------------------------------------

SEEDS = 64


def _seeded(name: str) -> bool:
    # comfy-kitchen rounds w4a8 stochastically from 0.2.28 on
    return name != "w4a8" or kitchen_version() >= Version("0.2.28")


def _clipped_sq_error(weight: torch.Tensor, qt: QuantizedTensor) -> float:
    """Mean squared distance of ``weight``'s rotated values from the level range of their w4a8 group.

    No rounding can be unbiased there: a value beyond a group's largest level always gets that level.
    Kitchen fits each group's scale by least squares, which clips about 5 % of the rotated values of
    an outlier weight; the other formats' scales cover every value (their clipped error is 0)."""
    from lowbit.kernels.hadamard import rotate_blocks
    from lowbit.kernels.reference import w4a8_level_table

    p = qt._params
    table = w4a8_level_table(p.codebook).double()  # [fp8 scale byte, code] -> int8 level
    levels = table[p.scale.contiguous().view(torch.uint8).long()] * p.s_channel.double().reshape(-1, 1, 1)
    rotated = rotate_blocks(weight.float(), "regular", p.convrot_groupsize).double()
    grouped = rotated.view(*levels.shape[:2], p.group_size)
    low, high = levels.amin(-1, keepdim=True), levels.amax(-1, keepdim=True)
    return (grouped - grouped.clamp(min=low, max=high)).pow(2).mean().item()


@per_format
def test_stochastic_rounding_is_unbiased(name):
    """The mean over 64 seeds of the dequantized weight is much closer to W than round-to-nearest
    (theory: 1/32 of its squared error for values spread between grid points), apart from values
    beyond the grid's ends (w4a8 only: ``_clipped_sq_error``), which every rounding clips alike."""
    if not _seeded(name):
        pytest.skip(f"w4a8 stochastic rounding needs comfy-kitchen >= 0.2.28, found {kitchen_version()}")
    codec = get_format(name)
    weight = outlier_weight(32, 256, seed=17)
    nearest = codec.quantize(weight, compute_dtype=torch.float32)
    mean = torch.zeros_like(weight, dtype=torch.float64)
    codes = set()
    for seed in range(1, SEEDS + 1):
        stochastic = codec.quantize(weight, compute_dtype=torch.float32, seed=seed)
        mean += stochastic.dequantize().double() / SEEDS
        codes.add(bytes(stochastic._qdata.contiguous().view(torch.uint8).reshape(-1).numpy()))
    assert len(codes) == SEEDS  # every seed draws different roundings
    nearest_error = (nearest.dequantize().double() - weight.double()).pow(2).mean()
    mean_error = (mean - weight.double()).pow(2).mean()
    clipped = _clipped_sq_error(weight, nearest) if name == "w4a8" else 0.0
    assert clipped < 0.2 * nearest_error  # the grid covers most values: the check below still has teeth
    assert mean_error <= 0.1 * nearest_error + clipped, (mean_error, nearest_error, clipped)
    again = codec.quantize(weight, compute_dtype=torch.float32, seed=SEEDS)
    assert same_bits(again._qdata, stochastic._qdata)  # a seed is reproducible


def test_w4a8_seed_on_old_kitchen_raises_a_clear_error():
    if _seeded("w4a8"):
        pytest.skip(f"comfy-kitchen {kitchen_version()} supports w4a8 stochastic rounding")
    with pytest.raises(ValueError, match=r"needs comfy-kitchen >= 0\.2\.28, found comfy-kitchen 0\.2\.") as err:
        get_format("w4a8").quantize(outlier_weight(16, 256, seed=18), seed=3)
    assert "seed=0" in str(err.value)
