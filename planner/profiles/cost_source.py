"""The cost model's seam: measured per-layer costs from a profile (``LayerCostSource``)."""

from __future__ import annotations

from planner.profiles.index import LayerCost, ProfileIndex
from planner.profiles.schema import Profile, concurrency_slowdown

RECOMPUTED_KINDS = frozenset({"vision_block", "audio_block", "decoder_layer"})
"""Layer kinds activation recomputation re-runs (transformer blocks, as the runtime and the cost model do)."""


class ProfileCostSource:
    """A ``planner.cost.LayerCostSource`` backed by a profile: measured layer times (and saved activations),
    interpolated over sequence length and micro-batch, and the optimizer step over each layer's parameters; None
    (-> analytical) for shards the profile lacks.

    Recompute modes: ``none`` uses the measured saved activations and no recompute time; ``full`` adds, for
    transformer blocks, the measured extra backward time of a checkpointed forward and leaves their (input-only)
    activation bytes to the formula; other layers are not recomputed. ``selective`` (attention core only) was not
    measured, so it is analytical; so is context parallelism.

    Sharded layers (tp * sp > 1) use the points timed as the runtime runs them (``includes_comm``: TP/SP
    collectives, DTensor dispatch and the ranks' contention included; the measurement says so, and the cost model
    then adds no collectives of its own for the layer) where the profile has them, else one rank's shard timed
    alone.

    ``concurrent_devices``: devices computing at once. Where the profile measured that devices slow each other
    down (CPU "devices" are processes sharing one host's cores, caches and memory bandwidth), layer times are
    multiplied by the measured slowdown for that many devices (the largest measured count beyond it); a point
    timed as run with tp*sp processes already contains their slowdown, so it gets only the ratio beyond it.
    ``path`` is the file the profile was read from (recorded in the plans it costs). ``time_scale`` multiplies every
    measured layer time and optimizer step (the calibrated ``measured_time_scale``;
    collectives are not scaled).
    """

    def __init__(self, profile: Profile, *, concurrent_devices: int = 1, time_scale: float = 1.0,
                 path: str | None = None) -> None:
        self.profile = profile
        self.path = path
        self.index = ProfileIndex(profile)
        self.time_scale = time_scale
        self.slowdown = concurrency_slowdown(profile, concurrent_devices) * time_scale

    def _cost(self, module: str, layer: str, *, tp: int, sp: int, seq_len: int, micro_batch: int
              ) -> tuple[LayerCost | None, bool, float]:
        """(cost, whether it was timed as run, slowdown to apply): as-run points first for sharded layers."""
        if tp * sp > 1:
            cost = self.index.layer_cost(module, layer, tp=tp, sp=sp, seq_len=seq_len, micro_batch=micro_batch,
                                         includes_comm=True)
            if cost is not None:
                return cost, True, max(self.slowdown / concurrency_slowdown(self.profile, tp * sp), self.time_scale)
        cost = self.index.layer_cost(module, layer, tp=tp, sp=sp, seq_len=seq_len, micro_batch=micro_batch)
        return cost, False, self.slowdown

    def layer_cost(self, *, module, layer, tp, sp, cp, seq_len, tokens_per_rank, micro_batch, recompute):
        from planner.cost.layer_costs import LayerMeasurement

        if cp > 1 or recompute == "selective":
            return None
        cost, as_run, slowdown = self._cost(module, layer.name, tp=tp, sp=sp, seq_len=seq_len,
                                            micro_batch=micro_batch)
        if cost is None:
            return None
        full = recompute == "full" and layer.kind in RECOMPUTED_KINDS
        return LayerMeasurement(
            forward_s=cost.forward_s * slowdown,
            backward_s=cost.backward_s * slowdown,
            recompute_s=cost.recompute_s * slowdown if full else 0.0,
            activation_bytes=None if full else round(cost.saved_activation_bytes),
            includes_comm=as_run,
            optimizer_s=None if cost.optimizer_s is None else cost.optimizer_s * slowdown,
            optimizer_call_s=cost.optimizer_call_s * slowdown,
        )

    def collective_time(self, op: str, group_size: int, message_bytes: float) -> float | None:
        """Measured seconds of a collective (None: use the link model). ``message_bytes`` is the per-rank input
        buffer. The seam for the cost model's collectives (they use the fitted link model until they call it)."""
        return self.index.collective_time(op, group_size, message_bytes)
