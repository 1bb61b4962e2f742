"""Rank functions of the resume tests, run in gloo processes by tests.runtime.ranks.spawn (a child cannot import a
test module): a run straight through, and the same run cut into legs that each resume from the previous leg's
checkpoint, possibly under another plan."""

from __future__ import annotations

import os
from typing import Any

from planner.schema import Plan
from runtime.checkpoint_dir import latest_checkpoint
from runtime.dcp_checkpoint import save_checkpoint
from runtime.trainer import RunOptions, Trainer

SEED = 0


def _steps(trainer: Trainer, steps: int) -> list[dict[str, Any]]:
    return [{k: r[k] for k in ("loss", "grad_norm", "lr")} for r in (trainer.train_step() for _ in range(steps))]


def straight_and_legs(rank: int, straight: Plan, legs: list[tuple[Plan, int]], directory: str) -> dict[str, Any]:
    """``straight`` for all the legs' steps; then each leg (plan, steps): the first from the seed's random init,
    each next resuming from the latest checkpoint the one before saved. Returns this rank's per-step records and
    the full parameters it gathered (on a module's first rank) at the end of both runs."""
    trainer = Trainer(straight, rank=rank, options=RunOptions(seed=SEED))
    out = {"straight": _steps(trainer, sum(steps for _, steps in legs)), "straight_params": trainer.full_tensors("param")}
    del trainer
    records, resume = [], None
    for plan, steps in legs:
        trainer = Trainer(plan, rank=rank, options=RunOptions(seed=SEED, resume=resume))
        records += _steps(trainer, steps)
        save_checkpoint(trainer, directory, keep_last=1)
        resume = latest_checkpoint(directory)
    out["legs"], out["legs_params"] = records, trainer.full_tensors("param")
    return out


def each_straight_and_resumed(rank: int, plans: dict[str, Plan], directory: str) -> dict[str, dict[str, Any]]:
    """``straight_and_legs`` of each plan against itself (2 + 2 steps), in one set of processes."""
    return {name: straight_and_legs(rank, plan, [(plan, 2), (plan, 2)], os.path.join(directory, name))
            for name, plan in plans.items()}
