"""The Qwen2-VL checkpoints the catalog offers: their Hugging Face ``config.json`` as Python dicts, by catalog
name (``CONFIGS``).

Values are copied from the hub repositories named above each dict (the Instruct checkpoints). Keys the hub file
omits are left out on purpose: the adapter fills them with the transformers defaults, exactly as ``from_pretrained``
does.
"""

from __future__ import annotations

from typing import Any

from planner.contract.families.qwen2_5_vl_configs import QWEN_VL_TOKEN_IDS


def _qwen2_vl(*, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int,
              tie: bool) -> dict[str, Any]:
    """The Qwen2-VL hub config: the three sizes differ only in these fields (the merger projects to ``hidden``)."""
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "attention_dropout": 0.0,
        **QWEN_VL_TOKEN_IDS,
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

CONFIGS = {"qwen2-vl-2b": QWEN2_VL_2B, "qwen2-vl-7b": QWEN2_VL_7B, "qwen2-vl-72b": QWEN2_VL_72B}
"""Catalog name -> config.json."""
