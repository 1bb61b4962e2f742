"""Reference strategies costed by the same cost model as the plan, so the speed-up compares like with like.

* ``uniform_tp``: every module with the same TP degree across the GPUs, DP over the rest, colocated -- how
  Megatron-LM runs a VLM. Best over TP degree, ZeRO 0/1 (Megatron's distributed optimizer), recompute and
  micro-batch, the same settings for every module (one command line).
* ``zero3``: pure sharded data parallelism (FSDP / ZeRO-3 on all GPUs, tp = sp = cp = 1), colocated. Best over
  recompute and micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from planner.candidates import Problem, divisors
from planner.cost import Estimate, check_strategy, estimate
from planner.cost.results import GIB
from planner.strategy import RECOMPUTE_CHOICES, ModuleStrategy, Strategy

BASELINE_DESCRIPTIONS = {
    "uniform_tp": "uniform TP: every module with the same TP degree, DP over the rest, colocated (Megatron-style)",
    "zero3": "ZeRO-3: pure sharded data parallelism on all GPUs, colocated (FSDP-style)",
}
"""Baseline name -> one line for tables and the plan file."""


@dataclass(kw_only=True, frozen=True)
class BaselineOutcome:
    """The best fitting strategy of a baseline family, or why none fits."""

    name: str
    """uniform_tp or zero3."""
    estimate: Estimate | None
    """Its prediction; None when it does not fit."""
    infeasible: str | None = None
    """Why no member fits, in one line; None when one does."""


def _uniform(problem: Problem, s: ModuleStrategy) -> Strategy:
    """The same module strategy for every module, colocated."""
    return Strategy(placement="colocated", modules={m: s for m in problem.model.module_names},
                    precision=problem.precision)


def uniform_tp_family(problem: Problem) -> Iterable[ModuleStrategy]:
    """Every (tp, zero <= 1, recompute, micro-batch) with tp dividing a node and the GPUs, dp = N / tp."""
    n, batch = problem.num_gpus, problem.workload.global_batch
    for tp in divisors(problem.cluster.devices_per_node):
        dp = n // tp
        if n % tp or batch % dp:
            continue
        for ga in divisors(batch // dp):
            for zero in (0, 1):
                for rc in RECOMPUTE_CHOICES:
                    yield ModuleStrategy(dp=dp, tp=tp, zero=zero, recompute=rc, micro_batch=batch // (dp * ga),
                                         grad_accum=ga)


def zero3_family(problem: Problem) -> Iterable[ModuleStrategy]:
    """Every (recompute, micro-batch) of dp = N, ZeRO-3."""
    n, batch = problem.num_gpus, problem.workload.global_batch
    if batch % n:
        return
    for ga in divisors(batch // n):
        for rc in RECOMPUTE_CHOICES:
            yield ModuleStrategy(dp=n, zero=3, recompute=rc, micro_batch=batch // (n * ga), grad_accum=ga)


def best_of(problem: Problem, name: str, family: Iterable[ModuleStrategy]) -> BaselineOutcome:
    """The fastest fitting member of ``family`` (ties: the first), or the reason none fits."""
    best: Estimate | None = None
    smallest: Estimate | None = None
    reason = None
    for s in family:
        problems = [p for m in problem.model.module_names
                    for p in check_strategy(problem.model, m, s, problem.cluster, problem.workload)]
        if problems:
            reason = reason or problems[0]
            continue
        e = estimate(problem.model, problem.cluster, problem.workload, _uniform(problem, s),
                     problem.assumptions, problem.layer_costs)
        if smallest is None or e.peak_memory_bytes < smallest.peak_memory_bytes:
            smallest = e
        if e.fits and (best is None or e.step_time_s < best.step_time_s):
            best = e
    if best is not None:
        return BaselineOutcome(name=name, estimate=best)
    if smallest is not None:
        s = next(iter(smallest.modules.values())).strategy
        return BaselineOutcome(name=name, estimate=None, infeasible=(
            f"does not fit: needs at least {smallest.peak_memory_bytes / GIB:.1f} GiB per GPU ({s.describe()}) "
            f"of {smallest.usable_memory_bytes / GIB:.1f} GiB usable"
        ))
    if reason is None:
        reason = (f"the global batch of {problem.workload.global_batch} does not divide over "
                  f"{problem.num_gpus} GPUs' data-parallel ranks")
    return BaselineOutcome(name=name, estimate=None, infeasible=f"not applicable: {reason}")


def baselines(problem: Problem) -> dict[str, BaselineOutcome]:
    """Both baselines of ``problem``."""
    return {
        "uniform_tp": best_of(problem, "uniform_tp", uniform_tp_family(problem)),
        "zero3": best_of(problem, "zero3", zero3_family(problem)),
    }
