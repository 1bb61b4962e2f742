"""The profile file's schema (pydantic): provenance, layer, collective, device and memory points, calibration.

Conventions: times in seconds, memory in bytes, FLOPs as counts. ``seq_len`` is the tokens of ONE sample entering
the module before any sequence-parallel split (the plan's own variable); the shard shape the TP/SP degrees imply is
what was measured. A layer point is either one rank's shard timed alone (``includes_comm`` False: the cost model
adds the TP/SP collectives) or the layer timed as the runtime runs it in tp*sp processes (``includes_comm`` True:
its collectives, DTensor dispatch and the ranks' contention for the host are in the times).
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from planner.contract.hardware import PLAUSIBLE_RANGES, PlausibleRange, check_plausible, get_device

PROFILE_SCHEMA_VERSION = 4
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
    host_seconds_per_op: Seconds | None = Field(
        default=None, description="host seconds of one eager operator call with autograd (runtime.profile.ops); None "
        "in profiles measured before it was")
    dtensor_seconds_per_op: Seconds | None = Field(
        default=None, description="extra host seconds of an operator call on DTensors")

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


class CalibratedRun(_Strict):
    """One measured run a calibration used: its step time measured, predicted before the fit and after it."""

    name: str = Field(description="the plan file, or the table row's plan arguments")
    measured_s: Seconds
    before_s: Seconds = Field(description="predicted with the assumptions before the fit")
    after_s: Seconds = Field(description="predicted with the fitted assumptions")
    leave_one_out_s: Seconds | None = Field(default=None, description="predicted with assumptions fitted on the other "
                                            "runs (None with fewer than three runs)")
    measured_peak_bytes: int | None = Field(default=None, ge=0)
    predicted_peak_bytes: int | None = Field(default=None, ge=0, description="after the fit")


class Calibration(_Strict):
    """Named cost-model assumptions refitted from measured runs, within physical bounds
    (``planner.profiles.calibration.CALIBRATED_ASSUMPTIONS``); the planner costs with them."""

    values: dict[str, float] = Field(description="CostAssumptions field -> fitted value (only the fields fitted)")
    at_bound: list[str] = Field(default_factory=list, description="fitted fields that ended on a bound of their range")
    not_identifiable: list[str] = Field(default_factory=list, description="fields the runs do not constrain (their "
                                        "predictions do not depend on them): kept at their defaults")
    runs: list[CalibratedRun]
    rms_error_before: float | None = Field(description="relative RMS step-time error before the fit (None: no step "
                                           "time was fitted, only memory)")
    rms_error_after: float | None
    leave_one_out_rms: float | None = Field(default=None, description="relative RMS error of each run predicted from "
                                            "a fit on the others")
    date: str = Field(description="ISO date-time of the fit")
    sources: list[str] = Field(description="the metrics files or tables the runs came from")


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


PEAK_MARGIN = 2.0
"""How far a layer's achieved FLOP/s (its FLOPs over its time) may exceed the device's peak before its numbers are
refused as a unit mistake: timing noise, and FLOP counts that include work the kernels skip (causal attention
counted dense), stay well under it."""
MIN_CONCURRENCY_SLOWDOWN = 0.5
"""Smallest per-device "slowdown" a profile may record for devices computing at once: below 1 is timing noise,
below a half no measurement of the same work."""
MAX_CONCURRENCY_SLOWDOWN = 1024.0
"""Largest per-device slowdown a profile may record for devices computing at once (one device per core of a
1,024-core host, in the extreme)."""
HOST_SECONDS_PER_OP = PlausibleRange(low=0.0, high=1e-2, unit="seconds", other_units=(("us", 1e-6), ("ms", 1e-3),
                                                                                      ("ns", 1e-9)))
"""Plausible host cost of one eager operator call (a few microseconds measured; 10 ms is beyond any host)."""
_TIME_HINT = "times are seconds and FLOPs plain counts (a time in another unit, or FLOPs scaled, would give this)"


def reference_peak(profile: Profile) -> tuple[float, str]:
    """The FLOP/s no layer of ``profile`` can beat by ``PEAK_MARGIN``: its device's datasheet peak (catalog GPUs),
    else its own matmul peak where measured (a CPU's catalog peak is a placeholder), else the plausible maximum."""
    if profile.device is not None and profile.hardware == "cpu":
        return profile.device.peak_matmul_flops, "the profile's measured matmul peak"
    try:
        return get_device(profile.hardware).peak_bf16_flops, f"the {profile.hardware} datasheet peak"
    except ValueError:  # a device the catalog does not know
        return PLAUSIBLE_RANGES["peak_bf16_flops"].high, "the plausible maximum"


def check_measurements(profile: Profile, origin: str) -> None:
    """Raise a one-line ValueError, with a unit hint, when a measured number of ``profile`` is physically
    impossible: device numbers outside ``PLAUSIBLE_RANGES`` (and ``HOST_SECONDS_PER_OP``), a layer with FLOPs but
    no time or faster than ``PEAK_MARGIN`` times the reference peak (``reference_peak``), a collective moving
    bytes faster than the plausible link maximum, memory beyond the plausible device maximum, a concurrency
    slowdown outside ``MIN_CONCURRENCY_SLOWDOWN`` to ``MAX_CONCURRENCY_SLOWDOWN``."""
    if profile.device is not None:
        for point in profile.device.matmul:
            check_plausible("peak_bf16_flops", point.flops_per_s, f"{origin}: device.matmul n={point.n} flops_per_s")
        check_plausible("memory_bandwidth", profile.device.memory_bandwidth, f"{origin}: device")
        for name in ("host_seconds_per_op", "dtensor_seconds_per_op"):
            value = getattr(profile.device, name)
            if value is not None and not HOST_SECONDS_PER_OP.low <= value <= HOST_SECONDS_PER_OP.high:
                raise ValueError(f"{origin}: device.{name} = {value:g} is outside the plausible range 0 to "
                                 f"{HOST_SECONDS_PER_OP.high:g} seconds (written in us or ns?)")
        for devices, slowdown in profile.device.concurrency.items():
            if not MIN_CONCURRENCY_SLOWDOWN <= slowdown <= MAX_CONCURRENCY_SLOWDOWN:
                raise ValueError(f"{origin}: device.concurrency[{devices}] = {slowdown:g} is not a slowdown factor "
                                 f"(1 = none; {MIN_CONCURRENCY_SLOWDOWN:g} to {MAX_CONCURRENCY_SLOWDOWN:g})")
    peak, what = reference_peak(profile)
    most_bytes = PLAUSIBLE_RANGES["memory_bytes"].high
    for i, layer in enumerate(profile.layers):
        where = f"{origin}: layers.{i} ({layer.module}/{layer.layer} seq_len {layer.seq_len})"
        for phase, flops in (("forward", layer.forward_flops), ("backward", layer.backward_flops)):
            seconds = getattr(layer, phase).median_s
            if flops > 0 and (seconds == 0 or flops / seconds > PEAK_MARGIN * peak):
                achieved = math.inf if seconds == 0 else flops / seconds
                raise ValueError(f"{where}: {phase} achieves {achieved:.3g} FLOP/s, above {PEAK_MARGIN:g} x {what} "
                                 f"({peak:.3g}); {_TIME_HINT}")
        if max(layer.peak_bytes, layer.saved_activation_bytes) > most_bytes:
            raise ValueError(f"{where}: {max(layer.peak_bytes, layer.saved_activation_bytes):,} bytes is more than "
                             f"any device holds ({most_bytes:,}): memory is in bytes")
    fastest = PLAUSIBLE_RANGES["intra_node_bandwidth"].high
    for point in profile.collectives:
        seconds = point.time.median_s
        if seconds == 0 or point.message_bytes / seconds > fastest:
            raise ValueError(f"{origin}: {point.op} of {point.message_bytes:,} bytes over {point.group_size} ranks in "
                             f"{seconds:g} s is faster than any link ({fastest:g} bytes/s): times are seconds, "
                             "message_bytes bytes")
    for point in profile.memory:
        if max(point.param_bytes, point.peak_bytes, point.saved_activation_bytes) > most_bytes:
            raise ValueError(f"{origin}: memory point {point.module}/{point.layer} seq_len {point.seq_len} records "
                             f"more bytes than any device holds ({most_bytes:,}): memory is in bytes")


def _shard_key(point: dict) -> tuple:
    return (point["module"], point["layer"], point["tp"], point["sp"], point["seq_len"], point["micro_batch"],
            point.get("includes_comm", False))
