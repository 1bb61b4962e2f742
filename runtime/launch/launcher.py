"""Start one Ray actor per planned device and run the plan on them.

Order: validate the plan (before Ray) -> attach to / start Ray -> check the cluster has the devices ->
placement group (one bundle per device, PACK) -> actors -> rendezvous on a TCP store the first actor starts on
its own address -> each actor builds its Trainer -> steps, with a sharded checkpoint every K steps
(runtime.checkpoints.dcp_checkpoint).

Recovery (``max_failures``): the driver waits on every step's per-rank results with ``ray.wait``, so a dead
worker process (or a rank whose collective failed because a peer died) is seen as soon as Ray reports it; the
job is torn down (actors killed, placement group removed), started again on a new placement group, and resumes
from the latest complete checkpoint, at most ``max_failures`` times; after a lost node it first waits for the
cluster to have the resources again. Plain actors rather than Ray Train's TorchTrainer: their measured step
overhead is 1.06x in the worker and 1.09x seen by the driver (benchmarks/runtime_overhead.py, CPU), and Ray Train
needs the ``ray[train]`` extras (pyarrow, ...), which this project does not install.
"""

from __future__ import annotations

import dataclasses
import datetime
import gc
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from planner.contract.file_io import write_output
from planner.contract.schema import Plan, load_plan
from planner.contract.strategy import layout_of
from runtime.run.checkpoint_dir import CheckpointOptions, newest_sound
from runtime.checkpoints.dcp_checkpoint import Checkpointer, checkpoint_problem
from runtime.training import loop
from runtime.launch.driver import validate_plan
from runtime.launch.adapt import Adapter, AdaptOptions
from runtime.observability.collectives import time_in_world
from runtime.observability.memory import StepOutOfMemory
from runtime.observability.metrics import MetricsLog, print_summary
from runtime.parallel.parallel_dims import forget_earlier_worlds
from runtime.run.preflight import check_outputs, is_cpu_plan, num_devices, save_with_fallback
from runtime.run.stop_signals import keep_handler
from runtime.training.trainer import RunOptions, Trainer, freeze_startup_heap

PLACEMENT_TIMEOUT_S = 120
"""How long to wait for the placement group's bundles once resources were found sufficient, and, when
recovering, for the cluster to have the resources again (a lost node replaced)."""

SHUTDOWN_TIMEOUT_S = 30
"""How long actors get to leave the process group before they are killed."""

COLLECTIVE_TIMEOUT_S = 300
"""A collective waiting longer than this for a peer fails (instead of hanging): torch.distributed's timeout."""

USER_ERRORS = (ValueError, NotImplementedError, OSError)
"""Errors of a worker that a restart cannot cure (bad input, unsupported plan, unwritable paths)."""


def check_resources(plan: Plan, resources: dict[str, float]) -> None:
    """Raise ValueError (one line) if the Ray cluster lacks the devices the plan needs."""
    need = num_devices(plan)
    kind = "CPU" if is_cpu_plan(plan) else "GPU"
    have = int(resources.get(kind, 0))
    if have < need:
        what = "CPU slots" if kind == "CPU" else "GPUs"
        raise ValueError(f"the plan needs {need} {what} but the Ray cluster has {have} (missing {need - have} {what})")


def _rendezvous_host() -> str:
    """This host's address as seen on the route to Ray's GCS."""
    gcs_host = ray.get_runtime_context().gcs_address.rsplit(":", 1)[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((gcs_host, 1))
        return probe.getsockname()[0]


class Worker(loop.RankCheckpoints):
    """One device (a Ray actor, ``ray::Worker``): a member of the torch.distributed world, holding one Trainer. A
    worker of a ``WorkerPool`` serves job after job: ``close`` leaves its world, ``setup`` joins the next."""

    def __init__(self, rank: int, threads: int):
        self.rank = rank
        torch.set_num_threads(threads)
        freeze_startup_heap()
        self.trainer: Trainer | None = None
        self.checkpointer: Checkpointer | None = None
        self.store: dist.TCPStore | None = None

    def rendezvous_address(self) -> tuple[str, int]:
        """Start the job's rendezvous store here (rank 0) on a port the OS picks as it binds (no window in which
        another socket can take a port found free); its address."""
        self.store = dist.TCPStore(_rendezvous_host(), 0, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        return self.store.host, self.store.port

    def setup(self, plan_json: str, address: tuple[str, int], options: RunOptions, world_size: int) -> int:
        """Join the process group and build the Trainer; returns the steps already done (resumed)."""
        plan = Plan.model_validate_json(plan_json)
        backend = "gloo" if is_cpu_plan(plan) else "nccl"
        if backend == "nccl":
            torch.cuda.set_device(0)
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        store = self.store if self.rank == 0 else dist.TCPStore(*address, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=world_size, timeout=timeout)
        self.trainer = Trainer(plan, rank=self.rank, options=options)
        return self.trainer.step

    def ping(self) -> bool:
        return True

    def train_step(self) -> dict[str, Any]:
        return self.trainer.train_step()

    def full_tensors(self, kind: str) -> dict[str, torch.Tensor]:
        return self.trainer.full_tensors(kind)

    def save_hf_folder(self, path: str) -> None:
        self.trainer.save_hf_folder(path)

    def time_collectives(self, group_sizes: tuple[int, ...]) -> list[dict[str, Any]] | None:
        """The cost model's collectives timed on this job's world (``runtime.observability.collectives``); rank 0's
        timings."""
        device = torch.device("cuda", 0) if dist.get_backend() == "nccl" else torch.device("cpu")
        return time_in_world(self.rank, group_sizes, device)

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
        self.trainer = self.checkpointer = self.store = None
        if dist.is_initialized():
            dist.destroy_process_group()
        forget_earlier_worlds()
        gc.collect()  # the job's meshes sit in reference cycles: until collected, they hold its gloo groups' threads


class PooledWorker(Worker):
    """A ``WorkerPool``'s worker, under a process title of its own (``ray::PooledWorker``), so that what counts a
    job's ``ray::Worker`` processes (the recovery tests) never counts an idle pool member."""


RemoteWorker, RemotePooledWorker = ray.remote(Worker), ray.remote(PooledWorker)


ROOT_CAUSE_WAIT_S = 2.0
"""When a rank fails with a runtime error (often a collective whose peer died), how long to wait for another
rank's actor to be reported dead, the root cause, before stopping them all."""


def get_all(refs: list[ray.ObjectRef], workers: list[Any]) -> list[Any]:
    """The results of one call per rank. When a rank fails, the others are stopped (they wait for it in a
    collective) and the failed rank's error is raised, or a dead actor's if one died on its own; the stopped
    ranks' errors are collected, so that Ray does not print each of them as an "Unhandled error" stack."""
    pending = list(refs)
    while pending:
        (ready,), pending = ray.wait(pending, num_returns=1)
        try:
            ray.get(ready)
        except ray.exceptions.RayError as error:
            died = isinstance(error, ray.exceptions.RayActorError)
            cause = _dead_actor(pending) if _worker_lost(error) and not died else None
            for w in workers:
                ray.kill(w)
            _drain(pending)
            raise cause or error
    return ray.get(refs)


def _dead_actor(refs: list[ray.ObjectRef]) -> ray.exceptions.RayError | None:
    """The error of a call in ``refs`` whose actor died within ``ROOT_CAUSE_WAIT_S``, if any."""
    deadline = time.monotonic() + ROOT_CAUSE_WAIT_S
    pending = list(refs)
    while pending and time.monotonic() < deadline:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError as error:
                if isinstance(error, ray.exceptions.RayActorError):
                    return error
    return None


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
    """Their placement group; None for a pool's workers (the pool keeps them)."""
    steps_done: int = 0
    """Optimizer steps done when the job started (resumed from a checkpoint), then after each step."""
    setup_s: float = 0.0
    """Seconds its ranks took to join their world and build their Trainers (a resumed job: to load the
    checkpoint too)."""

    def step(self) -> list[dict[str, Any]]:
        """One optimizer step on every rank; each rank's measurements."""
        results = get_all([w.train_step.remote() for w in self.workers], self.workers)
        self.steps_done += 1
        return results

    def save_training_checkpoint(self, checkpoints: CheckpointOptions) -> list[dict[str, Any]]:
        """A sharded checkpoint of every rank's state (runtime.checkpoints.dcp_checkpoint.Checkpointer); rank 0's measurements
        of the checkpoints that were completed."""
        return get_all([w.save_training_checkpoint.remote(checkpoints) for w in self.workers], self.workers)[0]

    def finish_checkpoints(self) -> list[dict[str, Any]]:
        """Wait for a checkpoint still being written; rank 0's measurements of it."""
        return get_all([w.finish_checkpoints.remote() for w in self.workers], self.workers)[0]

    def time_collectives(self, group_sizes: tuple[int, ...]) -> list[dict[str, Any]]:
        """Collectives timed on the job's own devices over groups of each size (``Worker.time_collectives``)."""
        return get_all([w.time_collectives.remote(group_sizes) for w in self.workers], self.workers)[0]

    def gather(self, kind: str) -> dict[str, torch.Tensor]:
        """Full parameters (``"param"``) or gradients (``"grad"``) under their HF names."""
        merged: dict[str, torch.Tensor] = {}
        for part in get_all([w.full_tensors.remote(kind) for w in self.workers], self.workers):
            merged.update(part)
        return merged

    def leave(self) -> None:
        """Every rank leaves the process group and drops its Trainer; the actors stay up for the next plan's job
        (``start(kept=...)``)."""
        get_all([w.close.remote() for w in self.workers], self.workers)

    def shutdown(self) -> None:
        """Leave the process group where possible (a rank stuck after a peer failed cannot), then stop the actors;
        a pool's workers that left their group stay up for the next job."""
        closing = [w.close.remote() for w in self.workers]
        done, _ = ray.wait(closing, num_returns=len(closing), timeout=SHUTDOWN_TIMEOUT_S)
        for w, call in zip(self.workers, closing):
            if self.group is not None or call not in done:
                ray.kill(w)
        _drain(closing)
        if self.group is not None:
            remove_placement_group(self.group)


class WorkerPool:
    """Warm workers that run job after job (``start(..., pool=)``), so that a job pays no process start-up (~7 s of
    CPU importing torch and transformers per worker here): the test suite's many short jobs. Each job still joins a
    fresh process group and builds fresh Trainers; a worker that died or was killed is replaced by a new one when
    the next job takes it. Workers reserve no CPU slot (``num_cpus=0``): jobs take them one at a time, and a job
    started without the pool still finds the cluster's slots free."""

    def __init__(self) -> None:
        self.workers: list[Any] = []

    def take(self, n: int) -> list[Any]:
        """Ranks 0..n-1: live workers, new ones where they died or were never started."""
        for rank in range(n):
            if rank < len(self.workers) and not self._alive(self.workers[rank]):
                self.workers[rank] = self._new(rank)
            elif rank == len(self.workers):
                self.workers.append(self._new(rank))
        return self.workers[:n]

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers.clear()

    @staticmethod
    def _new(rank: int) -> Any:
        return RemotePooledWorker.options(num_cpus=0).remote(rank, 1)

    @staticmethod
    def _alive(worker: Any) -> bool:
        try:
            return ray.get(worker.ping.remote(), timeout=SHUTDOWN_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError):
            return False


TOKEN_AUTH_HINT = ("if the cluster authenticates by token (clusters started by Ray 2.59 or later do by default), "
                   "set RAY_AUTH_MODE=token with its token in ~/.ray/auth_token or RAY_AUTH_TOKEN, or use "
                   "RAY_ADDRESS=auto on one of its nodes")
"""What a failed connection to an explicit RAY_ADDRESS adds: Ray's own error does not say that a client naming the
address must opt into token authentication (``RAY_ADDRESS=auto`` finds the local cluster's token itself)."""


def ensure_ray() -> None:
    """Attach to RAY_ADDRESS (or the cluster of ``ray job submit``), else start Ray on this machine."""
    if not ray.is_initialized():
        previous = signal.getsignal(signal.SIGTERM)
        address = os.environ.get("RAY_ADDRESS")
        try:
            ray.init(address=address, log_to_driver=False, logging_level="ERROR")
        except ConnectionError as e:
            if address in (None, "auto") or os.environ.get("RAY_AUTH_MODE"):
                raise
            raise ConnectionError(f"{e}: {TOKEN_AUTH_HINT}") from None
        keep_handler(previous)  # ray.init's SIGTERM handler would exit mid-step, aborting in Ray's C++ teardown


def start(plan: Plan, options: RunOptions, *, resource_wait_s: float = 0.0, pool: WorkerPool | None = None,
          kept: Job | None = None) -> Job:
    """Validate, check resources (waiting up to ``resource_wait_s`` for them: a lost node being replaced),
    place one actor per device (or take the pool's, CPU plans only; or ``kept``'s, a job that left its world to
    switch plans, when they are enough: the rest are stopped) and build every rank's Trainer."""
    validate_plan(plan, options)
    ensure_ray()
    if kept is not None:
        n = num_devices(plan)
        if n <= len(kept.workers):
            for w in kept.workers[n:]:
                ray.kill(w)
            return _set_up(plan, options, kept.workers[:n], kept.group)
        kept.shutdown()
    if pool is not None:
        assert is_cpu_plan(plan), "a WorkerPool serves CPU plans (its workers hold no GPU)"
        return _set_up(plan, options, pool.take(num_devices(plan)), group=None)
    deadline = time.monotonic() + resource_wait_s
    while time.monotonic() < deadline:
        try:
            check_resources(plan, ray.cluster_resources())
            break
        except ValueError:
            time.sleep(1.0)
    check_resources(plan, ray.cluster_resources())
    n = num_devices(plan)
    bundle = {"CPU": 1} if is_cpu_plan(plan) else {"CPU": 1, "GPU": 1}
    # CPU plans: one thread per worker (one CPU slot each); GPU plans: the node's cores shared by its workers
    threads = 1 if is_cpu_plan(plan) else max(1, (os.cpu_count() or 1) // plan.cluster.devices_per_node)
    group = placement_group([bundle] * n, strategy="PACK")
    ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    workers = [
        RemoteWorker.options(
            num_cpus=1, num_gpus=bundle.get("GPU", 0),
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
        ).remote(rank, threads)
        for rank in range(n)
    ]
    return _set_up(plan, options, workers, group)


def _set_up(plan: Plan, options: RunOptions, workers: list[Any], group: Any) -> Job:
    """Rendezvous on the first worker's address and build every rank's Trainer (timed from when every actor is up:
    ``Job.setup_s``)."""
    try:
        get_all([w.ping.remote() for w in workers], workers)
        started = time.perf_counter()
        address = ray.get(workers[0].rendezvous_address.remote())
        plan_json = plan.model_dump_json()
        calls = [w.setup.remote(plan_json, address, options, len(workers)) for w in workers]
        steps_done = get_all(calls, workers)[0]
    except BaseException:  # one rank failed: the others may be blocked in the rendezvous, stop them all
        for w in workers:
            ray.kill(w)
        if group is not None:
            remove_placement_group(group)
        raise
    return Job(plan=plan, workers=workers, group=group, steps_done=steps_done, setup_s=time.perf_counter() - started)


def save_checkpoint(job: Job, path: str) -> None:
    """Write the trained weights as a Hugging Face folder from the ranks' shards (runtime.checkpoints.hf_folder.save_hf_folder:
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
    plan: Plan, options: RunOptions, *, steps: int, metrics_path: str | None = None, save: str | None = None,
    checkpoints: CheckpointOptions = CheckpointOptions(), adapt: AdaptOptions | None = None,
    pool: WorkerPool | None = None,
) -> dict[str, Any]:
    """Train until ``steps`` optimizer steps are done (counting those of a resumed checkpoint), with one JSON line
    per step and per checkpoint / resume / recovery, then save the weights to ``save`` (a folder ``--checkpoint``
    can start from); returns the summary (also printed).

    Every output path is checked before Ray starts. If saving fails at the end, the weights go to a fallback
    folder and ``preflight.SavedElsewhere`` says where. When a worker fails, the job restarts from the latest
    complete checkpoint at most ``checkpoints.max_failures`` times, then the failure is raised. ``adapt``: the run
    re-plans from its own measurements and switches plans at a checkpoint when it pays (``runtime.launch.adapt``).
    ``pool``: the job runs on a ``WorkerPool``'s warm workers (CPU plans), which stay up after it.
    """
    check_outputs(metrics=metrics_path, save=save)
    log = MetricsLog(plan, steps=steps, path=metrics_path, trace_dir=options.trace)
    try:
        try:
            adapter = None if adapt is None else Adapter(adapt, steps=steps, folder=checkpoints.directory, log=log,
                                                         memory_cap_bytes=options.memory_cap_bytes)
            job = _train_recovering(plan, options, log, steps, checkpoints, adapter, pool)
        except KeyboardInterrupt as stop:  # Ctrl-C or a stop signal (runtime.run.stop_signals): the steps done so far
            print_summary(log, plan, stopped=str(stop))
            raise
        summary = print_summary(log, plan)
        try:
            if save is not None:
                save_with_fallback(lambda folder: save_checkpoint(job, folder), save)
        finally:
            job.shutdown()
    finally:
        log.close()
    return summary


def _train_recovering(plan: Plan, options: RunOptions, log: MetricsLog, steps: int, checkpoints: CheckpointOptions,
                      adapter: Adapter | None = None, pool: WorkerPool | None = None) -> Job:
    """Start the job and train it until ``steps`` are done, restarting it from the latest complete checkpoint
    when a worker is lost (at most ``checkpoints.max_failures`` times); the job, still up. Elastic
    (``checkpoints.elastic_wait_s``): a restart runs on the devices left (``_plan_for_the_cluster``), and at a
    checkpoint the run moves back up when devices came back (``_SwitchPlan``); adaptive (``adapter``): at a
    checkpoint the run moves to the plan its measurements prefer, or back, or to one that fits the memory it
    measured (``_SwitchPlan``), and a step that ran out of memory re-plans on the memory measured and resumes from
    the newest checkpoint (without ``adapter``: one line, ``_plan_after_out_of_memory``)."""
    failures, failed_at, saved_at, first_plan, kept, out_of_memory = 0, None, {}, plan, None, False
    while True:
        if failed_at is not None and checkpoints.elastic_wait_s is not None:
            plan = _plan_for_the_cluster(plan, first_plan, log, checkpoints, step=failed_at[0])
        job = start(plan, options, resource_wait_s=PLACEMENT_TIMEOUT_S if failures else 0.0, pool=pool, kept=kept)
        kept = None
        if adapter is not None:
            adapter.job_started(job)
        try:
            if failed_at is not None:
                _log_recovery(log, job, failed_at, failures, saved_at)
            else:
                if out_of_memory:  # the steps after its checkpoint are done again
                    log.rewind(job.steps_done)
                if options.resume is not None:
                    log.event("resume", path=options.resume, step=job.steps_done)

            def next_plan(saved: dict[str, Any], job: Job = job) -> Plan | None:
                grown = None if checkpoints.elastic_wait_s is None else _grown_plan(
                    job.plan, first_plan, log, checkpoints.directory, saved["step"])
                return grown or (None if adapter is None else adapter.at_checkpoint(job, saved))

            _train(job, log, steps, checkpoints, saved_at, next_plan)
            return job
        except _SwitchPlan as switch:  # the job left its world; go on under the new plan from the checkpoint just made
            plan, failed_at, kept, out_of_memory = switch.plan, None, job, False
            log.rewind(switch.step)  # steps an overlapped checkpoint's run went past it are done again
            options = dataclasses.replace(options, resume=newest_sound(checkpoints.directory, checkpoint_problem)[0])
        except ray.exceptions.RayError as e:
            error = _out_of_memory(e)
            out_of_memory = error is not None
            if out_of_memory:
                plan, failed_at = _plan_after_out_of_memory(job, error, adapter), None
                options = dataclasses.replace(options, resume=_resume_point(checkpoints, options))
                continue
            if not _worker_lost(e) or failures >= checkpoints.max_failures:
                raise
            failures += 1
            failed_at = (job.steps_done, time.perf_counter(), _first_line(e))
            options = dataclasses.replace(options, resume=_resume_point(checkpoints, options))


def _resume_point(checkpoints: CheckpointOptions, options: RunOptions) -> str | None:
    """Where a restarted job resumes: the newest sound checkpoint of the run, else where the run itself started."""
    resume = newest_sound(checkpoints.directory, checkpoint_problem)[0] if checkpoints.directory else None
    return resume or options.resume


def _out_of_memory(error: ray.exceptions.RayError) -> StepOutOfMemory | None:
    """The rank's out-of-memory error when ``error`` is one."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, StepOutOfMemory) else None


def _plan_after_out_of_memory(job: Job, error: StepOutOfMemory, adapter: Adapter | None) -> Plan:
    """The plan to resume under after ``job`` ran out of memory: re-planned on the measured memory (``--adapt``);
    without it, a ValueError naming what ran out and the way on."""
    if adapter is None:
        raise ValueError(f"{error} (the plan predicted {job.plan.predicted.peak_memory_gib:.4g} GiB with its framework "
                         f"overhead): run with --adapt to re-plan on the measured memory and resume from the last "
                         f"checkpoint")
    return adapter.after_out_of_memory(job, error)


class _SwitchPlan(Exception):
    """Raised after the checkpoint of ``step`` to go on from it under ``plan`` (elastic: devices came back;
    adaptive: a plan measured or predicted faster, or one that fits the memory measured)."""

    def __init__(self, plan: Plan, step: int) -> None:
        super().__init__(f"switch to a plan on {num_devices(plan)} devices after step {step}")
        self.plan, self.step = plan, step


def _devices_of(plan: Plan) -> int:
    """The devices of ``plan``'s kind (CPU slots or GPUs) the Ray cluster has now."""
    return int(ray.cluster_resources().get("CPU" if is_cpu_plan(plan) else "GPU", 0))


def _plan_for_the_cluster(plan: Plan, first_plan: Plan, log: MetricsLog, checkpoints: CheckpointOptions, *,
                          step: int) -> Plan:
    """Elastic recovery: wait up to ``checkpoints.elastic_wait_s`` for ``first_plan``'s devices, then the plan for
    the devices the cluster has (``_plan_for``)."""
    deadline = time.monotonic() + checkpoints.elastic_wait_s
    while _devices_of(plan) < num_devices(first_plan) and time.monotonic() < deadline:
        time.sleep(1.0)
    have = _devices_of(plan)
    if have < 1:
        raise ValueError(f"the Ray cluster has no {'CPU slot' if is_cpu_plan(plan) else 'GPU'} left to re-plan for")
    return _plan_for(plan, first_plan, have, log, checkpoints.directory, step)


def _grown_plan(plan: Plan, first_plan: Plan, log: MetricsLog, folder: str, step: int) -> Plan | None:
    """At a checkpoint of an elastic run: the plan for more devices when the cluster has more than ``plan`` uses
    (and ``plan`` uses fewer than the first plan), else None; a re-plan that fails is a warning, the run goes on."""
    have = min(_devices_of(plan), num_devices(first_plan))
    if have <= num_devices(plan):
        return None
    try:
        return _plan_for(plan, first_plan, have, log, folder, step)
    except ValueError as e:
        log.warn(f"staying on {num_devices(plan)} devices: {e}")
        return None


def _plan_for(plan: Plan, first_plan: Plan, have: int, log: MetricsLog, folder: str, step: int) -> Plan:
    """The plan for ``have`` devices: ``first_plan`` when it has them all, ``plan`` when it uses exactly them, else
    ``plan`` re-planned for them (``replan``: the same global batch). One line and one metrics event say so."""
    path = note = None
    if have >= num_devices(first_plan):
        new = first_plan
    elif have == num_devices(plan):
        return plan
    else:
        new, path, note = replan(plan, have, folder, step)
    if new is plan:
        return plan
    log.event("replan", step=step, devices_before=num_devices(plan), devices_after=num_devices(new),
              global_batch=new.workload.global_batch, layout=layout_of(new),
              predicted_step_time_s=new.predicted.step_time_s, plan=path, note=note)
    log.say(f"elastic: {num_devices(plan)} -> {num_devices(new)} devices after step {step}: {layout_of(new)}; "
            f"global batch {new.workload.global_batch}; {new.predicted.step_time_s:.3g} s per step predicted"
            + (f" ({note})" if note else ""))
    log.plan = new
    return new


REPLAN_TIMEOUT_S = 300
"""Longest wait for the planner's re-plan (it plans in seconds)."""


def replan(plan: Plan, devices: int, folder: str, step: int) -> tuple[Plan, str, str | None]:
    """``plan`` re-planned for ``devices`` by ``python -m planner.replan`` (a subprocess: the runtime never imports
    the solver), written to ``folder``/plan-<step>-<devices>.json beside the checkpoints, where the run's plans
    stay: (the new plan, its file, the planner's note when it dropped pins). Raises ValueError with the planner's
    one line when it cannot."""
    base = os.path.join(folder, f"plan-{step:06d}-{num_devices(plan)}")
    old, new = f"{base}.json", os.path.join(folder, f"plan-{step:06d}-{devices}.json")
    write_output(old, plan.to_json(), flag="--checkpoint-dir")
    result = subprocess.run([sys.executable, "-m", "planner.replan", old, "--gpus", str(devices), "--out", new],
                            capture_output=True, text=True, timeout=REPLAN_TIMEOUT_S)
    if result.returncode != 0:
        reason = (result.stderr.strip().splitlines() or ["no output"])[-1].removeprefix("replan: error: ")
        raise ValueError(f"cannot re-plan for the {devices} devices left: {reason}")
    note = next((line.removeprefix("replan: ") for line in result.stdout.splitlines() if " dropped: " in line), None)
    return load_plan(new), new, note


def _train(job: Job, log: MetricsLog, steps: int, checkpoints: CheckpointOptions, saved_at: dict[int, float],
           next_plan: Callable[[dict[str, Any]], Plan | None] | None = None) -> None:
    """``loop.train`` from where the job stands, noting when each checkpoint was done in ``saved_at``; a failing
    step shuts the job down and raises. ``next_plan``: after each checkpoint before the last (its measurements),
    the plan to go on under instead (then the job leaves its world, its actors kept, and ``_SwitchPlan`` is
    raised), or None."""
    def on_saved(saved: dict[str, Any]) -> None:
        saved_at[saved["step"]] = time.perf_counter()

    def on_saved_switching(saved: dict[str, Any]) -> None:
        on_saved(saved)
        new = next_plan(saved) if next_plan is not None and saved["step"] < steps else None
        if new is not None:
            raise _SwitchPlan(new, saved["step"])

    try:
        loop.train(job, log, steps, checkpoints, on_saved=on_saved_switching)
    except _SwitchPlan:  # the actors stay for the next plan's job (``start(kept=...)``)
        job.leave()
        raise
    except KeyboardInterrupt:  # a stop signal reached the driver only: the workers let a checkpoint being written
        try:                   # complete (one step at most), so that the run resumes from it; a second one stops this
            loop.finish_checkpoints(job, log, checkpoints, on_saved)
        finally:
            job.shutdown()
        raise
    except BaseException:
        job.shutdown()
        raise


def _worker_lost(error: ray.exceptions.RayError) -> bool:
    """A failure a restart can cure: a worker died, or a rank's collective failed with it; not a user error, nor a
    step that ran out of memory (it would again)."""
    if isinstance(error, ray.exceptions.RayTaskError):
        return not isinstance(error.cause, (*USER_ERRORS, StepOutOfMemory))
    return isinstance(error, ray.exceptions.RayActorError)


def _first_line(error: BaseException) -> str:
    return next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)[:200]


def _log_recovery(log: MetricsLog, job: Job, failed_at: tuple[int, float, str], failures: int,
                  saved_at: dict[int, float]) -> None:
    """A recovery's metrics line: the steps redone since the checkpoint it resumed from, and the seconds from
    that checkpoint's save (or from the failure, for a checkpoint of an earlier run) to the restarted job."""
    done, when, error = failed_at
    since = saved_at.get(job.steps_done, when)
    log.rewind(job.steps_done)
    log.event("recovery", failure=failures, error=error, resumed_step=job.steps_done,
              lost_steps=done - job.steps_done, lost_s=time.perf_counter() - since)
