"""Model families: one adapter per architecture turns its Hugging Face ``config.json`` into the planner's
``ModelSpec`` (modules, layer specs, what crosses from the encoder to the LLM and where it lands, how images, clips
and audio become tokens).

Each adapter module builds one typed spec, ``FAMILY`` (``planner.contract.families.family.PlannerFamily``: its
``model_type``, ``model_spec(config, name) -> ModelSpec``, its encoder, the processors' image and video bounds, and
the config.json of each checkpoint the catalog offers, kept beside it in ``<type>_configs.py``); ``FAMILIES``
registers them by ``model_type`` and refuses one with a required hook missing.

The runtime's half of a family lives in ``runtime/models/families/`` under the same name. docs/CONTRIBUTING.md says how
to add one. This package imports neither torch nor transformers.
"""

from __future__ import annotations

from typing import Any, Mapping

from planner.contract.families import (qwen2_5_vl, qwen2_audio, qwen2_vl, qwen3_5, qwen3_5_moe, qwen3_vl, qwen3_vl_moe,
                                      text_decoders)
from planner.contract.families.family import PlannerFamily, registry
from planner.contract.families.fields import check_field_types
from planner.contract.models import ModelSpec

FAMILIES: dict[str, PlannerFamily] = registry((qwen2_5_vl.FAMILY, qwen2_vl.FAMILY, qwen3_vl.FAMILY,
                                                qwen2_audio.FAMILY, *text_decoders.FAMILIES, qwen3_vl_moe.FAMILY,
                                                qwen3_5.FAMILY, qwen3_5_moe.FAMILY))
"""``model_type`` -> the planner's half of its family."""


def model_from_hf_config(config: Mapping[str, Any], name: str) -> ModelSpec:
    """Build the ModelSpec of any supported Hugging Face ``config.json`` dict.

    Args:
        config: the parsed ``config.json`` (flat hub layout or nested transformers-5 layout).
        name: the name the spec carries (catalog name, or one derived from the file's path).

    Raises:
        ValueError: unsupported ``model_type`` or an invalid field, in one line.
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"a model config must be a JSON object, got {type(config).__name__}")
    check_field_types(config, "config")
    family = FAMILIES.get(config.get("model_type"))
    if family is None:
        raise ValueError(f"unsupported model_type {config.get('model_type')!r}; supported: {', '.join(FAMILIES)}")
    return family.model_spec(config, name)
