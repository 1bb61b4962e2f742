"""Files the project writes and reads (issue 43): outputs on special files and symlinks, outputs that are inputs,
the run lock, and readers that never block, never recurse without bound and name the file.

Device nodes are made with ``mknod`` in a temporary folder (root only; skipped otherwise): the real ``/dev`` is
never written to, so a regression that replaces the output cannot harm the machine.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from planner.cli import main as plan_main
from planner.contract.file_io import MAX_DEPTH, read_json, write_output
from planner.contract.schema import PlanError, load_plan
from runtime.run import run_lock
from runtime.__main__ import main as runtime_main
from tests.runtime.plans import make_plan
from tests.test_file_fuzz import bounded

TINY = ["--model", "qwen2.5-vl-tiny", "--gpu", "cpu", "--gpus", "2", "--time-limit", "2", "--workers", "1"]
NULL, FULL = (1, 3), (1, 7)
"""Major and minor numbers of Linux's null and full character devices."""


def device(path: Path, numbers: tuple[int, int]) -> Path:
    """A character device node at ``path`` (a copy of /dev/null or /dev/full, in a temporary folder)."""
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(*numbers))
    except PermissionError:
        pytest.skip("mknod needs root")
    return path


def is_char_device(path: Path) -> bool:
    return stat.S_ISCHR(os.lstat(path).st_mode)


def run(main, argv: list[str]) -> tuple[int, str]:
    """(exit status, stderr) of a CLI's ``main`` called in-process."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err), bounded(60):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return code, err.getvalue()


def assert_refused(code: int, err: str, *fragments: str) -> None:
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


@pytest.fixture
def started(monkeypatch) -> list:
    """The runs the runtime's CLI started, instead of starting them (a check that lets a run through fails fast)."""
    import runtime.__main__ as cli

    runs = []
    monkeypatch.setattr(cli, "_run_on_ray", lambda plan, args: runs.append(args) or 0)
    return runs


@pytest.fixture
def plan_file(tmp_path) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(make_plan({}, {}).to_json())
    return path


# ---- outputs on special files and symlinks ------------------------------------------------------------------------


def test_plan_out_and_trace_on_a_device_write_into_it_and_keep_it_a_device(tmp_path):
    null = device(tmp_path / "null", NULL)
    null2 = device(tmp_path / "null2", NULL)
    code, err = run(plan_main, TINY + ["--out", str(null), "--trace", str(null2)])
    assert code == 0, err
    assert is_char_device(null) and is_char_device(null2)  # was: replaced by regular JSON files, exit 0


def test_a_write_to_a_full_device_fails_and_keeps_the_device(tmp_path):
    full = device(tmp_path / "full", FULL)
    with pytest.raises(OSError):
        write_output(full, "x" * 10, flag="--trace")
    assert is_char_device(full)


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_plan_out_on_a_fifo_or_folder_is_refused_before_planning(tmp_path, kind):
    target = tmp_path / kind
    os.mkfifo(target) if kind == "fifo" else target.mkdir()
    code, err = run(plan_main, TINY + ["--out", str(target)])
    assert_refused(code, err, f"cannot write --out {target}: it is a ")
    assert stat.S_ISFIFO(os.lstat(target).st_mode) if kind == "fifo" else target.is_dir()


def test_a_symlinked_output_keeps_the_link_and_writes_its_target(tmp_path):
    (tmp_path / "real.json").write_text("old")
    (tmp_path / "link.json").symlink_to("real.json")
    (tmp_path / "dangling.json").symlink_to("new.json")
    write_output(tmp_path / "link.json", "new", flag="--out")
    write_output(tmp_path / "dangling.json", "made", flag="--out")
    assert (tmp_path / "link.json").is_symlink() and (tmp_path / "real.json").read_text() == "new"
    assert (tmp_path / "dangling.json").is_symlink() and (tmp_path / "new.json").read_text() == "made"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling.json", "link.json", "new.json", "real.json"]


def test_the_metrics_summary_on_a_device_is_written_into_it(tmp_path):
    from runtime.observability.metrics import MetricsLog

    null = device(tmp_path / "null", NULL)
    log = MetricsLog(make_plan({}, {}), steps=1, path=str(null))
    log.log(0, [{"rank": 0, "loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "step_time_s": 0.1, "llm_tokens": 10,
                 "peak_memory_bytes": 1}])
    log.summary()
    log.close()
    assert is_char_device(null)  # was: replaced by a regular file holding the summary


# ---- an output that is an input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["same", "relative", "symlink", "hardlink"])
def test_runtime_metrics_naming_the_plan_file_is_refused(tmp_path, plan_file, monkeypatch, started, name):
    monkeypatch.chdir(tmp_path)
    metrics = {"same": str(plan_file), "relative": "./plan.json", "symlink": "link.json", "hardlink": "hard.json"}
    os.symlink("plan.json", "link.json")
    os.link("plan.json", "hard.json")
    before = plan_file.read_text()
    code, err = run(runtime_main, [str(plan_file), "--metrics", metrics[name]])
    assert_refused(code, err, f"--metrics {metrics[name]} is the same file as the plan file {plan_file}")
    assert plan_file.read_text() == before


def test_runtime_save_into_the_starting_checkpoint_is_refused(tmp_path, plan_file, started):
    from planner.catalog import get_model

    checkpoint = tmp_path / "ck"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps(dict(get_model("qwen2.5-vl-tiny").hf_config)))
    (checkpoint / "model.safetensors").write_bytes(b"")
    code, err = run(runtime_main, [str(plan_file), "--checkpoint", str(checkpoint), "--save", f"{tmp_path}/./ck"])
    assert_refused(code, err, f"--save {tmp_path}/./ck is the same file as --checkpoint {checkpoint}")


def test_plan_histogram_out_naming_the_dataset_is_refused(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"image": "a.png", "text": "x"}\n')
    code, err = run(plan_main, TINY + ["--dataset", str(data), "--histogram-out", str(data), "--out",
                                       str(tmp_path / "p.json")])
    assert_refused(code, err, f"--histogram-out {data} is the same file as --dataset {data}")
    assert data.read_text() == '{"image": "a.png", "text": "x"}\n'


# ---- the run lock ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--metrics", "--checkpoint-dir"])
def test_a_second_run_on_the_same_metrics_or_checkpoint_dir_is_refused(tmp_path, plan_file, started, flag):
    owned = {"--metrics": str(tmp_path / "m.jsonl"), "--checkpoint-dir": str(tmp_path / "ck")}
    os.makedirs(owned["--checkpoint-dir"])
    other = {"--metrics": "--checkpoint-dir", "--checkpoint-dir": "--metrics"}[flag]
    with run_lock.hold({"--metrics": owned["--metrics"] if flag == "--metrics" else None},
                       {"--checkpoint-dir": owned[flag] if flag == "--checkpoint-dir" else None}):  # the first run
        code, err = run(runtime_main, [str(plan_file), flag, owned[flag]])
        assert_refused(code, err, f"{flag} {owned[flag]} is in use by another run")
        assert not started
        assert run(runtime_main, [str(plan_file), other, owned[other]])[0] == 0  # what it does not hold is free
    assert run(runtime_main, [str(plan_file), flag, owned[flag]])[0] == 0 and len(started) == 2


def test_the_run_lock_is_released_when_its_holder_is_killed(tmp_path):
    metrics = str(tmp_path / "m.jsonl")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom runtime.run import run_lock\n"
        f"with run_lock.hold({{'--metrics': {metrics!r}}}, {{}}):\n    print('held', flush=True)\n    time.sleep(60)\n"
    )], stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(ValueError, match="is in use by another run"), run_lock.hold({"--metrics": metrics}, {}):
            pass
    finally:
        holder.kill()
        holder.wait()
    with run_lock.hold({"--metrics": metrics}, {}):
        pass


# ---- readers ---------------------------------------------------------------------------------------------------------


def test_a_plan_nested_200000_levels_is_refused_in_one_line(tmp_path, started):
    path = tmp_path / "deep.json"
    path.write_text("[" * 200_000)  # was: RecursionError traceback
    code, err = run(runtime_main, [str(path)])
    assert_refused(code, err, f"plan file {path} is nested deeper than {MAX_DEPTH} levels")


def test_a_plan_just_deeper_than_the_bound_is_refused_too(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text('{"schema_version": 7, "x": ' + "[" * MAX_DEPTH + "]" * MAX_DEPTH + "}")
    with pytest.raises(PlanError, match="nested deeper than"):
        load_plan(path)


@pytest.mark.parametrize("text, says", [
    ("runs: " + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), f"is nested deeper than {MAX_DEPTH} levels"),
    ("runs: " + "[" * 200_000, f"is nested deeper than {MAX_DEPTH} levels"),  # past the composer's recursion
    # aliases sharing one list 10**12 times, then a list holding itself: each container is measured once
    ("a: &a [1, 2]\n" + "".join(f"l{i}: &l{i} [{', '.join([f'*{p}'] * 10)}]\n"
                                for i, p in enumerate(["a"] + [f"l{i}" for i in range(11)])) + "runs: &r [*r]\n",
     f"is nested deeper than {MAX_DEPTH} levels"),
    ("runs: [a, b", "is not YAML: while parsing a flow sequence"),
])
def test_a_yaml_runs_table_is_nested_at_most_as_deep_as_json(tmp_path, text, says):
    """Calibration's YAML tables obey the JSON readers' depth bound (``parse_yaml``), in one line naming the file."""
    from planner.calibrate import load_runs

    table = tmp_path / "runs.yaml"
    table.write_text(text)
    with bounded(30), pytest.raises(ValueError, match=f"^runs table {table} {says}") as refused:
        load_runs([str(table)], [])
    assert "\n" not in str(refused.value)


def test_a_named_pipe_as_the_plan_file_is_refused_without_blocking(tmp_path, started):
    path = tmp_path / "fifo"
    os.mkfifo(path)  # was: blocked forever
    code, err = run(runtime_main, [str(path)])
    assert_refused(code, err, f"plan file {path} is a named pipe (FIFO), not a regular file")


def test_a_binary_plan_file_is_named(tmp_path, started):
    path = tmp_path / "plan.json"
    path.write_bytes(b'{"schema_version": \x96\xff}')  # was: 'utf-8' codec can't decode ... without the file
    code, err = run(runtime_main, [str(path)])
    assert_refused(code, err, f"plan file {path} is not UTF-8 text (byte 19)")


@pytest.mark.parametrize("reader, flag", [
    (lambda p: plan_main(TINY + ["--cluster", str(p)]), "cluster file"),
    (lambda p: plan_main(TINY + ["--profile", str(p)]), "profile"),
    (lambda p: plan_main(TINY + ["--dataset", str(p)]), "--dataset"),
    (lambda p: plan_main(["--model", str(p), *TINY[2:]]), "model config"),
])
def test_the_planners_inputs_refuse_a_named_pipe_without_blocking(tmp_path, reader, flag):
    path = tmp_path / "input.json"
    os.mkfifo(path)
    code, err = run(lambda argv: reader(path), [])
    assert_refused(code, err, f"{path}", "named pipe" if flag != "--dataset" else "is not a file")


def test_a_checkpoint_run_state_that_is_a_named_pipe_is_refused_without_blocking(tmp_path):
    from runtime.run.checkpoint_dir import RUN_STATE, read_run_state

    os.mkfifo(tmp_path / RUN_STATE)
    with bounded(), pytest.raises(ValueError, match=f"run state {tmp_path / RUN_STATE} is a named pipe"):
        read_run_state(str(tmp_path))


def test_a_document_larger_than_the_bound_is_refused(tmp_path):
    path = tmp_path / "big.json"
    path.write_text("[" + "0," * 2**20 + "0]")
    with pytest.raises(ValueError, match=f"thing {path} is larger than 2 MiB"):
        read_json(path, kind="thing", max_bytes=2 * 2**20)
