"""Profile every layer type of a model over a grid of shard degrees, sequence lengths and micro-batch sizes.

Resumable: points already in the profile are skipped. A time budget stops the sweep between points; the profile
is saved after every point, so an interrupted run loses at most one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import product
from typing import Callable, Iterator

import torch
from tqdm import tqdm

from planner.contract.models import LayerSpec, ModelSpec
from planner.profiles import LayerPoint, MemoryPoint, Profile
from runtime.profile.measure import TimingConfig, analyze_fake, default_dtype, time_optimizer_step, time_shard
from runtime.profile.shards import build_shard, hf_config, tokens_multiple, valid_degree


@dataclass(kw_only=True, frozen=True)
class Grid:
    """Which points to measure."""

    seq_lens: dict[str, tuple[int, ...]]
    """Tokens per sample, by module name (vision: patches of one image; llm: sequence length)."""
    micro_batches: tuple[int, ...]
    """Micro-batch sizes."""
    tps: tuple[int, ...]
    """Tensor-parallel degrees whose shards to measure."""
    sps: tuple[int, ...]
    """Ulysses sequence-parallel degrees whose shards to measure."""
    layers: tuple[str, ...] = ()
    """Only these ``module.layer`` names (empty: every layer type)."""


@dataclass(kw_only=True, frozen=True)
class GridPoint:
    """One shard at one shape."""

    module: str
    layer: LayerSpec
    tp: int
    sp: int
    seq_len: int
    micro_batch: int

    @property
    def key(self) -> tuple[str, str, int, int, int, int]:
        """``MemoryPoint.key`` of this point."""
        return (self.module, self.layer.name, self.tp, self.sp, self.seq_len, self.micro_batch)

    def layer_key(self, *, includes_comm: bool = False) -> tuple[str, str, int, int, int, int, bool]:
        """``LayerPoint.key`` of this point timed single-process, or as run (``includes_comm``)."""
        return (*self.key, includes_comm)

    def describe(self) -> str:
        return f"{self.module}.{self.layer.name} tp{self.tp} sp{self.sp} s{self.seq_len} mb{self.micro_batch}"


def grid_points(model: ModelSpec, grid: Grid) -> Iterator[GridPoint]:
    """Every valid point of ``grid`` for ``model``, cheapest layers first within each shape."""
    config = hf_config(model.hf_config)
    for module in model.modules:
        for layer in module.layers:
            if grid.layers and f"{module.name}.{layer.name}" not in grid.layers:
                continue
            for tp, sp, seq, mb in product(grid.tps, grid.sps, grid.seq_lens.get(module.name, ()), grid.micro_batches):
                if valid_degree(config, layer, tp=tp, sp=sp) and seq % tokens_multiple(config, layer, sp) == 0:
                    yield GridPoint(module=module.name, layer=layer, tp=tp, sp=sp, seq_len=seq, micro_batch=mb)


def measure_point(model: ModelSpec, point: GridPoint, cfg: TimingConfig) -> LayerPoint:
    """Times on the device (forward, backward, recompute, optimizer step), FLOPs and memory from a fake pass (plus
    the CUDA allocator's peak on GPU)."""
    config = hf_config(model.hf_config)

    def factory():
        return build_shard(config, point.layer, tp=point.tp, sp=point.sp)

    fake = analyze_fake(factory, point.seq_len, point.micro_batch, dtype=cfg.dtype)
    with default_dtype(cfg.dtype):
        shard = factory()
    forward, backward, recompute, cuda_peak = time_shard(shard, point.seq_len, point.micro_batch, cfg)
    optimizer, optimizer_pair = (time_optimizer_step(shard, cfg, instances=n) for n in (1, 2))
    return LayerPoint(
        module=point.module, layer=point.layer.name, tp=point.tp, sp=point.sp, seq_len=point.seq_len,
        micro_batch=point.micro_batch, forward=forward, backward=backward, recompute=recompute, optimizer=optimizer,
        optimizer_pair=optimizer_pair,
        forward_flops=fake.forward_flops, backward_flops=fake.backward_flops,
        saved_activation_bytes=fake.saved_activation_bytes,
        peak_bytes=cuda_peak if cuda_peak is not None else fake.peak_bytes,
    )


def memory_point(model: ModelSpec, point: GridPoint, dtype: torch.dtype) -> MemoryPoint:
    """FakeTensor memory breakdown of one shard (no timing, nothing allocated)."""
    config = hf_config(model.hf_config)
    fake = analyze_fake(lambda: build_shard(config, point.layer, tp=point.tp, sp=point.sp), point.seq_len,
                        point.micro_batch, dtype=dtype)
    return MemoryPoint(
        module=point.module, layer=point.layer.name, tp=point.tp, sp=point.sp, seq_len=point.seq_len,
        micro_batch=point.micro_batch, param_bytes=fake.param_bytes,
        saved_activation_bytes=fake.saved_activation_bytes, peak_bytes=fake.peak_bytes,
        peak_breakdown=fake.peak_breakdown,
    )


def noisy_points(points: list[LayerPoint], *, tolerance: float = 0.05, chord_tolerance: float = 0.15,
                 spread_limit: float = 1.5) -> set[tuple]:
    """Keys of points that other processes visibly slowed down (other processes only ever add time), for
    ``--remeasure-noisy``. Along each shard's sequence lengths, forward or backward median:

    * slower (beyond ``tolerance``) than the same shard at the next longer sequence: work never shrinks with more
      tokens;
    * above the chord of its two neighbours (beyond ``chord_tolerance``): a layer's time a + b s + c s^2 (fixed
      cost, linear layers, attention) is convex in the sequence length s, so a point sticking out above the
      straight line between its neighbours was disturbed;
    * a median more than ``spread_limit`` times its fastest repeat: most repeats were disturbed.
    """
    series: dict[tuple, list[LayerPoint]] = {}
    for p in points:
        series.setdefault((p.module, p.layer, p.tp, p.sp, p.micro_batch, p.includes_comm), []).append(p)
    noisy = set()
    for row in series.values():
        row.sort(key=lambda p: p.seq_len)
        for field in ("forward", "backward"):
            t = [getattr(p, field).median_s for p in row]
            for i, p in enumerate(row):
                if getattr(p, field).median_s > spread_limit * getattr(p, field).min_s:
                    noisy.add(p.key)
                if i + 1 < len(row) and t[i] > (1 + tolerance) * t[i + 1]:
                    noisy.add(p.key)
                if 0 < i < len(row) - 1:
                    s0, s1, s2 = row[i - 1].seq_len, p.seq_len, row[i + 1].seq_len
                    chord = t[i - 1] + (t[i + 1] - t[i - 1]) * (s1 - s0) / (s2 - s0)
                    if t[i] > (1 + chord_tolerance) * chord:
                        noisy.add(p.key)
    return noisy


def sweep(
    profile: Profile,
    points: list[GridPoint],
    measure: Callable[[GridPoint], LayerPoint | MemoryPoint],
    *,
    field: str,
    save: Callable[[Profile], None],
    time_budget_s: float | None,
) -> tuple[int, int]:
    """Measure the points ``profile.<field>`` lacks, saving after each; returns (measured, skipped for time)."""
    done = {p.key for p in getattr(profile, field)}
    todo = [p for p in points if (p.layer_key() if field == "layers" else p.key) not in done]
    start, measured = time.monotonic(), 0
    with tqdm(total=len(points), initial=len(points) - len(todo), desc=field, unit="pt") as bar:
        for point in todo:
            if time_budget_s is not None and time.monotonic() - start > time_budget_s:
                break
            bar.set_postfix_str(point.describe())
            getattr(profile, field).append(measure(point))
            save(profile)
            measured += 1
            bar.update()
    return measured, len(todo) - measured
