"""The CP-SAT model: its objective is the cost model's step time, ties break deterministically, top-k ranks."""

from dataclasses import replace

import pytest
from plan_helpers import problem

from planner.search.candidates import build_candidates, least_colocated_need
from planner.cost import estimate
from planner.search.solver.cp_sat import SolverSettings, solve
from planner.contract.strategy import Strategy

ROUNDING_S = 2e-9

SCENARIOS = {
    "32b-16": dict(model="qwen-vl-32b", gpus=16, device="h100-80gb", batch=64, image=1344, text=512),
    "3b-16": dict(model="qwen2.5-vl-3b", gpus=16, device="h100-80gb", batch=64, image=1344, text=512),
    "7b-12": dict(model="qwen2.5-vl-7b", gpus=12, device="a100-80gb", batch=48, image=896, text=256),
    "audio-8": dict(model="qwen2-audio-7b", gpus=8, device="h100-80gb", batch=32, image=0, text=256),
}


def _problem(name):
    kw = dict(SCENARIOS[name])
    p = problem(**kw) if kw["image"] else _audio_problem(kw)
    return p


def _audio_problem(kw):
    from planner.contract.workload import Workload

    kw = dict(kw)
    kw.pop("image")
    p = problem(**kw, image=14)
    return replace(p, workload=Workload(audio_seconds=30.0, text_tokens=kw["text"], global_batch=kw["batch"]))


def _solve(p, placement, **kw):
    return solve(build_candidates(p, placement), p.num_gpus, p.usable_bytes - p.overhead_bytes, **kw)


def _estimate(p, placement, sol):
    strategy = Strategy(placement=placement, modules={m: c.strategy for m, c in sol.choice.items()},
                        precision=p.precision)
    return estimate(p.model, p.cluster, p.workload, strategy, p.assumptions)


@pytest.mark.parametrize("placement", ["colocated", "disjoint"])
@pytest.mark.parametrize("scenario", ["32b-16", "3b-16", "7b-12", "audio-8"])
def test_objective_equals_cost_model_step_time(scenario, placement):
    p = _problem(scenario)
    sols = _solve(p, placement, top_k=2)
    assert sols, f"{scenario} {placement}: no plan"
    for sol in sols:
        e = _estimate(p, placement, sol)
        assert e.fits
        assert sol.objective_ns / 1e9 == pytest.approx(e.step_time_s, abs=ROUNDING_S)
        if placement == "disjoint":
            assert sum(c.gpus for c in sol.choice.values()) == p.num_gpus


def test_top_k_plans_are_distinct_and_ranked():
    p = _problem("32b-16")
    sols = _solve(p, "colocated", top_k=4)
    assert len(sols) == 4
    keys = [tuple(c.strategy for c in s.choice.values()) for s in sols]
    assert len(set(keys)) == 4
    objectives = [s.objective_ns for s in sols]
    assert objectives == sorted(objectives)
    assert all(s.status == "OPTIMAL" for s in sols)


def test_top_k_stops_when_plans_run_out():
    p = problem(gpus=1, batch=1)
    cands = build_candidates(p, "colocated")
    total = 1
    for cs in cands.by_module.values():
        total *= len(cs)
    sols = solve(cands, 1, p.usable_bytes - p.overhead_bytes, top_k=total + 5)
    assert 1 <= len(sols) <= total


def test_ties_break_to_the_smallest_mixed_radix_index():
    p = problem(overhead_gib=0.0)
    cands = build_candidates(p, "colocated")
    tied = replace(cands, by_module={m: [replace(c, step_ns=1000) for c in cs] for m, cs in cands.by_module.items()})
    vision, llm = tied.by_module["vision"], tied.by_module["llm"]
    budget = p.usable_bytes - p.overhead_bytes
    expected = min(
        (i, j) for i, a in enumerate(vision) for j, b in enumerate(llm)
        if a.grad_accum == b.grad_accum and a.memory_bytes + b.memory_bytes <= budget
    )
    for workers in (1, 8):
        sol = solve(tied, p.num_gpus, budget, settings=SolverSettings(num_workers=workers))[0]
        assert (vision.index(sol.choice["vision"]), llm.index(sol.choice["llm"])) == expected


@pytest.mark.parametrize("placement", ["colocated", "disjoint"])
def test_same_choice_every_time_and_with_any_worker_count(placement):
    p = _problem("32b-16")
    cands = build_candidates(p, placement)
    budget = p.usable_bytes - p.overhead_bytes
    choices = {
        tuple(c.strategy for c in solve(cands, p.num_gpus, budget, settings=SolverSettings(num_workers=w, seed=s))[0]
              .choice.values())
        for w, s in ((8, 0), (8, 0), (8, 1), (1, 0), (4, 7))
    }
    assert len(choices) == 1


def test_no_plan_when_nothing_fits_together():
    p = problem(overhead_gib=0.0)
    cands = build_candidates(p, "colocated")
    _, smallest = least_colocated_need(cands)
    assert solve(cands, p.num_gpus, smallest - 1) == []
    assert solve(cands, p.num_gpus, smallest)


def test_statuses_without_proof_are_reported(monkeypatch):
    """FEASIBLE (time limit hit with a plan) skips the tie-break; UNKNOWN (no plan yet) is a one-line error."""
    from planner.search.solver import cp_sat

    p = problem()
    cands = build_candidates(p, "colocated")
    budget = p.usable_bytes - p.overhead_bytes
    real_run = cp_sat._run

    def feasible_only(model, settings):
        solver, _ = real_run(model, settings)
        return solver, "FEASIBLE"

    monkeypatch.setattr(cp_sat, "_run", feasible_only)
    assert [s.status for s in solve(cands, p.num_gpus, budget, top_k=2)] == ["FEASIBLE", "FEASIBLE"]
    monkeypatch.setattr(cp_sat, "_run", lambda model, settings: (None, "UNKNOWN"))
    with pytest.raises(cp_sat.SolverTimeout, match="no colocated plan within 20 s; raise --time-limit"):
        solve(cands, p.num_gpus, budget)


def test_encoders_are_costed_for_the_llm_they_feed():
    """With PP in the space every encoder has a candidate for a pipelined LLM (holding every micro-batch's
    activations) and one for a flat LLM, at the same step time; the solver must pick the one that matches."""
    p = problem("qwen-vl-32b", device="h200-141gb", gpus=4, batch=4, image=448, text=128, precision="bf16_pure",
                gpus_per_node=1, allow_pp=True)
    cands = build_candidates(p, "colocated")
    assert {c.pipelined for c in cands.by_module["vision"]} == {False, True}
    for top in solve(cands, p.num_gpus, p.usable_bytes - p.overhead_bytes, top_k=3):
        llm_pipelined = top.choice["llm"].strategy.pp > 1
        assert top.choice["vision"].pipelined == top.choice["llm"].pipelined == llm_pipelined
    assert any(top.choice["llm"].strategy.pp > 1 for top in solve(cands, p.num_gpus, p.usable_bytes, top_k=1))
