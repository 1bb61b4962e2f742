"""The adaptive run's planner half (``python -m planner.adapt``): the fit recovers per-module compute factors, the
optimizer's and the step's overhead from measurements the cost model itself made under known values; the run's own
collectives enter the prediction; a factor that cannot explain its module ends on its bound and says so; a memory
re-plan keeps an earlier time fit; bad input is one line."""

from __future__ import annotations

import json

import pytest

from planner import adapt
from planner.contract.schema import load_plan
from planner.contract.strategy import layout_of, strategy_of
from planner.profiles import load_profile
from planner.replan import replan_problem
from tests.runtime.plans import make_plan

TRUTH = {"vision_compute_scale": 3.0, "llm_compute_scale": 2.0, "optimizer_time_scale": 1.5, "step_overhead_s": 0.05}


def _collectives(seconds_per_byte: float) -> list[dict]:
    """Timings of every priced collective over 2 ranks: 100 us plus ``seconds_per_byte``."""
    return [{"op": op, "group_size": 2, "message_bytes": size, "backend": "gloo",
             "times": [1e-4 + size * seconds_per_byte] * 3}
            for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
            for size in (4096, 262144, 16777216)]


def _request(tmp_path, measured: dict | None = None, seconds_per_byte: float = 1e-9) -> tuple[str, dict]:
    """A TP2 plan's request file; ``measured`` None: what the cost model predicts under ``TRUTH`` (with the
    request's collectives), split 1:2 between forward and backward."""
    plan = make_plan(dict(tp=2, micro_batch=2), dict(tp=2, micro_batch=2))
    (tmp_path / "plan.json").write_text(plan.to_json())
    request = {"plan": str(tmp_path / "plan.json"), "collectives": _collectives(seconds_per_byte), "dtype": "float32",
               "measured": measured or {"step_time_s": 1.0}}
    if measured is None:
        parsed = adapt.AdaptRequest.model_validate(request)
        adapt.save_profile(adapt.fitted_profile(plan, parsed), tmp_path / "truth-profile.json")
        truth = adapt._Predictor(replan_problem(plan, 2, str(tmp_path / "truth-profile.json")), strategy_of(plan))(TRUTH)
        request["measured"] = {"step_time_s": truth.step_time_s, "optimizer_s": adapt.predicted_optimizer_s(truth)}
        for module, cost in truth.modules.items():
            passes = adapt.module_passes_s(cost)
            request["measured"] |= {f"{module}_forward_s": passes / 3, f"{module}_backward_s": 2 * passes / 3}
    path = tmp_path / "measured.json"
    path.write_text(json.dumps(request))
    return str(path), request


def _adapt(tmp_path, path: str) -> dict:
    return adapt.adapt(adapt.load_request(path), path, str(tmp_path / "new.json"), str(tmp_path / "fitted.json"))


def test_the_fit_recovers_each_modules_compute_the_optimizer_and_the_overhead(tmp_path):
    path, request = _request(tmp_path)
    answer = _adapt(tmp_path, path)
    assert answer["fitted"] == pytest.approx(TRUTH, rel=1e-6)
    assert answer["at_bound"] == [] and max(map(abs, answer["residuals"].values())) < 1e-6
    assert answer["current_fitted_s"] == pytest.approx(request["measured"]["step_time_s"], rel=1e-6)
    new = load_plan(answer["new_plan"])
    assert answer["new_fitted_s"] == new.predicted.step_time_s <= answer["current_fitted_s"]
    assert answer["new_layout"] == layout_of(new) and answer["same_layout"] == (layout_of(new) == answer["current_layout"])
    profile = load_profile(answer["profile"])  # what the next `plan --profile` reads
    assert profile.calibration.values == answer["fitted"] and len(profile.collectives) == 15
    assert new.predicted.profile == answer["profile"]


def test_the_runs_collectives_are_what_the_fitted_model_prices(tmp_path):
    """The same measured passes with collectives 100x slower leave less of them to compute: smaller compute
    factors, and a re-plan that moves off TP (its per-layer collectives now dear)."""
    path, request = _request(tmp_path)
    fast = _adapt(tmp_path, path)
    slow_path = tmp_path / "slow.json"
    slow_path.write_text(json.dumps({**request, "collectives": _collectives(1e-7)}))
    slow = _adapt(tmp_path, str(slow_path))
    for module in ("vision", "llm"):
        assert slow["fitted"][f"{module}_compute_scale"] < fast["fitted"][f"{module}_compute_scale"]
    assert "TP2" in slow["current_layout"] and "TP2" not in slow["new_layout"]


def test_a_module_faster_than_its_own_collectives_ends_on_its_bound_and_says_so(tmp_path):
    path, request = _request(tmp_path)
    measured = {**request["measured"], "vision_forward_s": 1e-6, "vision_backward_s": 1e-6}
    path, _ = _request(tmp_path, measured)
    answer = _adapt(tmp_path, path)
    assert answer["fitted"]["vision_compute_scale"] == adapt.ADAPTED_ASSUMPTIONS["vision_compute_scale"].low
    assert answer["at_bound"] == ["vision_compute_scale"] and answer["residuals"]["vision"] > 1


@pytest.mark.parametrize("change, said", [
    (dict(measured={"step_time_s": -1.0}), "measured step_time_s = -1.0 is not a time in seconds"),
    (dict(measured={"llm_forward_s": 0.1}), "measured step_time_s is missing or not positive"),
    (dict(collectives=[{"op": "broadcast"}]), "collectives.0.op"),
    (dict(plan="/nonexistent/plan.json"), "/nonexistent/plan.json"),
])
def test_a_bad_request_is_one_line_and_exit_2(tmp_path, capsys, change, said):
    _, request = _request(tmp_path, {"step_time_s": 1.0})
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({**request, **change}))
    assert adapt.main([str(path), "--out", str(tmp_path / "n.json"), "--profile-out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("adapt: error: ") and said in err and err.count("\n") == 1


def test_a_layout_line_says_when_the_modules_have_gpus_of_their_own():
    """``vision DP1; llm DP1`` on one GPU, or each on its own: the line (and the adaptive fit's "same layout") tells
    them apart."""
    colocated = make_plan(dict(dp=1), dict(dp=1))
    disjoint = make_plan(dict(dp=1), dict(dp=1), placement="disjoint")
    assert layout_of(disjoint) == f"disjoint: {layout_of(colocated)}" and not layout_of(colocated).startswith("disj")


def _memory_request(tmp_path, peak: int, cap: int, measured: dict | None = None) -> str:
    """A DP2 plan (micro-batches of 2) whose ranks measured ``peak`` tensor bytes under a CPU run's tensor ``cap``."""
    plan = make_plan(dict(dp=2, micro_batch=2), dict(dp=2, micro_batch=2))
    (tmp_path / "plan.json").write_text(plan.to_json())
    request = {"plan": str(tmp_path / "plan.json"), "dtype": "float32", "measured": measured or {},
               "memory": {"peak_tensor_bytes": {"0": peak, "1": peak - 1000}, "capacity_bytes": cap,
                          "tensor_cap": True}}
    path = tmp_path / "memory.json"
    path.write_text(json.dumps(request))
    return str(path)


def _predicted_tensors(tmp_path, values: dict) -> int:
    """The DP2 plan's predicted tensors per rank under ``values``, with the profile the fit predicts with."""
    path = _memory_request(tmp_path, 1, 1)
    plan = load_plan(str(tmp_path / "plan.json"))
    adapt.save_profile(adapt.fitted_profile(plan, adapt.load_request(path)), tmp_path / "truth-profile.json")
    e = adapt._Predictor(replan_problem(plan, 2, str(tmp_path / "truth-profile.json")), strategy_of(plan))(values)
    return adapt.predicted_tensor_bytes(e)["all"]


def test_memory_over_the_plan_fits_the_step_memory_and_re_plans_under_the_devices_cap(tmp_path):
    """Ranks that measured the tensors the model predicts with the step memory 1.6x over its estimate: the fit finds
    1.6 for both modules (they share the ranks); under a cap the running plan no longer fits, the new plan does, and
    it records the device the cap stands for."""
    truth = {"vision_activation_memory_scale": 1.6, "llm_activation_memory_scale": 1.6}
    peak = _predicted_tensors(tmp_path, truth)
    cap = int(0.9 * peak)
    answer = _adapt(tmp_path, _memory_request(tmp_path, peak, cap))
    assert answer["fitted"] == pytest.approx(truth, rel=1e-6) and answer["at_bound"] == []
    memory = answer["memory"]
    assert memory["groups"]["all"]["measured"] == peak == pytest.approx(memory["groups"]["all"]["fitted"], rel=1e-6)
    assert memory["groups"]["all"]["predicted"] < peak and not memory["current_fits"]
    assert memory["usable_tensor_bytes"] == pytest.approx(cap, abs=2) and memory["new_tensor_bytes"] <= cap
    new = load_plan(answer["new_plan"])
    assert not answer["same_layout"] and new.cluster.device.memory_bytes == memory["device_memory_bytes"]
    assert load_profile(answer["profile"]).calibration.rms_error_before is None  # memory alone: no step time fitted


def test_memory_under_the_model_keeps_its_estimate_and_a_plan_that_fits_stays(tmp_path):
    predicted = _predicted_tensors(tmp_path, {})
    answer = _adapt(tmp_path, _memory_request(tmp_path, predicted // 2, 4 * predicted))
    assert answer["fitted"] == {} and answer["memory"]["current_fits"]
    assert answer["memory"]["groups"]["all"]["fitted"] == predicted


def test_a_memory_re_plan_of_a_fitted_plan_keeps_its_time_fit(tmp_path):
    """A plan made under a time fit, re-planned on its measured memory alone (no step measured): the fitted profile
    it writes keeps the time factors, so the running plan is still priced as the run measured it."""
    path, _ = _request(tmp_path)
    timed = _adapt(tmp_path, path)
    request = {"plan": timed["new_plan"], "dtype": "float32", "measured": {},
               "memory": {"peak_tensor_bytes": {"0": 1}, "capacity_bytes": 1 << 40, "tensor_cap": True}}
    (tmp_path / "memory.json").write_text(json.dumps(request))
    answer = adapt.adapt(adapt.load_request(str(tmp_path / "memory.json")), "memory.json",
                         str(tmp_path / "memory-new.json"), str(tmp_path / "memory-fitted.json"))
    assert answer["fitted"] == timed["fitted"] == load_profile(answer["profile"]).calibration.values
    assert answer["current_fitted_s"] == pytest.approx(timed["new_fitted_s"], rel=1e-9)
