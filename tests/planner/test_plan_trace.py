"""``plan --trace``: the predicted step as a Chrome trace whose spans add up to the plan's step time."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import replace

import pytest

from planner.api import make_problem
from planner.cli import main
from planner.cost import estimate
from planner.cost.pipeline import path_terms, pipeline_step_time
from planner.contract.strategy import ModuleStrategy as MS
from planner.contract.strategy import Strategy
from planner.trace import Part, _disjoint, _Timeline, micro_batch_parts, predicted_trace
from planner.contract.trace_format import LANES, makespan_s

STRATEGIES = {  # 16 GPUs, 64 samples a step
    "colocated ZeRO-3 full recompute, SP encoder": Strategy(placement="colocated", modules={
        "vision": MS(dp=8, sp=2, grad_accum=2, micro_batch=4),
        "llm": MS(dp=4, tp=4, grad_accum=2, micro_batch=8, zero=3, recompute="full")}),
    "disjoint 4 micro-batches": Strategy(placement="disjoint", modules={
        "vision": MS(dp=4, grad_accum=4, micro_batch=4), "llm": MS(dp=2, tp=4, grad_accum=4, micro_batch=8)}),
    "disjoint 1 micro-batch": Strategy(placement="disjoint", modules={
        "vision": MS(dp=4, grad_accum=1, micro_batch=16), "llm": MS(dp=2, tp=4, grad_accum=1, micro_batch=32)}),
    "colocated PP 1F1B": Strategy(placement="colocated", modules={
        "vision": MS(dp=16, grad_accum=4, micro_batch=1), "llm": MS(pp=4, dp=2, tp=2, grad_accum=4, micro_batch=8)}),
    "colocated PP interleaved": Strategy(placement="colocated", modules={
        "vision": MS(dp=16, grad_accum=4, micro_batch=1),
        "llm": MS(pp=4, dp=2, tp=2, grad_accum=4, micro_batch=8, pp_schedule="interleaved_1f1b", virtual_stages=2)}),
    "colocated PP zero-bubble": Strategy(placement="colocated", modules={
        "vision": MS(dp=16, grad_accum=4, micro_batch=1),
        "llm": MS(pp=4, dp=2, tp=2, grad_accum=4, micro_batch=8, pp_schedule="interleaved_zb", virtual_stages=2,
                  zero=1)}),
    "disjoint PP": Strategy(placement="disjoint", modules={
        "vision": MS(dp=4, grad_accum=8, micro_batch=2), "llm": MS(pp=2, dp=2, tp=2, grad_accum=8, micro_batch=4,
                                                                   zero=1)}),
}


@pytest.fixture(scope="module")
def problem():
    made = make_problem("qwen-vl-7b", 16)
    return replace(made, assumptions=replace(made.assumptions, step_overhead_s=0.05))


@pytest.mark.parametrize("name", STRATEGIES)
def test_trace_ends_at_the_predicted_step_time_and_no_lane_overlaps(problem, name):
    e = estimate(problem.model, problem.cluster, problem.workload, STRATEGIES[name], problem.assumptions)
    trace = predicted_trace(e, problem.model, problem.assumptions)
    assert makespan_s(trace) == pytest.approx(e.step_time_s, rel=1e-12)
    spans = [x for x in trace["traceEvents"] if x["ph"] == "X"]
    assert all(x["dur"] > 0 and x["ts"] >= 0 and x["tid"] in LANES.values() for x in spans)
    by_rank = defaultdict(list)
    for x in spans:  # compute and priced-as-exposed communication follow each other on a rank
        by_rank[x["pid"]].append((x["ts"], x["ts"] + x["dur"]))
    for intervals in by_rank.values():
        intervals.sort()
        assert all(a[1] <= b[0] * (1 + 1e-12) + 1e-9 for a, b in zip(intervals, intervals[1:]))
    named = {x["pid"] for x in trace["traceEvents"] if x["name"] == "process_name"}
    assert named == set(by_rank)
    llm = STRATEGIES[name].modules["llm"]
    assert len(named) == llm.pp + (STRATEGIES[name].placement == "disjoint")  # one rank per group / stage
    json.dumps(trace)
    if llm.pp > 1:  # the first micro-batch reaches each stage after its forward crossed the stages before
        firsts = [min(x["ts"] for x in spans if x["name"] == "llm forward" and x["args"]["stage"] == k)
                  for k in range(llm.pp)]
        assert firsts == sorted(firsts) and len(set(firsts)) == llm.pp


def test_each_micro_batch_is_drawn_with_every_priced_term(problem):
    """The parts of a micro-batch add up to the cost model's per-micro-batch time, the forward ones to its forward
    (what the disjoint schedule's next stage waits for)."""
    e = estimate(problem.model, problem.cluster, problem.workload, STRATEGIES["colocated ZeRO-3 full recompute, "
                                                                              "SP encoder"], problem.assumptions)
    for name, cost in e.modules.items():
        forward, backward = micro_batch_parts(cost, "full")
        assert sum(p.seconds for p in forward) == pytest.approx(cost.forward_per_micro_batch_s, rel=1e-12)
        assert sum(p.seconds for p in forward + backward) == pytest.approx(cost.per_micro_batch_s, rel=1e-12)
    names = {p.name for p in sum(micro_batch_parts(e.modules["llm"], "full"), [])}
    assert {"llm TP (forward)", "llm TP (recompute)", "llm TP (backward)", "llm recompute"} <= names
    assert "vision SP all-to-all (forward)" in {p.name for p in micro_batch_parts(e.modules["vision"], "full")[0]}


@pytest.mark.parametrize("m", [1, 2, 3, 6])
@pytest.mark.parametrize("times", [(1.0, 2.0, 0.5), (0.2, 0.3, 4.0), (1.0, 0.1, 1.1)])
def test_disjoint_order_takes_the_critical_path_of_the_cost_model(m, times):
    forward, backward, llm = times
    parts = {"vision": ([Part("f", "compute", forward)], [Part("b", "compute", backward)]),
             "llm": ([Part("t", "compute", llm)], [])}
    end = _disjoint(_Timeline(), parts, ["vision"], {"vision": 1}, 0, m)
    expected = pipeline_step_time(path_terms(forward + backward, forward, m, stage="encoder"),
                                  path_terms(llm, 0.0, m, stage="llm"))
    assert end == pytest.approx(expected, rel=1e-12)


def test_plan_trace_flag_writes_the_best_plans_trace(tmp_path, capsys):
    plan_path, trace_path = tmp_path / "plan.json", tmp_path / "step.json"
    args = ["--model", "qwen2.5-vl-tiny", "--gpu", "cpu", "--gpus", "2", "--image-size", "168x112", "--text-tokens",
            "40", "--global-batch", "4", "--out", str(plan_path)]
    assert main(args + ["--trace", str(trace_path)]) == 0
    assert f"wrote {plan_path}, {trace_path}" in capsys.readouterr().out
    trace, plan = json.loads(trace_path.read_text()), json.loads(plan_path.read_text())
    assert makespan_s(trace) == pytest.approx(plan["predicted"]["step_time_s"], rel=1e-12)
    assert trace["otherData"] == {"kind": "predicted", "step_time_s": plan["predicted"]["step_time_s"]}


@pytest.mark.parametrize("trace,error", [
    ("", "--trace needs a file path, got an empty one"),
    ("plan.json", "--trace plan.json is the same file as --out plan.json: it would be overwritten"),
    ("./plan.json", "--trace ./plan.json is the same file as --out plan.json"),
    ("missing/step.json", "cannot write --trace missing/step.json: no folder missing"),
    (".", "cannot write --trace .: it is a folder"),
])
def test_plan_trace_bad_path_is_one_line_before_planning(tmp_path, monkeypatch, capsys, trace, error):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "qwen2.5-vl-tiny", "--gpu", "cpu", "--gpus", "2", "--out", "plan.json", "--trace", trace])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and error in err
    assert not (tmp_path / "plan.json").exists()
