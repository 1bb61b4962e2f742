"""The Plan document of a strategy: re-costed by the cost model, with its predictions, the baselines beside it and
the solver's record."""

from __future__ import annotations

from functools import lru_cache
from typing import Mapping

from planner.search.baselines import BASELINE_DESCRIPTIONS, BaselineOutcome, baselines
from planner.cost import Estimate, estimate
from planner.cost.memory import loss_chunk_tokens
from planner.cost.report import module_predictions, prediction
from planner.contract.units import GIB
from planner.problem import Problem
from planner.contract.schema import (
    SCHEMA_VERSION,
    BaselineResult,
    ClusterInfo,
    ModelInfo,
    ModulePlan,
    ModulePrediction,
    Plan,
    SolverInfo,
    TrainingInfo,
    WorkloadInfo,
)
from planner.contract.strategy import Strategy
from planner.contract.workload import module_tokens

OBJECTIVE_TOLERANCE_S = 5e-9
"""The solver's integer step time (ns, at most four rounded terms) vs the cost model's float step time."""
OBJECTIVE_RELATIVE_TOLERANCE = 1e-12
"""The same comparison for long steps, where the float step time itself carries more than a nanosecond of rounding."""


@lru_cache(maxsize=1)
def planner_version() -> str:
    """The installed dhplan version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dhplan")
    except PackageNotFoundError:
        return "unknown"


def _module_plan(problem: Problem, strategy: Strategy, name: str, prediction: ModulePrediction,
                 pp_layers: list[int] | None) -> ModulePlan:
    s = strategy.modules[name]
    spec = problem.model.module(name)
    has_loss = any(layer.kind == "lm_head" for layer in spec.layers)
    return ModulePlan(
        name=name, ranks=strategy.module_ranks()[name], dp=s.dp, tp=s.tp, sp=s.sp, cp=s.cp, pp=s.pp, ep=s.ep,
        pp_schedule=s.pp_schedule, virtual_stages=s.virtual_stages, pp_layers=pp_layers,
        # a ring-CP module runs the ring's SDPA kernels (runtime.parallel.ring), whatever the others call
        attention="sdpa" if s.cp > 1 else problem.assumptions.attention_calls,
        loss_chunk_tokens=loss_chunk_tokens(s.pp, problem.assumptions) if has_loss else 0,
        linear_attention=(problem.assumptions.linear_attention_kernel
                          if any(layer.linear_attention is not None for layer in spec.layers) else None),
        zero=s.zero, recompute=s.recompute, micro_batch=s.micro_batch, grad_accum=s.grad_accum, frozen=spec.frozen,
        num_params=spec.num_params, predicted=prediction,
    )


def _baseline_result(outcome: BaselineOutcome, plan_step_s: float) -> BaselineResult:
    """A baseline in the plan file."""
    description = BASELINE_DESCRIPTIONS[outcome.name]
    e = outcome.estimate
    if e is None:
        return BaselineResult(description=description, infeasible=outcome.infeasible)
    return BaselineResult(
        description=description, step_time_s=e.step_time_s, tokens_per_s=e.tokens_per_s,
        peak_memory_gib=e.peak_memory_bytes / GIB, mfu=e.mfu, speedup=e.step_time_s / plan_step_s,
        modules={m: c.strategy.describe() for m, c in e.modules.items()},
    )


def calibration_note(problem: Problem) -> str | None:
    """Where the calibrated assumptions the problem is costed with come from (None without a calibration)."""
    profile = getattr(problem.layer_costs, "profile", None)
    calibration = getattr(profile, "calibration", None)
    if calibration is None:
        return None
    from planner.profiles import describe_calibration

    return f"profile {profile.hardware}/{profile.model} {describe_calibration(calibration)}"


def _binding(e: Estimate) -> str:
    return (f"{e.binding_constraint}; peak memory {e.peak_memory_bytes / GIB:.1f} of "
            f"{e.usable_memory_bytes / GIB:.1f} GiB usable")


def build_plan(
    problem: Problem,
    strategy: Strategy,
    *,
    status: str,
    num_candidates: int,
    rank: int = 1,
    fixed: Mapping[str, str] | None = None,
    reference: Mapping[str, BaselineOutcome] | None = None,
    objective_s: float | None = None,
) -> Plan:
    """The Plan document of ``strategy``: re-costed with ``cost.estimate``, with the baselines. ``objective_s``,
    the solver's step time, must agree with the re-costed one up to the solver's nanosecond rounding."""
    e = estimate(problem.model, problem.cluster, problem.workload, strategy, problem.assumptions, problem.layer_costs)
    tolerance = max(OBJECTIVE_TOLERANCE_S, OBJECTIVE_RELATIVE_TOLERANCE * e.step_time_s)
    assert objective_s is None or abs(objective_s - e.step_time_s) <= tolerance, (
        f"solver objective {objective_s} s != cost model {e.step_time_s} s"
    )
    model, device, w = problem.model, problem.cluster.device, problem.workload
    tokens = module_tokens(w, model)
    reference = baselines(problem) if reference is None else reference
    predicted = prediction(e).model_copy(update={"binding_constraint": _binding(e),
                                                 "calibration": calibration_note(problem),
                                                 "profile": getattr(problem.layer_costs, "path", None)})
    predictions = module_predictions(e)
    return Plan(
        schema_version=SCHEMA_VERSION,
        planner_version=planner_version(),
        model=ModelInfo(name=model.name, family=model.family, hf_config=dict(model.hf_config),
                        num_params=model.num_params, module_params={m.name: m.num_params for m in model.modules}),
        cluster=ClusterInfo(
            device=device,
            num_devices=problem.num_gpus, devices_per_node=problem.cluster.devices_per_node,
        ),
        workload=WorkloadInfo(
            image_sizes=list(w.image_sizes), vision_tokens=w.vision_tokens, text_tokens=w.text_tokens,
            audio_seconds=w.audio_seconds, global_batch=w.global_batch, videos=list(w.videos),
            module_tokens={m: round(t.tokens) for m, t in tokens.items()},
            llm_image_tokens=round(tokens["vision"].output_tokens) if "vision" in tokens else 0,
            dataset=problem.dataset,
        ),
        training=TrainingInfo(precision=problem.precision),
        placement=strategy.placement,
        modules=[_module_plan(problem, strategy, m, predictions[m], list(e.modules[m].chunk_layers) or None)
                 for m in model.module_names],
        predicted=predicted,
        baselines={name: _baseline_result(o, predicted.step_time_s) for name, o in reference.items()},
        solver=SolverInfo(status=status, num_candidates=num_candidates, rank=rank, fixed=dict(fixed or {})),
    )
