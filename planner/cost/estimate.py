"""Public entry points: per-module cost under one ModuleStrategy, and its combination into a plan estimate.

The combination rules are linear in per-module quantities (sums, and one max per quantity), so a CP-SAT model
with one boolean per (module, candidate) reproduces ``combine`` exactly:

* colocated: ``step = sum_m (grad_accum * per_micro_batch_m + bubble_m + tail_m)`` where ``tail = dp_comm +
  optimizer`` (``ModuleCost.step_tail_s``) and ``bubble`` is a pipelined module's fill and drain (0 without PP);
  ``memory = max_phase sum_m alive_m(phase) + overhead``, what each module holds at each moment of the step
  (``planner.cost.phases``). Encoders feeding a pipelined LLM run every micro-batch's forward before its schedule
  and every backward after it, so they hold ``grad_accum`` micro-batches' activations (either placement).
* disjoint (encoders -> LLM, 1F1B over grad_accum micro-batches as the runtime schedules them):
  ``step = max_k (encoder_term_k + llm_term_k) + max_m tail_m``, the longest of the schedule's critical paths
  (``planner.cost.pipeline``), each a sum of per-module terms; each group's memory is its own module's plus the
  overhead at the group's own peak moment.

Both add the constant ``step_overhead_s`` (``planner.search`` adds it to the solver's objective, which leaves it out).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from planner.cost.assumptions import DEFAULT_ASSUMPTIONS, CostAssumptions
from planner.cost.layer_costs import LayerCostSource
from planner.cost.module import module_cost
from planner.cost.phases import PHASE_KINDS, Phase, alive, alive_bytes, data_flow_order, own_phases, step_phases
from planner.cost.pipeline import NUM_PATHS, path_terms, pipeline_step_time
from planner.cost.results import Estimate, MemoryBreakdown, ModuleCost
from planner.cost.validity import check_strategy
from planner.contract.hardware import Cluster
from planner.contract.models import ModelSpec
from planner.contract.strategy import Placement, Strategy
from planner.contract.workload import Workload, module_tokens
from planner.contract.units import GIB

__all__ = ["Estimate", "MemoryBreakdown", "ModuleCost", "combine", "estimate", "module_cost"]


def combine(
    model: ModelSpec,
    cluster: Cluster,
    workload: Workload,
    placement: Placement,
    costs: Mapping[str, ModuleCost],
    assumptions: CostAssumptions = DEFAULT_ASSUMPTIONS,
) -> Estimate:
    """Combine per-module costs into a plan estimate with the linear rules of this module's docstring."""
    step = step_time_s(placement, costs, assumptions)
    if placement == "colocated":
        phase, memory = colocated_peak(costs, assumptions)
        groups, phases = {"all": memory}, {"all": phase}
        num_gpus = max(c.strategy.gpus for c in costs.values())
    else:
        peaks = {name: disjoint_peak(c, assumptions) for name, c in costs.items()}
        groups = {name: memory for name, (_, memory) in peaks.items()}
        phases = {name: phase for name, (phase, _) in peaks.items()}
        num_gpus = sum(c.strategy.gpus for c in costs.values())
    peak_group = max(groups, key=lambda g: groups[g].total)
    peak = groups[peak_group]
    usable = int(cluster.device.memory_bytes * assumptions.usable_memory_fraction)
    llm_tokens = module_tokens(workload, model)["llm"].tokens
    flops = sum(c.flops_per_step for c in costs.values())
    fits = peak.total <= usable
    return Estimate(
        stage_peaks=stage_peaks(placement, costs, assumptions),
        placement=placement,
        step_time_s=step,
        tokens_per_s=workload.global_batch * llm_tokens / step,
        samples_per_s=workload.global_batch * workload.samples_per_unit / step,
        mfu=flops / (step * num_gpus * cluster.device.peak_bf16_flops),
        num_gpus=num_gpus,
        peak_memory_bytes=peak.total,
        peak_group=peak_group,
        peak_phase=phases[peak_group],
        peak_breakdown=peak,
        memory_per_group=groups,
        usable_memory_bytes=usable,
        fits=fits,
        binding_constraint=_binding_constraint(placement, costs, peak_group, peak, usable, fits),
        modules=dict(costs),
    )


def step_time_s(placement: Placement, costs: Mapping[str, ModuleCost], assumptions: CostAssumptions) -> float:
    """The step time of ``combine`` alone (the rules of this module's docstring), overhead included."""
    if placement == "colocated":
        step = sum(c.micro_batches_s + c.step_tail_s for c in costs.values())
    elif placement == "disjoint":
        step = pipeline_step_time(*stage_terms(costs)) + max(c.step_tail_s for c in costs.values())
    else:
        raise ValueError(f"placement must be colocated or disjoint, got {placement!r}")
    return step + assumptions.step_overhead_s


def module_path_terms(cost: ModuleCost) -> tuple[float, ...]:
    """The module's terms of the disjoint pipeline's critical paths: the LLM is the second stage, encoders the
    first (``planner.cost.pipeline.path_terms``). A pipelined LLM runs its schedule over every micro-batch once
    the encoders' forwards are done, and they run their backwards after it: its step is on every path, whose
    longest is then the encoders' ``m P`` plus it (exact for that sequence)."""
    if cost.stage_costs:
        return (cost.micro_batches_s,) * NUM_PATHS
    stage = "llm" if cost.module == "llm" else "encoder"
    return path_terms(cost.per_micro_batch_s, cost.forward_per_micro_batch_s, cost.strategy.grad_accum, stage=stage)


def stage_terms(costs: Mapping[str, ModuleCost]) -> tuple[list[float], list[float]]:
    """(encoder stage, LLM stage) shares of the disjoint pipeline's critical paths (``planner.cost.pipeline``);
    several encoders form one stage (their terms are summed)."""
    terms = {name: module_path_terms(c) for name, c in costs.items()}
    encoders = [t for name, t in terms.items() if name != "llm"]
    return [sum(column) for column in zip(*encoders)], list(terms["llm"])


def _overhead(assumptions: CostAssumptions) -> MemoryBreakdown:
    return MemoryBreakdown(
        weights=0, gradients=0, optimizer=0, activations=0, buffers=0, overhead=assumptions.framework_overhead_bytes
    )


def colocated_peak(costs: Mapping[str, ModuleCost], assumptions: CostAssumptions) -> tuple[str, MemoryBreakdown]:
    """(phase name, per-GPU memory plus the overhead) of the step's heaviest moment when every GPU runs every
    module; of equal totals the earliest phase (found on the totals, ``alive_bytes``; only its breakdown is built)."""
    order = data_flow_order(list(costs))
    phases = step_phases(order)
    totals = [sum(alive_bytes(costs[name], position, phase.kind, order.index(phase.module))
                  for position, name in enumerate(order)) for phase in phases]
    phase = phases[totals.index(max(totals))]
    at = order.index(phase.module)
    total = _overhead(assumptions)
    for position, name in enumerate(order):
        total = total + alive(costs[name], position, phase, at)
    return phase.name, total


def stage_peaks(placement: Placement, costs: Mapping[str, ModuleCost], assumptions: CostAssumptions
                ) -> tuple[tuple[str, MemoryBreakdown], ...]:
    """(phase, per-GPU memory plus the overhead) of each pipeline stage's GPUs at their heaviest moment when the
    LLM is pipelined, else (): ``colocated_peak`` or ``disjoint_peak`` with the LLM as that stage alone."""
    llm = costs.get("llm")
    if llm is None or not llm.stage_costs:
        return ()
    peaks = []
    for stage in llm.rank_costs():
        alone = replace(llm, stage_costs=(stage,))
        peaks.append(colocated_peak({**costs, "llm": alone}, assumptions) if placement == "colocated"
                     else disjoint_peak(alone, assumptions))
    return tuple(peaks)


def disjoint_peak(cost: ModuleCost, assumptions: CostAssumptions) -> tuple[str, MemoryBreakdown]:
    """(phase name, per-GPU memory plus the overhead) of a group holding one module, at its heaviest moment."""
    memories = own_phases(cost)
    index = max(range(len(memories)), key=lambda i: (memories[i].total, -i))
    return Phase(cost.module, PHASE_KINDS[index]).name, _overhead(assumptions) + memories[index]


def _binding_constraint(
    placement: Placement,
    costs: Mapping[str, ModuleCost],
    peak_group: str,
    peak: MemoryBreakdown,
    usable: int,
    fits: bool,
) -> str:
    """One line naming what limits the plan: memory if it does not fit, else the largest time component."""
    if not fits:
        return f"memory: {peak_group} GPUs need {peak.total / GIB:.1f} GiB of {usable / GIB:.1f} GiB usable"
    if placement == "disjoint":
        name = max(costs, key=lambda m: costs[m].per_micro_batch_s)
        lead = f"pipeline: {name} stage is the slowest ({costs[name].per_micro_batch_s * 1e3:.1f} ms per micro-batch)"
    else:
        name = max(costs, key=lambda m: costs[m].micro_batches_s + costs[m].step_tail_s)
        lead = f"time: {name} takes the most of the step"
    parts = costs[name].time_parts()
    part = max(parts, key=parts.get)
    share = parts[part] / max(sum(parts.values()), 1e-30)
    return f"{lead}; {part} is {share:.0%} of its time"


def estimate(
    model: ModelSpec,
    cluster: Cluster,
    workload: Workload,
    strategy: Strategy,
    assumptions: CostAssumptions = DEFAULT_ASSUMPTIONS,
    layer_costs: LayerCostSource | None = None,
) -> Estimate:
    """Cost a whole-model strategy: validate it, cost every module, combine.

    Raises:
        ValueError: With one line per broken rule when the strategy is invalid for this model and cluster.
    """
    if set(strategy.modules) != set(model.module_names):
        raise ValueError(
            f"strategy covers modules {sorted(strategy.modules)} but model {model.name} has "
            f"{sorted(model.module_names)}"
        )
    if strategy.num_gpus > cluster.num_devices:
        raise ValueError(f"strategy uses {strategy.num_gpus} GPUs but the cluster has {cluster.num_devices}")
    problems = [
        f"{name}: {reason}"
        for name, s in strategy.modules.items()
        for reason in check_strategy(model, name, s, cluster, workload)
    ]
    problems += [f"{name}: pp={s.pp}; pipeline parallelism is planned for the LLM only"
                 for name, s in strategy.modules.items() if name != "llm" and s.pp > 1]
    if problems:
        raise ValueError("; ".join(problems))
    return combine(model, cluster, workload, strategy.placement,
                   module_costs(model, cluster, workload, strategy, assumptions, layer_costs), assumptions)


def module_costs(model: ModelSpec, cluster: Cluster, workload: Workload, strategy: Strategy,
                 assumptions: CostAssumptions = DEFAULT_ASSUMPTIONS, layer_costs: LayerCostSource | None = None
                 ) -> dict[str, ModuleCost]:
    """Every module's cost under a valid whole-model strategy (``estimate`` without its checks and ``combine``)."""
    pipelined = strategy.modules["llm"].pp > 1 if "llm" in strategy.modules else False
    firsts = strategy.first_ranks()
    num_stages = 2 if strategy.placement == "disjoint" else 1
    return {
        name: module_cost(
            model,
            name,
            cluster,
            workload,
            s,
            placement=strategy.placement,
            precision=strategy.precision,
            first_rank=firsts[name],
            num_stages=num_stages,
            stage_index=num_stages - 1 if name == "llm" else 0,
            feeds_pipeline=pipelined and name != "llm",
            assumptions=assumptions,
            layer_costs=layer_costs,
        )
        for name, s in strategy.modules.items()
    }
