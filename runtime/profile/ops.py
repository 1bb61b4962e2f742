"""How many operations a pass dispatches, and what one dispatch costs the host.

Eager PyTorch pays host time for every operator call (Python, the dispatcher, autograd bookkeeping, and for a DTensor
its sharding propagation) whether or not the kernel behind it does much. ``OpCounter`` counts the calls of a pass as
the dispatcher sees them (a ``TorchDispatchMode`` sees each top-level call once: a DTensor op's local op runs inside
DTensor's own handler, below the mode); ``host_seconds_per_op`` times a chain of calls too small for their kernels
to matter.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


@dataclass(kw_only=True)
class OpCount:
    """Operator calls of one pass."""

    ops: int = 0
    """All calls."""
    dtensor_ops: int = 0
    """Of ``ops``, the calls on DTensors (each pays sharding propagation on top)."""
    kernels: int = 0
    """Of ``ops``, those that launch work (not views / metadata changes): what a GPU runs as a kernel."""


class OpCounter(TorchDispatchMode):
    """Counts the operator calls made while active (forward and, if it runs inside, autograd's backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = OpCount()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat, _ = tree_flatten((args, kwargs or {}))
        self.count.ops += 1
        self.count.dtensor_ops += any(isinstance(a, DTensor) for a in flat)
        self.count.kernels += not func.is_view
        return func(*args, **(kwargs or {}))


HOST_PROBE_OPS = 200
"""Calls in one timed chain of ``host_seconds_per_op``."""


def _probe_chain(leaf: torch.Tensor) -> None:
    y = leaf
    for _ in range(HOST_PROBE_OPS):
        y = y + leaf
    y.sum().backward()


def host_seconds_per_op(make_tensor=None, *, repeats: int = 7) -> float:
    """Host seconds per operator call with autograd recording: a chain of ``HOST_PROBE_OPS`` in-graph adds on
    one-element tensors (their kernels are negligible), forward and backward, timed without the counter and divided
    by the calls it counts. ``make_tensor`` builds the chain's leaf (default: a plain CPU tensor; pass one returning
    a DTensor to time DTensor dispatch). Median of ``repeats`` after one warm-up."""
    make_tensor = make_tensor or (lambda: torch.ones(1))
    with OpCounter() as counter:
        _probe_chain(make_tensor().requires_grad_(True))
    samples = []
    for i in range(repeats + 1):
        leaf = make_tensor().requires_grad_(True)
        start = time.perf_counter()
        _probe_chain(leaf)
        if i:
            samples.append((time.perf_counter() - start) / counter.count.ops)
    return statistics.median(samples)


def measure_host_dispatch(port: int, device: torch.device) -> tuple[float, float]:
    """(host seconds per plain call on ``device``'s tensors — on a GPU, the launch call included, the kernels left to
    run behind —, extra seconds per DTensor call). The DTensor probe runs on CPU tensors of a one-rank gloo mesh (a
    world of its own on ``port`` when no process group exists): sharding propagation is host work, the same for
    any device's tensors, and it does not depend on the mesh size once cached."""
    plain = host_seconds_per_op(lambda: torch.ones(1, device=device))
    cpu_plain = plain if device.type == "cpu" else host_seconds_per_op()
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        dtensor = host_seconds_per_op(lambda: distribute_tensor(torch.ones(1), mesh, [Replicate()]))
    finally:
        if own_group:
            dist.destroy_process_group()
    return plain, max(dtensor - cpu_plain, 0.0)
