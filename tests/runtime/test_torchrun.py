"""``torchrun --nproc-per-node N -m runtime plan.json``: the same plan without Ray, against the single-process
reference (tolerances as in test_parity.py), and its errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from runtime.models.model import build_model
from tests.runtime.plans import make_plan
from tests.runtime.reference import reference_run

STEPS = 3
SEED = 0
LR = 1e-3


def torchrun(nproc: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node NPROC -m runtime ARGS`` (torchrun is torch.distributed.run)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "runtime", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def runtime_errors(stderr: str) -> list[str]:
    """The ranks' error lines (one may follow rank 0's progress bar on the same terminal line)."""
    marker = "runtime: error:"
    return [line[line.index(marker):] for line in stderr.splitlines() if marker in line]


@pytest.mark.slow
def test_vision_sp2_llm_tp2_under_torchrun_matches_the_reference(tmp_path):
    plan = make_plan(dict(sp=2), dict(tp=2), learning_rate=LR)
    (tmp_path / "plan.json").write_text(plan.to_json())
    metrics, saved = tmp_path / "metrics.jsonl", tmp_path / "saved"
    result = torchrun(2, str(tmp_path / "plan.json"), "--steps", str(STEPS), "--seed", str(SEED),
                      "--metrics", str(metrics), "--save", str(saved))
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r.get("step") for r in records] == [*range(STEPS), None] and records[-1]["summary"]
    assert all([x["rank"] for x in r["ranks"]] == [0, 1] for r in records[:STEPS])  # every rank's reached rank 0
    assert result.stdout.count("final loss") == 1  # rank 0 alone prints the summary
    reference = reference_run(plan, seed=SEED, steps=STEPS)
    torch.testing.assert_close([r["loss"] for r in records[:STEPS]], reference["losses"], rtol=1e-5, atol=0)
    trained = dict(build_model(plan.model.hf_config, seed=0, checkpoint=str(saved)).named_parameters())
    assert set(trained) == set(reference["params"])
    for name, expected in reference["params"].items():
        error = (trained[name].detach() - expected).abs().max().item()
        assert error <= 0.1 * LR, f"{name}: max |p - p_ref| = {error:.3g}"


@pytest.mark.slow
def test_torchrun_with_more_processes_than_the_plans_devices_is_one_line(tmp_path):
    (tmp_path / "plan.json").write_text(make_plan(dict(sp=2), dict(tp=2)).to_json())
    result = torchrun(3, str(tmp_path / "plan.json"), "--steps", "1")
    assert result.returncode != 0
    assert runtime_errors(result.stderr) == [  # every rank finds it, rank 0 alone says it
        "runtime: error: torchrun started 3 processes but the plan uses 2 devices: run torchrun with 2 processes "
        "in all (--nnodes x --nproc-per-node = 2)"
    ], result.stderr
    assert "[rank0]: Traceback" not in result.stderr  # torchrun's own report follows; no rank printed a stack


@pytest.mark.slow
def test_a_failing_rank_under_torchrun_is_its_one_line_and_its_peers_print_no_stack(tmp_path):
    """Rank 1 of the DP-2 plan reads the missing image; rank 0, waiting in a collective, loses its peer."""
    from PIL import Image

    (tmp_path / "plan.json").write_text(make_plan(dict(dp=2), dict(dp=2)).to_json())
    Image.new("RGB", (168, 112)).save(tmp_path / "good.png")
    rows = [{"image": image, "text": "a cat"} for image in ("good.png", "missing.png")]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = torchrun(2, str(tmp_path / "plan.json"), "--steps", "1", "--data", str(tmp_path / "data.jsonl"))
    assert result.returncode != 0
    errors = runtime_errors(result.stderr)
    assert errors[0].startswith(f"runtime: error: cannot read image {tmp_path}/missing.png"), result.stderr
    # rank 0 either is stopped by torchrun first (silent) or sees the connection close (one line, no stack)
    assert all(e.startswith("runtime: error: rank 0 stopped: another rank failed") for e in errors[1:]), errors
    assert "[rank0]: Traceback" not in result.stderr and "[rank1]: Traceback" not in result.stderr


def _ranks_lines(stderr: str) -> list[str]:
    """Our ranks' own lines (``runtime: ...``; one may follow rank 0's progress bar on the same terminal line)."""
    return [line[line.index("runtime: "):] for line in stderr.splitlines() if "runtime: " in line]


@pytest.mark.slow
def test_sigterm_to_torchrun_ends_each_rank_in_one_line_naming_a_complete_checkpoint(tmp_path):
    """A scheduler's SIGTERM to torchrun's agent once the first checkpoint is written: the agent passes it on to
    every rank; rank 0 alone names a complete checkpoint to resume from (checkpoints written with
    ``--async-checkpoint``, so that one may be in flight: a partial one is never named; a synchronous checkpoint's
    stop takes the same path, run on Ray by tests/runtime/test_run_faults.py) and writes the summary
    (``"stopped": "SIGTERM"``); no rank prints a stack, and no process is left. The agent itself re-raises the signal as its ``SignalException`` (a traceback of torchrun's
    own and exit status 1, docs/runtime.md), so only the ranks' lines are ours to check."""
    from runtime.run.checkpoint_dir import is_complete, latest_checkpoint
    from tests.runtime.test_run_faults import _records

    (tmp_path / "plan.json").write_text(make_plan(dict(dp=2), dict(dp=2)).to_json())
    metrics, folder = tmp_path / "m.jsonl", tmp_path / "ck"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "runtime", str(tmp_path / "plan.json"), "--steps", "1000", "--metrics", str(metrics),
               "--checkpoint-dir", str(folder), "--checkpoint-every", "2", "--async-checkpoint"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 240
        while not any(r.get("event") == "checkpoint" for r in _records(metrics)):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=120)
    finally:
        _stop_group(process.pid)
    assert process.returncode == 1, err[-3000:]  # torchrun's agent: its SignalException
    # no stack through our code (once in five runs a thread of multiprocessing's resource sharer printed one)
    assert not [line for line in err.splitlines() if 'File "' in line and "/runtime/" in line], err[-3000:]
    lines = _ranks_lines(err)
    assert len(lines) == 1 and lines[0].startswith("runtime: interrupted (SIGTERM): resume with --resume "), err
    named = lines[0].split("--resume ")[1]
    assert is_complete(named) and named == latest_checkpoint(str(folder)), (named, os.listdir(folder))
    summary = _records(metrics)[-1]
    assert summary.get("summary") and summary["stopped"] == "SIGTERM" and summary["steps"] >= 2, summary
    assert out.count("final loss") == 1


def _stop_group(pgid: int) -> None:
    """Waits (10 s at most) for every process of the test's torchrun session to end, then fails if one is left
    (killing it, so that none outlives the test)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(pgid, signal.SIGKILL)
    raise AssertionError("a process of the stopped torchrun run was left")
