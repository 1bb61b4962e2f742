"""Layers and checks the Qwen families share: the Conv3d patchifier, the patch merger, the GQA decoder, and what
transformers' Qwen vision-language classes need of a config beyond each field being valid alone."""

from __future__ import annotations

import copy
from typing import Any, Callable, Mapping

from planner.contract.families.fields import TOKEN_ID_KEYS, encoder_section, heads_divide, ints, positive_int, text_section
from planner.contract.models import AttentionSpec, LayerSpec, MlpSpec, ModelSpec, ModuleSpec, VideoInputSpec, VisionInputSpec
from planner.contract.param_counts import (
    embedding_params,
    lm_head_params,
    patch_embed_params,
    patch_merger_params,
    qwen2_decoder_layer_params,
    rms_norm_params,
)

QWEN_VL_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8,
}
"""transformers ``Qwen2_5_VLTextConfig`` / ``Qwen2VLTextConfig`` defaults (identical)."""
QWEN2_VL_IMAGE_PIXELS = (56 * 56, 28 * 28 * 16384)
"""(min_pixels, max_pixels) of Qwen2-VL's and Qwen2.5-VL's preprocessor_config.json (3,136 and 12,845,056)."""
QWEN2_VL_VIDEO = VideoInputSpec(min_pixels=128 * 28 * 28, max_pixels=768 * 28 * 28, pixels_per_clip=False,
                                group_text_tokens=0, clip_text_tokens=2, min_frames=4, max_frames=768,
                                samples_whole_temporal_patches=True)
"""Qwen2-VL's and Qwen2.5-VL's video processor (``Qwen2VLVideoProcessor.size``: 100,352 to 602,112 pixels per
frame; ``sample_frames``: 4 to 768 frames, whole temporal patches); the prompt puts one vision start/end pair around
the clip."""


def patch_embed_layer(v: Mapping[str, Any], dim: int, bias: bool = False) -> LayerSpec:
    """The Conv3d patchifier; ``v`` is a vision section; ``bias``: whether the conv has one (Qwen3-VL)."""
    channels = positive_int(v, "in_channels", "vision_config")
    temporal, patch = ints(v, "temporal_patch_size patch_size", "vision_config")
    return LayerSpec(
        kind="patch_embed", name="patch_embed", count=1,
        params=patch_embed_params(channels, temporal, patch, dim) + (dim if bias else 0),
        hidden_size=dim, in_features=channels * temporal * patch**2,
    )


def merger_layer(dim: int, out_dim: int, merge: int, norm_params: int, *, name: str = "patch_merger",
                 count: int = 1) -> LayerSpec:
    """The spatial merge + MLP into the LLM width (``count`` alike ones called ``name``)."""
    return LayerSpec(
        kind="patch_merger", name=name, count=count,
        params=patch_merger_params(dim, out_dim, merge, norm_params),
        hidden_size=dim, in_features=dim * merge**2, out_features=out_dim, token_reduction=merge**2,
    )


def llm_module(t: Mapping[str, Any], tied: bool, *, head_dim_key: bool, layer_params: Any = None,
               qk_norm: bool = False) -> ModuleSpec:
    """The GQA + SwiGLU decoder: embedding, decoder layers, final RMSNorm, lm_head.

    ``head_dim_key``: whether the architecture honours a ``head_dim`` key (Qwen2, Qwen3) or always uses
    hidden/heads. ``layer_params(hidden, heads, kv_heads, head_dim, intermediate)``: one decoder layer's parameters
    (default ``qwen2_decoder_layer_params``). ``qk_norm``: Qwen3's per-head q / k norms (``AttentionSpec.qk_norm``).
    """
    vocab, hidden, inter, layers, heads = ints(
        t, "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads", "text_config"
    )
    kv_heads = heads if t.get("num_key_value_heads") is None else positive_int(t, "num_key_value_heads", "text_config")
    if heads % kv_heads:
        raise ValueError(f"text_config: {heads} attention heads are not a multiple of {kv_heads} key/value heads")
    if head_dim_key and t.get("head_dim") is not None:
        head_dim = positive_int(t, "head_dim", "text_config")
    else:
        head_dim = heads_divide(hidden, heads, "text_config")
    attention = AttentionSpec(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, causal=True, qk_norm=qk_norm)
    params = (layer_params or qwen2_decoder_layer_params)(hidden, heads, kv_heads, head_dim, inter)
    return ModuleSpec(name="llm", layers=(
        LayerSpec(kind="embedding", name="embedding", count=1, params=embedding_params(vocab, hidden),
                  hidden_size=hidden),
        LayerSpec(kind="decoder_layer", name="decoder_layer", count=layers, params=params, hidden_size=hidden,
                  attention=attention, mlp=MlpSpec(intermediate_size=inter, gated=True)),
        LayerSpec(kind="final_norm", name="final_norm", count=1, params=rms_norm_params(hidden), hidden_size=hidden),
        LayerSpec(kind="lm_head", name="lm_head", count=1, params=lm_head_params(hidden, vocab, tied),
                  hidden_size=hidden, out_features=vocab),
    ))


def vision_input(v: Mapping[str, Any], *, window: bool, image_pixels: tuple[int, int],
                 video: VideoInputSpec) -> VisionInputSpec:
    """How images and clips become patches, from a (defaults-filled) vision section and the processor's bounds."""
    patch, temporal, merge = ints(v, "patch_size temporal_patch_size spatial_merge_size", "vision_config")
    window_size = positive_int(v, "window_size", "vision_config") if window else None
    return VisionInputSpec(patch_size=patch, temporal_patch_size=temporal, spatial_merge_size=merge,
                           window_size=window_size, min_pixels=image_pixels[0], max_pixels=image_pixels[1],
                           video=video)


def check_vision_language(config: Mapping[str, Any], text: Mapping[str, Any], vision: ModuleSpec, llm: ModuleSpec,
                          vision_input: VisionInputSpec, *, rotary_fraction: float = 1.0) -> None:
    """What transformers' Qwen-VL modules need beyond each field being valid alone (the runtime builds them):
    the merger's output width is the decoder's, rotary head widths are even (the vision tower's a multiple of 4: its
    2-D rotary splits half the head between rows and columns) and M-RoPE's sections cover half the decoder's rotary
    width (``rotary_fraction`` of its head: Qwen3.5 turns a quarter), a window holds at least one merge unit, and the special token ids index the vocabulary."""
    merger, embedding = vision.layer("patch_merger"), llm.layer("embedding")
    if merger.out_features != embedding.hidden_size:
        raise ValueError(f"vision_config's merger outputs {merger.out_features} features but the decoder's "
                         f"hidden_size is {embedding.hidden_size}: they must be equal")
    for spec, where, multiple in ((vision, "vision_config", 4), (llm, "text_config", 2)):
        head_dim = next(layer.attention.head_dim for layer in spec.layers if layer.attention is not None)
        if head_dim % multiple:
            raise ValueError(f"{where}: head width {head_dim} is not a multiple of {multiple}, which its rotary "
                             f"embedding needs")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or config.get("rope_scaling") or {}
    sections = rope.get("mrope_section") if isinstance(rope, Mapping) else None
    rotary_dim = int(llm.layer("decoder_layer").attention.head_dim * rotary_fraction)
    if sections is not None and (not isinstance(sections, list) or len(sections) != 3
                                 or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in sections)
                                 or sum(sections) != rotary_dim // 2):
        raise ValueError(f"mrope_section must be three positive integers summing to half the decoder's rotary width "
                         f"({rotary_dim // 2}), got {sections!r}")
    unit = vision_input.patch_size * vision_input.spatial_merge_size
    if vision_input.window_size is not None and vision_input.window_size < unit:
        raise ValueError(f"vision_config.window_size {vision_input.window_size} is smaller than one merge unit "
                         f"(patch_size x spatial_merge_size = {unit} pixels)")
    vocab = positive_int(text, "vocab_size", "text_config")
    for key in TOKEN_ID_KEYS:
        for section in (config, text):
            value = section.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab):
                raise ValueError(f"{key} {value!r} is not a token id of the {vocab:,}-entry vocabulary")


def qwen2_vl_style_spec(config: Mapping[str, Any], name: str, *, model_type: str, vision_defaults: Mapping[str, Any],
                        vision_module: Callable[[Mapping[str, Any]], ModuleSpec], window: bool) -> ModelSpec:
    """The ModelSpec of a Qwen2-VL or Qwen2.5-VL config.json: its vision tower (``vision_module``), the Qwen2 decoder
    (lm_head tied when the root or text_config says so), the processors' bounds, one merged tensor handed over."""
    text = text_section(config, QWEN_VL_TEXT_DEFAULTS)
    tied = bool(config.get("tie_word_embeddings") or text.get("tie_word_embeddings"))
    v = encoder_section(config, "vision_config", vision_defaults)
    vision = vision_module(v)
    inputs = vision_input(v, window=window, image_pixels=QWEN2_VL_IMAGE_PIXELS, video=QWEN2_VL_VIDEO)
    llm = llm_module(text, tied, head_dim_key=False)
    check_vision_language(config, text, vision, llm, inputs)
    return ModelSpec(name=name, family=model_type, hf_config=copy.deepcopy(dict(config)), vision_input=inputs,
                     modules=(vision, llm), tie_word_embeddings=tied)
