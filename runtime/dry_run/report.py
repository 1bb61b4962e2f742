"""The dry-run's report: every role's memory beside the planner's prediction, the verdict, the table."""

from __future__ import annotations

from dataclasses import dataclass

from planner.contract.schema import ZERO_BUBBLE_SCHEDULES, Plan
from planner.contract.units import GIB
from runtime.dry_run.measure import RoleMemory
from runtime.models.parallelize import uses_fsdp
from runtime.parallel.parallel_dims import plan_dims
from runtime.parallel.precision import module_precision
from runtime.run.preflight import module_names
from runtime.training import trainer as trainer_module
from runtime.training.trainer import numerics_device_type


@dataclass(kw_only=True)
class DryRunReport:
    """Every role's measured memory beside the planner's prediction, in bytes."""

    plan: Plan
    """The plan dry-run."""
    roles: list[RoleMemory]
    """One entry per distinct role."""
    usable_bytes: int
    """Device memory the planner lets a plan use: memory x usable_memory_fraction."""
    numerics: str
    """How tensors were emulated, in words."""
    seconds: float = 0.0
    """Wall time of the whole dry-run."""

    def overhead_bytes(self, role: RoleMemory) -> int:
        """The planner's framework allowance of the role's GPU group (not measurable on fake tensors)."""
        group = self.predicted_group(role) or self.plan.predicted.memory_breakdown_gib
        return round(group.overhead * GIB)

    def predicted_group(self, role: RoleMemory):
        """The planner's memory breakdown (GiB) of the GPU group the role's rank belongs to: of its pipeline stage's
        GPUs when the LLM is pipelined there (a plan written before stages were recorded: only the largest
        stage's, else None)."""
        stage = _pipeline_stage(self.plan, role.rank)
        stages = self.plan.predicted.stage_memory_breakdown_gib
        if stage is not None and stages:
            return stages[stage]
        if stage is not None and stage != _binding_stage(self.plan):
            return None
        if self.plan.placement == "colocated":
            return self.plan.predicted.memory_breakdown_gib
        (name,) = role.modules
        return self.plan.module(name).predicted.memory_gib

    def role_total(self, role: RoleMemory) -> int:
        """Measured peak tensor memory + the planner's overhead: what the rank needs of its device."""
        return role.peak.get("Total", 0) + self.overhead_bytes(role)

    @property
    def fits(self) -> bool:
        """Every role fits in the usable device memory."""
        return all(self.role_total(role) <= self.usable_bytes for role in self.roles)


def usable_bytes(plan: Plan) -> int:
    """Device memory the planner lets a plan use (its default usable_memory_fraction)."""
    from planner.cost.assumptions import DEFAULT_ASSUMPTIONS  # pure Python, no solver

    return int(plan.cluster.device.memory_bytes * DEFAULT_ASSUMPTIONS.usable_memory_fraction)


def numerics(plan: Plan) -> str:
    """The trainer's numeric recipe per module for the plan's device (runtime.parallel.precision), in words."""
    device = numerics_device_type(plan)
    if device == "cpu":
        return "fake CPU tensors, fp32 (as the runtime trains on CPU)"
    parts = []
    for name in module_names(plan):
        recipe = module_precision(plan.training.precision, device,
                                  fsdp=uses_fsdp(plan_dims(plan, name)))
        compute = ("FSDP2 bf16 all-gathers" if recipe.fsdp_policy is not None
                   else "bf16 autocast" if recipe.autocast_dtype is not None else "")
        dtype = str(recipe.param_dtype).removeprefix("torch.")
        parts.append(f"{name} {dtype} params" + (f", {compute}" if compute else ""))
    return f"fake CPU tensors, the {device} recipe: " + "; ".join(parts) + "; bf16 hand-off"


# ---- the table ----------------------------------------------------------------------------------------------------
PEAK_ROWS = (
    ("weights", ("Parameter", "Buffer")),
    ("gradients", ("Gradient",)),
    ("optimizer", ("Optstate",)),
    ("activations", ("Activation",)),
    ("buffers", ("Temp", "Other")),
)
"""Planner category -> MemTracker categories at the rank's peak (gathered ZeRO-3 layers count as Parameter in
MemTracker and as buffers in the planner; gradients not yet accumulated count as Temp)."""


def _ratio(measured: float, predicted: float | None) -> str:
    return f"{measured / predicted:.2f}" if predicted else "-"


def _row(label: str, measured: float, predicted: float | None) -> str:
    """One table row; ``predicted`` None where the plan has no prediction for this rank (a pipeline stage other
    than its largest)."""
    shown = "-" if predicted is None else f"{predicted / GIB:.2f}"
    return f"  {label:<30} {measured / GIB:>9.2f} {shown:>10} {_ratio(measured, predicted):>6}"


def format_report(report: DryRunReport) -> str:
    """The dry-run beside the planner: per role, per module state and activation rows, the rank's peak by
    category, and FITS / DOES NOT FIT."""
    plan = report.plan
    device = plan.cluster.device
    lines = [
        f"dry-run of {plan.model.name} on {plan.cluster.num_devices} x {device.name} ({plan.placement}, "
        f"{plan.training.precision}): {len(report.roles)} role(s) in {report.seconds:.0f} s",
        f"tensors: {report.numerics}; peaks are tensor memory only, the planner's framework overhead is added for "
        f"FITS; usable = {report.usable_bytes / GIB:.1f} GiB of {device.memory_bytes / GIB:.1f} GiB",
    ]
    for role in report.roles:
        lines += ["", f"rank {role.rank} (role of ranks {_ranges(role.ranks)}; built in "
                      f"{role.startup_peak / GIB:.2f} GiB peak, {role.seconds:.0f} s)",
                  f"  {'module / category (GiB)':<30} {'dry-run':>9} {'predicted':>10} {'ratio':>6}"]
        stage = _pipeline_stage(plan, role.rank)
        for name, memory in role.modules.items():
            module = plan.module(name)
            predicted = _module_prediction(plan, name, stage)
            in_flight = _in_flight(plan, name, stage)
            for field_name in ("weights", "gradients", "optimizer"):
                lines.append(_row(f"{name} {field_name}", getattr(memory, field_name),
                                  predicted and getattr(predicted, field_name) * GIB))
            unit = " chunks" if module.pp > 1 else ""
            label = f"{name} activations" + (f" (x{in_flight}{unit} in flight)" if in_flight > 1 else "")
            lines.append(_row(label, memory.activations * in_flight, predicted and predicted.activations * GIB))
        group = report.predicted_group(role)
        for label, categories in PEAK_ROWS:
            measured = sum(role.peak.get(c, 0) for c in categories)
            lines.append(_row(f"peak: {label}", measured, group and getattr(group, label) * GIB))
        overhead = report.overhead_bytes(role)
        predicted_peak = group and (group.total - group.overhead) * GIB
        lines.append(_row("peak tensors", role.peak.get("Total", 0), predicted_peak))
        if stage is not None:
            own = plan.module("llm").predicted.stage_peak_memory_gib
            lines.append(f"  llm pipeline stage {stage}" + (f": the planner's own peak of the stage {own[stage]:.2f} "
                                                            "GiB" if own else "") +
                         ("" if group else " (the plan's breakdown is of its largest stage)"))
        lines.append(f"  runtime peak during {role.peak_at}")
        total = report.role_total(role)
        verdict = "FITS" if total <= report.usable_bytes else "DOES NOT FIT"
        planner = f" (planner: {group.total:.2f} GiB{_planner_phase(report.plan, role)})" if group else ""
        lines.append(f"  + overhead {overhead / GIB:.1f} = {total / GIB:.2f} GiB of {report.usable_bytes / GIB:.1f} "
                     f"GiB usable{planner}  {verdict}")
    lines += ["", "FITS" if report.fits else "DOES NOT FIT"]
    return "\n".join(lines)


def _module_prediction(plan: Plan, name: str, stage: int | None):
    """The planner's breakdown (GiB) of module ``name`` on a rank of pipeline ``stage`` (None: not pipelined there);
    None for a stage a plan written before stages were recorded has no breakdown of."""
    predicted = plan.module(name).predicted
    if stage is None or plan.module(name).pp == 1:
        return predicted.memory_gib
    if predicted.stage_memory_gib:
        return predicted.stage_memory_gib[stage]
    return predicted.memory_gib if stage == _binding_stage(plan) else None


def _planner_phase(plan: Plan, role: RoleMemory) -> str:
    """`` at the llm forward``: the moment of the step the planner puts the peak at, where the plan records it (for
    the role's group: a disjoint group other than the peak one has its own; a pipeline stage its own)."""
    stage, phases = _pipeline_stage(plan, role.rank), plan.predicted.stage_peak_phases
    if stage is not None and phases:
        return f" at the {phases[stage]}"
    phase = plan.predicted.peak_phase
    if phase is None or (plan.placement == "disjoint" and not phase.startswith(next(iter(role.modules)) + " ")):
        return ""
    return f" at the {phase}"


def _in_flight(plan: Plan, name: str, stage: int | None) -> int:
    """Micro-batches (of a pipelined module: model chunks) whose activations a module holds at once: a pipeline
    stage holds what its schedule keeps in flight (the planner's count, planner.cost.pipeline); the vision tower
    feeding a pipeline runs every forward before the schedule; the vision group of a disjoint plan runs
    MAX_ENCODER_IN_FLIGHT forwards ahead (as the planner's 1F1B model)."""
    from planner.cost.pipeline import in_flight_chunks  # pure Python, no solver

    module = plan.module(name)
    if module.pp > 1:
        return in_flight_chunks(stage, module.pp, module.grad_accum, module.virtual_stages,
                                module.pp_schedule in ZERO_BUBBLE_SCHEDULES)
    if plan.module("llm").pp > 1:
        return module.grad_accum
    if plan.placement == "disjoint" and name != "llm":
        return min(trainer_module.MAX_ENCODER_IN_FLIGHT, module.grad_accum)
    return 1


def _pipeline_stage(plan: Plan, rank: int) -> int | None:
    """The LLM pipeline stage ``rank`` runs (None: the LLM is not pipelined or not on this rank)."""
    dims = plan_dims(plan, "llm")
    return dims.stage_of(rank) if dims.pp > 1 and rank in dims.ranks else None


def _binding_stage(plan: Plan) -> int | None:
    """The pipeline stage the plan's LLM memory breakdown is of (its largest own peak)."""
    own = plan.module("llm").predicted.stage_peak_memory_gib
    return None if not own else own.index(max(own))


def _ranges(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``0-2,5``."""
    parts, start = [], None
    for i, rank in enumerate(ranks):
        if start is None:
            start = rank
        if i + 1 == len(ranks) or ranks[i + 1] != rank + 1:
            parts.append(str(start) if start == rank else f"{start}-{rank}")
            start = None
    return ",".join(parts)
