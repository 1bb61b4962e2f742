"""A model family's runtime half, typed: how transformers' class splits into the plan's encoder and LLM and runs
under the plan's parallelism (``RuntimeFamily``), and the encoder interface it hands the trainer (``Encoder``).
``planner.contract.families.family.PlannerFamily`` is the other half; both registries refuse a spec with a required
hook missing (``planner.contract.families.family.registry``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

ENCODER_METHODS = ("config", "split_model", "parallelize_tp", "row_order", "rules", "shard", "layout_from_plan",
                   "synthetic", "missing_hooks")
"""What an ``Encoder`` must be able to do (the registry checks each is callable)."""


class Encoder(Protocol):
    """The plan module before the LLM, as the runtime drives it (runtime.models.vision ``VisionEncoder`` for the
    vision towers; the audio family writes its own)."""

    name: str
    """The plan module it runs: ``vision`` or ``audio``."""

    def config(self, config: Any) -> Any:
        """Its section of the transformers config."""

    def split_model(self, model: nn.Module, language_model: Any) -> tuple[nn.Module, nn.Module, Any]:
        """(tower, LLM, position function) of transformers' model; ``language_model(decoder, lm_head, handoff token
        ids)`` builds the LLM."""

    def parallelize_tp(self, tower: nn.Module, mesh: Any) -> None:
        """Shard the tower over the TP mesh."""

    def row_order(self, local_name: str, tp: int, rows: int) -> Any:
        """transformers' row of each stored row of a parameter TP stores in another order, else None."""

    def rules(self, tp: int, sp: int, config: Any) -> list[str]:
        """Why the tower cannot run at these degrees (one line each)."""

    def shard(self, batch: Mapping[str, Any], config: Any, *, sp_rank: int, sp_group: Any, sp: int) -> Any:
        """What the tower's forward takes on one SP rank."""

    def layout_from_plan(self, workload: Any, config: Any) -> Any:
        """The samples' layout (``seq_len``, ``handoff_mask(ids)``, ``output_positions_per_rank(samples, config,
        sp)``, ``template_ids()``)."""

    def synthetic(self, layout: Any, seed: int) -> Any:
        """Random samples of the layout (``sample(index)``)."""

    def missing_hooks(self) -> list[str]:
        """The hooks of the family it lacks (empty: complete)."""


@dataclass(kw_only=True, frozen=True)
class RuntimeFamily:
    """What the runtime needs of a model family."""

    model_type: str
    """The transformers ``model_type`` it runs."""
    model_class: type[nn.Module]
    """transformers' conditional-generation class."""
    encoder: Encoder
    """Its encoder behind the runtime's one interface."""
    handoff_tensors: Callable[[Any], int]
    """``handoff_tensors(config)``: tensors of the LLM's width each encoder token hands over (the hand-off carries
    their concatenation as one row per token, the first landing on the embeddings, the others on the first decoder
    layers' outputs)."""
    llm_layer_tp_plan: Mapping[str, ParallelStyle]
    """What a decoder layer adds to the common LLM TP plan (Qwen3's per-head q/k norms); may be empty."""
    prepare_llm: Callable[[nn.Module, Any], None] | None = None
    """``prepare_llm(llm, module)``: what the runtime changes in the split LLM before sharding it, as the plan's
    ``llm`` module (``ModulePlan``) says (Qwen3.5: its linear-attention layers run by segments on the planned
    kernel); None: nothing. The reference model is left as transformers builds it."""
    llm_row_order: Callable[[str, Any, int], Any] | None = None
    """``llm_row_order(local_name, config, tp)``: transformers' row of each stored row of an LLM parameter TP stores
    in another order (Qwen3.5's fused linear-attention q/k/v), else None; None: the family stores none so."""

    def missing_hooks(self) -> list[str]:
        """The required fields and encoder methods that are absent or not callable, and the encoder's own."""
        present = {"model_type": bool(self.model_type), "model_class": isinstance(self.model_class, type),
                   "handoff_tensors": callable(self.handoff_tensors),
                   "llm_layer_tp_plan": isinstance(self.llm_layer_tp_plan, Mapping),
                   "encoder": self.encoder is not None and isinstance(getattr(self.encoder, "name", None), str)}
        missing = [name for name, ok in present.items() if not ok]
        if "encoder" in missing:
            return missing
        missing += [f"encoder.{name}" for name in ENCODER_METHODS if not callable(getattr(self.encoder, name, None))]
        return missing or self.encoder.missing_hooks()
