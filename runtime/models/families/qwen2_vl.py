"""Qwen2-VL on the runtime: as Qwen2.5-VL, but every vision block attends whole images and its MLP is fc1/fc2."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import Qwen2VLForConditionalGeneration

from runtime.models.families.family import RuntimeFamily
from runtime.models.vision import VisionEncoder, VisionHooks
from runtime.models.families.qwen2_5_vl import (
    IMAGE_NORMALIZATION,
    MERGER_TP_PLAN,
    handoff_tensors,
    vision_forward,
    vision_patch_inputs,
)

BLOCK_TP_PLAN = {
    "attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
    "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel(),
}
"""A vision block: attention heads and the MLP's width split."""


def vision_tp_plans(visual: nn.Module) -> list[tuple[nn.Module, dict]]:
    """Every block's plan and the merger's."""
    return [(block, BLOCK_TP_PLAN) for block in visual.blocks] + [(visual.merger, MERGER_TP_PLAN)]


FAMILY = RuntimeFamily(
    model_type="qwen2_vl", model_class=Qwen2VLForConditionalGeneration, handoff_tensors=handoff_tensors,
    llm_layer_tp_plan={},
    encoder=VisionEncoder(VisionHooks(tp_plans=vision_tp_plans, patch_inputs=vision_patch_inputs,
                                      forward=vision_forward, image_normalization=IMAGE_NORMALIZATION)),
)
"""The runtime's half of the family: Qwen2.5-VL's forward, merger and processor with Qwen2-VL's blocks."""
