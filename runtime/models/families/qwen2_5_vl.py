"""Qwen2.5-VL on the runtime: ``model.model.visual`` (window and full-attention blocks, gated MLPs, an
``nn.Sequential`` merger MLP) hands one merged tensor to ``model.model.language_model``."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import Qwen2_5_VLForConditionalGeneration

from runtime.data.normalization import IMAGE_NORMALIZATIONS
from runtime.models.vision import VisionEncoder, VisionShard, blocks_forward

MODEL_TYPE = "qwen2_5_vl"
MODEL_CLASS = Qwen2_5_VLForConditionalGeneration
ENCODER = VisionEncoder(sys.modules[__name__])
"""The runtime's encoder interface (runtime.models.vision) over this module's vision hooks."""
BLOCK_TP_PLAN = {
    "attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel(),
}
"""A vision block: attention heads and the gated MLP's width split (Megatron-LM, Shoeybi et al. 2019)."""
MERGER_TP_PLAN = {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
"""The merger's two-layer MLP."""
IMAGE_NORMALIZATION = IMAGE_NORMALIZATIONS[MODEL_TYPE]
"""(image_mean, image_std) of the checkpoints' preprocessor_config.json: CLIP's."""
LLM_LAYER_TP_PLAN: dict = {}
"""Nothing beyond the common decoder-layer plan."""


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
