"""Qwen2-Audio (transformers ``Qwen2AudioForConditionalGeneration``): a Whisper-style audio encoder, pooled 2x and
projected into a Qwen2 decoder (transformers never ties its lm_head)."""

from __future__ import annotations

import copy
from typing import Any, Mapping

from planner.contract.families import qwen2_audio_configs
from planner.contract.families.family import PlannerFamily
from planner.contract.families.fields import encoder_section, heads_divide, ints, positive_int, sub_config
from planner.contract.families.qwen_parts import llm_module
from planner.contract.models import AttentionSpec, AudioInputSpec, LayerSpec, MlpSpec, ModelSpec, ModuleSpec
from planner.contract.param_counts import qwen2_audio_layer_params, qwen2_audio_projector_params, whisper_conv_params

MODEL_TYPE = "qwen2_audio"
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32,
}
"""transformers ``Qwen2Config`` defaults (the decoder of Qwen2-Audio)."""
ENCODER_DEFAULTS: dict[str, Any] = {
    "num_mel_bins": 128, "encoder_layers": 32, "encoder_attention_heads": 20, "encoder_ffn_dim": 5120,
    "d_model": 1280, "max_source_positions": 1500,
}
"""transformers ``Qwen2AudioEncoderConfig`` defaults."""
WHISPER_MEL_FRAMES_PER_SECOND = 100
"""Mel frames per second of audio (WhisperFeatureExtractor: 16 kHz, hop length 160)."""
WHISPER_CONV_STRIDE = 2
"""Stride of the encoder's second conv (mel frames per encoder position)."""
POOL_STRIDE = 2
"""Encoder positions per LLM token (``Qwen2AudioEncoder.avg_pooler``, AvgPool1d(2, stride=2))."""


def audio_module(a: Mapping[str, Any], llm_hidden: int) -> ModuleSpec:
    """The Whisper-style encoder: conv front end, encoder layers, final norm + pooling + projector."""
    mels, layers, heads, ffn, dim, positions = ints(
        a, "num_mel_bins encoder_layers encoder_attention_heads encoder_ffn_dim d_model max_source_positions",
        "audio_config",
    )
    attention = AttentionSpec(num_heads=heads, num_kv_heads=heads, head_dim=heads_divide(dim, heads, "audio_config"),
                              causal=False)
    return ModuleSpec(name="audio", layers=(
        LayerSpec(kind="audio_conv", name="audio_conv", count=1, params=whisper_conv_params(mels, dim, positions),
                  hidden_size=dim, in_features=mels, token_reduction=WHISPER_CONV_STRIDE),
        LayerSpec(kind="audio_block", name="audio_block", count=layers, params=qwen2_audio_layer_params(dim, ffn),
                  hidden_size=dim, attention=attention, mlp=MlpSpec(intermediate_size=ffn, gated=False)),
        LayerSpec(kind="audio_projector", name="audio_projector", count=1,
                  params=qwen2_audio_projector_params(dim, llm_hidden), hidden_size=dim, out_features=llm_hidden,
                  token_reduction=POOL_STRIDE),
    ))


def model_spec(config: Mapping[str, Any], name: str) -> ModelSpec:
    """The ModelSpec of a Qwen2-Audio config.json."""
    text = sub_config(config, "text_config", TEXT_DEFAULTS)
    audio = encoder_section(config, "audio_config", ENCODER_DEFAULTS)
    llm = llm_module(text, tied=False, head_dim_key=True)
    tokens_per_second = WHISPER_MEL_FRAMES_PER_SECOND // WHISPER_CONV_STRIDE
    positions = positive_int(audio, "max_source_positions", "audio_config")
    audio_input = AudioInputSpec(encoder_tokens_per_second=tokens_per_second, pool_stride=POOL_STRIDE,
                                 max_seconds=positions // tokens_per_second, conv_stride=WHISPER_CONV_STRIDE)
    return ModelSpec(
        name=name, family=MODEL_TYPE, hf_config=copy.deepcopy(dict(config)), audio_input=audio_input,
        modules=(audio_module(audio, llm.layer("embedding").hidden_size), llm),
    )


FAMILY = PlannerFamily(model_type=MODEL_TYPE, model_spec=model_spec, encoder="audio", image_pixels=None, video=None,
                       configs=qwen2_audio_configs.CONFIGS)
"""The planner's half of the family (planner.contract.families.family)."""
