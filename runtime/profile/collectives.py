"""Collective times versus message size for each group size: gloo between local processes on CPU, NCCL on GPUs.

Each group size runs in its own ``torch.multiprocessing.spawn`` of that many processes, timed by
``runtime.observability.collectives`` (the slowest rank's time per iteration); the recorded value is the median over
iterations.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from planner.profiles import COLLECTIVE_OPS, CollectivePoint, Spread
from runtime.observability.collectives import time_ops
from runtime.profile.device import free_port

DEFAULT_SIZES = tuple(4**k * 1024 for k in range(0, 9))  # 1 KiB .. 64 MiB


def _points(results: list[dict], group_size: int, backend: str) -> list[CollectivePoint]:
    """Profile points of ``time_ops``' timings."""
    return [
        CollectivePoint(
            op=r["op"], group_size=group_size, message_bytes=r["message_bytes"], backend=backend,
            time=Spread(median_s=statistics.median(r["times"]), min_s=min(r["times"]), max_s=max(r["times"]),
                        repeats=len(r["times"])),
        )
        for r in results
    ]


def _worker(rank: int, group_size: int, port: int, sizes: tuple[int, ...], ops: tuple[str, ...], device_type: str,
            repeats: int, warmup: int, out: str) -> None:
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=group_size)
    results = time_ops(rank, group_size, sizes, ops, device, backend, repeats, warmup)
    if rank == 0:
        Path(out).write_text(json.dumps({"backend": backend, "results": results}))
    dist.destroy_process_group()


def default_group_sizes(device: torch.device) -> tuple[int, ...]:
    """Group sizes this machine offers: 2..devices (GPUs, or CPU cores with one process per core)."""
    count = torch.cuda.device_count() if device.type == "cuda" else (os.cpu_count() or 1)
    return tuple(g for g in range(2, count + 1))


def measure_group(group_size: int, *, device: torch.device, sizes: tuple[int, ...] = DEFAULT_SIZES,
                  ops: tuple[str, ...] = COLLECTIVE_OPS, repeats: int = 5, warmup: int = 2) -> list[CollectivePoint]:
    """Spawn ``group_size`` processes and time every op at every size."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "collectives.json")
        mp.spawn(_worker, args=(group_size, free_port(), sizes, ops, device.type, repeats, warmup, out),
                 nprocs=group_size, join=True)
        data = json.loads(Path(out).read_text())
    return _points(data["results"], group_size, data["backend"])


def measure_collectives(*, device: torch.device, group_sizes: tuple[int, ...] | None,
                        existing: list[CollectivePoint], sizes: tuple[int, ...] = DEFAULT_SIZES) -> list[CollectivePoint]:
    """``existing`` plus every group size it lacks (resumable per group size)."""
    sizes_done = {c.group_size for c in existing}
    groups = group_sizes or default_group_sizes(device)
    if not groups:
        raise ValueError("this machine offers no group of 2 or more devices to time collectives on")
    points = list(existing)
    for g in groups:
        if g not in sizes_done:
            points.extend(measure_group(g, device=device, sizes=sizes))
    return points
