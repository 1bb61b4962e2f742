"""Decoder-only language models (transformers ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``): one
module, the LLM. Planned so that published text-model training runs can check the cost model (issue 32); the
runtime builds vision-language models only and refuses these plans in one line."""

from __future__ import annotations

import copy
from typing import Any, Mapping

from planner.contract.families.family import PlannerFamily
from planner.contract.families.fields import with_defaults
from planner.contract.families.qwen_parts import llm_module
from planner.contract.models import ModelSpec
from planner.contract.param_counts import linear_params, qwen2_decoder_layer_params, rms_norm_params

DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False},
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "tie_word_embeddings": False},
    "qwen3": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "attention_bias": False,
              "tie_word_embeddings": False},
}
"""transformers ``LlamaConfig`` / ``Qwen2Config`` / ``Qwen3Config`` defaults (Llama: as many KV heads as query heads
and head_dim = hidden / heads unless given)."""


def llama_decoder_layer_params(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, *,
                               attention_bias: bool, mlp_bias: bool, qk_norm: bool) -> int:
    """``LlamaDecoderLayer`` (q/k/v/o with ``attention_bias``, SwiGLU with ``mlp_bias``, two RMSNorms), and
    ``Qwen3DecoderLayer`` (``qk_norm``: an RMSNorm of one head's width on q and on k, no MLP bias)."""
    attention = (linear_params(hidden, heads * head_dim, attention_bias)
                 + 2 * linear_params(hidden, kv_heads * head_dim, attention_bias)
                 + linear_params(heads * head_dim, hidden, attention_bias))
    norms = 2 * rms_norm_params(head_dim) if qk_norm else 0
    mlp = 2 * linear_params(hidden, intermediate, mlp_bias) + linear_params(intermediate, hidden, mlp_bias)
    return attention + norms + mlp + 2 * rms_norm_params(hidden)


def model_spec(config: Mapping[str, Any], name: str) -> ModelSpec:
    """The ModelSpec of a decoder-only config.json (its lm_head tied when it says so)."""
    model_type = config["model_type"]
    if "hidden_size" not in config:
        raise ValueError(f"no hidden_size: a {model_type} config.json gives the decoder's widths at its top level "
                         f"(copy the model's config.json from its hub repository)")
    text = with_defaults(config, DEFAULTS[model_type], "config")
    tied = bool(text.get("tie_word_embeddings"))
    if model_type == "qwen2":  # q/k/v with bias, o without; head_dim only where the file gives one
        llm = llm_module(text, tied, head_dim_key=True, layer_params=qwen2_decoder_layer_params)
    else:
        llm = llm_module(text, tied, head_dim_key=True, qk_norm=model_type == "qwen3",
                         layer_params=lambda *dims: llama_decoder_layer_params(
            *dims, attention_bias=text.get("attention_bias") is True, mlp_bias=text.get("mlp_bias") is True,
            qk_norm=model_type == "qwen3"))
    return ModelSpec(name=name, family=model_type, hf_config=copy.deepcopy(dict(config)), modules=(llm,),
                     tie_word_embeddings=tied)


FAMILIES = tuple(PlannerFamily(model_type=model_type, model_spec=model_spec, encoder=None, image_pixels=None,
                               video=None, configs={}) for model_type in DEFAULTS)
"""The planner's half of each decoder-only family (the runtime has none: it runs vision-language models)."""
