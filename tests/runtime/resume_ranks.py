"""Rank functions of the resume tests, run in gloo processes by tests.runtime.ranks.spawn (a child cannot import a
test module): a run straight through, and the same run cut into legs that each resume from the previous leg's
checkpoint, possibly under another plan."""

from __future__ import annotations

import contextlib
import errno
import os
from typing import Any

from torch.distributed.checkpoint import filesystem

from planner.contract.schema import Plan
from runtime.checkpoints import dcp_checkpoint
from runtime.run.checkpoint_dir import latest_checkpoint
from runtime.checkpoints.dcp_checkpoint import Checkpointer
from runtime.training.trainer import RunOptions, Trainer
from tests.runtime.ranks import fresh_groups

SEED = 0


def _steps(trainer: Trainer, steps: int) -> list[dict[str, Any]]:
    return [{k: r[k] for k in ("loss", "grad_norm", "lr")} for r in (trainer.train_step() for _ in range(steps))]


def straight_and_legs(rank: int, straight: Plan, legs: list[tuple[Plan, int]], directory: str, *,
                      overlap: bool = False) -> dict[str, Any]:
    """``straight`` for all the legs' steps; then each leg (plan, steps): the first from the seed's random init,
    each next resuming from the latest checkpoint the one before saved. With ``overlap`` (DCP async_save) one more
    step runs, and is thrown away, while the checkpoint is written: it must not change what is saved. Returns
    this rank's per-step records and the full parameters it gathered (on a module's first rank) at the end of
    both runs."""
    fresh_groups()
    trainer = Trainer(straight, rank=rank, options=RunOptions(seed=SEED))
    out = {"straight": _steps(trainer, sum(steps for _, steps in legs))}
    out["straight_params"] = trainer.full_tensors("param")
    del trainer
    records, resume = [], None
    for plan, steps in legs:
        fresh_groups()
        trainer = Trainer(plan, rank=rank, options=RunOptions(seed=SEED, resume=resume))
        checkpointer = Checkpointer(trainer, directory, keep_last=1, overlap=overlap)
        records += _steps(trainer, steps)
        out["legs_params"] = trainer.full_tensors("param")
        checkpointer.save()
        if overlap:
            _steps(trainer, 1)
        checkpointer.finish()
        resume = latest_checkpoint(directory)
    out["legs"] = records
    return out


def each_straight_and_resumed(rank: int, plans: dict[str, Plan], directory: str, overlap: set[str]
                              ) -> dict[str, dict[str, Any]]:
    """``straight_and_legs`` of each plan against itself (2 + 2 steps), in one set of processes; async saves for
    the plans named in ``overlap``."""
    return {name: straight_and_legs(rank, plan, [(plan, 2), (plan, 2)], os.path.join(directory, name),
                                    overlap=name in overlap)
            for name, plan in plans.items()}


def same_and_across_plans(rank: int, same: dict[str, Plan], same_directory: str, overlap: set[str],
                          straight: Plan, legs: list[tuple[Plan, int]], across_directory: str, failing_directory: str
                          ) -> tuple[dict[str, dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """The resume scenarios in one set of processes (a spawn costs seconds of imports per rank): each plan
    against itself (``each_straight_and_resumed``), ``straight`` against legs under other plans, then checkpoint
    writes failing on a full disk under ``straight`` (``failing_saves``)."""
    return (each_straight_and_resumed(rank, same, same_directory, overlap),
            straight_and_legs(rank, straight, legs, across_directory),
            failing_saves(rank, straight, failing_directory))


def _no_space(*args: Any, **kwargs: Any) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@contextlib.contextmanager
def _disk_full(module: Any, name: str, *, on: bool):
    """``module.name`` raises ENOSPC while in the block, where ``on``."""
    original = getattr(module, name)
    if on:
        setattr(module, name, _no_space)
    try:
        yield
    finally:
        setattr(module, name, original)


FAILING_WRITES = {
    "shard on rank 1": (filesystem, "_write_item", 1, False),
    "run state on rank 0": (dcp_checkpoint, "_write_run_state", 0, False),
    "overlapped shard on rank 1": (filesystem, "_write_item", 1, True),
}
"""Checkpoint writes that fail with a full disk: (module, function that raises, on which rank, async save)."""


def failing_saves(rank: int, plan: Plan, directory: str) -> dict[str, Any]:
    """A step, then per ``FAILING_WRITES`` case a checkpoint whose write fails (one rank's disk is full), a step,
    and a checkpoint that works. Per case: the failed save's and the working save's measurements, and the
    checkpoint folder's listing after the failed one."""
    trainer = Trainer(plan, rank=rank, options=RunOptions(seed=SEED))
    trainer.train_step()
    out = {}
    for case, (module, name, failing_rank, overlap) in FAILING_WRITES.items():
        folder = os.path.join(directory, case.replace(" ", "-"))
        checkpointer = Checkpointer(trainer, folder, overlap=overlap)
        with _disk_full(module, name, on=rank == failing_rank):
            failed = checkpointer.save() + checkpointer.finish()
        listing = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        trainer.train_step()
        out[case] = {"failed": failed, "listing": listing, "worked": checkpointer.save() + checkpointer.finish()}
    return out
