"""Measure one layer shard at one (seq_len, micro_batch): times on the real device, FLOPs and memory on fake tensors.

Times: forward, backward, the extra backward time of full recomputation (the forward re-run inside
``torch.utils.checkpoint``) and the optimizer step over the shard's parameters, each the median of ``repeats`` timed
runs after ``warmup`` untimed ones.
FLOPs (FlopCounterMode, CPU SDPA included) and memory (MemTracker + saved-tensor hooks) do not depend on the values,
so they run under FakeTensorMode: the same code gives full-size numbers without allocating them.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.checkpoint import checkpoint

from planner.profiles import Spread
from runtime.training.optim import adamw, grad_sq_norm, scale_gradients
from runtime.profile.flops import flop_counter
from runtime.profile.shards import LayerShard, shard_param_bytes

ShardFactory = Callable[[], LayerShard]


@dataclass(kw_only=True, frozen=True)
class TimingConfig:
    """How layer times are measured."""

    warmup: int = 2
    """Untimed runs before timing (allocator, caches, oneDNN primitive creation)."""
    repeats: int = 5
    """Timed runs whose median is recorded."""
    dtype: torch.dtype = torch.float32
    """Parameter and activation dtype."""
    device: str = "cpu"
    """Device to time on (cpu or cuda)."""


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """Build modules in ``dtype`` (converting fake parameters afterwards is not supported)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _spread(samples: list[float]) -> Spread:
    return Spread(median_s=statistics.median(samples), min_s=min(samples), max_s=max(samples), repeats=len(samples))


def _backward_seed(out: torch.Tensor) -> torch.Tensor | None:
    return None if out.dim() == 0 else torch.ones_like(out)


def _zero_grads(shard: LayerShard, x: torch.Tensor) -> None:
    for p in shard.parameters():
        p.grad = None
    x.grad = None


def one_step(shard: LayerShard, inputs, *, recompute: bool, device: torch.device) -> tuple[float, float]:
    """Forward then backward once; returns (forward seconds, backward seconds)."""
    _sync(device)
    start = time.perf_counter()
    if recompute:
        out = checkpoint(shard, inputs.x, use_reentrant=False, **inputs.kwargs)
    else:
        out = shard(inputs.x, **inputs.kwargs)
    _sync(device)
    mid = time.perf_counter()
    out.backward(_backward_seed(out))
    _sync(device)
    end = time.perf_counter()
    _zero_grads(shard, inputs.x)
    return mid - start, end - mid


def time_shard(
    shard: LayerShard, seq_len: int, micro_batch: int, cfg: TimingConfig
) -> tuple[Spread, Spread, Spread, int | None]:
    """(forward, backward, recompute) spreads and, on CUDA, the allocator's peak beyond what was resident before.

    recompute is the checkpointed backward minus the plain backward of the same iteration, clipped at 0.
    """
    device = torch.device(cfg.device)
    shard.to(device=device, dtype=cfg.dtype).train()
    inputs = shard.inputs(seq_len, micro_batch, dtype=cfg.dtype, device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device)
    plain, ckpt = [], []
    for i in range(cfg.warmup + cfg.repeats):
        fb = one_step(shard, inputs, recompute=False, device=device)
        rb = one_step(shard, inputs, recompute=True, device=device)
        if i >= cfg.warmup:
            plain.append(fb)
            ckpt.append(rb)
    backward = [b for _, b in plain]
    extra = [max(rb - b, 0.0) for (_, rb), b in zip(ckpt, backward)]
    peak = torch.cuda.max_memory_allocated(device) - resident if device.type == "cuda" else None
    return _spread([f for f, _ in plain]), _spread(backward), _spread(extra), peak


OPTIMIZER_GRAD = 1e-3
"""Value the gradients are filled with before timing the optimizer step (its time does not depend on values)."""
CACHE_FLUSH_BYTES = 256 * 2**20
"""A buffer larger than the last-level cache, overwritten before each timed optimizer step: in a training step the
whole model's weights, gradients and Adam states stream through the optimizer, so none of a layer's are cached."""


@torch.no_grad()
def time_optimizer_step(module: nn.Module, cfg: TimingConfig, *, instances: int = 1,
                        slowest_rank: bool = False) -> Spread:
    """Seconds of the runtime's optimizer step (runtime/training/optim.py: the gradients' squared norm, scaling them by the
    clipping factor, one AdamW step) over the parameters of ``instances`` copies of ``module`` in one call: the
    runtime steps all of a module's layers at once, so one and two instances separate a layer's own share from the
    call's fixed cost. Median over ``cfg.repeats`` after ``cfg.warmup`` (Adam's states are allocated at the first),
    each from cold caches (``CACHE_FLUSH_BYTES``). ``slowest_rank``: every rank of the default process group calls
    this with its shard; an iteration's time is the slowest rank's (DTensor norms communicate)."""
    device = torch.device(cfg.device)
    module = nn.ModuleList([module, *(copy.deepcopy(module) for _ in range(instances - 1))])
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.full_like(p, OPTIMIZER_GRAD)
    optimizer = adamw(params, lr=1e-5, weight_decay=0.1)
    flush = torch.empty(CACHE_FLUSH_BYTES, dtype=torch.uint8, device=device)
    samples = []
    for i in range(cfg.warmup + cfg.repeats):
        flush.zero_()
        if slowest_rank:
            dist.barrier()
        _sync(device)
        start = time.perf_counter()
        norm = float(grad_sq_norm(module).sqrt())
        scale_gradients(module, 1.0 / (norm + 1.0))  # clipping active, as early in training
        optimizer.step()
        _sync(device)
        if i >= cfg.warmup:
            samples.append(time.perf_counter() - start)
    for p in params:
        p.grad = None
    if slowest_rank:
        slowest = torch.tensor(samples, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        samples = slowest.tolist()
    return _spread(samples)


@dataclass(kw_only=True, frozen=True)
class FakeAnalysis:
    """What one fake forward+backward of a shard reveals."""

    param_bytes: int
    """Parameters of the shard."""
    forward_flops: float
    """FLOPs of the forward (FlopCounterMode)."""
    backward_flops: float
    """FLOPs of the backward."""
    saved_activation_bytes: int
    """Distinct storages autograd saved for backward, parameters excluded."""
    peak_bytes: int
    """MemTracker's peak over fwd+bwd minus parameters and the layer input ("Other"): activations, temporaries,
    gradients."""
    peak_breakdown: dict[str, int]
    """MemTracker categories at the peak."""


def _saved_bytes_hooks(param_storages: set[int], seen: dict[int, int]):
    """saved_tensors_hooks recording each distinct non-parameter storage autograd keeps."""

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        if st._cdata not in param_storages:
            seen[st._cdata] = st.nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def analyze_fake(factory: ShardFactory, seq_len: int, micro_batch: int, *, dtype: torch.dtype, device: str = "cpu") -> FakeAnalysis:
    """FLOPs and memory of the shard ``factory`` builds, on fake tensors (nothing is allocated)."""
    with FakeTensorMode(allow_non_fake_inputs=False), default_dtype(dtype), torch.device(device):
        shard = factory().train()
        inputs = shard.inputs(seq_len, micro_batch, dtype=dtype, device=torch.device(device))
        params = shard_param_bytes(shard)
        with flop_counter() as fwd_counter:
            out = shard(inputs.x, **inputs.kwargs)
        with flop_counter() as bwd_counter:
            out.backward(_backward_seed(out))
        _zero_grads(shard, inputs.x)
        del out
        param_storages = {p.untyped_storage()._cdata for p in shard.parameters()}
        saved: dict[int, int] = {}
        tracker = MemTracker()
        tracker.track_external(shard, inputs.x)
        with tracker:
            with _saved_bytes_hooks(param_storages, saved):
                out = shard(inputs.x, **inputs.kwargs)
            out.backward(_backward_seed(out))
        peak = tracker.get_tracker_snapshot("peak")[torch.device(device)]
    breakdown = {str(k.value): int(v) for k, v in peak.items() if k != "Total" and v}
    return FakeAnalysis(
        param_bytes=params,
        forward_flops=float(fwd_counter.get_total_flops()),
        backward_flops=float(bwd_counter.get_total_flops()),
        saved_activation_bytes=sum(saved.values()),
        peak_bytes=int(peak["Total"]) - breakdown.get("Parameter", 0) - breakdown.get("Other", 0),
        peak_breakdown=breakdown,
    )
