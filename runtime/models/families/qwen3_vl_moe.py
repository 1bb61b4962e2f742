"""Qwen3-VL-MoE on the runtime: Qwen3-VL's vision tower and hand-off (runtime.models.families.qwen3_vl) with a decoder
whose MLPs are routed mixtures of experts (``Qwen3VLMoeTextSparseMoeBlock``: a top-k router and the experts' fused
3-D weights). The router stays whole on every TP rank; the experts are split over the EP group
(runtime.parallel.experts), never by the dense TP plan."""

from __future__ import annotations

import sys

from transformers import Qwen3VLMoeForConditionalGeneration

from runtime.models.families import qwen3_vl
from runtime.models.vision import VisionEncoder

MODEL_TYPE = "qwen3_vl_moe"
MODEL_CLASS = Qwen3VLMoeForConditionalGeneration
ENCODER = VisionEncoder(sys.modules[__name__])
"""The runtime's encoder interface (runtime.models.vision) over Qwen3-VL's vision hooks (the same tower)."""
IMAGE_NORMALIZATION = qwen3_vl.IMAGE_NORMALIZATION
LLM_LAYER_TP_PLAN = qwen3_vl.LLM_LAYER_TP_PLAN
handoff_tensors = qwen3_vl.handoff_tensors
vision_tp_plans = qwen3_vl.vision_tp_plans
vision_patch_inputs = qwen3_vl.vision_patch_inputs
vision_forward = qwen3_vl.vision_forward
