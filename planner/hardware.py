"""Hardware the planner costs against: one GPU type (or the CPU) and a cluster of them."""

from __future__ import annotations

from dataclasses import dataclass


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
