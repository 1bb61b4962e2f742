"""Automatic recovery on Ray: a worker process SIGKILLed in the middle of a run.

2 workers (ZeRO-0 DP2), 12 steps, a checkpoint every 3. The test waits for step 7's metrics line, then kills one
worker process (found by its Ray process title, ``ray::Worker``, which the data-prefetch process each worker forks
inherits: the worker is the one whose parent is not so titled):

- with ``--max-failures 1`` the run tears the job down, starts new workers and resumes from the step-6
  checkpoint; it finishes all 12 steps, its loss curve (the last record of each step) is bitwise the
  uninterrupted run's, and its metrics hold one recovery line with at most K-1 = 2 lost steps;
- with ``--max-failures 0`` the same kill ends the run within 60 s with one error line and a non-zero exit. In that
  run, a worker's prefetch process is killed first (after step 4): that costs no step, the run goes on on the
  uninterrupted curve without a recovery (it is allowed none).

After each run no worker process of it is left.

Two "nodes" (ray.cluster_utils.Cluster: a head and a second raylet on this machine, one CPU slot each, so the
plan's two workers span both): the second node is removed at step 7 and a new one added, as an autoscaler
replacing a lost node would; the run waits for the resources, resumes on the new node and again ends with the
uninterrupted loss curve.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import ray

from planner.contract.schema import load_plan
from planner.profiles import load_profile
from planner.contract.strategy import layout_of
from runtime.launch import launcher
from runtime.launch.adapt import AdaptOptions, planned_tensor_bytes
from runtime.observability.memory import StepOutOfMemory
from runtime.run.checkpoint_dir import CheckpointOptions
from runtime.training.trainer import RunOptions
from tests.runtime.plans import make_plan

STEPS, EVERY, KILL_AFTER, PREFETCH_KILL_AFTER = 12, 3, 7, 4
WORKER_TITLE = b"ray::Worker"


def _titled_pids() -> dict[int, int]:
    """Processes of this machine whose title is a runtime Worker actor's (the actors, and the data-prefetch
    processes they fork, which inherit the title): pid -> parent pid."""
    pids = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    titled = f.read().startswith(WORKER_TITLE)
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if titled:
                pids[int(entry)] = parent
    return pids


def _worker_pids() -> list[int]:
    """The runtime's Worker actor processes."""
    titled = _titled_pids()
    return sorted(pid for pid, parent in titled.items() if parent not in titled)


def _prefetch_pids() -> list[int]:
    """The data-prefetch processes the Worker actors forked."""
    titled = _titled_pids()
    return sorted(pid for pid, parent in titled.items() if parent in titled)


def _records(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip().endswith("}")]


def _run_and_kill(tmp_path, name: str, max_failures: int, address: str, kill=None, extra: tuple[str, ...] = (),
                  every: int = EVERY, before=None) -> tuple[subprocess.CompletedProcess, float]:
    """The CLI run, one worker SIGKILLed (or ``kill()`` called) once step KILL_AFTER's line is written (and, first,
    ``before = (after, kill)``: ``kill()`` once step ``after``'s line is); (result, seconds from the last kill to the
    exit)."""
    metrics = tmp_path / f"{name}.jsonl"
    command = [sys.executable, "-m", "runtime", str(tmp_path / "plan.json"), "--steps", str(STEPS), "--metrics",
               str(metrics), "--checkpoint-dir", str(tmp_path / name), "--checkpoint-every", str(every),
               "--max-failures", str(max_failures), *extra]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "RAY_ADDRESS": address})
    deadline = time.monotonic() + 240

    def wait_for_step(after: int) -> None:
        while not any(r.get("step") == after - 1 and "loss" in r for r in _records(metrics)):
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
            time.sleep(0.05)

    if before is not None:
        wait_for_step(before[0])
        before[1]()
    wait_for_step(KILL_AFTER)
    if kill is None:
        os.kill(_worker_pids()[-1], signal.SIGKILL)
    else:
        kill()
    killed = time.monotonic()
    out, err = process.communicate(timeout=300)
    return subprocess.CompletedProcess(command, process.returncode, out, err), time.monotonic() - killed


def _assert_no_workers_left() -> None:
    deadline = time.monotonic() + 30
    while _titled_pids():
        assert time.monotonic() < deadline, f"stray worker processes {_titled_pids()}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, worker_pool):
    """The plan file and the loss of each step of the run without failures (on the session's warm workers)."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    plan = make_plan(dict(dp=2), dict(dp=2))
    (folder / "plan.json").write_text(plan.to_json())
    summary = launcher.run(plan, RunOptions(), steps=STEPS, metrics_path=str(folder / "straight.jsonl"),
                           pool=worker_pool)
    assert summary["steps"] == STEPS
    _assert_no_workers_left()
    return folder / "plan.json", {r["step"]: r["loss"] for r in _records(folder / "straight.jsonl") if "step" in r}


def _assert_recovered(tmp_path, name: str, expected: dict[int, float], resumed: tuple[int, ...]) -> dict:
    """The run finished all steps on the uninterrupted curve after one recovery from a checkpoint in
    ``resumed``, losing at most K-1 steps; returns the recovery's metrics line."""
    records = _records(tmp_path / f"{name}.jsonl")
    losses = {r["step"]: r["loss"] for r in records if "step" in r and "loss" in r}  # a redone step: its last
    assert losses == expected
    (recovery,) = [r for r in records if r.get("event") == "recovery"]
    assert recovery["resumed_step"] in resumed and 0 <= recovery["lost_steps"] <= EVERY - 1
    summary = records[-1]
    assert summary["steps"] == STEPS and summary["recoveries"]["count"] == 1
    return recovery


def _assert_on_the_curve(records: list[dict], expected: dict[int, float]) -> None:
    """Every step's loss (its last record: a redone step's) is the uninterrupted run's, up to the summation order of
    another plan (relative 1e-5)."""
    losses = {r["step"]: r["loss"] for r in records if "step" in r and "loss" in r}
    assert losses.keys() == expected.keys()
    for step, loss in expected.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5), step


@pytest.mark.slow
def test_a_killed_worker_is_recovered_from_the_last_checkpoint_or_ends_the_run_in_one_line(
    tmp_path, ray_cluster, uninterrupted
):
    plan_path, expected = uninterrupted
    shutil.copy(plan_path, tmp_path / "plan.json")
    address = ray_cluster.get_runtime_context().gcs_address

    result, _ = _run_and_kill(tmp_path, "recovered", 1, address)
    assert result.returncode == 0, result.stderr[-3000:]
    recovery = _assert_recovered(tmp_path, "recovered", expected, resumed=(6,))
    assert recovery["lost_steps"] >= 1  # killed after step 7: step 7 is redone
    _assert_no_workers_left()

    # --max-failures 0: first a worker's data-prefetch process is SIGKILLed, which costs no step and no recovery
    # (that rank builds its samples itself: the run, allowed no recovery, goes on on the uninterrupted curve)
    result, seconds = _run_and_kill(tmp_path, "failed", 0, address, before=(
        PREFETCH_KILL_AFTER, lambda: os.kill(_prefetch_pids()[-1], signal.SIGKILL)))
    records = _records(tmp_path / "failed.jsonl")
    losses = {r["step"]: r["loss"] for r in records if "step" in r and "loss" in r}
    assert {step: losses.get(step) for step in range(KILL_AFTER)} == {s: expected[s] for s in range(KILL_AFTER)}
    assert not [r for r in records if r.get("event") == "recovery"]
    # ... then the worker itself: the run ends in one line
    assert result.returncode != 0 and seconds < 60
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("runtime: error:")]
    assert len(errors) == 1 and "--max-failures 0" in errors[0], result.stderr[-3000:]
    _assert_no_workers_left()


@pytest.mark.slow
def test_a_lost_node_is_replaced_and_the_run_recovers_on_it(tmp_path, uninterrupted):
    from ray.cluster_utils import Cluster

    plan_path, expected = uninterrupted
    shutil.copy(plan_path, tmp_path / "plan.json")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        second = cluster.add_node(num_cpus=1)

        def lose_the_second_node():
            cluster.remove_node(second)
            cluster.add_node(num_cpus=1)

        result, _ = _run_and_kill(tmp_path, "two_nodes", 1, cluster.address, kill=lose_the_second_node)
        assert result.returncode == 0, result.stderr[-3000:]
        # removing a node takes a moment (its raylet stops its workers): on a loaded machine step 9 may be saved
        _assert_recovered(tmp_path, "two_nodes", expected, resumed=(6, 9))
    finally:
        cluster.shutdown()
    _assert_no_workers_left()


@pytest.fixture(scope="module")
def dataset_plan(tmp_path_factory, worker_pool):
    """The planner's plan for a conversation file on 2 CPU devices (``plan --model FOLDER --dataset d.jsonl``: the
    folder's tokenizer counts the text), the run's data flags, and the loss of each step of its run without failures
    (on the session's warm workers)."""
    from planner import api
    from tests.runtime.plans import tiny_hf_config
    from tests.runtime.test_packed_data import write_dataset
    from tests.runtime.tokenizer import save_tokenizer

    folder = tmp_path_factory.mktemp("dataset")
    model = save_tokenizer(folder / "model")
    (model / "config.json").write_text(json.dumps(tiny_hf_config()))
    data = write_dataset(folder, rows=16)
    plan = api.plan(str(model / "config.json"), api.ClusterInputs(gpus=2, gpu="cpu"),
                    dataset=api.DatasetInputs(source=str(data)), workload=api.WorkloadInputs(global_batch=8))
    (folder / "plan.json").write_text(plan.to_json())
    launcher.run(plan, RunOptions(data=str(data), tokenizer=str(model)), steps=STEPS,
                 metrics_path=str(folder / "straight.jsonl"), pool=worker_pool)
    _assert_no_workers_left()
    expected = {r["step"]: r["loss"] for r in _records(folder / "straight.jsonl") if "loss" in r}
    return folder / "plan.json", ("--data", str(data), "--tokenizer", str(model)), expected


@pytest.mark.slow
def test_an_elastic_run_shrinks_onto_the_devices_left_and_moves_back_up_when_they_return(tmp_path, dataset_plan):
    """``--elastic 2``, a checkpoint every step, a dataset plan: the second of two one-slot "nodes" is removed. After
    waiting 2 s the run re-plans for the one device left (``planner.replan``: the dataset read again as the plan
    was made from it, the same pack budget and global batch of packs) and resumes from the last checkpoint under it;
    the node is added back once it has, and at its next checkpoint the run goes back to the first plan. Every step is
    on the uninterrupted loss curve; each decision is one line on stdout and one metrics event; the re-planned plan
    stays beside the checkpoints."""
    from ray.cluster_utils import Cluster

    plan_path, data_flags, expected = dataset_plan
    shutil.copy(plan_path, tmp_path / "plan.json")
    plan = load_plan(plan_path)
    metrics = tmp_path / "elastic.jsonl"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    second = cluster.add_node(num_cpus=1)

    def lose_the_second_node_until_the_run_replanned():  # in this thread: Ray's node start-up sets signals
        cluster.remove_node(second)
        deadline = time.monotonic() + 240
        while not any(r.get("event") == "replan" for r in _records(metrics)) and time.monotonic() < deadline:
            time.sleep(0.1)
        cluster.add_node(num_cpus=1)

    try:
        result, _ = _run_and_kill(tmp_path, "elastic", 1, cluster.address,
                                  kill=lose_the_second_node_until_the_run_replanned,
                                  extra=("--elastic", "2", *data_flags), every=1)
    finally:
        cluster.shutdown()
    assert result.returncode == 0, result.stderr[-3000:]
    records = _records(metrics)
    _assert_on_the_curve(records, expected)
    shrink, grow = [r for r in records if r.get("event") == "replan"]
    (recovery,) = [r for r in records if r.get("event") == "recovery"]
    assert (shrink["devices_before"], shrink["devices_after"]) == (2, 1)
    assert shrink["global_batch"] == plan.workload.global_batch  # packs
    assert (grow["devices_before"], grow["devices_after"]) == (1, 2) and shrink["step"] <= grow["step"] < STEPS
    said = [line for line in result.stdout.splitlines() if line.startswith("runtime: elastic: ")]
    assert [line.split(" devices")[0] for line in said] == ["runtime: elastic: 2 -> 1", "runtime: elastic: 1 -> 2"]
    assert shrink["plan"] == str(tmp_path / "elastic" / f"plan-{shrink['step']:06d}-1.json") and grow["plan"] is None
    shrunk = load_plan(shrink["plan"])
    assert shrunk.cluster.num_devices == 1 and shrunk.workload.dataset == plan.workload.dataset
    assert records[-1]["steps"] == STEPS and recovery["resumed_step"] in (6, 7)
    _assert_no_workers_left()


@pytest.mark.slow
def test_an_adaptive_run_switches_to_the_plan_its_measurements_prefer_on_the_same_loss_curve(
        tmp_path, ray_cluster, uninterrupted):
    """``--adapt 2 --switch-cost 0`` on a TP2 plan (both modules; micro-batches of 2: the uninterrupted DP2 run's
    global batch and samples). After step 3 (its first step left out, 2 measured) the run times the collectives on
    its two workers, the planner fits each module's compute, the optimizer and the overhead to the measurements and
    re-plans; the fitted model prefers a plan without TP and the run switches to it at the checkpoint of step 3 on
    the same actors, then checks it after 2 measured steps (kept, or switched back if slower); kept, it fits the new
    plan at once on those steps (here the fitted model prefers it: adapting stops) and never goes back to TP2 on a
    prediction. Every step is on the uninterrupted loss curve (TP and DP sum in other orders: relative 1e-5); each
    decision is one stdout line and one metrics event; the fitted profile (the run's collectives and the fit) is
    beside the checkpoints."""
    _, expected = uninterrupted
    (tmp_path / "plan.json").write_text(make_plan(dict(tp=2, micro_batch=2), dict(tp=2, micro_batch=2)).to_json())
    metrics = tmp_path / "adapt.jsonl"
    result = subprocess.run(
        [sys.executable, "-m", "runtime", str(tmp_path / "plan.json"), "--steps", str(STEPS), "--metrics",
         str(metrics), "--checkpoint-dir", str(tmp_path / "adapt"), "--checkpoint-every", "1", "--adapt", "2",
         "--switch-cost", "0"], capture_output=True, text=True, timeout=300,
        env={**os.environ, "RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address})
    assert result.returncode == 0, result.stderr[-3000:]
    records = _records(metrics)
    _assert_on_the_curve(records, expected)
    (resumed,) = [r for r in records if r.get("event") == "resume"]  # from the switch's checkpoint, no step redone
    assert resumed["step"] == 3 and len([r for r in records if "loss" in r and "step" in r]) == STEPS
    decisions = [r for r in records if r.get("event") == "adapt"]
    fit, check, *after = decisions
    assert (fit["step"], fit["decision"], check["step"]) == (3, "switch", 6) and check["decision"] in ("kept",
                                                                                                     "switch back")
    if check["decision"] == "kept":  # fitted again on the same steps, never back to the layout it left
        assert after[0]["step"] == 6 and after[0]["current_layout"] == fit["new_layout"]
        assert all("TP2" not in r["new_layout"] for r in after if r["decision"] == "switch")
    else:
        assert after == []
    assert "TP2" in fit["current_layout"] and "TP2" not in fit["new_layout"]
    assert fit["new_fitted_s"] < fit["current_fitted_s"] == pytest.approx(fit["measured"]["step_time_s"], rel=1e-6)
    assert {"vision_compute_scale", "llm_compute_scale", "optimizer_time_scale"} <= fit["fitted"].keys()
    profile = load_profile(fit["profile"])
    assert profile.calibration.values == fit["fitted"] and {p.group_size for p in profile.collectives} == {2}
    assert load_plan(fit["plan"]).predicted.profile == fit["profile"]
    said = [line for line in result.stdout.splitlines() if line.startswith("runtime: adapt: ")]
    assert len(said) == len(decisions) and "switching (predicted gain" in said[0] and check["why"] in said[1]
    assert records[-1]["steps"] == STEPS
    _assert_no_workers_left()


MEMORY_CAP = 26 << 20
"""Tensor bytes a worker may hold in the memory test: a DP2 rank of the tiny model with micro-batches of 2 measures
25.6 MiB in its first step (Adam's states not yet made) and 26.5 MiB from the second on; ZeRO-3 or recomputation
fit under it."""


@pytest.mark.slow
def test_a_run_whose_memory_is_over_its_plan_re_plans_and_finishes_on_the_same_loss_curve(tmp_path, worker_pool):
    """A DP2 plan (micro-batches of 2) under a 26 MiB cap on each worker's tensors: its second step runs out of
    memory; with ``--adapt`` the planner fits the step memory to the measured tensors, re-plans for the capped
    devices, and the run resumes from the checkpoint of step 1 under the new plan (measured under the cap from then
    on) and finishes on the loss curve of the same plan run without a cap. The new plan's ranks measure more than it
    predicts: at the next checkpoint the planner checks them on the memory alone (still fits; asked once, as they do
    not grow after)."""
    steps, plan = 4, make_plan(dict(dp=2, micro_batch=2), dict(dp=2, micro_batch=2))
    launcher.run(plan, RunOptions(), steps=steps, metrics_path=str(tmp_path / "straight.jsonl"), pool=worker_pool)
    expected = {r["step"]: r["loss"] for r in _records(tmp_path / "straight.jsonl") if "loss" in r}
    metrics = tmp_path / "adapt.jsonl"
    launcher.run(plan, RunOptions(memory_cap_bytes=MEMORY_CAP), steps=steps, metrics_path=str(metrics), adapt=AdaptOptions(),
                 checkpoints=CheckpointOptions(directory=str(tmp_path / "adapt"), every=1))
    records = _records(metrics)
    _assert_on_the_curve(records, expected)
    replan, check = [r for r in records if r.get("event") == "adapt"]
    assert replan["decision"] == "memory re-plan" and replan["step"] == 1
    (resumed,) = [r for r in records if r.get("event") == "resume"]
    assert resumed["step"] == 1 and resumed["path"].endswith("step-000001")
    memory = replan["memory"]
    assert memory["groups"]["all"]["measured"] > MEMORY_CAP and not memory["current_fits"]
    assert memory["new_tensor_bytes"] <= memory["usable_tensor_bytes"] == pytest.approx(MEMORY_CAP, abs=2)
    new = load_plan(replan["plan"])
    assert layout_of(new) == replan["new_layout"] != layout_of(plan)
    assert (check["decision"], check["step"], check["current_layout"]) == ("keep", 2, layout_of(new))
    assert check["memory"]["current_fits"] and check["memory"]["groups"]["all"]["measured"] > planned_tensor_bytes(new)
    after = [r for r in records if "loss" in r and r["step"] >= 1]
    assert len(after) == steps - 1 and all(max(r["peak_tensor_bytes"]) <= MEMORY_CAP for r in after)
    _assert_no_workers_left()


def test_running_out_of_memory_without_adapt_is_one_line_naming_the_way_on():
    """Never a blind restart (the step would run out again): the rank, what it held, what the plan predicted, and
    ``--adapt``."""
    job = launcher.Job(plan=make_plan(dict(dp=2), dict(dp=2)), workers=[], group=None)
    error = StepOutOfMemory(1, ["llm", "vision"], 2, 27 << 20, MEMORY_CAP)
    assert not launcher._worker_lost(ray.exceptions.RayTaskError("train_step", "", error))
    with pytest.raises(ValueError) as raised:
        launcher._plan_after_out_of_memory(job, error, None)
    assert str(raised.value) == (
        "rank 1 (llm+vision) ran out of memory in step 2: 0.02637 GiB of tensors on a device that holds 0.02539 (the "
        "plan predicted 0.1 GiB with its framework overhead): run with --adapt to re-plan on the measured memory and "
        "resume from the last checkpoint")


def test_a_dead_worker_is_named_even_when_a_peers_collective_error_arrives_first(ray_cluster):
    """One rank's collective fails at once (a peer closed its connection), its peer's process dies a moment later:
    the driver raises the dead actor's error (the root cause), not the collective's."""

    @ray.remote(num_cpus=0)
    class Rank:
        def fail_in_a_collective(self):
            raise RuntimeError("[pair.cc:537] Read error [127.0.0.1]:40353: Connection reset by peer")

        def die_soon(self):
            time.sleep(0.5)
            os._exit(1)

    failing, dying = Rank.remote(), Rank.remote()
    refs = [failing.fail_in_a_collective.remote(), dying.die_soon.remote()]
    with pytest.raises(ray.exceptions.RayActorError):
        launcher.get_all(refs, [failing, dying])


def test_an_elastic_run_grows_to_what_came_back_and_stays_put_when_that_cannot_be_planned(monkeypatch, capsys):
    """``launcher._grown_plan`` at a checkpoint of a run planned on 4 devices, now on 1, with 2 in the cluster: the
    plan re-planned for 2 (one event, one line); when the re-plan fails, a warning and the run stays on 1."""
    from runtime.observability.metrics import MetricsLog

    first, now, two = make_plan(dict(dp=4), dict(dp=4)), make_plan({}, {}), make_plan(dict(dp=2), dict(dp=2))
    monkeypatch.setattr(launcher, "_devices_of", lambda plan: 2)
    monkeypatch.setattr(launcher, "replan", lambda plan, devices, folder, step: (two, f"{folder}/p.json", None))
    log = MetricsLog(now, steps=8, path=None)
    assert launcher._grown_plan(now, first, log, "ckpt", 5) is two
    (event,) = log.events
    assert (event["event"], event["devices_before"], event["devices_after"], event["plan"]) == ("replan", 1, 2,
                                                                                                "ckpt/p.json")
    assert capsys.readouterr().out.startswith("runtime: elastic: 1 -> 2 devices after step 5: vision DP2")

    def cannot(plan, devices, folder, step):
        raise ValueError("cannot re-plan for the 2 devices left: no plan fits")

    monkeypatch.setattr(launcher, "replan", cannot)
    assert launcher._grown_plan(now, first, log, "ckpt", 6) is None and len(log.events) == 1
    assert ("runtime: warning: staying on 1 devices: cannot re-plan for the 2 devices left: no plan fits"
            in capsys.readouterr().err.splitlines())
    assert launcher._grown_plan(two, first, log, "ckpt", 7) is None  # uses what the cluster has: nothing to do
