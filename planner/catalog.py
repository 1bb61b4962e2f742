"""Model catalog: Hugging Face ``config.json`` dicts of supported architectures become ``ModelSpec``s.

Catalog entries and a user's ``config.json`` go through the same ``model_from_hf_config``. Keys a config omits
take the transformers 5.x class defaults (``*_DEFAULTS`` below), as ``from_pretrained`` would. Both layouts are
read: the flat hub layout (decoder keys at the top level) and the nested ``text_config`` layout of transformers 5.
Each parameter formula mirrors one Hugging Face module; ``tests/test_catalog.py`` checks every entry against the
transformers model built on the meta device. This module imports neither torch nor transformers.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

from planner import hf_configs
from planner.models import (
    AttentionSpec,
    AudioInputSpec,
    LayerSpec,
    MlpSpec,
    ModelSpec,
    ModuleSpec,
    VisionInputSpec,
)
from planner.param_counts import (
    embedding_params,
    layer_norm_params,
    lm_head_params,
    patch_embed_params,
    patch_merger_params,
    qwen2_5_vision_block_params,
    qwen2_audio_layer_params,
    qwen2_audio_projector_params,
    qwen2_decoder_layer_params,
    qwen2_vl_vision_block_params,
    rms_norm_params,
    whisper_conv_params,
)

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("qwen2_5_vl", "qwen2_vl", "qwen2_audio")

QWEN2_5_VL_VISION_DEFAULTS: dict[str, Any] = {
    "depth": 32, "hidden_size": 3584, "intermediate_size": 3420, "num_heads": 16, "in_channels": 3,
    "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
    "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31],
}
"""transformers ``Qwen2_5_VLVisionConfig`` defaults."""
QWEN2_VL_VISION_DEFAULTS: dict[str, Any] = {
    "depth": 32, "embed_dim": 1280, "hidden_size": 3584, "mlp_ratio": 4, "num_heads": 16, "in_channels": 3,
    "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
}
"""transformers ``Qwen2VLVisionConfig`` defaults (``hidden_size`` is the merger's output width)."""
QWEN_VL_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8,
}
"""transformers ``Qwen2_5_VLTextConfig`` / ``Qwen2VLTextConfig`` defaults (identical)."""
QWEN2_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32,
}
"""transformers ``Qwen2Config`` defaults (the decoder of Qwen2-Audio)."""
QWEN2_AUDIO_ENCODER_DEFAULTS: dict[str, Any] = {
    "num_mel_bins": 128, "encoder_layers": 32, "encoder_attention_heads": 20, "encoder_ffn_dim": 5120,
    "d_model": 1280, "max_source_positions": 1500,
}
"""transformers ``Qwen2AudioEncoderConfig`` defaults."""

WHISPER_MEL_FRAMES_PER_SECOND = 100
"""Mel frames per second of audio (WhisperFeatureExtractor: 16 kHz, hop length 160)."""
WHISPER_CONV_STRIDE = 2
"""Stride of the encoder's second conv (mel frames per encoder position)."""
QWEN2_AUDIO_POOL_STRIDE = 2
"""Encoder positions per LLM token (``Qwen2AudioEncoder.avg_pooler``, AvgPool1d(2, stride=2))."""
MAX_CONFIG_INTEGER = 2**24
"""Largest width, depth, head count or vocabulary a config.json may give (16,777,216: far beyond any model, small
enough that parameter counts and costs stay exact)."""
TOKEN_ID_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                 "vision_token_id", "bos_token_id", "eos_token_id", "pad_token_id")
"""Special token ids a vision-language config may give: each must index the decoder's vocabulary (the runtime
embeds them)."""


_NUMBER = (int, float)
CONFIG_FIELD_TYPES: dict[str, tuple[type, ...]] = {
    **dict.fromkeys(("model_type", "hidden_act", "activation_function", "transformers_version", "torch_dtype",
                     "dtype"), (str,)),
    **dict.fromkeys(("rms_norm_eps", "initializer_range", "attention_dropout", "rope_theta", "mlp_ratio",
                     "dropout", "activation_dropout", "layerdrop", "init_std"), _NUMBER),
    **dict.fromkeys(("tie_word_embeddings", "use_cache", "use_sliding_window", "scale_embedding"), (bool,)),
    **dict.fromkeys(("max_position_embeddings", "sliding_window", "max_window_layers", "tokens_per_second",
                     "in_chans", "spatial_patch_size", "audio_token_index"), (int,)),
    **dict.fromkeys(("architectures", "fullatt_block_indexes", "layer_types"), (list,)),
    **dict.fromkeys(("rope_parameters", "rope_scaling"), (dict,)),
}
"""JSON types of the config keys transformers' strict config classes type-check, besides the widths, depths and
token ids the modules are built from (``_positive_int``): a config whose value has another type (null counts as
one where the key is present) plans nothing, since the runtime could not build it. A number key takes an int or a
float; an int key no bool."""
ACTIVATIONS = ("gelu", "gelu_10", "gelu_accurate", "gelu_fast", "gelu_new", "gelu_python", "gelu_python_tanh",
               "gelu_pytorch_tanh", "hardswish", "laplace", "leaky_relu", "linear", "mish", "prelu", "quick_gelu",
               "relu", "relu2", "relu6", "sigmoid", "silu", "sqrtsoftplus", "swish", "tanh", "xielu")
"""``hidden_act`` names transformers knows (``transformers.activations.ACT2CLS``, 5.x); another fails the build."""
NULLABLE_KEYS = ("sliding_window", "max_window_layers", "use_sliding_window", "rope_scaling", "rope_parameters",
                 "layer_types", "architectures", "torch_dtype", "dtype", "transformers_version")
"""Keys transformers also accepts as null."""


def check_field_types(section: Mapping[str, Any], where: str) -> None:
    """Raise a one-line ValueError naming the first key of ``section`` whose value has a type other than its
    ``CONFIG_FIELD_TYPES``, a non-finite number, or an unknown ``hidden_act``."""
    for key, value in section.items():
        allowed = CONFIG_FIELD_TYPES.get(key)
        if allowed is None or (value is None and key in NULLABLE_KEYS):
            continue
        wrong = not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed)
        if not wrong and isinstance(value, float) and not math.isfinite(value):
            wrong = True
        if wrong:
            expected = {(str,): "a string", _NUMBER: "a finite number", (bool,): "true or false",
                        (int,): "an integer", (list,): "a list", (dict,): "an object"}[allowed]
            raise ValueError(f"{where}.{key} must be {expected}, got {json.dumps(value)}")
        if key == "hidden_act" and value not in ACTIVATIONS:
            raise ValueError(f"{where}.hidden_act {value!r} is not an activation transformers knows "
                             f"({', '.join(ACTIVATIONS)})")


# --- Config sections --------------------------------------------------------------------------------------------


def _with_defaults(section: Any, defaults: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``section`` with the transformers defaults for the keys it omits, its own keys type-checked."""
    if not isinstance(section, Mapping):
        raise ValueError(f"{where} must be a JSON object, got {type(section).__name__}")
    check_field_types(section, where)
    return {**defaults, **section}


def _section(config: Mapping[str, Any], key: str, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The nested sub-config ``config[key]``, defaults filled in."""
    return _with_defaults(config.get(key) or {}, defaults, key)


def _encoder_section(config: Mapping[str, Any], key: str, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """An encoder's sub-config, which every hub config of the family has: a file without it is most likely not the
    model's own config.json, so it is refused rather than read as the transformers defaults."""
    if key not in config:
        raise ValueError(f"no {key}: a {config.get('model_type')} config.json describes its encoder there (copy the "
                         f"model's config.json from its hub repository)")
    return _section(config, key, defaults)


def _text_section(config: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """The decoder's settings: nested ``text_config`` (transformers 5) or the flat top level (hub files)."""
    return _with_defaults(config.get("text_config") or config, defaults, "text_config")


def _positive_int(section: Mapping[str, Any], key: str, where: str) -> int:
    """``section[key]`` as a positive int, or a one-line error naming the field."""
    value = section.get(key)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{where}.{key} must be a positive integer, got {value!r}")
    if value > MAX_CONFIG_INTEGER:
        raise ValueError(f"{where}.{key} = {value:,} is above {MAX_CONFIG_INTEGER:,}, the most any model has")
    return value


def _ints(section: Mapping[str, Any], keys: str, where: str) -> list[int]:
    """Several positive ints from a whitespace-separated key list."""
    return [_positive_int(section, key, where) for key in keys.split()]


def _heads_divide(width: int, heads: int, where: str) -> int:
    """Head width ``width // heads``; transformers rejects widths that heads do not divide."""
    if width % heads:
        raise ValueError(f"{where}: hidden size {width} is not divisible by {heads} attention heads")
    return width // heads


# --- Modules ----------------------------------------------------------------------------------------------------


def _patch_embed_layer(v: Mapping[str, Any], dim: int) -> LayerSpec:
    """The Conv3d patchifier; ``v`` is a vision section."""
    channels = _positive_int(v, "in_channels", "vision_config")
    temporal, patch = _ints(v, "temporal_patch_size patch_size", "vision_config")
    return LayerSpec(
        kind="patch_embed", name="patch_embed", count=1, params=patch_embed_params(channels, temporal, patch, dim),
        hidden_size=dim, in_features=channels * temporal * patch**2,
    )


def _merger_layer(dim: int, out_dim: int, merge: int, norm_params: int) -> LayerSpec:
    """The spatial merge + MLP into the LLM width."""
    return LayerSpec(
        kind="patch_merger", name="patch_merger", count=1,
        params=patch_merger_params(dim, out_dim, merge, norm_params),
        hidden_size=dim, in_features=dim * merge**2, out_features=out_dim, token_reduction=merge**2,
    )


def _full_attention_blocks(v: Mapping[str, Any], depth: int) -> set[int]:
    """Indexes of the full-attention blocks (``fullatt_block_indexes`` beyond the depth are ignored, as in HF)."""
    indexes = v["fullatt_block_indexes"]
    if not isinstance(indexes, (list, tuple)) or not all(isinstance(i, int) for i in indexes):
        raise ValueError(f"vision_config.fullatt_block_indexes must be a list of integers, got {indexes!r}")
    return {i for i in indexes if 0 <= i < depth}


def qwen2_5_vision_module(v: Mapping[str, Any]) -> ModuleSpec:
    """Qwen2.5-VL vision tower: patch embed, window- and full-attention blocks, merger."""
    depth, dim, inter, heads, merge, out_dim, patch, window = _ints(
        v, "depth hidden_size intermediate_size num_heads spatial_merge_size out_hidden_size patch_size window_size",
        "vision_config",
    )
    num_full = len(_full_attention_blocks(v, depth))
    head_dim = _heads_divide(dim, heads, "vision_config")
    block = dict(kind="vision_block", params=qwen2_5_vision_block_params(dim, inter), hidden_size=dim,
                 mlp=MlpSpec(intermediate_size=inter, gated=True))
    window_side = window // merge // patch * merge  # in patches, whole merge units (vit_merger_window_size)
    windowed = AttentionSpec(num_heads=heads, num_kv_heads=heads, head_dim=head_dim, causal=False,
                             window_patches=window_side**2)
    blocks = [
        LayerSpec(name="window_block", count=depth - num_full, attention=windowed, **block),
        LayerSpec(name="full_block", count=num_full, attention=AttentionSpec(
            num_heads=heads, num_kv_heads=heads, head_dim=head_dim, causal=False), **block),
    ]
    layers = [_patch_embed_layer(v, dim), *(b for b in blocks if b.count), _merger_layer(dim, out_dim, merge, dim)]
    return ModuleSpec(name="vision", layers=tuple(layers))


def qwen2_vl_vision_module(v: Mapping[str, Any]) -> ModuleSpec:
    """Qwen2-VL vision tower: patch embed, full-attention LayerNorm/GELU blocks, merger."""
    depth, dim, heads, merge, out_dim = _ints(v, "depth embed_dim num_heads spatial_merge_size hidden_size",
                                              "vision_config")
    ratio = v["mlp_ratio"]
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or ratio <= 0:
        raise ValueError(f"vision_config.mlp_ratio must be a positive number, got {ratio!r}")
    mlp_hidden = int(dim * ratio)
    attention = AttentionSpec(num_heads=heads, num_kv_heads=heads, head_dim=_heads_divide(dim, heads, "vision_config"),
                              causal=False)
    block = LayerSpec(
        kind="vision_block", name="full_block", count=depth, params=qwen2_vl_vision_block_params(dim, mlp_hidden),
        hidden_size=dim, attention=attention, mlp=MlpSpec(intermediate_size=mlp_hidden, gated=False),
    )
    merger = _merger_layer(dim, out_dim, merge, layer_norm_params(dim))
    return ModuleSpec(name="vision", layers=(_patch_embed_layer(v, dim), block, merger))


def qwen2_audio_module(a: Mapping[str, Any], llm_hidden: int) -> ModuleSpec:
    """Qwen2-Audio's Whisper-style encoder: conv front end, encoder layers, final norm + pooling + projector."""
    mels, layers, heads, ffn, dim, positions = _ints(
        a, "num_mel_bins encoder_layers encoder_attention_heads encoder_ffn_dim d_model max_source_positions",
        "audio_config",
    )
    attention = AttentionSpec(num_heads=heads, num_kv_heads=heads, head_dim=_heads_divide(dim, heads, "audio_config"),
                              causal=False)
    return ModuleSpec(name="audio", layers=(
        LayerSpec(kind="audio_conv", name="audio_conv", count=1, params=whisper_conv_params(mels, dim, positions),
                  hidden_size=dim, in_features=mels, token_reduction=WHISPER_CONV_STRIDE),
        LayerSpec(kind="audio_block", name="audio_block", count=layers, params=qwen2_audio_layer_params(dim, ffn),
                  hidden_size=dim, attention=attention, mlp=MlpSpec(intermediate_size=ffn, gated=False)),
        LayerSpec(kind="audio_projector", name="audio_projector", count=1,
                  params=qwen2_audio_projector_params(dim, llm_hidden), hidden_size=dim, out_features=llm_hidden,
                  token_reduction=QWEN2_AUDIO_POOL_STRIDE),
    ))


def llm_module(t: Mapping[str, Any], tied: bool, head_dim_key: bool) -> ModuleSpec:
    """The GQA + SwiGLU decoder: embedding, decoder layers, final RMSNorm, lm_head.

    ``head_dim_key``: whether the architecture honours a ``head_dim`` key (Qwen2) or always uses hidden/heads.
    """
    vocab, hidden, inter, layers, heads = _ints(
        t, "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads", "text_config"
    )
    kv_heads = heads if t.get("num_key_value_heads") is None else _positive_int(t, "num_key_value_heads", "text_config")
    if heads % kv_heads:
        raise ValueError(f"text_config: {heads} attention heads are not a multiple of {kv_heads} key/value heads")
    if head_dim_key and t.get("head_dim") is not None:
        head_dim = _positive_int(t, "head_dim", "text_config")
    else:
        head_dim = _heads_divide(hidden, heads, "text_config")
    attention = AttentionSpec(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, causal=True)
    return ModuleSpec(name="llm", layers=(
        LayerSpec(kind="embedding", name="embedding", count=1, params=embedding_params(vocab, hidden),
                  hidden_size=hidden),
        LayerSpec(kind="decoder_layer", name="decoder_layer", count=layers,
                  params=qwen2_decoder_layer_params(hidden, heads, kv_heads, head_dim, inter), hidden_size=hidden,
                  attention=attention, mlp=MlpSpec(intermediate_size=inter, gated=True)),
        LayerSpec(kind="final_norm", name="final_norm", count=1, params=rms_norm_params(hidden), hidden_size=hidden),
        LayerSpec(kind="lm_head", name="lm_head", count=1, params=lm_head_params(hidden, vocab, tied),
                  hidden_size=hidden, out_features=vocab),
    ))


# --- Config -> ModelSpec ----------------------------------------------------------------------------------------


def _vision_input(v: Mapping[str, Any], window: bool) -> VisionInputSpec:
    """How images become patches, from a (defaults-filled) vision section."""
    patch, temporal, merge = _ints(v, "patch_size temporal_patch_size spatial_merge_size", "vision_config")
    window_size = _positive_int(v, "window_size", "vision_config") if window else None
    return VisionInputSpec(patch_size=patch, temporal_patch_size=temporal, spatial_merge_size=merge,
                           window_size=window_size)


def _check_runnable(config: Mapping[str, Any], text: Mapping[str, Any], vision: ModuleSpec, llm: ModuleSpec,
                    vision_input: VisionInputSpec) -> None:
    """What transformers' Qwen-VL modules need beyond each field being valid alone (the runtime builds them):
    the merger's output width is the decoder's, rotary head widths are even (the vision tower's a multiple of 4: its
    2-D rotary splits half the head between rows and columns) and M-RoPE's sections cover half the decoder's head
    width, a window holds at least one merge unit, and the special token ids index the vocabulary."""
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
    head_dim = llm.layer("decoder_layer").attention.head_dim
    if sections is not None and (not isinstance(sections, list) or len(sections) != 3
                                 or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in sections)
                                 or sum(sections) != head_dim // 2):
        raise ValueError(f"mrope_section must be three positive integers summing to half the decoder's head width "
                         f"({head_dim // 2}), got {sections!r}")
    unit = vision_input.patch_size * vision_input.spatial_merge_size
    if vision_input.window_size is not None and vision_input.window_size < unit:
        raise ValueError(f"vision_config.window_size {vision_input.window_size} is smaller than one merge unit "
                         f"(patch_size x spatial_merge_size = {unit} pixels)")
    vocab = _positive_int(text, "vocab_size", "text_config")
    for key in TOKEN_ID_KEYS:
        for section in (config, text):
            value = section.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab):
                raise ValueError(f"{key} {value!r} is not a token id of the {vocab:,}-entry vocabulary")


def _vision_language_spec(config: Mapping[str, Any], name: str, family: str) -> ModelSpec:
    """Qwen2.5-VL or Qwen2-VL: vision tower + decoder (tied when the root or text_config says so)."""
    text = _text_section(config, QWEN_VL_TEXT_DEFAULTS)
    tied = bool(config.get("tie_word_embeddings") or text.get("tie_word_embeddings"))
    if family == "qwen2_5_vl":
        v = _encoder_section(config, "vision_config", QWEN2_5_VL_VISION_DEFAULTS)
        vision, vision_input = qwen2_5_vision_module(v), _vision_input(v, window=True)
    else:
        v = _encoder_section(config, "vision_config", QWEN2_VL_VISION_DEFAULTS)
        vision, vision_input = qwen2_vl_vision_module(v), _vision_input(v, window=False)
    llm = llm_module(text, tied, head_dim_key=False)
    _check_runnable(config, text, vision, llm, vision_input)
    return ModelSpec(
        name=name, family=family, hf_config=copy.deepcopy(dict(config)), vision_input=vision_input,
        modules=(vision, llm), tie_word_embeddings=tied,
    )


def _audio_language_spec(config: Mapping[str, Any], name: str) -> ModelSpec:
    """Qwen2-Audio: audio encoder + Qwen2 decoder (transformers never ties its lm_head)."""
    text = _section(config, "text_config", QWEN2_TEXT_DEFAULTS)
    audio = _encoder_section(config, "audio_config", QWEN2_AUDIO_ENCODER_DEFAULTS)
    llm = llm_module(text, tied=False, head_dim_key=True)
    tokens_per_second = WHISPER_MEL_FRAMES_PER_SECOND // WHISPER_CONV_STRIDE
    positions = _positive_int(audio, "max_source_positions", "audio_config")
    audio_input = AudioInputSpec(encoder_tokens_per_second=tokens_per_second, pool_stride=QWEN2_AUDIO_POOL_STRIDE,
                                 max_seconds=positions // tokens_per_second)
    return ModelSpec(
        name=name, family="qwen2_audio", hf_config=copy.deepcopy(dict(config)), audio_input=audio_input,
        modules=(qwen2_audio_module(audio, llm.layer("embedding").hidden_size), llm),
    )


def model_from_hf_config(config: Mapping[str, Any], name: str) -> ModelSpec:
    """Build the ModelSpec of any supported Hugging Face ``config.json`` dict.

    Args:
        config: the parsed ``config.json`` (flat hub layout or nested transformers-5 layout).
        name: the name the spec carries (catalog name, or one derived from the file's path).

    Raises:
        ValueError: unsupported ``model_type`` or an invalid field, in one line.
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"a model config must be a JSON object, got {type(config).__name__}")
    check_field_types(config, "config")
    family = config.get("model_type")
    if family in ("qwen2_5_vl", "qwen2_vl"):
        return _vision_language_spec(config, name, family)
    if family == "qwen2_audio":
        return _audio_language_spec(config, name)
    raise ValueError(f"unsupported model_type {family!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")


# --- Catalog ----------------------------------------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class CatalogEntry:
    """One named model of the catalog."""

    config: Mapping[str, Any]
    """Its Hugging Face config.json contents."""
    aliases: tuple[str, ...]
    """Other names it answers to (matched case-insensitively)."""
    description: str
    """One line for ``plan --list-models``."""


def _entry(name: str, config: Mapping[str, Any], description: str, *aliases: str) -> tuple[str, CatalogEntry]:
    """A catalog item; each hub id ``Qwen/X`` among ``aliases`` also adds its bare lower-cased ``x``."""
    expanded = [a for alias in aliases for a in ((alias.split("/")[1].lower(), alias) if "/" in alias else (alias,))]
    unique = tuple(dict.fromkeys(a for a in expanded if a.lower() != name))
    return name, CatalogEntry(config=config, aliases=unique, description=description)


CATALOG: dict[str, CatalogEntry] = dict([
    _entry("qwen2.5-vl-3b", hf_configs.QWEN2_5_VL_3B, "Qwen2.5-VL 3B Instruct (tied embeddings)",
           "Qwen/Qwen2.5-VL-3B-Instruct", "qwen-vl-3b"),
    _entry("qwen2.5-vl-7b", hf_configs.QWEN2_5_VL_7B, "Qwen2.5-VL 7B Instruct",
           "Qwen/Qwen2.5-VL-7B-Instruct", "qwen-vl-7b"),
    _entry("qwen2.5-vl-32b", hf_configs.QWEN2_5_VL_32B, "Qwen2.5-VL 32B Instruct",
           "Qwen/Qwen2.5-VL-32B-Instruct", "qwen-vl-32b"),
    _entry("qwen2.5-vl-72b", hf_configs.QWEN2_5_VL_72B, "Qwen2.5-VL 72B Instruct",
           "Qwen/Qwen2.5-VL-72B-Instruct", "qwen-vl-72b"),
    _entry("qwen2-vl-2b", hf_configs.QWEN2_VL_2B, "Qwen2-VL 2B Instruct (tied embeddings, no window attention)",
           "Qwen/Qwen2-VL-2B-Instruct"),
    _entry("qwen2-vl-7b", hf_configs.QWEN2_VL_7B, "Qwen2-VL 7B Instruct (no window attention)",
           "Qwen/Qwen2-VL-7B-Instruct"),
    _entry("qwen2-vl-72b", hf_configs.QWEN2_VL_72B, "Qwen2-VL 72B Instruct (no window attention)",
           "Qwen/Qwen2-VL-72B-Instruct"),
    _entry("qwen2-audio-7b", hf_configs.QWEN2_AUDIO_7B, "Qwen2-Audio 7B: Whisper-style audio encoder + Qwen 7B decoder",
           "Qwen/Qwen2-Audio-7B", "Qwen/Qwen2-Audio-7B-Instruct", "qwen-audio-7b"),
    _entry("qwen2.5-vl-tiny", hf_configs.QWEN2_5_VL_TINY, "Toy Qwen2.5-VL for CPU tests and demos (~1.2M params)",
           "qwen-vl-tiny", "tiny"),
])
"""Catalog name -> entry."""

_BY_NAME: dict[str, str] = {
    key.lower(): name for name, entry in CATALOG.items() for key in (name, *entry.aliases)
}
"""Lower-cased name or alias -> catalog name."""


def _load_config_file(path: str) -> tuple[dict[str, Any], str]:
    """Parse ``path`` (a config.json or a folder holding one); also returns the name the model is given."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read model config {file}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"model config {file} is not valid JSON: {e}") from None
    folder = os.path.basename(os.path.dirname(os.path.abspath(file)))
    return config, folder or os.path.splitext(os.path.basename(file))[0]


def _unknown_model(name: str) -> ValueError:
    """One-line error with the closest catalog names."""
    close = difflib.get_close_matches(name.lower(), list(_BY_NAME), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    return ValueError(
        f"unknown model {name!r}; {hint}(`plan --list-models` lists all; a path to a config.json also works)"
    )


def get_model(name_or_path: str) -> ModelSpec:
    """The ModelSpec of a catalog name or alias, or of a config.json file (or a folder holding one).

    Raises:
        ValueError: unknown name (with suggestions), unreadable file or unsupported config, in one line.
    """
    name = _BY_NAME.get(name_or_path.strip().lower())
    if name is not None:
        return model_from_hf_config(CATALOG[name].config, name)
    if os.path.exists(name_or_path) or name_or_path.endswith(".json"):
        config, derived_name = _load_config_file(name_or_path)
        try:
            return model_from_hf_config(config, derived_name)
        except ValueError as e:
            raise ValueError(f"{name_or_path}: {e}") from None
    raise _unknown_model(name_or_path)


def list_models() -> list[tuple[str, tuple[str, ...], int, str]]:
    """(name, aliases, exact parameter count, description) of every catalog entry."""
    return [
        (name, entry.aliases, model_from_hf_config(entry.config, name).num_params, entry.description)
        for name, entry in CATALOG.items()
    ]
