"""How a run ends or goes on when something outside it fails: a checkpoint that could not be written (the loop
warns and trains on), a full disk under the metrics file or a saved folder's index (written through a temporary
file renamed into place: the file is whole or as it was), Ctrl-C or a scheduler's SIGTERM (one line naming the
checkpoint to resume from, the summary, exit status 128 + the signal), a dry-run's own fault (one line, exit status 3, never DOES NOT FIT's 1)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest

from runtime.checkpoints import hf_folder as checkpoint
from runtime import dry_run
from runtime.training import loop
from runtime.__main__ import DRY_RUN_FAILED, main
from runtime.run.checkpoint_dir import CheckpointOptions
from runtime.observability.metrics import MetricsLog
from tests.runtime.plans import make_plan
from tests.runtime.test_recovery import _assert_no_workers_left

DISK_FULL = "rank 1: [Errno 28] No space left on device"


class DiskFullJob:
    """A ``loop.StepJob`` whose every checkpoint fails to write, as ``Checkpointer.save`` reports it."""

    def __init__(self):
        self.steps_done = 0

    def step(self) -> list[dict]:
        self.steps_done += 1
        return [{"rank": 0, "loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "step_time_s": 0.1, "llm_tokens": 8,
                 "peak_memory_bytes": 1}]

    def save_training_checkpoint(self, checkpoints: CheckpointOptions) -> list[dict]:
        return [{"step": self.steps_done, "path": f"{checkpoints.directory}/step-{self.steps_done:06d}",
                 "error": DISK_FULL, "seconds": 0.01}]

    def finish_checkpoints(self) -> list[dict]:
        return []


def test_a_checkpoint_that_could_not_be_written_is_a_warning_and_training_goes_on(tmp_path, capsys):
    metrics, saved = tmp_path / "m.jsonl", []
    log = MetricsLog(make_plan({}, {}), steps=4, path=str(metrics))
    loop.train(DiskFullJob(), log, 4, CheckpointOptions(directory=str(tmp_path / "ck"), every=2),
               on_saved=saved.append)
    summary = log.summary()
    log.close()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [0, 1, 2, 3]
    assert [(r["event"], r["step"]) for r in records if "event" in r] == [("checkpoint_failed", 2),
                                                                          ("checkpoint_failed", 4)]
    assert saved == [] and summary["failed_checkpoints"] == 2 and "checkpoints" not in summary
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("runtime: warning:")]
    assert len(warnings) == 2 and "checkpoint of step 2 not written, training goes on" in warnings[0]
    assert DISK_FULL in warnings[0]


def test_the_progress_bar_of_a_resumed_run_starts_at_the_resumed_step(tmp_path):
    """A 4-step run resumed at step 2 ends its bar at 4/4, not 2/4 (50 %)."""
    job, log = DiskFullJob(), MetricsLog(make_plan({}, {}), steps=4, path=None)
    job.steps_done = 2
    loop.train(job, log, 4, CheckpointOptions())
    assert (log.bar.n, log.bar.total) == (4, 4) and "4/4" in str(log.bar)
    log.close()


@contextlib.contextmanager
def _file_size_limit(nbytes: int):
    """No file this process writes can grow past ``nbytes``: its writes fail with EFBIG, as on a full disk (no
    root needed, unlike a small filesystem)."""
    handler, limits = signal.signal(signal.SIGXFSZ, signal.SIG_IGN), resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, limits[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)


def test_a_full_disk_under_the_metrics_file_keeps_its_lines_and_the_run(tmp_path, capsys):
    """A step line that cannot be written stops the file, not the run; a summary line that cannot be added
    leaves the file as it was; once there is room the summary goes after the whole step lines."""
    metrics = tmp_path / "m.jsonl"
    log = MetricsLog(make_plan({}, {}), steps=3, path=str(metrics))
    job = DiskFullJob()
    for step in range(2):
        log.log(step, job.step())
    lines = metrics.read_text()
    with _file_size_limit(len(lines) + 20):
        log.log(2, job.step())
        cut = metrics.read_text()
        log.summary()
    assert metrics.read_text() == cut and cut.startswith(lines) and os.listdir(tmp_path) == ["m.jsonl"]
    assert log.summary()["steps"] == 3
    log.close()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r.get("step") for r in records] == [0, 1, None] and records[-1]["summary"]
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("runtime: warning:")]
    assert len(warnings) == 2 and "cannot be written" in warnings[0], warnings
    assert "the summary line could not be added" in warnings[1], warnings


def test_a_saved_folders_index_is_whole_or_as_it_was(tmp_path):
    weight_map = {f"model.layers.{i}.weight": "model-00001-of-00001.safetensors" for i in range(100)}
    checkpoint.write_index(str(tmp_path), 1, {"a": "model-00001-of-00001.safetensors"})
    before = (tmp_path / checkpoint.INDEX_FILE).read_text()
    with _file_size_limit(len(before) + 100), pytest.raises(OSError):
        checkpoint.write_index(str(tmp_path), 100, weight_map)
    assert (tmp_path / checkpoint.INDEX_FILE).read_text() == before
    assert os.listdir(tmp_path) == [checkpoint.INDEX_FILE]
    checkpoint.write_index(str(tmp_path), 100, weight_map)
    assert json.loads((tmp_path / checkpoint.INDEX_FILE).read_text())["weight_map"] == weight_map


def _records(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip().endswith("}")]


@pytest.mark.slow
@pytest.mark.parametrize("signum, name, extra", [(signal.SIGINT, "Ctrl-C", []),
                                                 (signal.SIGTERM, "SIGTERM", ["--async-checkpoint"])])
def test_a_stop_signal_ends_a_run_in_one_line_naming_the_checkpoint_to_resume_from(
    tmp_path, ray_cluster, signum, name, extra
):
    """Ctrl-C (SIGINT to the run's process group, as a terminal sends it) or a scheduler's SIGTERM to the driver
    once the step-2 checkpoint is written: exit status 128 + the signal, no traceback (no Ray abort), one line
    naming a complete checkpoint, the summary of the steps done; with an async checkpoint in flight, it completes
    (no partial folder is left)."""
    from runtime.run.checkpoint_dir import TMP_SUFFIX, is_complete, latest_checkpoint

    (tmp_path / "plan.json").write_text(make_plan({}, {}).to_json())
    metrics = tmp_path / "m.jsonl"
    process = subprocess.Popen(
        [sys.executable, "-m", "runtime", str(tmp_path / "plan.json"), "--steps", "1000", "--metrics", str(metrics),
         "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address})
    deadline = time.monotonic() + 240
    while not any(r.get("event") == "checkpoint" for r in _records(metrics)):
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.05)
    if signum == signal.SIGINT:
        os.killpg(process.pid, signum)
    else:
        os.kill(process.pid, signum)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, err[-3000:]
    assert "Traceback" not in err and "Aborted" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("runtime: ")]
    assert len(lines) == 1 and lines[0].startswith(f"runtime: interrupted ({name}): resume with --resume "), err
    named = lines[0].split("--resume ")[1]
    assert is_complete(named) and named == latest_checkpoint(str(tmp_path / "ck")), (named, os.listdir(named))
    assert not [n for n in os.listdir(tmp_path / "ck") if n.endswith(TMP_SUFFIX)]
    summary = _records(metrics)[-1]
    assert summary.get("summary") and summary["stopped"] == name and summary["steps"] >= 2, summary
    assert out.startswith(f"{summary['steps']} steps, final loss "), out
    _assert_no_workers_left()


def test_a_plan_with_a_frozen_module_dry_runs_and_a_dry_run_fault_is_not_read_as_does_not_fit(
    tmp_path, capsys, monkeypatch
):
    """A frozen vision tower: MemTracker's gradient hooks go on trainable parameters only. A fault inside the
    dry-run is one line with its own exit status."""
    plan_file = tmp_path / "frozen.json"
    plan_file.write_text(make_plan(dict(frozen=True), {}).to_json())
    assert main([str(plan_file), "--dry-run"]) == 0
    assert "DOES NOT FIT" not in capsys.readouterr().out

    def fault(*args, **kwargs):
        raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")

    monkeypatch.setattr(dry_run, "dry_run", fault)
    assert main([str(plan_file), "--dry-run"]) == DRY_RUN_FAILED
    captured = capsys.readouterr()
    assert "DOES NOT FIT" not in captured.out and captured.err.count("\n") == 1
    assert captured.err.startswith("runtime: error: the dry-run failed, so no memory verdict (RuntimeError: cannot "
                                   "register a hook"), captured.err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2])
def test_every_signal_a_scheduler_sends_takes_the_one_stop_path(signum):
    """SIGUSR1 / SIGUSR2 (a scheduler's pre-timeout warning) stop a run as SIGTERM does: ``Stopped``, named in the
    last line, exit status 128 + the signal (the path the SIGTERM tests above follow end to end)."""
    from runtime.run.stop_signals import Stopped, name_and_status, stopping_on_signals

    seen = []
    previous = signal.signal(signum, lambda *_: seen.append(signum))  # what runs if the run did not handle it
    try:
        with pytest.raises(Stopped) as stopped, stopping_on_signals():
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the handler interrupts this
    finally:
        signal.signal(signum, previous)
    assert not seen and name_and_status(stopped.value) == (signal.Signals(signum).name, 128 + signum)
