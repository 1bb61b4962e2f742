"""Refit a profile's efficiency parameters from real runs: ``python -m runtime.profile --calibrate M.jsonl --plan P.json``.

For each (metrics, plan) pair: the measured step time is the median over steps (warm-up steps dropped) of the
slowest rank's ``step_time_s``; the predicted one is the cost model's raw estimate of the plan's strategy with the
profile's measured layers (``ProfileCostSource``), recomputed here so an earlier calibration baked into the plan
file cannot leak into the fit. Least squares of measured = scale * predicted + overhead across the pairs is
written into the profile; the planner applies it to every later prediction (a positive affine map, so the ranking
of plans, and hence the solver's choice, is unchanged).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from planner.catalog import model_from_hf_config
from planner.cost import estimate
from planner.hardware import Cluster, DeviceSpec
from planner.profiles import (
    Profile,
    ProfileCostSource,
    calibrate,
    find_profile,
    load_profile,
    refit_calibration,
    save_profile,
)
from planner.schema import Plan, load_plan
from planner.strategy import ModuleStrategy, Strategy
from planner.workload import Workload

WARMUP_STEPS = 1
"""Steps dropped from the start of every run (allocator warm-up, first-touch, lazy initialisation)."""


def measured_step_time(path: Path, warmup_steps: int = WARMUP_STEPS) -> float:
    """Median over steps of the slowest rank's ``step_time_s`` in a metrics JSONL file."""
    per_step: dict[int, float] = {}
    seen: dict[object, int] = {}
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read metrics file {path}: {e.strerror}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"metrics file {path} line {number} is not JSON: {e.msg}") from None
        if not isinstance(row, dict) or row.get("summary") or not isinstance(row.get("step_time_s"), (int, float)):
            continue  # the runtime's closing summary line, or a record of something else
        rank = row.get("rank", 0)
        step = row.get("step", seen.get(rank, 0))
        seen[rank] = step + 1
        per_step[step] = max(per_step.get(step, 0.0), float(row["step_time_s"]))
    steps = [per_step[s] for s in sorted(per_step)]
    if not steps:
        raise ValueError(f"metrics file {path} has no step_time_s records: pass the file `--metrics` wrote")
    kept = steps[warmup_steps:] if len(steps) > warmup_steps else steps
    return statistics.median(kept)


def plan_inputs(plan: Plan):
    """(model, cluster, workload, strategy) the plan was made for, rebuilt from the plan file."""
    model = model_from_hf_config(plan.model.hf_config, plan.model.name)
    model = model.with_frozen([m.name for m in plan.modules if m.frozen])
    device = DeviceSpec(**plan.cluster.device.model_dump())
    cluster = Cluster(device=device, num_devices=plan.cluster.num_devices, devices_per_node=plan.cluster.devices_per_node)
    w = plan.workload
    workload = Workload(image_sizes=tuple(tuple(s) for s in w.image_sizes), vision_tokens=w.vision_tokens,
                        text_tokens=w.text_tokens, audio_seconds=w.audio_seconds, global_batch=w.global_batch)
    strategy = Strategy(
        placement=plan.placement,
        precision=plan.training.precision,
        modules={
            m.name: ModuleStrategy(dp=m.dp, tp=m.tp, sp=m.sp, cp=m.cp, zero=m.zero, recompute=m.recompute,
                                   micro_batch=m.micro_batch, grad_accum=m.grad_accum)
            for m in plan.modules
        },
    )
    return model, cluster, workload, strategy


def raw_prediction(plan: Plan, profile: Profile) -> float:
    """The cost model's step time for the plan's strategy with the profile's layers, before calibration."""
    model, cluster, workload, strategy = plan_inputs(plan)
    source = ProfileCostSource(profile, concurrent_devices=cluster.num_devices)
    return estimate(model, cluster, workload, strategy, layer_costs=source).step_time_s


@dataclass(kw_only=True, frozen=True)
class CalibrationSample:
    """One run: which plan, what the model predicted, what the run measured."""

    plan: str
    predicted_s: float
    measured_s: float


def _profile_for(plans: list[Plan], out: str | None) -> Path:
    if out:
        return Path(out)
    keys = {(p.cluster.device.name, p.model.name) for p in plans}
    if len(keys) > 1:
        raise ValueError(f"the plans are for different hardware/models {sorted(keys)}: calibrate one at a time")
    (device, model), = keys
    path = find_profile(device, model)
    if path is None:
        raise ValueError(f"no profile profiles/{device}/{model}.json to calibrate: profile first, or pass --out FILE")
    return path


def calibrate_main(metrics: list[str], plans: list[str], *, out: str | None) -> int:
    """Fit, write into the profile, print before/after."""
    if len(plans) not in (1, len(metrics)):
        raise ValueError(f"give one --plan for all metrics files or one per file ({len(metrics)}), got {len(plans)}")
    plan_files = plans * len(metrics) if len(plans) == 1 else plans
    loaded = [load_plan(p) for p in plan_files]
    path = _profile_for(loaded, out)
    profile = load_profile(path)
    samples = [
        CalibrationSample(plan=p, predicted_s=raw_prediction(plan, profile), measured_s=measured_step_time(Path(m)))
        for m, p, plan in zip(metrics, plan_files, loaded)
    ]
    profile.calibration = refit_calibration(
        [s.predicted_s for s in samples], [s.measured_s for s in samples], sources=metrics
    )
    save_profile(profile, path)
    cal = profile.calibration
    print(f"{'plan':<40} {'predicted':>10} {'calibrated':>10} {'measured':>10}")
    for s in samples:
        print(f"{s.plan:<40} {s.predicted_s:>10.4f} {calibrate(s.predicted_s, cal):>10.4f} {s.measured_s:>10.4f}")
    print(f"wrote {path}: measured = {cal.scale:.4f} x predicted + {cal.overhead_s:.4f} s "
          f"(relative RMS error {cal.rms_error_before:.1%} -> {cal.rms_error_after:.1%})")
    return 0
