"""Build real ComfyUI diffusion models (few blocks, on the ``meta`` device) for the preset tests.

Each :class:`ArchCase` names a ``comfy.supported_models`` class and the ``unet_config`` that
ComfyUI's ``detect_unet_config`` would produce for that architecture, with the block counts cut
down. The model is built the way ``UNETLoader`` builds it (``model_config.get_model``) with
``comfy.ops.disable_weight_init`` and float32; on the ``meta`` device it costs no memory, so the
layer widths stay real and ComfyUI's own shape-based detection can run on the state dict.

ComfyUI is found through ``COMFYUI_PATH`` or ``~/ComfyUI``; :func:`load_comfy` skips the calling
test with the reason when it is absent.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch


def comfyui_path() -> Path | None:
    """Where ComfyUI's source is, or ``None``."""
    path = Path(os.environ.get("COMFYUI_PATH") or Path.home() / "ComfyUI").expanduser()
    return path if (path / "comfy" / "model_detection.py").is_file() else None


@functools.lru_cache(maxsize=1)
def _import_comfy():
    path = comfyui_path()
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    import comfy.cli_args

    comfy.cli_args.args.cpu = True  # before comfy.model_management is imported: no GPU here
    import comfy.model_detection
    import comfy.ops
    import comfy.supported_models

    return comfy


def load_comfy():
    """The ``comfy`` package, imported in-process on CPU; skips the test when ComfyUI is absent."""
    if comfyui_path() is None:
        pytest.skip("ComfyUI not found: set COMFYUI_PATH or put ComfyUI in ~/ComfyUI")
    return _import_comfy()


@dataclass(frozen=True)
class ArchCase:
    id: str
    comfy_class: str  # comfy.supported_models class ComfyUI detects
    config: dict = field(hash=False)
    preset: str  # what detect_preset must pick from keys and shapes
    keys_only_preset: str | None = None  # from key names alone, when that differs (shape-only distinctions)
    expect_float: tuple[str, ...] = ()  # layers (no ".weight") the preset must keep float
    expect_quantized: tuple[str, ...] = ()  # block linears the preset must quantize


F1 = dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=4096, hidden_size=3072,
          mlp_ratio=4.0, num_heads=24, depth=2, depth_single_blocks=2, axes_dim=[16, 56, 56], theta=10000, patch_size=2,
          qkv_bias=True, guidance_embed=True, txt_ids_dims=[], yak_mlp=False, txt_norm=False)
F2 = dict(image_model="flux2", axes_dim=[32, 32, 32, 32], num_heads=48, mlp_ratio=3.0, theta=2000, out_channels=128,
          global_modulation=True, mlp_silu_act=True, qkv_bias=False, ops_bias=False, default_ref_method="index",
          ref_index_scale=10.0, txt_ids_dims=[3], patch_size=1, in_channels=128, hidden_size=6144, context_in_dim=15360,
          vec_in_dim=None, depth=2, depth_single_blocks=2, guidance_embed=True, yak_mlp=False, txt_norm=False)
CHROMA = dict(image_model="chroma", in_channels=64, out_channels=64, context_in_dim=4096, hidden_size=3072, mlp_ratio=4.0,
              num_heads=24, depth=2, depth_single_blocks=2, axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True,
              in_dim=64, out_dim=3072, hidden_dim=5120, n_layers=5, txt_ids_dims=[], vec_in_dim=None)
WAN = dict(image_model="wan2.1", model_type="t2v", dim=1536, out_dim=16, num_heads=12, ffn_dim=8960, num_layers=2,
           patch_size=(1, 2, 2), freq_dim=256, window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6, in_dim=16)
COSMOS2 = dict(image_model="cosmos_predict2", max_img_h=240, max_img_w=240, max_frames=128, in_channels=16, out_channels=16,
               patch_spatial=2, patch_temporal=1, model_channels=2048, concat_padding_mask=True, crossattn_emb_channels=1024,
               pos_emb_cls="rope3d", pos_emb_learnable=True, pos_emb_interpolation="crop", min_fps=1, max_fps=30,
               use_adaln_lora=True, adaln_lora_dim=256, num_blocks=2, num_heads=16, extra_per_block_abs_pos_emb=False,
               rope_h_extrapolation_ratio=4.0, rope_w_extrapolation_ratio=4.0, rope_t_extrapolation_ratio=1.0,
               rope_enable_fps_modulation=False)
UNET = dict(use_checkpoint=False, image_size=32, out_channels=4, use_spatial_transformer=True, legacy=False, in_channels=4,
            model_channels=320, use_temporal_attention=False, use_temporal_resblock=False)

CASES = (
    ArchCase("flux1-dev", "Flux", F1, "flux1",
             expect_float=("img_in", "txt_in", "time_in.in_layer", "vector_in.in_layer", "guidance_in.out_layer",
                           "final_layer.linear", "final_layer.adaLN_modulation.1"),
             expect_quantized=("double_blocks.0.img_attn.qkv", "double_blocks.1.txt_mlp.2", "double_blocks.0.img_mod.lin",
                               "single_blocks.1.linear1", "single_blocks.0.modulation.lin")),
    ArchCase("flux1-schnell", "FluxSchnell", {**F1, "guidance_embed": False}, "flux1",
             expect_float=("img_in", "txt_in", "final_layer.linear"), expect_quantized=("single_blocks.0.linear2",)),
    ArchCase("flux2-dev", "Flux2", F2, "flux2",
             expect_float=("img_in", "txt_in", "guidance_in.in_layer", "double_stream_modulation_img.lin",
                           "single_stream_modulation.lin", "final_layer.linear"),
             expect_quantized=("double_blocks.0.img_attn.qkv", "double_blocks.1.txt_mlp.0", "single_blocks.1.linear2")),
    ArchCase("flux2-klein", "Flux2", {**F2, "hidden_size": 3072, "num_heads": 24, "context_in_dim": 7680,
                                      "guidance_embed": False}, "flux2_klein",
             expect_float=("img_in", "txt_in", "double_stream_modulation_txt.lin", "final_layer.adaLN_modulation.1"),
             expect_quantized=("double_blocks.0.txt_attn.qkv", "single_blocks.0.linear1")),
    ArchCase("chroma", "Chroma", CHROMA, "chroma",
             expect_float=("img_in", "txt_in", "distilled_guidance_layer.in_proj", "distilled_guidance_layer.layers.0.in_layer",
                           "final_layer.linear"),
             expect_quantized=("double_blocks.0.img_attn.qkv", "single_blocks.1.linear2")),
    ArchCase("chroma-radiance", "ChromaRadiance",
             {**CHROMA, "image_model": "chroma_radiance", "depth": 8, "depth_single_blocks": 16, "in_channels": 3, "out_channels": 3, "patch_size": 16,
              "nerf_hidden_size": 64, "nerf_mlp_ratio": 4, "nerf_depth": 4, "nerf_max_freqs": 8, "nerf_tile_size": 512,
              "nerf_final_head_type": "linear", "nerf_embedder_dtype": torch.float32, "use_x0": False,
              "use_sequential_txt_ids": False}, "chroma",
             expect_float=("txt_in", "nerf_blocks.0.param_generator", "nerf_image_embedder.embedder.0"),
             expect_quantized=("double_blocks.1.img_mlp.0",)),
    ArchCase("sd3.5", "SD3", dict(in_channels=16, patch_size=2, out_channels=16, depth=4, input_size=None, adm_in_channels=2048,
                                  context_embedder_config={"target": "torch.nn.Linear",
                                                           "params": {"in_features": 4096, "out_features": 256}},
                                  num_patches=36864, pos_embed_max_size=192, pos_embed_scaling_factor=None,
                                  x_block_self_attn_layers=[0, 1], qk_norm="rms"), "sd3",
             expect_float=("context_embedder", "t_embedder.mlp.0", "y_embedder.mlp.2", "final_layer.linear",
                           "final_layer.adaLN_modulation.1"),
             expect_quantized=("joint_blocks.0.x_block.attn.qkv", "joint_blocks.1.context_block.mlp.fc1",
                               "joint_blocks.0.x_block.attn2.proj")),
    ArchCase("sd3-medium", "SD3", dict(in_channels=16, patch_size=2, out_channels=16, depth=4, input_size=None,
                                       adm_in_channels=2048, context_embedder_config={
                                           "target": "torch.nn.Linear", "params": {"in_features": 4096, "out_features": 256}},
                                       num_patches=36864, pos_embed_max_size=192, pos_embed_scaling_factor=None,
                                       x_block_self_attn_layers=[]), "sd3",
             expect_float=("context_embedder",), expect_quantized=("joint_blocks.0.context_block.attn.qkv",)),
    ArchCase("wan2.1-t2v", "WAN21_T2V", WAN, "wan21",
             expect_float=("text_embedding.0", "time_embedding.2", "time_projection.1", "head.head"),
             expect_quantized=("blocks.0.self_attn.q", "blocks.1.cross_attn.k", "blocks.0.ffn.0", "blocks.1.ffn.2")),
    ArchCase("wan2.1-i2v", "WAN21_I2V", {**WAN, "model_type": "i2v", "in_dim": 36}, "wan21",
             expect_float=("img_emb.proj.1", "img_emb.proj.3", "head.head"), expect_quantized=("blocks.0.cross_attn.k_img",)),
    ArchCase("wan2.2-ti2v-5b", "WAN22_T2V", {**WAN, "dim": 3072, "out_dim": 48, "num_heads": 24, "ffn_dim": 14336,
                                             "in_dim": 48}, "wan22", keys_only_preset="wan21",
             expect_float=("text_embedding.0", "head.head"), expect_quantized=("blocks.0.self_attn.o",)),
    ArchCase("qwen-image", "QwenImage", dict(image_model="qwen_image", in_channels=64, num_layers=2), "qwen_image",
             expect_float=("img_in", "txt_in", "time_text_embed.timestep_embedder.linear_1", "norm_out.linear", "proj_out"),
             expect_quantized=("transformer_blocks.0.attn.to_q", "transformer_blocks.1.attn.add_k_proj",
                               "transformer_blocks.0.img_mod.1", "transformer_blocks.1.txt_mlp.net.2")),
    ArchCase("qwen-image-edit-2511", "QwenImage", dict(image_model="qwen_image", in_channels=64, num_layers=2,
                                                       default_ref_method="index_timestep_zero"), "qwen_image",
             expect_float=("img_in",), expect_quantized=("transformer_blocks.0.attn.to_out.0",)),
    ArchCase("z-image", "ZImage", dict(image_model="lumina2", patch_size=2, in_channels=16, dim=3840, cap_feat_dim=2560,
                                       n_layers=2, qk_norm=True, n_heads=30, n_kv_heads=30, axes_dims=[32, 48, 48],
                                       axes_lens=[1536, 512, 512], rope_theta=256.0, ffn_dim_multiplier=8.0 / 3.0,
                                       z_image_modulation=True, time_scale=1000.0, pad_tokens_multiple=32), "z_image",
             expect_float=("x_embedder", "cap_embedder.1", "t_embedder.mlp.0", "final_layer.linear",
                           "final_layer.adaLN_modulation.1"),
             expect_quantized=("layers.0.attention.qkv", "layers.1.feed_forward.w2", "layers.0.adaLN_modulation.0",
                               "context_refiner.0.attention.qkv", "noise_refiner.1.feed_forward.w1")),
    ArchCase("lumina2", "Lumina2", dict(image_model="lumina2", patch_size=2, in_channels=16, dim=2304, cap_feat_dim=2304,
                                        n_layers=2, qk_norm=True, n_heads=24, n_kv_heads=8, axes_dims=[32, 32, 32],
                                        axes_lens=[300, 512, 512], rope_theta=10000.0, ffn_dim_multiplier=4.0), "lumina2",
             expect_float=("x_embedder", "cap_embedder.1", "final_layer.linear"),
             expect_quantized=("layers.1.attention.out", "layers.0.adaLN_modulation.1")),
    ArchCase("hunyuan-video", "HunyuanVideo", dict(image_model="hunyuan_video", in_channels=16, patch_size=[1, 2, 2],
                                                   out_channels=16, vec_in_dim=768, axes_dim=[16, 56, 56], meanflow=False,
                                                   context_in_dim=4096, hidden_size=3072, mlp_ratio=4.0, num_heads=24,
                                                   depth=2, depth_single_blocks=2, theta=256, qkv_bias=True, byt5=False,
                                                   guidance_embed=True, use_cond_type_embedding=False, vision_in_dim=None,
                                                   meanflow_sum=False), "hunyuan_video",
             expect_float=("txt_in.input_embedder", "txt_in.individual_token_refiner.blocks.0.self_attn.qkv",
                           "vector_in.in_layer", "final_layer.linear"),
             expect_quantized=("double_blocks.0.img_attn.qkv", "single_blocks.1.linear2", "double_blocks.1.txt_mod.lin")),
    ArchCase("hunyuan-video-1.5", "HunyuanVideo15", dict(image_model="hunyuan_video", in_channels=65, patch_size=[1, 1, 1],
                                                         out_channels=32, vec_in_dim=None, axes_dim=[16, 56, 56],
                                                         meanflow=False, context_in_dim=3584, hidden_size=2048,
                                                         mlp_ratio=4.0, num_heads=16, depth=2, depth_single_blocks=0,
                                                         theta=256, qkv_bias=True, byt5=True, guidance_embed=False,
                                                         use_cond_type_embedding=True, vision_in_dim=1152,
                                                         meanflow_sum=True), "hunyuan_video",
             expect_float=("byt5_in.fc1", "vision_in.proj.1", "cond_type_embedding"),
             expect_quantized=("double_blocks.1.img_mlp.0",)),
    ArchCase("hidream", "HiDream", dict(image_model="hidream", attention_head_dim=128, axes_dims_rope=[64, 32, 32],
                                        caption_channels=[4096, 4096], max_resolution=[128, 128], in_channels=16,
                                        llama_layers=list(range(32)) + [31] * 16, num_attention_heads=20,
                                        num_routed_experts=4, num_activated_experts=2, num_layers=16, num_single_layers=32,
                                        out_channels=16, patch_size=2, text_emb_dim=2048), "hidream",
             expect_float=("x_embedder.proj", "caption_projection.3.linear", "t_embedder.timestep_embedder.linear_1",
                           "double_stream_blocks.0.block.ff_i.gate", "final_layer.linear"),
             expect_quantized=("double_stream_blocks.0.block.attn1.to_q", "single_stream_blocks.31.block.ff_i.experts.3.w2")),
    ArchCase("ltxv", "LTXV", dict(image_model="ltxv", num_layers=2, attention_head_dim=64, cross_attention_dim=2048), "ltxv",
             expect_float=("patchify_proj", "adaln_single.linear", "caption_projection.linear_1", "proj_out"),
             expect_quantized=("transformer_blocks.0.attn1.to_q", "transformer_blocks.1.ff.net.2")),
    ArchCase("ltx-2", "LTXAV", dict(image_model="ltxav", num_layers=8), "ltx2",
             expect_float=("patchify_proj", "audio_patchify_proj", "adaln_single.linear", "av_ca_a2v_gate_adaln_single.linear",
                           "video_embeddings_connector.transformer_1d_blocks.0.attn1.to_q", "audio_proj_out"),
             expect_quantized=("transformer_blocks.0.audio_to_video_attn.to_q", "transformer_blocks.1.audio_ff.net.2")),
    ArchCase("cosmos-predict2", "CosmosT2IPredict2", COSMOS2, "cosmos_predict2",
             expect_float=("x_embedder.proj.1", "t_embedder.1.linear_2", "final_layer.linear"),
             expect_quantized=("blocks.0.self_attn.q_proj", "blocks.1.adaln_modulation_mlp.2")),
    ArchCase("anima", "Anima", {**COSMOS2, "image_model": "anima"}, "anima",
             expect_float=("llm_adapter.embed", "llm_adapter.out_proj", "x_embedder.proj.1"),
             expect_quantized=("llm_adapter.blocks.0.self_attn.q_proj", "blocks.0.mlp.layer1")),
    ArchCase("cosmos1", "CosmosT2V", dict(image_model="cosmos", max_img_h=240, max_img_w=240, max_frames=128, in_channels=16,
                                          out_channels=16, patch_spatial=2, patch_temporal=1, model_channels=4096,
                                          block_config="FA-CA-MLP", concat_padding_mask=True, pos_emb_cls="rope3d",
                                          pos_emb_learnable=False, pos_emb_interpolation="crop", block_x_format="THWBD",
                                          affline_emb_norm=True, use_adaln_lora=True, adaln_lora_dim=256, num_blocks=2,
                                          num_heads=32, extra_per_block_abs_pos_emb=True, rope_h_extrapolation_ratio=1.0,
                                          rope_w_extrapolation_ratio=1.0, rope_t_extrapolation_ratio=2.0,
                                          extra_per_block_abs_pos_emb_type="learnable"), "cosmos1",
             expect_float=("x_embedder.proj.1", "t_embedder.1.linear_1", "final_layer.linear"),
             expect_quantized=("blocks.block1.blocks.1.block.attn.to_k.0", "blocks.block0.blocks.2.block.layer2")),
    ArchCase("krea2", "Krea2", dict(image_model="krea2", features=6144, channels=16, patch=2, layers=2, heads=48, kvheads=12,
                                    txtlayers=12, txtdim=2560), "krea2",
             expect_float=("first", "tproj.1", "txtfusion.refiner_blocks.0.attn.wq", "last.linear"),
             expect_quantized=("blocks.0.attn.wq", "blocks.1.mlp.down")),
    ArchCase("ernie-image", "ErnieImage", dict(image_model="ernie", num_layers=2), "ernie",
             expect_float=("text_proj", "adaLN_modulation.1", "final_linear", "time_embedding.linear_1"),
             expect_quantized=("layers.0.self_attention.to_q", "layers.1.mlp.linear_fc2")),
    ArchCase("ideogram4", "Ideogram4", dict(image_model="ideogram4", in_channels=128, num_layers=2), "ideogram4",
             expect_float=("input_proj", "llm_cond_proj", "adaln_proj", "embed_image_indicator", "final_layer.linear"),
             expect_quantized=("layers.0.attention.qkv", "layers.1.adaln_modulation")),
    ArchCase("minimax-h3", "MiniMaxH3", dict(image_model="minimax_h3", num_layers=2), "minimax_h3",
             expect_float=("video_patch_proj", "condition_proj", "token_refiner.blocks.0.attn.qkv_proj",
                           "final_layer.video_out"),
             expect_quantized=("blocks.0.attn.qkv_proj", "blocks.1.adaln_proj.linear")),
    ArchCase("sdxl", "SDXL", {**UNET, "num_classes": "sequential", "adm_in_channels": 2816, "num_res_blocks": [2, 2, 2],
                              "transformer_depth": [0, 0, 2, 2, 10, 10], "channel_mult": [1, 2, 4],
                              "transformer_depth_middle": 10, "use_linear_in_transformer": True, "context_dim": 2048,
                              "num_head_channels": 64, "transformer_depth_output": [0, 0, 0, 2, 2, 2, 10, 10, 10]}, "sdxl",
             expect_float=("time_embed.0", "label_emb.0.0", "input_blocks.1.0.emb_layers.1"),
             expect_quantized=("input_blocks.4.1.transformer_blocks.0.attn1.to_q", "middle_block.1.proj_in",
                               "output_blocks.2.1.transformer_blocks.9.ff.net.2")),
    ArchCase("sd1.5", "SD15", {**UNET, "adm_in_channels": None, "num_res_blocks": [2, 2, 2, 2],
                               "transformer_depth": [1, 1, 1, 1, 1, 1, 0, 0], "channel_mult": [1, 2, 4, 4],
                               "transformer_depth_middle": 1, "use_linear_in_transformer": False, "context_dim": 768,
                               "num_heads": 8, "transformer_depth_output": [1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0]}, "sd15",
             expect_float=("time_embed.2", "input_blocks.4.0.emb_layers.1"),
             expect_quantized=("input_blocks.1.1.transformer_blocks.0.attn2.to_k", "middle_block.1.transformer_blocks.0.ff.net.2")),
)


def qualified_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


@functools.lru_cache(maxsize=None)
def build(case_id: str):
    """The ComfyUI ``BaseModel`` for a case, built on the meta device (cached per case)."""
    comfy = load_comfy()
    case = next(c for c in CASES if c.id == case_id)
    model_config = getattr(comfy.supported_models, case.comfy_class)(case.config)
    model_config.custom_operations = comfy.ops.disable_weight_init
    model_config.set_inference_dtype(torch.float32, None)
    return model_config.get_model({}, device="meta")
