"""The Qwen2-Audio checkpoints the catalog offers: their Hugging Face ``config.json`` as Python dicts, by catalog
name (``CONFIGS``).

Values are copied from the base checkpoint's hub repository. Keys the hub file omits are left out on purpose: the
adapter fills them with the transformers defaults, exactly as ``from_pretrained`` does.
"""

from __future__ import annotations

from typing import Any


# Qwen/Qwen2-Audio-7B (the decoder's width, depth and heads are the Qwen2Config defaults: 4096, 32, 32 MHA)
QWEN2_AUDIO_7B: dict[str, Any] = {
    "architectures": ["Qwen2AudioForConditionalGeneration"],
    "audio_config": {
        "model_type": "qwen2_audio_encoder",
        "num_mel_bins": 128,
        "encoder_layers": 32,
        "encoder_attention_heads": 20,
        "encoder_ffn_dim": 5120,
        "d_model": 1280,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "activation_function": "gelu",
        "activation_dropout": 0.0,
        "scale_embedding": False,
        "init_std": 0.02,
        "max_source_positions": 1500,
    },
    "audio_token_index": 151646,
    "ignore_index": -100,
    "model_type": "qwen2_audio",
    "text_config": {
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "intermediate_size": 11008,
        "max_position_embeddings": 8192,
        "model_type": "qwen2",
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000,
        "sliding_window": 32768,
        "torch_dtype": "bfloat16",
        "use_mrope": False,
        "vocab_size": 156032,
    },
    "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0",
    "vocab_size": 156032,
}

# Not a hub model: the Qwen2-Audio structure (Whisper-style encoder, 2x pooling, linear projector, Qwen2 decoder) at
# toy width for CPU tests and demos: clips of 1 s (50 encoder positions -> 25 audio tokens), 16 mel bins. Its
# <|AUDIO|>, <|audio_bos|>, <|audio_eos|> ids (1001-1003) sit inside its small vocabulary, in the hub model's order.
QWEN2_AUDIO_TINY: dict[str, Any] = {
    "architectures": ["Qwen2AudioForConditionalGeneration"],
    "model_type": "qwen2_audio",
    "audio_token_index": 1001,
    "audio_config": {
        "model_type": "qwen2_audio_encoder",
        "num_mel_bins": 16,
        "encoder_layers": 2,
        "encoder_attention_heads": 4,
        "encoder_ffn_dim": 128,
        "d_model": 64,
        "max_source_positions": 50,
    },
    "text_config": {
        "model_type": "qwen2",
        "vocab_size": 1024,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "bos_token_id": 1005,
        "eos_token_id": 1006,
        "pad_token_id": 1007,
    },
}

CONFIGS = {"qwen2-audio-7b": QWEN2_AUDIO_7B, "qwen2-audio-tiny": QWEN2_AUDIO_TINY}
"""Catalog name -> config.json."""
