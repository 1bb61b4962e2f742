"""The Qwen3.5 / Qwen3.6 mixture-of-experts checkpoints the catalog offers: their Hugging Face ``config.json`` as Python
dicts, by catalog name (``CONFIGS``), on the dense family's layout (``qwen3_5_configs``).

Field names and defaults: transformers 5.25's ``transformers/models/qwen3_5_moe/configuration_qwen3_5_moe.py``.
Widths, per checkpoint (the hub config.json fields as a public simulator's metadata table copies them, keyed by hub
id, on GitHub; the same values in SGLang's Qwen3.5 cookbook, https://docs.sglang.io/cookbook/autoregressive/Qwen/Qwen3.5,
and the Megatron Bridge's Qwen 3.5 / 3.6 page,
https://docs.nvidia.com/nemo/megatron-bridge/nightly/models/qwen/qwen35-vl.html):

- **Qwen/Qwen3.5-35B-A3B** and **Qwen/Qwen3.6-35B-A3B** (the same architecture): hidden 2048, 40 layers (every 4th
  full attention), 16 query / 2 KV heads of 256, linear attention 16 key / 32 value heads of 128, conv 4, 256
  experts of width 512, top-8, one shared expert of width 512, vocabulary 248320, untied.
- **Qwen/Qwen3.5-397B-A17B**: hidden 4096, 60 layers, 32 query / 2 KV heads of 256, linear attention 16 key / 64
  value heads of 128, 512 experts of width 1024, top-10, one shared expert of width 1024 (SGLang's Ascend tutorial:
  "Top-10 active out of 512 routed experts plus a dedicated shared expert"), vocabulary 248320, untied.

Their safetensors totals are not cited here (no source at hand lists them), so their tests compare with transformers
on the meta device only. The vision tower is the dense family's (depth 27, width 1152, patch 16), its merger writing
the decoder's width; every checkpoint carries one MTP layer (``mtp_num_hidden_layers``: 1, model cards: "built-in
multi-token prediction").
"""

from __future__ import annotations

from typing import Any

from planner.contract.families.qwen3_5_configs import QWEN3_5_TINY, QWEN3_5_VISION, hybrid_layer_types


def _qwen3_5_moe(*, hidden: int, layers: int, heads: int, value_heads: int, experts: int, top_k: int,
                 expert_intermediate: int) -> dict[str, Any]:
    """A Qwen3.5-MoE hub config: 2 KV heads of 256, gated attention every 4th layer, 16 linear-attention key heads of
    128, one shared expert as wide as a routed one, one MTP layer."""
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "image_token_id": 248056,
        "model_type": "qwen3_5_moe",
        "text_config": {
            "attention_bias": False, "attn_output_gate": True, "full_attention_interval": 4, "head_dim": 256,
            "hidden_act": "silu", "hidden_size": hidden, "layer_types": hybrid_layer_types(layers),
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
            "linear_num_value_heads": value_heads, "linear_value_head_dim": 128, "max_position_embeddings": 262144,
            "model_type": "qwen3_5_moe_text", "moe_intermediate_size": expert_intermediate,
            "mtp_num_hidden_layers": 1, "num_attention_heads": heads, "num_experts": experts,
            "num_experts_per_tok": top_k, "num_hidden_layers": layers, "num_key_value_heads": 2,
            "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
            "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10],
                                "partial_rotary_factor": 0.25, "rope_theta": 10000000, "rope_type": "default"},
            "shared_expert_intermediate_size": expert_intermediate, "tie_word_embeddings": False,
            "vocab_size": 248320,
        },
        "tie_word_embeddings": False,
        "video_token_id": 248057,
        "vision_config": {**QWEN3_5_VISION, "model_type": "qwen3_5_moe", "out_hidden_size": hidden},
        "vision_end_token_id": 248054,
        "vision_start_token_id": 248053,
    }


QWEN3_5_35B_A3B = _qwen3_5_moe(hidden=2048, layers=40, heads=16, value_heads=32, experts=256, top_k=8,
                               expert_intermediate=512)
QWEN3_5_397B_A17B = _qwen3_5_moe(hidden=4096, layers=60, heads=32, value_heads=64, experts=512, top_k=10,
                                 expert_intermediate=1024)

# Not a hub model: the tiny Qwen3.5 with 8 experts of width 64, top-2, and a shared expert of width 64 in every
# decoder layer, for CPU tests and demos.
QWEN3_5_MOE_TINY: dict[str, Any] = {
    **QWEN3_5_TINY,
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "text_config": {**QWEN3_5_TINY["text_config"], "model_type": "qwen3_5_moe_text", "num_experts": 8,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64},
    "vision_config": {**QWEN3_5_TINY["vision_config"], "model_type": "qwen3_5_moe_vision"},
}

CONFIGS = {"qwen3.5-35b-a3b": QWEN3_5_35B_A3B, "qwen3.6-35b-a3b": QWEN3_5_35B_A3B,
           "qwen3.5-397b-a17b": QWEN3_5_397B_A17B, "qwen3.5-moe-tiny": QWEN3_5_MOE_TINY}
"""Catalog name -> config.json."""
