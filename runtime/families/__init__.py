"""Model families, the runtime's half: one adapter per architecture says how transformers' model class splits
into the project's modules and runs under the plan's parallelism. ``planner.families`` holds the other half (the
config read into modules and layer specs); a family is the pair, under the same ``MODEL_TYPE``.

An adapter is a module with

- ``MODEL_TYPE``: the ``model_type`` it runs; ``MODEL_CLASS``: transformers' conditional-generation class;
- ``handoff_tensors(config) -> int``: tensors of the LLM's width each image token hands over (the hand-off carries
  their concatenation as one row per token);
- ``vision_tp_plans(visual) -> [(submodule, plan)]``: the DTensor ``parallelize_module`` plans of the vision tower
  (its fused ``attn.qkv`` rows are put in TP layout first, by runtime.parallel.tensor_parallel);
- ``LLM_LAYER_TP_PLAN``: what a decoder layer adds to the common LLM plan (Qwen3's per-head q/k norms);
- ``IMAGE_NORMALIZATION``: (image_mean, image_std) of the checkpoints' processor config;
- ``vision_patch_inputs(grid_thw, config) -> {name: [N, ...]}``: per-patch inputs besides pixels and positions, in
  patch order (the shard takes its patches' rows);
- ``vision_forward(visual, shard) -> [m, handoff_tensors * D]``: this rank's rows of the hand-off.

docs/CONTRIBUTING.md says how to add one.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from runtime.families import qwen2_5_vl, qwen2_vl, qwen3_vl

FAMILIES: dict[str, ModuleType] = {adapter.MODEL_TYPE: adapter for adapter in (qwen2_5_vl, qwen2_vl, qwen3_vl)}
"""``model_type`` -> its runtime adapter."""


def family_of(config: Any) -> ModuleType:
    """The adapter of a transformers config (one the runtime built, so its type is known)."""
    return FAMILIES[config.model_type]
