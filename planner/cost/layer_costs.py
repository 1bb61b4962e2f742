"""The one seam through which measured per-layer numbers enter the cost model.

A ``LayerCostSource`` answers, for one layer type under one sharding, the compute time of ONE instance of the
layer for ONE micro-batch on one GPU -- or ``None`` when it has no measurement, in which case the analytical
model is used. Collective communication is normally not part of a measurement: the alpha-beta model (or the
measured collective curves) adds it, so a profile taken on a single GPU composes with any degree of parallelism.
A measurement taken as the runtime runs the sharded layer (``includes_comm``) already contains the layer's TP/SP
collectives; the cost model then adds none for that layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from planner.contract.models import LayerSpec
from planner.contract.strategy import Recompute

ANALYTICAL = "analytical"
MEASURED = "measured"


@dataclass(kw_only=True, frozen=True)
class LayerMeasurement:
    """Measured cost of one layer instance for one micro-batch on one GPU (communication excluded unless
    ``includes_comm``)."""

    forward_s: float
    """Forward compute time."""
    backward_s: float
    """Backward compute time (without recomputation)."""
    recompute_s: float
    """Extra forward compute the given recompute mode adds to backward."""
    activation_bytes: int | None = None
    """Activation bytes the layer keeps for backward under the given recompute mode; None: use the formula."""
    includes_comm: bool = False
    """The measured time already contains the layer's TP/SP collectives (timed as the runtime runs the sharded
    layer); the cost model must not add its own ``tp_comm_s`` / ``sp_comm_s`` for it."""
    optimizer_s: float | None = None
    """The instance's share of the optimizer step (gradient norm and clipping, AdamW) over its parameters on one
    TP/SP rank, before any ZeRO sharding; None: use the formula (``optimizer_step_time``)."""
    optimizer_call_s: float = 0.0
    """Fixed cost of the module's optimizer call (dispatch, norm reductions) this measurement saw; the module pays
    the largest of its layers' once."""


class LayerCostSource(Protocol):
    """Supplies measured per-layer costs; the profile reader implements it."""

    def layer_cost(
        self,
        *,
        module: str,
        layer: LayerSpec,
        tp: int,
        sp: int,
        cp: int,
        seq_len: int,
        tokens_per_rank: int,
        micro_batch: int,
        recompute: Recompute,
    ) -> LayerMeasurement | None:
        """Cost of one instance of ``layer`` of ``module`` sharded tp/sp/cp ways.

        Args:
            module: Module name (vision, audio, llm).
            layer: The layer type (``layer.name`` keys profiles).
            tp: Tensor-parallel degree.
            sp: Ulysses sequence-parallel degree.
            cp: Context-parallel degree.
            seq_len: Tokens of ONE sample entering the module, before any SP/CP split (profiles key on it).
            tokens_per_rank: Tokens entering the layer on one rank for the whole micro-batch
                (``micro_batch * tokens_per_sample / (sp * cp)``).
            micro_batch: Samples per micro-batch.
            recompute: Recompute mode, which decides ``recompute_s`` and ``activation_bytes``.

        Returns:
            The measurement, or None when the source has none for this configuration.
        """
        ...
