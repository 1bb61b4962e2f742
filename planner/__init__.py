"""dhplan planner: per-module parallelism plans for multimodal training.

``plan``, ``top_plans``, ``evaluate``, ``max_seq`` (``planner.api``), ``compare`` and ``sweep``
(``planner.analysis``, which imports pandas), ``load_plan`` (``planner.contract.schema``) and the input sections
``ClusterInputs``, ``WorkloadInputs``, ``DatasetInputs``, ``SearchOptions`` (``planner.inputs``) are imported
lazily, so ``import planner`` pulls in neither OR-Tools, pandas nor pydantic until one is used.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "plan": "planner.api",
    "top_plans": "planner.api",
    "evaluate": "planner.api",
    "max_seq": "planner.api",
    "make_problem": "planner.api",
    "compare": "planner.analysis",
    "sweep": "planner.analysis",
    "load_plan": "planner.contract.schema",
    "ClusterInputs": "planner.inputs",
    "WorkloadInputs": "planner.inputs",
    "DatasetInputs": "planner.inputs",
    "SearchOptions": "planner.inputs",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
