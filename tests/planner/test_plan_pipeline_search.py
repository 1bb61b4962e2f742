"""Pipelined strategies are costed on demand (``planner.search.solve_strategies``): only once their floor
(``pipelined_step_floor_s`` plus the encoders' least time) is within a plan already found. The floor never exceeds
a strategy's cost, and the plans (with their ``with_pp`` / ``without_pp`` rows) are those of the full search."""

import pytest
from plan_helpers import problem

import planner.search as search
import planner.search.candidates as candidates
from planner.api import ClusterInputs, make_problem, top_plans
from planner.search.candidates import as_candidate, placed_cost
from planner.cost.memory import model_state_bytes
from planner.cost.pipeline import pipelined_state_floor_bytes, pipelined_step_floor_s
from planner.cost.rank_cost import module_static, params_per_rank
from planner.search.enumeration import group_sizes, module_strategies


@pytest.mark.parametrize("placement", ["colocated", "disjoint"])
def test_the_floor_of_every_pipelined_strategy_is_at_most_its_cost(placement):
    p = problem("qwen-vl-32b", 32, device="h100-80gb", batch=128, image=1344, text=512, allow_pp=True)
    strategies = [s for g in group_sizes(p, "llm", placement) for series in module_strategies(p, "llm", g, {}, {})[0]
                  for s in series if s.pp > 1]
    assert len(strategies) > 1000
    tightest = 0.0
    for s in strategies:
        floor = pipelined_step_floor_s(p.model, "llm", p.cluster, p.workload, s, assumptions=p.assumptions)
        cost = placed_cost(p, "llm", s, placement).micro_batches_s
        assert floor <= cost, s
        tightest = max(tightest, floor / cost)
    assert tightest > 0.99  # equal stages without transfers: the bound is reached


@pytest.mark.parametrize("placement", ["colocated", "disjoint"])
def test_the_memory_floor_of_every_pipelined_strategy_is_its_states_share_and_at_most_its_memory(placement):
    """``pipelined_state_floor_bytes``: a 1/pp share of a TP rank's parameters at ZeRO's sharded bytes (by hand, on
    one strategy), never above the candidate's memory (every pipelined strategy of a 235B MoE on 64 GPUs: what the
    planner skips uncosted when a plan exists)."""
    p = problem("qwen3-vl-235b-a22b", 64, device="h100-80gb", batch=256, image=1344, text=512, allow_pp=True)
    strategies = [s for g in group_sizes(p, "llm", placement) for series in module_strategies(p, "llm", g, {}, {})[0]
                  for s in series if s.pp > 1][::7]
    assert len(strategies) > 300
    s = strategies[0]
    params = params_per_rank(module_static(p.model, "llm", p.workload, p.cluster, p.assumptions), s.tp, s.ep,
                             p.model.module("llm").layers)[0]
    by_hand = sum(model_state_bytes(params / s.pp, p.assumptions.bytes_per_param(p.precision), zero=s.zero,
                                    shards=s.dp * s.cp * s.sp, frozen=False))
    floor = pipelined_state_floor_bytes(p.model, "llm", p.cluster, p.workload, s, precision=p.precision,
                                        assumptions=p.assumptions)
    assert floor == pytest.approx(by_hand) and by_hand > 0
    tightest = 0.0
    for s in strategies:
        floor = pipelined_state_floor_bytes(p.model, "llm", p.cluster, p.workload, s, precision=p.precision,
                                            assumptions=p.assumptions)
        memory = as_candidate(p, placed_cost(p, "llm", s, placement), placement, pipelined=True).memory_bytes
        assert floor <= memory, s
        tightest = max(tightest, floor / memory)
    assert tightest > 0.9


def test_pipelined_strategies_that_cannot_fit_are_skipped_and_the_plan_is_the_same(monkeypatch):
    """A 30B MoE on 16 GPUs: its best plan does not pipeline, and finding the best pipelined one (its ``with_pp``
    row) skips the strategies whose model states alone exceed a GPU; the plans are those of costing them all. (The
    235B MoE on 64 GPUs skips 4,400 of 22,000 strategies, 4.9 -> 3.7 s.)"""
    p = make_problem("qwen3-vl-30b-a3b", ClusterInputs(gpus=16, profile=None))
    costed = []
    real = candidates._cost_in_processes
    monkeypatch.setattr(candidates, "_cost_in_processes", lambda *a: costed.append(real(*a)[2]) or real(*a))
    skipping = top_plans(p, k=1)
    skipped_costed = sum(costed)
    costed.clear()
    monkeypatch.setattr(candidates, "_may_fit_alone", lambda problem, s, module="llm": True)
    full = top_plans(p, k=1)
    assert skipping == full and "with_pp" in skipping[0].baselines
    assert skipped_costed < sum(costed)


SLOW_NETWORK = "device: h100-80gb\ninter_node_bandwidth: 6.25e9\n"
"""50 Gb/s per GPU between nodes: ZeRO's traffic no longer hides and the 72B plans pipeline the LLM."""


@pytest.mark.parametrize("model,network,limit_step", [("qwen-vl-32b", "catalog", 1.01), ("qwen-vl-72b", "slow", None)])
def test_costing_pipelined_strategies_on_demand_gives_the_full_searchs_plans(model, network, limit_step, tmp_path,
                                                                            monkeypatch):
    """32B: no plan pipelines; raised in small steps, the limit first admits a pipelined plan slower than the best
    one, which must then be found (the ``with_pp`` row). 72B behind a slow network: the best plans pipeline."""
    cluster_file = None
    if network == "slow":
        cluster_file = tmp_path / "slow.yaml"
        cluster_file.write_text(SLOW_NETWORK)
    if limit_step is not None:
        monkeypatch.setattr(search, "PIPELINE_LIMIT_STEP", limit_step)
    p = make_problem(model, ClusterInputs(gpus=64, profile=None, cluster_file=cluster_file and str(cluster_file)))
    bounded = top_plans(p, k=2)
    monkeypatch.setattr(candidates, "pipeline_floor", lambda *args: lambda strategy: 0.0)  # nothing deferred
    monkeypatch.setattr(candidates, "module_strategies", lambda *args: module_strategies(*args[:6]))  # CP too
    full = top_plans(p, k=2)
    assert (bounded[0].module("llm").pp > 1) == (network == "slow")
    assert [plan.model_copy(update={"solver": None}) for plan in bounded] == \
        [plan.model_copy(update={"solver": None}) for plan in full]
    assert bounded[0].solver.num_candidates < full[0].solver.num_candidates
