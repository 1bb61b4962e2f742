"""Qwen3-VL-MoE on the runtime: Qwen3-VL's vision tower and hand-off (runtime.models.families.qwen3_vl) with a decoder
whose MLPs are routed mixtures of experts (``Qwen3VLMoeTextSparseMoeBlock``: a top-k router and the experts' fused
3-D weights). The router stays whole on every TP rank; the experts are split over the EP group
(runtime.parallel.experts), never by the dense TP plan."""

from __future__ import annotations

from transformers import Qwen3VLMoeForConditionalGeneration

from runtime.models.families import qwen3_vl
from runtime.models.families.family import RuntimeFamily
from runtime.models.vision import VisionEncoder

FAMILY = RuntimeFamily(model_type="qwen3_vl_moe", model_class=Qwen3VLMoeForConditionalGeneration,
                       encoder=VisionEncoder(qwen3_vl.VISION_HOOKS), handoff_tensors=qwen3_vl.handoff_tensors,
                       llm_layer_tp_plan=qwen3_vl.LLM_LAYER_TP_PLAN)
"""The runtime's half of the family: Qwen3-VL's tower, hooks, hand-off and decoder-layer plan."""
