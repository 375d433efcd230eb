"""Architecture presets: file validation, key-fingerprint and ComfyUI-class detection on real
ComfyUI models, and what each preset keeps float."""

from __future__ import annotations

import importlib
import json
import logging
import re

import pytest

from lowbit.quant import presets as P
from lowbit.quant.demo import TinyFluxConfig, flux_shapes
from lowbit.quant.errors import PolicyError
from lowbit.quant.policy import Policy

from presets_helpers import CASES, build, load_comfy, qualified_name

ISSUE_PRESETS = {"flux1", "flux2", "flux2_klein", "chroma", "sd3", "wan21", "wan22", "qwen_image", "z_image"}
# a linear inside a repeated block (transformer block, refiner, UNet level); anything else is an
# input/output projection or embedder that every preset must keep float
BLOCK_LINEAR = re.compile(r"(^|\.)[a-z0-9_]*(blocks?|layers|refiner)\.(block)?\d+\.")


def _shapes(case_id: str) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in build(case_id).diffusion_model.state_dict().items()}


# ---- the preset files -----------------------------------------------------------------------

def test_every_preset_file_validates_and_round_trips():
    files = sorted(P.PRESET_DIR.glob("*.json"))
    assert {f.stem for f in files} >= ISSUE_PRESETS | {"generic"}
    for path in files:
        preset = P.load_preset_file(path)
        assert preset.name == path.stem
        assert P.Preset.from_dict(preset.to_dict(), source=path.name) == preset
        assert P.Preset.from_dict(json.loads(json.dumps(preset.to_dict()))) == preset
        for pattern in (*preset.keep_float, *preset.int4_sensitive):
            re.compile(pattern)
        if preset.name != P.GENERIC:
            assert preset.detect, f"{path.name} has no detect fingerprint"
            assert preset.comfy_classes, f"{path.name} names no ComfyUI class"
            assert preset.keep_float and preset.int4_sensitive and preset.description and preset.notes


def test_preset_names_are_unique_and_known():
    names = P.preset_names()
    assert len(names) == len(set(names)) == len(list(P.PRESET_DIR.glob("*.json")))
    assert P.get_preset("flux1").name == "flux1"
    with pytest.raises(PolicyError, match=r"unknown preset 'flux9'.*known presets: auto, .*flux1"):
        P.get_preset("flux9")


def test_comfy_classes_exist_in_comfyui():
    comfy = load_comfy()
    for preset in P.all_presets():
        for entry in preset.comfy_classes:
            if "." in entry:
                module, _, name = entry.rpartition(".")
                assert isinstance(getattr(importlib.import_module(module), name, None), type), f"{preset.name}: {entry}"
            else:
                assert isinstance(getattr(comfy.supported_models, entry, None), type), f"{preset.name}: {entry}"


@pytest.mark.parametrize("change, message", [
    ({"keep_float": ["^img_in$", "(unclosed"]}, r"keep_float pattern '\(unclosed' is not a valid regular expression"),
    ({"int4_sensitive": ["[z-a]"]}, r"int4_sensitive pattern '\[z-a\]' is not a valid regular expression"),
    ({"keep_float": "^img_in$"}, r"'keep_float' must be a list of non-empty strings"),
    ({"surprise": 1}, r"unknown keys \['surprise'\]"),
    ({"version": 2}, r"version 2 is not supported"),
    ({"priority": "high"}, r"'priority' must be an integer"),
    ({"detect": {"all": ["a.weight"], "any": ["b"]}}, r"detect\[0\]: unknown keys \['any'\]"),
    ({"detect": {"none": ["a.weight"]}}, r"needs at least one 'all' key or 'shapes' entry"),
    ({"detect": {"all": [["a.weight", 3]]}}, r"'all' entry must be a list of non-empty strings"),
    ({"detect": {"all": ["a"], "shapes": {"a": [0, None]}}}, r"shape of 'a' must be a list of positive integers or null"),
    ({"detect": "a.weight"}, r"'detect' must be an object or a list of objects"),
    ({"name": ""}, r"non-empty string 'name'"),
])
def test_bad_preset_data_is_rejected_with_the_reason(change, message):
    data = {**P.get_preset("flux1").to_dict(), **change}
    with pytest.raises(PolicyError, match=message):
        P.Preset.from_dict(data, source="broken.json")


def test_preset_file_name_must_match_and_json_must_parse(tmp_path):
    wrong = tmp_path / "mine.json"
    wrong.write_text(json.dumps({**P.get_preset("flux1").to_dict(), "name": "flux1"}))
    with pytest.raises(PolicyError, match=r"'name' is 'flux1' but must equal the file name 'mine'"):
        P.load_preset_file(wrong)
    broken = tmp_path / "broken.json"
    broken.write_text("{\"name\": ")
    with pytest.raises(PolicyError, match=r"broken.json is not valid JSON"):
        P.load_preset_file(broken)


# ---- detection from keys, without ComfyUI ---------------------------------------------------

def test_demo_flux_is_detected_with_any_prefix_and_spelling():
    shapes = flux_shapes(TinyFluxConfig())
    assert P.detect_preset(shapes).name == "flux1"
    assert P.detect_preset(list(shapes)).name == "flux1"
    for prefix in ("model.diffusion_model.", "diffusion_model.", "model."):
        prefixed = {prefix + k: v for k, v in shapes.items()}
        assert P.model_prefix(prefixed) == prefix
        assert P.detect_preset(prefixed).name == "flux1"
    # a full checkpoint: the diffusion model next to VAE and text-encoder keys
    full = {"model.diffusion_model." + k: v for k, v in shapes.items()}
    full.update({f"first_stage_model.decoder.up.{i}.conv.weight": (4, 4, 3, 3) for i in range(8)})
    full.update({f"text_encoders.t5xxl.layer.{i}.weight": (64, 64) for i in range(8)})
    assert P.model_prefix(full) == "model.diffusion_model."
    assert set(P.model_names(full)) == set(shapes)
    assert P.detect_preset(full).name == "flux1"
    # original BFL checkpoints spell the q/k norms ``.scale``
    bfl = {k.replace("_norm.weight", "_norm.scale"): v for k, v in shapes.items()}
    assert "double_blocks.0.img_attn.norm.key_norm.scale" in bfl
    assert P.detect_preset(bfl).name == "flux1"


def test_undetected_model_falls_back_to_generic_and_names_what_it_saw(caplog):
    keys = {"encoder.layer.0.dense.weight": (64, 64), "encoder.layer.0.norm.weight": (64,), "pooler.weight": (64, 64)}
    with caplog.at_level(logging.WARNING, logger=P.__name__):
        preset = P.detect_preset(keys)
    assert preset.name == P.GENERIC
    assert "no preset matches" in caplog.text and "encoder.layer.0.dense.weight" in caplog.text


def test_shape_fingerprints_need_shapes():
    wan22 = P.get_preset("wan22")
    names = {"head.modulation": (1, 2, 3072), "blocks.0.self_attn.q.weight": (3072, 3072), "head.head.weight": (192, 3072),
             "patch_embedding.weight": (3072, 48, 1, 2, 2)}
    assert wan22.matches(names)
    assert not wan22.matches(list(names))  # key names alone cannot show out_dim 48
    assert not wan22.matches({**names, "head.head.weight": (64, 3072)})
    assert P.detect_preset(list(names)).name == "wan21"


def test_class_detection_without_comfyui():
    shapes = flux_shapes(TinyFluxConfig())
    assert P.detect_preset_from_classes(["comfy.supported_models.FluxSchnell"]).name == "flux1"
    assert P.detect_preset_from_classes(["FluxSchnell"]).name == "flux1"
    assert P.detect_preset_from_classes(["comfy.supported_models.Chroma"], keys=shapes).name == "chroma"  # class wins
    # the shared diffusion-model class is ambiguous; the keys decide
    flux = "comfy.ldm.flux.model.Flux"
    assert {p.name for p in P.all_presets() if p.claims_class(flux)} >= {"flux1", "flux2", "flux2_klein"}
    assert P.detect_preset_from_classes([flux], keys=shapes).name == "flux1"
    # a bare name is a supported_models class, never a diffusion-model class of the same name
    assert not P.get_preset("flux1").claims_class("comfy.ldm.other.Flux")
    # unknown classes: keys, else generic
    assert P.detect_preset_from_classes(["my.custom.Model", ""], keys=shapes).name == "flux1"


def test_preset_for_model_class_returns_none_unless_one_preset_fits():
    shapes = flux_shapes(TinyFluxConfig())
    assert P.preset_for_model_class("FluxSchnell").name == "flux1"
    assert P.preset_for_model_class("comfy.supported_models.Chroma").name == "chroma"
    assert P.preset_for_model_class("WAN21") is None  # a model_base class no preset claims
    assert P.preset_for_model_class("Flux2") is None  # dev or klein: the keys must decide
    assert P.preset_for_model_class("comfy.ldm.flux.model.Flux", shapes).name == "flux1"
    assert P.preset_for_model_class("Flux2", shapes) is None  # neither Flux.2 fingerprint fits Flux.1 keys


def test_unknown_classes_without_keys_warn(caplog):
    with caplog.at_level(logging.WARNING, logger=P.__name__):
        assert P.detect_preset_from_classes(["my.custom.Model"]).name == P.GENERIC
    assert "my.custom.Model" in caplog.text


def test_unclaimed_class_with_unmatched_keys_warns_naming_the_class_and_the_keys(caplog):
    keys = {"encoder.layer.0.dense.weight": (64, 64), "pooler.weight": (64, 64)}
    with caplog.at_level(logging.WARNING, logger=P.__name__):
        preset = P.detect_preset_from_classes(["my.custom.ModelConfig", "my.custom.Net"], keys=keys)
    assert preset.name == P.GENERIC
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "no preset matches" in warnings[0] and "encoder.layer.0.dense.weight" in warnings[0]
    assert "my.custom.ModelConfig, my.custom.Net" in warnings[0] and "no preset claims" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=P.__name__):
        P.detect_preset(keys)  # no class known: the warning names none
    assert "no preset matches" in caplog.text and "ComfyUI class" not in caplog.text


# ---- real ComfyUI models --------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_detection_agrees_with_comfyui(case):
    comfy = load_comfy()
    model = build(case.id)
    state_dict = model.diffusion_model.state_dict()
    shapes = _shapes(case.id)

    # ComfyUI's own detection on the same state dict
    detected = comfy.model_detection.model_config_from_unet(state_dict, "")
    assert type(detected).__name__ == case.comfy_class
    assert P.get_preset(case.preset).claims_class(f"comfy.supported_models.{case.comfy_class}")

    # key fingerprints: exactly the expected preset matches (others only below it by priority)
    matches = [p.name for p in P.matching_presets(shapes)]
    assert matches[0] == case.preset, matches
    assert P.detect_preset(shapes).name == case.preset
    assert P.detect_preset({"model.diffusion_model." + k: v for k, v in shapes.items()}).name == case.preset
    assert P.detect_preset(list(shapes)).name == (case.keys_only_preset or case.preset)
    if case.keys_only_preset is None:
        assert matches == [case.preset], f"fingerprints overlap: {matches}"

    # class names first (model_config, then the diffusion model), keys as the tie-breaker
    classes = [qualified_name(model.model_config), qualified_name(model.diffusion_model)]
    assert P.detect_preset_from_classes(classes, keys=shapes).name == case.preset
    assert P.detect_preset_from_classes(classes[1:], keys=shapes).name == case.preset
    assert P.detect_preset_from_classes(["unknown.Class"], keys=shapes).name == case.preset
    assert P.preset_for_model_class(case.comfy_class, shapes).name == case.preset


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_preset_keeps_io_float_and_quantizes_block_linears(case):
    shapes = _shapes(case.id)
    preset = P.get_preset(case.preset)
    plan = Policy(mode="int8", preset=case.preset).plan(shapes)
    decisions = {d.name: d for d in plan.layers}
    for name in case.expect_float:
        assert decisions[name].format is None, f"{name}: {decisions[name].reason}"
    for name in case.expect_quantized:
        assert decisions[name].format == "int8", f"{name}: {decisions[name].reason}"
    for d in plan.layers:  # nothing outside the repeated blocks is quantized
        if not BLOCK_LINEAR.search(d.name):
            assert d.format is None, f"{case.preset} quantizes the non-block layer {d.name}"
    quantized = [d for d in plan.layers if d.format]
    share = sum(d.params for d in quantized) / sum(d.params for d in plan.layers)
    assert share >= 0.5, f"the preset keeps most of the weights float ({share:.0%} quantized)"
    # the most sensitive patterns name real layers of this architecture
    assert any(re.search(preset.int4_sensitive[0], d.name) for d in quantized), preset.int4_sensitive[0]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_int4_sensitive_layers_take_int8_first(case):
    shapes = _shapes(case.id)
    preset = P.get_preset(case.preset)
    plan = Policy(mode="int4_mixed", preset=case.preset, int4_mixed_ratio=0.25).plan(shapes)
    budget = [d for d in plan.quantized if "int4_mixed: int8 budget" in d.reason]
    assert budget, "a 25% INT8 budget picks at least one layer"
    assert all("int4_sensitive" in d.reason for d in budget), [d.reason for d in budget]
    first_pattern = re.compile(preset.int4_sensitive[0])
    assert any(first_pattern.search(d.name) for d in budget)
