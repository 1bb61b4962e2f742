"""Qwen3-VL on the runtime: ``model.model.visual`` adds a learned position table, resampled to each image's grid,
to the patch embeddings; every block attends whole images (or temporal groups); the features after the blocks in
``deepstack_visual_indexes`` go through their own mergers (DeepStack). The hand-off row of an image token is the
merged output followed by one feature per level; the LLM adds feature ``k`` to the output of decoder layer ``k`` at
the image positions (runtime.models.model ``decoder_forward``). The Qwen3 decoder normalises q and k per head."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import Qwen3VLForConditionalGeneration
from transformers.vision_utils import get_vision_interpolation_indices_and_weights

from runtime.parallel.tensor_parallel import ReplicatedWeightSummedGradients
from runtime.models.families.family import RuntimeFamily
from runtime.models.vision import VisionEncoder, VisionHooks, VisionShard, blocks_forward

BLOCK_TP_PLAN = {
    "attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
    "mlp.linear_fc1": ColwiseParallel(), "mlp.linear_fc2": RowwiseParallel(),
}
"""A vision block: attention heads and the MLP's width split (torchtitan's Qwen3-VL vision plan)."""
MERGER_TP_PLAN = {"linear_fc1": ColwiseParallel(), "linear_fc2": RowwiseParallel()}
"""The merger's and each DeepStack merger's two-layer MLP (their norms stay replicated)."""
IMAGE_NORMALIZATION = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
"""(image_mean, image_std) of the checkpoints' preprocessor_config.json (docs/research/qwen3-vl.md), not the image
processor class's CLIP defaults."""
LLM_LAYER_TP_PLAN = {
    "self_attn.q_norm": ReplicatedWeightSummedGradients(),
    "self_attn.k_norm": ReplicatedWeightSummedGradients(),
}
"""q/k RMSNorms over each head's width: their input is the rank's own heads, so the weight stays whole and its
gradient, each rank's share, is summed over TP."""
POSITION_INTERPOLATION = dict(mode="bilinear", align_corners=True)
"""How ``Qwen3VLVisionModel`` resamples its square position table (``interpolation_mode``,
``interpolation_align_corners``)."""


def handoff_tensors(config: Any) -> int:
    """The merged output and one feature per DeepStack level."""
    return 1 + len(config.vision_config.deepstack_visual_indexes)


def vision_tp_plans(visual: nn.Module) -> list[tuple[nn.Module, dict]]:
    """Every block's plan, the merger's and each DeepStack merger's."""
    mergers = [visual.merger, *visual.deepstack_merger_list]
    return [(block, BLOCK_TP_PLAN) for block in visual.blocks] + [(m, MERGER_TP_PLAN) for m in mergers]


def vision_patch_inputs(grid_thw: torch.Tensor, config: Any) -> dict[str, torch.Tensor]:
    """Each patch's 4 taps into the position table and their bilinear weights, in patch (merge-unit) order."""
    indices, weights = get_vision_interpolation_indices_and_weights(
        grid_thw, num_grid_per_side=math.isqrt(config.num_position_embeddings),
        spatial_merge_size=config.spatial_merge_size, **POSITION_INTERPOLATION)
    return {"interp_indices": indices, "interp_weights": weights}


def vision_forward(visual: nn.Module, shard: VisionShard) -> torch.Tensor:
    """Hand-off rows [m, (1 + levels) * D_llm] of this rank's patches, in merge-unit order: the merged output, then
    the DeepStack features in block order (each from its merger, ``Qwen3VLVisionModel.forward``)."""
    hidden = visual.patch_embed(shard.pixel_values_nP)
    taps, weights = shard.patch_inputs["interp_indices"], shard.patch_inputs["interp_weights"]
    hidden = hidden + (visual.pos_embed(taps) * weights[:, :, None]).sum(1).to(hidden.dtype)
    levels = list(visual.deepstack_visual_indexes)
    features = []

    def take_feature(index: int, block_output: torch.Tensor) -> None:
        if index in levels:
            features.append(visual.deepstack_merger_list[levels.index(index)](block_output))

    hidden = blocks_forward(visual, shard, hidden, after_block=take_feature)
    return torch.cat([visual.merger(hidden), *features], dim=-1)


VISION_HOOKS = VisionHooks(tp_plans=vision_tp_plans, patch_inputs=vision_patch_inputs, forward=vision_forward,
                           image_normalization=IMAGE_NORMALIZATION)
"""The tower's hooks (Qwen3-VL-MoE has the same tower)."""
FAMILY = RuntimeFamily(model_type="qwen3_vl", model_class=Qwen3VLForConditionalGeneration,
                       encoder=VisionEncoder(VISION_HOOKS), handoff_tensors=handoff_tensors,
                       llm_layer_tp_plan=LLM_LAYER_TP_PLAN)
"""The runtime's half of the family (runtime.models.families.family)."""
