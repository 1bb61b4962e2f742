"""Qwen3.5 / Qwen3.6 on the runtime: Qwen3-VL's vision tower without DeepStack (a learned position table resampled to
each image's grid, every block attending whole images or temporal groups, one merged tensor handed over) and a
hybrid decoder: gated full-attention layers (q_proj doubled per head for a sigmoid output gate, q/k RMSNorm per
head) among Gated DeltaNet linear-attention layers, which run by segments and split both head kinds under TP
(runtime.models.linear_attention). The checkpoints' multi-token-prediction layers are not built (transformers
skips ``mtp.*`` on load): they are neither trained nor saved."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import Qwen3_5ForConditionalGeneration

from runtime.models.families import qwen3_vl
from runtime.models.families.family import RuntimeFamily
from runtime.models.linear_attention import GatedDeltaNetParallel, linear_attention_row_order, run_by_segments
from runtime.models.vision import VisionEncoder, VisionHooks, VisionShard, blocks_forward

LLM_LAYER_TP_PLAN = {**qwen3_vl.LLM_LAYER_TP_PLAN, "linear_attn": GatedDeltaNetParallel()}
"""Gated attention's per-head q/k norms as Qwen3's; a linear-attention layer split over both of its head kinds."""


def handoff_tensors(config: Any) -> int:
    """One merged tensor per image token (no DeepStack)."""
    return 1


def vision_tp_plans(visual: nn.Module) -> list[tuple[nn.Module, dict]]:
    """Every block's plan and the merger's (Qwen3-VL's, without DeepStack mergers)."""
    return [(block, qwen3_vl.BLOCK_TP_PLAN) for block in visual.blocks] + [(visual.merger, qwen3_vl.MERGER_TP_PLAN)]


def vision_forward(visual: nn.Module, shard: VisionShard) -> torch.Tensor:
    """Merged tokens [m, D_llm] of this rank's patches, in merge-unit order (``Qwen3_5VisionModel.forward``)."""
    hidden = visual.patch_embed(shard.pixel_values_nP)
    taps, weights = shard.patch_inputs["interp_indices"], shard.patch_inputs["interp_weights"]
    hidden = hidden + (visual.pos_embed(taps) * weights[:, :, None]).sum(1).to(hidden.dtype)
    return visual.merger(blocks_forward(visual, shard, hidden))


def prepare_llm(llm: nn.Module, module: Any) -> None:
    """Every linear-attention layer runs by segments (``run_by_segments``) on the kernel the plan's ``module``
    priced (a plan before schema version 9 records none: transformers' torch fallback)."""
    for layer in llm.language_model.layers:
        if hasattr(layer, "linear_attn"):
            run_by_segments(layer.linear_attn, module.linear_attention or "torch")


VISION_HOOKS = VisionHooks(tp_plans=vision_tp_plans, patch_inputs=qwen3_vl.vision_patch_inputs,
                           forward=vision_forward, image_normalization=qwen3_vl.IMAGE_NORMALIZATION)
"""The tower's hooks (Qwen3.5-MoE has the same tower)."""
FAMILY = RuntimeFamily(model_type="qwen3_5", model_class=Qwen3_5ForConditionalGeneration,
                       encoder=VisionEncoder(VISION_HOOKS), handoff_tensors=handoff_tensors,
                       llm_layer_tp_plan=LLM_LAYER_TP_PLAN, prepare_llm=prepare_llm,
                       llm_row_order=linear_attention_row_order)
"""The runtime's half of the family (runtime.models.families.family)."""
