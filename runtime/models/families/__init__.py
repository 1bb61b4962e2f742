"""Model families, the runtime's half: one adapter per architecture says how transformers' model class splits
into the project's modules and runs under the plan's parallelism. ``planner.contract.families`` holds the other half
(the config read into modules and layer specs); a family is the pair, under the same ``model_type``.

Each adapter module builds one typed spec, ``FAMILY`` (``runtime.models.families.family.RuntimeFamily``: its
``model_class``, its ``encoder`` behind the runtime's ``Encoder`` interface, ``handoff_tensors``, the decoder
layer's ``llm_layer_tp_plan``). A vision family builds its encoder from its hooks,
``VisionEncoder(VisionHooks(tp_plans=, patch_inputs=, forward=, image_normalization=))`` (runtime.models.vision);
Qwen2-Audio writes its own. ``FAMILIES`` registers them by ``model_type`` and refuses one with a required hook
missing. docs/CONTRIBUTING.md says how to add one.
"""

from __future__ import annotations

from typing import Any

from planner.contract.families.family import registry
from runtime.models.families import qwen2_5_vl, qwen2_audio, qwen2_vl, qwen3_5, qwen3_5_moe, qwen3_vl, qwen3_vl_moe
from runtime.models.families.family import RuntimeFamily

FAMILIES: dict[str, RuntimeFamily] = registry((qwen2_5_vl.FAMILY, qwen2_vl.FAMILY, qwen3_vl.FAMILY,
                                                qwen3_vl_moe.FAMILY, qwen3_5.FAMILY, qwen3_5_moe.FAMILY,
                                                qwen2_audio.FAMILY))
"""``model_type`` -> the runtime's half of its family."""


def family_of(config: Any) -> RuntimeFamily:
    """The family of a transformers config (one the runtime built, so its type is known)."""
    return FAMILIES[config.model_type]
