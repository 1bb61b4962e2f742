"""Qwen3-VL-MoE (transformers ``Qwen3VLMoeForConditionalGeneration``): the Qwen3-VL vision tower and DeepStack
hand-off (``planner.contract.families.qwen3_vl``) with a decoder whose feed-forward is a mixture of experts
(``Qwen3VLMoeTextSparseMoeBlock``: a linear router, softmax, top-k, SwiGLU experts stored fused per layer).

A decoder layer routes to experts unless it is listed in ``mlp_only_layers`` or ``(index + 1) %
decoder_sparse_step`` is not 0 (transformers' ``Qwen3VLMoeTextDecoderLayer``); such layers keep a dense SwiGLU MLP
of ``intermediate_size``. The lm_head is tied as the ROOT ``tie_word_embeddings`` says (the hub's 30B-A3B and
235B-A22B say false; ``Qwen3VLMoeTextConfig`` defaults its own key to true: docs/research/qwen3-vl.md, section 1).
"""

from __future__ import annotations

import copy
from dataclasses import replace
from typing import Any, Mapping

from planner.contract.families import qwen3_vl, qwen3_vl_moe_configs
from planner.contract.families.family import PlannerFamily
from planner.contract.families.fields import encoder_section, ints, positive_int, text_section
from planner.contract.families.qwen_parts import check_vision_language, llm_module, vision_input
from planner.contract.models import ModelSpec, ModuleSpec, MoeSpec
from planner.contract.param_counts import routed_experts_params, top_k_router_params

MODEL_TYPE = "qwen3_vl_moe"
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
    "num_attention_heads": 16, "num_key_value_heads": 16, "attention_bias": False, "decoder_sparse_step": 1,
    "moe_intermediate_size": 1408, "num_experts_per_tok": 4, "num_experts": 60, "mlp_only_layers": [],
    "output_router_logits": False,
}
"""transformers ``Qwen3VLMoeTextConfig`` defaults (``num_local_experts`` is its alias of ``num_experts``)."""


def sparse_layers(text: Mapping[str, Any], num_layers: int) -> list[int]:
    """Indexes of the decoder layers that route to experts (transformers ``Qwen3VLMoeTextDecoderLayer``)."""
    step = positive_int(text, "decoder_sparse_step", "text_config")
    dense = text["mlp_only_layers"]
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise ValueError(f"text_config.mlp_only_layers must be a list of layer indexes, got {dense!r}")
    return [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]


def moe_spec(text: Mapping[str, Any]) -> MoeSpec:
    """The routed experts of a decoder layer."""
    hidden, inter, top_k = ints(text, "hidden_size moe_intermediate_size num_experts_per_tok", "text_config")
    experts = positive_int({"num_experts": text.get("num_local_experts", text["num_experts"])}, "num_experts",
                           "text_config")
    if top_k > experts:
        raise ValueError(f"text_config.num_experts_per_tok = {top_k} exceeds the {experts} experts")
    return MoeSpec(num_experts=experts, experts_per_token=top_k, expert_intermediate_size=inter,
                   expert_params=routed_experts_params(experts, hidden, inter), norm_topk_prob=True,
                   balancing_loss=text["output_router_logits"] is True)


def moe_llm_module(text: Mapping[str, Any], tied: bool) -> ModuleSpec:
    """The decoder: its sparse layers as ``decoder_layer`` (with ``LayerSpec.moe``), any dense ones as
    ``dense_decoder_layer``. transformers' router always renormalises the top-k weights, whatever
    ``norm_topk_prob`` says."""
    bias = text.get("attention_bias") is True
    dense = llm_module(text, tied, head_dim_key=True, qk_norm=True,
                       layer_params=lambda *dims: qwen3_vl.decoder_layer_params(*dims, bias=bias))
    block = dense.layer("decoder_layer")
    a, moe = block.attention, moe_spec(text)
    sparse = sparse_layers(text, block.count)
    params = (qwen3_vl.attention_and_norms_params(block.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, bias)
              + top_k_router_params(moe.num_experts, block.hidden_size) + moe.expert_params)
    if not sparse:
        raise ValueError("no decoder layer routes to experts (mlp_only_layers / decoder_sparse_step leave none): "
                         "plan it as model_type qwen3_vl")
    blocks = [replace(block, count=len(sparse), params=params, mlp=None, moe=moe)]
    if len(sparse) < block.count:
        blocks.append(replace(block, name="dense_decoder_layer", count=block.count - len(sparse)))
    embedding, _, final_norm, lm_head = dense.layers
    return replace(dense, layers=(embedding, *blocks, final_norm, lm_head))


def model_spec(config: Mapping[str, Any], name: str) -> ModelSpec:
    """The ModelSpec of a Qwen3-VL-MoE config.json."""
    text = text_section(config, TEXT_DEFAULTS)
    tied = bool(config.get("tie_word_embeddings"))
    v = encoder_section(config, "vision_config", qwen3_vl.VISION_DEFAULTS)
    vision = qwen3_vl.vision_module(v)
    llm = moe_llm_module(text, tied)
    inputs = vision_input(v, window=False, image_pixels=qwen3_vl.IMAGE_PIXELS, video=qwen3_vl.VIDEO)
    check_vision_language(config, text, vision, llm, inputs)
    levels = len(qwen3_vl.deepstack_indexes(v, vision.layer("full_block").count))
    decoder_layers = sum(layer.count for layer in llm.layers if layer.kind == "decoder_layer")
    if levels > decoder_layers:
        raise ValueError(f"{levels} DeepStack levels need at least {levels} decoder layers, the decoder has "
                         f"{decoder_layers}")
    return ModelSpec(name=name, family=MODEL_TYPE, hf_config=copy.deepcopy(dict(config)), vision_input=inputs,
                     modules=(vision, llm), tie_word_embeddings=tied, injection_layers=tuple(range(levels)))


FAMILY = PlannerFamily(model_type=MODEL_TYPE, model_spec=model_spec, encoder="vision",
                       image_pixels=qwen3_vl.IMAGE_PIXELS, video=qwen3_vl.VIDEO, configs=qwen3_vl_moe_configs.CONFIGS)
"""The planner's half of the family: Qwen3-VL's tower and processors (planner.contract.families.family)."""
