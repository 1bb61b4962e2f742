"""The model read back whole from a rank's shards: unsharded tensors in Hugging Face layout under their HF names,
what a saved folder holds, and its config (runtime.checkpoints.hf_folder.save_hf_folder writes them; tests compare them).
Gathering is collective: every rank of a module calls these together.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig

from runtime.models.model import hf_config_from_dict, split_model
from runtime.run.preflight import module_names
from runtime.models.pipeline import stage_of_parameter
from runtime.training.rank_model import RankModel

TensorParts = dict[str, tuple[tuple[int, ...], list[tuple[str, torch.Size, torch.dtype]]]]
"""Part (a module, or a pipeline stage of one) -> (the ranks that hold it, its (HF name, full shape, dtype)s)."""


def iter_full_tensors(model: RankModel, module_name: str, kind: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, unsharded tensor in HF layout on CPU) of each parameter (``kind="param"``) or gradient (``"grad"``)
    of a module this rank holds, one at a time: collective over the module's ranks, and no rank holds more than one
    unsharded tensor at once."""
    module = model.modules[module_name]
    for local_name, param in module.named_parameters():
        tensor = param if kind == "param" else param.grad
        if tensor is None:
            continue
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        order = model.row_order(module_name, local_name, tensor.shape[0])
        if order is not None:  # stored row i is HF row order[i]
            tensor = tensor[torch.argsort(order)]
        yield module.hf_name(local_name), tensor.detach().cpu()


def full_tensors(model: RankModel, kind: str) -> dict[str, torch.Tensor]:
    """Unsharded parameters (``kind="param"``) or gradients (``"grad"``) under their HF names, on CPU, fp32.

    Every rank of a module must call this (gathering is collective); the module's first rank (of each pipeline
    stage) returns them.
    """
    out = {}
    for name in model.modules:
        dims = model.dims[name]
        first = dims.ranks[dims.stage_of(model.rank) * dims.stage_devices]
        for hf_name, tensor in iter_full_tensors(model, name, kind):
            if model.rank == first:
                out[hf_name] = tensor.float().clone()
    return out


def tensor_parts(model: RankModel) -> TensorParts:
    """Every parameter of every module, held here or not (tied weights once), as (HF name, full shape, dtype) in
    ``iter_full_tensors`` order, by the ranks that hold it: each module's, or each pipeline stage's of a pipelined
    one. What a saved checkpoint holds."""
    encoder, llm, _ = split_model(model.init.meta)
    parts = {}
    for name, module in zip(module_names(model.plan), (encoder, llm)):
        dims = model.dims[name]
        dtype = model.precision[name].param_dtype
        entries = [(module.hf_name(n), p.shape, dtype) for n, p in module.named_parameters()]
        if not dims.pp_enabled:
            parts[name] = (dims.ranks, entries)
            continue
        for stage in range(dims.pp):
            mine = [e for e in entries if stage_of_parameter(e[0], dims) == stage]
            parts[f"{name}.stage{stage}"] = (dims.stage_view(stage).ranks, mine)
    return parts


def saved_hf_config(hf_config: dict) -> PretrainedConfig:
    """The model's transformers config, as a saved checkpoint's ``config.json`` has it."""
    config = hf_config_from_dict(hf_config)
    config._attn_implementation = None
    return config
