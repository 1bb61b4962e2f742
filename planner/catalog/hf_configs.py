"""The official Hugging Face ``config.json`` of every catalog model, as Python dicts.

Values are copied from the hub repositories named above each dict (the Instruct checkpoints; Qwen2-Audio is the
base checkpoint). Keys the hub file omits are left out on purpose: ``planner.catalog`` fills them with the
transformers defaults, exactly as ``from_pretrained`` does. The hub files use the flat layout (decoder keys at the
top level); ``QWEN2_5_VL_TINY`` uses the nested ``text_config`` layout that transformers 5 writes.
"""

from __future__ import annotations

from typing import Any

_QWEN_VL_TOKEN_IDS: dict[str, Any] = {
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
}

# Qwen/Qwen2.5-VL-3B-Instruct
QWEN2_5_VL_3B: dict[str, Any] = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "attention_dropout": 0.0,
    **_QWEN_VL_TOKEN_IDS,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 11008,
    "max_position_embeddings": 128000,
    "max_window_layers": 70,
    "model_type": "qwen2_5_vl",
    "num_attention_heads": 16,
    "num_hidden_layers": 36,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.41.2",
    "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 2048,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 151936,
}

# Qwen/Qwen2.5-VL-7B-Instruct
QWEN2_5_VL_7B: dict[str, Any] = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "attention_dropout": 0.0,
    **_QWEN_VL_TOKEN_IDS,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 128000,
    "max_window_layers": 28,
    "model_type": "qwen2_5_vl",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.41.2",
    "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 152064,
}

# Qwen/Qwen2.5-VL-32B-Instruct (its vision_config lists only what differs from the transformers defaults)
QWEN2_5_VL_32B: dict[str, Any] = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "attention_dropout": 0.0,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "image_token_id": 151655,
    "initializer_range": 0.02,
    "intermediate_size": 27648,
    "max_position_embeddings": 128000,
    "max_window_layers": 64,
    "model_type": "qwen2_5_vl",
    "num_attention_heads": 40,
    "num_hidden_layers": 64,
    "num_key_value_heads": 8,
    "pad_token_id": 151643,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"},
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.49.0.dev0",
    "use_cache": True,
    "use_sliding_window": False,
    "video_token_id": 151656,
    "vision_config": {
        "hidden_size": 1280,
        "in_chans": 3,
        "intermediate_size": 3456,
        "model_type": "qwen2_5_vl",
        "out_hidden_size": 5120,
        "spatial_patch_size": 14,
        "tokens_per_second": 2,
        "torch_dtype": "bfloat16",
    },
    "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
    "vision_token_id": 151654,
    "vocab_size": 152064,
}

# Qwen/Qwen2.5-VL-72B-Instruct
QWEN2_5_VL_72B: dict[str, Any] = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "attention_dropout": 0.0,
    **_QWEN_VL_TOKEN_IDS,
    "hidden_act": "silu",
    "hidden_size": 8192,
    "initializer_range": 0.02,
    "intermediate_size": 29568,
    "max_position_embeddings": 128000,
    "max_window_layers": 80,
    "model_type": "qwen2_5_vl",
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.41.2",
    "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3456,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 8192,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 152064,
}


def _qwen2_vl(*, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int,
              tie: bool) -> dict[str, Any]:
    """The Qwen2-VL hub config: the three sizes differ only in these fields (the merger projects to ``hidden``)."""
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "attention_dropout": 0.0,
        **_QWEN_VL_TOKEN_IDS,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "max_position_embeddings": 32768,
        "max_window_layers": layers,
        "model_type": "qwen2_vl",
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "tie_word_embeddings": tie,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.41.2",
        "use_cache": True,
        "use_sliding_window": False,
        "vision_config": {
            "depth": 32,
            "embed_dim": 1280,
            "mlp_ratio": 4,
            "num_heads": 16,
            "in_chans": 3,
            "hidden_size": hidden,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "temporal_patch_size": 2,
        },
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "vocab_size": vocab,
    }


# Qwen/Qwen2-VL-2B-Instruct, Qwen/Qwen2-VL-7B-Instruct, Qwen/Qwen2-VL-72B-Instruct
QWEN2_VL_2B = _qwen2_vl(hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2, vocab=151936, tie=True)
QWEN2_VL_7B = _qwen2_vl(hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, vocab=152064, tie=False)
QWEN2_VL_72B = _qwen2_vl(hidden=8192, intermediate=29568, layers=80, heads=64, kv_heads=8, vocab=152064, tie=False)

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

# Not a hub model: the Qwen2.5-VL structure (window + full-attention vision blocks, RMSNorm, SwiGLU, merger, GQA
# decoder with M-RoPE) at toy width, for CPU tests and demos. Special token ids sit inside its small vocabulary.
QWEN2_5_VL_TINY: dict[str, Any] = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "model_type": "qwen2_5_vl",
    "image_token_id": 1001,
    "video_token_id": 1002,
    "vision_start_token_id": 1003,
    "vision_end_token_id": 1004,
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen2_5_vl_text",
        "vocab_size": 1024,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-06,
        "bos_token_id": 1005,
        "eos_token_id": 1006,
        "pad_token_id": 1007,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [4, 6, 6]},
    },
    "vision_config": {
        "model_type": "qwen2_5_vl_vision",
        "depth": 4,
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 4,
        "in_channels": 3,
        "out_hidden_size": 128,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [1, 3],
        "tokens_per_second": 2,
    },
}


def _qwen3_vl(*, hidden: int, intermediate: int, layers: int, heads: int, tie: bool, vision_depth: int,
              vision_hidden: int, vision_intermediate: int, deepstack: list[int]) -> dict[str, Any]:
    """The Qwen3-VL hub config (nested layout): the four dense sizes differ only in these fields; every size has 8
    key/value heads of width 128 and 16 vision heads (docs/research/qwen3-vl.md, section 1)."""
    rope = {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True}
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "image_token_id": 151655,
        "model_type": "qwen3_vl",
        "text_config": {
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": 151643,
            "dtype": "bfloat16",
            "eos_token_id": 151645,
            "head_dim": 128,
            "hidden_act": "silu",
            "hidden_size": hidden,
            "initializer_range": 0.02,
            "intermediate_size": intermediate,
            "max_position_embeddings": 262144,
            "model_type": "qwen3_vl_text",
            "num_attention_heads": heads,
            "num_hidden_layers": layers,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-06,
            "rope_scaling": rope,
            "rope_theta": 5000000,
            "tie_word_embeddings": tie,
            "use_cache": True,
            "vocab_size": 151936,
        },
        "tie_word_embeddings": tie,
        "transformers_version": "4.57.0.dev0",
        "video_token_id": 151656,
        "vision_config": {
            "deepstack_visual_indexes": deepstack,
            "depth": vision_depth,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": vision_hidden,
            "in_channels": 3,
            "initializer_range": 0.02,
            "intermediate_size": vision_intermediate,
            "model_type": "qwen3_vl",
            "num_heads": 16,
            "num_position_embeddings": 2304,
            "out_hidden_size": hidden,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        "vision_end_token_id": 151653,
        "vision_start_token_id": 151652,
    }


_QWEN3_VL_SMALL_VIT = dict(vision_depth=24, vision_hidden=1024, vision_intermediate=4096, deepstack=[5, 11, 17])
_QWEN3_VL_LARGE_VIT = dict(vision_depth=27, vision_hidden=1152, vision_intermediate=4304, deepstack=[8, 16, 24])
# Qwen/Qwen3-VL-2B-Instruct, -4B-, -8B-, -32B-Instruct
QWEN3_VL_2B = _qwen3_vl(hidden=2048, intermediate=6144, layers=28, heads=16, tie=True, **_QWEN3_VL_SMALL_VIT)
QWEN3_VL_4B = _qwen3_vl(hidden=2560, intermediate=9728, layers=36, heads=32, tie=True, **_QWEN3_VL_SMALL_VIT)
QWEN3_VL_8B = _qwen3_vl(hidden=4096, intermediate=12288, layers=36, heads=32, tie=False, **_QWEN3_VL_LARGE_VIT)
QWEN3_VL_32B = _qwen3_vl(hidden=5120, intermediate=25600, layers=64, heads=64, tie=False, **_QWEN3_VL_LARGE_VIT)

def _qwen3_vl_moe(*, hidden: int, intermediate: int, layers: int, heads: int, expert_intermediate: int
                  ) -> dict[str, Any]:
    """The Qwen3-VL-MoE hub config: the Qwen3-VL layout with the large vision tower, 4 key/value heads, 128 experts
    of which each token takes 8, every decoder layer sparse; the root says ``tie_word_embeddings: false`` and
    ``text_config`` has no such key (docs/research/qwen3-vl.md, section 1, sources S30 and S235)."""
    config = _qwen3_vl(hidden=hidden, intermediate=intermediate, layers=layers, heads=heads, tie=False,
                       **_QWEN3_VL_LARGE_VIT)
    text = config["text_config"]
    del text["tie_word_embeddings"]
    text.update(model_type="qwen3_vl_moe_text", num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
                moe_intermediate_size=expert_intermediate, decoder_sparse_step=1, mlp_only_layers=[],
                norm_topk_prob=True)
    config.update(architectures=["Qwen3VLMoeForConditionalGeneration"], model_type="qwen3_vl_moe")
    config["vision_config"]["model_type"] = "qwen3_vl_moe"
    return config


# Qwen/Qwen3-VL-30B-A3B-Instruct, Qwen/Qwen3-VL-235B-A22B-Instruct
QWEN3_VL_30B_A3B = _qwen3_vl_moe(hidden=2048, intermediate=6144, layers=48, heads=32, expert_intermediate=768)
QWEN3_VL_235B_A22B = _qwen3_vl_moe(hidden=4096, intermediate=12288, layers=94, heads=64, expert_intermediate=1536)


# Not a hub model: the Qwen3-VL structure (full-attention vision blocks with learned positions, DeepStack mergers
# feeding decoder layers 0 and 1, a Qwen3 decoder with q/k norms and interleaved M-RoPE) at toy width.
QWEN3_VL_TINY: dict[str, Any] = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "model_type": "qwen3_vl",
    "image_token_id": 1001,
    "video_token_id": 1002,
    "vision_start_token_id": 1003,
    "vision_end_token_id": 1004,
    "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_vl_text",
        "vocab_size": 1024,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-06,
        "bos_token_id": 1005,
        "eos_token_id": 1006,
        "pad_token_id": 1007,
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": [8, 4, 4],
                            "mrope_interleaved": True},
    },
    "vision_config": {
        "model_type": "qwen3_vl_vision",
        "depth": 4,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 4,
        "in_channels": 3,
        "out_hidden_size": 128,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "num_position_embeddings": 64,
        "deepstack_visual_indexes": [1, 2],
    },
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

# Not a hub model: the Qwen3-VL-MoE structure at toy width (the tiny Qwen3-VL with 8 experts of width 64, top-2, in
# every decoder layer) for CPU tests and demos. Its load-balancing loss weight is one its gradients show, for the tests
# that turn the loss on (``output_router_logits``, off by transformers' default and here).
QWEN3_VL_MOE_TINY: dict[str, Any] = {
    **QWEN3_VL_TINY,
    "architectures": ["Qwen3VLMoeForConditionalGeneration"],
    "model_type": "qwen3_vl_moe",
    "text_config": {**QWEN3_VL_TINY["text_config"], "model_type": "qwen3_vl_moe_text", "num_experts": 8,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 64, "decoder_sparse_step": 1,
                    "mlp_only_layers": [], "router_aux_loss_coef": 0.1},
    "vision_config": {**QWEN3_VL_TINY["vision_config"], "model_type": "qwen3_vl_moe_vision"},
}
