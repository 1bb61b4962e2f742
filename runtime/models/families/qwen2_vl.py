"""Qwen2-VL on the runtime: as Qwen2.5-VL, but every vision block attends whole images and its MLP is fc1/fc2."""

from __future__ import annotations

import sys

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import Qwen2VLForConditionalGeneration

from runtime.models.vision import VisionEncoder
from runtime.models.families.qwen2_5_vl import (
    IMAGE_NORMALIZATION,
    MERGER_TP_PLAN,
    handoff_tensors,
    vision_forward,
    vision_patch_inputs,
)

MODEL_TYPE = "qwen2_vl"
MODEL_CLASS = Qwen2VLForConditionalGeneration
ENCODER = VisionEncoder(sys.modules[__name__])
"""The runtime's encoder interface (runtime.models.vision) over this module's vision hooks."""
BLOCK_TP_PLAN = {
    "attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
    "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel(),
}
"""A vision block: attention heads and the MLP's width split."""
LLM_LAYER_TP_PLAN: dict = {}
"""Nothing beyond the common decoder-layer plan."""
__all__ = ["MODEL_TYPE", "MODEL_CLASS", "ENCODER", "IMAGE_NORMALIZATION", "LLM_LAYER_TP_PLAN", "handoff_tensors",
           "vision_forward", "vision_patch_inputs", "vision_tp_plans"]


def vision_tp_plans(visual: nn.Module) -> list[tuple[nn.Module, dict]]:
    """Every block's plan and the merger's."""
    return [(block, BLOCK_TP_PLAN) for block in visual.blocks] + [(visual.merger, MERGER_TP_PLAN)]
