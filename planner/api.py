"""The planner as functions: ``plan``, ``top_plans``, ``evaluate``, ``max_seq`` -> ``schema.Plan``.

The ``plan`` command is a thin layer over these. Every function takes the model (a catalog name, a config.json
path, a ``ModelSpec``) and its cluster (``ClusterInputs`` or a GPU count) plus the other sections of
``make_problem`` as keywords (``workload=``, ``dataset=``, ``search=``, ``assumptions=``; ``planner.inputs``), or a
ready ``Problem`` (``planner.problem``: inputs, defaults and bounds). User mistakes raise ``ValueError`` with one
line; ``Infeasible`` (a ValueError) explains a request no plan fits. The search is ``planner.search``, the Plan
document ``planner.plan_document``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable, Mapping

from planner.search.baselines import BaselineOutcome, baselines
from planner.search.candidates import Fixes
from planner.cost import estimate
from planner.contract.units import GIB
from planner.dataset import DatasetHistogram, read_dataset
from planner.inputs import DEFAULT_GPU, ClusterInputs, DatasetInputs, SearchOptions, WorkloadInputs
from planner.contract.models import ModelSpec
from planner.plan_document import build_plan
from planner.problem import (
    DEFAULT_FPS,
    MAX_AUDIO_SECONDS,
    MAX_GLOBAL_BATCH,
    MAX_GPUS,
    MAX_IMAGE_SIDE,
    MAX_IMAGES_PER_SAMPLE,
    MAX_TEXT_TOKENS,
    MAX_VIDEO_FRAMES,
    MAX_VISION_TOKENS,
    MIN_VIDEO_FRAMES,
    Problem,
    check_bounds,
    check_pipelined_dataset,
    make_problem,
    make_workload,
    model_folder_tokenizer,
    video_frames,
)
from planner.contract.schema import Plan, load_plan
from planner.search import MAX_TIME_LIMIT_S, check_time_limit, pipeline_alternative, solve_strategies
from planner.search.solver.explain import (
    Infeasible,
    candidates_or_error,
    clip_frame_bounds,
    clip_workload,
    explain_infeasible,
    longest_clip,
    longest_side,
    variant,
    vision_workload,
)
from planner.search.solver.fixes import fixed_text, parse_fixes, pinned_strategy, placements_to_solve
from planner.contract.strategy import Strategy

__all__ = [
    "ClusterInputs", "DEFAULT_FPS", "DEFAULT_GPU", "DatasetInputs", "Infeasible", "MAX_AUDIO_SECONDS",
    "MAX_GLOBAL_BATCH", "MAX_GPUS", "MAX_IMAGE_SIDE", "MAX_IMAGES_PER_SAMPLE", "MAX_TEXT_TOKENS", "MAX_TIME_LIMIT_S",
    "MAX_TOP_K", "MAX_VIDEO_FRAMES", "MAX_VISION_TOKENS", "MIN_VIDEO_FRAMES", "Problem", "SearchOptions",
    "WorkloadInputs", "check_bounds", "clip_frame_bounds", "evaluate", "load_plan", "make_problem", "make_workload",
    "max_seq", "model_folder_tokenizer", "parse_fixes", "plan", "top_plans", "video_frames",
]

MAX_TOP_K = 20
"""Largest --top-k."""


def _as_problem(model: str | ModelSpec | Problem, cluster: ClusterInputs | int | None,
                inputs: Mapping[str, Any]) -> Problem:
    if isinstance(model, Problem):
        if inputs or cluster is not None:
            raise TypeError("pass either a Problem or model inputs, not both")
        return model
    return make_problem(model, cluster, **inputs)


def top_plans(
    model: str | ModelSpec | Problem,
    cluster: ClusterInputs | int | None = None,
    *,
    k: int = 1,
    placement: str = "auto",
    fix: Iterable[str] | Mapping[str, Any] | None = None,
    time_limit_s: float | None = None,
    **inputs: Any,
) -> list[Plan]:
    """The ``k`` best distinct plans, best first (fewer if fewer exist). Fixes that pin every field evaluate that
    one strategy (status EVALUATED).

    Raises:
        ValueError: bad input; Infeasible (a ValueError) when no plan fits, with the explanation.
    """
    check_bounds("--top-k", k, 1, MAX_TOP_K)
    check_time_limit(time_limit_s)
    budgets = _pack_budget_problems(model, cluster, inputs)
    if budgets:
        return _best_over(budgets, k=k, placement=placement, fix=fix, time_limit_s=time_limit_s)
    problem = _as_problem(model, cluster, inputs)
    pinned_placement, fixes = parse_fixes(fix or (), problem.model, problem.num_gpus, allow_pp=problem.allow_pp)
    fixed = fixed_text(pinned_placement, fixes)
    pinned = pinned_strategy(problem, placement, pinned_placement, fixes)
    reference = baselines(problem)
    if pinned is not None:
        return [_evaluated(problem, pinned, fixed, reference)]
    ranked, alternative = solve_strategies(problem, placement, pinned_placement, fixes, k, time_limit_s)
    return [
        build_plan(problem, r.strategy, status=r.status, num_candidates=r.num_candidates, rank=i + 1, fixed=fixed,
                   reference={**reference, **pipeline_alternative(problem, alternative, ranked[0].strategy)},
                   objective_s=r.objective_s)
        for i, r in enumerate(ranked)
    ]


PACK_BUDGET_MULTIPLES = (1, 2, 4)
"""Pack budgets ``top_plans`` tries for a dataset without ``pack_tokens``: these multiples of the longest sample."""


def _pack_budget_problems(model: Any, cluster: ClusterInputs | int | None, inputs: dict[str, Any]) -> list[Problem]:
    """One problem per candidate pack budget for a dataset whose budget is left to the planner, else []."""
    dataset: DatasetInputs | None = inputs.get("dataset")
    if isinstance(model, Problem) or dataset is None or dataset.pack_tokens is not None or not dataset.pack:
        return []
    if not isinstance(dataset.source, DatasetHistogram):
        tokenizer = dataset.tokenizer if dataset.tokenizer is not None else model_folder_tokenizer(model)
        dataset = replace(dataset, source=read_dataset(dataset.source, tokenizer))
    first = make_problem(model, cluster, **{**inputs, "dataset": dataset})
    base = first.dataset.pack_tokens
    return [first] + [make_problem(model, cluster, **{**inputs, "dataset": replace(dataset, pack_tokens=base * m)})
                      for m in PACK_BUDGET_MULTIPLES[1:]]


def _best_over(problems: list[Problem], *, k: int, **solve: Any) -> list[Plan]:
    """The ``k`` plans of most LLM tokens per second over several problems (pack budgets), re-ranked; the first
    problem's infeasibility when none fits."""
    plans, first_error = [], None
    for problem in problems:
        try:
            plans += top_plans(problem, k=k, **solve)
        except Infeasible as e:
            first_error = first_error or e
    if not plans:
        raise first_error
    plans.sort(key=lambda p: -p.predicted.tokens_per_s)
    return [p.model_copy(update={"solver": p.solver.model_copy(update={"rank": i + 1})})
            for i, p in enumerate(plans[:k])]


def plan(
    model: str | ModelSpec | Problem,
    cluster: ClusterInputs | int | None = None,
    *,
    placement: str = "auto",
    fix: Iterable[str] | Mapping[str, Any] | None = None,
    time_limit_s: float | None = None,
    **inputs: Any,
) -> Plan:
    """The fastest plan that fits (proven optimal within the strategy space unless the time limit stops CP-SAT).

    Example: ``plan("qwen-vl-32b", 16, fix=["llm.tp=8"], workload=WorkloadInputs(image_sizes=[(1792, 1792)]))``.

    Raises:
        ValueError: bad input; Infeasible (a ValueError) when no plan fits, with the explanation.
    """
    return top_plans(model, cluster, k=1, placement=placement, fix=fix, time_limit_s=time_limit_s, **inputs)[0]


def _evaluated(problem: Problem, strategy: Strategy, fixed: Mapping[str, str],
               reference: Mapping[str, BaselineOutcome]) -> Plan:
    if "llm" in strategy.modules:
        check_pipelined_dataset(problem, strategy.modules["llm"].pp, strategy.modules["llm"].sp)
    _check_fits(problem, strategy)
    return build_plan(problem, strategy, status="EVALUATED", num_candidates=1, fixed=fixed, reference=reference)


def _check_fits(problem: Problem, strategy: Strategy) -> None:
    """Raise Infeasible, with the breakdown, when an evaluated strategy does not fit."""
    e = estimate(problem.model, problem.cluster, problem.workload, strategy, problem.assumptions, problem.layer_costs)
    if not e.fits:
        raise Infeasible(
            f"this strategy does not fit: {e.peak_group} GPUs need {e.peak_memory_bytes / GIB:.1f} GiB "
            f"({e.peak_breakdown.describe()}) of {e.usable_memory_bytes / GIB:.1f} GiB usable, "
            f"{(e.peak_memory_bytes - e.usable_memory_bytes) / GIB:.1f} GiB over"
        )


def evaluate(model: str | ModelSpec | Problem, strategy: Strategy, cluster: ClusterInputs | int | None = None,
             **inputs: Any) -> Plan:
    """The Plan of one exact strategy (status EVALUATED), e.g. a hand-made layout; ``cluster`` defaults to the
    strategy's GPUs of the default hardware.

    Raises:
        ValueError: the strategy breaks a validity rule; Infeasible when it does not fit in memory.
    """
    if cluster is None and not isinstance(model, Problem):
        cluster = strategy.num_gpus
    problem = _as_problem(model, cluster, inputs)
    return _evaluated(problem, strategy, {}, baselines(problem))


def with_max_seq_margin(problem: Problem) -> Problem:
    """``problem`` with ``max_seq_memory_margin`` of its usable memory held back (how the longest sequences are
    searched, for the planner's plans and the baselines alike)."""
    a = problem.assumptions
    return replace(problem, assumptions=replace(
        a, usable_memory_fraction=a.usable_memory_fraction * (1 - a.max_seq_memory_margin)))


def max_seq(
    model: str | ModelSpec | Problem,
    cluster: ClusterInputs | int | None = None,
    *,
    placement: str = "auto",
    fix: Iterable[str] | Mapping[str, Any] | None = None,
    time_limit_s: float | None = None,
    **inputs: Any,
) -> Plan:
    """The plan at the longest sequence any plan fits at the given batch in all but ``max_seq_memory_margin`` of
    the usable memory (the cost model's error at the edge). A workload with clips: its last clip lengthened to the
    most frames that fit (``longest_clip``: whole temporal groups, at its frame size; ``plan.workload.videos``
    holds it); otherwise one square merge-aligned image (``plan.workload.vision_tokens``).

    Raises:
        ValueError: not a vision model, a dataset, or bad input; Infeasible when even the smallest image or the
        shortest clip does not fit.
    """
    check_time_limit(time_limit_s)
    problem = with_max_seq_margin(_as_problem(model, cluster, inputs))
    if problem.dataset is not None:
        raise ValueError("--max-seq lengthens one sample shape (an image or a clip); a --dataset gives its samples' "
                         "own (the plan already picks its pack budget): drop one of them")
    if problem.model.vision_input is None:
        raise ValueError(f"--max-seq searches image sequence lengths; {problem.model.name} has no vision encoder")
    pinned, fixes = parse_fixes(fix or (), problem.model, problem.num_gpus, allow_pp=problem.allow_pp)
    placements = placements_to_solve(problem, placement, pinned, fixes)
    longest = _longest_clip_problem(problem, placements, fixes) if problem.workload.videos else \
        _longest_image_problem(problem, placements, fixes)
    return plan(longest, placement=placement, fix=fix, time_limit_s=time_limit_s)


def _longest_image_problem(problem: Problem, placements: list[str], fixes: Fixes) -> Problem:
    """``problem`` with one square image of the longest side that fits; Infeasible when the smallest does not."""
    side = longest_side(problem, placements, fixes)
    if side is None:
        smallest = variant(problem, workload=vision_workload(problem, problem.model.vision_input.spatial_merge_size))
        raise Infeasible(explain_infeasible(smallest, candidates_or_error(smallest, placements, fixes), fixes))
    return variant(problem, workload=vision_workload(problem, side))


def _longest_clip_problem(problem: Problem, placements: list[str], fixes: Fixes) -> Problem:
    """``problem`` with its last clip at the most frames that fit; Infeasible when the shortest clip does not."""
    frames = longest_clip(problem, placements, fixes)
    if frames is None:
        shortest = variant(problem, workload=clip_workload(problem, clip_frame_bounds(problem.model)[0]))
        raise Infeasible(explain_infeasible(shortest, candidates_or_error(shortest, placements, fixes), fixes))
    return variant(problem, workload=clip_workload(problem, frames))
