"""Calibration: metrics parsing, rebuilding a plan's inputs, and the refit written into the profile."""

import json
import statistics
import sys

import pytest

from planner.catalog import get_model
from planner.contract import schema
from planner.contract.hardware import get_device
from planner.contract.strategy import ModuleStrategy, Strategy
from planner.contract.workload import Workload
from planner.cost.assumptions import DEFAULT_ASSUMPTIONS
from planner.profiles import PROFILE_SCHEMA_VERSION, Profile, Provenance, load_profile, save_profile
from planner.calibrate import MeasuredRun, Predictor, load_runs, measured_step_time, plan_inputs
from planner.calibrate import main as calibrate_main_cli
from runtime.profile.__main__ import main

PROV = Provenance(device_name="cpu", device_detail="test", torch_version="x", cuda_version=None, date="2026-01-01",
                  command="test", num_threads=1, dtype="float32")


def write_metrics(path, step_times_by_rank):
    rows = [{"rank": r, "step": s, "step_time_s": t} for r, times in step_times_by_rank.items()
            for s, t in enumerate(times)]
    summary = {"summary": True, "step_time_s": {"measured": 99.0, "predicted": 1.0}}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + [summary]))
    return path


def test_measured_step_time_is_median_of_slowest_rank_after_warmup(tmp_path):
    # Slowest rank per step: 9 (dropped as warm-up), 1.2, 1.5, 1.1 -> median 1.2.
    path = write_metrics(tmp_path / "m.jsonl", {0: [9.0, 1.0, 1.5, 1.1], 1: [2.0, 1.2, 1.4, 1.0]})
    assert measured_step_time(path) == pytest.approx(1.2)


def test_metrics_errors_are_one_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"loss": 1}\n')
    with pytest.raises(ValueError, match="no step_time_s"):
        measured_step_time(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError, match="cannot read metrics"):
        measured_step_time(tmp_path / "missing.jsonl")


def make_plan(model, strategy, workload, device) -> schema.Plan:
    """A schema-valid plan for ``strategy`` (predicted numbers zero: calibration recomputes them)."""
    zero_time = schema.ModuleTime(forward=0, backward=0, recompute=0, tp_comm=0, sp_comm=0, cp_comm=0, dp_comm=0,
                                  optimizer=0, handoff=0, per_micro_batch=0)
    zero_mem = schema.MemoryBreakdown(weights=0, gradients=0, optimizer=0, activations=0, buffers=0, overhead=0)
    ranks = strategy.module_ranks()
    modules = [
        schema.ModulePlan(name=name, ranks=ranks[name], dp=s.dp, tp=s.tp, sp=s.sp, cp=s.cp, zero=s.zero,
                          recompute=s.recompute, micro_batch=s.micro_batch, grad_accum=s.grad_accum, frozen=False,
                          num_params=model.module(name).num_params,
                          predicted=schema.ModulePrediction(time_s=zero_time, memory_gib=zero_mem, flops_per_step=0,
                                                            sources={}))
        for name, s in strategy.modules.items()
    ]
    return schema.Plan(
        schema_version=schema.SCHEMA_VERSION, planner_version="test",
        model=schema.ModelInfo(name=model.name, family=model.family, hf_config=dict(model.hf_config),
                               num_params=model.num_params, module_params={}),
        cluster=schema.ClusterInfo(device=device, num_devices=strategy.num_gpus,
                                   devices_per_node=device.devices_per_node),
        workload=schema.WorkloadInfo(image_sizes=[], vision_tokens=workload.vision_tokens,
                                     text_tokens=workload.text_tokens, audio_seconds=0.0,
                                     global_batch=workload.global_batch, module_tokens={}, llm_image_tokens=0),
        training=schema.TrainingInfo(precision=strategy.precision), placement=strategy.placement, modules=modules,
        predicted=schema.Prediction(step_time_s=0, tokens_per_s=0, samples_per_s=0, mfu=0, peak_memory_gib=0,
                                    memory_breakdown_gib=zero_mem, binding_constraint=""),
        baselines={}, solver=schema.SolverInfo(status="EVALUATED", num_candidates=1),
    )


MODEL = get_model("qwen2.5-vl-tiny")
WORKLOAD = Workload(vision_tokens=256, text_tokens=64, global_batch=4)


def strategy(ga: int) -> Strategy:
    ms = ModuleStrategy(dp=1, micro_batch=4 // ga, grad_accum=ga)
    return Strategy(placement="colocated", modules={"vision": ms, "llm": ms})


def test_plan_inputs_round_trip():
    plan = make_plan(MODEL, strategy(2), WORKLOAD, get_device("cpu"))
    model, cluster, workload, strat = plan_inputs(plan)
    assert model.num_params == MODEL.num_params and workload == WORKLOAD and strat == strategy(2)
    assert cluster.device == get_device("cpu")


EMPTY = Profile(schema_version=PROFILE_SCHEMA_VERSION, hardware="cpu", model=MODEL.name, provenance=PROV)
TRUTH = {"step_overhead_s": 0.25, "max_matmul_efficiency": 0.45}


def _strategies():
    yield from (strategy(ga) for ga in (1, 2, 4))
    yield Strategy(placement="colocated", modules={m: ModuleStrategy(dp=2, micro_batch=2) for m in ("vision", "llm")})
    yield Strategy(placement="colocated", modules={m: ModuleStrategy(dp=1, tp=2, micro_batch=4) for m in ("vision",
                                                                                                            "llm")})


def _runs_table(tmp_path, truth, *, peak_gib=None):
    """Plan files of five strategies and a CSV of their 'measured' step times: the cost model's own prediction with
    the assumptions ``truth``."""
    rows = []
    for i, strat in enumerate(_strategies()):
        plan = make_plan(MODEL, strat, WORKLOAD, get_device("cpu"))
        path = tmp_path / f"plan{i}.json"
        path.write_text(plan.to_json())
        run = MeasuredRun(name=str(path), where=str(path), plan=plan, measured_s=1.0)
        rows.append(f"{path},{Predictor(run, EMPTY)(truth).step_time_s},{'' if peak_gib is None else peak_gib}")
    table = tmp_path / "runs.csv"
    table.write_text("plan,step_time_s,peak_memory_gib\n" + "\n".join(rows) + "\n")
    return table


def test_calibration_recovers_the_assumptions_the_runs_were_made_with(tmp_path, capsys):
    profile_file = tmp_path / "cpu.json"
    save_profile(EMPTY, profile_file)
    table = _runs_table(tmp_path, TRUTH, peak_gib=2.0)
    assert calibrate_main_cli([str(table), "--out", str(profile_file)]) == 0
    cal = load_profile(profile_file).calibration
    # Five runs of one small model do not pin every assumption apart (matmul efficiency trades against the others),
    # but each moves most of the way from its default to the truth, and the predictions are recovered.
    for name, value in TRUTH.items():
        assert abs(cal.values[name] - value) < abs(getattr(DEFAULT_ASSUMPTIONS, name) - value) / 2, name
    assert cal.rms_error_before > 0.3 and cal.rms_error_after < 0.03 and cal.leave_one_out_rms < 0.05
    assert all(r.leave_one_out_s is not None for r in cal.runs)
    # the memory reserve makes the median run's predicted peak the measured 2 GiB
    assert statistics.median(r.predicted_peak_bytes for r in cal.runs) == pytest.approx(2 * 2**30, rel=1e-6)
    assert "eager_attention_efficiency" in cal.not_identifiable  # the model runs flash attention
    out = capsys.readouterr().out
    assert "left out" in out and "max_matmul_efficiency = " in out and "wrote" in out


def test_a_fit_on_its_bound_close_to_the_runs_is_kept_and_says_so(tmp_path, capsys):
    profile_file = tmp_path / "cpu.json"
    save_profile(EMPTY, profile_file)
    table = _runs_table(tmp_path, {"step_overhead_s": 72.0})  # above its 60 s bound, within the runs' noise of it
    assert calibrate_main_cli([str(table), "--out", str(profile_file)]) == 0
    cal = load_profile(profile_file).calibration
    assert "step_overhead_s" in cal.at_bound
    assert "at its bound" in capsys.readouterr().out


def test_a_fit_on_its_bound_far_from_the_runs_is_refused_naming_the_row(tmp_path, capsys):
    profile_file = tmp_path / "cpu.json"
    save_profile(EMPTY, profile_file)
    table = _runs_table(tmp_path, {"step_overhead_s": 59.0, "max_matmul_efficiency": 0.21})
    rows = table.read_text().splitlines()
    scaled = [rows[0]] + [",".join([p, str(100 * float(t)), m]) for p, t, m in (r.split(",") for r in rows[1:])]
    table.write_text("\n".join(scaled) + "\n")
    assert calibrate_main_cli([str(table), "--out", str(profile_file)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"{table} row " in err and "step_time_s: the fit stops" in err
    assert load_profile(profile_file).calibration is None  # nothing written


def test_bad_runs_tables_are_one_line_errors(tmp_path):
    bad = tmp_path / "runs.csv"
    for text, message in (("plan,step_time_s,speed\nx.json,1,2\n", "unknown column"),
                          ("plan,step_time_s\n,1\n", "either plan"),
                          ("args,step_time_s\n--model nope --gpus 2,1\n", "failed"),
                          ("step_time_s\n", "holds no runs")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_runs([str(bad)], [])
    plan_file = tmp_path / "p.json"
    plan_file.write_text(make_plan(MODEL, strategy(1), WORKLOAD, get_device("cpu")).to_json())
    bad.write_text(f"plan,step_time_s\n{plan_file},-3\n")
    with pytest.raises(ValueError, match="positive number"):
        load_runs([str(bad)], [])


def test_a_calibration_of_unknown_or_unphysical_values_is_refused():
    from planner.profiles import CalibratedRun, Calibration, apply_calibration

    def calibration(**values):
        return Calibration(values=values, runs=[CalibratedRun(name="r", measured_s=1, before_s=1, after_s=1)],
                           rms_error_before=0, rms_error_after=0, date="2026-12-02", sources=[])

    assert apply_calibration(DEFAULT_ASSUMPTIONS, calibration(step_overhead_s=0.5)).step_overhead_s == 0.5
    with pytest.raises(ValueError, match="not one of the calibrated"):
        apply_calibration(DEFAULT_ASSUMPTIONS, calibration(usable_memory_fraction=0.5))
    with pytest.raises(ValueError, match="outside its physical range"):
        apply_calibration(DEFAULT_ASSUMPTIONS, calibration(max_matmul_efficiency=3.0))


def test_a_csv_row_with_more_fields_than_the_header_is_a_one_line_error(tmp_path):
    table = tmp_path / "runs.csv"
    table.write_text("args,step_time_s\n--model m --image-sizes 448x448,448x448,1.0\n")
    with pytest.raises(ValueError, match="quote an args value"):
        load_runs([str(table)], [])


def test_a_plan_from_before_host_costs_takes_the_catalog_device_values():
    plan = make_plan(MODEL, strategy(1), WORKLOAD, get_device("h100"))
    data = json.loads(plan.to_json())
    for key in ("kernel_launch_latency", "host_overlap"):
        del data["cluster"]["device"][key]
    old = schema.Plan.model_validate(data)
    assert plan_inputs(old)[1].device == get_device("h100")


def test_calibration_goes_into_the_profile_the_plans_were_costed_with(tmp_path):
    profile_file = tmp_path / "cpu@this-machine.json"
    save_profile(EMPTY, profile_file)
    plan = make_plan(MODEL, strategy(1), WORKLOAD, get_device("cpu"))
    plan = plan.model_copy(update={"predicted": plan.predicted.model_copy(update={"profile": str(profile_file)})})
    (tmp_path / "p.json").write_text(plan.to_json())
    (tmp_path / "runs.csv").write_text(f"plan,step_time_s\n{tmp_path / 'p.json'},1.0\n")
    assert calibrate_main_cli([str(tmp_path / "runs.csv")]) == 0
    assert load_profile(profile_file).calibration is not None


def test_calibration_sets_the_expert_load_imbalance_the_runs_measured(tmp_path):
    """A mixture-of-experts run records the busiest EP rank's load over the mean every step; the calibration takes
    the median over the runs' steps (not a fit), and plan then costs with it."""
    from planner.profiles import apply_calibration

    moe = get_model("qwen3-vl-moe-tiny")
    modules = {"vision": ModuleStrategy(dp=2, micro_batch=2), "llm": ModuleStrategy(dp=2, ep=2, micro_batch=2)}
    plan_file = tmp_path / "moe.json"
    plan_file.write_text(make_plan(moe, Strategy(placement="colocated", modules=modules), WORKLOAD,
                                   get_device("cpu")).to_json())
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "step_time_s": 0.5, "moe_load_imbalance": v}) + "\n"
                               for s, v in enumerate([1.9, 1.5, 1.6, 1.7])))
    profile_file = tmp_path / "cpu.json"
    save_profile(Profile(schema_version=PROFILE_SCHEMA_VERSION, hardware="cpu", model=moe.name, provenance=PROV),
                 profile_file)
    assert calibrate_main_cli([str(metrics), "--plan", str(plan_file), "--out", str(profile_file)]) == 0
    calibrated = load_profile(profile_file)
    assert calibrated.calibration.values["moe_load_imbalance"] == pytest.approx(1.65)
    assert apply_calibration(DEFAULT_ASSUMPTIONS, calibrated.calibration).moe_load_imbalance == pytest.approx(1.65)


H100_EMPTY = Profile(schema_version=PROFILE_SCHEMA_VERSION, hardware="h100-80gb", model=MODEL.name, provenance=PROV)


def _h100_run(tmp_path, capsys, *, step_time_s=None, peak_gib=None):
    """`--calibrate` of one row of a plan file on an H100 (the step time, unless given, is the one predicted);
    returns (exit status, stderr, whether the profile holds a calibration afterwards)."""
    plan = make_plan(MODEL, strategy(1), WORKLOAD, get_device("h100"))
    plan_file, profile_file, table = tmp_path / "p.json", tmp_path / "h100.json", tmp_path / "runs.csv"
    plan_file.write_text(plan.to_json())
    save_profile(H100_EMPTY, profile_file)
    if step_time_s is None:
        step_time_s = Predictor(MeasuredRun(name="r", where="r", plan=plan, measured_s=1.0), H100_EMPTY)({}).step_time_s
    table.write_text(f"plan,step_time_s,peak_memory_gib\n{plan_file},{step_time_s},{peak_gib or ''}\n")
    status = calibrate_main_cli([str(table), "--out", str(profile_file)])
    return status, capsys.readouterr().err, load_profile(profile_file).calibration is not None


@pytest.mark.parametrize("column, value, says", [
    ("peak_memory_gib", 61500, "no peak one h100-80gb can hold"),
    ("peak_memory_gib", 1e308, "no peak one h100-80gb can hold"),
    ("step_time_s", 1e308, "at most a day"),
    ("step_time_s", 1e-9, "faster than 1 GPU(s) do the step"),
    # a peak an H100 can hold, but not the tiny model's states and activations plus at most 32 GiB of reserve
    ("peak_memory_gib", 70, "the memory reserve stops at its physical bound"),
])
def test_impossible_measurements_are_refused_in_one_line_naming_file_row_column(tmp_path, capsys, column, value, says):
    keyword = "peak_gib" if column == "peak_memory_gib" else column
    status, err, written = _h100_run(tmp_path, capsys, **{keyword: value})
    assert status == 2 and not written
    assert len(err.strip().splitlines()) == 1 and f"runs.csv row 1 {column}: " in err and says in err, err


def test_an_args_row_is_planned_through_the_api_not_the_cli(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "planner.cli", None)  # importing it now fails
    table = tmp_path / "runs.csv"
    table.write_text('args,step_time_s\n"--model qwen2.5-vl-tiny --gpu cpu --gpus 2 --fix llm.tp=2",10\n')
    run, = load_runs([str(table)], [])
    assert run.plan.module("llm").tp == 2 and run.where == f"{table} row 1"


def test_a_fit_into_the_profiles_folder_that_out_did_not_name_says_so():
    from planner.profiles import PROFILES_DIR
    from planner.calibrate import _written

    committed = PROFILES_DIR / "h100-80gb" / "m.json"
    assert _written(committed, replaced=True, chosen=False).startswith(
        f"replaced the calibration of the committed profile {committed}: every later plan")
    assert _written(committed, replaced=False, chosen=False).startswith(f"wrote the new profile {committed}")
    assert _written(committed, replaced=True, chosen=True) == f"wrote {committed}"


def test_metrics_files_are_checked_as_tables_are(tmp_path, capsys):
    plan_file = tmp_path / "p.json"
    plan_file.write_text(make_plan(MODEL, strategy(1), WORKLOAD, get_device("h100")).to_json())
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "step_time_s": 1.0, "peak_memory_gib": 61500}) + "\n"
                               for s in range(3)))
    assert calibrate_main_cli([str(metrics), "--plan", str(plan_file), "--out", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"metrics file {metrics} peak_memory_gib: 61500 GiB is no peak" in err
    assert not (tmp_path / "o.json").exists()


def test_the_profilers_calibrate_flag_points_at_the_planners_command(capsys):
    assert main(["--calibrate", "runs.csv"]) == 2
    err = capsys.readouterr().err.strip()
    assert "python -m planner.calibrate RUNS" in err and len(err.splitlines()) == 1
