"""AdamW per module, one global gradient norm across all modules, linear warm-up (plan.training)."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

CLIP_EPS = 1e-6
"""Added to the norm before dividing, as torch.nn.utils.clip_grad_norm_ does."""


def warmup_factor(step: int, warmup_steps: int) -> float:
    """LR multiplier of optimizer step ``step`` (0-based): linear from 1/warmup to 1 over ``warmup_steps``, then 1."""
    return 1.0 if warmup_steps <= 0 else min(1.0, (step + 1) / warmup_steps)


def build_optimizer(module: nn.Module, training) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``module``'s parameters with the plan's LR, weight decay and warm-up."""
    optimizer = adamw(module.parameters(), lr=training.learning_rate, weight_decay=training.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_factor(step, training.warmup_steps))
    return optimizer, schedule


def adamw(params, *, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer every module trains with: torch's AdamW, in its default implementation (multi-tensor on CUDA,
    per parameter on CPU, where DTensor's propagation of multi-tensor calls costs more than it saves: 11 parity
    plans took 92 s forced multi-tensor against 84 s), over parameter groups a multi-tensor call accepts
    (``same_kind_groups``)."""
    groups = same_kind_groups(list(params), key=_mesh)
    return torch.optim.AdamW([{"params": group} for group in groups], lr=lr, weight_decay=weight_decay)


def same_kind_groups(tensors: list[torch.Tensor], key) -> list[list[torch.Tensor]]:
    """``tensors`` split by ``key``, in order of first appearance: a multi-tensor call refuses a list mixing plain
    tensors and DTensors, or DTensors of different device meshes (a TP module's norms stay plain tensors beside its
    sharded weights; its experts sit on the EP mesh)."""
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        groups[key(t)].append(t)
    return list(groups.values())


def _mesh(t: torch.Tensor) -> object:
    """A DTensor's device mesh; None for a plain tensor."""
    return t.device_mesh if isinstance(t, DTensor) else None


def scale_gradients(module: nn.Module, coef: float) -> None:
    """Multiply every gradient of ``module`` by ``coef`` in place."""
    for p in module.parameters():
        if p.grad is not None:
            p.grad.mul_(coef)


def grad_sq_norm(module: nn.Module) -> torch.Tensor:
    """Squared L2 norm of all of ``module``'s gradients, reduced over its shards (same value on all its ranks)."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    total = torch.zeros((), dtype=torch.float32)
    for group in same_kind_groups(grads, key=lambda g: (_mesh(g), getattr(g, "placements", None))):
        norm = torch.nn.utils.get_total_norm(group, 2.0)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        total = total + norm.float().cpu() ** 2
    return total


@torch.no_grad()
def clip_grad_norm(
    modules: dict[str, nn.Module], all_modules: list[str], max_norm: float, device: torch.device
) -> float:
    """Scale every module's gradients by min(1, max_norm / (global norm + eps)); returns the global norm.

    Each rank holds some of the modules (all of them when colocated); the squared norms are exchanged with
    one all-reduce (max: ranks of a module agree, other ranks contribute 0).
    """
    sq = torch.zeros(len(all_modules))
    for i, name in enumerate(all_modules):
        if name in modules:
            sq[i] = grad_sq_norm(modules[name])
    sq = sq.to(device)
    dist.all_reduce(sq, op=dist.ReduceOp.MAX)
    total = float(sq.sum().sqrt())
    coef = min(1.0, max_norm / (total + CLIP_EPS))
    if coef < 1.0:
        for module in modules.values():
            scale_gradients(module, coef)
    return total
