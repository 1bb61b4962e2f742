"""Start one Ray actor per planned device and run the plan on them.

Order: validate the plan (before Ray) -> attach to / start Ray -> check the cluster has the devices ->
placement group (one bundle per device, PACK) -> actors -> rendezvous on the first actor's own address and a
free port there -> each actor builds its Trainer -> steps.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any

import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from planner.schema import Plan
from runtime.driver import tokens_per_sample, validate_plan
from runtime.metrics import MetricsLog, format_summary
from runtime.preflight import check_outputs, is_cpu_plan, num_devices, save_with_fallback
from runtime.trainer import RunOptions, Trainer

PLACEMENT_TIMEOUT_S = 120
"""How long to wait for the placement group's bundles once resources were found sufficient."""

SHUTDOWN_TIMEOUT_S = 30
"""How long actors get to leave the process group before they are killed."""


def check_resources(plan: Plan, resources: dict[str, float]) -> None:
    """Raise ValueError (one line) if the Ray cluster lacks the devices the plan needs."""
    need = num_devices(plan)
    kind = "CPU" if is_cpu_plan(plan) else "GPU"
    have = int(resources.get(kind, 0))
    if have < need:
        what = "CPU slots" if kind == "CPU" else "GPUs"
        raise ValueError(f"the plan needs {need} {what} but the Ray cluster has {have} (missing {need - have} {what})")


def _rendezvous_address() -> tuple[str, int]:
    """This host's address as seen on the route to Ray's GCS, and a free TCP port on it."""
    gcs_host = ray.get_runtime_context().gcs_address.rsplit(":", 1)[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((gcs_host, 1))
        host = probe.getsockname()[0]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]


@ray.remote
class Worker:
    """One device: a member of the torch.distributed world, holding one Trainer."""

    def __init__(self, rank: int, world_size: int, threads: int):
        self.rank, self.world_size = rank, world_size
        torch.set_num_threads(threads)
        self.trainer: Trainer | None = None

    def rendezvous_address(self) -> tuple[str, int]:
        return _rendezvous_address()

    def setup(self, plan_json: str, address: tuple[str, int], options: RunOptions) -> None:
        plan = Plan.model_validate_json(plan_json)
        backend = "gloo" if is_cpu_plan(plan) else "nccl"
        if backend == "nccl":
            torch.cuda.set_device(0)
        dist.init_process_group(backend, init_method=f"tcp://{address[0]}:{address[1]}", rank=self.rank,
                                world_size=self.world_size)
        self.trainer = Trainer(plan, rank=self.rank, options=options)

    def train_step(self) -> dict[str, Any]:
        return self.trainer.train_step()

    def full_tensors(self, kind: str) -> dict[str, torch.Tensor]:
        return self.trainer.full_tensors(kind)

    def save_hf_folder(self, path: str) -> None:
        self.trainer.save_hf_folder(path)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def get_all(refs: list[ray.ObjectRef], workers: list[Any]) -> list[Any]:
    """The results of one call per rank. When a rank fails, the others are stopped (they wait for it in a
    collective) and the failed rank's error is raised; the stopped ranks' errors are collected, so that Ray does
    not print each of them as an "Unhandled error" stack."""
    pending = list(refs)
    while pending:
        (ready,), pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(ready)
        except ray.exceptions.RayError:
            for w in workers:
                ray.kill(w)
            _drain(pending)
            raise
    return ray.get(refs)


def _drain(refs: list[ray.ObjectRef]) -> None:
    """Wait for calls whose results (or errors, once their actors were killed) nobody needs."""
    for ref in refs:
        try:
            ray.get(ref)
        except ray.exceptions.RayError:
            pass


@dataclass
class Job:
    """A plan's running actors."""

    plan: Plan
    workers: list[Any]
    group: Any

    def step(self) -> list[dict[str, Any]]:
        """One optimizer step on every rank; each rank's measurements."""
        return get_all([w.train_step.remote() for w in self.workers], self.workers)

    def gather(self, kind: str) -> dict[str, torch.Tensor]:
        """Full parameters (``"param"``) or gradients (``"grad"``) under their HF names."""
        merged: dict[str, torch.Tensor] = {}
        for part in get_all([w.full_tensors.remote(kind) for w in self.workers], self.workers):
            merged.update(part)
        return merged

    def shutdown(self) -> None:
        """Leave the process group where possible (a rank stuck after a peer failed cannot), then stop the actors."""
        closing = [w.close.remote() for w in self.workers]
        ray.wait(closing, num_returns=len(closing), timeout=SHUTDOWN_TIMEOUT_S)
        for w in self.workers:
            ray.kill(w)
        _drain(closing)
        remove_placement_group(self.group)


def ensure_ray() -> None:
    """Attach to RAY_ADDRESS (or the cluster of ``ray job submit``), else start Ray on this machine."""
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False, logging_level="ERROR")


def start(plan: Plan, options: RunOptions) -> Job:
    """Validate, check resources, place one actor per device and build every rank's Trainer."""
    validate_plan(plan, options)
    ensure_ray()
    check_resources(plan, ray.cluster_resources())
    n = num_devices(plan)
    bundle = {"CPU": 1} if is_cpu_plan(plan) else {"CPU": 1, "GPU": 1}
    # CPU plans: one thread per worker (one CPU slot each); GPU plans: the node's cores shared by its workers
    threads = 1 if is_cpu_plan(plan) else max(1, (os.cpu_count() or 1) // plan.cluster.devices_per_node)
    group = placement_group([bundle] * n, strategy="PACK")
    ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    workers = [
        Worker.options(
            num_cpus=1, num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
        ).remote(rank, n, threads)
        for rank in range(n)
    ]
    try:
        address = ray.get(workers[0].rendezvous_address.remote())
        plan_json = plan.model_dump_json()
        get_all([w.setup.remote(plan_json, address, options) for w in workers], workers)
    except BaseException:  # one rank failed: the others may be blocked in the rendezvous, stop them all
        for w in workers:
            ray.kill(w)
        remove_placement_group(group)
        raise
    return Job(plan=plan, workers=workers, group=group)


def save_checkpoint(job: Job, path: str) -> None:
    """Write the trained weights as a Hugging Face folder from the ranks' shards (runtime.checkpoint.save_hf_folder:
    no process holds the whole model); ``path`` must be reachable by every worker.

    Every rank raises the same OSError when a write failed on any of them (and stays alive, so a fallback folder
    can be tried); that error is raised here."""
    pending, errors = [w.save_hf_folder.remote(path) for w in job.workers], []
    while pending:
        (ready,), pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(ready)
        except ray.exceptions.RayTaskError as e:
            if not isinstance(e.cause, OSError):  # not a failed write: the other ranks may wait for this one
                get_all([ready, *pending], job.workers)
            errors.append(e.cause)
    if errors:
        raise errors[0]


def run(
    plan: Plan, options: RunOptions, *, steps: int, metrics_path: str | None = None, save: str | None = None
) -> dict[str, Any]:
    """Train ``steps`` optimizer steps with one JSON line per step (then save the weights to ``save``, a
    folder ``--checkpoint`` can start from); returns the summary (also printed).

    Every output path is checked before Ray starts. If saving fails at the end, the weights go to a fallback
    folder and ``preflight.SavedElsewhere`` says where.
    """
    check_outputs(metrics=metrics_path, save=save)
    job = start(plan, options)
    try:
        log = MetricsLog(plan, steps=steps, path=metrics_path, tokens_per_sample=tokens_per_sample(plan))
        try:
            for step in range(steps):
                log.log(step, job.step())
        finally:
            log.close()
        summary = log.summary()
        print(format_summary(summary, "peak RSS per worker" if is_cpu_plan(plan) else "max allocated per GPU"))
        if save is not None:
            save_with_fallback(lambda folder: save_checkpoint(job, folder), save)
    finally:
        job.shutdown()
    return summary
