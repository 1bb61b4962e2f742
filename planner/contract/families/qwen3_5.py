"""Qwen3.5 / Qwen3.6 dense (transformers ``Qwen3_5ForConditionalGeneration``): Qwen3-VL's vision tower without
DeepStack (patch 16, one merged tensor handed over) and a hybrid decoder: ``layer_types`` (or, without it, every
``full_attention_interval``-th layer) is gated full attention (``Qwen3_5Attention``: q_proj doubled for a sigmoid
output gate, q/k RMSNorm per head, head 256, partial rotary), the others Gated DeltaNet linear attention
(``Qwen3_5GatedDeltaNet``: its own key / value head counts and widths, a depthwise causal conv over q, k, v).

Multi-token prediction: the checkpoints carry ``mtp_num_hidden_layers`` MTP layers (``mtp.*``: a fusing linear of
2 h -> h, three RMSNorms and one full-attention decoder layer); transformers skips them on load
(``_keys_to_ignore_on_load_unexpected = ["^mtp.*"]``), so the runtime's model has none: they are counted
(``ModelSpec.unbuilt_params``, so that built + MTP equals the safetensors total) but neither trained nor priced.
Parameter formulas mirror transformers 5.25's ``modeling_qwen3_5``.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Mapping

from planner.contract.families import qwen3_5_configs, qwen3_vl
from planner.contract.families.family import PlannerFamily
from planner.contract.families.fields import encoder_section, ints, positive_int, text_section
from planner.contract.families.qwen_parts import check_vision_language, vision_input
from planner.contract.models import AttentionSpec, LayerSpec, LinearAttentionSpec, MlpSpec, ModelSpec, ModuleSpec
from planner.contract.param_counts import embedding_params, linear_params, lm_head_params, rms_norm_params

MODEL_TYPE = "qwen3_5"
VISION_DEFAULTS: dict[str, Any] = {**qwen3_vl.VISION_DEFAULTS, "deepstack_visual_indexes": []}
"""transformers ``Qwen3_5VisionConfig`` defaults (Qwen3-VL's, without DeepStack)."""
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 248320, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32,
    "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256, "attention_bias": False,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "full_attention_interval": 4,
    "partial_rotary_factor": 0.25, "mtp_num_hidden_layers": 0,
}
"""transformers ``Qwen3_5TextConfig`` defaults (``full_attention_interval`` and ``partial_rotary_factor`` are its
``__post_init__`` defaults); ``mtp_num_hidden_layers`` is a hub key transformers does not read (0: none)."""
LAYER_TYPES = ("linear_attention", "full_attention")
FULL, LINEAR = "decoder_layer", "linear_decoder_layer"
"""Layer names of the two decoder layer types."""


def layer_types(text: Mapping[str, Any]) -> list[str]:
    """Each decoder layer's token mixer: ``layer_types``, or every ``full_attention_interval``-th layer full
    attention (``Qwen3_5TextConfig.__post_init__``)."""
    layers = positive_int(text, "num_hidden_layers", "text_config")
    types = text.get("layer_types")
    if types is None:
        interval = positive_int(text, "full_attention_interval", "text_config")
        return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
    if len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"text_config.layer_types must give one of {', '.join(LAYER_TYPES)} for each of the "
                         f"{layers} layers")
    if "full_attention" not in types:
        raise ValueError("text_config.layer_types has no full_attention layer; the planner prices Qwen3.5 decoders "
                         "with at least one")
    return list(types)


def gated_attention_params(hidden: int, heads: int, kv_heads: int, head_dim: int, bias: bool) -> int:
    """``Qwen3_5Attention``: q_proj of twice the query width (query and output gate), k/v/o, q/k RMSNorm of one
    head's width."""
    return (linear_params(hidden, 2 * heads * head_dim, bias) + 2 * linear_params(hidden, kv_heads * head_dim, bias)
            + linear_params(heads * head_dim, hidden, bias) + 2 * rms_norm_params(head_dim))


def gated_delta_net_params(hidden: int, spec: LinearAttentionSpec) -> int:
    """``Qwen3_5GatedDeltaNet``: in_proj_qkv (h -> 2 key + value widths), in_proj_z (h -> value width), in_proj_a and
    in_proj_b (h -> value heads), the depthwise conv over q, k, v (no bias), ``dt_bias`` and ``A_log`` per value head,
    the gated RMSNorm of one value head's width, out_proj."""
    key, value = spec.num_key_heads * spec.key_head_dim, spec.num_value_heads * spec.value_head_dim
    conv_channels = 2 * key + value
    return (linear_params(hidden, conv_channels, False) + linear_params(hidden, value, False)
            + 2 * linear_params(hidden, spec.num_value_heads, False) + conv_channels * spec.conv_kernel
            + 2 * spec.num_value_heads + rms_norm_params(spec.value_head_dim) + linear_params(value, hidden, False))


def linear_attention_spec(text: Mapping[str, Any]) -> LinearAttentionSpec:
    """The Gated DeltaNet widths; value heads a multiple of key heads (the rule repeats each key head over its
    group of value heads)."""
    key_heads, value_heads, key_dim, value_dim, kernel = ints(
        text, "linear_num_key_heads linear_num_value_heads linear_key_head_dim linear_value_head_dim "
              "linear_conv_kernel_dim", "text_config")
    if value_heads % key_heads:
        raise ValueError(f"text_config: {value_heads} linear-attention value heads are not a multiple of "
                         f"{key_heads} key heads")
    return LinearAttentionSpec(num_key_heads=key_heads, num_value_heads=value_heads, key_head_dim=key_dim,
                               value_head_dim=value_dim, conv_kernel=kernel)


def full_attention_spec(text: Mapping[str, Any]) -> AttentionSpec:
    """The gated full attention's heads."""
    heads, kv_heads, head_dim = ints(text, "num_attention_heads num_key_value_heads head_dim", "text_config")
    if heads % kv_heads:
        raise ValueError(f"text_config: {heads} attention heads are not a multiple of {kv_heads} key/value heads")
    return AttentionSpec(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, causal=True, output_gate=True,
                         qk_norm=True)


def dense_feed_forward(text: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """(LayerSpec fields, parameters) of the SwiGLU MLP of ``intermediate_size``."""
    hidden, inter = ints(text, "hidden_size intermediate_size", "text_config")
    return {"mlp": MlpSpec(intermediate_size=inter, gated=True)}, 3 * linear_params(hidden, inter, False)


FeedForward = Callable[[Mapping[str, Any]], tuple[dict[str, Any], int]]
"""``feed_forward(text) -> (LayerSpec fields, parameters)`` of a decoder layer's feed-forward."""


def hybrid_llm_module(text: Mapping[str, Any], tied: bool, feed_forward: FeedForward) -> ModuleSpec:
    """Embedding, the linear- and full-attention decoder layers (``layer_order`` says which is where), final RMSNorm,
    lm_head."""
    vocab, hidden = ints(text, "vocab_size hidden_size", "text_config")
    types = layer_types(text)
    ffn_fields, ffn_params = feed_forward(text)
    attention, linear = full_attention_spec(text), linear_attention_spec(text)
    bias = text.get("attention_bias") is True
    norms = 2 * rms_norm_params(hidden)
    full_params = gated_attention_params(hidden, attention.num_heads, attention.num_kv_heads, attention.head_dim, bias)
    blocks = {
        LINEAR: LayerSpec(kind="decoder_layer", name=LINEAR, count=types.count("linear_attention"),
                          params=gated_delta_net_params(hidden, linear) + ffn_params + norms, hidden_size=hidden,
                          linear_attention=linear, **ffn_fields),
        FULL: LayerSpec(kind="decoder_layer", name=FULL, count=types.count("full_attention"),
                        params=full_params + ffn_params + norms, hidden_size=hidden, attention=attention,
                        **ffn_fields),
    }
    order = tuple(LINEAR if t == "linear_attention" else FULL for t in types)
    present = [blocks[name] for name in dict.fromkeys(order)]
    return ModuleSpec(name="llm", layer_order=order if len(present) > 1 else (), layers=(
        LayerSpec(kind="embedding", name="embedding", count=1, params=embedding_params(vocab, hidden),
                  hidden_size=hidden),
        *present,
        LayerSpec(kind="final_norm", name="final_norm", count=1, params=rms_norm_params(hidden), hidden_size=hidden),
        LayerSpec(kind="lm_head", name="lm_head", count=1, params=lm_head_params(hidden, vocab, tied),
                  hidden_size=hidden, out_features=vocab),
    ))


def mtp_params(text: Mapping[str, Any], llm: ModuleSpec) -> int:
    """Parameters of the checkpoint's ``mtp.*`` layers: ``fc`` (2 h -> h, no bias), ``pre_fc_norm_embedding``,
    ``pre_fc_norm_hidden`` and ``norm`` (RMSNorms), and ``mtp_num_hidden_layers`` full-attention decoder layers (the
    embedding and lm_head are the model's)."""
    layers = text["mtp_num_hidden_layers"]
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 0:
        raise ValueError(f"text_config.mtp_num_hidden_layers must be a non-negative integer, got {layers!r}")
    if layers == 0:
        return 0
    hidden = llm.layer("embedding").hidden_size
    return linear_params(2 * hidden, hidden, False) + 3 * rms_norm_params(hidden) + layers * llm.layer(FULL).params


def hybrid_model_spec(config: Mapping[str, Any], name: str, *, model_type: str, text_defaults: Mapping[str, Any],
                      feed_forward: FeedForward) -> ModelSpec:
    """The ModelSpec of a Qwen3.5 config.json, dense or mixture-of-experts (``feed_forward``)."""
    text = text_section(config, text_defaults)
    tied = bool(config.get("tie_word_embeddings"))
    v = {**encoder_section(config, "vision_config", VISION_DEFAULTS), "deepstack_visual_indexes": []}
    vision = qwen3_vl.vision_module(v)
    llm = hybrid_llm_module(text, tied, feed_forward)
    inputs = vision_input(v, window=False, image_pixels=qwen3_vl.IMAGE_PIXELS, video=qwen3_vl.VIDEO)
    check_vision_language(config, text, vision, llm, inputs, rotary_fraction=rotary_fraction(text))
    return ModelSpec(name=name, family=model_type, hf_config=copy.deepcopy(dict(config)), vision_input=inputs,
                     modules=(vision, llm), tie_word_embeddings=tied, unbuilt_params=mtp_params(text, llm))


def rotary_fraction(text: Mapping[str, Any]) -> float:
    """Share of the full attention's head width that rotary embedding turns (``partial_rotary_factor``, in
    ``rope_parameters`` or the text section)."""
    rope = text.get("rope_parameters") or {}
    fraction = rope.get("partial_rotary_factor", text["partial_rotary_factor"]) if isinstance(rope, Mapping) else 1.0
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise ValueError(f"partial_rotary_factor must be a number in (0, 1], got {fraction!r}")
    return float(fraction)


def model_spec(config: Mapping[str, Any], name: str) -> ModelSpec:
    """The ModelSpec of a dense Qwen3.5 config.json."""
    return hybrid_model_spec(config, name, model_type=MODEL_TYPE, text_defaults=TEXT_DEFAULTS,
                             feed_forward=dense_feed_forward)


FAMILY = PlannerFamily(model_type=MODEL_TYPE, model_spec=model_spec, encoder="vision",
                       image_pixels=qwen3_vl.IMAGE_PIXELS, video=qwen3_vl.VIDEO, configs=qwen3_5_configs.CONFIGS)
"""The planner's half of the family: Qwen3-VL's tower and processors (planner.contract.families.family)."""
