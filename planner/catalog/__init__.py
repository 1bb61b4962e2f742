"""Model catalog: Hugging Face ``config.json`` dicts of supported architectures become ``ModelSpec``s.

Each family keeps the config.json of its checkpoints beside its adapter (``planner.contract.families``, its
``FAMILY.configs``); the catalog gathers them and gives each a description and aliases. Catalog entries and a user's
``config.json`` go through the same ``model_from_hf_config``, which hands the config to its family's adapter. Keys a config omits take the transformers 5.x class defaults (each
adapter's ``*_DEFAULTS``), as ``from_pretrained`` would. Both layouts are
read: the flat hub layout (decoder keys at the top level) and the nested ``text_config`` layout of transformers 5.
Each parameter formula mirrors one Hugging Face module; ``tests/test_catalog.py`` checks every entry against the
transformers model built on the meta device. This module imports neither torch nor transformers.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from typing import Any, Mapping

from planner.contract.families import FAMILIES, model_from_hf_config
from planner.contract.models import ModelSpec
from planner.contract.file_io import read_json


# --- Catalog ----------------------------------------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class CatalogEntry:
    """One named model of the catalog."""

    config: Mapping[str, Any]
    """Its Hugging Face config.json contents."""
    aliases: tuple[str, ...]
    """Other names it answers to (matched case-insensitively)."""
    description: str
    """One line for ``plan --list-models``."""


CONFIGS: dict[str, Mapping[str, Any]] = {name: config for family in FAMILIES.values()
                                         for name, config in family.configs.items()}
"""Catalog name -> config.json, gathered from the families."""


def _entry(name: str, description: str, *aliases: str) -> tuple[str, CatalogEntry]:
    """A catalog item (its config is the family's ``CONFIGS[name]``); each hub id ``Qwen/X`` among ``aliases`` also
    adds its bare lower-cased ``x``."""
    expanded = [a for alias in aliases for a in ((alias.split("/")[1].lower(), alias) if "/" in alias else (alias,))]
    unique = tuple(dict.fromkeys(a for a in expanded if a.lower() != name))
    return name, CatalogEntry(config=CONFIGS[name], aliases=unique, description=description)


CATALOG: dict[str, CatalogEntry] = dict([
    _entry("qwen2.5-vl-3b", "Qwen2.5-VL 3B Instruct (tied embeddings)", "Qwen/Qwen2.5-VL-3B-Instruct", "qwen-vl-3b"),
    _entry("qwen2.5-vl-7b", "Qwen2.5-VL 7B Instruct", "Qwen/Qwen2.5-VL-7B-Instruct", "qwen-vl-7b"),
    _entry("qwen2.5-vl-32b", "Qwen2.5-VL 32B Instruct", "Qwen/Qwen2.5-VL-32B-Instruct", "qwen-vl-32b"),
    _entry("qwen2.5-vl-72b", "Qwen2.5-VL 72B Instruct", "Qwen/Qwen2.5-VL-72B-Instruct", "qwen-vl-72b"),
    _entry("qwen2-vl-2b", "Qwen2-VL 2B Instruct (tied embeddings, no window attention)", "Qwen/Qwen2-VL-2B-Instruct"),
    _entry("qwen2-vl-7b", "Qwen2-VL 7B Instruct (no window attention)", "Qwen/Qwen2-VL-7B-Instruct"),
    _entry("qwen2-vl-72b", "Qwen2-VL 72B Instruct (no window attention)", "Qwen/Qwen2-VL-72B-Instruct"),
    _entry("qwen2-audio-7b", "Qwen2-Audio 7B: Whisper-style audio encoder + Qwen 7B decoder",
           "Qwen/Qwen2-Audio-7B", "Qwen/Qwen2-Audio-7B-Instruct", "qwen-audio-7b"),
    _entry("qwen3-vl-2b", "Qwen3-VL 2B Instruct (DeepStack, tied embeddings)", "Qwen/Qwen3-VL-2B-Instruct"),
    _entry("qwen3-vl-4b", "Qwen3-VL 4B Instruct (DeepStack, tied embeddings)", "Qwen/Qwen3-VL-4B-Instruct"),
    _entry("qwen3-vl-8b", "Qwen3-VL 8B Instruct (DeepStack)", "Qwen/Qwen3-VL-8B-Instruct"),
    _entry("qwen3-vl-32b", "Qwen3-VL 32B Instruct (DeepStack)", "Qwen/Qwen3-VL-32B-Instruct"),
    _entry("qwen3-vl-30b-a3b", "Qwen3-VL 30B-A3B Instruct (DeepStack, 128 experts, top-8: 3B active)",
           "Qwen/Qwen3-VL-30B-A3B-Instruct"),
    _entry("qwen3-vl-235b-a22b", "Qwen3-VL 235B-A22B Instruct (DeepStack, 128 experts, top-8: 22B active)",
           "Qwen/Qwen3-VL-235B-A22B-Instruct"),
    _entry("qwen3.5-27b", "Qwen3.5 27B: hybrid Gated DeltaNet (48) + gated attention (16) layers, 1 MTP layer unbuilt",
           "Qwen/Qwen3.5-27B"),
    _entry("qwen3.6-27b", "Qwen3.6 27B (Qwen3.5 architecture: 48 linear + 16 full attention layers)", "Qwen/Qwen3.6-27B"),
    _entry("qwen3.5-35b-a3b", "Qwen3.5 35B-A3B: hybrid layers, 256 experts, top-8 + a shared expert: 3B active",
           "Qwen/Qwen3.5-35B-A3B"),
    _entry("qwen3.6-35b-a3b", "Qwen3.6 35B-A3B (Qwen3.5-MoE architecture: 256 experts, top-8 + shared)",
           "Qwen/Qwen3.6-35B-A3B"),
    _entry("qwen3.5-397b-a17b", "Qwen3.5 397B-A17B: hybrid layers, 512 experts, top-10 + a shared expert: 17B active",
           "Qwen/Qwen3.5-397B-A17B"),
    _entry("qwen3-vl-tiny", "Toy Qwen3-VL for CPU tests and demos (DeepStack into 2 layers)"),
    _entry("qwen3-vl-moe-tiny", "Toy Qwen3-VL-MoE for CPU tests and demos (8 experts, top-2, in every decoder layer)"),
    _entry("qwen3.5-tiny", "Toy Qwen3.5 for CPU tests and demos (3 linear-attention layers, then 1 gated full)"),
    _entry("qwen3.5-moe-tiny", "Toy Qwen3.5-MoE for CPU tests and demos (8 experts, top-2, a shared expert)"),
    _entry("qwen2-audio-tiny", "Toy Qwen2-Audio for CPU tests and demos (1 s clips)"),
    _entry("qwen2.5-vl-tiny", "Toy Qwen2.5-VL for CPU tests and demos (~1.2M params)", "qwen-vl-tiny", "tiny"),
])
"""Catalog name -> entry."""

_BY_NAME: dict[str, str] = {
    key.lower(): name for name, entry in CATALOG.items() for key in (name, *entry.aliases)
}
"""Lower-cased name or alias -> catalog name."""


def _load_config_file(path: str) -> tuple[dict[str, Any], str]:
    """Parse ``path`` (a config.json or a folder holding one); also returns the name the model is given."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    config = read_json(file, kind="model config")
    folder = os.path.basename(os.path.dirname(os.path.abspath(file)))
    return config, folder or os.path.splitext(os.path.basename(file))[0]


def _unknown_model(name: str) -> ValueError:
    """One-line error with the closest catalog names."""
    close = difflib.get_close_matches(name.lower(), list(_BY_NAME), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    return ValueError(
        f"unknown model {name!r}; {hint}(`plan --list-models` lists all; a path to a config.json also works)"
    )


def get_model(name_or_path: str) -> ModelSpec:
    """The ModelSpec of a catalog name or alias, or of a config.json file (or a folder holding one).

    Raises:
        ValueError: unknown name (with suggestions), unreadable file or unsupported config, in one line.
    """
    name = _BY_NAME.get(name_or_path.strip().lower())
    if name is not None:
        return model_from_hf_config(CATALOG[name].config, name)
    if os.path.exists(name_or_path) or name_or_path.endswith(".json"):
        config, derived_name = _load_config_file(name_or_path)
        try:
            return model_from_hf_config(config, derived_name)
        except ValueError as e:
            raise ValueError(f"{name_or_path}: {e}") from None
    raise _unknown_model(name_or_path)


def list_models() -> list[tuple[str, tuple[str, ...], int, str]]:
    """(name, aliases, exact parameter count, description) of every catalog entry."""
    return [
        (name, entry.aliases, model_from_hf_config(entry.config, name).num_params, entry.description)
        for name, entry in CATALOG.items()
    ]
