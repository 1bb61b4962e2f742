"""The model catalog against the real transformers models (built on the meta device: no memory, no weights)."""

from __future__ import annotations

import copy
import functools
import json
import math
import subprocess
import sys

import pytest
import torch
import transformers

from planner.contract import param_counts
from planner.contract.families import (qwen2_5_vl, qwen2_audio, qwen2_vl, qwen3_5, qwen3_5_moe, qwen3_vl, qwen3_vl_moe,
                                      qwen_parts)
from planner.catalog import CATALOG, get_model, list_models, model_from_hf_config

HF_CLASSES = {
    "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration),
    "qwen2_vl": (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration),
    "qwen2_audio": (transformers.Qwen2AudioConfig, transformers.Qwen2AudioForConditionalGeneration),
    "qwen3_vl": (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration),
    "qwen3_vl_moe": (transformers.Qwen3VLMoeConfig, transformers.Qwen3VLMoeForConditionalGeneration),
    "qwen3_5": (transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration),
    "qwen3_5_moe": (transformers.Qwen3_5MoeConfig, transformers.Qwen3_5MoeForConditionalGeneration),
}


def hf_config(config: dict) -> transformers.PreTrainedConfig:
    """The transformers config object of a config.json dict."""
    config_class, _ = HF_CLASSES[config["model_type"]]
    return config_class.from_dict(copy.deepcopy(config))


@functools.cache
def hf_model(name: str) -> torch.nn.Module:
    """The transformers model of a catalog entry, on the meta device."""
    config = CATALOG[name].config
    _, model_class = HF_CLASSES[config["model_type"]]
    with torch.device("meta"):
        return model_class(hf_config(config))


def count(module: torch.nn.Module) -> int:
    """Parameters of a module (shared tensors once)."""
    return sum(p.numel() for p in module.parameters())


def is_tied(model: torch.nn.Module) -> bool:
    """Whether lm_head shares the embedding tensor."""
    return model.lm_head.weight is model.model.language_model.embed_tokens.weight


def hf_module_counts(model: torch.nn.Module) -> dict[str, int]:
    """Per planner module, the transformers count (encoder incl. merger/projector; llm without lm_head)."""
    counts = {"llm": count(model.model.language_model), "lm_head": 0 if is_tied(model) else count(model.lm_head)}
    if hasattr(model.model, "visual"):
        counts["vision"] = count(model.model.visual)
    else:
        counts["audio"] = count(model.model.audio_tower) + count(model.model.multi_modal_projector)
    counts["total"] = count(model)
    return counts


def planner_module_counts(spec) -> dict[str, int]:
    """The same breakdown from a ModelSpec."""
    lm_head = spec.module("llm").layer("lm_head").params
    counts = {m.name: m.num_params for m in spec.modules}
    counts["llm"] -= lm_head
    return {**counts, "lm_head": lm_head, "total": spec.num_params}


@pytest.mark.parametrize("name", list(CATALOG))
def test_module_counts_match_transformers(name):
    model, spec = hf_model(name), get_model(name)
    assert planner_module_counts(spec) == hf_module_counts(model)
    assert spec.tie_word_embeddings == is_tied(model)


def hf_layer_counts(model: torch.nn.Module) -> dict[str, int]:
    """One instance of each planner layer type, counted on the transformers model."""
    lm = model.model.language_model
    counts = {"embedding": count(lm.embed_tokens), "final_norm": count(lm.norm)}
    for layer in lm.layers:  # Qwen3.5's hybrid decoder: the first layer of each block type
        linear = getattr(layer, "block_type", None) == "linear_attention"
        counts.setdefault("linear_decoder_layer" if linear else "decoder_layer", count(layer))
    if hasattr(model.model, "visual"):
        visual = model.model.visual
        full = set(getattr(visual, "fullatt_block_indexes", range(len(visual.blocks))))
        window = [i for i in range(len(visual.blocks)) if i not in full]
        counts |= {"patch_embed": count(visual.patch_embed), "full_block": count(visual.blocks[min(full)]),
                   "patch_merger": count(visual.merger)}
        if hasattr(visual, "pos_embed"):  # Qwen3-VL: the learned position table counts with the patchifier
            counts["patch_embed"] += count(visual.pos_embed)
        for merger in getattr(visual, "deepstack_merger_list", [])[:1]:
            counts["deepstack_merger"] = count(merger)
        if window:
            counts["window_block"] = count(visual.blocks[window[0]])
    else:
        audio = model.model.audio_tower
        counts |= {
            "audio_conv": count(audio.conv1) + count(audio.conv2) + count(audio.embed_positions),
            "audio_block": count(audio.layers[0]),
            "audio_projector": count(audio.layer_norm) + count(model.model.multi_modal_projector),
        }
    return counts


@pytest.mark.parametrize("name", list(CATALOG))
def test_layer_counts_match_transformers(name):
    model, spec = hf_model(name), get_model(name)
    ours = {layer.name: layer.params for m in spec.modules for layer in m.layers if layer.kind != "lm_head"}
    assert ours == hf_layer_counts(model)


def test_qwen2_5_vl_32b_published_counts():
    spec = get_model("qwen-vl-32b")
    assert spec.module("vision").num_params == 688_841_984
    assert spec.module("llm").num_params - spec.module("llm").layer("lm_head").params == 31_985_308_672
    assert spec.module("llm").layer("lm_head").params == 778_567_680
    assert spec.num_params == 33_452_718_336


def test_qwen3_vl_published_counts():
    """The safetensors total of Qwen3-VL-8B-Instruct (750 tensors, docs/research/qwen3-vl.md source S8), and the
    2B's: its 4.26 GB bf16 file holds 2,127,532,032 parameters (tied lm_head once)."""
    assert get_model("Qwen/Qwen3-VL-8B-Instruct").num_params == 8_767_123_696
    assert get_model("qwen3-vl-2b").num_params == 2_127_532_032
    vision = get_model("qwen3-vl-32b").module("vision")
    assert vision.layer("deepstack_merger").count == 3
    assert vision.layer("deepstack_merger").params * 3 == 134_536_704


def test_qwen3_5_27b_published_count():
    """Qwen/Qwen3.6-27B's safetensors hold 27,781,427,952 parameters (1,199 tensors; the config file's sources in
    planner/contract/families/qwen3_5_configs.py): the built model plus its one MTP layer (``mtp.*``), which
    transformers skips on load and the planner counts apart."""
    for name in ("qwen3.5-27b", "Qwen/Qwen3.6-27B"):
        spec = get_model(name)
        assert spec.num_params + spec.unbuilt_params == 27_781_427_952
    assert spec.unbuilt_params == 424_699_392
    llm = spec.module("llm")
    assert (llm.layer("linear_decoder_layer").count, llm.layer("decoder_layer").count) == (48, 16)
    assert llm.layer_order[:4] == ("linear_decoder_layer",) * 3 + ("decoder_layer",)


def test_qwen3_5_layers_by_hand():
    """One Qwen3.6-27B linear-attention layer, from the checkpoint's tensor shapes: in_proj_qkv [10240, 5120],
    in_proj_z [6144, 5120], in_proj_a / in_proj_b [48, 5120], conv1d [10240, 1, 4], dt_bias / A_log [48], norm [128],
    out_proj [5120, 6144]; one full-attention layer: q_proj [12288, 5120], k/v [1024, 5120], o [5120, 6144], q/k norm
    [256]; each with the MLP (3 x 17408 x 5120) and two RMSNorms [5120]."""
    mlp_and_norms = 3 * 17408 * 5120 + 2 * 5120
    linear = 10240 * 5120 + 6144 * 5120 + 2 * 48 * 5120 + 10240 * 4 + 2 * 48 + 128 + 5120 * 6144
    full = 12288 * 5120 + 2 * 1024 * 5120 + 5120 * 6144 + 2 * 256
    llm = get_model("qwen3.5-27b").module("llm")
    assert llm.layer("linear_decoder_layer").params == linear + mlp_and_norms
    assert llm.layer("decoder_layer").params == full + mlp_and_norms


def test_qwen3_5_refuses_what_it_cannot_build():
    config = copy.deepcopy(CATALOG["qwen3.5-tiny"].config)
    config["text_config"]["linear_num_value_heads"] = 3
    assert_one_line_error(r"3 linear-attention value heads are not a multiple of 2 key heads", get_model_of, config)
    config = copy.deepcopy(CATALOG["qwen3.5-tiny"].config)
    config["text_config"]["layer_types"] = ["linear_attention"] * 3
    assert_one_line_error(r"layer_types must give one of .* for each of the 4 layers", get_model_of, config)
    config["text_config"]["layer_types"] = ["linear_attention"] * 4
    assert_one_line_error(r"layer_types has no full_attention layer", get_model_of, config)
    config = copy.deepcopy(CATALOG["qwen3.5-tiny"].config)
    config["text_config"]["rope_parameters"]["mrope_section"] = [8, 4, 4]
    assert_one_line_error(r"mrope_section .* half the decoder's rotary width \(4\)", get_model_of, config)


def get_model_of(config: dict):
    """The spec of a config.json dict."""
    return model_from_hf_config(config, "x")


@pytest.mark.parametrize(("ours", "config_class"), [(qwen3_5.TEXT_DEFAULTS, transformers.Qwen3_5TextConfig),
                                                    (qwen3_5_moe.TEXT_DEFAULTS, transformers.Qwen3_5MoeTextConfig)])
def test_qwen3_5_defaults_are_the_transformers_defaults(ours, config_class):
    """Field defaults as the class's; the keys its ``__post_init__`` consumes by their effect: layer_types every 4th
    full attention, rotary on a quarter of the head; ``mtp_num_hidden_layers`` transformers does not read."""
    theirs = config_class(num_hidden_layers=8)
    derived = {"full_attention_interval", "partial_rotary_factor", "mtp_num_hidden_layers"}
    assert {key: getattr(config_class(), key) for key in ours if key not in derived} == {
        key: value for key, value in ours.items() if key not in derived}
    assert theirs.layer_types == qwen3_5.layer_types({**ours, "num_hidden_layers": 8, "layer_types": None})
    assert theirs.rope_parameters["partial_rotary_factor"] == ours["partial_rotary_factor"]
    assert not hasattr(theirs, "mtp_num_hidden_layers") and ours["mtp_num_hidden_layers"] == 0


def test_qwen3_vl_formulas_by_hand():
    """Qwen3-VL-8B shapes summed from the module printout: the decoder layer has no biases but q/k norms of one
    head's width; the DeepStack merger normalises the 4x merged width, the merger the block width."""
    q, kv, o = 4096 * 4096, 4096 * 1024, 4096 * 4096
    layer = q + 2 * kv + o + 2 * 128 + 3 * 4096 * 12288 + 2 * 4096
    assert qwen3_vl.decoder_layer_params(4096, 32, 8, 128, 12288) == layer
    vision = get_model("qwen3-vl-8b").module("vision")
    fc = 4608 * 4608 + 4608 + 4608 * 4096 + 4096
    assert vision.layer("patch_merger").params == 2 * 1152 + fc
    assert vision.layer("deepstack_merger").params == 2 * 4608 + fc
    assert vision.layer("patch_embed").params == 3 * 2 * 16 * 16 * 1152 + 1152 + 2304 * 1152
    spec = get_model("qwen3-vl-8b")
    assert spec.injection_layers == (0, 1, 2) and spec.handoff_tensors == 4
    assert spec.vision_input.window_size is None and spec.vision_input.patch_size == 16


def test_qwen3_vl_refuses_deepstack_it_cannot_build():
    config = copy.deepcopy(CATALOG["qwen3-vl-tiny"].config)
    config["vision_config"]["deepstack_visual_indexes"] = [1, 9]
    assert_one_line_error("deepstack_visual_indexes must be distinct block indexes below the depth 4",
                          model_from_hf_config, config, "x")
    config["vision_config"]["deepstack_visual_indexes"] = [0, 1, 2]
    config["text_config"]["num_hidden_layers"] = 2
    assert_one_line_error("3 DeepStack levels need at least 3 decoder layers", model_from_hf_config, config, "x")


def test_qwen3_vl_key_value_heads_default_to_transformers_32():
    """A Qwen3-VL config without num_key_value_heads gets transformers' 32, whatever its query heads: 64 heads share
    32 KV heads (counted as transformers builds them), and 4 heads cannot (transformers' forward would fail)."""
    config = copy.deepcopy(CATALOG["qwen3-vl-32b"].config)
    del config["text_config"]["num_key_value_heads"]
    spec = model_from_hf_config(config, "x")
    assert spec.module("llm").layer("decoder_layer").attention.num_kv_heads == 32
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextDecoderLayer

    with torch.device("meta"):
        layer = Qwen3VLTextDecoderLayer(hf_config(config).text_config, layer_idx=0)
    assert count(layer) == spec.module("llm").layer("decoder_layer").params
    tiny = copy.deepcopy(CATALOG["qwen3-vl-tiny"].config)
    del tiny["text_config"]["num_key_value_heads"]
    assert_one_line_error("4 attention heads are not a multiple of 32 key/value heads", model_from_hf_config, tiny, "x")


def test_qwen3_vl_moe_published_counts():
    """The safetensors totals of Qwen3-VL-30B-A3B-Instruct (882 tensors) and -235B-A22B-Instruct (1,388 tensors),
    docs/research/qwen3-vl.md sources S30 and S235, and their experts' share (section 2)."""
    for name, total, experts in (("qwen3-vl-30b-a3b", 31_070_754_032, 28_991_029_248),
                                 ("Qwen/Qwen3-VL-235B-A22B-Instruct", 235_670_022_896, 227_096_395_776)):
        spec = get_model(name)
        block = spec.module("llm").layer("decoder_layer")
        assert spec.num_params == total
        assert block.moe.expert_params * block.count == experts
        assert block.mlp is None and not spec.tie_word_embeddings and spec.handoff_tensors == 4


def test_qwen3_vl_moe_layer_by_hand():
    """30B-A3B's decoder layer from the tensor table: q 2048x4096, k/v 2048x512, o 4096x2048, q/k norms of 128, two
    RMSNorms of 2048, router [128, 2048], experts gate_up [128, 1536, 2048] and down [128, 2048, 768]."""
    attention = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 2 * 128 + 2 * 2048
    experts = 128 * 1536 * 2048 + 128 * 2048 * 768
    block = get_model("qwen3-vl-30b-a3b").module("llm").layer("decoder_layer")
    assert block.params == attention + 128 * 2048 + experts
    assert (block.moe.num_experts, block.moe.experts_per_token, block.moe.expert_intermediate_size) == (128, 8, 768)


def test_qwen3_vl_moe_dense_layers_match_transformers():
    """``mlp_only_layers`` and ``decoder_sparse_step`` keep layers dense, as transformers builds them: with step 2
    and layer 1 listed, of 4 layers only layer 3 routes to experts."""
    config = copy.deepcopy(CATALOG["qwen3-vl-moe-tiny"].config)
    config["text_config"].update(decoder_sparse_step=2, mlp_only_layers=[1])
    spec = model_from_hf_config(config, "x")
    llm = spec.module("llm")
    assert (llm.layer("decoder_layer").count, llm.layer("dense_decoder_layer").count) == (1, 3)
    _, model_class = HF_CLASSES["qwen3_vl_moe"]
    with torch.device("meta"):
        model = model_class(hf_config(config))
    layers = model.model.language_model.layers
    assert llm.layer("decoder_layer").params == count(layers[3])
    assert llm.layer("dense_decoder_layer").params == count(layers[0])
    assert spec.num_params == count(model)


def test_qwen3_vl_moe_refuses_what_it_cannot_build():
    config = copy.deepcopy(CATALOG["qwen3-vl-moe-tiny"].config)
    config["text_config"]["num_experts_per_tok"] = 9
    assert_one_line_error("num_experts_per_tok = 9 exceeds the 8 experts", model_from_hf_config, config, "x")
    config["text_config"].update(num_experts_per_tok=2, mlp_only_layers=[0, 1, 2, 3])
    assert_one_line_error("no decoder layer routes to experts", model_from_hf_config, config, "x")


DECODER_ONLY = {
    "llama_biased_gqa": dict(model_type="llama", vocab_size=1000, hidden_size=128, intermediate_size=256,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                             mlp_bias=True),
    "llama_mha_head_dim_from_width": dict(model_type="llama", vocab_size=1000, hidden_size=96, intermediate_size=200,
                                          num_hidden_layers=3, num_attention_heads=3),
    "qwen2_tied": dict(model_type="qwen2", vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3_head_dim_64": dict(model_type="qwen3", vocab_size=1000, hidden_size=128, intermediate_size=256,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
}
"""Decoder-only configs covering each formula's switches (biases, GQA, head_dim, tying)."""


@pytest.mark.parametrize("name", list(DECODER_ONLY))
def test_decoder_only_counts_match_transformers(name):
    config = DECODER_ONLY[name]
    spec = model_from_hf_config(config, name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    assert spec.module_names == ("llm",) and spec.vision_input is None
    assert spec.num_params == count(model)
    assert spec.module("llm").layer("decoder_layer").params == count(model.model.layers[0])


def test_a_decoder_only_file_without_its_widths_is_refused():
    assert_one_line_error("no hidden_size: a llama config.json gives the decoder's widths at its top level",
                          model_from_hf_config, {"model_type": "llama", "vision_config": {}}, "x")


def test_llama_3_1_8b_published_count():
    """meta-llama/Llama-3.1-8B's config.json: 8,030,261,248 parameters (its safetensors total)."""
    config = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)
    assert model_from_hf_config(config, "llama-3.1-8b").num_params == 8_030_261_248


@pytest.mark.parametrize(("model_type", "config_class"), [
    ("llama", transformers.LlamaConfig), ("qwen2", transformers.Qwen2Config), ("qwen3", transformers.Qwen3Config)])
def test_decoder_only_defaults_are_the_transformers_defaults(model_type, config_class):
    from planner.contract.families import text_decoders

    ours = text_decoders.DEFAULTS[model_type]
    theirs = config_class()
    assert {key: getattr(theirs, key) for key in ours} == ours


def test_param_formulas_by_hand():
    """Qwen2.5-VL-32B shapes, summed by hand from the module printout."""
    qkv, proj = 1280 * 3840 + 3840, 1280 * 1280 + 1280
    mlp = 2 * (1280 * 3456 + 3456) + 3456 * 1280 + 1280
    assert param_counts.qwen2_5_vision_block_params(1280, 3456) == qkv + proj + mlp + 2 * 1280 == 19_840_512
    q, kv, o = 5120 * 5120 + 5120, 5120 * 1024 + 1024, 5120 * 5120
    layer = q + 2 * kv + o + 3 * 5120 * 27648 + 2 * 5120
    assert param_counts.qwen2_decoder_layer_params(5120, 40, 8, 128, 27648) == layer == 487_605_248
    assert param_counts.patch_merger_params(1280, 5120, 2, 1280) == 1280 + 2 * (5120 * 5120 + 5120)
    assert param_counts.lm_head_params(2048, 151936, tied=True) == 0


def test_qwen2_5_vl_vision_blocks_split_into_window_and_full():
    vision = get_model("qwen2.5-vl-32b").module("vision")
    assert [(layer.name, layer.count) for layer in vision.layers] == [
        ("patch_embed", 1), ("window_block", 28), ("full_block", 4), ("patch_merger", 1)
    ]
    assert vision.layer("window_block").attention.window_patches == (112 // 14) ** 2
    assert vision.layer("full_block").attention.window_patches is None
    assert vision.layer("window_block").mlp.gated
    assert vision.layer("patch_merger").token_reduction == 4
    assert vision.layer("patch_merger").out_features == 5120


def test_qwen2_vl_has_only_full_attention_gelu_blocks():
    spec = get_model("qwen2-vl-7b")
    assert [layer.name for layer in spec.module("vision").layers] == ["patch_embed", "full_block", "patch_merger"]
    block = spec.module("vision").layer("full_block")
    assert block.count == 32 and not block.mlp.gated and block.mlp.intermediate_size == 5120
    assert spec.vision_input.window_size is None


def test_input_specs():
    vision = get_model("qwen2.5-vl-7b").vision_input
    assert (vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size, vision.window_size) == (
        14, 2, 2, 112
    )
    audio = get_model("qwen2-audio-7b")
    assert audio.vision_input is None and audio.module_names == ("audio", "llm")
    assert (audio.audio_input.encoder_tokens_per_second, audio.audio_input.pool_stride) == (50, 2)
    assert audio.audio_input.max_seconds == 30


@pytest.mark.parametrize(("seconds", "llm_tokens"), [(30, 750), (45, 750 + 375), (10, 250), (0.5, 12), (60, 1500)])
def test_audio_llm_tokens_are_the_processors(seconds, llm_tokens):
    """Hand-calculated: a clip's real mel frames (100 per second) through the stride-2 convolution and the 2x pool,
    e.g. 15 s: 1,500 frames -> 750 positions -> 375 tokens; each pass costs the encoder 1,500 positions whatever its
    length; and transformers' own ``_get_feat_extract_output_lengths`` gives the same."""
    from planner.contract.workload import Workload, module_tokens

    model = get_model("qwen2-audio-7b")
    tokens = module_tokens(Workload(audio_seconds=seconds, text_tokens=8, global_batch=1), model)
    assert tokens["audio"].output_tokens == llm_tokens
    assert tokens["audio"].tokens == 1500 * -(-seconds // 30)
    encoder = transformers.models.qwen2_audio.modeling_qwen2_audio.Qwen2AudioEncoder
    frames = [min(3000, round(seconds * 100) - 3000 * k) for k in range(int(-(-seconds // 30)))]
    _, ours = encoder._get_feat_extract_output_lengths(None, torch.tensor(frames))
    assert int(ours.sum()) == llm_tokens


@pytest.mark.parametrize(
    ("ours", "config_class"),
    [
        (qwen2_5_vl.VISION_DEFAULTS, transformers.Qwen2_5_VLVisionConfig),
        (qwen2_vl.VISION_DEFAULTS, transformers.Qwen2VLVisionConfig),
        (qwen_parts.QWEN_VL_TEXT_DEFAULTS, transformers.Qwen2_5_VLTextConfig),
        (qwen_parts.QWEN_VL_TEXT_DEFAULTS, transformers.Qwen2VLTextConfig),
        (qwen2_audio.TEXT_DEFAULTS, transformers.Qwen2Config),
        (qwen2_audio.ENCODER_DEFAULTS, transformers.Qwen2AudioEncoderConfig),
        (qwen3_vl.VISION_DEFAULTS, transformers.Qwen3VLVisionConfig),
        (qwen3_vl.TEXT_DEFAULTS, transformers.Qwen3VLTextConfig),
        (qwen3_vl_moe.TEXT_DEFAULTS, transformers.Qwen3VLMoeTextConfig),
    ],
)
def test_defaults_are_the_transformers_defaults(ours, config_class):
    theirs = config_class()
    theirs = {key: getattr(theirs, key) for key in ours}
    assert {key: list(v) if isinstance(v, tuple) else v for key, v in theirs.items()} == ours


@pytest.mark.parametrize("name", ["qwen2.5-vl-7b", "qwen2-vl-2b", "qwen2-audio-7b", "qwen2.5-vl-32b", "qwen3-vl-2b",
                                  "qwen3-vl-8b", "qwen3-vl-30b-a3b", "qwen3-vl-moe-tiny", "qwen3.5-27b",
                                  "qwen3.5-moe-tiny"])
def test_transformers_saved_layout_gives_the_same_spec(name):
    """transformers 5 writes text_config/vision_config nested and every default spelled out."""
    saved = hf_config(CATALOG[name].config).to_dict()
    assert "text_config" in saved
    assert planner_module_counts(model_from_hf_config(saved, name)) == planner_module_counts(get_model(name))


def test_config_json_path_and_folder(tmp_path):
    folder = tmp_path / "Qwen2.5-VL-7B-Instruct"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CATALOG["qwen2.5-vl-7b"].config))
    for path in (folder, folder / "config.json"):
        spec = get_model(str(path))
        assert spec.name == "Qwen2.5-VL-7B-Instruct"
        assert spec.modules == get_model("qwen2.5-vl-7b").modules
        assert spec.hf_config == CATALOG["qwen2.5-vl-7b"].config


@pytest.mark.parametrize(
    "alias", ["qwen-vl-32b", "Qwen/Qwen2.5-VL-32B-Instruct", "QWEN2.5-VL-32B-INSTRUCT", " qwen2.5-vl-32b "]
)
def test_aliases(alias):
    assert get_model(alias).name == "qwen2.5-vl-32b"


def test_list_models_lists_every_entry_with_exact_counts():
    listed = {name: (aliases, params) for name, aliases, params, _ in list_models()}
    assert list(listed) == list(CATALOG)
    assert "qwen-vl-32b" in listed["qwen2.5-vl-32b"][0]
    assert all(params == get_model(name).num_params for name, (_, params) in listed.items())


def assert_one_line_error(match: str, call, *args):
    with pytest.raises(ValueError, match=match) as info:
        call(*args)
    assert "\n" not in str(info.value)


def test_unknown_model_suggests_close_names():
    assert_one_line_error(r"unknown model 'qwen-vl-33b'; did you mean .*qwen-vl-32b", get_model, "qwen-vl-33b")
    assert_one_line_error(r"unknown model 'gpt-5'; \(", get_model, "gpt-5")


def test_unsupported_model_type_names_the_supported_ones():
    assert_one_line_error("unsupported model_type 'gpt2'.*qwen2_5_vl, qwen2_vl, qwen3_vl, qwen2_audio, llama, qwen2, "
                          "qwen3", model_from_hf_config, {"model_type": "gpt2"}, "x")


def test_bad_config_files(tmp_path):
    assert_one_line_error("cannot read model config", get_model, str(tmp_path / "missing.json"))
    (tmp_path / "broken.json").write_text("{not json")
    assert_one_line_error("broken.json is not JSON", get_model, str(tmp_path / "broken.json"))
    (tmp_path / "gpt2.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert_one_line_error(f"{tmp_path / 'gpt2.json'}: unsupported model_type 'gpt2'", get_model,
                          str(tmp_path / "gpt2.json"))
    bad = copy.deepcopy(CATALOG["qwen2.5-vl-7b"].config)
    bad["vision_config"]["depth"] = "32"
    assert_one_line_error(r"vision_config.depth must be a positive integer, got '32'", model_from_hf_config, bad, "x")
    bad = {**CATALOG["qwen2.5-vl-7b"].config, "num_attention_heads": 24}
    assert_one_line_error("hidden size 3584 is not divisible by 24", model_from_hf_config, bad, "x")


def tiny_batch(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """One 112x224 image (8x16 patches: two attention windows, 32 merged tokens) and some text."""
    config = model.config
    grid = torch.tensor([[1, 8, 16]])
    patch_width = 3 * config.vision_config.temporal_patch_size * config.vision_config.patch_size**2
    image_tokens = int(grid.prod()) // config.vision_config.spatial_merge_size**2
    text = torch.randint(0, 1000, (8,))
    ids = torch.cat([
        torch.tensor([config.vision_start_token_id]), torch.full((image_tokens,), config.image_token_id),
        torch.tensor([config.vision_end_token_id]), text,
    ]).unsqueeze(0)
    return {"input_ids": ids, "labels": ids.clone(), "image_grid_thw": grid,
            "pixel_values": torch.randn(int(grid.prod()), patch_width)}


def test_tiny_model_runs_a_training_step():
    spec = get_model("qwen2.5-vl-tiny")
    vision = spec.module("vision")
    assert (vision.layer("window_block").count, vision.layer("full_block").count) == (2, 2)
    assert spec.module("llm").layer("decoder_layer").attention.num_kv_heads == 2
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(hf_config(spec.hf_config))
    assert count(model) == spec.num_params
    loss = model(**tiny_batch(model)).loss
    loss.backward()
    assert math.isfinite(loss.item())
    assert model.model.visual.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
    assert model.model.language_model.layers[-1].mlp.down_proj.weight.grad.abs().sum() > 0


def test_catalog_imports_neither_torch_nor_transformers():
    code = (
        "import sys\n"
        "for blocked in ('torch', 'transformers', 'ray'):\n"
        "    sys.modules[blocked] = None\n"
        "from planner.catalog import get_model, list_models\n"
        "assert get_model('qwen-vl-32b').num_params == 33_452_718_336\n"
        "assert len(list_models()) >= 9\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
