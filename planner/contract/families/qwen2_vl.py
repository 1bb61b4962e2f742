"""Qwen2-VL (transformers ``Qwen2VLForConditionalGeneration``): a full-attention LayerNorm/GELU vision tower merged
2x2 into a Qwen2 decoder with M-RoPE."""

from __future__ import annotations

from typing import Any, Mapping

from planner.contract.families import qwen2_vl_configs
from planner.contract.families.family import PlannerFamily
from planner.contract.families.fields import heads_divide, ints
from planner.contract.families.qwen_parts import (
    QWEN2_VL_IMAGE_PIXELS,
    QWEN2_VL_VIDEO,
    merger_layer,
    patch_embed_layer,
    qwen2_vl_style_spec,
)
from planner.contract.models import AttentionSpec, LayerSpec, MlpSpec, ModelSpec, ModuleSpec
from planner.contract.param_counts import layer_norm_params, qwen2_vl_vision_block_params

MODEL_TYPE = "qwen2_vl"
VISION_DEFAULTS: dict[str, Any] = {
    "depth": 32, "embed_dim": 1280, "hidden_size": 3584, "mlp_ratio": 4, "num_heads": 16, "in_channels": 3,
    "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
}
"""transformers ``Qwen2VLVisionConfig`` defaults (``hidden_size`` is the merger's output width)."""


def vision_module(v: Mapping[str, Any]) -> ModuleSpec:
    """The vision tower: patch embed, full-attention LayerNorm/GELU blocks, merger."""
    depth, dim, heads, merge, out_dim = ints(v, "depth embed_dim num_heads spatial_merge_size hidden_size",
                                             "vision_config")
    ratio = v["mlp_ratio"]
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or ratio <= 0:
        raise ValueError(f"vision_config.mlp_ratio must be a positive number, got {ratio!r}")
    mlp_hidden = int(dim * ratio)
    attention = AttentionSpec(num_heads=heads, num_kv_heads=heads, head_dim=heads_divide(dim, heads, "vision_config"),
                              causal=False)
    block = LayerSpec(
        kind="vision_block", name="full_block", count=depth, params=qwen2_vl_vision_block_params(dim, mlp_hidden),
        hidden_size=dim, attention=attention, mlp=MlpSpec(intermediate_size=mlp_hidden, gated=False),
    )
    merger = merger_layer(dim, out_dim, merge, layer_norm_params(dim))
    return ModuleSpec(name="vision", layers=(patch_embed_layer(v, dim), block, merger))


def model_spec(config: Mapping[str, Any], name: str) -> ModelSpec:
    """The ModelSpec of a Qwen2-VL config.json."""
    return qwen2_vl_style_spec(config, name, model_type=MODEL_TYPE, vision_defaults=VISION_DEFAULTS,
                               vision_module=vision_module, window=False)


FAMILY = PlannerFamily(model_type=MODEL_TYPE, model_spec=model_spec, encoder="vision", image_pixels=QWEN2_VL_IMAGE_PIXELS,
                       video=QWEN2_VL_VIDEO, configs=qwen2_vl_configs.CONFIGS)
"""The planner's half of the family (planner.contract.families.family)."""
