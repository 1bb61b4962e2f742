"""``torchrun --nproc-per-node N -m runtime plan.json``: the plan's ranks as torchrun's processes, without Ray.

Each process is one rank: it joins the process group from torchrun's environment (gloo for a CPU plan, NCCL for
a GPU plan), builds its Trainer and runs the steps. Rank 0 gathers every rank's step measurements, so the
metrics file and the summary are the same as under Ray.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from planner.contract.schema import Plan
from runtime.training import loop
from runtime.run.checkpoint_dir import CheckpointOptions
from runtime.checkpoints.dcp_checkpoint import Checkpointer
from runtime.launch.driver import validate_plan
from runtime.observability.metrics import MetricsLog, print_summary
from runtime.run.preflight import TorchrunEnv, check_outputs, check_world_size, is_cpu_plan, save_with_fallback
from runtime.training.trainer import RunOptions, Trainer, freeze_startup_heap


def pin_gpu(local_rank: int) -> None:
    """Make this process see only GPU ``local_rank`` (of those visible to torchrun), as Ray does for its actors,
    so that the Trainer's ``cuda:0`` is this rank's GPU. Must run before CUDA initialises."""
    assert not torch.cuda.is_initialized(), "pin_gpu must run before CUDA initialises"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(local_rank + 1)]
    if local_rank >= len(ids):
        raise ValueError(f"LOCAL_RANK {local_rank} but only {len(ids)} GPUs are visible ({visible})")
    os.environ["CUDA_VISIBLE_DEVICES"] = ids[local_rank]


@dataclass
class Job(loop.RankCheckpoints):
    """This process's rank of a torchrun job (a ``loop.StepJob``): its Trainer, its checkpointer, and the
    collectives the launcher needs."""

    plan: Plan
    trainer: Trainer
    rank: int
    checkpointer: Checkpointer | None = None

    @property
    def steps_done(self) -> int:
        return self.trainer.step

    def step(self) -> list[dict[str, Any]] | None:
        """One optimizer step on every rank; every rank's measurements on rank 0 (None elsewhere)."""
        result = self.trainer.train_step()
        results = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(result, results, dst=0)
        return results

    def agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def save_checkpoint(job: Job, path: str) -> None:
    """Write the trained weights as a Hugging Face folder from the ranks' shards (runtime.checkpoints.hf_folder.save_hf_folder).
    Collective: every rank calls it."""
    job.trainer.save_hf_folder(path)


def run(plan: Plan, options: RunOptions, env: TorchrunEnv, *, steps: int, metrics_path: str | None = None,
        save: str | None = None, checkpoints: CheckpointOptions = CheckpointOptions()) -> dict[str, Any] | None:
    """Run as this torchrun rank until ``steps`` optimizer steps are done (counting a resumed checkpoint's),
    with sharded checkpoints as ``checkpoints`` says; rank 0 writes the metrics,
    prints and returns the summary (None on the other ranks), then every rank saves the weights to ``save`` if
    given (a fallback folder if that fails, see ``preflight.save_with_fallback``)."""
    check_world_size(plan, env)
    validate_plan(plan, options)
    check_outputs(metrics=metrics_path if env.rank == 0 else None, save=save)
    cpu = is_cpu_plan(plan)
    if not cpu:
        pin_gpu(env.local_rank)
        torch.cuda.set_device(0)
    dist.init_process_group("gloo" if cpu else "nccl")
    freeze_startup_heap()
    trainer = None
    try:
        trainer = Trainer(plan, rank=env.rank, options=options)
        job = Job(plan=plan, trainer=trainer, rank=env.rank)
        summary = _train(job, steps=steps, metrics_path=metrics_path, checkpoints=checkpoints)
        if save is not None:
            save_with_fallback(lambda folder: save_checkpoint(job, folder), save, agree=job.agree)
    finally:
        if trainer is not None:
            trainer.close()
        dist.destroy_process_group()
    return summary


def _train(job: Job, *, steps: int, metrics_path: str | None, checkpoints: CheckpointOptions
           ) -> dict[str, Any] | None:
    """``loop.train`` from where the trainer stands; on rank 0 the metrics log, the printed summary and its
    return."""
    log = None
    if job.rank == 0:
        log = MetricsLog(job.plan, steps=steps, path=metrics_path, trace_dir=job.trainer.options.trace)
        if job.trainer.options.resume is not None:
            log.event("resume", path=job.trainer.options.resume, step=job.trainer.step)
    try:
        loop.train(job, log, steps, checkpoints)
    except KeyboardInterrupt as stop:  # on every rank (torchrun's agent passes a stop signal on to each): a
        if log is not None:            # checkpoint being written is discarded, the last complete one stays
            print_summary(log, job.plan, stopped=str(stop))
        raise
    finally:
        if log is not None:
            log.close()
    return None if log is None else print_summary(log, job.plan)
