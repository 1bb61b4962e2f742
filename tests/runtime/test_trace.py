"""``python -m runtime --trace DIR``: each measured step as a Chrome trace of every rank's timed spans."""

from __future__ import annotations

import json

import pytest

from planner.contract.trace_format import LANES, makespan_s
from runtime.__main__ import check_flags, parse_args
from runtime.observability.metrics import MetricsLog
from runtime.observability.trace import step_trace
from tests.runtime.plans import make_plan
from tests.runtime.test_cli import assert_one_line_error, run_cli


def _result(rank: int) -> dict:
    """A rank's measurements as ``Trainer.train_step`` returns them (two micro-batches, colocated)."""
    spans = [("step", 0.0, 1.0), ("vision_forward_s", 0.0, 0.1), ("llm_forward_s", 0.1, 0.2),
             ("llm_backward_s", 0.2, 0.4), ("vision_forward_s", 0.5, 0.6), ("hand-off wait", 0.6, 0.61),
             ("grad_sync_s", 0.8, 0.9), ("optimizer_s", 0.9, 1.0), ("forward_one_chunk", 0.2, 0.3)]
    return {"rank": rank, "modules": ["llm", "vision"], "loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "llm_tokens": 8,
            "step_time_s": 1.0 + rank / 10, "peak_memory_bytes": 0, "spans": spans}


def test_step_trace_names_ranks_lanes_and_micro_batches():
    trace = step_trace(3, [_result(0), _result(1)])
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert makespan_s(trace) == pytest.approx(1.0)
    assert trace["otherData"] == {"kind": "measured", "step": 3, "step_time_s": 1.1}
    rank0 = {(e["name"], e["args"].get("micro_batch")): e for e in spans if e["pid"] == 0}
    assert rank0[("vision forward", 1)]["ts"] == pytest.approx(0.5e6)  # the second forward is micro-batch 1
    assert rank0[("llm forward", 0)]["dur"] == pytest.approx(0.1e6)
    lanes = {e["name"]: e["tid"] for e in spans}
    assert lanes["grad sync"] == lanes["hand-off wait"] == LANES["communication"]
    assert lanes["step"] == LANES["host"] and lanes["llm stage forward"] == lanes["optimizer"] == LANES["compute"]
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert names == ["rank 0: llm, vision", "rank 1: llm, vision"]


def test_metrics_log_writes_a_trace_per_step_and_warns_once_when_it_cannot(tmp_path, capsys):
    log = MetricsLog(make_plan({}, {}), steps=2, path=None, trace_dir=str(tmp_path))
    log.log(0, [_result(0)])
    assert makespan_s(json.loads((tmp_path / "step-0.json").read_text())) == pytest.approx(1.0)
    log.trace_dir = str(tmp_path / "gone")
    log.log(1, [_result(0)])
    log.log(2, [_result(0)])
    log.close()
    assert capsys.readouterr().err.count("no more traces, training goes on") == 1


@pytest.mark.parametrize("flags,error", [
    (["--trace-profiler"], "--trace-profiler needs --trace DIR"),
    (["--trace", "t", "--dry-run"], "--trace records the steps of a run; --dry-run runs none"),
])
def test_trace_flags_that_do_not_go_together(flags, error):
    with pytest.raises(ValueError, match=error):
        check_flags(parse_args(["plan.json", *flags]))


def test_trace_folder_that_is_a_file_is_one_line_before_ray(tmp_path):
    (tmp_path / "plan.json").write_text(make_plan({}, {}).to_json())
    (tmp_path / "file").write_text("")
    result = run_cli(str(tmp_path / "plan.json"), "--trace", str(tmp_path / "file"))
    assert_one_line_error(result, f"--trace {tmp_path / 'file'} is a file, not a folder")
