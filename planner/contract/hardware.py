"""Hardware the planner costs against: one GPU type (or the CPU) and a cluster of them."""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

from planner.contract.units import GIB
from planner.contract.file_io import check_depth, read_text


@dataclass(kw_only=True, frozen=True)
class DeviceSpec:
    """One accelerator type and its links. Bandwidths are per device, one direction, in bytes/s."""

    name: str
    """Catalog name, e.g. ``h100-80gb``."""
    peak_bf16_flops: float
    """Peak dense bf16 FLOP/s (no sparsity)."""
    memory_bytes: int
    """Device memory (HBM) capacity."""
    memory_bandwidth: float
    """HBM bandwidth, bytes/s."""
    intra_node_bandwidth: float
    """Per-device unidirectional bandwidth to peers in the same node (NVLink), bytes/s."""
    intra_node_latency: float
    """Per-message latency inside a node, seconds."""
    inter_node_bandwidth: float
    """Per-device unidirectional bandwidth to other nodes (IB/RoCE NIC), bytes/s."""
    inter_node_latency: float
    """Per-message latency between nodes, seconds."""
    devices_per_node: int
    """Devices sharing the fast intra-node link."""
    kernel_launch_latency: float
    """Seconds the device spends per kernel beyond its work (launch latency; 0 for a CPU, which runs kernels as
    calls)."""
    host_overlap: float
    """Fraction of the shorter of a pass's host dispatch and its device work hidden behind the longer: how far the
    host runs ahead of the device (asynchronous CUDA streams: near 1, less the syncs of a training step; a CPU
    computes on the host itself: 0)."""
    source: str
    """Where the numbers come from (spec sheet, or the profile they were measured in)."""


@dataclass(kw_only=True, frozen=True)
class Cluster:
    """``num_devices`` devices of one type, ``devices_per_node`` to a node."""

    device: DeviceSpec
    """The device type."""
    num_devices: int
    """Devices the plan may use."""
    devices_per_node: int
    """Devices per node (defaults to the device's own)."""

    def __post_init__(self) -> None:
        if self.num_devices < 1:
            raise ValueError(f"the number of GPUs must be >= 1, got {self.num_devices}")
        if self.devices_per_node < 1:
            raise ValueError(f"GPUs per node must be >= 1, got {self.devices_per_node}")

    @property
    def num_nodes(self) -> int:
        """Nodes spanned (the last one may be partly used)."""
        return -(-self.num_devices // self.devices_per_node)


@dataclass(kw_only=True, frozen=True)
class PlausibleRange:
    """The values a device field may take in a cluster file: wide enough for any real device (a CPU worker to a
    GPU generations ahead), narrow enough to catch a number written in another unit (GB/s for bytes/s)."""

    low: float
    """Smallest plausible value."""
    high: float
    """Largest plausible value."""
    unit: str
    """The unit the field is in."""
    other_units: tuple[tuple[str, float], ...] = ()
    """(unit, its size in ``unit``) a user may have written instead, for the hint (GB/s -> 1e9 bytes/s)."""


_BANDWIDTH_UNITS = (("GB/s", 1e9), ("TB/s", 1e12), ("Gb/s", 1e9 / 8))
_LATENCY_UNITS = (("us", 1e-6), ("ms", 1e-3), ("ns", 1e-9))
PLAUSIBLE_RANGES: dict[str, PlausibleRange] = {
    "peak_bf16_flops": PlausibleRange(low=1e9, high=1e17, unit="FLOP/s",
                                      other_units=(("TFLOP/s", 1e12), ("PFLOP/s", 1e15), ("GFLOP/s", 1e9))),
    "memory_bytes": PlausibleRange(low=2**28, high=2**44, unit="bytes", other_units=(("GiB", 2**30), ("MiB", 2**20))),
    "memory_bandwidth": PlausibleRange(low=1e9, high=1e14, unit="bytes/s", other_units=_BANDWIDTH_UNITS),
    "intra_node_bandwidth": PlausibleRange(low=1e7, high=1e14, unit="bytes/s", other_units=_BANDWIDTH_UNITS),
    "intra_node_latency": PlausibleRange(low=0.0, high=1e-2, unit="seconds", other_units=_LATENCY_UNITS),
    "inter_node_bandwidth": PlausibleRange(low=1e7, high=1e14, unit="bytes/s", other_units=_BANDWIDTH_UNITS),
    "inter_node_latency": PlausibleRange(low=0.0, high=1e-1, unit="seconds", other_units=_LATENCY_UNITS),
    "devices_per_node": PlausibleRange(low=1, high=1024, unit="devices"),
    "kernel_launch_latency": PlausibleRange(low=0.0, high=1e-3, unit="seconds", other_units=_LATENCY_UNITS),
    "host_overlap": PlausibleRange(low=0.0, high=1.0, unit="fraction"),
}
"""DeviceSpec field -> the range a cluster file's value must lie in: peak 1 GFLOP/s (a CPU worker) to 100 PFLOP/s;
256 MiB to 16 TiB of memory; memory bandwidth 1 GB/s to 100 TB/s; links 10 MB/s to 100 TB/s per direction;
latencies 0 to 10 ms in a node and 100 ms between nodes; 1 to 1,024 devices per node; kernel launch 0 to 1 ms; host
overlap a fraction. Together with the flag
bounds (``planner.problem``) they keep every predicted time far inside the solver's integers (``planner.search.solver``)."""


# --- Device catalog ---------------------------------------------------------------------------------------------

NCCL_NVLINK_HOP_LATENCY = 3.4e-6
"""Per-hop latency of NCCL's tuning model, ring/Simple over NVLink (nccl src/graph/tuning.cc hwLat, NVLS-era)."""
NCCL_NET_HOP_LATENCY = 14.0e-6
"""Per-hop latency of NCCL's tuning model for ring/Simple over the network (same table)."""
GPU_KERNEL_LAUNCH_LATENCY = 3e-6
"""Seconds per kernel launch on a recent NVIDIA GPU (assumed 3 us): the per-kernel launch overhead that NVIDIA's
"Getting Started with CUDA Graphs" (Technical Blog, 2019) shows dominating short kernels and graphs removing."""
GPU_HOST_OVERLAP = 0.9
"""How far a GPU's host runs ahead: kernels are queued asynchronously (CUDA streams), but a training step syncs
(loss and gradient-norm reads, allocator frees), so not everything hides (assumed; a cluster file may override it)."""
_LATENCY_SOURCE = ("latencies: NCCL tuning model ring/Simple hwLat (NVLink 3.4 us, NET 14 us per hop); kernel "
                   "launch 3 us (NVIDIA, Getting Started with CUDA Graphs, 2019)")


@dataclass(kw_only=True, frozen=True)
class DeviceEntry:
    """One catalog device."""

    spec: DeviceSpec
    """Its numbers."""
    aliases: tuple[str, ...]
    """Other names it answers to (case-insensitive; '_' and ' ' read as '-')."""
    description: str
    """One line for listings."""


# datasheet "GB" of HBM is taken as GiB: the driver reports within 1% of it (H100: 81,559 MiB of 81,920)
DEVICE_CATALOG: dict[str, DeviceEntry] = {
    "h100-80gb": DeviceEntry(
        spec=DeviceSpec(
            name="h100-80gb", peak_bf16_flops=1979e12 / 2, memory_bytes=80 * GIB, memory_bandwidth=3.35e12,
            intra_node_bandwidth=900e9 / 2, intra_node_latency=NCCL_NVLINK_HOP_LATENCY,
            inter_node_bandwidth=400e9 / 8, inter_node_latency=NCCL_NET_HOP_LATENCY, devices_per_node=8,
            kernel_launch_latency=GPU_KERNEL_LAUNCH_LATENCY, host_overlap=GPU_HOST_OVERLAP,
            source="NVIDIA H100 Tensor Core GPU datasheet (2023), SXM: bf16 1,979 TFLOPS with sparsity (/2 dense), "
            "80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s bidirectional (/2); NVIDIA DGX H100 datasheet (2023): "
            f"8x ConnectX-7 400 Gb/s, one per GPU; {_LATENCY_SOURCE}",
        ),
        aliases=("h100", "h100-sxm", "h100-sxm5", "h100-sxm-80gb", "h100-sxm5-80gb", "h100-80g"),
        description="NVIDIA H100 SXM5 80GB HBM3, NVLink 4, 8 per node (DGX H100)",
    ),
    "h200-141gb": DeviceEntry(
        spec=DeviceSpec(
            name="h200-141gb", peak_bf16_flops=1979e12 / 2, memory_bytes=141 * GIB, memory_bandwidth=4.8e12,
            intra_node_bandwidth=900e9 / 2, intra_node_latency=NCCL_NVLINK_HOP_LATENCY,
            inter_node_bandwidth=400e9 / 8, inter_node_latency=NCCL_NET_HOP_LATENCY, devices_per_node=8,
            kernel_launch_latency=GPU_KERNEL_LAUNCH_LATENCY, host_overlap=GPU_HOST_OVERLAP,
            source="NVIDIA H200 Tensor Core GPU datasheet (2024), SXM: bf16 1,979 TFLOPS with sparsity (/2 dense), "
            "141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s bidirectional (/2); NVIDIA DGX H200 datasheet (2024): "
            f"8x ConnectX-7 400 Gb/s, one per GPU; {_LATENCY_SOURCE}",
        ),
        aliases=("h200", "h200-sxm", "h200-sxm-141gb", "h200-141g"),
        description="NVIDIA H200 SXM 141GB HBM3e, NVLink 4, 8 per node (DGX H200)",
    ),
    "a100-80gb": DeviceEntry(
        spec=DeviceSpec(
            name="a100-80gb", peak_bf16_flops=312e12, memory_bytes=80 * GIB, memory_bandwidth=2.039e12,
            intra_node_bandwidth=600e9 / 2, intra_node_latency=NCCL_NVLINK_HOP_LATENCY,
            inter_node_bandwidth=200e9 / 8, inter_node_latency=NCCL_NET_HOP_LATENCY, devices_per_node=8,
            kernel_launch_latency=GPU_KERNEL_LAUNCH_LATENCY, host_overlap=GPU_HOST_OVERLAP,
            source="NVIDIA A100 Tensor Core GPU datasheet (2021), 80GB SXM: bf16 312 TFLOPS dense, 80 GB HBM2e at "
            "2,039 GB/s, NVLink 600 GB/s bidirectional (/2); NVIDIA DGX A100 datasheet (2020): 8x ConnectX-6 "
            f"200 Gb/s HDR InfiniBand, one per GPU; {_LATENCY_SOURCE}",
        ),
        aliases=("a100", "a100-sxm", "a100-sxm4", "a100-sxm-80gb", "a100-sxm4-80gb", "a100-80g"),
        description="NVIDIA A100 SXM4 80GB HBM2e, NVLink 3, 8 per node (DGX A100)",
    ),
    "b200": DeviceEntry(
        spec=DeviceSpec(
            name="b200", peak_bf16_flops=36e15 / 8 / 2, memory_bytes=180 * GIB, memory_bandwidth=64e12 / 8,
            intra_node_bandwidth=1.8e12 / 2, intra_node_latency=NCCL_NVLINK_HOP_LATENCY,
            inter_node_bandwidth=400e9 / 8, inter_node_latency=NCCL_NET_HOP_LATENCY, devices_per_node=8,
            kernel_launch_latency=GPU_KERNEL_LAUNCH_LATENCY, host_overlap=GPU_HOST_OVERLAP,
            source="NVIDIA HGX B200 specifications (2024): bf16 36 PFLOPS with sparsity per 8 GPUs (/8, /2 dense), "
            "NVLink 5 1.8 TB/s per GPU bidirectional (/2); NVIDIA DGX B200 datasheet (2024): 1,440 GB HBM3e and "
            f"64 TB/s per 8 GPUs, 8x ConnectX-7 400 Gb/s, one per GPU; {_LATENCY_SOURCE}",
        ),
        aliases=("b200-180gb", "b200-sxm", "hgx-b200", "dgx-b200"),
        description="NVIDIA B200 180GB HBM3e, NVLink 5, 8 per node (DGX/HGX B200)",
    ),
    "cpu": DeviceEntry(
        spec=DeviceSpec(
            name="cpu", peak_bf16_flops=100e9, memory_bytes=16 * GIB, memory_bandwidth=20e9,
            intra_node_bandwidth=5e9, intra_node_latency=50e-6, inter_node_bandwidth=1.25e9,
            inter_node_latency=100e-6, devices_per_node=8, kernel_launch_latency=0.0, host_overlap=0.0,
            source="PLACEHOLDER, not measured: round numbers for one CPU worker process (100 GFLOP/s, 16 GiB, "
            "20 GB/s memory, 5 GB/s / 50 us gloo between local ranks, 10 GbE between hosts); a profile of this "
            "machine replaces them",
        ),
        aliases=("host", "cpu-gloo"),
        description="CPU worker processes over gloo (placeholder numbers until profiled)",
    ),
}
"""Catalog name -> device."""

_DEVICE_BY_NAME: dict[str, str] = {
    key: name for name, entry in DEVICE_CATALOG.items() for key in (name, *entry.aliases)
}
"""Normalised name or alias -> catalog name."""


def _normalise(name: str) -> str:
    """Lower case; '_' and spaces read as '-'."""
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def get_device(name: str) -> DeviceSpec:
    """The catalog device called ``name`` (or an alias such as ``h100`` or ``H100-SXM-80GB``).

    Raises:
        ValueError: unknown name, with the closest known names, in one line.
    """
    key = _DEVICE_BY_NAME.get(_normalise(name))
    if key is None:
        close = difflib.get_close_matches(_normalise(name), list(_DEVICE_BY_NAME), n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ValueError(f"unknown device {name!r}; {hint}known: {', '.join(DEVICE_CATALOG)}")
    return DEVICE_CATALOG[key].spec


def list_devices() -> list[tuple[str, tuple[str, ...], str]]:
    """(name, aliases, description) of every catalog device."""
    return [(name, entry.aliases, entry.description) for name, entry in DEVICE_CATALOG.items()]


HOST_FIELDS = ("kernel_launch_latency", "host_overlap")
"""Device fields that plans record since host costs were modelled."""


def with_host_fields(values: Mapping[str, Any]) -> dict[str, Any]:
    """A recorded device's fields (a plan's ``cluster.device``) with the host fields an older plan lacks: the
    catalog device's values when its name is a catalog device, else 0 (no host cost)."""
    missing = [name for name in HOST_FIELDS if name not in values]
    if not missing:
        return dict(values)
    try:
        catalog = get_device(str(values.get("name", "")))
    except ValueError:
        catalog = None
    return {**values, **{name: getattr(catalog, name) if catalog else 0.0 for name in missing}}


def make_cluster(device: DeviceSpec | str, num_devices: int, devices_per_node: int | None = None) -> Cluster:
    """``num_devices`` of ``device`` (a spec or a catalog name), by default as many per node as the device has."""
    spec = get_device(device) if isinstance(device, str) else device
    return Cluster(device=spec, num_devices=num_devices, devices_per_node=devices_per_node or spec.devices_per_node)


# --- Cluster files ----------------------------------------------------------------------------------------------

_FIELD_TYPES: dict[str, str] = {f.name: str(f.type) for f in fields(DeviceSpec)}
"""DeviceSpec field -> its annotation ("int", "float" or "str")."""


def _number(key: str, value: Any, origin: str) -> float:
    """A finite number, also from a string such as "25e9"; positive, except that a latency may be 0."""
    lowest = "non-negative" if key.endswith("latency") or key == "host_overlap" else "positive"
    error = ValueError(f"{origin}: {key} must be a {lowest} number, got {value!r}")
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise error
    try:
        number = float(value)
    except ValueError:
        raise error from None
    if not math.isfinite(number) or number < 0 or (number == 0 and lowest == "positive"):
        raise error
    return number


def _field_value(key: str, value: Any, origin: str) -> int | float | str:
    """A cluster-file value checked against the DeviceSpec field's type."""
    kind = _FIELD_TYPES[key]
    if kind == "str":
        if not isinstance(value, str) or not value:
            raise ValueError(f"{origin}: {key} must be a non-empty string, got {value!r}")
        return value
    number = _number(key, value, origin)
    if kind == "int" and not number.is_integer():
        raise ValueError(f"{origin}: {key} must be a whole number, got {value!r}")
    check_plausible(key, number, origin)
    return int(number) if kind == "int" else number


def check_plausible(key: str, value: float, origin: str) -> None:
    """Raise a one-line ValueError naming the field, value, unit and range when ``value`` is outside the field's
    ``PLAUSIBLE_RANGES``, with the value in the expected unit if it looks like one written in another."""
    bounds = PLAUSIBLE_RANGES[key]
    if bounds.low <= value <= bounds.high:
        return
    fitting = [(unit, value * size) for unit, size in bounds.other_units if bounds.low <= value * size <= bounds.high]
    hint = ""
    if fitting:
        units = " or ".join(unit for unit, _ in fitting)
        values = ", ".join(f"{value:g} {unit} = {converted:g}" for unit, converted in fitting)
        hint = f" (written in {units}? {values} {bounds.unit})"
    raise ValueError(f"{origin}: {key} = {value:g} is outside the plausible range {bounds.low:g} to "
                     f"{bounds.high:g} {bounds.unit}{hint}")


def _check_fields(values: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """Typed values of known DeviceSpec fields; an unknown key is an error that suggests the closest field."""
    checked = {}
    for key, value in values.items():
        if key not in _FIELD_TYPES:
            close = difflib.get_close_matches(str(key), list(_FIELD_TYPES), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ValueError(f"{origin}: unknown field {key!r}; {hint}fields: device, {', '.join(_FIELD_TYPES)}")
        checked[key] = _field_value(key, value, origin)
    return checked


def override_device(device: DeviceSpec, overrides: Mapping[str, Any], origin: str) -> DeviceSpec:
    """``device`` with some fields replaced; ``source`` records ``origin`` unless the overrides set it.

    Raises:
        ValueError: unknown field or bad value, in one line.
    """
    checked = _check_fields(overrides, origin)
    if not checked:
        return device
    checked.setdefault("source", f"{device.source}; overridden by {origin}: {', '.join(sorted(checked))}")
    return replace(device, **checked)


def _new_device(values: Mapping[str, Any], origin: str) -> DeviceSpec:
    """A device defined entirely by a cluster file (every field but ``source`` given)."""
    checked = _check_fields(values, origin)
    checked.setdefault("source", f"user-defined in {origin}")
    missing = [key for key in _FIELD_TYPES if key not in checked]
    if missing:
        raise ValueError(f"{origin}: give \"device\" (one of {', '.join(DEVICE_CATALOG)}) to start from, "
                         f"or every field of a new device; missing: {', '.join(missing)}")
    return DeviceSpec(**checked)


def _read_mapping(path: str) -> dict[str, Any]:
    """A JSON (``.json``) or YAML (anything else) file holding one mapping."""
    text = read_text(path, kind="cluster file")
    try:
        if path.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml  # pyyaml; only cluster files need it

            data = yaml.safe_load(text)
    except Exception as e:  # json.JSONDecodeError, yaml.YAMLError, RecursionError (nested too deep)
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"cluster file {path} does not parse: {first_line}") from None
    check_depth(data, where=f"cluster file {path}")
    if not isinstance(data, dict):
        raise ValueError(f"cluster file {path} must hold a mapping of fields, got {type(data).__name__}")
    return data


def load_cluster_file(path: str) -> tuple[DeviceSpec, dict[str, Any]]:
    """The device described by a JSON/YAML cluster file, and the fields the file set.

    The file either names a catalog ``device`` and overrides some of its fields, e.g.
    ``{"device": "h100-80gb", "inter_node_bandwidth": 25e9, "devices_per_node": 8}``, or gives every DeviceSpec
    field of a new device. Numbers may be written as strings (YAML reads ``25e9`` as one).

    Raises:
        ValueError: unreadable file, parse error, unknown device or field, or a bad value, in one line.
    """
    data = _read_mapping(path)
    base = data.pop("device", None)
    overrides = _check_fields(data, path)
    if base is None:
        return _new_device(overrides, path), overrides
    if not isinstance(base, str):
        raise ValueError(f"{path}: device must be a catalog name such as h100-80gb, got {base!r}")
    return override_device(get_device(base), overrides, path), overrides
