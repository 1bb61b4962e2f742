"""How much devices that share a host slow each other down (CPU: worker processes share cores, caches, DRAM).

``n`` processes (spawned, ``threads`` torch threads each, as runtime workers are) time the same layer shard's
forward+backward over the same wall-clock window; a run's time is the mean of the processes' median times. Runs
alone and runs of ``n`` alternate ``trials`` times and the fastest of each kind is kept, so that unrelated processes
sharing the machine (which only ever add time) count as little as possible; the slowdown for ``n`` is the ratio of
the two. A layer profile measured alone is multiplied by it for plans running ``n`` devices.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from planner.catalog import get_model
from runtime.profile.shards import build_shard, hf_config


def _worker(rank: int, model: str, module: str, layer: str, seq_len: int, threads: int, window_s: float, barrier,
            out: str) -> None:
    torch.set_num_threads(threads)
    spec = get_model(model)
    shard = build_shard(hf_config(spec.hf_config), spec.module(module).layer(layer), tp=1, sp=1).train()
    inputs = shard.inputs(seq_len, 1, dtype=torch.float32, device=torch.device("cpu"))

    def step() -> float:
        start = time.perf_counter()
        out = shard(inputs.x, **inputs.kwargs)
        out.backward(torch.ones_like(out) if out.dim() else None)
        for p in shard.parameters():
            p.grad = None
        inputs.x.grad = None
        return time.perf_counter() - start

    for _ in range(3):
        step()
    barrier.wait()
    deadline, times = time.perf_counter() + window_s, []
    while time.perf_counter() < deadline:
        times.append(step())
    Path(out, f"{rank}.json").write_text(json.dumps(statistics.median(times)))


def _median_times(n: int, args: tuple) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        barrier = mp.get_context("spawn").Barrier(n)
        mp.spawn(_worker, args=(*args, barrier, tmp), nprocs=n, join=True)
        return [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(n)]


def measure_concurrency(model: str, *, module: str, layer: str, seq_len: int, threads: int,
                        counts: tuple[int, ...] | None = None, window_s: float = 2.0,
                        trials: int = 4) -> dict[int, float]:
    """Per-device slowdown for each number of concurrent devices (default 2 .. CPU cores / threads)."""
    counts = counts or tuple(range(2, (os.cpu_count() or 1) // threads + 1))
    args = (model, module, layer, seq_len, threads, window_s)
    slowdown = {}
    for n in counts:
        alone, together = [], []
        for _ in range(trials):
            alone.append(_median_times(1, args)[0])
            together.append(statistics.mean(_median_times(n, args)))
        slowdown[n] = min(together) / min(alone)
    return {1: 1.0, **slowdown}
