"""Data parallelism and ZeRO over a module's data-parallel ranks, with FSDP2 ``fully_shard``.

What each planned ZeRO stage maps to (ZeRO: Rajbhandari et al. 2020):

- zero 0 — plain data parallelism: weights, gradients and Adam states replicated; gradients summed with one
  flat all-reduce after the last micro-batch (``all_reduce_gradients``, DDP-like buffer, no overlap, no FSDP).
- zero 1 — ``fully_shard(reshard_after_forward=False)``, gradient sync and re-sharding only after the last
  micro-batch's backward: Adam states and the fp32 master weights are sharded; the whole weights stay
  gathered and the full gradients accumulate locally through the step's micro-batches, then are
  reduce-scattered once, as in ZeRO-1. Unlike textbook ZeRO-1 the weights are gathered at the step's first
  forward instead of being kept whole between steps (same peak, one all-gather per step).
- zero 2 — as zero 1 but gradients are reduce-scattered after every micro-batch, so they too stay sharded.
- zero 3 — ``fully_shard(reshard_after_forward=True)``: weights are re-sharded after each block's forward and
  backward and all-gathered again for the next use.

Sharding is per block, then the module root (torchtitan's order). A module's sequence-parallel ranks (vision
tower or LLM) hold the same weights and each computes part of every gradient, so its data-parallel group is
dp x sp (torchtitan's "dp_shard_cp"): the gradients are summed over both, and ZeRO shards over both.
Gradients are summed, not averaged (divide factor 1): the loss is already normalised by the step's token count.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from runtime.parallel.experts import expert_parameters


def apply_fsdp(
    module: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh, *, zero: int,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> None:
    """Shard ``module`` for ZeRO stage 1-3 over ``mesh`` (1-D data-parallel mesh), with FSDP2's mixed-precision
    policy when given (runtime.parallel.precision)."""
    assert zero in (1, 2, 3), zero
    reshard = zero == 3
    policy = mp_policy or MixedPrecisionPolicy()
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.set_gradient_divide_factor(1.0)
            sub.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)


def set_gradient_sync(module: nn.Module, *, zero: int, last_micro_batch: bool) -> None:
    """Before a backward: reduce-scatter every micro-batch (ZeRO-2/3) or only the last (ZeRO-1); keep the
    weights gathered until the last micro-batch (ZeRO-1/2) or re-shard them after each backward (ZeRO-3)."""
    if isinstance(module, FSDPModule):
        module.set_requires_gradient_sync(zero >= 2 or last_micro_batch)
        module.set_reshard_after_backward(zero == 3 or last_micro_batch)


FLAT_GRADIENTS_ATTR = "_flat_gradient_buffer"
"""Attribute prefix of a ZeRO-0 module's persistent flat gradient buffers (one per parameter set)."""


@torch.no_grad()
def all_reduce_gradients(module: nn.Module, group: dist.ProcessGroup, *, experts: bool = False) -> None:
    """ZeRO-0: sum the gradients of ``module``'s parameters over ``group`` with one flat all-reduce (a single
    bucket); ``experts``: its split experts' weights (runtime.parallel.experts, summed over their ``efsdp`` group)
    instead of the others. The flat buffer persists across steps (as DDP's buckets do), so each step copies the
    gradients in and out of memory that is already mapped."""
    expert_params = expert_parameters(module)
    grads = [p.grad for p in module.parameters() if p.grad is not None and (p in expert_params) == experts]
    if not grads:
        return
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    numel = sum(g.numel() for g in local)
    attr = FLAT_GRADIENTS_ATTR + ("_experts" if experts else "")
    flat = getattr(module, attr, None)
    if flat is None or flat.numel() != numel or flat.dtype != local[0].dtype or flat.device != local[0].device:
        flat = torch.empty(numel, dtype=local[0].dtype, device=local[0].device)
        setattr(module, attr, flat)
    torch.cat([g.reshape(-1) for g in local], out=flat)
    dist.all_reduce(flat, group=group)
    torch._foreach_copy_(local, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in local]), local)])
