"""Training checkpoints with torch.distributed.checkpoint (DCP): every rank writes only its shards of the model
and of the AdamW state; ``--resume`` loads them back, also under a plan with other degrees (DCP reshards).

What a checkpoint holds (folder layout: runtime.run.checkpoint_dir):

- DCP shards (``*.distcp`` + ``.metadata``) of one flat state dict whose keys are plan-independent:
  ``param/<HF name>`` and ``optim/<HF name>/<exp_avg | exp_avg_sq | step>``. The values come from
  ``torch.distributed.checkpoint.state_dict.get_state_dict`` (FSDP2 / TP DTensor shards, FQNs without wrapper
  prefixes), renamed to HF names (``VisionTower.hf_name`` / ``LanguageModel.hf_name``). The one tensor whose
  stored layout depends on the plan, the vision ``qkv`` under TP (rows in TP layout,
  runtime.parallel.tensor_parallel), is saved in HF row order: gathered one tensor at a time, put in HF order,
  and re-sharded on rows over the same mesh.
- ``run_state.json`` (rank 0): the Trainer's ``state_dict``: optimizer steps done and the global index of the next
  sample (plan-independent).
- ``schedule-<module>.json`` (the module's first rank): the LR schedule's state.
- ``config.json`` (rank 0): the model's transformers config.
- ``rng-rank<r>.pt`` (each rank): torch's RNG states; restored when the resuming plan has that rank.

Saving is collective over the world (each rank passes the state of the modules it holds); so is loading.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from planner.contract.file_io import read_json, write_output
from runtime.checkpoints.hf_folder import local_region
from runtime.checkpoints.dcp_metadata import SafeFileSystemReader, UnsafeCheckpoint, read_metadata
from runtime.run.checkpoint_dir import (
    RUN_STATE, TMP_SUFFIX, checkpoint_name, mark_complete, prune, read_run_state, run_state_problem,
)

CONFIG_FILE = "config.json"
"""Rank 0's copy of the model's transformers config (preflight checks a resume against it; export copies it)."""

PARAM, OPTIM = "param", "optim"
"""Key prefixes of the model's and the optimizer's tensors in the flat DCP state dict."""


def schedule_file(module_name: str) -> str:
    return f"schedule-{module_name}.json"


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


class TrainingState:
    """A rank's flat, plan-independent DCP state dict of the modules it holds, and how to put loaded values back.

    The values are the live parameters and optimizer states (DCP writes from and loads into them in place),
    except the TP vision qkv tensors, which are HF-order copies (``restore`` writes them back).
    """

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.flat: dict[str, Any] = {}
        self._loaded: dict[str, tuple[dict[str, Any], dict[str, Any] | None]] = {}
        self._reordered: list[tuple[DTensor, str, int]] = []  # (live tensor, flat key, tp)
        for name in trainer.modules:
            self._add_module(name)

    def _add_module(self, name: str) -> None:
        trainer, module = self.trainer, self.trainer.modules[name]
        if name in trainer.optimizers:
            model_sd, optim_sd = get_state_dict(module, trainer.optimizers[name][0])
        else:
            model_sd, optim_sd = get_model_state_dict(module), None
        self._loaded[name] = (model_sd, optim_sd)
        for fqn, tensor in model_sd.items():
            self._add(f"{PARAM}/{module.hf_name(fqn)}", tensor, name, fqn)
        for fqn, states in (optim_sd or {}).get("state", {}).items():
            for state_name, tensor in states.items():
                self._add(f"{OPTIM}/{module.hf_name(fqn)}/{state_name}", tensor, name, fqn)

    def _add(self, key: str, tensor: Any, module_name: str, fqn: str) -> None:
        order = self.trainer.model.row_order(module_name, fqn, tensor.shape[0]) if isinstance(tensor, DTensor) else None
        if order is not None:  # stored row i is HF row order[i]
            self._reordered.append((tensor, key, order))
            tensor = _resharded_rows(tensor.full_tensor()[torch.argsort(order)], tensor.device_mesh)
        self.flat[key] = tensor

    def restore(self) -> None:
        """After ``dcp.load`` into ``flat``: the HF-order tensors back into their TP row order, then every module's
        model and optimizer state set (``set_state_dict``)."""
        for live, key, order in self._reordered:
            stored = self.flat[key].full_tensor()[order]
            local = live.to_local()
            if local.numel():
                local.copy_(stored[local_region(live)])
        for name, (model_sd, optim_sd) in self._loaded.items():
            module = self.trainer.modules[name]
            if optim_sd is None:
                set_model_state_dict(module, model_sd)
            else:
                set_state_dict(module, self.trainer.optimizers[name][0], model_state_dict=model_sd,
                               optim_state_dict=optim_sd)


def _resharded_rows(full: torch.Tensor, mesh) -> DTensor:
    """``full`` (the same on every rank of ``mesh``) as a DTensor sharded on rows over the mesh's first axis."""
    placements = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    local = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))].clone()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def _write_run_state(trainer: Any, path: str) -> None:
    """This rank's small files: run state (rank 0), LR schedules (a module's first rank), RNG states."""
    if trainer.rank == 0:
        write_output(os.path.join(path, RUN_STATE), json.dumps(trainer.state_dict()), flag="--checkpoint-dir")
        trainer.hf_config().to_json_file(os.path.join(path, CONFIG_FILE))
    for name, (_, schedule) in trainer.optimizers.items():
        if trainer.rank == trainer.dims[name].ranks[0]:
            write_output(os.path.join(path, schedule_file(name)), json.dumps(schedule.state_dict()),
                         flag="--checkpoint-dir")
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and trainer.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, os.path.join(path, rng_file(trainer.rank)))


class Checkpointer:
    """A rank's checkpoint writer: ``save`` whenever one is due, ``finish`` at the end (both collective: every
    rank calls them). Each checkpoint goes to ``directory/step-NNNNNN.tmp``; rank 0 marks it complete and renames
    it once every rank has written (runtime.run.checkpoint_dir), then keeps the ``keep_last`` newest.

    Synchronous (``overlap=False``): ``save`` writes, and returns the checkpoint's measurements. Overlapped:
    ``save`` stages the state in memory (the stall) and DCP's ``async_save`` writes it from a thread, over a
    gloo group of its own so that its collectives never interleave with training's, while training goes on.
    Rank 0 marks it complete as soon as its write returned (DCP's coordinator finishes a save only after every
    rank's write). The next ``save``, or ``finish``, first waits for it and returns its measurements.

    A measurement: ``step``, ``path``, ``seconds`` (time training was blocked) and, from rank 0, ``bytes`` (all
    ranks' files), or ``error`` when a write failed with an OSError on some rank (the checkpoint was removed).
    """

    def __init__(self, trainer: Any, directory: str, *, keep_last: int | None = None, overlap: bool = False):
        self.trainer, self.directory, self.keep_last = trainer, directory, keep_last
        self.group = dist.new_group(backend="gloo") if overlap else None
        self._pending: tuple[Any, dict[str, Any], threading.Event] | None = None

    def save(self) -> list[dict[str, Any]]:
        """Checkpoint the trainer's current state; the measurements of the checkpoints finished meanwhile.

        A write that fails on any rank with an OSError (a full disk) costs this checkpoint only: every rank learns
        it, rank 0 removes the partial folder, the measurement says why under ``error``, and training goes on."""
        finished = self.finish()
        start = time.perf_counter()
        trainer = self.trainer
        tmp = os.path.join(self.directory, checkpoint_name(trainer.step) + TMP_SUFFIX)
        error = None
        if trainer.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by an attempt that died while writing it
            error = _write_error(os.makedirs, tmp)
        dist.barrier()
        state = TrainingState(trainer)
        error = error or _write_error(_write_run_state, trainer, tmp)
        record: dict[str, Any] = {"step": trainer.step, "path": tmp.removesuffix(TMP_SUFFIX)}
        if self.group is None:
            written = _write_error(dcp.save, state.flat, checkpoint_id=tmp)  # collective: every rank calls it
            error = error or written
            self._end(tmp, record, self._agreed(error))
            dist.barrier()
            record["seconds"] = time.perf_counter() - start
            return finished + [record]
        error = self._agreed(error)
        if error is not None:  # no rank starts the shards' write: the async save's collectives stay paired
            self._end(tmp, record, error)
            record["seconds"] = time.perf_counter() - start
            return finished + [record]
        future = dcp.async_save(state.flat, checkpoint_id=tmp, process_group=self.group)
        marked = threading.Event()
        future.add_done_callback(lambda f: self._on_written(f, tmp, record, marked))
        record["seconds"] = time.perf_counter() - start
        self._pending = (future, record, marked)
        return finished

    def finish(self) -> list[dict[str, Any]]:
        """Wait for an overlapped save still being written; its measurements ([] when there is none)."""
        if self._pending is None:
            return []
        future, record, marked = self._pending
        self._pending = None
        start = time.perf_counter()
        marked.wait()
        if future.exception() is not None and not _only_oserrors(future.exception()):
            future.result()
        dist.barrier()
        record["seconds"] += time.perf_counter() - start
        return [record]

    def _on_written(self, future: Any, tmp: str, record: dict[str, Any], marked: threading.Event) -> None:
        """An overlapped save's write returned (in DCP's thread; DCP made every rank see the same outcome):
        complete it, or remove it if a write failed with an OSError; another error is raised by ``finish``."""
        try:
            error = future.exception()
            if error is None or _only_oserrors(error):
                self._end(tmp, record, error and _error_line(error))
        finally:
            marked.set()

    def _agreed(self, error: str | None) -> str | None:
        """The first rank's write error, on every rank (None when every rank's writes worked)."""
        errors: list[str | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(errors, error, group=self.group)
        return next((e for e in errors if e is not None), None)

    def _end(self, tmp: str, record: dict[str, Any], error: str | None) -> None:
        """Rank 0: complete the written checkpoint ``tmp``, or remove it if a write failed on some rank (then
        ``record["error"]`` says why)."""
        if self.trainer.rank != 0:
            return
        error = error or _write_error(self._complete, tmp, record)
        if error is not None:
            record["error"] = error
            shutil.rmtree(tmp, ignore_errors=True)

    def _complete(self, tmp: str, record: dict[str, Any]) -> None:
        """Every rank has written ``tmp``: measure it, mark it complete, prune older checkpoints."""
        record["bytes"] = _folder_bytes(tmp)
        mark_complete(tmp)
        if self.keep_last is not None:
            prune(self.directory, self.keep_last)


def _write_error(write: Any, *args: Any, **kwargs: Any) -> str | None:
    """None if ``write(*args, **kwargs)`` worked; the OSError it raised (directly or on some rank of a DCP
    collective) in one line. Other errors propagate."""
    try:
        write(*args, **kwargs)
    except (OSError, CheckpointException) as e:
        if not _only_oserrors(e):
            raise
        return _error_line(e)
    return None


def _only_oserrors(error: BaseException) -> bool:
    """An OSError, or a DCP CheckpointException every rank's failure of which is an OSError."""
    if isinstance(error, CheckpointException):
        return all(isinstance(cause, OSError) for cause, _ in error.failures.values())
    return isinstance(error, OSError)


def _error_line(error: BaseException) -> str:
    """One line for ``_only_oserrors``' errors: the OSError's (the first failed rank's, for DCP's)."""
    if isinstance(error, CheckpointException):
        rank, (error, _) = min(error.failures.items(), key=lambda item: item[0])
        return f"rank {rank}: {' '.join(str(error).split())}"
    return " ".join(str(error).split()) or type(error).__name__


def _folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))


def shards_problem(path: str) -> str | None:
    """What is wrong with a checkpoint's DCP shards, or None: its ``.metadata`` must read, and every file it
    points into must hold the bytes it points at (a truncated or missing shard is found; flipped bytes are not)."""
    try:
        metadata = read_metadata(path)
    except UnsafeCheckpoint as e:
        return f"its DCP metadata is refused: {e}"
    except Exception as e:  # a truncated pickle raises any of several errors
        return f"its DCP metadata cannot be read ({type(e).__name__}: {' '.join(str(e).split())})"[:300]
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        if os.path.basename(name) != name or name in ("", ".", ".."):
            return f"its DCP metadata points outside the checkpoint folder ({name!r})"
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"its shard {name} is missing"
        if os.path.getsize(file) < end:
            return f"its shard {name} is truncated ({os.path.getsize(file)} bytes, the metadata needs {end})"
    return None


def checkpoint_problem(path: str) -> str | None:
    """What is wrong with a complete checkpoint's run state or shards, or None."""
    return run_state_problem(path) or shards_problem(path)


def load_checkpoint(trainer: Any, path: str) -> None:
    """Load a complete checkpoint (written under any plan of the same model) into the trainer's materialised
    shards, optimizers, LR schedules, counters and RNG states (collective: every rank calls it).

    Raises:
        UnsafeCheckpoint: its metadata names what a DCP metadata file never holds (before any rank loads).
    """
    read_metadata(path)  # a refusal as one ValueError, not wrapped in DCP's collective error
    state = TrainingState(trainer)
    dcp.load(state.flat, storage_reader=SafeFileSystemReader(path))
    state.restore()
    trainer.load_state_dict(read_run_state(path))
    for name, (optimizer, schedule) in trainer.optimizers.items():
        saved = read_json(os.path.join(path, schedule_file(name)), kind="LR schedule state")
        schedule.load_state_dict(schedule_state_for(saved, len(optimizer.param_groups)))
        for group, lr in zip(optimizer.param_groups, schedule.get_last_lr()):
            group["lr"] = lr
    rng = os.path.join(path, rng_file(trainer.rank))
    if os.path.isfile(rng):
        states = torch.load(rng, weights_only=True)
        torch.set_rng_state(states["cpu"])
        if "cuda" in states and trainer.device.type == "cuda":
            torch.cuda.set_rng_state(states["cuda"])


PER_GROUP_SCHEDULE_STATE = ("base_lrs", "_last_lr", "lr_lambdas")
"""What an LR schedule's state holds once per parameter group (torch's ``LambdaLR``)."""


def schedule_state_for(state: dict, groups: int) -> dict:
    """A module's saved LR-schedule state for an optimizer of ``groups`` parameter groups: its groups share one
    learning rate and warm-up, and a plan that splits its parameters otherwise has another count of groups
    (``runtime.training.optim.same_kind_groups``), so each group takes the first saved group's values."""
    return {k: [v[0]] * groups if k in PER_GROUP_SCHEDULE_STATE and isinstance(v, list) and v else v
            for k, v in state.items()}


class Unfilled:
    """A tensor source for ``runtime.checkpoints.hf_folder.materialize`` that leaves the shards' values unset: a resumed
    run gives its shards storage, then ``load_checkpoint`` fills them (no random init first)."""

    def read(self, hf_name: str, index: tuple[slice, ...], shape: torch.Size) -> torch.Tensor:
        sizes = [s.indices(n)[1] - s.indices(n)[0] for s, n in zip(index, shape)] + list(shape[len(index):])
        return torch.empty(sizes)

