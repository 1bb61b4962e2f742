"""Model families: one adapter per architecture turns its Hugging Face ``config.json`` into the planner's
``ModelSpec`` (modules, layer specs, what crosses from the encoder to the LLM and where it lands, how images, clips
and audio become tokens).

An adapter is a module with

- ``MODEL_TYPES``: the ``model_type`` of the configs it reads (one per family, or several decoder-only ones);
- ``model_spec(config, name) -> ModelSpec``: the spec of a parsed config.json, raising a one-line ValueError on a
  field transformers would refuse or the runtime could not build.

The runtime's half of a family lives in ``runtime/models/families/`` under the same name. docs/CONTRIBUTING.md says how
to add one. This package imports neither torch nor transformers.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Mapping

from planner.contract.families import qwen2_5_vl, qwen2_audio, qwen2_vl, qwen3_vl, qwen3_vl_moe, text_decoders
from planner.contract.families.fields import check_field_types
from planner.contract.models import ModelSpec

FAMILIES: dict[str, ModuleType] = {
    model_type: adapter for adapter in (qwen2_5_vl, qwen2_vl, qwen3_vl, qwen2_audio, text_decoders, qwen3_vl_moe)
    for model_type in adapter.MODEL_TYPES
}
"""``model_type`` -> its adapter."""


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
    adapter = FAMILIES.get(config.get("model_type"))
    if adapter is None:
        raise ValueError(f"unsupported model_type {config.get('model_type')!r}; supported: {', '.join(FAMILIES)}")
    return adapter.model_spec(config, name)
