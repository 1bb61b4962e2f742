"""Measured profiles: the file schema, reading, interpolation, and the cost source the planner plugs in.

A profile is what ``python -m runtime.profile`` measured on one device type for one model: per-layer shard times
(forward, backward, recompute), memory and FLOPs over a grid of sequence lengths and micro-batch sizes, collective
times over message sizes, device microbenchmarks, FakeTensor memory breakdowns, and the efficiency parameters a
calibration refitted from real runs. This module is pure Python (pydantic only) so the planner can read profiles
without torch.

Conventions: times in seconds, memory in bytes, FLOPs as counts. ``seq_len`` is the tokens of ONE sample entering
the module before any sequence-parallel split (the plan's own variable); the shard shape the TP/SP degrees imply is
what was measured. A layer point is either one rank's shard timed alone (``includes_comm`` False: the cost model
adds the TP/SP collectives) or the layer timed as the runtime runs it in tp*sp processes (``includes_comm`` True:
its collectives, DTensor dispatch and the ranks' contention for the host are in the times).
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from planner.hardware import DeviceSpec

PROFILE_SCHEMA_VERSION = 3
READABLE_SCHEMA_VERSIONS = (1, 2, 3)
"""Versions ``load_profile`` reads: version 1 lacks ``LayerPoint.includes_comm`` (all its points are single-process
shards, the field's default), versions 1-2 lack ``LayerPoint.optimizer`` (None); older files are upgraded to the
current version on the next save."""
PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"
CollectiveOp = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"]
COLLECTIVE_OPS: tuple[CollectiveOp, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


MAX_MEASURED_SECONDS = 86_400.0
"""Longest time a profile may record for one layer or collective (a day): beyond it a number is not a measurement,
and would carry predicted steps past what the planner's arithmetic is meant for."""
MAX_MEASURED_AMOUNT = 1e24
"""Largest FLOP count a profile may record for one layer."""
Seconds = Annotated[float, Field(ge=0, le=MAX_MEASURED_SECONDS, allow_inf_nan=False)]
"""A measured time: finite, not negative, at most ``MAX_MEASURED_SECONDS``."""
Amount = Annotated[float, Field(ge=0, le=MAX_MEASURED_AMOUNT, allow_inf_nan=False)]
"""A measured FLOP count: finite, not negative, at most ``MAX_MEASURED_AMOUNT``."""


class Provenance(_Strict):
    """Where and how a profile was measured."""

    device_name: str = Field(description="catalog name of the hardware, e.g. cpu or h100-80gb")
    device_detail: str = Field(description="what the machine reports (CPU model / GPU name)")
    torch_version: str
    cuda_version: str | None
    date: str = Field(description="ISO date-time of the last write")
    command: str = Field(description="command line that produced the profile")
    num_threads: int = Field(description="torch intra-op threads during measurement")
    dtype: str = Field(description="parameter/activation dtype measured")


class Spread(_Strict):
    """Distribution of repeated timings of one quantity."""

    median_s: Seconds
    min_s: Seconds
    max_s: Seconds
    repeats: int


class LayerPoint(_Strict):
    """One layer shard measured at one (seq_len, micro_batch)."""

    module: str
    layer: str = Field(description="LayerSpec.name, e.g. window_block, decoder_layer")
    tp: int = Field(ge=1)
    sp: int = Field(ge=1)
    seq_len: int = Field(ge=1, description="tokens per sample before the SP split")
    micro_batch: int = Field(ge=1)
    forward: Spread
    backward: Spread
    recompute: Spread = Field(description="extra backward time when the forward ran under torch.utils.checkpoint")
    optimizer: Spread | None = Field(
        default=None,
        description="the runtime's optimizer step over this shard's parameters: gradient norm, clipping scale, AdamW "
        "(None in profiles older than schema version 3: the cost model's formula is used)",
    )
    optimizer_pair: Spread | None = Field(
        default=None,
        description="the same step over two instances of the layer in one call: the difference from ``optimizer`` is "
        "one instance's share, the rest the call's fixed cost (DTensor dispatch, norm reductions), paid once per "
        "module",
    )
    forward_flops: Amount
    backward_flops: Amount
    saved_activation_bytes: int = Field(ge=0, description="tensors autograd saved for backward, parameters excluded")
    peak_bytes: int = Field(ge=0, description="peak of activations + temporaries + gradients during fwd+bwd, params "
                            "excluded")
    includes_comm: bool = Field(
        default=False,
        description="timed as the runtime runs the layer, in tp*sp gloo/NCCL processes sharded by the runtime's own "
        "functions (slowest rank): the times include its TP/SP collectives, DTensor dispatch and the ranks' "
        "contention for the host. False: one rank's shard timed alone in one process, collectives excluded",
    )

    @property
    def key(self) -> tuple[str, str, int, int, int, int, bool]:
        return (self.module, self.layer, self.tp, self.sp, self.seq_len, self.micro_batch, self.includes_comm)


class CollectivePoint(_Strict):
    """One collective at one message size and group size."""

    op: CollectiveOp
    group_size: int = Field(ge=2)
    message_bytes: int = Field(ge=1, description="bytes of the per-rank input buffer")
    time: Spread
    backend: str = Field(description="gloo or nccl")

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.op, self.group_size, self.message_bytes)


class MatmulPoint(_Strict):
    """Achieved FLOP/s of an n x n x n matmul."""

    n: int
    flops_per_s: float = Field(gt=0, allow_inf_nan=False)


class DeviceMeasurements(_Strict):
    """Microbenchmarks of the device itself."""

    matmul: list[MatmulPoint]
    memory_bandwidth: float = Field(gt=0, allow_inf_nan=False, description="bytes/s of a large copy (read + write "
                                    "counted)")
    concurrency: dict[int, float] = Field(
        default_factory=dict,
        description="devices computing at once -> per-device slowdown of a layer's fwd+bwd vs one alone (CPU)",
    )

    @property
    def peak_matmul_flops(self) -> float:
        """Best achieved matmul FLOP/s over the sizes measured."""
        return max(p.flops_per_s for p in self.matmul)


def concurrency_slowdown(profile: "Profile", devices: int) -> float:
    """Measured per-device slowdown when ``devices`` compute at once (1.0 when not measured)."""
    measured = profile.device.concurrency if profile.device is not None else {}
    if devices <= 1 or not measured:
        return 1.0
    fitting = [n for n in measured if n <= devices]
    return measured[max(fitting)] if fitting else 1.0


class MemoryPoint(_Strict):
    """FakeTensor memory breakdown of one layer shard (no memory allocated)."""

    module: str
    layer: str
    tp: int = Field(ge=1)
    sp: int = Field(ge=1)
    seq_len: int = Field(ge=1)
    micro_batch: int = Field(ge=1)
    param_bytes: int
    saved_activation_bytes: int
    peak_bytes: int = Field(description="peak fwd+bwd memory beyond the parameters")
    peak_breakdown: dict[str, int] = Field(description="MemTracker categories at the peak")

    @property
    def key(self) -> tuple[str, str, int, int, int, int]:
        return (self.module, self.layer, self.tp, self.sp, self.seq_len, self.micro_batch)


class Calibration(_Strict):
    """Efficiency parameters refitted from real runs: measured step = scale * predicted step + overhead_s."""

    scale: float = Field(gt=0)
    overhead_s: float
    num_samples: int
    rms_error_before: float = Field(description="relative RMS error of the predictions before the refit")
    rms_error_after: float
    sources: list[str] = Field(description="metrics files the fit used")


class Profile(_Strict):
    """Everything measured for one (hardware, model)."""

    schema_version: int
    hardware: str
    model: str
    provenance: Provenance
    layers: list[LayerPoint] = Field(default_factory=list)
    collectives: list[CollectivePoint] = Field(default_factory=list)
    device: DeviceMeasurements | None = None
    memory: list[MemoryPoint] = Field(default_factory=list)
    calibration: Calibration | None = None
    time_statistic: Literal["median", "min"] = Field(
        default="median",
        description="which recorded timing the planner uses: median (a dedicated machine) or min (a shared machine, "
        "where other processes only ever add time and the fastest repeat is the least disturbed)",
    )

    def to_json(self) -> str:
        """Canonical text: points sorted by key so re-runs give small diffs."""
        data = self.model_dump(mode="json")
        data["layers"].sort(key=_shard_key)
        data["memory"].sort(key=_shard_key)
        data["collectives"].sort(key=lambda p: (p["op"], p["group_size"], p["message_bytes"]))
        return json.dumps(data, indent=1, sort_keys=True) + "\n"


def _shard_key(point: dict) -> tuple:
    return (point["module"], point["layer"], point["tp"], point["sp"], point["seq_len"], point["micro_batch"],
            point.get("includes_comm", False))


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile file; raise ValueError with a one-line reason if it cannot be used."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"cannot read profile {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"profile {path} is not JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(data, dict) or "schema_version" not in data:
        raise ValueError(f"{path} is not a profile: it has no schema_version (write one with `python -m runtime.profile`)")
    version = data["schema_version"]
    if not isinstance(version, int) or isinstance(version, bool):
        raise ValueError(f"profile {path}: schema_version must be a whole number, got {version!r} "
                         f"({type(version).__name__})")
    if version not in READABLE_SCHEMA_VERSIONS:
        raise ValueError(
            f"profile {path} has schema version {data['schema_version']}, this tool reads versions "
            f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))}: re-run `python -m runtime.profile` to regenerate it"
        )
    try:
        return Profile.model_validate({**data, "schema_version": PROFILE_SCHEMA_VERSION})
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ValueError(f"profile {path} is invalid at {where}: {first['msg']}") from None


def save_profile(profile: Profile, path: str | Path) -> None:
    """Write a profile atomically (a partial file never replaces a good one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(profile.to_json())
    tmp.replace(path)


def profile_path(device_name: str, model_name: str, root: Path = PROFILES_DIR) -> Path:
    """Where the profile of ``model_name`` on ``device_name`` lives: ``profiles/<hardware>/<model>.json``."""
    return root / device_name / f"{model_name}.json"


def find_profile(device_name: str, model_name: str, root: Path = PROFILES_DIR) -> Path | None:
    """The committed profile for this hardware and model, or None when there is none."""
    path = profile_path(device_name, model_name, root)
    return path if path.is_file() else None


# ---------------------------------------------------------------------------------------------------------------
# Interpolation
# ---------------------------------------------------------------------------------------------------------------


EXTRAPOLATION_SLOPES = (1.0, 2.0)
"""Power-law exponents allowed when extrapolating beyond the measured sizes: a layer's work grows at least linearly
(GEMMs, norms) and at most quadratically (attention) in tokens and micro-batch; the measured end segment's slope,
which noise can make anything, is clamped to this range (downward only the upper bound applies)."""


def interp_loglog(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise power-law interpolation: linear in (log x, log y); beyond the ends, the end segment's exponent
    clamped to ``EXTRAPOLATION_SLOPES``.

    Exact for y = c * x**p inside the range (any p) and outside it for 1 <= p <= 2, which covers linear (MLP) and
    quadratic (attention) scaling; a mix is approximated segment by segment. A single point scales linearly.
    ``xs`` must be increasing and ``ys`` positive.
    """
    assert len(xs) == len(ys) and len(xs) >= 1, "need at least one point"
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], max(ys[i - 1], 1e-30), max(ys[i], 1e-30)
    slope = math.log(y1 / y0) / math.log(x1 / x0)
    lo, hi = EXTRAPOLATION_SLOPES
    if x > xs[-1]:
        return y1 * math.exp(min(max(slope, lo), hi) * math.log(x / x1))
    if x < xs[0]:
        slope = min(max(slope, 0.0), hi)
    return y0 * math.exp(slope * math.log(x / x0))


def interp_grid(points: dict[tuple[int, int], float], seq_len: float, micro_batch: float) -> float:
    """Interpolate a value measured on a (seq_len, micro_batch) grid: along seq_len at each measured micro-batch,
    then along micro-batch (both with ``interp_loglog``)."""
    by_mb: dict[int, list[tuple[int, float]]] = {}
    for (seq, mb), value in points.items():
        by_mb.setdefault(mb, []).append((seq, value))
    mbs = sorted(by_mb)
    at_seq = []
    for mb in mbs:
        row = sorted(by_mb[mb])
        at_seq.append(interp_loglog([s for s, _ in row], [v for _, v in row], seq_len))
    return interp_loglog(mbs, at_seq, micro_batch)


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
        """Measured cost of one layer instance, interpolated over seq_len and micro_batch; None if never measured.
        ``includes_comm`` picks the points timed as run (collectives included) instead of the single-process shard."""
        grid = self._layers.get((module, layer, tp, sp, includes_comm))
        if not grid:
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


def interp_collective(sizes: Sequence[float], times: Sequence[float], message_bytes: float) -> float:
    """Collective time at ``message_bytes``: linear between measured sizes (the alpha-beta model is linear in size),
    flat at the smallest size below it (latency floor) and extrapolated with the last segment's bandwidth above."""
    if message_bytes <= sizes[0] or len(sizes) == 1:
        return times[0] if message_bytes <= sizes[0] else times[0] * message_bytes / sizes[0]
    i = min(bisect.bisect_left(sizes, message_bytes), len(sizes) - 1)
    x0, x1, y0, y1 = sizes[i - 1], sizes[i], times[i - 1], times[i]
    return y0 + (y1 - y0) * (message_bytes - x0) / (x1 - x0)


# ---------------------------------------------------------------------------------------------------------------
# Device entry from a profile
# ---------------------------------------------------------------------------------------------------------------


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Fit of t = alpha + bytes / beta (Hockney's alpha-beta model, Hockney 1994, eq. 1) minimising the RELATIVE
    error sum(((alpha + b/beta) - t) / t)^2, so small latency-bound messages weigh as much as large ones
    (weighted least squares, weights 1/t^2, closed form).

    Returns (alpha seconds, beta bytes/s); alpha is clipped at 0.
    """
    assert len(sizes) >= 2, "need two message sizes to fit alpha and beta"
    w = [1.0 / (t * t) for t in times]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, sizes)) / sw
    my = sum(wi * y for wi, y in zip(w, times)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, sizes))
    slope = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, sizes, times)) / sxx
    return max(my - slope * mx, 0.0), 1.0 / slope


LINK_FIT_OP = "all_reduce"
"""The collective whose measured curve sets the link model: the one TP and DP put on the critical path."""


def link_from_collectives(profile: Profile, bus_efficiency: float) -> tuple[float, float] | None:
    """(latency alpha, device bandwidth) such that the cost model's ring all-reduce over 2 devices,
    ``B / (bandwidth * bus_efficiency) + 2 alpha`` (Thakur et al. 2005, Sec. 4.4 with n = 2), fits the measured
    2-device all-reduce curve; else the send/recv curve (``B / bw + alpha``); None without either."""
    for op, latency_terms in ((LINK_FIT_OP, 2), ("send_recv", 1)):
        curve = sorted((c.message_bytes, pick_time(c.time, profile.time_statistic)) for c in profile.collectives
                       if c.op == op and c.group_size == 2)
        if len(curve) >= 2:
            alpha, beta = fit_alpha_beta([b for b, _ in curve], [t for _, t in curve])
            return alpha / latency_terms, beta / bus_efficiency
    return None


def device_from_profile(base: DeviceSpec, profile: Profile, *, intra_node_bus_efficiency: float = 0.8) -> DeviceSpec:
    """``base`` with the numbers the profile measured: matmul peak, memory bandwidth and the link model fitted to
    the measured collectives (``link_from_collectives``; ``intra_node_bus_efficiency`` must be the cost model's,
    CostAssumptions' default 0.8, so that it reproduces the measured curve).

    Fields the profile did not measure keep the catalog's value; ``source`` names the profile.
    """
    changes: dict[str, float | str] = {}
    if profile.device is not None:
        changes["peak_bf16_flops"] = profile.device.peak_matmul_flops
        changes["memory_bandwidth"] = profile.device.memory_bandwidth
    fitted = link_from_collectives(profile, intra_node_bus_efficiency)
    if fitted is not None:
        changes["intra_node_latency"], changes["intra_node_bandwidth"] = fitted
    if not changes:
        return base
    changes["source"] = f"measured: profile {profile.hardware}/{profile.model} ({profile.provenance.date})"
    return replace(base, **changes)


# ---------------------------------------------------------------------------------------------------------------
# Calibration refit
# ---------------------------------------------------------------------------------------------------------------


def fit_scale_overhead(predicted: Sequence[float], measured: Sequence[float]) -> tuple[float, float]:
    """Least squares of measured = scale * predicted + overhead (ordinary least squares, closed form).

    With a single distinct prediction the overhead is not identifiable; then overhead = 0 and
    scale = sum(m*p) / sum(p*p).
    """
    n = len(predicted)
    assert n == len(measured) and n >= 1, "need matching, non-empty samples"
    mp, mm = sum(predicted) / n, sum(measured) / n
    sxx = sum((p - mp) ** 2 for p in predicted)
    if sxx <= 1e-12 * max(mp * mp, 1e-30):
        return sum(m * p for p, m in zip(predicted, measured)) / sum(p * p for p in predicted), 0.0
    scale = sum((p - mp) * (m - mm) for p, m in zip(predicted, measured)) / sxx
    return scale, mm - scale * mp


def relative_rms(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Root-mean-square of (predicted - measured) / measured."""
    return math.sqrt(sum(((p - m) / m) ** 2 for p, m in zip(predicted, measured)) / len(measured))


def refit_calibration(predicted: Sequence[float], measured: Sequence[float], *, sources: Sequence[str]) -> Calibration:
    """Refit scale/overhead from (predicted, measured) step times.

    ``predicted`` are the RAW predictions (before any calibration). A non-positive fitted scale (noise on near-identical predictions) falls back
    to the scale-only fit.
    """
    scale, overhead = fit_scale_overhead(predicted, measured)
    if scale <= 0:
        scale, overhead = sum(m * p for p, m in zip(predicted, measured)) / sum(p * p for p in predicted), 0.0
    after = [scale * p + overhead for p in predicted]
    return Calibration(
        scale=scale,
        overhead_s=overhead,
        num_samples=len(predicted),
        rms_error_before=relative_rms(predicted, measured),
        rms_error_after=relative_rms(after, measured),
        sources=list(sources),
    )


def calibrate(step_time_s: float, calibration: Calibration | None) -> float:
    """A raw predicted step time with the calibration applied."""
    if calibration is None:
        return step_time_s
    return calibration.scale * step_time_s + calibration.overhead_s



# ---------------------------------------------------------------------------------------------------------------
# The cost model's seam: measured per-layer costs
# ---------------------------------------------------------------------------------------------------------------


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
    """

    def __init__(self, profile: Profile, *, concurrent_devices: int = 1) -> None:
        self.profile = profile
        self.index = ProfileIndex(profile)
        self.slowdown = concurrency_slowdown(profile, concurrent_devices)

    def _cost(self, module: str, layer: str, *, tp: int, sp: int, seq_len: int, micro_batch: int
              ) -> tuple[LayerCost | None, bool, float]:
        """(cost, whether it was timed as run, slowdown to apply): as-run points first for sharded layers."""
        if tp * sp > 1:
            cost = self.index.layer_cost(module, layer, tp=tp, sp=sp, seq_len=seq_len, micro_batch=micro_batch,
                                         includes_comm=True)
            if cost is not None:
                return cost, True, max(self.slowdown / concurrency_slowdown(self.profile, tp * sp), 1.0)
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

    def step_time(self, raw_step_time_s: float) -> float:
        """A predicted step time with this profile's calibration applied (identity without one)."""
        return calibrate(raw_step_time_s, self.profile.calibration)

