"""Calibration: metrics parsing, rebuilding a plan's inputs, and the refit written into the profile."""

import json

import pytest

from planner import schema
from planner.catalog import get_model
from planner.cost import estimate
from planner.hardware import get_device
from planner.profiles import PROFILE_SCHEMA_VERSION, Profile, ProfileCostSource, Provenance, load_profile, save_profile
from planner.strategy import ModuleStrategy, Strategy
from planner.workload import Workload
from runtime.profile.__main__ import main
from runtime.profile.calibrate import measured_step_time, plan_inputs, raw_prediction

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
        cluster=schema.ClusterInfo(device=schema.DeviceInfo(**device.__dict__), num_devices=strategy.num_gpus,
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


def test_calibrate_writes_the_least_squares_fit_into_the_profile(tmp_path, capsys):
    profile = Profile(schema_version=PROFILE_SCHEMA_VERSION, hardware="cpu", model=MODEL.name, provenance=PROV)
    profile_file = tmp_path / "cpu.json"
    save_profile(profile, profile_file)
    plans, metrics, predicted = [], [], []
    for ga in (1, 2, 4):
        plan = make_plan(MODEL, strategy(ga), WORKLOAD, get_device("cpu"))
        path = tmp_path / f"plan{ga}.json"
        path.write_text(plan.to_json())
        p = raw_prediction(plan, profile)
        assert p == pytest.approx(estimate(MODEL, *plan_inputs(plan)[1:],
                                           layer_costs=ProfileCostSource(profile)).step_time_s)
        predicted.append(p)
        # A run that is exactly 3x the prediction plus 0.25 s.
        metrics.append(write_metrics(tmp_path / f"m{ga}.jsonl", {0: [10.0] + [3 * p + 0.25] * 3}))
        plans.append(path)
    assert len(set(predicted)) == 3
    assert main(["--calibrate", *map(str, metrics), "--plan", *map(str, plans), "--out", str(profile_file)]) == 0
    cal = load_profile(profile_file).calibration
    assert (cal.scale, cal.overhead_s) == pytest.approx((3.0, 0.25))
    assert cal.rms_error_after == pytest.approx(0.0, abs=1e-9) and cal.num_samples == 3
    assert "wrote" in capsys.readouterr().out
