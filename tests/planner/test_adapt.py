"""The adaptive run's planner half (``python -m planner.adapt``): the fit recovers per-module compute factors, the
optimizer's and the step's overhead from measurements the cost model itself made under known values; the run's own
collectives enter the prediction; a factor that cannot explain its module ends on its bound and says so; bad input is
one line."""

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
