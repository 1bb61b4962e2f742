"""Qwen3-VL (transformers ``Qwen3VLForConditionalGeneration``): a full-attention vision tower (patch 16, learned
position embeddings interpolated per image, no windows) whose features taken at ``deepstack_visual_indexes`` go
through their own mergers and are added to the output of the first decoder layers at the image positions
(DeepStack), and a Qwen3 decoder (q/k RMSNorm per head, no biases, interleaved M-RoPE).

The hand-off is therefore 1 + len(deepstack_visual_indexes) tensors of the LLM's width per image token
(``ModelSpec.injection_layers``). Parameter formulas mirror transformers 5's ``modeling_qwen3_vl``; the counts equal
the published safetensors totals (docs/research/qwen3-vl.md).
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from planner.contract.families import qwen3_vl_configs
from planner.contract.families.family import PlannerFamily
from planner.contract.families.fields import encoder_section, heads_divide, ints, positive_int, text_section
from planner.contract.families.qwen_parts import check_vision_language, llm_module, merger_layer, patch_embed_layer, vision_input
from planner.contract.models import AttentionSpec, LayerSpec, MlpSpec, ModelSpec, ModuleSpec, VideoInputSpec
from planner.contract.param_counts import layer_norm_params, linear_params, qwen2_vl_vision_block_params, rms_norm_params

MODEL_TYPE = "qwen3_vl"
VISION_DEFAULTS: dict[str, Any] = {
    "depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "in_channels": 3,
    "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 3584,
    "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
}
"""transformers ``Qwen3VLVisionConfig`` defaults."""
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "attention_bias": False,
}
"""transformers ``Qwen3VLTextConfig`` defaults (its ``num_key_value_heads`` is 32 whatever the query heads)."""
IMAGE_PIXELS = (65_536, 16_777_216)
"""(shortest_edge, longest_edge) pixels of the checkpoints' preprocessor_config.json (not the class defaults)."""
TIMESTAMP_TOKENS = 7
"""Tokens of one ``<12.5 seconds>`` timestamp (Qwen's tokenizer splits digits: ``<``, 1, 2, ``.``, 5, `` seconds``,
``>``); a named approximation: clips under 10 s take one fewer, over 100 s one more."""
VIDEO = VideoInputSpec(min_pixels=4_096, max_pixels=25_165_824, pixels_per_clip=True,
                       group_text_tokens=TIMESTAMP_TOKENS + 2, clip_text_tokens=0, min_frames=4, max_frames=768,
                       samples_whole_temporal_patches=False)
"""The checkpoints' video_preprocessor_config.json: a pixel budget for the whole clip (frames x H x W); the prompt
gives each temporal group its timestamp and its own vision start/end pair (``Qwen3VLProcessor.replace_video_token``);
a file is sampled by ``Qwen3VLVideoProcessor.sample_frames`` (4 to 768 frames)."""


def attention_and_norms_params(hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool = False) -> int:
    """A Qwen3-VL decoder layer without its feed-forward: q/k/v/o (bias per ``attention_bias``), q_norm and k_norm
    RMSNorms of one head's width, the two RMSNorms around attention and feed-forward."""
    attention = (linear_params(hidden, heads * head_dim, bias) + 2 * linear_params(hidden, kv_heads * head_dim, bias)
                 + linear_params(heads * head_dim, hidden, bias) + 2 * rms_norm_params(head_dim))
    return attention + 2 * rms_norm_params(hidden)


def decoder_layer_params(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                         bias: bool = False) -> int:
    """``Qwen3VLTextDecoderLayer``: ``attention_and_norms_params`` and a SwiGLU MLP without bias."""
    return (attention_and_norms_params(hidden, heads, kv_heads, head_dim, bias)
            + 3 * linear_params(hidden, intermediate, bias=False))


def deepstack_indexes(v: Mapping[str, Any], depth: int) -> list[int]:
    """``deepstack_visual_indexes``: distinct vision blocks, each inside the tower."""
    indexes = v["deepstack_visual_indexes"]
    if (not isinstance(indexes, (list, tuple)) or len(set(indexes)) != len(indexes)
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < depth for i in indexes)):
        raise ValueError(f"vision_config.deepstack_visual_indexes must be distinct block indexes below the depth "
                         f"{depth}, got {indexes!r}")
    return list(indexes)


def vision_module(v: Mapping[str, Any]) -> ModuleSpec:
    """The vision tower: patch embed (Conv3d with bias, plus the learned position table), full-attention
    LayerNorm/GELU blocks, the merger, and one DeepStack merger per ``deepstack_visual_indexes`` entry (LayerNorm
    after the 2x2 shuffle, over the merged width)."""
    depth, dim, inter, heads, merge, out_dim = ints(
        v, "depth hidden_size intermediate_size num_heads spatial_merge_size out_hidden_size", "vision_config")
    positions = positive_int(v, "num_position_embeddings", "vision_config")
    levels = len(deepstack_indexes(v, depth))
    attention = AttentionSpec(num_heads=heads, num_kv_heads=heads, head_dim=heads_divide(dim, heads, "vision_config"),
                              causal=False)
    embed = patch_embed_layer(v, dim, bias=True)
    layers = [
        LayerSpec(kind="patch_embed", name="patch_embed", count=1, params=embed.params + positions * dim,
                  hidden_size=dim, in_features=embed.in_features),
        LayerSpec(kind="vision_block", name="full_block", count=depth, params=qwen2_vl_vision_block_params(dim, inter),
                  hidden_size=dim, attention=attention, mlp=MlpSpec(intermediate_size=inter, gated=False)),
        merger_layer(dim, out_dim, merge, layer_norm_params(dim)),
    ]
    if levels:
        layers.append(merger_layer(dim, out_dim, merge, layer_norm_params(dim * merge**2), name="deepstack_merger",
                                   count=levels))
    return ModuleSpec(name="vision", layers=tuple(layers))


def model_spec(config: Mapping[str, Any], name: str) -> ModelSpec:
    """The ModelSpec of a Qwen3-VL config.json (lm_head tied when the root config says so, as transformers reads it)."""
    text = text_section(config, TEXT_DEFAULTS)
    tied = bool(config.get("tie_word_embeddings"))
    v = encoder_section(config, "vision_config", VISION_DEFAULTS)
    vision = vision_module(v)
    bias = text.get("attention_bias") is True
    llm = llm_module(text, tied, head_dim_key=True, qk_norm=True,
                     layer_params=lambda *dims: decoder_layer_params(*dims, bias=bias))
    inputs = vision_input(v, window=False, image_pixels=IMAGE_PIXELS, video=VIDEO)
    check_vision_language(config, text, vision, llm, inputs)
    levels = len(deepstack_indexes(v, vision.layer("full_block").count))
    decoder_layers = llm.layer("decoder_layer").count
    if levels > decoder_layers:
        raise ValueError(f"{levels} DeepStack levels need at least {levels} decoder layers, the decoder has "
                         f"{decoder_layers}")
    return ModelSpec(name=name, family=MODEL_TYPE, hf_config=copy.deepcopy(dict(config)), vision_input=inputs,
                     modules=(vision, llm), tie_word_embeddings=tied, injection_layers=tuple(range(levels)))


FAMILY = PlannerFamily(model_type=MODEL_TYPE, model_spec=model_spec, encoder="vision", image_pixels=IMAGE_PIXELS,
                       video=VIDEO, configs=qwen3_vl_configs.CONFIGS)
"""The planner's half of the family (planner.contract.families.family)."""
