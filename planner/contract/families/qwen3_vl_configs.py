"""The Qwen3-VL checkpoints the catalog offers: their Hugging Face ``config.json`` as Python dicts, by catalog name
(``CONFIGS``).

Values are copied from the hub repositories named above each dict (the Instruct checkpoints). Keys the hub file
omits are left out on purpose: the adapter fills them with the transformers defaults, exactly as ``from_pretrained``
does. The hub files use the nested ``text_config`` layout.
"""

from __future__ import annotations

from typing import Any


def qwen3_vl_config(*, hidden: int, intermediate: int, layers: int, heads: int, tie: bool,
                    vision_depth: int, vision_hidden: int, vision_intermediate: int,
                    deepstack: list[int]) -> dict[str, Any]:
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


QWEN3_VL_SMALL_VIT = dict(vision_depth=24, vision_hidden=1024, vision_intermediate=4096, deepstack=[5, 11, 17])
QWEN3_VL_LARGE_VIT = dict(vision_depth=27, vision_hidden=1152, vision_intermediate=4304, deepstack=[8, 16, 24])
# Qwen/Qwen3-VL-2B-Instruct, -4B-, -8B-, -32B-Instruct
QWEN3_VL_2B = qwen3_vl_config(hidden=2048, intermediate=6144, layers=28, heads=16, tie=True,
                              **QWEN3_VL_SMALL_VIT)
QWEN3_VL_4B = qwen3_vl_config(hidden=2560, intermediate=9728, layers=36, heads=32, tie=True,
                              **QWEN3_VL_SMALL_VIT)
QWEN3_VL_8B = qwen3_vl_config(hidden=4096, intermediate=12288, layers=36, heads=32, tie=False,
                              **QWEN3_VL_LARGE_VIT)
QWEN3_VL_32B = qwen3_vl_config(hidden=5120, intermediate=25600, layers=64, heads=64, tie=False,
                               **QWEN3_VL_LARGE_VIT)

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

CONFIGS = {"qwen3-vl-2b": QWEN3_VL_2B, "qwen3-vl-4b": QWEN3_VL_4B, "qwen3-vl-8b": QWEN3_VL_8B,
           "qwen3-vl-32b": QWEN3_VL_32B, "qwen3-vl-tiny": QWEN3_VL_TINY}
"""Catalog name -> config.json."""
