"""LoRA key parsing (lora/keys.py): every key style, fused slices, adapters, and unmatched keys reported."""

from __future__ import annotations

import pytest
import torch

from lowbit.lora.keys import parse_lora, split_key

HIDDEN = 32
MLP = 64
SHAPES = {
    "diffusion_model.double_blocks.0.img_attn.qkv.weight": (3 * HIDDEN, HIDDEN),
    "diffusion_model.double_blocks.0.img_attn.proj.weight": (HIDDEN, HIDDEN),
    "diffusion_model.double_blocks.0.img_mlp.0.weight": (MLP, HIDDEN),
    "diffusion_model.single_blocks.0.linear2.weight": (HIDDEN, HIDDEN + MLP),
    "diffusion_model.img_in.weight": (HIDDEN, 16),
}
QKV = "diffusion_model.double_blocks.0.img_attn.qkv.weight"
PROJ = "diffusion_model.double_blocks.0.img_attn.proj.weight"
MLP0 = "diffusion_model.double_blocks.0.img_mlp.0.weight"
LINEAR2 = "diffusion_model.single_blocks.0.linear2.weight"


def key_map() -> dict[str, object]:
    """What comfy.lora.model_lora_keys_unet produces for these layers of a Flux model (the parts used here)."""
    out: dict[str, object] = {}
    for key in SHAPES:
        layer = key[len("diffusion_model."):-len(".weight")]
        out[f"lora_unet_{layer.replace('.', '_')}"] = key  # kohya
        out[f"diffusion_model.{layer}"] = key  # ComfyUI keys
    for i, part in enumerate(("to_q", "to_k", "to_v")):  # diffusers Flux names, slices of the fused qkv
        out[f"transformer.transformer_blocks.0.attn.{part}"] = (QKV, (0, i * HIDDEN, HIDDEN))
    out["transformer.transformer_blocks.0.attn.to_out.0"] = PROJ
    out["transformer.transformer_blocks.0.ff.net.0.proj"] = MLP0
    out["transformer.single_transformer_blocks.0.proj_out"] = LINEAR2
    return out


def _pair(rows: int, cols: int, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rank, cols, generator=gen), torch.randn(rows, rank, generator=gen)


def _only_delta(parsed, layer):
    assert len(parsed.low_rank[layer]) == 1
    return parsed.low_rank[layer][0]


def test_kohya_keys_with_alpha():
    down, up = _pair(HIDDEN, HIDDEN, 4, 1)
    prefix = "lora_unet_double_blocks_0_img_attn_proj"
    lora = {f"{prefix}.lora_down.weight": down, f"{prefix}.lora_up.weight": up, f"{prefix}.alpha": torch.tensor(2.0)}
    parsed = parse_lora(lora, key_map(), shapes=SHAPES)
    delta = _only_delta(parsed, PROJ)
    assert torch.equal(delta.down, down) and torch.equal(delta.up, up)
    assert delta.alpha == 2.0 and delta.factor == 0.5 and delta.rows is None and delta.source == prefix
    assert parsed.unmatched == () and parsed.styles == {"kohya": 1}


def test_diffusers_peft_keys_on_a_fused_qkv_become_row_slices():
    lora = {}
    for i, part in enumerate(("to_q", "to_k", "to_v")):
        down, up = _pair(HIDDEN, HIDDEN, 8, 10 + i)
        lora[f"transformer.transformer_blocks.0.attn.{part}.lora_A.weight"] = down
        lora[f"transformer.transformer_blocks.0.attn.{part}.lora_B.weight"] = up
    parsed = parse_lora(lora, key_map(), shapes=SHAPES)
    deltas = parsed.low_rank[QKV]
    assert sorted(d.rows for d in deltas) == [(0, HIDDEN), (HIDDEN, HIDDEN), (2 * HIDDEN, HIDDEN)]
    assert all(d.alpha is None and d.factor == 1.0 for d in deltas)
    assert parsed.styles == {"peft": 3} and parsed.unmatched == ()


def test_comfyui_style_keys():
    down, up = _pair(MLP, HIDDEN, 4, 2)
    lora = {"diffusion_model.double_blocks.0.img_mlp.0.lora_up.weight": up,
            "diffusion_model.double_blocks.0.img_mlp.0.lora_down.weight": down}
    parsed = parse_lora(lora, key_map(), shapes=SHAPES)
    assert torch.equal(_only_delta(parsed, MLP0).up, up)


@pytest.mark.parametrize("style,up_suffix,down_suffix", [
    ("peft-named", ".lora_B.default.weight", ".lora_A.default.weight"),
    ("diffusers-old", "_lora.up.weight", "_lora.down.weight"),
    ("diffusers-attn", ".lora.up.weight", ".lora.down.weight"),
    ("transformers", ".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight"),
    ("mochi", ".lora_B", ".lora_A"),
])
def test_other_pair_names(style, up_suffix, down_suffix):
    down, up = _pair(HIDDEN, HIDDEN + MLP, 4, 3)
    prefix = "transformer.single_transformer_blocks.0.proj_out"
    lora = {prefix + up_suffix: up, prefix + down_suffix: down, prefix + ".alpha": torch.tensor(8.0)}
    parsed = parse_lora(lora, key_map(), shapes=SHAPES)
    delta = _only_delta(parsed, LINEAR2)
    assert torch.equal(delta.down, down) and delta.factor == 2.0
    assert parsed.styles == {style: 1}


def test_split_key_prefers_the_longest_suffix():
    assert split_key("a.b.lora_B.default.weight") == ("a.b", ".lora_B.default.weight")
    assert split_key("a.b.lora_B.weight") == ("a.b", ".lora_B.weight")
    assert split_key("a.b.lora_B") == ("a.b", ".lora_B")
    assert split_key("a.b_lora.up.weight") == ("a.b", "_lora.up.weight")
    assert split_key("a.b.diff_b") == ("a.b", ".diff_b")
    assert split_key("a.b.something") is None


def test_non_low_rank_entries_go_to_comfyui_adapters():
    down, up = _pair(HIDDEN, HIDDEN, 4, 4)
    loha = {f"lora_unet_double_blocks_0_img_attn_proj.hada_{n}": torch.randn(4, HIDDEN) for n in ("w1_a", "w2_a")}
    loha.update({f"lora_unet_double_blocks_0_img_attn_proj.hada_{n}": torch.randn(HIDDEN, 4) for n in ("w1_b", "w2_b")})
    dora = {"diffusion_model.double_blocks.0.img_mlp.0.lora_up.weight": torch.randn(MLP, 4),
            "diffusion_model.double_blocks.0.img_mlp.0.lora_down.weight": torch.randn(4, HIDDEN),
            "diffusion_model.double_blocks.0.img_mlp.0.dora_scale": torch.ones(MLP, 1)}
    diff = {"diffusion_model.img_in.diff": torch.randn(HIDDEN, 16)}
    conv = {"lora_unet_single_blocks_0_linear2.lora_up.weight": torch.randn(HIDDEN, 4, 1, 1),
            "lora_unet_single_blocks_0_linear2.lora_down.weight": torch.randn(4, HIDDEN + MLP, 1, 1)}
    parsed = parse_lora({**loha, **dora, **diff, **conv}, key_map(), shapes=SHAPES)
    assert parsed.low_rank == {}
    assert parsed.adapters == {
        "lora_unet_double_blocks_0_img_attn_proj": PROJ,
        "diffusion_model.double_blocks.0.img_mlp.0": MLP0,
        "diffusion_model.img_in": "diffusion_model.img_in.weight",
        "lora_unet_single_blocks_0_linear2": LINEAR2,
    }
    assert parsed.unmatched == () and parsed.layers == 4


def test_unmatched_keys_are_counted_with_their_reason():
    down, up = _pair(HIDDEN, HIDDEN, 4, 5)
    wrong_down, wrong_up = _pair(HIDDEN, 48, 4, 6)  # made for a model with 48 input features
    lora = {
        "lora_unet_double_blocks_0_img_attn_proj.lora_down.weight": down,
        "lora_unet_double_blocks_0_img_attn_proj.lora_up.weight": up,
        "lora_unet_double_blocks_7_img_attn_proj.lora_down.weight": down,  # no such layer
        "lora_unet_double_blocks_7_img_attn_proj.lora_up.weight": up,
        "lora_unet_double_blocks_7_img_attn_proj.alpha": torch.tensor(4.0),
        "lora_unet_img_in.lora_down.weight": torch.randn(4, 16),  # half a pair
        "lora_unet_single_blocks_0_linear2.lora_down.weight": wrong_down,  # wrong shape
        "lora_unet_single_blocks_0_linear2.lora_up.weight": wrong_up,
        "some_other_tool.metadata_tensor": torch.zeros(1),  # nobody's key
        "diffusion_model.double_blocks.0.img_mlp.0.alpha": torch.tensor(1.0),  # alpha alone
        "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": down,  # text encoder: skipped
        "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": up,
    }
    parsed = parse_lora(lora, key_map(), shapes=SHAPES, skip_prefixes=("lora_te",))
    reasons = {u.key: u.reason for u in parsed.unmatched}
    assert set(parsed.low_rank) == {PROJ}
    assert parsed.skipped == 2 and parsed.total_keys == len(lora)
    assert len(parsed.unmatched) == len(lora) - 2 - 2
    assert "no model layer" in reasons["lora_unet_double_blocks_7_img_attn_proj.alpha"]
    assert "half of a LoRA pair" in reasons["lora_unet_img_in.lora_down.weight"]
    assert "different model" in reasons["lora_unet_single_blocks_0_linear2.lora_up.weight"]
    assert "unrecognised suffix" in reasons["some_other_tool.metadata_tensor"]
    assert "alpha without" in reasons["diffusion_model.double_blocks.0.img_mlp.0.alpha"]
    summary = parsed.summary("my_lora", limit=3)
    assert f"{len(parsed.unmatched)} unmatched" in summary and "... and 5 more" in summary


def test_without_shapes_a_bad_pair_still_cannot_hide():
    """No model shapes given: ranks that disagree are still reported, not merged."""
    lora = {"lora_unet_img_in.lora_down.weight": torch.randn(4, 16), "lora_unet_img_in.lora_up.weight": torch.randn(HIDDEN, 8)}
    parsed = parse_lora(lora, key_map())
    assert parsed.low_rank == {} and len(parsed.unmatched) == 2
    assert "rank" in parsed.unmatched[0].reason


def test_deltas_at_a_strength():
    down, up = _pair(HIDDEN, HIDDEN, 4, 7)
    prefix = "lora_unet_double_blocks_0_img_attn_proj"
    parsed = parse_lora({f"{prefix}.lora_down.weight": down, f"{prefix}.lora_up.weight": up}, key_map())
    (delta,) = parsed.deltas(0.25)[PROJ]
    assert delta.strength == 0.25 and _only_delta(parsed, PROJ).strength == 1.0


def test_a_pair_on_a_conv_layer_goes_to_comfyui_adapters():
    shapes = {**SHAPES, "diffusion_model.img_in.weight": (HIDDEN, 16, 1, 1)}  # a 1x1 conv in some architectures
    lora = {"lora_unet_img_in.lora_down.weight": torch.randn(4, 16), "lora_unet_img_in.lora_up.weight": torch.randn(HIDDEN, 4)}
    parsed = parse_lora(lora, key_map(), shapes=shapes)
    assert parsed.low_rank == {} and parsed.adapters == {"lora_unet_img_in": "diffusion_model.img_in.weight"}
    assert parsed.unmatched == ()
