"""Model families, the runtime's half: one adapter per architecture says how transformers' model class splits
into the project's modules and runs under the plan's parallelism. ``planner.contract.families`` holds the other half (the
config read into modules and layer specs); a family is the pair, under the same ``MODEL_TYPE``.

An adapter is a module with

- ``MODEL_TYPE``: the ``model_type`` it runs; ``MODEL_CLASS``: transformers' conditional-generation class;
- ``ENCODER``: its encoder, the plan module before the LLM (``name``: ``vision`` or ``audio``), behind one
  interface: ``config(config)``, ``split_model(model, LanguageModel) -> (tower, llm, position function)``,
  ``parallelize_tp(tower, mesh)``, ``row_order`` (rows stored in another order under TP), ``rules(tp, sp,
  config)`` (one-line refusals), ``shard(batch, config, sp_rank=, sp_group=, sp=)`` (what the tower's forward
  takes on one SP rank), ``layout_from_plan(workload, config)`` (the samples' layout: ``seq_len``,
  ``handoff_mask(ids)``, ``output_positions_per_rank(samples, config, sp)``, ``template_ids()``) and
  ``synthetic(layout, seed)``. The vision families get theirs from their vision hooks (runtime.models.vision
  ``VisionEncoder``), below; Qwen2-Audio writes its own;
- ``handoff_tensors(config) -> int``: tensors of the LLM's width each encoder token hands over (the hand-off
  carries their concatenation as one row per token);
- ``LLM_LAYER_TP_PLAN``: what a decoder layer adds to the common LLM plan (Qwen3's per-head q/k norms);

and, in a vision family, the hooks its ``VisionEncoder`` calls:

- ``vision_tp_plans(visual) -> [(submodule, plan)]``: the DTensor ``parallelize_module`` plans of the vision
  tower (its fused ``attn.qkv`` rows are put in TP layout first, by runtime.parallel.tensor_parallel);
- ``IMAGE_NORMALIZATION``: (image_mean, image_std) of the checkpoints' processor config (its entry in
  runtime.data.normalization, which the data readers use);
- ``vision_patch_inputs(grid_thw, config) -> {name: [N, ...]}``: per-patch inputs besides pixels and positions, in
  patch order (the shard takes its patches' rows);
- ``vision_forward(visual, shard) -> [m, handoff_tensors * D]``: this rank's rows of the hand-off.

docs/CONTRIBUTING.md says how to add one.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from runtime.models.families import qwen2_5_vl, qwen2_audio, qwen2_vl, qwen3_vl, qwen3_vl_moe

FAMILIES: dict[str, ModuleType] = {adapter.MODEL_TYPE: adapter for adapter in (qwen2_5_vl, qwen2_vl, qwen3_vl,
                                                                                   qwen3_vl_moe, qwen2_audio)}
"""``model_type`` -> its runtime adapter."""


def family_of(config: Any) -> ModuleType:
    """The adapter of a transformers config (one the runtime built, so its type is known)."""
    return FAMILIES[config.model_type]
