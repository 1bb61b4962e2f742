"""Ranks as plain processes (torch.multiprocessing, gloo, no Ray) for the sharded start-up and checkpoint tests.

Functions run in the children live here, not in a test module: pytest imports test modules under names of its
own (``runtime.test_*``) that a child cannot import.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
import torch.multiprocessing as mp

from runtime.parallel.parallel_dims import forget_earlier_worlds
from runtime.training.trainer import RunOptions, Trainer, freeze_startup_heap

SEED = 3
"""Random-init seed of the scenarios."""

TESTS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, fn, args: tuple, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    freeze_startup_heap()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(fn(rank, *args), os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


FORKSERVER_PRELOAD = ["runtime.training.trainer", "tests.runtime.ranks"]
"""What the fork server imports once per test session (~8 s of torch and transformers here), so that every rank
after the first start forks from a process that already holds them instead of importing them again."""


def start_ranks(fn, args: tuple, nprocs: int) -> None:
    """``fn(rank, *args)`` in ``nprocs`` fresh processes forked from the session's fork server, which imported the
    runtime once; waits for them all (an exception in a child is raised here).

    The server (started by the first call, so every test's ranks must start here) inherits ``sys.path`` less the
    ``tests`` folder pytest prepends (there, ``runtime`` would be ``tests/runtime``).
    """
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != TESTS_DIR]
    try:
        mp.set_forkserver_preload(FORKSERVER_PRELOAD)
        mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver")
    finally:
        sys.path[:] = saved


def spawn(world: int, fn, *args) -> list:
    """``fn(rank, *args)`` on ``world`` gloo ranks (``start_ranks``); each rank's return value."""
    with tempfile.TemporaryDirectory() as out_dir:
        start_ranks(_rank_main, (world, _free_port(), fn, args, out_dir), world)
        return [torch.load(os.path.join(out_dir, f"{rank}.pt")) for rank in range(world)]


def fresh_groups() -> None:
    """Destroy every process group but the world's, before a rank builds its next Trainer: each Trainer's device
    meshes make gloo groups of their own, whose threads stay while anything holds the meshes (DTensor's caches
    do, until ``forget_earlier_worlds``; reference cycles do, until collected). A rank building dozens of Trainers
    in turn held over a thousand threads (the resume ranks: their fixture 91 s -> 68 s alone)."""
    for group in list(c10d._world.pg_map):
        if group is not c10d.GroupMember.WORLD:
            dist.destroy_process_group(group)
    forget_earlier_worlds()
    gc.collect()


def _gathered(trainer: Trainer) -> tuple[dict, dict]:
    """The full parameters (HF names) gathered from a Trainer's shards, and its buffers."""
    buffers = {m.hf_name(n): b.clone() for m in trainer.modules.values() for n, b in m.named_buffers()}
    return trainer.full_tensors("param"), buffers


def run_scenarios(rank: int, plans: dict, checkpoints: dict, round_trip: dict, save_dir: str) -> dict:
    """On every rank: each plan from random init and from its checkpoint (``checkpoints[name]``); then for each
    round trip (saving plan, loading plan): train one step under the first, save, load under the second."""
    out = {}
    for name, plan in plans.items():
        out["init", name] = _gathered(Trainer(plan, rank=rank, options=RunOptions(seed=SEED)))
        out["load", name] = _gathered(Trainer(plan, rank=rank, options=RunOptions(checkpoint=checkpoints[name])))
    for saving, loading in round_trip.items():
        trainer = Trainer(plans[saving], rank=rank, options=RunOptions(seed=SEED))
        trainer.train_step()
        path = os.path.join(save_dir, saving)
        trainer.save_hf_folder(path)
        out["saved", saving] = _gathered(trainer)
        out["reloaded", saving] = _gathered(Trainer(plans[loading], rank=rank, options=RunOptions(checkpoint=path)))
    return out


def _proc_status_bytes(field: str) -> int:
    """A memory line of /proc/self/status (VmRSS: resident now; VmHWM: peak since the last reset), in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _measured(build):
    """``build()`` and its peak resident-memory growth over what this process held before (freed memory is
    handed back to the OS first, so that a previous phase's heap cannot hide this one's growth)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = _proc_status_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    start = time.perf_counter()
    result = build()
    return result, {"base": base, "peak_growth": _proc_status_bytes("VmHWM") - base,
                    "seconds": time.perf_counter() - start}


def measure_startup(rank: int, init_plan, load_plan, checkpoint: str) -> dict:
    """Peak RSS growth and seconds of building a Trainer under ``init_plan`` from random init, of saving it as a
    bf16 Hub-format folder, and of building one under ``load_plan`` from that folder."""
    out = {"baseline": _proc_status_bytes("VmRSS")}
    trainer, out["init"] = _measured(lambda: Trainer(init_plan, rank=rank, options=RunOptions(seed=SEED)))
    _, out["save"] = _measured(functools.partial(trainer.save_hf_folder, checkpoint, dtype=torch.bfloat16))
    del trainer
    _, out["load"] = _measured(lambda: Trainer(load_plan, rank=rank, options=RunOptions(checkpoint=checkpoint)))
    return out
