"""The Qwen3.5 / Qwen3.6 dense checkpoints the catalog offers: their Hugging Face ``config.json`` as Python dicts, by
catalog name (``CONFIGS``).

Sources (transformers 5.25's own classes, ``transformers/models/qwen3_5/configuration_qwen3_5.py``, give the field
names and the defaults the adapter fills in):

- **Qwen/Qwen3.6-27B** (https://huggingface.co/Qwen/Qwen3.6-27B/blob/main/config.json): the dict below is that file,
  key for key, as a public model-inspection report on GitHub reproduces it beside the checkpoint's safetensors
  listing (15 shards, 1,199 tensors, **27,781,427,952 parameters**, of which the ``mtp.*`` multi-token-prediction
  layer holds 424,699,392); http://www.eadst.com/blog/325 quotes the same file (64 layers, 48 linear + 16 full
  attention, ``max_position_embeddings`` 262144, ``model.safetensors.index.json`` total_size 55.56 GB in bf16).
  Only ``layer_types`` is written as the expression that yields the file's 64 entries.
- **Qwen/Qwen3.5-27B**: the same architecture and widths (hidden 5120, 64 layers, 24 query / 4 KV heads of 256,
  intermediate 17408, linear attention 16 key / 48 value heads of 128, one MTP layer, vocabulary 248320): THUDM/slime
  ``scripts/models/qwen3.5-27B.sh`` (Megatron arguments of the same widths, gated attention, rotary 25 %) and the
  Qwen3.5-27B GPTQ model card of TevunahAi (https://hugingapi.com/TevunahAi/Qwen3.5-27B-TevunahAi-GPTQ: 64 layers
  as [DeltaNet x 3, full attention] x 16, 24 Q / 4 KV heads, 17408, 1 MTP layer); the catalog gives it the 3.6 file.
"""

from __future__ import annotations

from typing import Any


def hybrid_layer_types(layers: int, interval: int = 4) -> list[str]:
    """``layer_types`` as transformers derives it from ``full_attention_interval`` (``Qwen3_5TextConfig``): every
    ``interval``-th layer full attention, the others linear attention."""
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]


QWEN3_5_VISION: dict[str, Any] = {
    "deepstack_visual_indexes": [], "depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
    "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304, "model_type": "qwen3_5", "num_heads": 16,
    "num_position_embeddings": 2304, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
}
"""The vision tower of the hub configs (Qwen3-VL's, patch 16, no DeepStack); ``out_hidden_size`` is the decoder's
width."""

QWEN3_6_27B: dict[str, Any] = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "image_token_id": 248056,
    "language_model_only": False,
    "model_type": "qwen3_5",
    "text_config": {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "bos_token_id": 248044,
        "dtype": "bfloat16", "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256,
        "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 17408,
        "layer_types": hybrid_layer_types(64),
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 48, "linear_value_head_dim": 128, "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144, "model_type": "qwen3_5_text", "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False, "num_attention_heads": 24, "num_hidden_layers": 64,
        "num_key_value_heads": 4, "output_gate_type": "swish", "pad_token_id": None, "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                            "rope_theta": 10000000, "rope_type": "default"},
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": 248320,
    },
    "tie_word_embeddings": False,
    "transformers_version": "4.57.1",
    "video_token_id": 248057,
    "vision_config": {**QWEN3_5_VISION, "out_hidden_size": 5120},
    "vision_end_token_id": 248054,
    "vision_start_token_id": 248053,
}

# Not a hub model: the Qwen3.5 structure at toy width for CPU tests and demos: 4 decoder layers (3 linear attention,
# then 1 gated full attention), linear attention with 2 key and 4 value heads, the tiny Qwen3-VL tower without
# DeepStack, one MTP layer.
QWEN3_5_TINY: dict[str, Any] = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "image_token_id": 1001,
    "video_token_id": 1002,
    "vision_start_token_id": 1003,
    "vision_end_token_id": 1004,
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text", "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
        "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-06, "mtp_num_hidden_layers": 1,
        "bos_token_id": 1005, "eos_token_id": 1006, "pad_token_id": 1007,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "mrope_section": [2, 1, 1],
                            "mrope_interleaved": True, "partial_rotary_factor": 0.25},
    },
    "vision_config": {"model_type": "qwen3_5_vision", "depth": 2, "hidden_size": 64, "intermediate_size": 128,
                      "num_heads": 4, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "out_hidden_size": 128, "num_position_embeddings": 64},
}

CONFIGS = {"qwen3.5-27b": QWEN3_6_27B, "qwen3.6-27b": QWEN3_6_27B, "qwen3.5-tiny": QWEN3_5_TINY}
"""Catalog name -> config.json."""
