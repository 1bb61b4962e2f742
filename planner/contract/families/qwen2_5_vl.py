"""Qwen2.5-VL (transformers ``Qwen2_5_VLForConditionalGeneration``): a window-attention vision tower with a few
full-attention blocks, RMSNorm and SwiGLU, merged 2x2 into a Qwen2 decoder with M-RoPE."""

from __future__ import annotations

from typing import Any, Mapping

from planner.contract.families import qwen2_5_vl_configs
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
from planner.contract.param_counts import qwen2_5_vision_block_params

MODEL_TYPE = "qwen2_5_vl"
VISION_DEFAULTS: dict[str, Any] = {
    "depth": 32, "hidden_size": 3584, "intermediate_size": 3420, "num_heads": 16, "in_channels": 3,
    "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
    "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31],
}
"""transformers ``Qwen2_5_VLVisionConfig`` defaults."""


def _full_attention_blocks(v: Mapping[str, Any], depth: int) -> set[int]:
    """Indexes of the full-attention blocks (``fullatt_block_indexes`` beyond the depth are ignored, as in HF)."""
    indexes = v["fullatt_block_indexes"]
    if not isinstance(indexes, (list, tuple)) or not all(isinstance(i, int) for i in indexes):
        raise ValueError(f"vision_config.fullatt_block_indexes must be a list of integers, got {indexes!r}")
    return {i for i in indexes if 0 <= i < depth}


def vision_module(v: Mapping[str, Any]) -> ModuleSpec:
    """The vision tower: patch embed, window- and full-attention blocks, merger."""
    depth, dim, inter, heads, merge, out_dim, patch, window = ints(
        v, "depth hidden_size intermediate_size num_heads spatial_merge_size out_hidden_size patch_size window_size",
        "vision_config",
    )
    num_full = len(_full_attention_blocks(v, depth))
    head_dim = heads_divide(dim, heads, "vision_config")
    block = dict(kind="vision_block", params=qwen2_5_vision_block_params(dim, inter), hidden_size=dim,
                 mlp=MlpSpec(intermediate_size=inter, gated=True))
    window_side = window // merge // patch * merge  # in patches, whole merge units (vit_merger_window_size)
    windowed = AttentionSpec(num_heads=heads, num_kv_heads=heads, head_dim=head_dim, causal=False,
                             window_patches=window_side**2)
    blocks = [
        LayerSpec(name="window_block", count=depth - num_full, attention=windowed, **block),
        LayerSpec(name="full_block", count=num_full, attention=AttentionSpec(
            num_heads=heads, num_kv_heads=heads, head_dim=head_dim, causal=False), **block),
    ]
    layers = [patch_embed_layer(v, dim), *(b for b in blocks if b.count), merger_layer(dim, out_dim, merge, dim)]
    return ModuleSpec(name="vision", layers=tuple(layers))


def model_spec(config: Mapping[str, Any], name: str) -> ModelSpec:
    """The ModelSpec of a Qwen2.5-VL config.json."""
    return qwen2_vl_style_spec(config, name, model_type=MODEL_TYPE, vision_defaults=VISION_DEFAULTS,
                               vision_module=vision_module, window=True)


FAMILY = PlannerFamily(model_type=MODEL_TYPE, model_spec=model_spec, encoder="vision", image_pixels=QWEN2_VL_IMAGE_PIXELS,
                       video=QWEN2_VL_VIDEO, configs=qwen2_5_vl_configs.CONFIGS)
"""The planner's half of the family (planner.contract.families.family)."""
