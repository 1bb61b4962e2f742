"""Candidate enumeration, validity, pruning and the direct feasibility check."""

import math
from dataclasses import replace

import pytest
from plan_helpers import problem, with_usable_memory

from planner.search.candidates import (
    Candidates,
    build_candidates,
    cost_candidate,
    cost_series,
    extend_context_parallel,
    extend_pipelined,
    feasible,
    fits_alone,
    module_candidates,
    pareto_front,
    refine_groups,
)
from planner.catalog import get_model
from planner.cost import check_strategy
from planner.search.enumeration import divisors, encoder_node_counts, group_sizes, module_strategies
from planner.contract.models import ModelSpec


def test_divisors():
    assert divisors(12) == (1, 2, 3, 4, 6, 12)
    assert divisors(1) == (1,)
    assert divisors(49) == (1, 7, 49)


@pytest.mark.parametrize("placement", ["colocated", "disjoint"])
def test_every_candidate_is_valid_and_consumes_the_batch(placement):
    p = problem("qwen-vl-32b", 16, device="h100-80gb", batch=64, image=1344, text=512)
    cands = build_candidates(p, placement)
    assert not cands.empty
    for module, cs in cands.by_module.items():
        for c in cs:
            s = c.strategy
            assert check_strategy(p.model, module, s, p.cluster, p.workload) == []
            assert s.dp * s.micro_batch * s.grad_accum == 64
            if placement == "colocated":
                assert s.gpus == 16
            assert c.memory_bytes + p.overhead_bytes <= p.usable_bytes


def test_disjoint_sizes_pair_up_and_respect_nodes():
    p = problem("qwen-vl-32b", 64, device="h100-80gb", batch=64)
    encoder = group_sizes(p, "vision", "disjoint")
    llm = group_sizes(p, "llm", "disjoint")
    assert sorted(64 - g for g in encoder) == llm
    assert all(g < 8 or g % 8 == 0 for g in encoder)
    assert group_sizes(p, "llm", "colocated") == [64]


def test_encoder_node_grid_is_dense_then_geometric():
    counts = encoder_node_counts(128)
    assert counts[:16] == list(range(1, 17))
    assert [c for c in counts if c > 16] == [24, 32, 48, 64, 96]
    assert encoder_node_counts(4) == [1, 2, 3]


def test_disjoint_with_two_encoders_is_not_implemented():
    vl, audio = get_model("qwen2.5-vl-tiny"), get_model("qwen2-audio-7b")
    three = ModelSpec(name="three", family="qwen2_5_vl", hf_config={}, vision_input=vl.vision_input,
                      audio_input=audio.audio_input, modules=(vl.module("vision"), audio.module("audio"), vl.module("llm")))
    p = replace(problem(), model=three)
    with pytest.raises(NotImplementedError, match="exactly one encoder"):
        group_sizes(p, "llm", "disjoint")


def test_fixes_restrict_every_candidate():
    p = problem("qwen-vl-32b", 16, device="h100-80gb", batch=64)
    cands = build_candidates(p, "colocated", {"llm": {"tp": 8, "zero": 1}, "vision": {"sp": 4}})
    assert all(c.strategy.tp == 8 and c.strategy.zero == 1 for c in cands.by_module["llm"])
    assert all(c.strategy.sp == 4 for c in cands.by_module["vision"])


def test_invalid_fix_reports_the_rule():
    p = problem("qwen-vl-32b", 16, device="h100-80gb", batch=64)
    cands = build_candidates(p, "colocated", {"llm": {"tp": 8, "sp": 2}})
    assert "sp=2 does not divide the 5 attention heads per TP rank" in cands.invalid["llm"]
    assert cands.by_module["llm"] == []


def test_unusable_gpu_count_is_reported():
    p = problem("qwen-vl-32b", 7, device="h100-80gb", batch=64)
    assert module_candidates(p, "vision", "colocated", {}).invalid == ("no vision layout on 7 GPUs consumes the global "
                                                                      "batch of 64")
    audio = replace(problem("qwen2-audio-7b", 7, device="h100-80gb", batch=64), allow_ring_cp=True)
    reason = module_candidates(audio, "audio", "colocated", {}).invalid
    assert reason == "audio uses cp=7; context parallelism is run for the LLM and the vision tower only"
    vision = module_candidates(replace(p, allow_ring_cp=True), "vision", "colocated", {})  # 7 GPUs: CP7 alone
    assert vision.invalid is None and {c.strategy.cp for c in vision.kept} == {7}


def test_ring_cp_is_searched_only_when_allowed():
    p = problem("qwen-vl-32b", 16, device="h100-80gb", batch=64)
    default = build_candidates(p, "colocated").by_module["llm"]
    allowed = build_candidates(replace(p, allow_ring_cp=True), "colocated").by_module["llm"]
    assert all(c.strategy.cp == 1 for c in default)
    assert any(c.strategy.cp > 1 for c in allowed)


def _with(c, **ints):
    return replace(c, **ints)


def test_pareto_front_keeps_exactly_the_non_dominated():
    p = problem()
    base = build_candidates(p, "colocated").by_module["llm"][0]
    points = {"a": (10, 50), "b": (20, 40), "c": (20, 60), "d": (30, 40), "e": (5, 90), "f": (10, 50)}
    cands = [_with(base, step_ns=t, phase_bytes=(m, 7)) for t, m in points.values()]
    front = pareto_front(cands, "colocated")
    assert sorted((c.step_ns, c.memory_bytes) for c in front) == [(5, 90), (10, 50), (20, 40)]
    # memory is compared phase by phase: less at one moment keeps a slower candidate
    slower = _with(base, step_ns=30, phase_bytes=(60, 6))
    front = pareto_front(cands + [slower], "colocated")
    assert sorted((c.step_ns, c.phase_bytes) for c in front) == [
        (5, (90, 7)), (10, (50, 7)), (20, (40, 7)), (30, (60, 6))]


def test_disjoint_pareto_uses_time_terms_only():
    p = problem()
    base = build_candidates(p, "disjoint").by_module["llm"][0]
    cands = [
        _with(base, path_ns=(10, 20, 9, 40), tail_ns=5, phase_bytes=(100,)),
        _with(base, path_ns=(10, 20, 9, 40), tail_ns=5, phase_bytes=(50,)),
        _with(base, path_ns=(12, 24, 11, 48), tail_ns=1, phase_bytes=(10,)),
        _with(base, path_ns=(12, 24, 11, 48), tail_ns=6, phase_bytes=(1,)),
        _with(base, path_ns=(12, 24, 8, 48), tail_ns=6, phase_bytes=(1,)),  # shorter on one path: kept
    ]
    front = pareto_front(cands, "disjoint")
    assert [(c.path_ns[2], c.tail_ns, c.memory_bytes) for c in front] == [(9, 5, 50), (8, 6, 1), (11, 1, 10)]


def test_disjoint_groups_are_costed_only_where_the_other_group_can_take_the_rest(monkeypatch):
    """The encoder is costed on a (GPU count, grad_accum) only when the LLM has a valid strategy of that grad_accum on
    the other GPUs, and the LLM only where a fitting encoder candidate complements it: the plan is the one without
    that restriction, from fewer strategies costed."""
    import planner.search.candidates as candidates
    from planner.search.solver.cp_sat import solve

    p = problem("qwen-vl-32b", 16, device="h100-80gb", batch=64, image=1344, text=512, allow_pp=True)
    cands = build_candidates(p, "disjoint")
    llm_accums = {g: {s.grad_accum for series in module_strategies(p, "llm", g, {}, {})[0] for s in series}
                  for g in group_sizes(p, "llm", "disjoint")}
    assert all(c.grad_accum in llm_accums[16 - c.gpus] for c in cands.by_module["vision"])
    encoder = {(c.gpus, c.grad_accum) for c in cands.by_module["vision"]}
    assert all((16 - c.gpus, c.grad_accum) in encoder for c in cands.by_module["llm"])

    monkeypatch.setattr(candidates, "valid_accums", lambda *args: set(divisors(64)))
    everywhere = build_candidates(p, "disjoint")
    assert cands.by_module["vision"] == [c for c in everywhere.by_module["vision"]
                                         if c.grad_accum in llm_accums[16 - c.gpus]]
    assert len(cands.by_module["vision"]) < len(everywhere.by_module["vision"])
    assert cands.num_costed < everywhere.num_costed
    budget = p.usable_bytes - p.overhead_bytes
    best, reference = solve(cands, 16, budget)[0], solve(everywhere, 16, budget)[0]
    assert (best.objective_ns, best.choice) == (reference.objective_ns, reference.choice)


@pytest.mark.parametrize("placement", ["colocated", "disjoint"])
def test_micro_batch_early_stop_drops_no_fitting_candidate(placement):
    p = problem("qwen-vl-32b", 8, device="h100-80gb", batch=64, image=1344, text=512)
    truncated = 0
    for module in p.model.module_names:
        for g in group_sizes(p, module, placement):
            series, _ = module_strategies(p, module, g, {}, {})
            for strategies in series:
                every = [cost_candidate(p, module, s, placement) for s in strategies]
                kept = cost_series(p, module, strategies, placement)
                assert [c for c in every if fits_alone(p, c)] == [c for c in kept if fits_alone(p, c)]
                truncated += len(kept) < len(every)
    assert truncated > 0


@pytest.mark.parametrize("placement", ["colocated", "disjoint"])
def test_feasible_agrees_with_the_solver(placement):
    from planner.search.solver.cp_sat import solve

    p = problem(overhead_gib=0.0)
    loose = build_candidates(p, placement)
    memories = sorted({c.memory_bytes for cs in loose.by_module.values() for c in cs})
    for usable in memories[:: max(1, len(memories) // 6)]:
        q = with_usable_memory(p, int(usable * 1.5))
        cands = build_candidates(q, placement)
        assert feasible(q, cands) == bool(solve(cands, q.num_gpus, q.usable_bytes - q.overhead_bytes))


def test_empty_candidates_are_infeasible():
    p = problem()
    assert not feasible(p, Candidates(placement="colocated", by_module={"vision": [], "llm": []}))


def _solver_view(cands: Candidates) -> dict:
    """What the solver and the explanations read of candidates."""
    return {
        "kept": {m: [(c.strategy, c.pipelined, c.step_ns, c.path_ns, c.tail_ns, c.phase_bytes, c.cost) for c in cs]
                 for m, cs in cands.by_module.items()},
        "smallest": {m: (c.strategy, c.pipelined, c.phase_bytes) for m, c in cands.smallest.items()},
        "costed": cands.num_costed,
    }


_WORKER_LOG: list = []
"""(folder, original share function) of the running worker test: each worker leaves a file named by its pid."""


def _logged_share_of_worker(index):
    import os

    folder, share_of_worker = _WORKER_LOG
    (folder / f"{os.getpid()}-{index}").touch()
    return share_of_worker(index)


@pytest.mark.parametrize("placement", ["colocated", "disjoint"])
def test_costing_in_worker_processes_gives_the_serial_candidates(placement, monkeypatch, tmp_path):
    import os

    import planner.search.candidates as candidates

    p = problem("qwen-vl-32b", 32, device="h100-80gb", batch=128, image=1344, text=512, allow_pp=True,
                allow_ring_cp=True)
    serial = build_candidates(p, placement, defer_cp=True)
    _WORKER_LOG[:] = [tmp_path, candidates._share_of_worker]
    monkeypatch.setattr(candidates, "_share_of_worker", _logged_share_of_worker)
    monkeypatch.setattr(candidates, "PARALLEL_MIN_STRATEGIES", 1)
    forked = build_candidates(replace(p, workers=3), placement, defer_cp=True)
    assert _solver_view(forked) == _solver_view(serial)
    assert sorted(forked.deferred_cp, key=repr) == sorted(serial.deferred_cp, key=repr) and serial.deferred_cp
    ran = {int(f.name.split("-")[0]) for f in tmp_path.iterdir()}
    assert ran and os.getpid() not in ran
    assert any(c.pipelined for cs in serial.by_module.values() for c in cs)


def test_ring_cp_is_not_planned_where_the_runtime_does_not_run_it():
    p = replace(problem("qwen-vl-32b", 16, device="h100-80gb", batch=64), allow_ring_cp=True)
    cands = build_candidates(p, "colocated", {"llm": {"cp": 2, "pp": 2}})
    assert "cp=2 with pp=2: the runtime does not run ring context parallelism inside a pipeline yet" in (
        cands.invalid["llm"])
    assert all(c.strategy.pp == 1 for c in build_candidates(p, "colocated", {"llm": {"cp": 2}}).by_module["llm"])


def test_a_ring_cp_module_is_planned_with_the_rings_sdpa_kernels():
    from planner.api import plan
    from planner.inputs import SearchOptions

    made = plan("qwen2.5-vl-7b", 8, fix=["llm.cp=2", "llm.tp=2"], search=SearchOptions(allow_ring_cp=True))
    assert made.module("llm").cp == 2 and made.module("llm").attention == "sdpa"
    assert made.module("vision").attention == "varlen"  # a GPU plan's other modules: the variable-length kernel


@pytest.mark.parametrize("placement", ["colocated", "disjoint"])
@pytest.mark.parametrize("case", [dict(model="qwen2.5-vl-tiny", gpus=4, batch=2, text=1024, memory_gib=0.02),
                                  dict(model="qwen-vl-32b", gpus=16, device="h100-80gb", batch=16, image=1344)])
def test_context_parallel_groups_are_deferred_with_lower_bounds_on_what_fits(case, placement):
    """Every context-parallel strategy that fits a GPU takes at least its group's bounds (colocated step term,
    each disjoint path term), the rough ones it is deferred with and the refined ones, which are tighter; a group
    bounded at infinity has none that fits; what is deferred is what plain costing would have costed, and fewer
    strategies are costed up front."""
    p = replace(problem(**case), allow_ring_cp=True)
    deferred = build_candidates(p, placement, defer_cp=True)
    assert deferred.deferred_cp and all(g.module in ("vision", "llm") for g in deferred.deferred_cp)
    assert not any(g.refined for g in deferred.deferred_cp)
    refined = refine_groups(p, placement, deferred.deferred_cp)
    assert all(r.refined and r.strategies == g.strategies for g, r in zip(deferred.deferred_cp, refined, strict=True))
    tighter = 0
    for group, tight in zip(deferred.deferred_cp, refined):
        fitting = [c for s in group.strategies for c in cost_series(p, group.module, [s], placement, group.feeds)
                   if fits_alone(p, c)]
        assert tight.step_ns < float("inf") or not fitting
        assert tight.step_ns >= group.step_ns and all(map(float.__ge__, map(float, tight.path_ns), group.path_ns))
        tighter += tight.step_ns > group.step_ns or group.step_ns == float("inf")
        for c in fitting:
            assert c.step_ns >= tight.step_ns and all(map(int.__ge__, c.path_ns, tight.path_ns))
    assert tighter > len(refined) / 2
    full = build_candidates(p, placement)
    costed_later = sum(len(g.strategies) for g in deferred.deferred_cp)
    assert deferred.num_costed < full.num_costed <= deferred.num_costed + costed_later


@pytest.mark.parametrize("placement", ["colocated", "disjoint"])
@pytest.mark.parametrize("case", [dict(model="qwen2.5-vl-tiny", gpus=4, batch=2, text=1024, memory_gib=0.02),
                                  dict(model="qwen-vl-32b", gpus=16, device="h100-80gb", batch=16, image=16240)])
def test_a_feasibility_check_costs_only_deferred_strategies_that_could_fit(case, placement):
    """Asked only whether some plan fits (``fits_only``, as ``--max-seq`` and the infeasibility hints ask), the
    extensions leave uncosted the deferred groups whose bounds say nothing of theirs fits a GPU, and answer as
    costing everything does (the 32B's 16,240 px image fits colocated only with CP, and not at all disjoint)."""
    p = replace(problem(**case), allow_ring_cp=True, allow_pp=True)
    answers, costed = [], []
    for fits_only in (False, True):
        cands = build_candidates(p, placement, defer_cp=True, pipeline_limit_s=-math.inf)
        n = extend_context_parallel(p, cands, math.inf, fits_only=fits_only)
        with_cp = feasible(p, cands)
        n += extend_pipelined(p, cands, math.inf, fits_only=fits_only)
        answers.append((with_cp, feasible(p, cands)))
        costed.append(n)
    assert answers[0] == answers[1] == ((placement == "colocated" and case["model"] == "qwen-vl-32b"),) * 2
    assert costed[1] < 0.75 * costed[0]
