"""``python -m runtime``: user errors are one line with exit status 2; a plan written by ``plan`` trains."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from runtime.launch import launcher
from runtime.training.trainer import RunOptions
from tests.runtime.plans import QWEN3_IMAGE_SIZE, make_plan, tiny_qwen2_audio_config, tiny_qwen3_vl_moe_config


def run_cli(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def assert_one_line_error(result: subprocess.CompletedProcess, text: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("runtime: error:")]
    assert len(errors) == 1 and text in errors[0], result.stderr
    assert result.stderr.strip().endswith(errors[0]), result.stderr


def test_missing_plan_file(tmp_path):
    assert_one_line_error(run_cli(str(tmp_path / "nope.json")), "cannot read plan file")


def test_plan_of_another_schema_version(tmp_path):
    data = json.loads(make_plan({}, {}).to_json())
    data["schema_version"] = 999
    (tmp_path / "plan.json").write_text(json.dumps(data))
    assert_one_line_error(run_cli(str(tmp_path / "plan.json")), "schema version 999")


def test_context_parallel_plan_the_runtime_cannot_run_is_refused_before_ray(tmp_path):
    audio = make_plan(dict(cp=2), dict(cp=2), hf_config=tiny_qwen2_audio_config(), audio_seconds=2.0, text_tokens=12)
    (tmp_path / "plan.json").write_text(audio.to_json())
    assert_one_line_error(run_cli(str(tmp_path / "plan.json")), "audio: context parallelism (cp=2) is run for the "
                                                                "LLM and the vision tower only")
    (tmp_path / "plan.json").write_text(make_plan(dict(dp=4), dict(cp=2, pp=2, pp_layers=[2, 2])).to_json())
    assert_one_line_error(run_cli(str(tmp_path / "plan.json")), "with pipeline parallelism (pp=2) is not run yet")


def test_expert_parallelism_the_runtime_cannot_run_is_refused_before_ray(tmp_path):
    """ep on a dense LLM, experts that do not split over an EP group's ep x tp ranks, and the load-balancing loss
    with a pipelined LLM (its counts span every stage's layers): refused by the checks the command line runs before
    Ray (one subprocess shows the command line's one line; the others call the same checks in-process)."""
    (tmp_path / "dense.json").write_text(make_plan(dict(dp=2), dict(dp=2, ep=2)).to_json())
    assert_one_line_error(run_cli(str(tmp_path / "dense.json")), "ep=2 but the LLM has no experts")
    moe = tiny_qwen3_vl_moe_config()
    with pytest.raises(ValueError, match=r"^ep\*tp = 3\*1 = 3 does not divide the 8 experts of the LLM"):
        launcher.validate_plan(make_plan(dict(dp=3), dict(dp=3, ep=3), hf_config=moe, image_size=QWEN3_IMAGE_SIZE),
                               RunOptions())
    pipelined = make_plan(dict(dp=2, grad_accum=2), dict(pp=2, pp_layers=[2, 2], grad_accum=2), hf_config=moe,
                          image_size=QWEN3_IMAGE_SIZE)
    with pytest.raises(NotImplementedError, match=r"^pp=2: the load-balancing loss \(text_config."
                                                  r"output_router_logits\) is not run with a pipelined LLM"):
        launcher.validate_plan(pipelined, RunOptions())


def test_what_a_pipeline_does_not_run_yet_is_refused_before_ray(tmp_path):
    zero_bubble = json.loads(make_plan(dict(dp=4, grad_accum=2), dict(
        pp=2, dp=2, zero=1, pp_schedule="interleaved_zb", virtual_stages=2, pp_layers=[1, 1, 1, 1], micro_batch=2,
        grad_accum=2)).to_json())
    next(m for m in zero_bubble["modules"] if m["name"] == "llm")["zero"] = 3  # (a plan the planner never writes)
    (tmp_path / "zb.json").write_text(json.dumps(zero_bubble))
    assert_one_line_error(run_cli(str(tmp_path / "zb.json")), "interleaved_zb with zero=3")
    pipelined = dict(pp=2, pp_layers=[2, 2], grad_accum=2)
    (tmp_path / "sp.json").write_text(make_plan(dict(dp=2, grad_accum=2), dict(pipelined, sp=2), pack_tokens=512).to_json())
    assert_one_line_error(run_cli(str(tmp_path / "sp.json")), "with sp=2 on a dataset plan is not run")
    unpacked = json.loads(make_plan(dict(grad_accum=2), dict(pipelined), pack_tokens=512).to_json())
    unpacked["workload"]["dataset"]["pack_tokens"] = None  # (a dataset plan without packing)
    (tmp_path / "unpacked.json").write_text(json.dumps(unpacked))
    assert_one_line_error(run_cli(str(tmp_path / "unpacked.json")), "on a dataset without packing is not run")


@pytest.mark.slow
def test_too_few_cpu_slots_is_refused_before_any_actor_starts(ray_cluster):
    plan = make_plan(dict(dp=8), dict(dp=8))
    with pytest.raises(ValueError, match="needs 8 CPU slots but the Ray cluster has 4"):
        launcher.start(plan, RunOptions())
    assert all(pg["state"] == "REMOVED" for pg in ray_cluster.util.placement_group_table().values())


@pytest.mark.slow
def test_bad_caption_data_found_by_a_worker_is_a_one_line_error(tmp_path, ray_cluster):
    (tmp_path / "plan.json").write_text(make_plan({}, {}).to_json())
    (tmp_path / "data.jsonl").write_text('{"image": "missing.png", "text": "a cat"}\n')
    address = ray_cluster.get_runtime_context().gcs_address
    result = run_cli(str(tmp_path / "plan.json"), "--data", str(tmp_path / "data.jsonl"), "--steps", "1",
                     env={"RAY_ADDRESS": address})
    assert_one_line_error(result, "cannot read image")


@pytest.mark.slow
def test_plan_written_by_the_planner_runs_end_to_end(tmp_path, ray_cluster):
    planner = shutil.which("plan", path=os.path.dirname(sys.executable))
    if planner is None:
        pytest.skip("the `plan` command is not installed")
    plan_path, metrics, traces = tmp_path / "plan.json", tmp_path / "metrics.jsonl", tmp_path / "traces"
    made = subprocess.run(
        [planner, "--model", "qwen2.5-vl-tiny", "--gpu", "cpu", "--gpus", "2", "--image-size", "168x112",
         "--text-tokens", "40", "--global-batch", "4", "--out", str(plan_path), "--trace", str(tmp_path / "step.json")],
        capture_output=True, text=True, timeout=300,
    )
    assert made.returncode == 0, made.stderr
    address = ray_cluster.get_runtime_context().gcs_address
    result = run_cli(str(plan_path), "--steps", "2", "--metrics", str(metrics), "--trace", str(traces),
                     "--trace-profiler", env={"RAY_ADDRESS": address})
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r.get("step") for r in records[:2]] == [0, 1] and records[2]["summary"]
    assert all(5.0 < r["loss"] < 9.0 for r in records[:2])
    assert "step time" in result.stdout and "predicted" in result.stdout
    # the measured traces: every rank's spans of each step, beside the predicted one, and torch.profiler's own
    predicted = {e["name"] for e in json.loads((tmp_path / "step.json").read_text())["traceEvents"]}
    for step, record in enumerate(records[:2]):
        trace = json.loads((traces / f"step-{step}.json").read_text())
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        assert {e["pid"] for e in spans} == {0, 1}
        assert trace["otherData"]["step_time_s"] == record["step_time_s"]
        drawn = {e["name"] for e in spans}
        assert {"vision forward", "llm forward", "llm backward", "vision backward"} <= drawn & predicted
        assert {"step", "optimizer"} <= drawn
        assert all(json.loads((traces / f"profiler-step-{step}-rank-{r}.json").read_text())["traceEvents"]
                   for r in (0, 1))


@pytest.mark.slow
def test_workers_start_from_and_save_a_checkpoint_folder(tmp_path, worker_pool):
    from runtime.models.model import build_model

    saved = build_model(make_plan({}, {}).model.hf_config, seed=7)
    saved.save_pretrained(tmp_path / "start")
    job = launcher.start(make_plan(dict(tp=2), dict(tp=2)), RunOptions(seed=0, checkpoint=str(tmp_path / "start")),
                         pool=worker_pool)
    try:
        start = job.gather("param")
        job.step()
        launcher.save_checkpoint(job, str(tmp_path / "end"))
        trained = job.gather("param")
    finally:
        job.shutdown()
    expected = dict(saved.named_parameters())
    assert set(start) == set(expected)
    for name, value in start.items():
        assert torch.equal(value, expected[name].detach()), name
    reloaded = dict(build_model(saved.config.to_dict(), seed=0, checkpoint=str(tmp_path / "end")).named_parameters())
    for name, value in trained.items():
        assert not torch.equal(value, expected[name].detach()), f"{name} did not train"
        assert torch.equal(reloaded[name].detach(), value), name


@pytest.mark.slow
@pytest.mark.parametrize("images", [("good.png", "missing.png"), ("missing.png", "missing-too.png")],
                         ids=["one_rank_fails", "every_rank_fails"])
def test_a_failing_rank_is_one_line_without_rays_unhandled_error_stacks(tmp_path, ray_cluster, images):
    """Rank r of the DP-2 plan reads row r; a rank blocked in a collective on a failed peer is stopped."""
    from PIL import Image

    (tmp_path / "plan.json").write_text(make_plan(dict(dp=2), dict(dp=2)).to_json())
    Image.new("RGB", (168, 112)).save(tmp_path / "good.png")
    rows = [{"image": image, "text": "a cat"} for image in images]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    address = ray_cluster.get_runtime_context().gcs_address
    result = run_cli(str(tmp_path / "plan.json"), "--data", str(tmp_path / "data.jsonl"), "--steps", "1",
                     env={"RAY_ADDRESS": address})
    assert_one_line_error(result, f"cannot read image {tmp_path}/missing")
    assert "Unhandled error" not in result.stderr and "Error" not in result.stderr.replace("runtime: error", "")


@pytest.mark.slow
def test_weights_go_to_a_fallback_folder_when_the_save_folder_breaks_during_training(
    tmp_path, ray_cluster, monkeypatch, capsys
):
    from runtime.__main__ import main
    from runtime.models.model import build_model

    plan = make_plan({}, {})
    (tmp_path / "plan.json").write_text(plan.to_json())
    save = tmp_path / "out" / "weights"
    real_start = launcher.start

    def start_then_break_the_save_folder(*args, **kwargs):  # the folder passed the checks, then became a file
        job = real_start(*args, **kwargs)
        assert save.is_dir()
        save.rmdir()
        save.write_text("not a folder any more")
        return job

    monkeypatch.setattr(launcher, "start", start_then_break_the_save_folder)
    monkeypatch.chdir(tmp_path)
    assert main([str(tmp_path / "plan.json"), "--steps", "1", "--save", str(save)]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    prefix = f"runtime: error: cannot save to {save} ("
    assert lines[-1].startswith(prefix) and "runtime: error" not in "".join(lines[:-1]), lines
    fallback = lines[-1].split("the trained weights were written to ")[-1]
    assert os.path.dirname(fallback) == str(tmp_path) and os.path.basename(fallback).startswith("dhplan-weights-")
    initial = dict(build_model(plan.model.hf_config, seed=0).named_parameters())
    trained = dict(build_model(plan.model.hf_config, seed=0, checkpoint=fallback).named_parameters())
    assert set(trained) == set(initial)
    for name, value in trained.items():
        assert not torch.equal(value, initial[name]), f"{name} is not the trained weight"


def run_main(capsys, *args: str) -> subprocess.CompletedProcess:
    """``python -m runtime ARGS`` as this process's call of its ``main`` (what the command runs, less the
    interpreter's start-up): exit status and printed output."""
    from runtime.__main__ import main

    status = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["python", "-m", "runtime", *args], status, out, err)


@pytest.mark.slow
def test_dry_run_flag_prints_the_report_and_exits_1_when_the_plan_does_not_fit(tmp_path, capsys):
    plan = json.loads(make_plan(dict(sp=2), dict(tp=2)).to_json())
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    fits = run_main(capsys, str(tmp_path / "plan.json"), "--dry-run")
    assert fits.returncode == 0, fits.stderr
    assert fits.stdout.strip().endswith("FITS") and "DOES NOT FIT" not in fits.stdout, fits.stdout
    heavy = json.loads(make_plan(dict(sp=2), dict(tp=2), text_tokens=20_000).to_json())
    heavy["cluster"]["device"]["memory_bytes"] = 256 << 20  # the least plausible device; 20K tokens' logits exceed it
    (tmp_path / "small.json").write_text(json.dumps(heavy))
    too_small = run_main(capsys, str(tmp_path / "small.json"), "--dry-run")
    assert too_small.returncode == 1, too_small.stderr
    assert too_small.stdout.strip().endswith("DOES NOT FIT"), too_small.stdout


def test_dry_run_is_refused_under_torchrun(tmp_path):
    (tmp_path / "plan.json").write_text(make_plan({}, {}).to_json())
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29500"}
    assert_one_line_error(run_cli(str(tmp_path / "plan.json"), "--dry-run", env=env), "run it without torchrun")
    elastic = run_cli(str(tmp_path / "plan.json"), "--checkpoint-dir", str(tmp_path / "c"), "--max-failures", "1",
                      "--elastic", env=env)
    assert_one_line_error(elastic, "torchrun runs are not elastic")
    adaptive = run_cli(str(tmp_path / "plan.json"), "--checkpoint-dir", str(tmp_path / "c"), "--checkpoint-every", "1",
                       "--adapt", env=env)
    assert_one_line_error(adaptive, "torchrun runs do not adapt")


@pytest.mark.parametrize("cause", [
    RuntimeError("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:40353: Connection reset by peer. "
                 "This is typically caused by a remote worker hanging"),
    KeyError("a fault in the runtime"),
])
def test_a_worker_failure_that_ends_the_run_is_one_line(tmp_path, monkeypatch, capsys, cause):
    """Whichever rank's error reaches the driver first when a worker dies (the dead actor's, or a peer's collective
    failing with it, as gloo's plain RuntimeError), the run ends with one line naming it and exit status 1."""
    import ray.exceptions

    from runtime import __main__ as cli

    def failing_run(*args, **kwargs):
        raise ray.exceptions.RayTaskError("train_step", "Traceback (most recent call last): ...", cause
                                          ).as_instanceof_cause()

    monkeypatch.setattr(launcher, "run", failing_run)
    (tmp_path / "plan.json").write_text(make_plan({}, {}).to_json())
    status = cli.main([str(tmp_path / "plan.json"), "--checkpoint-dir", str(tmp_path / "ckpt")])
    err = capsys.readouterr().err
    assert status == 1 and "Traceback" not in err
    (line,) = err.splitlines()
    assert line.startswith("runtime: error: a worker failed") and "--max-failures 0" in line
    assert f"({type(cause).__name__}: " in line and "pair.cc" not in line  # the message, its C++ location left off


@pytest.mark.parametrize("address, auth_mode, hinted", [("10.0.0.1:6379", None, True), ("10.0.0.1:6379", "token", False),
                                                        ("auto", None, False)])
def test_a_failed_connection_to_a_named_cluster_says_how_token_authentication_is_turned_on(
        monkeypatch, address, auth_mode, hinted):
    """Ray 2.60 clusters authenticate by token by default; a client naming the address must opt in
    (``RAY_AUTH_MODE=token``), which Ray's "Failed to connect" does not say (seen against ``ray start --head``)."""
    from runtime.launch import launcher

    def refuse(**kwargs):
        raise ConnectionError(f"Failed to connect to Ray cluster at {kwargs['address']}")

    monkeypatch.setattr(launcher.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(launcher.ray, "init", refuse)
    monkeypatch.setenv("RAY_ADDRESS", address)
    if auth_mode is None:
        monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    else:
        monkeypatch.setenv("RAY_AUTH_MODE", auth_mode)
    with pytest.raises(ConnectionError) as e:
        launcher.ensure_ray()
    assert str(e.value).startswith(f"Failed to connect to Ray cluster at {address}")
    assert ("set RAY_AUTH_MODE=token with its token in ~/.ray/auth_token" in str(e.value)) == hinted
