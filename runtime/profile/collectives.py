"""Collective times versus message size for each group size: gloo between local processes on CPU, NCCL on GPUs.

Each group size runs in its own ``torch.multiprocessing.spawn`` of that many processes. An iteration's time is the
slowest rank's (an all-reduce MAX of the per-rank timings); the recorded value is the median over iterations.
``message_bytes`` is the per-rank input buffer: the all-gather output and the reduce-scatter input are
``group_size`` times larger / the same, as in NCCL's own benchmarks (nccl-tests ``size``).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from planner.profiles import COLLECTIVE_OPS, CollectivePoint, Spread
from runtime.profile.device import free_port

DEFAULT_SIZES = tuple(4**k * 1024 for k in range(0, 9))  # 1 KiB .. 64 MiB


def _op(name: str, x: torch.Tensor, group_size: int, rank: int, backend: str) -> Callable[[], None]:
    """A closure running collective ``name`` on ``x`` (per-rank input)."""
    if name == "all_reduce":
        return lambda: dist.all_reduce(x)
    if name == "all_gather":
        out = torch.empty(x.numel() * group_size, dtype=x.dtype, device=x.device)
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        return lambda: gather(out, x)
    if name == "reduce_scatter":
        out = torch.empty(x.numel() // group_size, dtype=x.dtype, device=x.device)
        if backend == "nccl":
            return lambda: dist.reduce_scatter_tensor(out, x)
        chunks = list(x.chunk(group_size))
        return lambda: dist.reduce_scatter(out, chunks)
    if name == "all_to_all":
        out = torch.empty_like(x)
        return lambda: dist.all_to_all_single(out, x)
    if name == "send_recv":
        # One-way point-to-point between ranks 0 and 1; other ranks idle. Ping-pong halves the round trip.
        def ping_pong() -> None:
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            elif rank == 1:
                dist.recv(x, 0)
                dist.send(x, 0)

        return ping_pong
    raise ValueError(f"unknown collective {name!r}")


def _time_op(fn: Callable[[], None], device: torch.device, repeats: int, warmup: int, divisor: float) -> list[float]:
    """Per-iteration seconds of the slowest rank."""
    times = []
    for i in range(warmup + repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([(time.perf_counter() - start) / divisor], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(float(elapsed))
    return times


def _worker(rank: int, group_size: int, port: int, sizes: tuple[int, ...], ops: tuple[str, ...], device_type: str,
            repeats: int, warmup: int, out: str) -> None:
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=group_size)
    results = []
    for name in ops:
        for size in sizes:
            elements = max(size // 4 // group_size, 1) * group_size  # float32, divisible by the group
            x = torch.ones(elements, dtype=torch.float32, device=device)
            fn = _op(name, x, group_size, rank, backend)
            times = _time_op(fn, device, repeats, warmup, divisor=2.0 if name == "send_recv" else 1.0)
            results.append({"op": name, "message_bytes": elements * 4, "times": times})
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
    return [
        CollectivePoint(
            op=r["op"], group_size=group_size, message_bytes=r["message_bytes"], backend=data["backend"],
            time=Spread(median_s=statistics.median(r["times"]), min_s=min(r["times"]), max_s=max(r["times"]),
                        repeats=len(r["times"])),
        )
        for r in data["results"]
    ]


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
