"""Candidate strategies of each module: the valid ``ModuleStrategy`` values (``planner.search.enumeration``), costed and
pruned.

The CP-SAT model (``planner.search.solver``) picks one candidate per module, so everything the solver needs is
computed here, once, as integers: nanoseconds for times and bytes for memory. This is the hot path at
1,024 GPUs; ``benchmarks/plan_latency.py`` measures it.

Disjoint, the encoder is costed first and the LLM only on the GPU counts and grad_accum values a fitting encoder
candidate complements. Pruning is exact for the solver's objective: per (module, gpus, grad_accum), a candidate
is dropped when another one is no worse in every quantity the solver sees -- colocated: (its step-time term, its
memory at each phase of the step, ``planner.cost.phases``); disjoint: (per-micro-batch time, exposed DP time),
after dropping candidates whose group does not fit.
"""

from __future__ import annotations

import copyreg
import functools
import itertools
import math
import multiprocessing
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping, NamedTuple

from planner.cost import ModuleCost, module_cost
from planner.cost.module import feeding_pipeline, per_micro_batch_floor, ring_share_floor
from planner.cost.pipeline import (NUM_PATHS, path_terms, pipelined_state_floor_bytes, pipelined_step_floor_s,
                                    state_floor_bytes)
from planner.cost.estimate import module_path_terms
from planner.cost.phases import alive_bytes, data_flow_order, own_peak_bytes, step_phases
from planner.search.enumeration import (SettingsGroup, Verdicts, encoder_names, group_sizes, module_strategies,
                                        valid_accums)
from planner.contract.models import ENCODER_MODULES
from planner.problem import Problem
from planner.contract.strategy import RECOMPUTE_CHOICES, ModuleStrategy, Placement

NS_PER_S = 1_000_000_000
"""The solver's time unit is the nanosecond: integer coefficients, rounding error <= 0.5 ns per term."""
FIX_FIELDS = ("dp", "tp", "sp", "cp", "pp", "ep", "virtual_stages", "pp_schedule", "zero", "recompute", "micro_batch",
              "grad_accum", "gpus")
"""Fields ``--fix MODULE.FIELD=VALUE`` may pin."""

Fixes = Mapping[str, Mapping[str, int | str]]
"""Module -> {field: pinned value}."""


@dataclass(kw_only=True, frozen=True)
class Candidate:
    """One module under one strategy, with the integers the solver uses."""

    module: str
    """Module name."""
    cost: ModuleCost
    """The cost model's full answer."""
    step_ns: int
    """Colocated step-time term: grad_accum * per_micro_batch + tail (exposed DP comm + optimizer step)."""
    path_ns: tuple[int, ...]
    """Disjoint placement: this module's term of each critical path of the pipeline (``planner.cost.pipeline``)."""
    tail_ns: int
    """After the last micro-batch: exposed DP/ZeRO communication + the optimizer step (``step_tail_s``)."""
    phase_bytes: tuple[int, ...]
    """Colocated: per-GPU bytes this module holds at each phase of the step (``planner.cost.phases.step_phases`` of
    the model's modules); disjoint: one entry, its group's peak (it is alone on its GPUs)."""
    pipelined: bool = False
    """Part of a plan whose LLM is pipelined: the LLM with pp > 1, or an encoder costed as feeding one (every
    module of a plan agrees; ``planner.search.solver`` links them)."""

    @property
    def memory_bytes(self) -> int:
        """Its largest per-GPU need at any moment (disjoint: its group's peak; colocated: a lower bound on the
        peak of any plan containing it)."""
        return max(self.phase_bytes)

    @property
    def strategy(self) -> ModuleStrategy:
        """The strategy costed."""
        return self.cost.strategy

    @property
    def gpus(self) -> int:
        """GPUs the module occupies."""
        return self.cost.strategy.gpus

    @property
    def grad_accum(self) -> int:
        """Micro-batches per step."""
        return self.cost.strategy.grad_accum


@dataclass(kw_only=True)
class Candidates:
    """The solver's input for one placement."""

    placement: Placement
    """colocated or disjoint."""
    by_module: dict[str, list[Candidate]]
    """Module -> fitting, non-dominated candidates, in a fixed order (best first)."""
    smallest: dict[str, Candidate] = field(default_factory=dict)
    """Module -> its least-memory valid candidate, fitting or not (for explaining infeasibility)."""
    invalid: dict[str, str] = field(default_factory=dict)
    """Module -> why no strategy at all is valid (e.g. a --fix value breaks a rule)."""
    num_costed: int = 0
    """Strategies costed before pruning."""
    deferred: list[tuple[float, ModuleStrategy]] = field(default_factory=list)
    """Pipelined LLM strategies not costed yet, each with a lower bound on the step of any plan holding it
    (``pipeline_floor``), in enumeration order; ``extend_pipelined`` costs those under a limit."""
    deferred_cp: list["DeferredGroup"] = field(default_factory=list)
    """Context-parallel strategies not costed yet, in groups with lower bounds on their terms
    (``defer_context_parallel``); ``extend_context_parallel`` costs those whose plans could beat a limit."""

    @property
    def count(self) -> int:
        """Candidates handed to the solver."""
        return sum(len(c) for c in self.by_module.values())

    @property
    def empty(self) -> bool:
        """Whether some module has no fitting candidate."""
        return any(not c for c in self.by_module.values())


# --- Costing ----------------------------------------------------------------------------------------------------


def first_rank(problem: Problem, module: str, gpus: int, placement: Placement) -> int:
    """Global rank of the module's rank 0: colocated 0; disjoint, LLM 0 and the (single) encoder N - gpus."""
    if placement == "colocated" or module not in ENCODER_MODULES:
        return 0
    return problem.num_gpus - gpus


@functools.lru_cache(maxsize=64)
def _phase_positions(module_names: tuple[str, ...], module: str) -> tuple[int, tuple[tuple[str, int], ...]]:
    """(``module``'s position in data-flow order, (kind, its module's position) of each phase of the step)."""
    order = data_flow_order(module_names)
    return order.index(module), tuple((phase.kind, order.index(phase.module)) for phase in step_phases(order))


def cost_candidate(problem: Problem, module: str, strategy: ModuleStrategy, placement: Placement,
                   feeds_pipeline: bool = False) -> Candidate:
    """Cost ``strategy`` with the cost model and convert to the solver's integers (``feeds_pipeline``: an encoder
    in a plan whose LLM is pipelined)."""
    cost = placed_cost(problem, module, strategy, placement, feeds_pipeline)
    return as_candidate(problem, cost, placement, pipelined=feeds_pipeline or strategy.pp > 1)


def placed_cost(problem: Problem, module: str, strategy: ModuleStrategy, placement: Placement,
                feeds_pipeline: bool = False) -> ModuleCost:
    """The cost model's answer for ``module`` under ``strategy`` where ``placement`` puts it."""
    num_stages = 2 if placement == "disjoint" else 1
    return module_cost(
        problem.model,
        module,
        problem.cluster,
        problem.workload,
        strategy,
        placement=placement,
        precision=problem.precision,
        first_rank=first_rank(problem, module, strategy.gpus, placement),
        num_stages=num_stages,
        stage_index=num_stages - 1 if module == "llm" else 0,
        feeds_pipeline=feeds_pipeline,
        assumptions=problem.assumptions,
        layer_costs=problem.layer_costs,
    )


def as_candidate(problem: Problem, cost: ModuleCost, placement: Placement, *, pipelined: bool) -> Candidate:
    """The solver's integers of a module's cost (``pipelined``: part of a plan whose LLM is pipelined)."""
    if placement == "colocated":
        position, phases = _phase_positions(problem.model.module_names, cost.module)
        phase_bytes = tuple(alive_bytes(cost, position, kind, at) for kind, at in phases)
    else:
        phase_bytes = (own_peak_bytes(cost),)
    return Candidate(
        module=cost.module,
        cost=cost,
        step_ns=round((cost.micro_batches_s + cost.step_tail_s) * NS_PER_S),
        path_ns=tuple(round(t * NS_PER_S) for t in module_path_terms(cost)),
        tail_ns=round(cost.step_tail_s * NS_PER_S),
        phase_bytes=phase_bytes,
        pipelined=pipelined,
    )


# --- Pruning ----------------------------------------------------------------------------------------------------

_RECOMPUTE_ORDER = {name: i for i, name in enumerate(RECOMPUTE_CHOICES)}


def strategy_key(s: ModuleStrategy) -> tuple:
    """A total order on strategies, for deterministic tie-breaking (fewer GPUs, less parallelism first)."""
    return (s.gpus, s.grad_accum, s.pp, s.virtual_stages, s.pp_schedule, s.tp, s.sp, s.cp, s.dp, s.ep, s.zero,
            _RECOMPUTE_ORDER[s.recompute], s.micro_batch)


def solver_key(c: Candidate, placement: Placement) -> tuple[int, ...]:
    """The numbers the solver sees of a candidate besides its GPUs and grad_accum (all: smaller is better)."""
    if placement == "colocated":
        return c.step_ns, *c.phase_bytes
    return (*c.path_ns, c.tail_ns)


def pareto_front(cands: list[Candidate], placement: Placement) -> list[Candidate]:
    """Non-dominated candidates of one (module, gpus, grad_accum) group on ``solver_key``; of exact ties the one
    with less memory, then the smaller ``strategy_key``, is kept."""
    ordered = sorted(cands, key=lambda c: (*solver_key(c, placement), c.memory_bytes, strategy_key(c.strategy)))
    front: list[Candidate] = []
    keys: list[tuple[int, ...]] = []
    for c in ordered:  # a candidate can only be dominated by one sorted before it
        key = solver_key(c, placement)
        if not any(all(k <= v for k, v in zip(kept, key)) for kept in keys):
            front.append(c)
            keys.append(key)
    return front


def prune(cands: list[Candidate], placement: Placement) -> list[Candidate]:
    """Pareto-prune per (gpus, grad_accum, pipelined) group; result ordered best first (by step term or per-micro
    time)."""
    groups: dict[tuple[int, int, bool], list[Candidate]] = {}
    for c in cands:
        groups.setdefault((c.gpus, c.grad_accum, c.pipelined), []).append(c)
    kept = [c for group in groups.values() for c in pareto_front(group, placement)]
    return sorted(kept, key=lambda c: (*solver_key(c, placement), c.memory_bytes, strategy_key(c.strategy)))


def fits_alone(problem: Problem, c: Candidate) -> bool:
    """Whether the candidate fits a GPU by itself (plus the framework overhead)."""
    return c.memory_bytes + problem.overhead_bytes <= problem.usable_bytes


# --- Building ---------------------------------------------------------------------------------------------------


def cost_series(problem: Problem, module: str, series: list[ModuleStrategy], placement: Placement,
                feeds: tuple[bool, ...] = (False,)) -> list[Candidate]:
    """Cost a series of strategies differing only in micro-batch size, smallest first, stopping at the first whose
    weights + optimizer states + ONE micro-batch of activations do not fit: every larger micro-batch needs more
    (gradients are left out: with a single micro-batch per step they are not alive in the forward). An encoder is
    costed once and given as a candidate for each of ``feeds`` (an LLM that is not pipelined, is, or both;
    ``feeding_pipeline``)."""
    costed = []
    for s in series:
        cost = placed_cost(problem, module, s, placement)
        costed += [as_candidate(problem, feeding_pipeline(cost) if feed else cost, placement,
                                pipelined=feed or s.pp > 1) for feed in feeds]
        least = cost.weights_bytes + cost.optimizer_bytes + cost.activations_per_micro_batch_bytes
        if least + problem.overhead_bytes > problem.usable_bytes:
            break
    return costed


class ModuleCandidates(NamedTuple):
    """What ``module_candidates`` finds for one module."""

    kept: list[Candidate]
    """Fitting, non-dominated candidates."""
    smallest: Candidate | None
    """The least-memory valid candidate costed."""
    invalid: str | None
    """Why no strategy is valid (None if one is)."""
    costed: int
    """Strategies costed."""
    deferred: list[tuple[float, ModuleStrategy]]
    """Pipelined strategies left uncosted, with their floors (``Candidates.deferred``)."""
    deferred_cp: list["DeferredGroup"]
    """Context-parallel strategies left uncosted (``Candidates.deferred_cp``)."""


def module_candidates(
    problem: Problem,
    module: str,
    placement: Placement,
    fixed: Mapping[str, int | str],
    partners: Mapping[int, set[int]] | None = None,
    feeds: tuple[bool, ...] = (False,),
    floor: Callable[[ModuleStrategy], float] | None = None,
    limit_s: float = math.inf,
    verdicts: Verdicts | None = None,
    defer_cp: bool = False,
) -> ModuleCandidates:
    """The module's candidates on the GPU counts ``placement`` gives it.

    ``partners`` (disjoint): GPU count -> the grad_accum values the other group can match on the rest of the
    GPUs; other sizes and values cannot be part of a plan and are not costed. ``feeds`` (encoder): cost it for an
    LLM that is not pipelined, is, or both (``pipelined_options``). ``floor`` (pipelined LLM): a lower bound on
    the step of any plan holding a strategy; those above ``limit_s`` are deferred, not costed. ``verdicts``: the
    module's memoised ``check_strategy`` answers, shared with an earlier enumeration (``valid_accums``).
    ``defer_cp``: leave its context-parallel strategies uncosted, with lower bounds (``defer_context_parallel``).
    """
    sizes = group_sizes(problem, module, placement)
    if "gpus" in fixed:
        sizes = [g for g in sizes if g == fixed["gpus"]]
    verdicts = {} if verdicts is None else verdicts
    series, reason, context_parallel = [], None, [] if defer_cp else None
    for g in sizes:
        if partners is not None and g not in partners:
            continue
        more, why = module_strategies(problem, module, g, fixed, verdicts, None if partners is None else partners[g],
                                      context_parallel)
        series += more
        reason = reason or why
    valid = bool(series or context_parallel)
    if partners is not None and not valid:
        everywhere = [module_strategies(problem, module, g, fixed, verdicts) for g in sizes]
        if any(found for found, _ in everywhere):
            return ModuleCandidates([], None, None, 0, [], [])  # valid, but on no size the other group complements
        reason = next((why for _, why in everywhere if why), reason)
    invalid = None if valid else reason
    if not valid and reason is None:
        invalid = f"no {module} layout on {_sizes_text(sizes)} GPUs consumes the global batch of " \
                  f"{problem.workload.global_batch}" + "".join(f", {k}={v}" for k, v in sorted(fixed.items()))
    deferred, deferred_cp = [], []
    if floor is not None:
        series, deferred = _split_by_floor(series, floor, limit_s)
    if context_parallel:
        deferred_cp = defer_context_parallel(problem, module, context_parallel, placement, feeds)
    kept, smallest, costed = _cost_in_processes(problem, module, series, placement, feeds)
    return ModuleCandidates(kept, smallest, invalid, costed, deferred, deferred_cp)


FLOOR_SLACK_S = 1e-6
"""Slack when comparing a floor (float seconds) with a solved step (a sum of terms rounded to the nanosecond)."""


def _split_by_floor(series: list[list[ModuleStrategy]], floor: Callable[[ModuleStrategy], float], limit_s: float
                    ) -> tuple[list[list[ModuleStrategy]], list[tuple[float, ModuleStrategy]]]:
    """(``series`` without the pipelined strategies whose floor exceeds ``limit_s``, those with their floors)."""
    now, later = [], []
    for strategies in series:
        if strategies[0].pp == 1:
            now.append(strategies)
            continue
        kept = []
        for s in strategies:
            f = floor(s)
            if f <= limit_s + FLOOR_SLACK_S:
                kept.append(s)
            else:
                later.append((f, s))
        if kept:
            now.append(kept)
    return now, later


def _as_series(strategies: list[ModuleStrategy]) -> list[list[ModuleStrategy]]:
    """Strategies grouped into series that differ only in micro-batch size, ascending (``cost_series``)."""
    series: dict[tuple, list[ModuleStrategy]] = {}
    for s in strategies:
        key = (s.gpus, s.pp, s.pp_schedule, s.virtual_stages, s.dp, s.tp, s.sp, s.cp, s.ep, s.zero, s.recompute)
        series.setdefault(key, []).append(s)
    return [sorted(group, key=lambda s: s.micro_batch) for group in series.values()]


CostedShare = tuple[list[Candidate], Candidate | None, int]
"""(fitting pruned candidates, least-memory valid candidate, number costed) of some strategy series."""


def _cost_share(problem: Problem, module: str, series: list[list[ModuleStrategy]], placement: Placement,
                feeds: tuple[bool, ...]) -> CostedShare:
    """Cost ``series`` (``cost_series``) and keep what the solver and the explanations need."""
    costed = [c for s in series for c in cost_series(problem, module, s, placement, feeds)]
    smallest = min(costed, key=_memory_order, default=None)
    return prune([c for c in costed if fits_alone(problem, c)], placement), smallest, len(costed)


def _memory_order(c: Candidate) -> tuple:
    """Least memory first, then ``strategy_key`` (the feeding variants of one encoder strategy: as costed)."""
    return c.memory_bytes, strategy_key(c.strategy)


PARALLEL_MIN_STRATEGIES = 1000
"""Strategies (0.1-0.4 s of costing here) below which ``Problem.workers`` is ignored: forking would cost about as much
as it saves."""

_SHARED_WORK: tuple | None = None
"""The work of ``_in_processes``, inherited by its forked workers."""


def _in_processes(problem: Problem, work: Callable[[list], Any], items: list, size: int) -> list:
    """``work`` of every ``workers``-th item (sizes and layouts interleave, balancing the work) in each of
    ``problem.workers`` forked processes, or of all items here when ``size`` (strategies) is below
    ``PARALLEL_MIN_STRATEGIES``: the answers, one per share."""
    global _SHARED_WORK
    workers = problem.workers if size >= PARALLEL_MIN_STRATEGIES else 1
    if workers <= 1:
        return [work(items)]
    _SHARED_WORK = (work, items, workers)
    try:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            return pool.map(_share_of_worker, range(workers))
    finally:
        _SHARED_WORK = None


def _share_of_worker(index: int) -> Any:
    work, items, workers = _SHARED_WORK
    return work(items[index::workers])


def _cost_in_processes(problem: Problem, module: str, series: list[list[ModuleStrategy]], placement: Placement,
                       feeds: tuple[bool, ...]) -> CostedShare:
    """``_cost_share`` of all ``series``, split over ``problem.workers`` forked processes (each prunes its share,
    the union of the shares' Pareto fronts is pruned again, which gives the same front: the result equals the
    serial one)."""
    shares = _in_processes(problem, functools.partial(_cost_share, problem, module, placement=placement,
                                                      feeds=feeds), series, sum(map(len, series)))
    smallest = min((s for _, s, _ in shares if s is not None), key=_memory_order, default=None)
    return prune([c for kept, _, _ in shares for c in kept], placement), smallest, sum(n for _, _, n in shares)


def _read_only(mapping: dict) -> MappingProxyType:
    """A read-only view of ``mapping`` (how a worker's ``ModuleCost.sources`` are rebuilt)."""
    return MappingProxyType(mapping)


copyreg.pickle(MappingProxyType, lambda proxy: (_read_only, (dict(proxy),)))


def _sizes_text(sizes: list[int]) -> str:
    """``16``, ``8 or 12`` or ``1..15`` for messages."""
    if not sizes:
        return "no number of"
    if len(sizes) <= 3:
        return " or ".join(map(str, sizes))
    return f"{sizes[0]}..{sizes[-1]}"


def pipelined_options(problem: Problem, fixes: Fixes) -> tuple[bool, ...]:
    """Whether a plan's LLM can be pipelined: (False,) without PP in the space, (True,) with llm.pp pinned above 1,
    else both (encoders are then costed for either)."""
    pinned = fixes.get("llm", {}).get("pp")
    if "llm" not in problem.model.module_names or pinned == 1 or not (problem.searches_pp or pinned):
        return (False,)
    return (True,) if pinned else (False, True)


def build_candidates(problem: Problem, placement: Placement, fixes: Fixes | None = None, *,
                     pipeline_limit_s: float = math.inf, defer_cp: bool = False) -> Candidates:
    """The solver's input for ``placement``: every module's fitting, non-dominated candidates.

    Disjoint: the encoder is costed first; the LLM only on GPU counts and grad_accum values that some fitting
    encoder candidate complements (the groups must tile the cluster with one shared grad_accum), which is exact
    and skips most of the LLM's sizes (e.g. the encoder cannot use 24 or 48 nodes when the batch is a power of 2).

    ``pipeline_limit_s``: when the LLM may or may not be pipelined, its pipelined strategies whose plans cannot
    take less than this (solver seconds, ``pipeline_floor``) are deferred, not costed (``extend_pipelined``).
    ``defer_cp``: context-parallel strategies are deferred with lower bounds on their terms
    (``extend_context_parallel`` costs those whose plans could beat a limit).

    Raises:
        NotImplementedError: disjoint placement of a model with more than one encoder.
    """
    fixes = fixes or {}
    result = Candidates(placement=placement, by_module={})
    verdicts: dict[str, Verdicts] = {m: {} for m in problem.model.module_names}
    for module in sorted(problem.model.module_names, key=lambda m: m not in ENCODER_MODULES):
        partners = None if placement == "colocated" else _partners(problem, module, result, fixes, verdicts)
        feeds = pipelined_options(problem, fixes) if module in ENCODER_MODULES else (False,)
        bounded = module == "llm" and pipeline_limit_s < math.inf and pipelined_options(problem, fixes) == (False, True)
        found = module_candidates(problem, module, placement, fixes.get(module, {}), partners, feeds,
                                  floor=pipeline_floor(problem, result) if bounded else None,
                                  limit_s=pipeline_limit_s, verdicts=verdicts[module], defer_cp=defer_cp)
        result.by_module[module] = found.kept
        result.num_costed += found.costed
        result.deferred += found.deferred
        result.deferred_cp += found.deferred_cp
        if found.smallest is not None:
            result.smallest[module] = found.smallest
        if found.invalid is not None:
            result.invalid[module] = found.invalid
    result.by_module = {m: result.by_module[m] for m in problem.model.module_names}
    return result


def _partners(problem: Problem, module: str, cands: Candidates, fixes: Fixes, verdicts: Mapping[str, Verdicts]
              ) -> dict[int, set[int]] | None:
    """Disjoint: GPU count of ``module``'s group -> the grad_accum values the other group can match on the rest.
    The encoder (costed first) is matched with the other module's valid strategies (found without costing them),
    the other module with the encoder's fitting candidates and its deferred context-parallel ones that may fit; None
    for an encoder alone."""
    n = problem.num_gpus
    others = [m for m in problem.model.module_names if m not in ENCODER_MODULES]
    if module not in ENCODER_MODULES:
        partners: dict[int, set[int]] = {}
        encoder = encoder_names(problem.model)[0]
        fitting = [g for g in cands.deferred_cp if g.module == encoder and g.step_ns < math.inf]
        for c in [*cands.by_module[encoder], *fitting]:
            partners.setdefault(n - c.gpus, set()).add(c.grad_accum)
        return partners
    if len(others) != 1:
        return None
    other = others[0]
    return {n - g: valid_accums(problem, other, g, fixes.get(other, {}), verdicts[other])
            for g in group_sizes(problem, other, "disjoint")}


def pipeline_floor(problem: Problem, cands: Candidates) -> Callable[[ModuleStrategy], float]:
    """A lower bound, in solver seconds, on the step of any plan whose LLM takes a pipelined strategy: the LLM's
    ``pipelined_step_floor_s`` plus the least time the encoders' pipelined-world candidates of its grad_accum (and,
    disjoint, on the other GPUs) add to the objective -- colocated their step terms, disjoint the encoder's longest
    path term, since every path carries the pipelined LLM's whole step (``module_path_terms``); infinite when no
    encoder candidate fits there. ``cands`` holds the encoders' candidates (their deferred context-parallel ones
    by their lower bounds)."""
    encoders = [m for m in cands.by_module if m in ENCODER_MODULES]
    least: dict[tuple[int, int], int] = {}
    for module in encoders:
        fastest: dict[tuple[int, int], int] = {}
        deferred = [g for g in cands.deferred_cp if g.module == module and True in g.feeds]
        for c in [*(c for c in cands.by_module[module] if c.pipelined), *deferred]:
            term = c.step_ns if cands.placement == "colocated" else max(c.path_ns)
            key = (c.gpus, c.grad_accum)
            fastest[key] = min(fastest.get(key, term), term)
        least = fastest if module == encoders[0] else {k: v + least[k] for k, v in fastest.items() if k in least}

    def floor(s: ModuleStrategy) -> float:
        if encoders:
            partner = problem.num_gpus if cands.placement == "colocated" else problem.num_gpus - s.gpus
            if (partner, s.grad_accum) not in least:
                return math.inf
            encoder_s = least[partner, s.grad_accum] / NS_PER_S
        else:
            encoder_s = 0.0
        return encoder_s + pipelined_step_floor_s(problem.model, "llm", problem.cluster, problem.workload, s,
                                                  assumptions=problem.assumptions, layer_costs=problem.layer_costs)

    return floor


def extend_pipelined(problem: Problem, cands: Candidates, limit_s: float, *, fits_only: bool = False) -> int:
    """Cost the deferred pipelined strategies whose floor is at most ``limit_s`` and add their fitting,
    non-dominated candidates (pruning is per group, so the result is what costing them at first would give);
    returns how many were costed. ``fits_only``: only whether some plan fits is asked, so those that cannot fit
    are not costed even with no plan yet (``_may_fit_alone``)."""
    due = [s for f, s in cands.deferred if f <= limit_s + FLOOR_SLACK_S]
    cands.deferred = [(f, s) for f, s in cands.deferred if f > limit_s + FLOOR_SLACK_S]
    if math.isfinite(limit_s) or fits_only:  # those that cannot fit are never part of a (better) plan
        due = [s for s in due if _may_fit_alone(problem, s)]
    if not due:
        return 0
    kept, smallest, costed = _cost_in_processes(problem, "llm", _as_series(due), cands.placement, (False,))
    cands.by_module["llm"] = prune(cands.by_module["llm"] + kept, cands.placement)
    known = cands.smallest.get("llm")
    if smallest is not None:
        cands.smallest["llm"] = smallest if known is None else min(known, smallest, key=_memory_order)
    cands.num_costed += costed
    return costed


def _may_fit_alone(problem: Problem, s: ModuleStrategy, module: str = "llm") -> bool:
    """Whether a strategy's model states (``pipelined_state_floor_bytes``, with pp = 1 a module's whole states) leave
    it a chance to fit a GPU by itself; a pipelined one that cannot is skipped uncosted (~99 % of the pipelined
    strategies under a large MoE's floors).
    Left uncosted, it is not offered as the least-memory candidate (``Candidates.smallest``) either: only done when a
    plan exists, so no explanation of infeasibility needs it."""
    floor = pipelined_state_floor_bytes(problem.model, module, problem.cluster, problem.workload, s,
                                        precision=problem.precision, assumptions=problem.assumptions)
    return floor + problem.overhead_bytes <= problem.usable_bytes


# --- Context parallelism on demand ---------------------------------------------------------------------------------


class DeferredGroup(NamedTuple):
    """A module's context-parallel strategies that differ only in ZeRO stage and recomputation, left uncosted, with
    lower bounds on the solver's terms of every one of them: first the rough ``ring_share_floor_terms``, then, once a
    plan holding one could beat a limit, the tighter ``context_parallel_floor`` (``refined``)."""

    module: str
    group: SettingsGroup
    feeds: tuple[bool, ...]
    """The worlds it is a candidate in: feeding an LLM that is not pipelined, is, or both (``pipelined_options``;
    the LLM's own: not pipelined, since ``check_strategy`` refuses cp with pp)."""
    step_ns: float
    """At most the colocated step term of any of them that fits (infinite: none fits)."""
    path_ns: tuple[float, ...]
    """At most each disjoint path term of any of them that fits."""
    refined: bool
    """Whether the bounds are ``context_parallel_floor``'s."""

    @property
    def strategies(self) -> tuple[ModuleStrategy, ...]:
        return self.group.strategies()

    @property
    def gpus(self) -> int:
        return self.group.base.gpus

    @property
    def grad_accum(self) -> int:
        return self.group.base.grad_accum


NO_FIT = (math.inf, (math.inf,) * NUM_PATHS)
"""The bounds of a group none of whose strategies fits a GPU."""


def _floor_terms(per_micro_s: float, module: str, grad_accum: int) -> tuple[float, tuple[float, ...]]:
    """(colocated step term, disjoint path terms), in ns, at most those of ``grad_accum`` micro-batches of at least
    ``per_micro_s`` each: the hand-off and the step's tail are at least 0, and ``path_terms``' ``m P - min(F, P - F)``
    is least at the forward share ``F = P / 2``."""
    paths = path_terms(per_micro_s, per_micro_s / 2, grad_accum, stage="llm" if module == "llm" else "encoder")
    return math.floor(grad_accum * per_micro_s * NS_PER_S), tuple(math.floor(t * NS_PER_S) for t in paths)


def _least_states(problem: Problem, module: str, top: ModuleStrategy) -> tuple[float, float] | None:
    """(weights, optimizer) bytes of ``top`` -- a group's ``least_demanding`` strategy, whose model states are the
    least of its strategies' (``state_floor_bytes``) -- or None when those states alone leave no room in a GPU."""
    weights, gradients, optimizer = state_floor_bytes(problem.model, module, problem.cluster, problem.workload, top,
                                                      precision=problem.precision, assumptions=problem.assumptions)
    if weights + gradients + optimizer > problem.usable_bytes - problem.overhead_bytes:
        return None
    return weights, optimizer


def ring_share_floor_terms(problem: Problem, module: str, group: SettingsGroup, placement: Placement
                           ) -> tuple[float, tuple[float, ...]]:
    """Rough lower bounds, as ``context_parallel_floor``'s, at a fraction of its cost: ``grad_accum`` micro-batches
    of the group's lightest recomputation at ``ring_share_floor`` (infinite when its model states alone cannot fit).
    Analytical model only (a measured profile's times need not split as the analytical ones do)."""
    top = group.least_demanding()
    if _least_states(problem, module, top) is None:
        return NO_FIT
    per_micro = ring_share_floor(problem.model, module, problem.cluster, problem.workload, top,
                                 first_rank=first_rank(problem, module, top.gpus, placement),
                                 assumptions=problem.assumptions)
    return _floor_terms(per_micro, module, top.grad_accum)


def context_parallel_floor(problem: Problem, module: str, group: SettingsGroup, placement: Placement
                           ) -> tuple[float, tuple[float, ...]]:
    """(colocated step term, disjoint path terms), in ns, at most those of any strategy of ``group`` (one layout,
    experts and grad_accum; ZeRO stages and recomputations) that fits a GPU; infinite when none can. A strategy's
    model states are least under the group's highest ZeRO stage (``state_floor_bytes``) and its activations under its
    heaviest recomputation, and ZeRO does not change the micro-batches' time: so a recomputation whose weights and
    optimizer states at the highest stage plus its saved activations do not fit (``cost_series``' test) is never
    part of a plan, and the least time is ``grad_accum`` micro-batches of the lightest recomputation left
    (``per_micro_batch_floor``: recomputation only adds passes; ``_floor_terms``)."""
    top = group.least_demanding()
    least = _least_states(problem, module, top)
    if least is None:
        return NO_FIT
    weights, optimizer = least
    room = problem.usable_bytes - problem.overhead_bytes
    for recompute in sorted({rc for _, rc in group.settings}, key=_RECOMPUTE_ORDER.get):
        per_micro, saved = per_micro_batch_floor(
            problem.model, module, problem.cluster, problem.workload, replace(top, recompute=recompute),
            first_rank=first_rank(problem, module, top.gpus, placement), assumptions=problem.assumptions,
            layer_costs=problem.layer_costs)
        if weights + optimizer + saved <= room:
            return _floor_terms(per_micro, module, top.grad_accum)
    return NO_FIT


def defer_context_parallel(problem: Problem, module: str, groups: list[SettingsGroup], placement: Placement,
                           feeds: tuple[bool, ...]) -> list[DeferredGroup]:
    """``groups`` (``module_strategies``' context-parallel ones) with rough lower bounds
    (``ring_share_floor_terms``): one bound per (layout, experts, grad_accum) instead of a cost per ZeRO stage and
    recomputation as well, from layer sums shared by every ring size of a layout."""
    unbounded = [DeferredGroup(module, g, feeds, *NO_FIT, refined=False) for g in groups]
    if problem.layer_costs is not None:  # no rough bounds: context_parallel_floor's at once
        return refine_groups(problem, placement, unbounded)
    return _in_order(problem, functools.partial(_roughly_bounded, problem, placement), unbounded)


def _roughly_bounded(problem: Problem, placement: Placement, groups: list[DeferredGroup]) -> list[DeferredGroup]:
    return [g._replace(step_ns=step, path_ns=paths) for g in groups
            for step, paths in (ring_share_floor_terms(problem, g.module, g.group, placement),)]


def refine_groups(problem: Problem, placement: Placement, groups: list[DeferredGroup]) -> list[DeferredGroup]:
    """``groups`` with ``context_parallel_floor``'s bounds (in the worker processes when many)."""
    return _in_order(problem, functools.partial(_refined, problem, placement), groups)


def _in_order(problem: Problem, work: Callable[[list[DeferredGroup]], list[DeferredGroup]],
              groups: list[DeferredGroup]) -> list[DeferredGroup]:
    """``work`` of ``groups`` (one answer per group) in the worker processes when they hold many strategies
    (``_in_processes``), the answers in the groups' order."""
    shares = _in_processes(problem, work, groups, sum(len(g.group.settings) for g in groups))
    answers: list[DeferredGroup] = [None] * len(groups)  # type: ignore[list-item]
    for index, share in enumerate(shares):  # share i holds every len(shares)-th group from the i-th
        answers[index::len(shares)] = share
    return answers


def _refined(problem: Problem, placement: Placement, groups: list[DeferredGroup]) -> list[DeferredGroup]:
    return [g._replace(step_ns=step, path_ns=paths, refined=True) for g in groups
            for step, paths in (context_parallel_floor(problem, g.module, g.group, placement),)]


def extend_context_parallel(problem: Problem, cands: Candidates, limit_s: float, pipelined: bool | None = None, *,
                            fits_only: bool = False) -> int:
    """Cost the deferred context-parallel strategies of plans that could take at most ``limit_s`` (solver seconds;
    of plans whose LLM is ``pipelined`` when given) and add their fitting, non-dominated candidates; returns how many
    were costed. A group's plans take at least its lower bounds plus the least the other modules' candidates of its
    world add (``_plan_floor``), so what stays deferred belongs only to plans slower than ``limit_s``; the groups
    whose rough bounds let them under it are refined first (``refine_groups``), which may leave them out.
    ``fits_only``: only whether some plan fits is asked, so a group (or recomputation) whose bounds say none of its
    strategies fits a GPU (infinite) is not costed, even at an infinite limit; it stays deferred and is not offered
    as the least-memory candidate (``Candidates.smallest``)."""
    if not any(_in_world(g, pipelined) for g in cands.deferred_cp):
        return 0
    least = _refine_under(problem, cands, limit_s, pipelined)
    due = [g for g in cands.deferred_cp if _in_world(g, pipelined)
           and _under(problem, cands.placement, g, least, limit_s, pipelined, fits_only)]
    if not due:
        return 0
    costing = {id(g) for g in due}
    cands.deferred_cp = [g for g in cands.deferred_cp if id(g) not in costing]
    due, later = _split_by_recompute(problem, cands.placement, due, least, limit_s, pipelined, fits_only)
    cands.deferred_cp += later
    if not due:
        return 0
    costed = 0
    for module in dict.fromkeys(g.module for g in due):
        groups = [g for g in due if g.module == module]
        strategies = [s for g in groups for s in g.strategies]
        kept, smallest, count = _cost_in_processes(problem, module, _as_series(strategies), cands.placement,
                                                   groups[0].feeds)
        cands.by_module[module] = prune(cands.by_module[module] + kept, cands.placement)
        known = cands.smallest.get(module)
        if smallest is not None:
            cands.smallest[module] = smallest if known is None else min(known, smallest, key=_memory_order)
        costed += count
    cands.num_costed += costed
    return costed


def _split_by_recompute(problem: Problem, placement: Placement, groups: list[DeferredGroup], least: LeastTerms,
                        limit_s: float, pipelined: bool | None, fits_only: bool
                        ) -> tuple[list[DeferredGroup], list[DeferredGroup]]:
    """(the parts of ``groups`` to cost, the parts left deferred): each group split by recomputation, each part
    bounded on its own (``context_parallel_floor``: a heavier recomputation adds passes), and costed only when its
    plans could take at most ``limit_s`` (``_under``)."""
    now, later = [], []
    for group in groups:
        by_recompute: dict[str, list[tuple[int, str]]] = {}
        for zero, rc in group.group.settings:
            by_recompute.setdefault(rc, []).append((zero, rc))
        if len(by_recompute) == 1:
            now.append(group)
            continue
        for part in by_recompute.values():
            settings = SettingsGroup(group.group.base, tuple(part))
            step, paths = context_parallel_floor(problem, group.module, settings, placement)
            bounded = group._replace(group=settings, step_ns=step, path_ns=paths, refined=True)
            fits = _under(problem, placement, bounded, least, limit_s, pipelined, fits_only)
            (now if fits else later).append(bounded)
    return now, later


def _under(problem: Problem, placement: Placement, group: DeferredGroup, least: LeastTerms, limit_s: float,
           pipelined: bool | None, fits_only: bool) -> bool:
    """Whether plans holding one of ``group``'s strategies could take at most ``limit_s`` (``_plan_floor``); with
    ``fits_only``, also whether one of them could fit a GPU at all (its own bounds are finite: a group's partners
    may still come from strategies deferred elsewhere)."""
    if fits_only and math.isinf(group.step_ns):
        return False
    return _plan_floor(problem, placement, group, least, pipelined) <= limit_s + FLOOR_SLACK_S


def _refine_under(problem: Problem, cands: Candidates, limit_s: float, pipelined: bool | None) -> LeastTerms:
    """Refine the deferred groups whose rough bounds let their plans under ``limit_s``, one module at a time, the
    LLM first (refining one raises the least terms its partners' floors count, which may leave those out; the LLM's
    leave out more encoder groups than the other way round), until none is left; the least terms after."""
    least = _least_terms(cands, pipelined)
    modules = sorted({g.module for g in cands.deferred_cp}, key=lambda m: (m in ENCODER_MODULES, m))
    idle = 0
    while modules and idle < len(modules):
        module = modules[0]
        modules = modules[1:] + modules[:1]
        rough = [g for g in cands.deferred_cp if g.module == module and not g.refined and _in_world(g, pipelined)
                 and _plan_floor(problem, cands.placement, g, least, pipelined) <= limit_s + FLOOR_SLACK_S]
        idle = 0 if rough else idle + 1
        if rough:
            refined = dict(zip(map(id, rough), refine_groups(problem, cands.placement, rough)))
            cands.deferred_cp = [refined.get(id(g), g) for g in cands.deferred_cp]
            least = _least_terms(cands, pipelined)
    return least


def _in_world(group: DeferredGroup, pipelined: bool | None) -> bool:
    """Whether ``group`` is a candidate of plans whose LLM is ``pipelined`` (any plan's, when None)."""
    return pipelined is None or pipelined in group.feeds


def pipelined_floors(problem: Problem, cands: Candidates) -> list[float]:
    """The finite lower bounds, in solver seconds, of the plans with a pipelined LLM that strategies still deferred
    could be part of."""
    least = _least_terms(cands, True)
    floors = [f for f, _ in cands.deferred] + [_plan_floor(problem, cands.placement, g, least, True)
                                               for g in cands.deferred_cp if True in g.feeds]
    return [f for f in floors if f < math.inf]


LeastTerms = dict[str, dict[tuple[int, int, bool], tuple[float, tuple[float, ...]]]]
"""Module -> (gpus, grad_accum, pipelined world) -> (least step term, least of each path term) over its candidates
and its deferred groups' lower bounds."""


def _least_terms(cands: Candidates, pipelined: bool | None = None) -> LeastTerms:
    """``LeastTerms`` of ``cands`` (in the world of plans whose LLM is ``pipelined``, when given): each deferred
    group counts in every world it feeds."""
    least: LeastTerms = {m: {} for m in cands.by_module}
    terms = [((c.gpus, c.grad_accum, c.pipelined), c.module, c.step_ns, c.path_ns)
             for cs in cands.by_module.values() for c in cs if pipelined in (None, c.pipelined)]
    terms += [((g.gpus, g.grad_accum, world), g.module, g.step_ns, g.path_ns) for g in cands.deferred_cp
              for world in g.feeds if pipelined in (None, world)]
    for key, module, step, paths in terms:
        known = least[module].get(key)
        least[module][key] = (step, paths) if known is None else (
            min(known[0], step), tuple(map(min, known[1], paths)))
    return least


def _plan_floor(problem: Problem, placement: Placement, group: DeferredGroup, least: LeastTerms,
                pipelined: bool | None = None) -> float:
    """A lower bound, in solver seconds, on the step of any plan holding one of ``group``'s strategies (whose LLM is
    ``pipelined`` when given): its bounds plus the other modules' least terms in the same world (grad_accum,
    pipelining and, disjoint, the other GPUs) -- colocated the sum of step terms, disjoint the longest path (the
    tail is at least 0); infinite with no partner."""
    best = math.inf
    others = [m for m in least if m != group.module]
    partner = problem.num_gpus if placement == "colocated" else problem.num_gpus - group.gpus
    for world in (w for w in group.feeds if pipelined in (None, w)):
        found = [least[m].get((partner, group.grad_accum, world)) for m in others]
        if any(f is None for f in found):
            continue
        if placement == "colocated":
            ns = group.step_ns + sum(step for step, _ in found)
        else:
            ns = max(own + sum(paths[k] for _, paths in found) for k, own in enumerate(group.path_ns))
        best = min(best, ns / NS_PER_S)
    return best


def memory_front(cands: Iterable[Candidate]) -> list[Candidate]:
    """The candidates no other one beats on memory at every phase (ties: the first kept)."""
    front: list[Candidate] = []
    for c in sorted(cands, key=lambda c: c.phase_bytes):
        if not any(all(k <= v for k, v in zip(kept.phase_bytes, c.phase_bytes)) for kept in front):
            front.append(c)
    return front


def least_colocated_need(cands: Candidates) -> tuple[int, int] | None:
    """(grad_accum, bytes) of the colocated choice whose heaviest phase needs the least memory, overhead excluded
    (exact: over every combination of the modules' memory fronts at each grad_accum and pipelining they share);
    None when the modules have no such pair in common."""
    modules = list(cands.by_module)
    worlds = set.intersection(*({(c.grad_accum, c.pipelined) for c in cands.by_module[m]} for m in modules))
    best = None
    for ga, pipelined in sorted(worlds):
        fronts = [memory_front(c for c in cands.by_module[m] if (c.grad_accum, c.pipelined) == (ga, pipelined))
                  for m in modules]
        for combination in itertools.product(*fronts):
            need = max(map(sum, zip(*(c.phase_bytes for c in combination))))
            if best is None or need < best[1]:
                best = (ga, need)
    return best


def feasible(problem: Problem, cands: Candidates) -> bool:
    """Whether the solver's constraints can be met, decided directly from the candidates (no search): colocated,
    the least colocated need (``least_colocated_need``) fits; disjoint, some grad_accum and split of the N GPUs
    gives every group a fitting candidate."""
    if cands.empty:
        return False
    modules = list(cands.by_module)
    accums = set.intersection(*({c.grad_accum for c in cands.by_module[m]} for m in modules))
    if cands.placement == "colocated":
        least = least_colocated_need(cands)
        return least is not None and least[1] <= problem.usable_bytes - problem.overhead_bytes
    encoder, llm = modules
    for ga in accums:
        llm_sizes = {(c.gpus, c.pipelined) for c in cands.by_module[llm] if c.grad_accum == ga}
        if any((problem.num_gpus - c.gpus, c.pipelined) in llm_sizes for c in cands.by_module[encoder]
               if c.grad_accum == ga):
            return True
    return False
