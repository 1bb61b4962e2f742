"""Convert cost-model results into the Plan schema's prediction records (bytes -> GiB)."""

from __future__ import annotations

from planner.cost.phases import own_phases
from planner.cost.results import Estimate, MemoryBreakdown, ModuleCost
from planner.contract.schema import MemoryBreakdown as MemoryGiB
from planner.contract.schema import ModulePrediction, ModuleTime, Prediction
from planner.contract.units import GIB


def memory_gib(memory: MemoryBreakdown) -> MemoryGiB:
    """A byte breakdown in GiB."""
    return MemoryGiB(
        weights=memory.weights / GIB,
        gradients=memory.gradients / GIB,
        optimizer=memory.optimizer / GIB,
        activations=memory.activations / GIB,
        buffers=memory.buffers / GIB,
        overhead=memory.overhead / GIB,
    )


def module_time(cost: ModuleCost) -> ModuleTime:
    """Per-step seconds of one module by cause."""
    return ModuleTime(
        **{name.removesuffix("_s"): value for name, value in cost.terms().items()},
        dp_comm=cost.dp_comm_s,
        optimizer=cost.optimizer_s,
        handoff=cost.handoff_s,
        pp_comm=cost.pp_comm_s,
        pp_bubble=cost.pipeline_bubble_s,
        per_micro_batch=cost.per_micro_batch_s,
    )


def module_predictions(estimate: Estimate) -> dict[str, ModulePrediction]:
    """Each module's numbers; its memory is its own share (disjoint: its whole group, overhead included)."""
    predictions = {}
    for name, cost in estimate.modules.items():
        memory = estimate.memory_per_group[name] if estimate.placement == "disjoint" else cost.memory()
        predictions[name] = ModulePrediction(
            time_s=module_time(cost),
            memory_gib=memory_gib(memory),
            flops_per_step=cost.flops_per_step,
            sources=dict(cost.sources),
            stage_per_micro_batch_s=[c.per_micro_batch_s for c in cost.rank_costs()] or None,
            stage_peak_memory_gib=[max(m.total for m in own_phases(c)) / GIB for c in cost.rank_costs()] or None,
            stage_memory_gib=[memory_gib(max(own_phases(c), key=lambda m: m.total)) for c in cost.rank_costs()]
            or None,
            expected_imbalance=cost.imbalance,
        )
    return predictions


def prediction(estimate: Estimate) -> Prediction:
    """Whole-plan numbers."""
    return Prediction(
        step_time_s=estimate.step_time_s,
        tokens_per_s=estimate.tokens_per_s,
        samples_per_s=estimate.samples_per_s,
        mfu=estimate.mfu,
        peak_memory_gib=estimate.peak_memory_bytes / GIB,
        memory_breakdown_gib=memory_gib(estimate.peak_breakdown),
        peak_phase=estimate.peak_phase,
        binding_constraint=estimate.binding_constraint,
        stage_memory_breakdown_gib=[memory_gib(memory) for _, memory in estimate.stage_peaks] or None,
        stage_peak_phases=[phase for phase, _ in estimate.stage_peaks] or None,
    )
