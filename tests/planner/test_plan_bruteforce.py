"""CP-SAT (with candidate pruning) finds the same optimum as trying every strategy combination.

Coverage: the tiny model on 2, 4 (with and without ring CP in the space, CP costed on demand as ``plan`` does, with
pipeline parallelism in it, and on
packs of a mixed-resolution dataset) and 8 CPU "GPUs" (with and without pipeline parallelism) and Qwen2.5-VL-32B on 4 H200 (bf16 pure) and 8 H100, both
placements, and the tiny Qwen3-VL-MoE (expert parallelism in the space: on 4 CPU "GPUs", and on 2 nodes of 2 with
pipeline parallelism; Qwen3-VL-30B-A3B on 8 H100 colocated with the LLM's ep pinned), with the memory limit loose and tightened below the unconstrained optimum's peak (so that memory
binds). Brute force enumerates every integer grid, ZeRO stage, recompute mode and micro-batch that
``check_strategy`` accepts (and, disjoint, every split of the GPUs) and costs each pair with ``cost.estimate``.
"""

from functools import lru_cache

import pytest
from plan_helpers import brute_force, problem, with_usable_memory

from planner.api import plan
from planner.search import solve_strategies
from planner.search.candidates import build_candidates
from planner.cost import estimate
from planner.search.solver.cp_sat import solve

pytestmark = pytest.mark.slow  # each exhausts a strategy space: seconds apiece, left out of ``make test-fast``

ROUNDING_S = 2e-9
"""The solver's integer nanoseconds round each of at most four terms by 0.5 ns."""

TINY = dict(model="qwen2.5-vl-tiny", device="cpu", overhead_gib=0.0)
CASES = {
    "tiny-2gpu": dict(TINY, gpus=2, batch=4),
    "tiny-4gpu": dict(TINY, gpus=4, batch=4),
    "tiny-4gpu-cp": dict(TINY, gpus=4, batch=4, allow_ring_cp=True),
    "tiny-4gpu-cp-long": dict(TINY, gpus=4, batch=2, text=1024, allow_ring_cp=True),
    "tiny-8gpu": dict(TINY, gpus=8, batch=8),
    "tiny-4gpu-packed": dict(TINY, gpus=4, batch=4, packed=True),
    "tiny-4gpu-pp": dict(TINY, gpus=4, batch=8, allow_pp=True),
    "tiny-4gpu-packed-pp": dict(TINY, gpus=4, batch=8, packed=True, allow_pp=True),
    "tiny-8gpu-pp": dict(TINY, gpus=8, batch=16, allow_pp=True),
    "moe-tiny-4gpu": dict(TINY, model="qwen3-vl-moe-tiny", gpus=4, batch=4),
    "moe-tiny-4gpu-2nodes-pp": dict(TINY, model="qwen3-vl-moe-tiny", gpus=4, batch=8, gpus_per_node=2, allow_pp=True),
    "moe-30b-h100-8gpu": dict(model="qwen3-vl-30b-a3b", device="h100-80gb", gpus=8, batch=8, image=448, text=256),
    "32b-h200-4gpu-pure": dict(model="qwen-vl-32b", device="h200-141gb", gpus=4, batch=4, image=448, text=128,
                               precision="bf16_pure"),
    "32b-h200-4nodes-pp": dict(model="qwen-vl-32b", device="h200-141gb", gpus=4, batch=4, image=448, text=128,
                               precision="bf16_pure", gpus_per_node=1, allow_pp=True),  # the optimum pipelines
    "32b-h100-8gpu": dict(model="qwen-vl-32b", device="h100-80gb", gpus=8, batch=8, image=896, text=256),
}
FAST = ["tiny-2gpu", "tiny-4gpu", "tiny-4gpu-cp", "tiny-4gpu-packed", "tiny-4gpu-pp", "tiny-4gpu-packed-pp",
        "32b-h200-4gpu-pure", "moe-tiny-4gpu", "moe-tiny-4gpu-2nodes-pp"]
SLOW = ["tiny-8gpu", "tiny-8gpu-pp", "32b-h100-8gpu"]


@lru_cache(maxsize=None)
def _unconstrained(case, placement):
    p = problem(**CASES[case])
    return p, brute_force(p, placement)


@pytest.mark.parametrize("placement", ["colocated", "disjoint"])
@pytest.mark.parametrize("fraction", [None, 0.95, 0.8])
def test_same_optimum_when_the_optimum_pipelines(placement, fraction):
    """One GPU per node: PP sends activations where ZeRO gathers weights over the NIC, and the optimum pipelines the
    LLM in either placement (disjoint: the vision tower on its own GPU feeding stage 0)."""
    p, (step, best) = _unconstrained("32b-h200-4nodes-pp", placement)
    assert best.modules["llm"].pp > 1
    if fraction is None:
        _check(p, placement, (step, best))
    else:
        _check_tightened("32b-h200-4nodes-pp", placement, fraction)


def test_same_optimum_with_sp_pinned_inside_pipeline_stages():
    """``--fix llm.sp=2`` with PP in the space, one GPU per node: Ulysses SP inside pipeline stages joins the
    search, and the optimum (which pipelines the LLM) is brute force's over every LLM strategy with sp=2
    (colocated: on 4 GPUs a disjoint LLM has no room for PP2 x SP2)."""
    p = problem(**CASES["32b-h200-4nodes-pp"])
    expected = brute_force(p, "colocated", llm_sp=2)
    assert expected[1].modules["llm"].pp > 1
    _check(p, "colocated", expected, fixes={"llm": {"sp": 2}})


def _check(p, placement, expected, fixes=None):
    sols = solve(build_candidates(p, placement, fixes), p.num_gpus, p.usable_bytes - p.overhead_bytes)
    if expected is None:
        assert sols == []
        return
    assert sols, f"brute force found {expected[0]} s but the solver found nothing"
    assert sols[0].objective_ns / 1e9 == pytest.approx(expected[0], abs=ROUNDING_S)


def _check_tightened(case, placement, fraction):
    """Usable memory set to ``fraction`` of the unconstrained optimum's peak, so that memory binds."""
    p, best = _unconstrained(case, placement)
    assert best is not None
    peak = estimate(p.model, p.cluster, p.workload, best[1], p.assumptions).peak_memory_bytes
    tight = with_usable_memory(p, int(peak * fraction))
    expected = brute_force(tight, placement)
    if expected is not None:
        assert expected[0] >= best[0]
    _check(tight, placement, expected)


@pytest.mark.parametrize("placement", ["colocated", "disjoint"])
@pytest.mark.parametrize("case", FAST)
def test_same_optimum_as_brute_force(case, placement):
    p, expected = _unconstrained(case, placement)
    assert expected is not None
    _check(p, placement, expected)


@pytest.mark.parametrize("placement", ["colocated", "disjoint"])
@pytest.mark.parametrize("case,fraction", [("tiny-4gpu", 0.6), ("tiny-4gpu-packed", 0.6), ("tiny-4gpu-pp", 0.6),
                                           ("32b-h200-4gpu-pure", 0.9), ("moe-tiny-4gpu", 0.6)])
def test_same_optimum_when_memory_binds(case, placement, fraction):
    _check_tightened(case, placement, fraction)


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["colocated", "disjoint"])
@pytest.mark.parametrize("case", SLOW)
def test_same_optimum_as_brute_force_larger(case, placement):
    p, expected = _unconstrained(case, placement)
    _check(p, placement, expected)


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["colocated", "disjoint"])
@pytest.mark.parametrize("case,fraction", [("tiny-4gpu", 0.9), ("tiny-8gpu", 0.7), ("32b-h200-4gpu-pure", 0.6)])
def test_same_optimum_when_memory_binds_more(case, placement, fraction):
    _check_tightened(case, placement, fraction)


@pytest.mark.parametrize("placement", ["colocated", "disjoint"])
@pytest.mark.parametrize("case", ["tiny-4gpu-pp", "32b-h200-4nodes-pp"])
def test_pipelined_strategies_costed_on_demand_give_both_sides_of_pp(case, placement):
    """``plan`` costs a pipelined strategy only once its floor is within a plan already found: the plan is brute
    force's optimum, and its reference row (``with_pp`` or ``without_pp``) the brute-force optimum of the other
    side (tiny: the optimum does not pipeline, so the best pipelined plan takes raising the limit; 32B on one GPU
    per node: it does)."""
    p = problem(**CASES[case])
    sides = {pipelined: brute_force(p, placement, pipelined=pipelined) for pipelined in (False, True)}
    chosen = plan(p, placement=placement)
    pipelines = chosen.module("llm").pp > 1
    assert chosen.predicted.step_time_s == pytest.approx(sides[pipelines][0], abs=ROUNDING_S)
    other, expected = chosen.baselines["without_pp" if pipelines else "with_pp"], sides[not pipelines]
    if expected is None:  # 32B disjoint: without PP the LLM does not fit its 3 GPUs
        assert other.infeasible and other.step_time_s is None
    else:
        assert other.step_time_s == pytest.approx(expected[0], abs=ROUNDING_S) and expected[0] >= sides[pipelines][0]


@pytest.mark.parametrize("placement", ["colocated", "disjoint"])
@pytest.mark.parametrize("fraction", [None, 0.7])
def test_context_parallel_costed_on_demand_gives_the_optimum(placement, fraction):
    """``plan`` costs a context-parallel strategy only once the lower bound of the plans it could be part of
    (``candidates.extend_context_parallel``) is within a plan already found: its plan is brute force's optimum over
    the space with ring CP, which here uses CP (1,024 text tokens on 4 CPU "GPUs"), with the memory loose and
    binding."""
    p, (step, best) = _unconstrained("tiny-4gpu-cp-long", placement)
    if fraction is not None:
        peak = estimate(p.model, p.cluster, p.workload, best, p.assumptions).peak_memory_bytes
        p = with_usable_memory(p, int(peak * fraction))
        step, best = brute_force(p, placement)
    assert any(s.cp > 1 for s in best.modules.values())
    (found,), _ = solve_strategies(p, placement, None, {}, 1, None)
    assert found.objective_s == pytest.approx(step, abs=ROUNDING_S)


@pytest.mark.parametrize("case", ["moe-tiny-4gpu", "moe-30b-h100-8gpu"])
def test_same_optimum_with_expert_parallelism_pinned(case):
    """``--fix llm.ep=N``: the solver's optimum is brute force's among plans whose LLM splits its experts N ways
    (so a candidate missing from the EP space, or costed otherwise, shows), and EP changes the optimum's time."""
    p = problem(**CASES[case])
    expected = {ep: brute_force(p, "colocated", llm_ep=ep) for ep in (1, 4)}
    assert expected[1][0] != pytest.approx(expected[4][0])
    for ep, (step, best) in expected.items():
        assert best.modules["llm"].ep == ep
        _check(p, "colocated", (step, best), fixes={"llm": {"ep": ep}})
