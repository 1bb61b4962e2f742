"""Refit the cost model's named assumptions from measured runs: ``python -m planner.calibrate RUNS``.

RUNS are the runtime's metrics files (with ``--plan``, the plan each ran) or tables (CSV or YAML) of runs measured
with any framework: one row per run with ``plan`` (a plan file) or ``args`` (``plan`` arguments that pin the
strategy run, e.g. ``--model qwen-vl-7b --gpus 8 --fix llm.tp=2 ...``), ``step_time_s`` and optionally
``peak_memory_gib``. Each run is re-predicted here from its strategy (so a calibration already baked into a plan
file cannot leak into the fit) with the profile's measured layers where it has them and the analytical model
elsewhere. The step-time assumptions these runs depend on (``STEP_TIME_ASSUMPTIONS``: matmul and attention
efficiency, collective bus efficiency, host seconds per operator call, fixed step overhead, the scale on measured
layer times) are fitted by bounded least squares of log(predicted / measured), with a prior at their defaults
(``PhysicalRange.prior_width`` against ``MEASUREMENT_NOISE``) so that a handful of noisy runs cannot trade one
assumption off against another; the memory reserve
(``framework_overhead_bytes``) is fitted to the measured peaks. What the runs measure directly
(``MEASURED_ASSUMPTIONS``: a mixture-of-experts run's ``moe_load_imbalance``) is their median, set before the fit. Everything stays inside ``PhysicalRange`` bounds.
The fit goes into the profile (with every run's error before, after and left out); ``plan`` then costs with it and
says so.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import shlex
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from planner.arguments import plans_from_arguments
from planner.catalog import model_from_hf_config
from planner.contract.file_io import MAX_METRICS_BYTES, parse_json, parse_yaml, read_text
from planner.contract.hardware import Cluster
from planner.contract.schema import Plan, load_plan
from planner.contract.strategy import ModuleStrategy, Strategy
from planner.contract.units import GIB
from planner.contract.workload import Workload
from planner.cost import estimate
from planner.cost.assumptions import DEFAULT_ASSUMPTIONS, CostAssumptions
from planner.cost.results import Estimate
from planner.problem import profile_assumptions
from planner.profiles import (
    CALIBRATED_ASSUMPTIONS,
    MEASURED_ASSUMPTIONS,
    MEMORY_ASSUMPTIONS,
    PROFILE_SCHEMA_VERSION,
    PROFILES_DIR,
    STEP_TIME_ASSUMPTIONS,
    CalibratedRun,
    Calibration,
    Profile,
    ProfileCostSource,
    Provenance,
    find_profile,
    load_profile,
    profile_path,
    relative_rms,
    save_profile,
)
from planner.profiles.calibration import with_values
from planner.profiles.schema import MAX_MEASURED_SECONDS, PEAK_MARGIN, reference_peak

WARMUP_STEPS = 1
"""Steps dropped from the start of every run (allocator warm-up, first-touch, lazy initialisation)."""
MEASUREMENT_NOISE = 0.05
"""Relative spread of one measured step time (the unchanged 1-worker CPU run measured 1.108-1.187 s over an hour on
a shared machine). The fit weighs each run's log error by it against each assumption's ``prior_width``: a maximum
a posteriori estimate, so a few noisy runs move an assumption only as far as they agree on, and one they do not
constrain keeps its default."""
STEP_SHARE_PRIOR = 0.3
"""Prior width of an assumption that is a time only meaningful relative to the step (``prior_width`` None): this
share of the runs' median measured step."""
BOUND_RESIDUAL = 5 * MEASUREMENT_NOISE
"""Largest relative error a fit that ends on a bound of its physical range may leave on a run: beyond it the runs
want an assumption outside physics by more than their noise explains, and the fit is refused, not saved."""
SENSITIVITY = 1e-4
"""Smallest relative change of some run's prediction, when an assumption moves by a tenth of its range, for the
runs to constrain it; below it the assumption is not identifiable from these runs and keeps its default."""
def measured_step_time(path: Path, warmup_steps: int = WARMUP_STEPS) -> float:
    """Median over steps of the slowest rank's ``step_time_s`` in a metrics JSONL file."""
    per_step: dict[int, float] = {}
    seen: dict[object, int] = {}
    lines = read_text(path, kind="metrics file", max_bytes=MAX_METRICS_BYTES).splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        row = parse_json(line, where=f"metrics file {path} line {number}")
        if not isinstance(row, dict) or row.get("summary") or not isinstance(row.get("step_time_s"), (int, float)):
            continue  # the runtime's closing summary line, or a record of something else
        rank = row.get("rank", 0)
        if not all(type(v) is int for v in (rank, row.get("step", 0))):  # found by tests/test_file_fuzz.py
            raise ValueError(f"metrics file {path} line {number}: step and rank must be whole numbers")
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
    device = plan.cluster.device
    cluster = Cluster(device=device, num_devices=plan.cluster.num_devices, devices_per_node=plan.cluster.devices_per_node)
    w = plan.workload
    workload = Workload(image_sizes=tuple(tuple(s) for s in w.image_sizes), vision_tokens=w.vision_tokens,
                        text_tokens=w.text_tokens, audio_seconds=w.audio_seconds, global_batch=w.global_batch,
                        videos=tuple(tuple(v) for v in w.videos))
    strategy = Strategy(
        placement=plan.placement,
        precision=plan.training.precision,
        modules={
            m.name: ModuleStrategy.of_plan_module(m) for m in plan.modules
        },
    )
    return model, cluster, workload, strategy


def step_values(path: Path, key: str) -> list[float]:
    """``key`` of every step record of a metrics file that has it as a number (the closing summary left out)."""
    values = []
    for line in read_text(path, kind="metrics file", max_bytes=MAX_METRICS_BYTES).splitlines():
        try:
            row = parse_json(line, where="a metrics line") if line.strip() else None
        except ValueError:
            continue
        if isinstance(row, dict) and not row.get("summary") and isinstance(row.get(key), (int, float)):
            values.append(float(row[key]))
    return values


def measured_load_imbalance(path: Path) -> float | None:
    """Median over the steps of a metrics file of the busiest EP rank's routed tokens over the mean
    (``moe_load_imbalance``, a mixture-of-experts run's; None when it records none)."""
    values = step_values(path, "moe_load_imbalance")
    return statistics.median(values) if values else None


@dataclass(kw_only=True, frozen=True)
class MeasuredRun:
    """One run: the plan it ran and what it measured."""

    name: str
    where: str
    """Where the measurements were read, for messages: ``runs.csv row 2`` or ``metrics file m.jsonl``."""
    plan: Plan
    measured_s: float
    measured_peak_bytes: int | None = None
    measured_load_imbalance: float | None = None
    """The busiest EP rank's routed tokens over the mean (a mixture-of-experts run)."""


def runs_from_metrics(metrics: list[str], plans: list[str]) -> list[MeasuredRun]:
    """Runs of this runtime: metrics files and the plan of each (one plan for all, or one per file)."""
    if len(plans) not in (1, len(metrics)):
        raise ValueError(f"give one --plan for all metrics files or one per file ({len(metrics)}), got {len(plans)}")
    plan_files = plans * len(metrics) if len(plans) == 1 else plans
    runs = []
    for m, p in zip(metrics, plan_files):
        plan, where = load_plan(p), f"metrics file {m}"
        peaks = step_values(Path(m), "peak_memory_gib")
        runs.append(MeasuredRun(name=p, where=where, plan=plan, measured_s=measured_step_time(Path(m)),
                                measured_peak_bytes=peak_bytes(max(peaks), plan, where) if peaks else None,
                                measured_load_imbalance=measured_load_imbalance(Path(m))))
    return runs


def peak_bytes(peak_gib: float, plan: Plan, where: str) -> int:
    """A measured ``peak_memory_gib`` in bytes; a ValueError naming ``where`` when one GPU of the plan's hardware
    cannot hold it (or it is no positive number)."""
    device = plan.cluster.device
    if not 0 < peak_gib * GIB <= device.memory_bytes:  # NaN too
        raise ValueError(f"{where} peak_memory_gib: {peak_gib:g} GiB is no peak one {device.name} can hold "
                         f"({device.memory_bytes / GIB:g} GiB): give the largest GPU's peak, in GiB")
    return round(peak_gib * GIB)


TABLE_COLUMNS = ("plan", "args", "step_time_s", "peak_memory_gib", "moe_load_imbalance")


def _table_rows(path: Path) -> list[dict]:
    text = read_text(path, kind="runs table")
    if path.suffix == ".csv":
        rows = list(csv.DictReader(text.splitlines()))
    else:
        rows = parse_yaml(text, where=f"runs table {path}")
        rows = rows.get("runs") if isinstance(rows, dict) else rows
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"runs table {path} holds no runs: give a list of rows with {', '.join(TABLE_COLUMNS)}")
    return rows


def _plan_from_args(args: str, where: str) -> Plan:
    """The plan ``plan ARGS`` makes (the arguments should pin the strategy that was run with ``--fix``)."""
    try:
        return plans_from_arguments(shlex.split(args))[0]
    except (ValueError, NotImplementedError) as e:
        raise ValueError(f"{where}: `plan {args}` failed: {e}") from None


def _positive(row: dict, key: str, where: str, *, required: bool) -> float | None:
    value = row.get(key)
    if value in (None, ""):
        if required:
            raise ValueError(f"{where} {key}: missing")
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where} {key}: must be a number, got {value!r}") from None
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{where} {key}: must be a positive number, got {value!r}")
    return number


def runs_from_table(path: Path) -> list[MeasuredRun]:
    """Runs measured with any framework, one per row of a CSV or YAML table."""
    runs = []
    for i, row in enumerate(_table_rows(path), 1):
        where = f"{path} row {i}"
        if None in row:
            raise ValueError(f"{where} has more fields than the header: quote an args value that holds commas")
        unknown = sorted(str(k) for k in set(row) - set(TABLE_COLUMNS))
        if unknown:
            raise ValueError(f"{where}: unknown column(s) {', '.join(unknown)}; columns: {', '.join(TABLE_COLUMNS)}")
        if bool(row.get("plan")) == bool(row.get("args")):
            raise ValueError(f"{where}: give either plan (a plan file) or args (plan arguments), not both or neither")
        plan = load_plan(row["plan"]) if row.get("plan") else _plan_from_args(str(row["args"]), where)
        peak = _positive(row, "peak_memory_gib", where, required=False)
        runs.append(MeasuredRun(name=str(row.get("plan") or row["args"]), where=where, plan=plan,
                                measured_s=_positive(row, "step_time_s", where, required=True),
                                measured_peak_bytes=None if peak is None else peak_bytes(peak, plan, where),
                                measured_load_imbalance=_positive(row, "moe_load_imbalance", where, required=False)))
    return runs


def load_runs(sources: list[str], plans: list[str]) -> list[MeasuredRun]:
    """Runs from tables (.csv, .yaml, .yml) and metrics files (with ``plans``) alike."""
    tables = [s for s in sources if Path(s).suffix in (".csv", ".yaml", ".yml")]
    metrics = [s for s in sources if s not in tables]
    runs = [run for table in tables for run in runs_from_table(Path(table))]
    if metrics:
        runs += runs_from_metrics(metrics, plans)
    elif plans:
        raise ValueError("--plan goes with metrics files; a table names each run's plan itself")
    return runs


class Predictor:
    """One run's prediction as a function of the assumptions refitted (everything else as ``plan`` costs it)."""

    def __init__(self, run: MeasuredRun, profile: Profile) -> None:
        self.model, self.cluster, self.workload, self.strategy = plan_inputs(run.plan)
        self.profile = profile
        self.base = profile_assumptions(profile, DEFAULT_ASSUMPTIONS)

    def assumptions(self, values: dict[str, float]) -> CostAssumptions:
        return with_values(self.base, values)

    def __call__(self, values: dict[str, float]) -> Estimate:
        assumptions = self.assumptions(values)
        source = ProfileCostSource(self.profile, concurrent_devices=self.cluster.num_devices,
                                   time_scale=assumptions.measured_time_scale)
        return estimate(self.model, self.cluster, self.workload, self.strategy, assumptions, source)


def _normalised(name: str, value: float) -> float:
    r = STEP_TIME_ASSUMPTIONS[name]
    return (value - r.low) / (r.high - r.low)


def _physical(name: str, u: float) -> float:
    r = STEP_TIME_ASSUMPTIONS[name]
    return r.low + float(u) * (r.high - r.low)


def identifiable(predictors: list[Predictor]) -> list[str]:
    """The step-time assumptions some run's prediction depends on (``SENSITIVITY``)."""
    base = [p({}).step_time_s for p in predictors]
    found = []
    for name in STEP_TIME_ASSUMPTIONS:
        u = _normalised(name, getattr(predictors[0].base, name))
        moved = _physical(name, u + 0.1 if u <= 0.9 else u - 0.1)
        if any(abs(p({name: moved}).step_time_s / b - 1) > SENSITIVITY for p, b in zip(predictors, base)):
            found.append(name)
    return found


def fit_step_time(predictors: list[Predictor], measured: list[float], names: list[str]) -> dict[str, float]:
    """Bounded least squares over ``names`` of log(predicted / measured) / ``MEASUREMENT_NOISE`` and each
    assumption's distance from its default in ``prior_width``s."""
    if not names:
        return {}
    defaults = [getattr(predictors[0].base, n) for n in names]
    widths = [STEP_TIME_ASSUMPTIONS[n].prior_width or STEP_SHARE_PRIOR * statistics.median(measured) for n in names]

    def residuals(u: np.ndarray) -> np.ndarray:
        values = {n: _physical(n, x) for n, x in zip(names, u)}
        errors = [math.log(p(values).step_time_s / m) / MEASUREMENT_NOISE for p, m in zip(predictors, measured)]
        prior = [(values[n] - d) / w for n, d, w in zip(names, defaults, widths)]
        return np.array(errors + prior)

    from scipy.optimize import least_squares  # the runtime extra's scipy: only a fit needs it

    start = np.clip([_normalised(n, d) for n, d in zip(names, defaults)], 0.0, 1.0)  # a measured default may lie outside
    result = least_squares(residuals, start, bounds=(0.0, 1.0), diff_step=1e-3)
    return {n: _physical(n, x) for n, x in zip(names, result.x)}


def fit_memory_reserve(predictors: list[Predictor], runs: list[MeasuredRun], values: dict[str, float]) -> float | None:
    """``framework_overhead_bytes`` that makes the median run's predicted peak its measured one (None without
    measured peaks), within its ``MEMORY_ASSUMPTIONS`` range."""
    gaps = []
    for p, run in zip(predictors, runs):
        if run.measured_peak_bytes is not None:
            reserve = p.assumptions(values).framework_overhead_bytes
            gaps.append(run.measured_peak_bytes - (p(values).peak_memory_bytes - reserve))
    if not gaps:
        return None
    r = MEMORY_ASSUMPTIONS["framework_overhead_bytes"]
    return float(min(max(statistics.median(gaps), r.low), r.high))


def fit(predictors: list[Predictor], runs: list[MeasuredRun], names: list[str]) -> dict[str, float]:
    """Step-time assumptions, then the memory reserve."""
    values = fit_step_time(predictors, [r.measured_s for r in runs], names)
    reserve = fit_memory_reserve(predictors, runs, values)
    return values if reserve is None else {**values, "framework_overhead_bytes": reserve}


def measured_values(runs: list[MeasuredRun]) -> dict[str, float]:
    """``MEASURED_ASSUMPTIONS`` the runs record: the median over the runs, within its physical range."""
    imbalances = [r.measured_load_imbalance for r in runs if r.measured_load_imbalance is not None]
    if not imbalances:
        return {}
    r = MEASURED_ASSUMPTIONS["moe_load_imbalance"]
    return {"moe_load_imbalance": min(max(statistics.median(imbalances), r.low), r.high)}


def check_step_time(run: MeasuredRun, before: Estimate, peak_flops: float) -> None:
    """Raise a one-line ValueError naming the run when its step time cannot be a measurement: no positive number,
    longer than ``MAX_MEASURED_SECONDS``, or shorter than its step's model FLOPs take on its GPUs at ``PEAK_MARGIN``
    times ``peak_flops`` each."""
    where = f"{run.where} step_time_s"
    if not 0 < run.measured_s <= MAX_MEASURED_SECONDS:  # NaN too
        raise ValueError(f"{where}: {run.measured_s:g} s is no step time (a positive number of seconds, at most a "
                         "day): give seconds per optimizer step")
    model_flops = before.mfu * before.step_time_s * before.num_gpus * run.plan.cluster.device.peak_bf16_flops
    fastest = model_flops / (before.num_gpus * PEAK_MARGIN * peak_flops)
    if run.measured_s < fastest:
        raise ValueError(f"{where}: {run.measured_s:g} s is faster than {before.num_gpus} GPU(s) do the step's "
                         f"{model_flops:.3g} model FLOPs at {PEAK_MARGIN:g} x {peak_flops:.3g} FLOP/s each "
                         f"({fastest:.3g} s): give seconds per optimizer step of the run's plan")


def _worst(errors: list[float | None]) -> int:
    """Index of the largest relative error (None: not measured)."""
    return max(range(len(errors)), key=lambda i: -1 if errors[i] is None else abs(errors[i]))


def refuse_fit_at_bounds(runs: list[MeasuredRun], cal: Calibration) -> None:
    """Raise a one-line ValueError naming the worst run when the fit ends on a bound and still misses a run by more
    than ``BOUND_RESIDUAL``: the runs are not a machine the cost model's physical ranges describe."""
    step_bound = [n for n in cal.at_bound if n in STEP_TIME_ASSUMPTIONS]
    errors = [r.after_s / r.measured_s - 1 for r in cal.runs]
    i = _worst(errors)
    if step_bound and abs(errors[i]) > BOUND_RESIDUAL:
        raise ValueError(f"{runs[i].where} step_time_s: the fit stops at the physical bound of {', '.join(step_bound)}"
                         f" and still predicts {cal.runs[i].after_s:.3g} s for the measured {runs[i].measured_s:g} s "
                         f"({errors[i]:+.0%}): check the run's unit, plan and hardware; nothing written")
    errors = [None if r.measured_peak_bytes is None else r.predicted_peak_bytes / r.measured_peak_bytes - 1
              for r in cal.runs]
    i = _worst(errors)
    if "framework_overhead_bytes" in cal.at_bound and abs(errors[i]) > BOUND_RESIDUAL:
        raise ValueError(f"{runs[i].where} peak_memory_gib: the memory reserve stops at its physical bound "
                         f"({cal.values['framework_overhead_bytes'] / GIB:.3g} GiB) and still predicts "
                         f"{cal.runs[i].predicted_peak_bytes / GIB:.3g} GiB for the measured "
                         f"{runs[i].measured_peak_bytes / GIB:.3g} GiB ({errors[i]:+.0%}): check the unit (GiB of "
                         "the largest GPU), the run's plan and hardware; nothing written")


def _at_bound(values: dict[str, float], names: list[str]) -> list[str]:
    """The fitted step-time ``names`` and the memory reserve that ended on a bound of their range."""
    step = [n for n in names if min(abs(_normalised(n, values[n])), abs(1 - _normalised(n, values[n]))) < 1e-6]
    r = MEMORY_ASSUMPTIONS["framework_overhead_bytes"]
    reserve = values.get("framework_overhead_bytes")
    return step + (["framework_overhead_bytes"] if reserve in (r.low, r.high) else [])


def calibrate_runs(runs: list[MeasuredRun], profile: Profile, *, sources: list[str]) -> Calibration:
    """Check the runs against physics, set what they measure, then fit on all runs (refused when it ends on a bound
    far from them); each run also predicted from a fit on the others when there are three or more."""
    predictors = [Predictor(run, profile) for run in runs]
    estimates = [p({}) for p in predictors]
    peak_flops = reference_peak(profile)[0]
    for run, e in zip(runs, estimates):
        check_step_time(run, e, peak_flops)
    before = [e.step_time_s for e in estimates]
    measured_directly = measured_values(runs)
    for p in predictors:
        p.base = with_values(p.base, measured_directly)
    names = identifiable(predictors)
    values = {**measured_directly, **fit(predictors, runs, names)}
    left_out: list[float | None] = [None] * len(runs)
    if len(runs) >= 3:
        for i in range(len(runs)):
            others = [j for j in range(len(runs)) if j != i]
            fitted = fit([predictors[j] for j in others], [runs[j] for j in others], names)
            left_out[i] = predictors[i](fitted).step_time_s
    after = [p(values) for p in predictors]
    measured = [r.measured_s for r in runs]
    cal = Calibration(
        values=values, at_bound=_at_bound(values, names),
        not_identifiable=[n for n in STEP_TIME_ASSUMPTIONS if n not in names],
        runs=[CalibratedRun(name=r.name, measured_s=r.measured_s, before_s=b, after_s=a.step_time_s,
                            leave_one_out_s=loo, measured_peak_bytes=r.measured_peak_bytes,
                            predicted_peak_bytes=a.peak_memory_bytes)
              for r, b, a, loo in zip(runs, before, after, left_out)],
        rms_error_before=relative_rms(before, measured),
        rms_error_after=relative_rms([a.step_time_s for a in after], measured),
        leave_one_out_rms=None if left_out[0] is None else relative_rms(left_out, measured),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        sources=sources,
    )
    refuse_fit_at_bounds(runs, cal)
    return cal


def _profile_for(runs: list[MeasuredRun], out: str | None) -> tuple[Path, Profile]:
    """The profile to calibrate: ``out``, else the one the runs' plans were costed with, else the committed one of
    their hardware and model; where there is none, a new one holding only the calibration (the analytical model is
    then what is calibrated)."""
    keys = {(r.plan.cluster.device.name, r.plan.model.name) for r in runs}
    if len(keys) > 1:
        raise ValueError(f"the runs are for different hardware/models {sorted(keys)}: calibrate one at a time")
    (device, model), = keys
    recorded = {r.plan.predicted.profile for r in runs}
    recorded = {p for p in recorded if p and Path(p).is_file()}  # a plan made on another machine names its path
    if not out and len(recorded) > 1:
        raise ValueError(f"the runs' plans were costed with different profiles {sorted(recorded)}: pass --out FILE")
    path = Path(out or next(iter(recorded), None) or find_profile(device, model) or profile_path(device, model))
    if path.exists():
        return path, load_profile(path)
    provenance = Provenance(device_name=device, device_detail="not profiled: a calibration of the analytical model",
                            torch_version="-", cuda_version=None, date="", command="", num_threads=0, dtype="bfloat16")
    return path, Profile(schema_version=PROFILE_SCHEMA_VERSION, hardware=device, model=model, provenance=provenance)


def calibrate_main(sources: list[str], plans: list[str], *, out: str | None) -> int:
    """Fit, write into the profile, print every run's error before, after and left out, and the fitted values."""
    runs = load_runs(sources, plans)
    path, profile = _profile_for(runs, out)
    replaced = path.exists()
    profile.calibration = None  # predictions before the fit are the uncalibrated ones
    cal = calibrate_runs(runs, profile, sources=sources)
    profile.calibration = cal
    save_profile(profile, path)
    print(f"{'run':<48} {'measured':>9} {'before':>9} {'after':>9} {'left out':>9}")
    for r in cal.runs:
        loo = "" if r.leave_one_out_s is None else f"{100 * (r.leave_one_out_s / r.measured_s - 1):>+8.1f}%"
        print(f"{r.name[-48:]:<48} {r.measured_s:>8.3f}s {100 * (r.before_s / r.measured_s - 1):>+8.1f}% "
              f"{100 * (r.after_s / r.measured_s - 1):>+8.1f}% {loo:>9}")
    loo = "" if cal.leave_one_out_rms is None else f", leave-one-out {cal.leave_one_out_rms:.1%}"
    print(f"relative RMS error {cal.rms_error_before:.1%} -> {cal.rms_error_after:.1%}{loo}")
    for name, value in sorted(cal.values.items()):
        r = CALIBRATED_ASSUMPTIONS[name]
        flag = "  (at its bound: the runs want a value outside the physical range)" if name in cal.at_bound else ""
        print(f"  {name} = {value:.4g}  (range {r.low:g}..{r.high:g}){flag}")
    if cal.not_identifiable:
        print(f"  not constrained by these runs (defaults kept): {', '.join(cal.not_identifiable)}")
    print(_written(path, replaced=replaced, chosen=out is not None))
    return 0


def _written(path: Path, *, replaced: bool, chosen: bool) -> str:
    """The line saying where the fit went: a profile under ``PROFILES_DIR`` that ``--out`` did not name is one every
    later ``plan`` for this hardware and model picks up, which the line says."""
    if chosen or not path.resolve().is_relative_to(PROFILES_DIR):
        return f"wrote {path}"
    what = "replaced the calibration of the committed profile" if replaced else "wrote the new profile"
    return f"{what} {path}: every later plan for this hardware and model costs with it (--out FILE writes elsewhere)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m planner.calibrate", description=__doc__.split("\n")[0])
    p.add_argument("runs", metavar="RUNS", nargs="+",
                   help="measured runs to refit the cost model's assumptions from: runtime metrics files (with --plan) "
                   "or CSV/YAML tables with columns plan or args, step_time_s, peak_memory_gib (optional)")
    p.add_argument("--plan", nargs="+", default=[], help="plan file(s) the metrics files were run from (one per "
                   "metrics file)")
    p.add_argument("--out", help="the profile to write the fit into (default: the plans' profile, or the committed "
                   "profile of the runs' hardware and model)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """``python -m planner.calibrate``: a mistake in the runs is one line on stderr and exit status 2."""
    args = parse_args(argv)
    try:
        return calibrate_main(args.runs, args.plan, out=args.out)
    except (ValueError, NotImplementedError, OSError) as e:
        print(f"calibrate: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
