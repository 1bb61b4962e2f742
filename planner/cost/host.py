"""Host-side cost of a pass: eager dispatch per operator call and kernel launches, against the device's work.

An eager framework pays host time for every operator call (Python, the dispatcher, autograd, and for a DTensor its
sharding propagation) and the device pays a launch latency for every kernel. On a GPU the host queues kernels
ahead, so a pass takes the longer of the two and hides (part of) the shorter; when each kernel is tiny (a narrow
encoder split 8 ways, a small micro-batch) the host is the longer (He 2022, "Making Deep Learning Go Brrrr From
First Principles", Sec. "Overhead": the GPU waits on the host when ops are small). On a CPU the host runs the
kernels itself, so nothing hides.
"""

from __future__ import annotations

from planner.cost.assumptions import CostAssumptions
from planner.cost.op_counts import PassOps
from planner.contract.hardware import DeviceSpec


def host_dispatch_time(ops: PassOps, assumptions: CostAssumptions) -> float:
    """Host seconds to dispatch a pass: every call at ``host_seconds_per_op``, DTensor calls
    ``dtensor_seconds_per_op`` more (He 2022, "Overhead": per-call framework cost independent of tensor size)."""
    return ops.ops * assumptions.host_seconds_per_op + ops.dtensor_ops * assumptions.dtensor_seconds_per_op


def device_pass_time(compute_s: float, ops: PassOps, device: DeviceSpec) -> float:
    """Device seconds of a pass: its kernels' work plus one launch latency per kernel (NVIDIA, "Getting Started
    with CUDA Graphs", 2019: a few microseconds of launch overhead per kernel, which CUDA Graphs remove)."""
    return compute_s + ops.kernels * device.kernel_launch_latency


def pass_time(compute_s: float, ops: PassOps, device: DeviceSpec, assumptions: CostAssumptions) -> float:
    """Seconds of a pass: ``max(device, host) + (1 - overlap) * min(device, host)``, where ``overlap`` is the
    device's ``host_overlap`` (how far its host runs ahead: near 1 on a GPU's asynchronous streams, 0 on a CPU)."""
    if compute_s <= 0 and ops.ops <= 0:
        return 0.0
    device_s = device_pass_time(compute_s, ops, device)
    host_s = host_dispatch_time(ops, assumptions)
    return max(device_s, host_s) + (1 - device.host_overlap) * min(device_s, host_s)
