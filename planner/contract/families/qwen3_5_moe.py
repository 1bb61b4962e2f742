"""Qwen3.5 / Qwen3.6 mixture-of-experts (transformers ``Qwen3_5MoeForConditionalGeneration``): the dense family's
vision tower and hybrid decoder (``planner.contract.families.qwen3_5``) with every decoder layer's feed-forward a
``Qwen3_5MoeSparseMoeBlock``: a linear router, softmax, top-k (renormalised), routed SwiGLU experts stored fused, and
a shared SwiGLU expert of ``shared_expert_intermediate_size`` scaled by a sigmoid gate (a linear h -> 1)."""

from __future__ import annotations

from typing import Any, Mapping

from planner.contract.families import qwen3_5, qwen3_5_moe_configs, qwen3_vl
from planner.contract.families.family import PlannerFamily
from planner.contract.families.fields import ints
from planner.contract.models import ModelSpec, MoeSpec
from planner.contract.param_counts import linear_params, routed_experts_params, top_k_router_params

MODEL_TYPE = "qwen3_5_moe"
TEXT_DEFAULTS: dict[str, Any] = {
    **{k: v for k, v in qwen3_5.TEXT_DEFAULTS.items() if k != "intermediate_size"},
    "hidden_size": 2048, "num_hidden_layers": 40, "num_key_value_heads": 2, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8, "num_experts": 256,
    "output_router_logits": False,
}
"""transformers ``Qwen3_5MoeTextConfig`` defaults."""


def sparse_feed_forward(text: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """(LayerSpec fields, parameters) of ``Qwen3_5MoeSparseMoeBlock``: router, routed experts, shared expert and its
    gate."""
    hidden, inter, shared, top_k, experts = ints(
        text, "hidden_size moe_intermediate_size shared_expert_intermediate_size num_experts_per_tok num_experts",
        "text_config")
    if top_k > experts:
        raise ValueError(f"text_config.num_experts_per_tok = {top_k} exceeds the {experts} experts")
    moe = MoeSpec(num_experts=experts, experts_per_token=top_k, expert_intermediate_size=inter,
                  expert_params=routed_experts_params(experts, hidden, inter), shared_expert_intermediate_size=shared,
                  norm_topk_prob=True, balancing_loss=text["output_router_logits"] is True)
    shared_params = 3 * linear_params(hidden, shared, False) + linear_params(hidden, 1, False)
    return {"mlp": None, "moe": moe}, top_k_router_params(experts, hidden) + moe.expert_params + shared_params


def model_spec(config: Mapping[str, Any], name: str) -> ModelSpec:
    """The ModelSpec of a Qwen3.5-MoE config.json."""
    return qwen3_5.hybrid_model_spec(config, name, model_type=MODEL_TYPE, text_defaults=TEXT_DEFAULTS,
                                     feed_forward=sparse_feed_forward)


FAMILY = PlannerFamily(model_type=MODEL_TYPE, model_spec=model_spec, encoder="vision",
                       image_pixels=qwen3_vl.IMAGE_PIXELS, video=qwen3_vl.VIDEO, configs=qwen3_5_moe_configs.CONFIGS)
"""The planner's half of the family (planner.contract.families.family)."""
