"""Reference strategies costed by the same cost model as the plan, so the speed-up compares like with like.

* ``uniform_tp``: every module with the same TP degree across the GPUs, DP over the rest, colocated -- how
  Megatron-LM runs a VLM. Best over TP degree, ZeRO 0/1 (Megatron's distributed optimizer), recompute and
  micro-batch, the same settings for every module (one command line).
* ``zero3``: pure sharded data parallelism (FSDP / ZeRO-3 on all GPUs, tp = sp = cp = 1), colocated. Best over
  recompute and micro-batch.
* ``megatron``: what a Megatron-LM user configures for a large model: TP inside the node, the LLM pipelined (1F1B)
  across the GPUs' blocks, DP over the rest (Narayanan et al. 2021, Sec. 3.3: "use tensor parallelism up to the
  GPUs of a server, then pipeline parallelism across servers"); the vision tower with the same TP and data
  parallel over all GPUs (it is small). Best over TP, PP (> 1), ZeRO 0/1, recompute and micro-batch; an LLM with
  mixture-of-experts layers also over its expert-parallel degree, whole experts split over EP groups of ep ranks of
  each stage's DP group with all their TP ranks (Megatron-LM's TP x EP x PP, Narayanan et al. 2021, with Megatron-Core's
  MoE parallel folding at expert-TP 1, whose EP group folds the TP ranks: Liu et al. 2025, "MoE Parallel Folding").
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable

from planner.cost import Estimate, check_strategy
from planner.search.enumeration import divisors
from planner.problem import Problem
from planner.cost.estimate import combine, module_costs, step_time_s
from planner.contract.units import GIB
from planner.contract.strategy import RECOMPUTE_CHOICES, ModuleStrategy, Strategy

BASELINE_DESCRIPTIONS = {
    "uniform_tp": "uniform TP: every module with the same TP degree, DP over the rest, colocated (Megatron-style)",
    "zero3": "ZeRO-3: pure sharded data parallelism on all GPUs, colocated (FSDP-style)",
    "megatron": "Megatron-style: TP inside a node, the LLM pipelined (1F1B) across nodes, DP over the rest (MoE: "
                "whole experts over EP ranks of the DP group x TP)",
    "without_pp": "the planner's best plan without pipeline parallelism (pp = 1)",
    "with_pp": "the planner's best plan with the LLM pipelined (pp > 1)",
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


def megatron_family(problem: Problem) -> Iterable[Strategy]:
    """Every (tp dividing a node, pp > 1 up to the decoder layers, zero <= 1, recompute, micro-batch): the LLM
    PP x DP x TP with 1F1B (at least pp micro-batches; with experts, every EP degree ``check_strategy`` allows: ep
    dividing dp, ep x tp the experts),
    every other module DP x TP on all GPUs."""
    n, batch = problem.num_gpus, problem.workload.global_batch
    if "llm" not in problem.model.module_names:
        return
    llm_spec = problem.model.module("llm")
    layers = sum(layer.count for layer in llm_spec.layers if layer.kind == "decoder_layer")
    experts = next((layer.moe.num_experts for layer in llm_spec.layers if layer.moe is not None), 1)
    expert_degrees = divisors(experts)
    for tp in divisors(problem.cluster.devices_per_node):
        if n % tp:
            continue
        for pp in (d for d in divisors(n // tp) if 1 < d <= layers):
            dp = n // (tp * pp)
            if batch % (dp * pp):
                continue
            for ga in (g for g in divisors(batch // (dp * pp)) if g >= pp):
                for zero, rc, ep in itertools.product((0, 1), RECOMPUTE_CHOICES, expert_degrees):
                    if dp % ep == 0:
                        llm = ModuleStrategy(dp=dp, tp=tp, pp=pp, ep=ep, zero=zero, recompute=rc,
                                             micro_batch=batch // (dp * ga), grad_accum=ga)
                        other = ModuleStrategy(dp=dp * pp, tp=tp, zero=zero, recompute=rc,
                                               micro_batch=batch // (dp * pp * ga), grad_accum=ga)
                        yield Strategy(placement="colocated", precision=problem.precision,
                                       modules={m: llm if m == "llm" else other for m in problem.model.module_names})


MEGATRON_EMPTY = ("no TP x PP layout gives every pipeline stage at least pp micro-batches per step with the vision "
                  "tower data-parallel over all GPUs (raise the global batch)")
"""Why the Megatron-style family can be empty."""


def best_of(problem: Problem, name: str, family: Iterable[ModuleStrategy | Strategy],
            empty_reason: str | None = None) -> BaselineOutcome:
    """The fastest fitting member of ``family`` (a module strategy used by every module, or whole strategies;
    ties: the first), or the reason none fits (``empty_reason`` when the family has no member)."""
    best: Estimate | None = None
    smallest: Estimate | None = None
    reason = None
    for member in family:
        strategy = member if isinstance(member, Strategy) else _uniform(problem, member)
        problems = [p for m, s in strategy.modules.items()
                    for p in check_strategy(problem.model, m, s, problem.cluster, problem.workload)]
        if problems:
            reason = reason or problems[0]
            continue
        costs = module_costs(problem.model, problem.cluster, problem.workload, strategy, problem.assumptions,
                             problem.layer_costs)
        if best is not None and step_time_s(strategy.placement, costs, problem.assumptions) >= best.step_time_s:
            continue  # no faster than a fitting member: neither the best nor, one fitting, the smallest needed
        e = combine(problem.model, problem.cluster, problem.workload, strategy.placement, costs, problem.assumptions)
        if smallest is None or e.peak_memory_bytes < smallest.peak_memory_bytes:
            smallest = e
        if e.fits and (best is None or e.step_time_s < best.step_time_s):
            best = e
    if best is not None:
        return BaselineOutcome(name=name, estimate=best)
    if smallest is not None:
        s = smallest.modules.get("llm", next(iter(smallest.modules.values()))).strategy
        return BaselineOutcome(name=name, estimate=None, infeasible=(
            f"does not fit: needs at least {smallest.peak_memory_bytes / GIB:.1f} GiB per GPU ({s.describe()}) "
            f"of {smallest.usable_memory_bytes / GIB:.1f} GiB usable"
        ))
    if reason is None:
        reason = empty_reason or (f"the global batch of {problem.workload.global_batch} does not divide over "
                                  f"{problem.num_gpus} GPUs' data-parallel ranks")
    return BaselineOutcome(name=name, estimate=None, infeasible=f"not applicable: {reason}")


def baselines(problem: Problem) -> dict[str, BaselineOutcome]:
    """Every baseline of ``problem``."""
    return {
        "uniform_tp": best_of(problem, "uniform_tp", uniform_tp_family(problem)),
        "zero3": best_of(problem, "zero3", zero3_family(problem)),
        "megatron": best_of(problem, "megatron", megatron_family(problem), MEGATRON_EMPTY),
    }
