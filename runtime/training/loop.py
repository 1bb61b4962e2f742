"""The training loop both launchers run: the Ray launcher's ``launcher.Job`` (the plan's actors, driven from the
driver) and torchrun's ``torchrun.Job`` (this process's rank), each a ``StepJob``."""

from __future__ import annotations

from typing import Any, Callable, Protocol

from runtime.run.checkpoint_dir import CheckpointOptions
from runtime.checkpoints.dcp_checkpoint import Checkpointer
from runtime.observability.metrics import MetricsLog


class StepJob(Protocol):
    """What the loop drives: steps, and sharded checkpoints of every rank's state."""

    @property
    def steps_done(self) -> int:
        """Optimizer steps done (a resumed checkpoint's included)."""

    def step(self) -> list[dict[str, Any]] | None:
        """One optimizer step on every rank; every rank's measurements where this process logs (else None)."""

    def save_training_checkpoint(self, checkpoints: CheckpointOptions) -> list[dict[str, Any]]:
        """A sharded checkpoint; the measurements of the checkpoints completed since the last call."""

    def finish_checkpoints(self) -> list[dict[str, Any]]:
        """Wait for a checkpoint still being written; its measurements."""


class RankCheckpoints:
    """A rank's sharded checkpoints of its ``trainer`` (a ``Checkpointer``, made at the first save): what the Ray
    launcher's workers and a torchrun rank both do when a checkpoint is due."""

    trainer: Any
    checkpointer: Checkpointer | None = None

    def save_training_checkpoint(self, checkpoints: CheckpointOptions) -> list[dict[str, Any]]:
        if self.checkpointer is None:
            self.checkpointer = Checkpointer(self.trainer, checkpoints.directory, keep_last=checkpoints.keep_last,
                                             overlap=checkpoints.overlap)
        return self.checkpointer.save()

    def finish_checkpoints(self) -> list[dict[str, Any]]:
        return [] if self.checkpointer is None else self.checkpointer.finish()


def train(job: StepJob, log: MetricsLog | None, steps: int, checkpoints: CheckpointOptions,
          on_saved: Callable[[dict[str, Any]], None] = lambda saved: None) -> None:
    """Steps from where ``job`` stands until ``steps`` are done, a metrics line per step and per completed
    checkpoint (``log``: None on the ranks that do not log), a checkpoint whenever one is due, then the last
    checkpoint finished. ``on_saved`` sees each completed checkpoint's measurements."""
    if log is not None:
        log.start_at(job.steps_done)
    while job.steps_done < steps:
        step = job.steps_done
        results = job.step()
        if log is not None:
            log.log(step, results)
        if checkpoints.due(job.steps_done, steps):
            _saved(log, job.save_training_checkpoint(checkpoints), on_saved)
    finish_checkpoints(job, log, checkpoints, on_saved)


def finish_checkpoints(job: StepJob, log: MetricsLog | None, checkpoints: CheckpointOptions,
                       on_saved: Callable[[dict[str, Any]], None] = lambda saved: None) -> None:
    """Wait for a checkpoint still being written (at the end, or when a stop signal arrived) and log it."""
    if checkpoints.directory is not None:
        _saved(log, job.finish_checkpoints(), on_saved)


def _saved(log: MetricsLog | None, saves: list[dict[str, Any]], on_saved: Callable[[dict[str, Any]], None]) -> None:
    """Log each checkpoint; one that failed to write (``error``: a full disk) is a warning, training goes on."""
    for saved in saves:
        if "error" in saved:
            if log is not None:
                log.event("checkpoint_failed", **saved)
                log.warn(f"checkpoint of step {saved['step']} not written, training goes on ({saved['error']}): "
                         f"its partial folder was removed; the run resumes from an earlier one if it stops")
            continue
        if log is not None:
            log.event("checkpoint", **saved)
        on_saved(saved)
