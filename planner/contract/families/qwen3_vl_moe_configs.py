"""The Qwen3-VL-MoE checkpoints the catalog offers: their Hugging Face ``config.json`` as Python dicts, by catalog
name (``CONFIGS``), built on Qwen3-VL's (``qwen3_vl_configs``).

Values are copied from the hub repositories named above each dict (the Instruct checkpoints). Keys the hub file
omits are left out on purpose: the adapter fills them with the transformers defaults, exactly as ``from_pretrained``
does.
"""

from __future__ import annotations

from typing import Any

from planner.contract.families.qwen3_vl_configs import QWEN3_VL_LARGE_VIT, QWEN3_VL_TINY, qwen3_vl_config


def _qwen3_vl_moe(*, hidden: int, intermediate: int, layers: int, heads: int, expert_intermediate: int
                  ) -> dict[str, Any]:
    """The Qwen3-VL-MoE hub config: the Qwen3-VL layout with the large vision tower, 4 key/value heads, 128 experts
    of which each token takes 8, every decoder layer sparse; the root says ``tie_word_embeddings: false`` and
    ``text_config`` has no such key (docs/research/qwen3-vl.md, section 1, sources S30 and S235)."""
    config = qwen3_vl_config(hidden=hidden, intermediate=intermediate, layers=layers, heads=heads,
                             tie=False, **QWEN3_VL_LARGE_VIT)
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

CONFIGS = {"qwen3-vl-30b-a3b": QWEN3_VL_30B_A3B, "qwen3-vl-235b-a22b": QWEN3_VL_235B_A22B,
           "qwen3-vl-moe-tiny": QWEN3_VL_MOE_TINY}
"""Catalog name -> config.json."""
