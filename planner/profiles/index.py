"""Fast lookups into a profile: per-layer shard costs and collective times."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from planner.profiles.interpolation import interp_collective, interp_grid
from planner.profiles.schema import LayerPoint, Profile, Spread

@dataclass(kw_only=True, frozen=True)
class LayerCost:
    """Interpolated measurements of one layer shard at one (seq_len, micro_batch)."""

    forward_s: float
    """Forward seconds of one instance."""
    backward_s: float
    """Backward seconds of one instance."""
    recompute_s: float
    """Extra seconds full recomputation adds to the backward."""
    forward_flops: float
    """FLOPs of the forward."""
    backward_flops: float
    """FLOPs of the backward."""
    saved_activation_bytes: float
    """Bytes autograd keeps for the backward."""
    peak_bytes: float
    """Peak fwd+bwd bytes beyond the parameters."""
    exact: bool
    """True when (seq_len, micro_batch) was a measured grid point, False when interpolated."""
    optimizer_s: float | None = None
    """One instance's share of the optimizer step (``_optimizer_costs``); None if the shard's points never timed it."""
    optimizer_call_s: float = 0.0
    """The optimizer call's fixed cost, paid once per module."""


def pick_time(spread: Spread, statistic: str) -> float:
    """The timing of ``spread`` a profile's ``time_statistic`` says to use."""
    return spread.min_s if statistic == "min" else spread.median_s


def _time_fields(statistic: str) -> dict:
    return {
        "forward_s": lambda p: pick_time(p.forward, statistic),
        "backward_s": lambda p: pick_time(p.backward, statistic),
        "recompute_s": lambda p: pick_time(p.recompute, statistic),
    }


_LAYER_FIELDS = {
    "forward_flops": lambda p: p.forward_flops,
    "backward_flops": lambda p: p.backward_flops,
    "saved_activation_bytes": lambda p: p.saved_activation_bytes,
    "peak_bytes": lambda p: p.peak_bytes,
}


def _optimizer_costs(points, statistic: str) -> tuple[float, float] | None:
    """(one instance's share, the call's fixed cost) of the optimizer step of one shard, from the medians over its
    points (the step does not depend on the sequence or micro-batch) of the step over one instance (t1) and over
    two in one call (t2): share = t2 - t1 (within [0, t1]), fixed = t1 - share. Without two-instance timings the
    whole t1 is the share. None if no point timed the step."""
    single = [pick_time(p.optimizer, statistic) for p in points if p.optimizer is not None]
    if not single:
        return None
    t1 = statistics.median(single)
    pair = [pick_time(p.optimizer_pair, statistic) for p in points if p.optimizer_pair is not None]
    share = min(max(statistics.median(pair) - t1, 0.0), t1) if pair else t1
    return share, t1 - share


MAX_SEQ_EXTRAPOLATION = 4.0
"""Sequences beyond this multiple of a layer's longest measured one are not taken from the profile (the analytical
model prices them): a power law fitted to short sequences cannot see attention's quadratic term take over (a tiny
model's decoder layer measured up to 1,024 tokens and extrapolated linearly to 40,000 ran at 4.6x the device's peak
FLOPs)."""

class ProfileIndex:
    """Fast lookups into a Profile: layer costs by shard, collective times by op/group/size."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self._fields = {**_time_fields(profile.time_statistic), **_LAYER_FIELDS}
        self._layers: dict[tuple[str, str, int, int, bool], dict[tuple[int, int], LayerPoint]] = {}
        for p in profile.layers:
            key = (p.module, p.layer, p.tp, p.sp, p.includes_comm)
            self._layers.setdefault(key, {})[(p.seq_len, p.micro_batch)] = p
        self._optimizer = {key: _optimizer_costs(grid.values(), profile.time_statistic)
                           for key, grid in self._layers.items()}
        self._collectives: dict[tuple[str, int], list[tuple[int, float]]] = {}
        for c in profile.collectives:
            t = pick_time(c.time, profile.time_statistic)
            self._collectives.setdefault((c.op, c.group_size), []).append((c.message_bytes, t))
        for row in self._collectives.values():
            row.sort()

    def has_layer(self, module: str, layer: str, tp: int, sp: int, *, includes_comm: bool = False) -> bool:
        """Whether this shard (any sequence length) was measured (as run, with its collectives, if
        ``includes_comm``)."""
        return (module, layer, tp, sp, includes_comm) in self._layers

    def layer_cost(self, module: str, layer: str, *, tp: int, sp: int, seq_len: int, micro_batch: int,
                   includes_comm: bool = False) -> LayerCost | None:
        """Measured cost of one layer instance, interpolated over seq_len and micro_batch; None if never measured,
        or only at sequences more than ``MAX_SEQ_EXTRAPOLATION`` times shorter.
        ``includes_comm`` picks the points timed as run (collectives included) instead of the single-process shard."""
        grid = self._layers.get((module, layer, tp, sp, includes_comm))
        if not grid or seq_len > MAX_SEQ_EXTRAPOLATION * max(seq for seq, _ in grid):
            return None
        exact = (seq_len, micro_batch) in grid
        values = {
            name: interp_grid({k: get(p) for k, p in grid.items()}, seq_len, micro_batch)
            for name, get in self._fields.items()
        }
        optimizer = self._optimizer[(module, layer, tp, sp, includes_comm)]
        return LayerCost(**values, exact=exact, optimizer_s=None if optimizer is None else optimizer[0],
                         optimizer_call_s=optimizer[1] if optimizer else 0.0)

    def collective_time(self, op: str, group_size: int, message_bytes: float) -> float | None:
        """Measured seconds of a collective, interpolated over message size; None if this op/group was not measured."""
        row = self._collectives.get((op, group_size))
        if not row:
            return None
        return interp_collective([b for b, _ in row], [t for _, t in row], message_bytes)
