"""Fit a running plan's cost model to what the run measured, solve its problem again under the fit, and predict the
running plan and the new one under the same fitted model: ``python -m planner.adapt MEASURED --out NEW
--profile-out FITTED``. The runtime's ``--adapt`` calls it (the runtime never imports the solver) and decides from
its answer whether a switch pays; so can a user.

MEASURED (JSON, ``AdaptRequest``; the runtime writes it beside its checkpoints): the plan file the run trains, the
medians of its measured steps (``step_time_s``; per module its passes' spans, ``<module>_forward_s`` and
``<module>_backward_s``, or a pipelined LLM's ``llm_pipeline_s``; ``optimizer_s``; none after a step ran out of
memory: then only memory is fitted), the collectives timed on the run's own devices and process groups, and the
tensor memory its ranks measured (GPU runs, and CPU runs under ``--memory-cap-gib``). The fit, one term at a time:

- **collectives**: the run's own timings (every op, on every group size the run's devices allow) replace the link
  model where the profile held none of its own (``with_measured_collectives``): nothing is fitted between them and the
  measurement;
- **compute, per module**: ``<module>_compute_scale``, the factor on the module's modelled compute (host dispatch
  included, collectives not) that makes its predicted passes equal its measured ones, by bisection on the cost model
  itself (the passes grow monotonically with the factor);
- **the optimizer**: ``optimizer_time_scale``, its measured step over its predicted one (the modules' sum where they
  share the devices, the slowest group's where they do not);
- **the rest of the step** (the loop's own work, data, hand-off waits): ``step_overhead_s``, what the measured step
  leaves over the predicted one, at least 0;
- **memory, per group of ranks** (``memory``: the most tensor bytes each rank's steps held, or held when a step ran
  out of memory, and what a device holds): ``<module>_activation_memory_scale`` of the modules on those ranks, the
  factor on their step memory (saved activations, pass and loss buffers; states are sizes, not estimates) that
  makes the group's predicted tensors equal its measured ones, by bisection; only ever raised. The re-plan is made
  for the device as the run found it (its memory, or the memory whose usable share less the framework overhead is a
  CPU run's tensor cap), and the answer says whether the running plan still fits under the fit.

Every factor lies in its ``ADAPTED_ASSUMPTIONS`` range; one that ends on a bound is named in ``at_bound``, and then
its module's predicted passes differ from the measured ones (``residuals``); so is ``step_overhead_s`` when the
measured spans add up to more than the measured step (one overlapping another). The fit is saved as a profile
(``--profile-out``: the collectives and a ``Calibration``; ``plan --profile FITTED`` reads it) on top of the plan's own
profile, if it had one: the factors of that profile's calibration this fit does not set stay (a memory-only fit keeps
an earlier time fit; a time fit, an earlier memory fit). One JSON line answers; bad input is one line and exit
status 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from planner.contract.file_io import check_output, parse_json, read_text, write_output
from planner.contract.schema import Plan, PlanError, load_plan
from planner.contract.strategy import Strategy, layout_of, strategy_of
from planner.cost import estimate
from planner.cost.assumptions import CostAssumptions
from planner.cost.results import Estimate, ModuleCost
from planner.problem import Problem
from planner.profiles import (
    ADAPTED_ASSUMPTIONS,
    PROFILE_SCHEMA_VERSION,
    CalibratedRun,
    Calibration,
    CollectiveOp,
    CollectivePoint,
    Profile,
    Provenance,
    Spread,
    load_profile,
    save_profile,
)
from planner.profiles.calibration import with_values
from planner.profiles.schema import Seconds
from planner.replan import EXIT_USER_ERROR, replan, replan_problem

BISECTION_STEPS = 40
"""Halvings of a compute factor's (log) range: 20x either way to within 1e-10 relative."""


class TimedCollective(BaseModel):
    """One collective as a running job timed it (``runtime.observability.collectives.time_in_world``)."""

    model_config = ConfigDict(extra="forbid")

    op: CollectiveOp
    group_size: int = Field(ge=2)
    message_bytes: int = Field(ge=1)
    backend: str
    times: list[Seconds] = Field(min_length=1, description="seconds of each timed iteration (the slowest rank's)")

    def point(self) -> CollectivePoint:
        """As a profile's point: the median, fastest and slowest iteration."""
        return CollectivePoint(op=self.op, group_size=self.group_size, message_bytes=self.message_bytes,
                               backend=self.backend, time=Spread(median_s=statistics.median(self.times),
                                                                 min_s=min(self.times), max_s=max(self.times),
                                                                 repeats=len(self.times)))


class MeasuredMemory(BaseModel):
    """The tensor memory a running plan's ranks measured, and what their devices hold."""

    model_config = ConfigDict(extra="forbid")

    peak_tensor_bytes: dict[int, int] = Field(min_length=1, description="rank -> the most tensor bytes a step of it "
                                              "held (a step that ran out of memory: when its allocation failed)")
    capacity_bytes: int = Field(ge=1, description="what one device holds: its memory, or a CPU run's tensor cap")
    tensor_cap: bool = Field(description="capacity_bytes caps tensors alone (a CPU run's --memory-cap-gib), not a "
                             "device's memory with its framework overhead")


class AdaptRequest(BaseModel):
    """What a running plan measured (``runtime.launch.adapt`` writes it)."""

    model_config = ConfigDict(extra="forbid")

    plan: str = Field(description="the plan file the run trains")
    measured: dict[str, float] = Field(description="medians over the measured steps of the metrics' step_time_s, "
                                       "<module>_forward_s / _backward_s (or llm_pipeline_s) and optimizer_s; empty "
                                       "when no step was measured yet (then only memory is fitted)")
    memory: MeasuredMemory | None = Field(default=None, description="measured tensor memory (GPU runs, and CPU "
                                          "runs under a memory cap)")
    collectives: list[TimedCollective] = Field(default_factory=list, description="timed on the run's own devices")
    device_detail: str = Field(default="", description="what the run's devices report (the fitted profile's "
                               "provenance)")
    dtype: str = Field(description="the dtype the run trains in (float32 on CPU)")


def load_request(path: str) -> AdaptRequest:
    """The request in ``path``; a one-line ValueError naming the file when it is not one."""
    data = parse_json(read_text(path, kind="adapt request"), where=f"adapt request {path}")
    try:
        request = AdaptRequest.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        raise ValueError(f"{path}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    for key, value in request.measured.items():
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{path}: measured {key} = {value} is not a time in seconds")
    if request.measured.get("step_time_s", 0) <= 0 and (request.measured or request.memory is None):
        raise ValueError(f"{path}: measured step_time_s is missing or not positive")
    return request


def fitted_profile(plan: Plan, request: AdaptRequest) -> Profile:
    """The plan's own profile (or an empty one of its device and model) with the run's collectives in place of the
    points it had for the same op, group size and message size."""
    own = plan.predicted.profile
    if own and Path(own).is_file():
        base = load_profile(own)
    else:
        base = Profile(schema_version=PROFILE_SCHEMA_VERSION, hardware=plan.cluster.device.name, model=plan.model.name,
                       provenance=Provenance(device_name=plan.cluster.device.name,
                                             device_detail=request.device_detail or "not profiled", torch_version="-",
                                             cuda_version=None, date="", command="", num_threads=0,
                                             dtype=request.dtype))
    measured = {p.key: p for p in (c.point() for c in request.collectives)}
    kept = [p for p in base.collectives if p.key not in measured]
    return base.model_copy(update={"collectives": kept + list(measured.values())})


class _Predictor:
    """The running plan's estimate as a function of the adapted assumptions (everything else as the problem has it)."""

    def __init__(self, problem: Problem, strategy: Strategy) -> None:
        self.problem, self.strategy = problem, strategy

    def __call__(self, values: dict[str, float]) -> Estimate:
        p = self.problem
        return estimate(p.model, p.cluster, p.workload, self.strategy, with_values(p.assumptions, values),
                        p.layer_costs)


def module_passes_s(cost: ModuleCost) -> float:
    """A module's predicted passes of one step, as the runtime's spans time them: every micro-batch's forward and
    backward (collectives, recomputation, a pipeline's bubble and stage transfers in), the hand-off to the LLM out."""
    return cost.micro_batches_s - cost.handoff_s


def measured_passes_s(measured: dict[str, float], module: str) -> float | None:
    """A module's measured passes of one step (None when the run did not time them)."""
    if module == "llm" and measured.get("llm_pipeline_s"):
        return measured["llm_pipeline_s"]
    keys = [f"{module}_forward_s", f"{module}_backward_s"]
    return sum(measured[k] for k in keys if k in measured) if any(k in measured for k in keys) else None


def predicted_optimizer_s(e: Estimate) -> float:
    """The optimizer step a rank times: every module's where they share the devices, the slowest group's where not."""
    times = [c.optimizer_s for c in e.modules.values()]
    return sum(times) if e.placement == "colocated" else max(times)


def _bisect_scale(predictor: _Predictor, values: dict[str, float], name: str, module: str, target: float) -> float:
    """The ``name`` factor in its range whose prediction of ``module``'s passes is ``target`` (the bound nearest when
    none in the range is)."""
    bounds = ADAPTED_ASSUMPTIONS[name]
    low, high = math.log(bounds.low), math.log(bounds.high)

    def passes(log_scale: float) -> float:
        return module_passes_s(predictor({**values, name: math.exp(log_scale)}).modules[module])

    if passes(low) >= target:
        return bounds.low
    if passes(high) <= target:
        return bounds.high
    for _ in range(BISECTION_STEPS):
        middle = (low + high) / 2
        low, high = (middle, high) if passes(middle) < target else (low, middle)
    return math.exp((low + high) / 2)


def fit(predictor: _Predictor, measured: dict[str, float]) -> dict[str, float]:
    """The adapted assumptions (module docstring): per module its compute factor, the optimizer's, the step's
    overhead."""
    values: dict[str, float] = {"step_overhead_s": 0.0}
    for module in predictor.strategy.modules:
        target = measured_passes_s(measured, module)
        if target is not None and target > 0:
            name = f"{module}_compute_scale"
            values[name] = _bisect_scale(predictor, values, name, module, target)
    optimizer = measured.get("optimizer_s")
    predicted = predicted_optimizer_s(predictor(values))
    if optimizer and predicted > 0:
        bounds = ADAPTED_ASSUMPTIONS["optimizer_time_scale"]
        values["optimizer_time_scale"] = min(max(optimizer / predicted, bounds.low), bounds.high)
    values["step_overhead_s"] = max(0.0, measured["step_time_s"] - predictor(values).step_time_s)
    return values


def memory_groups(plan: Plan, placement: str) -> dict[str, tuple[list[str], list[int]]]:
    """The estimate's memory groups (``Estimate.memory_per_group``): each one's modules and ranks."""
    if placement == "colocated":
        return {"all": ([m.name for m in plan.modules], sorted({r for m in plan.modules for r in m.ranks}))}
    return {m.name: ([m.name], list(m.ranks)) for m in plan.modules}


def predicted_tensor_bytes(e: Estimate) -> dict[str, int]:
    """Each memory group's predicted peak without the framework overhead: the tensors a rank of it holds."""
    return {g: b.total - b.overhead for g, b in e.memory_per_group.items()}


def fit_memory(predictor: _Predictor, values: dict[str, float], plan: Plan, memory: MeasuredMemory
               ) -> dict[str, dict[str, int]]:
    """Set in ``values`` each memory group's ``<module>_activation_memory_scale`` (one factor for the modules that
    share its ranks) that makes its predicted tensors equal the most its ranks measured, by bisection (the peak grows
    monotonically with the factor); a group measured at or under its prediction keeps 1. Per group: measured,
    predicted before and after the fit (bytes)."""
    before = predicted_tensor_bytes(predictor(values))
    report = {}
    for group, (modules, ranks) in memory_groups(plan, plan.placement).items():
        measured = max((memory.peak_tensor_bytes[r] for r in ranks if r in memory.peak_tensor_bytes), default=None)
        if measured is None:
            continue
        if measured > before[group]:
            bounds = ADAPTED_ASSUMPTIONS[f"{modules[0]}_activation_memory_scale"]

            def tensors(scale: float) -> int:
                scales = {f"{m}_activation_memory_scale": scale for m in modules}
                return predicted_tensor_bytes(predictor({**values, **scales}))[group]

            low, high = bounds.low, bounds.high
            if tensors(high) <= measured:
                low = high
            for _ in range(BISECTION_STEPS):
                middle = (low + high) / 2
                low, high = (middle, high) if tensors(middle) < measured else (low, middle)
            values.update({f"{m}_activation_memory_scale": high for m in modules})
        report[group] = {"measured": measured, "predicted": before[group],
                         "fitted": predicted_tensor_bytes(predictor(values))[group]}
    return report


def device_memory_bytes(memory: MeasuredMemory, assumptions: CostAssumptions) -> int:
    """The device memory to plan with: a device's own, or for a tensor cap the memory whose usable share less the
    framework overhead is the cap (so that the planner's rule, peak + overhead <= usable share, is the cap's)."""
    if not memory.tensor_cap:
        return memory.capacity_bytes
    return math.ceil((memory.capacity_bytes + assumptions.framework_overhead_bytes)
                     / assumptions.usable_memory_fraction)


def residuals(predictor: _Predictor, values: dict[str, float], measured: dict[str, float]) -> dict[str, float]:
    """(predicted - measured) / measured under the fit: each module's passes, the optimizer's and the step's."""
    e = predictor(values)
    out = {}
    for module, cost in e.modules.items():
        target = measured_passes_s(measured, module)
        if target:
            out[module] = module_passes_s(cost) / target - 1
    if measured.get("optimizer_s"):
        out["optimizer"] = predicted_optimizer_s(e) / measured["optimizer_s"] - 1
    out["step"] = e.step_time_s / measured["step_time_s"] - 1
    return out


def adapt(request: AdaptRequest, request_name: str, out: str, profile_out: str) -> dict[str, Any]:
    """Fit, save the fitted profile, re-plan under it, and both plans' predictions (the answer's fields)."""
    plan = load_plan(request.plan)
    gpus = plan.cluster.num_devices
    profile = fitted_profile(plan, request)
    save_profile(profile, Path(profile_out))  # collectives first: the fit predicts with them
    memory = request.memory
    predictor = _Predictor(replan_problem(plan, gpus, profile_out), strategy_of(plan))  # the fit needs no capacity
    device_memory = None if memory is None else device_memory_bytes(memory, predictor.problem.assumptions)
    measured_s = request.measured.get("step_time_s")
    earlier = {} if profile.calibration is None else profile.calibration.values  # the predictor's problem has them
    values = {**earlier, **(fit(predictor, request.measured) if measured_s else {})}
    memory_report = {} if memory is None else fit_memory(predictor, values, plan, memory)
    at_bound = [n for n, v in values.items() if n in ADAPTED_ASSUMPTIONS
                and v in (ADAPTED_ASSUMPTIONS[n].low, ADAPTED_ASSUMPTIONS[n].high)
                and not (n.endswith("_activation_memory_scale") and v == 1.0)]
    left, runs, errors = {}, [], (None, None)
    if measured_s:
        left = residuals(predictor, values, request.measured)
        if values["step_overhead_s"] == 0 and left["step"] > 1e-6:  # the spans sum to more than the step
            at_bound.append("step_overhead_s")
        before, after = predictor({}).step_time_s, predictor(values).step_time_s
        runs = [CalibratedRun(name=request_name, measured_s=measured_s, before_s=before, after_s=after)]
        errors = (abs(before / measured_s - 1), abs(after / measured_s - 1))
    calibration = Calibration(
        values=values, at_bound=at_bound, runs=runs, rms_error_before=errors[0], rms_error_after=errors[1],
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), sources=[request_name])
    save_profile(profile.model_copy(update={"calibration": calibration}), Path(profile_out))
    problem = replan_problem(plan, gpus, profile_out, device_memory)
    new, note = replan(plan, gpus, problem)
    write_output(out, new.to_json(), flag="--out")
    current = _Predictor(problem, strategy_of(plan))({})
    answer = {"measured_step_s": measured_s, "planned_step_s": plan.predicted.step_time_s,
              "current_fitted_s": current.step_time_s, "new_fitted_s": new.predicted.step_time_s,
              "current_layout": layout_of(plan), "new_layout": layout_of(new),
              "same_layout": layout_of(new) == layout_of(plan), "fitted": values, "at_bound": at_bound,
              "residuals": left, "new_plan": out, "profile": profile_out, "note": note}
    if memory is not None:
        usable = current.usable_memory_bytes - problem.assumptions.framework_overhead_bytes
        answer["memory"] = {"groups": memory_report, "usable_tensor_bytes": usable,
                            "device_memory_bytes": device_memory, "current_fits": current.fits,
                            "new_tensor_bytes": max(predicted_tensor_bytes(_Predictor(problem, strategy_of(new))({}))
                                                    .values())}
    return answer


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m planner.adapt", description=__doc__.split("\n\n")[0])
    parser.add_argument("measured", help="what the run measured (JSON: planner.adapt.AdaptRequest)")
    parser.add_argument("--out", required=True, help="write the plan made under the fit here")
    parser.add_argument("--profile-out", required=True, help="write the fitted profile here")
    args = parser.parse_args(argv)
    try:
        check_output(args.out, "--out")
        check_output(args.profile_out, "--profile-out")
        answer = adapt(load_request(args.measured), args.measured, args.out, args.profile_out)
    except (ValueError, OSError, PlanError) as e:
        print(f"adapt: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(json.dumps(answer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
