"""A clip split over a vision SP group is priced as the runtime splits it (issue 46, item 4: balanced video).

The runtime's Ulysses SP splits a replica's patches in whole merge units (Qwen3-VL has no attention windows;
``runtime.parallel.windows.window_layout``, ``runtime.parallel.ulysses.split_windows``), not in whole frames or
temporal groups, and every rank attends every group on its share of the heads: each rank holds an equal share of a
clip's tokens (to one merge unit) and of its attention work. The cost model prices ``tokens / (sp * cp)`` a rank
(``planner.cost.rank_cost``), which is that split, so no uneven (ceil of groups per rank) term is needed.
"""

from types import SimpleNamespace

import torch

from planner.api import make_problem
from planner.contract.strategy import ModuleStrategy
from planner.cost.rank_cost import _shard, module_static
from planner.inputs import WorkloadInputs
from runtime.parallel.ulysses import split_windows
from runtime.parallel.windows import window_layout


def test_a_clip_of_three_temporal_groups_over_sp2_is_priced_as_the_runtime_splits_it():
    """Qwen3-VL-8B, a 6-frame 128x128 clip: 3 temporal groups of 8 x 8 = 64 patches (16-pixel patches), 192 in
    all, 48 merge units of 4. By hand: the runtime gives each of 2 SP ranks 24 units, 96 patches; whole groups per
    rank would give the busiest ceil(3 / 2) = 2 groups, 128 patches. The cost model prices 192 / 2 = 96."""
    problem = make_problem("qwen3-vl-8b", 8, workload=WorkloadInputs(videos=[(6, 128, 128)], global_batch=8))
    static = module_static(problem.model, "vision", problem.workload, problem.cluster, problem.assumptions)
    assert static.tokens.segments == (64, 64, 64)
    shard = _shard(static, ModuleStrategy(dp=4, sp=2), (static.links[0],) * 4)
    grid_thw = torch.tensor([[3, 8, 8]])
    _, cu_units = window_layout(grid_thw, SimpleNamespace(spatial_merge_size=2))
    bounds = split_windows(cu_units, 2)
    assert bounds == [0, 96, 192]
    assert shard.tokens == max(b - a for a, b in zip(bounds[:-1], bounds[1:])) == 96
    assert shard.segments == 3 and shard.segment_tokens == 64  # each rank attends all three groups, heads / 2
