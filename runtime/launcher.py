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
from runtime.data import layout_from_plan
from runtime.model import hf_config_from_dict
from runtime.parallel.ulysses import split_sequence
from runtime.parallel_dims import ParallelDims
from runtime.trainer import MODULES, RunOptions, Trainer
from runtime.vision import merged_positions_per_rank

PLACEMENT_TIMEOUT_S = 120
"""How long to wait for the placement group's bundles once resources were found sufficient."""

SHUTDOWN_TIMEOUT_S = 30
"""How long actors get to leave the process group before they are killed."""


def is_cpu_plan(plan: Plan) -> bool:
    """A plan made for ``--gpu cpu`` runs on CPU workers."""
    return plan.cluster.device.name.lower() == "cpu"


def num_devices(plan: Plan) -> int:
    """Distinct global ranks the plan uses."""
    return len({r for m in plan.modules for r in m.ranks})


def validate_plan(plan: Plan, options: RunOptions) -> None:
    """Everything that can be checked without Ray; raises ValueError / NotImplementedError in one line."""
    names = sorted(m.name for m in plan.modules)
    if names != sorted(MODULES):
        raise NotImplementedError(f"the runtime runs plans with modules {list(MODULES)}, this one has {names}")
    dims = {name: ParallelDims.from_plan(plan.module(name)) for name in MODULES}
    vision, llm = dims["vision"], dims["llm"]
    if vision.frozen and llm.frozen:
        raise ValueError("every module of the plan is frozen: nothing to train")
    if vision.grad_accum != llm.grad_accum or vision.dp * vision.micro_batch != llm.dp * llm.micro_batch:
        raise ValueError("vision and llm must agree on grad_accum and on samples per micro-batch (dp * micro_batch)")
    ranks = {name: set(d.ranks) for name, d in dims.items()}
    if plan.placement == "colocated" and ranks["vision"] != ranks["llm"]:
        raise ValueError("a colocated plan must place vision and llm on the same ranks")
    if plan.placement == "disjoint" and ranks["vision"] & ranks["llm"]:
        raise ValueError("a disjoint plan must place vision and llm on different ranks")
    if sorted(ranks["vision"] | ranks["llm"]) != list(range(num_devices(plan))):
        raise ValueError("the plan's ranks must be 0..N-1")
    config = hf_config_from_dict(plan.model.hf_config)
    vc, tc = config.vision_config, config.get_text_config()
    if vc.num_heads % (vision.tp * vision.sp):
        raise ValueError(f"vision tp*sp = {vision.tp * vision.sp} does not divide its {vc.num_heads} heads")
    if tc.num_attention_heads % llm.tp or tc.num_key_value_heads % llm.tp:
        raise ValueError(
            f"llm tp = {llm.tp} does not divide its {tc.num_attention_heads} q / {tc.num_key_value_heads} kv heads"
        )
    if (tc.num_attention_heads // llm.tp) % llm.sp:
        raise ValueError(
            f"llm sp = {llm.sp} does not divide the {tc.num_attention_heads // llm.tp} attention heads of a TP rank "
            f"(tp = {llm.tp})"
        )
    layout = layout_from_plan(plan.workload, config)
    split_sequence(layout.seq_len, llm.sp)  # a token per SP rank at least
    grid = torch.tensor([(1, h // layout.patch_size, w // layout.patch_size) for h, w in layout.image_sizes])
    merged_positions_per_rank(grid.repeat(vision.micro_batch, 1), vc, vision.sp)  # enough windows for SP
    if options.data is not None and not os.path.exists(options.data):
        raise ValueError(f"data path {options.data} does not exist")
    if options.checkpoint is not None and not os.path.isdir(options.checkpoint):
        raise ValueError(f"checkpoint {options.checkpoint} is not a folder written by save_pretrained")


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

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class Job:
    """A plan's running actors."""

    plan: Plan
    workers: list[Any]
    group: Any

    def step(self) -> list[dict[str, Any]]:
        """One optimizer step on every rank; each rank's measurements."""
        return ray.get([w.train_step.remote() for w in self.workers])

    def gather(self, kind: str) -> dict[str, torch.Tensor]:
        """Full parameters (``"param"``) or gradients (``"grad"``) under their HF names."""
        merged: dict[str, torch.Tensor] = {}
        for part in ray.get([w.full_tensors.remote(kind) for w in self.workers]):
            merged.update(part)
        return merged

    def shutdown(self) -> None:
        """Leave the process group where possible (a rank stuck after a peer failed cannot), then stop the actors."""
        try:
            ray.get([w.close.remote() for w in self.workers], timeout=SHUTDOWN_TIMEOUT_S)
        except ray.exceptions.RayError:
            pass
        finally:
            for w in self.workers:
                ray.kill(w)
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
        ray.get([w.setup.remote(plan_json, address, options) for w in workers])
    except BaseException:  # one rank failed: the others may be blocked in the rendezvous, stop them all
        for w in workers:
            ray.kill(w)
        remove_placement_group(group)
        raise
    return Job(plan=plan, workers=workers, group=group)


def save_checkpoint(job: Job, path: str) -> None:
    """Gather the trained weights to this process and write them with transformers' ``save_pretrained``."""
    from runtime.model import build_model

    model = build_model(job.plan.model.hf_config, seed=0, device="meta")
    model.load_state_dict(job.gather("param"), strict=False, assign=True)
    model.tie_weights()
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    assert not missing, f"parameters not gathered: {missing[:3]}"
    model.save_pretrained(path)


def run(
    plan: Plan, options: RunOptions, *, steps: int, metrics_path: str | None = None, save: str | None = None
) -> dict[str, Any]:
    """Train ``steps`` optimizer steps with one JSON line per step (then save the weights to ``save``, a
    folder ``--checkpoint`` can start from); returns the summary (also printed)."""
    from runtime.metrics import MetricsLog, format_summary

    job = start(plan, options)
    try:
        layout = layout_from_plan(plan.workload, hf_config_from_dict(plan.model.hf_config))
        log = MetricsLog(plan, steps=steps, path=metrics_path, tokens_per_sample=layout.seq_len)
        try:
            for step in range(steps):
                log.log(step, job.step())
        finally:
            log.close()
        summary = log.summary()
        if save is not None:
            save_checkpoint(job, save)
    finally:
        job.shutdown()
    print(format_summary(summary, "peak RSS per worker" if is_cpu_plan(plan) else "max allocated per GPU"))
    return summary
