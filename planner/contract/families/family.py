"""A model family, typed: what each half needs of an architecture, and the registry that holds the families of
one half by ``model_type``.

The planner's half is ``PlannerFamily`` (each adapter in this package builds one, ``FAMILY``); the runtime's half is
``runtime.models.families.RuntimeFamily``. Both registries go through ``registry``, which refuses a spec with a
required hook missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Protocol, TypeVar

from planner.contract.models import ModelSpec, VideoInputSpec


class FamilySpec(Protocol):
    """What ``registry`` needs of a family spec of either half."""

    model_type: str

    def missing_hooks(self) -> list[str]:
        """Names of the required hooks the spec lacks (empty: complete)."""


Spec = TypeVar("Spec", bound=FamilySpec)


def registry(specs: Iterable[Spec]) -> dict[str, Spec]:
    """``model_type`` -> spec.

    Raises:
        ValueError: a spec lacks a required hook, or two specs claim one ``model_type`` (one line).
    """
    by_type: dict[str, Spec] = {}
    for spec in specs:
        if missing := spec.missing_hooks():
            raise ValueError(f"family {spec.model_type!r} ({type(spec).__name__}) lacks {', '.join(missing)}")
        if spec.model_type in by_type:
            raise ValueError(f"two families claim model_type {spec.model_type!r}")
        by_type[spec.model_type] = spec
    return by_type


@dataclass(kw_only=True, frozen=True)
class PlannerFamily:
    """What the planner needs of a model family."""

    model_type: str
    """The config.json ``model_type`` it reads."""
    model_spec: Callable[[Mapping[str, Any], str], ModelSpec]
    """``model_spec(config, name)``: the ModelSpec of a parsed config.json (modules and layer specs, what crosses to
    the LLM and where it lands, how inputs become tokens); a one-line ValueError on a field transformers would refuse
    or the runtime could not build."""
    encoder: str | None
    """The module before the LLM (``vision``, ``audio``); None: a decoder alone, which only the planner reads."""
    image_pixels: tuple[int, int] | None
    """(fewest, most) pixels the image processor resizes an image to; None: the family reads no images."""
    video: VideoInputSpec | None
    """How the video processor resizes and samples a clip and what text the prompt adds; None: no clips."""
    configs: Mapping[str, Mapping[str, Any]]
    """Catalog name -> config.json of each checkpoint of the family the catalog offers (planner.catalog names and
    describes them); may be empty."""

    def missing_hooks(self) -> list[str]:
        """``model_type``, ``model_spec`` and ``configs`` are required; a vision family has image bounds and a video
        spec."""
        present = {"model_type": bool(self.model_type), "model_spec": callable(self.model_spec),
                   "configs": isinstance(self.configs, Mapping)}
        missing = [name for name, ok in present.items() if not ok]
        if self.encoder == "vision":
            missing += [name for name in ("image_pixels", "video") if getattr(self, name) is None]
        return missing
