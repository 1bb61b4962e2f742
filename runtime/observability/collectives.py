"""Collectives timed on the process groups of the current world: the profiler's own processes
(``runtime.profile.collectives``) and a running job's devices (an adaptive run, ``runtime.launch.adapt``).

An iteration's time is the slowest rank's (an all-reduce MAX of the per-rank timings). ``message_bytes`` is the
per-rank input buffer: the all-gather output and the reduce-scatter input are ``group_size`` times larger / the
same, as in NCCL's own benchmarks (nccl-tests ``size``).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

IN_RUN_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
"""The collectives the cost model prices (``planner.profiles.COLLECTIVE_OPS``)."""

def _op(name: str, x: torch.Tensor, group_size: int, rank: int, backend: str, group: Any = None
        ) -> Callable[[], None]:
    """A closure running collective ``name`` on ``x`` (per-rank input) over ``group`` (the world when None; a group
    of the world's first ranks, so that its ranks 0 and 1 are the world's)."""
    if name == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if name == "all_gather":
        out = torch.empty(x.numel() * group_size, dtype=x.dtype, device=x.device)
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        return lambda: gather(out, x, group=group)
    if name == "reduce_scatter":
        out = torch.empty(x.numel() // group_size, dtype=x.dtype, device=x.device)
        if backend == "nccl":
            return lambda: dist.reduce_scatter_tensor(out, x, group=group)
        chunks = list(x.chunk(group_size))
        return lambda: dist.reduce_scatter(out, chunks, group=group)
    if name == "all_to_all":
        out = torch.empty_like(x)
        return lambda: dist.all_to_all_single(out, x, group=group)
    if name == "send_recv":
        # One-way point-to-point between ranks 0 and 1; other ranks idle. Ping-pong halves the round trip.
        def ping_pong() -> None:
            if rank == 0:
                dist.send(x, 1, group=group)
                dist.recv(x, 1, group=group)
            elif rank == 1:
                dist.recv(x, 0, group=group)
                dist.send(x, 0, group=group)

        return ping_pong
    raise ValueError(f"unknown collective {name!r}")


def _time_op(fn: Callable[[], None], device: torch.device, repeats: int, warmup: int, divisor: float,
             group: Any = None) -> list[float]:
    """Per-iteration seconds of the slowest rank (of ``group``; the world when None)."""
    times = []
    for i in range(warmup + repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([(time.perf_counter() - start) / divisor], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        if i >= warmup:
            times.append(float(elapsed))
    return times


def time_ops(rank: int, group_size: int, sizes: tuple[int, ...], ops: tuple[str, ...], device: torch.device,
              backend: str, repeats: int, warmup: int, group: Any = None) -> list[dict]:
    """Every op at every size over ``group``: {op, message_bytes, times}."""
    results = []
    for name in ops:
        for size in sizes:
            elements = max(size // 4 // group_size, 1) * group_size  # float32, divisible by the group
            x = torch.ones(elements, dtype=torch.float32, device=device)
            fn = _op(name, x, group_size, rank, backend, group)
            times = _time_op(fn, device, repeats, warmup, 2.0 if name == "send_recv" else 1.0, group)
            results.append({"op": name, "message_bytes": elements * 4, "times": times})
    return results


IN_RUN_SIZES = tuple(4**k * 1024 for k in (1, 3, 5, 7))  # 4 KiB .. 16 MiB
"""Message sizes ``time_in_world`` times (fewer than a profile's: a running job waits for them)."""


def time_in_world(rank: int, group_sizes: tuple[int, ...], device: torch.device, *,
                  sizes: tuple[int, ...] = IN_RUN_SIZES, ops: tuple[str, ...] = IN_RUN_OPS, repeats: int = 3,
                  warmup: int = 1) -> list[dict] | None:
    """Every op at every size on the current world's first ``g`` ranks, for each ``g`` of ``group_sizes`` (a running
    job's own devices, links and backend); every rank of the world calls it. Rank 0's timings ({op, group_size,
    message_bytes, backend, times}), None elsewhere."""
    backend, timed = dist.get_backend(), []
    for g in group_sizes:
        group = dist.new_group(list(range(g)))
        if rank < g:
            timed += [{**r, "group_size": g, "backend": backend}
                      for r in time_ops(rank, g, sizes, ops, device, backend, repeats, warmup, group)]
        dist.barrier()
        dist.destroy_process_group(group)
    return timed if rank == 0 else None


