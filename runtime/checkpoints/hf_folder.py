"""Weights in and out of a rank's shards, with no process ever holding the whole model.

- ``materialize``: a module built and sharded on the ``meta`` device gets storage for its local shards only,
  filled from a source (``RandomInit`` in runtime.models.model, or ``HFFolder``) that hands out one slice at a time.
- ``HFFolder``: a Hugging Face folder as ``save_pretrained`` writes it or as downloaded from the Hub
  (``model.safetensors.index.json`` + ``model-0000k-of-0000n.safetensors``, or one ``model.safetensors``), read
  with safetensors' lazy slicing: a rank reads exactly the rows and columns it holds, in the stored dtype, and
  converts them to the plan's.
- ``save_hf_folder``: the same format, written by the ranks from their shards. Each file belongs to one rank of
  the module whose tensors it holds; tensors are gathered one at a time (``DTensor.full_tensor``) and only the
  file's owner keeps them, so a rank holds at most one file's tensors (``max_file_bytes``) plus one tensor.

A parameter's *stored* layout equals the HF layout except for row orders a parallelism chose (the vision qkv
under TP, runtime.parallel.tensor_parallel): ``row_order`` gives the HF row of each stored row.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers.utils import CONFIG_NAME

from planner.contract.file_io import read_json, write_output

INDEX_FILE = "model.safetensors.index.json"
"""Index of a sharded HF checkpoint: tensor name -> file."""

SINGLE_FILE = "model.safetensors"
"""An unsharded HF checkpoint."""

MAX_FILE_BYTES = 1 << 30
"""Default size cap of one written safetensors file (bounds what its owner holds while saving)."""

RowOrder = Callable[[str, int], "torch.Tensor | None"]
"""(local parameter name, rows) -> HF row of each stored row, or None when stored as in HF."""


class TensorSource(Protocol):
    """Where initial weights come from, one slice at a time."""

    def read(self, hf_name: str, index: tuple[slice, ...], shape: torch.Size) -> torch.Tensor:
        """Slice ``index`` (HF layout) of tensor ``hf_name``, whose full shape must be ``shape``."""


LEGACY_PREFIXES = (
    ("model.visual.", "visual."), ("model.language_model.", "model."),
    ("model.audio_tower.", "audio_tower."), ("model.multi_modal_projector.", "multi_modal_projector."),
    ("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
)
"""(transformers 5 prefix, the prefix before it): Qwen-VL's ``visual.*`` / ``model.*``, Qwen2-Audio's
``audio_tower.*`` / ``multi_modal_projector.*`` / ``language_model.model.*`` / ``language_model.lm_head.*`` (the Hub's
uploads, and what transformers 5 still writes for Qwen2-Audio)."""


TRANSPOSED_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")
"""Fused expert weights the Hub's Qwen3-VL-MoE files hold transposed (``[E, in, out]``, transformers 4.57's layout):
read transposed where the stored shape is the model's with its last two dims swapped (transformers 5's
``conversion_mapping`` rule for ``qwen3_vl_moe``, ``Transpose(1, 2, check_dims=True)``: a square one is taken as
stored)."""


def legacy_names(hf_name: str) -> list[str]:
    """The names tensor ``hf_name`` may have in checkpoints written before transformers 5 (``LEGACY_PREFIXES``)."""
    return [old + hf_name.removeprefix(new) for new, old in LEGACY_PREFIXES if hf_name.startswith(new)]


def weight_map(index: str) -> dict[str, str]:
    """The ``weight_map`` of the index file ``index`` (tensor name -> shard file name).

    Raises:
        ValueError: the file does not read, is not JSON (``read_json`` names it) or holds no such mapping; one line.
    """
    document = read_json(index, kind="weight index")
    found = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(found, dict) or not all(isinstance(v, str) for v in found.values()):
        raise ValueError(f"weight index {index} holds no \"weight_map\" of tensor names to file names: "
                         "not a Hugging Face index (fetch the folder again)")
    return found


class HFFolder:
    """A Hugging Face checkpoint folder, read lazily slice by slice."""

    def __init__(self, path: str):
        """Raises ValueError: ``path`` holds neither an index nor a single safetensors file."""
        self.path = path
        index = os.path.join(path, INDEX_FILE)
        if os.path.isfile(index):
            self.weight_map: dict[str, str] = weight_map(index)
        elif os.path.isfile(os.path.join(path, SINGLE_FILE)):
            try:
                with safe_open(os.path.join(path, SINGLE_FILE), framework="pt") as f:
                    self.weight_map = dict.fromkeys(f.keys(), SINGLE_FILE)
            except (OSError, SafetensorError) as e:
                raise ValueError(f"cannot read {os.path.join(path, SINGLE_FILE)}: {' '.join(str(e).split())} (a "
                                 "corrupt or incomplete download? fetch the file again)") from None
        else:
            raise ValueError(f"checkpoint {path} has neither {INDEX_FILE} nor {SINGLE_FILE}: not a Hugging Face folder")

    def read(self, hf_name: str, index: tuple[slice, ...], shape: torch.Size) -> torch.Tensor:
        """Slice ``index`` of tensor ``hf_name`` in its stored dtype; only that slice is read from disk.

        Raises:
            ValueError: the folder lacks the tensor, or holds it with another shape than ``shape``.
        """
        name = next((n for n in (hf_name, *legacy_names(hf_name)) if n in self.weight_map), None)
        if name is None:
            raise ValueError(f"checkpoint {self.path} has no tensor {hf_name}: was it saved from this model?")
        file = os.path.join(self.path, self.weight_map[name])
        try:
            with safe_open(file, framework="pt") as f:
                stored = f.get_slice(name)
                stored_shape = list(stored.get_shape())
                if TRANSPOSED_EXPERTS.search(name) and stored_shape == [shape[0], shape[2], shape[1]] != list(shape):
                    return stored[index[0], index[2], index[1]].transpose(1, 2)
                if stored_shape != list(shape):
                    raise ValueError(f"checkpoint {self.path} holds {hf_name} with shape {stored.get_shape()}, the "
                                     f"plan's model has {list(shape)}: a checkpoint of another model size?")
                return stored[index]
        except (OSError, SafetensorError) as e:
            raise ValueError(f"cannot read {hf_name} from {file}: {' '.join(str(e).split())} (a corrupt or "
                             "incomplete download? fetch the file again)") from None

def local_region(tensor: torch.Tensor) -> tuple[slice, ...]:
    """The part of the full (stored-layout) tensor this rank holds: everything, or a DTensor's local shard."""
    if isinstance(tensor, DTensor):
        shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    else:
        shape, offset = tuple(tensor.shape), (0,) * tensor.dim()
    return tuple(slice(start, start + size) for start, size in zip(offset, shape))


def read_region(
    source: TensorSource, hf_name: str, shape: torch.Size, region: tuple[slice, ...], rows: torch.Tensor | None
) -> torch.Tensor:
    """``region`` of a tensor of full ``shape`` in stored layout: with a row order, one read per contiguous run
    of HF rows."""
    if rows is None:
        return source.read(hf_name, region, shape)
    hf_rows = rows[region[0]].tolist()
    runs, start = [], 0
    for i in range(1, len(hf_rows) + 1):
        if i == len(hf_rows) or hf_rows[i] != hf_rows[i - 1] + 1:
            runs.append(slice(hf_rows[start], hf_rows[i - 1] + 1))
            start = i
    return torch.cat([source.read(hf_name, (run, *region[1:]), shape) for run in runs])


def _shared_parameters(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """(owner module, attribute) of every parameter held under more than one name (tied weights)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for sub in module.modules():
        for attr, param in sub._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((sub, attr))
    return [h for h in holders.values() if len(h) > 1]


@torch.no_grad()
def materialize(
    module: nn.Module,
    *,
    hf_name: Callable[[str], str],
    params: TensorSource,
    buffers: TensorSource,
    device: torch.device,
    row_order: RowOrder | None = None,
) -> None:
    """Give a meta-device (possibly sharded) module storage for its local shards on ``device`` and fill them.

    Args:
        module: built on ``meta``, TP / FSDP already applied.
        hf_name: HF name of a parameter or buffer name of ``module``.
        params: source of the parameters (random init or a checkpoint).
        buffers: source of the buffers (non-persistent: always the model's own init).
        device: where the shards live (in the dtypes the meta module has: values are converted).
        row_order: stored row orders other than HF's.
    """
    ties = _shared_parameters(module)
    module.to_empty(device=device)
    for holders in ties:  # to_empty gives each holder its own tensor: share the first one again
        first = getattr(*holders[0])
        for sub, attr in holders[1:]:
            setattr(sub, attr, first)
    for name, param in module.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        if local.numel() == 0:  # a shard of a dimension smaller than the mesh
            continue
        region = local_region(param)
        rows = row_order(name, param.shape[0]) if row_order is not None else None
        local.copy_(read_region(params, hf_name(name), param.shape, region, rows))
    for name, buffer in module.named_buffers():
        buffer.copy_(buffers.read(hf_name(name), local_region(buffer), buffer.shape))


@dataclass(kw_only=True, frozen=True)
class FilePlan:
    """One safetensors file of a saved folder."""

    name: str
    """File name, ``model-0000k-of-0000n.safetensors``."""
    owner: int
    """Global rank that writes it."""
    tensors: tuple[str, ...]
    """HF names of its tensors, in order."""


def plan_files(
    tensors: dict[str, list[tuple[str, int]]], ranks: dict[str, tuple[int, ...]], max_file_bytes: int
) -> list[FilePlan]:
    """Split each module's tensors (HF name, bytes) into consecutive files of at most ``max_file_bytes`` (one
    tensor at least), owned in turn by the module's ranks; the same on every rank."""
    groups: list[tuple[str, list[str]]] = []
    for module_name, entries in tensors.items():
        current, size = [], 0
        for name, nbytes in entries:
            if current and size + nbytes > max_file_bytes:
                groups.append((module_name, current))
                current, size = [], 0
            current.append(name)
            size += nbytes
        if current:
            groups.append((module_name, current))
    files, count = [], {name: 0 for name in tensors}
    for index, (module_name, names) in enumerate(groups, start=1):
        owners = ranks[module_name]
        files.append(FilePlan(name=f"model-{index:05d}-of-{len(groups):05d}.safetensors",
                              owner=owners[count[module_name] % len(owners)], tensors=tuple(names)))
        count[module_name] += 1
    return files


def save_hf_folder(trainer: Any, path: str, *, dtype: torch.dtype | None = None,
                   max_file_bytes: int = MAX_FILE_BYTES) -> None:
    """Write the trainer's weights as a Hugging Face folder (``from_pretrained`` and ``--checkpoint`` load it).

    Collective: every rank of the world calls it. Each module's (or pipeline stage's) ranks gather its tensors one
    at a time, each file's owner keeps and writes its own into ``path/.saving`` (``STAGING``); then rank 0 writes
    the index and ``config.json`` there and replaces the folder's model with them (``replace_model``): a folder
    that already held a model (``--checkpoint hf --save hf``) ends with the new one alone, never two.

    Args:
        trainer: a runtime.training.trainer.Trainer.
        path: the folder (created).
        dtype: dtype of the written tensors (default: the parameters' own, so a reload is exact).
        max_file_bytes: size cap of one file (one tensor at least).
    """
    parts = trainer.tensor_parts()
    specs = {m: [(name, shape, dtype or own) for name, shape, own in entries] for m, (_, entries) in parts.items()}
    dtypes = {name: dt for entries in specs.values() for name, _, dt in entries}
    sizes = {m: [(name, shape.numel() * dt.itemsize) for name, shape, dt in entries] for m, entries in specs.items()}
    files = plan_files(sizes, {m: ranks for m, (ranks, _) in parts.items()}, max_file_bytes)
    mine = {name: f for f in files if f.owner == trainer.rank for name in f.tensors}
    staging = os.path.join(path, STAGING)
    failure = _attempt(os.makedirs, staging, exist_ok=True)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for module_name in trainer.modules:
        for name, tensor in trainer.iter_full_tensors(module_name, "param"):  # collective: every rank keeps going
            file = mine.get(name)
            if file is None:
                continue
            kept = pending.setdefault(file.name, {})
            kept[name] = tensor.to(dtypes[name]).contiguous()
            if len(kept) == len(file.tensors):
                tensors = pending.pop(file.name)
                failure = failure or _attempt(save_file, tensors, os.path.join(staging, file.name),
                                              metadata={"format": "pt"})
    assert not pending, f"incomplete files: {sorted(pending)}"
    _raise_if_any_rank_failed(failure, trainer.device)
    if trainer.rank == 0:  # last, once every rank's files are written: a folder without them is never loadable
        total = sum(nbytes for entries in sizes.values() for _, nbytes in entries)
        weight_map = {name: f.name for f in files for name in f.tensors}
        failure = _attempt(write_index, staging, total, weight_map)
        failure = failure or _attempt(write_output, os.path.join(staging, CONFIG_NAME),
                                      trainer.hf_config().to_json_string(use_diff=True), flag="--save")
        failure = failure or _attempt(replace_model, path, [f.name for f in files])
    _raise_if_any_rank_failed(failure, trainer.device)


STAGING = ".saving"
"""Sub-folder of a ``--save`` folder that the new model is written into before it replaces the folder's model."""

OLD_WEIGHTS = (SINGLE_FILE, INDEX_FILE, "pytorch_model.bin", "pytorch_model.bin.index.json")
"""The weight and index files of a model saved by ``save_pretrained`` (safetensors, or the older pickled format)."""

_SHARD = re.compile(r"^(model|pytorch_model)-\d{5}-of-\d{5}\.(safetensors|bin)$")
"""A shard file of a sharded ``save_pretrained`` model."""


def replace_model(path: str, shards: list[str]) -> None:
    """Move the model written into ``path/STAGING`` (``shards``, the index and config.json) into ``path``, after
    removing the weights of the model already there: its index first (a folder caught half way has none, so it
    loads nothing rather than a mix), its single-file weights and every shard. Other files (a tokenizer) stay."""
    staging = os.path.join(path, STAGING)
    stale = [n for n in os.listdir(path) if n in OLD_WEIGHTS or _SHARD.match(n)]
    for name in sorted(stale, key=lambda n: not n.endswith(".index.json")):
        os.remove(os.path.join(path, name))
    for name in [*shards, CONFIG_NAME, INDEX_FILE]:  # the index last: the weights it names are in place first
        os.replace(os.path.join(staging, name), os.path.join(path, name))
    shutil.rmtree(staging, ignore_errors=True)


def _attempt(write: Callable[..., Any], *args: Any, **kwargs: Any) -> str | None:
    """Run one write of a save; None if it worked, else the error in one line (the save goes on: its gathers are
    collective, so a rank that stopped would leave the others waiting)."""
    try:
        write(*args, **kwargs)
    except (OSError, SafetensorError) as e:
        return " ".join(str(e).split()) or type(e).__name__
    return None


def write_index(path: str, total: int, weight_map: dict[str, str]) -> None:
    """A saved folder's index (tensor name -> file), written through a temporary file renamed into place."""
    write_output(os.path.join(path, INDEX_FILE),
                 json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2), flag="--save")


def _raise_if_any_rank_failed(failure: str | None, device: torch.device) -> None:
    """Raise OSError on every rank if a write failed on any, so that all of them can retry elsewhere together."""
    failed = torch.tensor(float(failure is not None), device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item():
        raise OSError(failure or "a write failed on another rank")
