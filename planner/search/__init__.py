"""The search: a problem's best strategies over its placements (CP-SAT over the costed candidates), pipelined LLM
strategies costed on demand, and the best plan on the other side of pipeline parallelism."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Mapping

from planner.search.baselines import BaselineOutcome
from planner.search.candidates import (Candidates, extend_context_parallel, extend_pipelined,
                                      pipelined_floors, pipelined_options)
from planner.cost import estimate
from planner.problem import Problem, check_pipelined_dataset
from planner.search.solver.explain import Infeasible, candidates_or_error, explain_infeasible
from planner.search.solver.fixes import Fixes, placements_to_solve
from planner.contract.strategy import PLACEMENTS, Placement, Strategy

MAX_TIME_LIMIT_S = 3600.0
"""Largest --time-limit per solve in seconds."""


@dataclass(kw_only=True, frozen=True)
class Ranked:
    """A solved strategy before it becomes a Plan."""

    strategy: Strategy
    status: str
    objective_s: float
    num_candidates: int


def _strategy(problem: Problem, placement: Placement, choice: Mapping[str, Any]) -> Strategy:
    return Strategy(placement=placement, modules={m: choice[m].strategy for m in problem.model.module_names},
                    precision=problem.precision)


def check_time_limit(time_limit_s: float | None) -> None:
    if time_limit_s is not None and not 0 < time_limit_s <= MAX_TIME_LIMIT_S:
        raise ValueError(f"--time-limit must be more than 0 and at most {MAX_TIME_LIMIT_S:g} seconds, "
                         f"got {time_limit_s:g}")


def solve_strategies(problem: Problem, placement: str, pinned: str | None, fixes: Fixes, top_k: int,
                     time_limit_s: float | None) -> tuple[list[Ranked], list[Ranked] | None]:
    """Ranked strategies (best first) over the requested placements under the parsed fixes (``pinned``
    placement, ``fixes`` per module: ``parse_fixes``), and, when pipeline parallelism was in the space, the best
    plan on the other side of it (without PP if the best pipelines, with PP if not: ``pipeline_alternative``).

    Context-parallel strategies are solved without first; one is costed only once the lower bound of the plans it
    could be part of (``candidates.extend_context_parallel``) is within the ``top_k``-th plan found. When the LLM
    may or may not be pipelined, the plans without PP and CP are solved first; the pipelined strategies are costed up
    to the ``top_k``-th of those plans, and on from there until the best pipelined plan is proven (``_best_pipelined``: a
    pipelined strategy is costed only once its floor, ``candidates.pipeline_floor``, is within the limit); then both
    worlds are costed up to the ``top_k``-th plan found in either, and the plans without PP up to their own best
    when that is the reference row. Every strategy left out belongs only to plans slower than one found, so the
    answer is the full search's."""
    from planner.search.solver.cp_sat import DEFAULT_SETTINGS

    llm_fixes = fixes.get("llm", {})
    check_pipelined_dataset(problem, llm_fixes.get("pp"), llm_fixes.get("sp"))
    placements = placements_to_solve(problem, placement, pinned, fixes)
    settings = DEFAULT_SETTINGS if time_limit_s is None else replace(DEFAULT_SETTINGS, time_limit_s=time_limit_s)
    if pipelined_options(problem, fixes) != (False, True):  # one world: no PP, or PP pinned
        all_cands = candidates_or_error(problem, placements, fixes, defer_cp=True)
        ranked = _ranked(problem, all_cands, top_k, settings)
        if _extend(problem, all_cands, _limit_s(problem, ranked, top_k)):
            ranked = _ranked(problem, all_cands, top_k, settings)
        if not ranked:
            raise Infeasible(explain_infeasible(problem, all_cands, fixes))
        return ranked, None
    all_cands = candidates_or_error(problem, placements, fixes, pipeline_limit_s=0.0, defer_cp=True)
    flat = _ranked(problem, _world(all_cands, False), top_k, settings)
    first_limit_s = _limit_s(problem, flat, top_k)
    _extend(problem, all_cands, first_limit_s, pipelined=True)
    piped = _best_pipelined(problem, all_cands, _ranked(problem, _world(all_cands, True), 1, settings),
                            first_limit_s, settings)
    ranked = sorted(flat + piped, key=_rank_order)[:top_k]
    limit_s = _limit_s(problem, ranked, top_k)  # at least the top_k-th plan's step
    flat_limit_s = limit_s
    if not ranked or is_pipelined(ranked[0].strategy):  # the best plan without PP is the reference row: proven
        flat_limit_s = max(limit_s, _solver_s(problem, flat[0]) if flat else math.inf)
    before = _identities(_world(all_cands, False))
    _extend(problem, all_cands, flat_limit_s, pipelined=False)
    if _identities(_world(all_cands, False)) != before:  # context-parallel candidates joined the plans without PP
        flat = _ranked(problem, _world(all_cands, False), top_k, settings)
    if top_k > 1:
        _extend(problem, all_cands, limit_s, pipelined=True)
        piped = _ranked(problem, _world(all_cands, True), top_k, settings)
    ranked = sorted(flat + piped, key=_rank_order)[:top_k]  # of equal steps, the plan without PP first
    if not ranked:
        raise Infeasible(explain_infeasible(problem, all_cands, fixes))
    alternative = flat[:1] if is_pipelined(ranked[0].strategy) else piped[:1]
    return [replace(r, num_candidates=all_cands[r.strategy.placement].count) for r in ranked], alternative


PIPELINE_LIMIT_STEP = 1.15
"""Factor by which ``_best_pipelined`` raises its limit while no pipelined plan fits under it (a speed knob only:
the plan found does not depend on it)."""


def _best_pipelined(problem: Problem, all_cands: Mapping[str, Candidates], best: list[Ranked], limit_s: float,
                    settings: Any) -> list[Ranked]:
    """The best pipelined plan ([] if none fits), given the best ``best`` among the strategies costed so far, all
    of those with floors up to ``limit_s``: it is proven once it takes at most the limit (any better plan's
    strategies are then costed); else the limit rises to it, or while there is none by ``PIPELINE_LIMIT_STEP`` (at
    least to the next floor)."""
    while True:
        if best and _solver_s(problem, best[0]) <= limit_s:
            return best
        floors = [f for cands in all_cands.values() for f in pipelined_floors(problem, cands)]
        if not floors:  # what is left has no encoder candidate to form a plan with
            return best
        limit_s = _solver_s(problem, best[0]) if best else max(limit_s * PIPELINE_LIMIT_STEP, min(floors))
        if _extend(problem, all_cands, limit_s, pipelined=True):
            best = _ranked(problem, _world(all_cands, True), 1, settings)


def _solver_s(problem: Problem, ranked: Ranked) -> float:
    """The solver's step time of a ranked plan (without the fixed per-step overhead), in seconds."""
    return ranked.objective_s - problem.assumptions.step_overhead_s


def _rank_order(r: Ranked) -> tuple:
    return r.objective_s, PLACEMENTS.index(r.strategy.placement)


def _world(all_cands: Mapping[str, Candidates], pipelined: bool) -> dict[str, Candidates]:
    """Each placement's candidates of plans whose LLM is (or is not) pipelined."""
    return {p: _only_pipelined(c, pipelined) for p, c in all_cands.items()}


def _limit_s(problem: Problem, ranked: list[Ranked], top_k: int) -> float:
    """The solver's step of the ``top_k``-th plan (infinite with fewer): no strategy of a slower plan is needed."""
    return _solver_s(problem, ranked[-1]) if len(ranked) == top_k else math.inf


def _extend(problem: Problem, all_cands: Mapping[str, Candidates], limit_s: float, pipelined: bool | None = None
            ) -> int:
    """Cost the deferred strategies of plans (whose LLM is ``pipelined``, when given) that could take at most
    ``limit_s`` (solver seconds): the pipelined LLM's first (the context-parallel bounds take the least of the
    candidates costed); returns how many were costed."""
    piped = sum(extend_pipelined(problem, cands, limit_s) for cands in all_cands.values()) if pipelined in (
        None, True) else 0
    return piped + sum(extend_context_parallel(problem, cands, limit_s, pipelined) for cands in all_cands.values())


def _ranked(problem: Problem, all_cands: Mapping[str, Candidates], top_k: int, settings: Any) -> list[Ranked]:
    """The ``top_k`` best solutions over the placements' candidates, best first."""
    from planner.search.solver.cp_sat import solve

    budget = problem.usable_bytes - problem.overhead_bytes
    ranked = []
    for p, cands in all_cands.items():
        for sol in solve(cands, problem.num_gpus, budget, top_k=top_k, settings=settings):
            ranked.append(Ranked(strategy=_strategy(problem, p, sol.choice), status=sol.status,
                                  objective_s=sol.objective_ns / 1e9 + problem.assumptions.step_overhead_s,
                                  num_candidates=cands.count))
    ranked.sort(key=_rank_order)
    return ranked[:top_k]


def _identities(all_cands: Mapping[str, Candidates]) -> list[int]:
    """The candidates' identities, to tell whether costing more changed a world."""
    return [id(c) for cands in all_cands.values() for cs in cands.by_module.values() for c in cs]


def _only_pipelined(cands: Candidates, pipelined: bool) -> Candidates:
    """The candidates of plans whose LLM is (or is not) pipelined."""
    return replace(cands, by_module={m: [c for c in cs if c.pipelined == pipelined]
                                     for m, cs in cands.by_module.items()})


def is_pipelined(strategy: Strategy) -> bool:
    """Whether a strategy pipelines a module."""
    return any(s.pp > 1 for s in strategy.modules.values())


def pipeline_alternative(problem: Problem, alternative: list[Ranked] | None, chosen: Strategy
                         ) -> dict[str, BaselineOutcome]:
    """The best plan on the other side of pipeline parallelism (``_solve``) as a reference row, ``without_pp`` or
    ``with_pp``, so that a plan shows what pipelining gains or loses; {} when PP was not searched."""
    if alternative is None:
        return {}
    name = "without_pp" if is_pipelined(chosen) else "with_pp"
    if not alternative:
        return {name: BaselineOutcome(name=name, estimate=None, infeasible="no plan fits")}
    e = estimate(problem.model, problem.cluster, problem.workload, alternative[0].strategy, problem.assumptions,
                 problem.layer_costs)
    return {name: BaselineOutcome(name=name, estimate=e)}
