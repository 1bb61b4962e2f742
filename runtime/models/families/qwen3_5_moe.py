"""Qwen3.5-MoE on the runtime: Qwen3.5's vision tower, hand-off and hybrid decoder (runtime.models.families.qwen3_5)
with a sparse MoE block in every decoder layer (``Qwen3_5MoeSparseMoeBlock``): a top-k router and fused routed
experts, split over the EP group as Qwen3-VL-MoE's (runtime.parallel.experts), beside a shared expert (a gated MLP,
split by TP like a dense one) scaled by a sigmoid gate (one output: replicated, its inputs and gradient the same on
every TP rank)."""

from __future__ import annotations

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from transformers import Qwen3_5MoeForConditionalGeneration

from runtime.models.families import qwen3_5
from runtime.models.families.family import RuntimeFamily
from runtime.models.linear_attention import linear_attention_row_order
from runtime.models.vision import VisionEncoder

SHARED_EXPERT_TP_PLAN = {"mlp.shared_expert.gate_proj": ColwiseParallel(),
                         "mlp.shared_expert.up_proj": ColwiseParallel(),
                         "mlp.shared_expert.down_proj": RowwiseParallel()}
"""The shared expert's width split as a dense MLP's (Megatron-LM)."""

FAMILY = RuntimeFamily(model_type="qwen3_5_moe", model_class=Qwen3_5MoeForConditionalGeneration,
                       encoder=VisionEncoder(qwen3_5.VISION_HOOKS), handoff_tensors=qwen3_5.handoff_tensors,
                       llm_layer_tp_plan={**qwen3_5.LLM_LAYER_TP_PLAN, **SHARED_EXPERT_TP_PLAN},
                       prepare_llm=qwen3_5.prepare_llm, llm_row_order=linear_attention_row_order)
"""The runtime's half of the family: Qwen3.5's tower, hooks, hand-off and linear attention."""
