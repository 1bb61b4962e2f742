"""Roles: ranks that run the same code on tensors of the same shapes, so need the same memory."""

from __future__ import annotations

from typing import Any

import torch

from planner.contract.schema import Plan
from runtime.data.samples import SampleLayout
from runtime.models.families import family_of
from runtime.models.model import hf_config_from_dict
from runtime.parallel.windows import window_layout
from runtime.parallel.parallel_dims import plan_dims
from runtime.models.llm import sequence_positions
from runtime.parallel.ulysses import split_windows
from runtime.run.preflight import module_names


def _slice_lengths(plan: Plan, name: str, layout: SampleLayout, config: Any) -> list[int]:
    """Sequence positions each sequence rank (CP rank ``c``'s SP rank ``j``: ``c * sp + j``) of module ``name`` holds
    per micro-batch."""
    dims = plan_dims(plan, name)
    if name == "llm":
        return [len(held) for held in sequence_positions(layout.seq_len, dims.sp, dims.cp)]
    _, cu_windows = window_layout(torch.tensor(layout.grids() * dims.micro_batch), config.vision_config)
    bounds = split_windows(cu_windows, dims.sequence_ranks)
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def role_keys(plan: Plan) -> dict[int, tuple]:
    """Each rank's role: per module it holds, (module, the length of its sequence slice, its pipeline stage)."""
    config = hf_config_from_dict(plan.model.hf_config)
    layout = family_of(config).encoder.layout_from_plan(plan.workload, config)
    lengths = {name: _slice_lengths(plan, name, layout, config) for name in module_names(plan)}
    dims = {name: plan_dims(plan, name) for name in module_names(plan)}
    keys = {}
    for rank in sorted({r for m in plan.modules for r in m.ranks}):
        key = []
        for name in module_names(plan):
            if rank in dims[name].ranks:
                key.append((name, lengths[name][dims[name].sequence_rank(rank)], dims[name].coordinate(rank)["pp"]))
        keys[rank] = tuple(key)
    return keys


def roles(plan: Plan) -> dict[int, list[int]]:
    """The lowest rank of each role -> all ranks of that role. The lowest rank has TP coordinate 0: it is the one
    that sends the hand-off and the hand-back (the copies it sends are extra memory; its TP peers hold none)."""
    groups: dict[tuple, list[int]] = {}
    for rank, key in role_keys(plan).items():
        groups.setdefault(key, []).append(rank)
    return {ranks[0]: ranks for ranks in groups.values()}
