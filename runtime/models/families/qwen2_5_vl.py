"""Qwen2.5-VL on the runtime: ``model.model.visual`` (window and full-attention blocks, gated MLPs, an
``nn.Sequential`` merger MLP) hands one merged tensor to ``model.model.language_model``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import Qwen2_5_VLForConditionalGeneration
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from runtime.models.families.family import RuntimeFamily
from runtime.models.vision import VisionEncoder, VisionHooks, VisionShard, blocks_forward

BLOCK_TP_PLAN = {
    "attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
}
"""A vision block: attention heads and the gated MLP's width split (Megatron-LM, Shoeybi et al. 2019)."""
MERGER_TP_PLAN = {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
"""The merger's two-layer MLP."""
IMAGE_NORMALIZATION = (tuple(OPENAI_CLIP_MEAN), tuple(OPENAI_CLIP_STD))
"""(image_mean, image_std) of the checkpoints' preprocessor_config.json: CLIP's."""


def handoff_tensors(config: Any) -> int:
    """One merged tensor per image token."""
    return 1


def vision_tp_plans(visual: nn.Module) -> list[tuple[nn.Module, dict]]:
    """Every block's plan and the merger's."""
    return [(block, BLOCK_TP_PLAN) for block in visual.blocks] + [(visual.merger, MERGER_TP_PLAN)]


def vision_patch_inputs(grid_thw: torch.Tensor, config: Any) -> dict[str, torch.Tensor]:
    """None besides pixels and rotary positions."""
    return {}


def vision_forward(visual: nn.Module, shard: VisionShard) -> torch.Tensor:
    """Merged tokens [m, D_llm] of this rank's windows, in window order."""
    hidden = blocks_forward(visual, shard, visual.patch_embed(shard.pixel_values_nP))
    return visual.merger(hidden)


FAMILY = RuntimeFamily(
    model_type="qwen2_5_vl", model_class=Qwen2_5_VLForConditionalGeneration, handoff_tensors=handoff_tensors,
    llm_layer_tp_plan={},
    encoder=VisionEncoder(VisionHooks(tp_plans=vision_tp_plans, patch_inputs=vision_patch_inputs,
                                      forward=vision_forward, image_normalization=IMAGE_NORMALIZATION)),
)
"""The runtime's half of the family (runtime.models.families.family); its decoder layers take the common TP plan."""
