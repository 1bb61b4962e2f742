"""Sharded training checkpoints (torch.distributed.checkpoint) and ``--resume``, on 2 gloo ranks, CPU fp32.

- Same plan: 4 steps straight against 2 steps, checkpoint, a new Trainer resuming (its shards materialised
  unfilled, then loaded), 2 steps; for two plans the checkpoint is written by DCP's async_save while one more
  (discarded) step runs, so staging must have copied the state. Losses, pre-clip gradient norms, LRs and every
  parameter are bitwise equal: the checkpoint restores exactly the weights, AdamW moments and step counts, the
  LR schedule and the data position, and each step then runs the same arithmetic in the same order.
- Another plan: a checkpoint written under TP2 resumes under ZeRO-3 DP2, whose checkpoint resumes under vision
  SP2 + LLM TP2 (DCP reshards weights and optimizer state; the TP vision qkv is stored in HF row order), against
  one uninterrupted TP2 run: rtol 1e-5 on losses and gradient norms, the parity tests' fp32 reduction-order
  tolerance (the plans sum the same numbers in different orders). Observed: <= 1.3e-7 relative. The last
  checkpoint, exported with ``python -m runtime.export``, loads with ``from_pretrained`` and equals the weights.
- Under torchrun (no Ray): an async checkpoint under TP2, resumed under ZeRO-3 DP2, against the reference.
- The checkpoint folder: written as ``step-N.tmp`` and renamed once complete; ``--keep-last`` prunes; a folder
  without the marker is never resumed from. Bad checkpoint flags: one line, before torch and Ray.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from runtime.run import checkpoint_dir, preflight
from runtime import export
from runtime.__main__ import main
from runtime.checkpoints.dcp_checkpoint import checkpoint_problem, shards_problem
from tests.runtime.plans import QWEN3_IMAGE_SIZE, make_plan, tiny_hf_config, tiny_qwen3_vl_moe_config
from tests.runtime.ranks import spawn
from tests.runtime.test_bad_input import run_light
from tests.runtime.test_cli import assert_one_line_error
from tests.runtime.resume_ranks import same_and_across_plans

SAME_PLAN = {
    "colocated_zero0_dp2": dict(vision=dict(dp=2), llm=dict(dp=2)),
    "colocated_zero1_dp2__tp2": dict(vision=dict(dp=2, zero=1), llm=dict(tp=2, micro_batch=2)),
    "colocated_zero2_dp2__sp2": dict(vision=dict(sp=2, micro_batch=2), llm=dict(dp=2, zero=2)),
    "colocated_zero3_dp2": dict(vision=dict(dp=2, zero=3), llm=dict(dp=2, zero=3)),
    "colocated_vision_tp2__llm_sp2": dict(vision=dict(tp=2), llm=dict(sp=2)),
    "disjoint_1_1__2_micro_batches": dict(vision=dict(grad_accum=2), llm=dict(grad_accum=2), placement="disjoint"),
    "colocated_llm_pp2": dict(vision=dict(dp=2, grad_accum=2), llm=dict(pp=2, pp_layers=[2, 2], micro_batch=2,
                                                                        grad_accum=2)),
    "colocated_llm_pp2_interleaved": dict(vision=dict(dp=2, grad_accum=2), llm=dict(
        pp=2, pp_schedule="interleaved_1f1b", virtual_stages=2, pp_layers=[1, 1, 1, 1], micro_batch=2, grad_accum=2)),
    # expert parallelism: each rank saves and loads its 4 of the 8 experts (DCP metadata through the allow-list)
    "moe_ep2": dict(vision=dict(dp=2), llm=dict(dp=2, ep=2), hf_config=tiny_qwen3_vl_moe_config(),
                    image_size=QWEN3_IMAGE_SIZE),
}

OVERLAPPED = {"colocated_zero3_dp2", "disjoint_1_1__2_micro_batches"}
"""Plans whose checkpoints are written with DCP async_save while a step runs (which must not change them)."""

ACROSS_PLANS = [  # the same global batch (2 samples) in each
    dict(vision=dict(tp=2, grad_accum=2), llm=dict(tp=2, grad_accum=2)),
    dict(vision=dict(dp=2, zero=3), llm=dict(dp=2, zero=3)),
    dict(vision=dict(sp=2, grad_accum=2), llm=dict(tp=2, grad_accum=2)),
    dict(vision=dict(sp=2, grad_accum=2), llm=dict(pp=2, pp_layers=[3, 1], grad_accum=2)),
]


def _merged_params(outs: list[dict], key: str) -> dict[str, torch.Tensor]:
    merged = {}
    for out in outs:
        merged.update(out[key])
    return merged


def _curve(outs: list[dict], key: str) -> list[dict]:
    """Per step: the loss (from an LLM rank), the grad norm and LR every rank reports."""
    steps = []
    for i in range(len(outs[0][key])):
        records = [out[key][i] for out in outs]
        steps.append({"loss": next(r["loss"] for r in records if r["loss"] is not None),
                      "grad_norm": records[0]["grad_norm"], "lr": next(r["lr"] for r in records if r["lr"])})
    return steps


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Per rank, the outputs of both scenarios, from one pair of processes (a spawn costs ~15 s of imports here);
    the same-plan plans; the across-plans and same-plan checkpoint folders."""
    same = {name: make_plan(**{k: dict(v) if isinstance(v, dict) else v for k, v in p.items()})
            for name, p in SAME_PLAN.items()}
    across = [make_plan(**{k: dict(v) for k, v in p.items()}) for p in ACROSS_PLANS]
    same_dir, across_dir = tmp_path_factory.mktemp("same"), tmp_path_factory.mktemp("across")
    by_rank = spawn(2, same_and_across_plans, same, str(same_dir), OVERLAPPED, across[0], [(p, 2) for p in across],
                    str(across_dir), str(tmp_path_factory.mktemp("failing")))
    return (same, [out[0] for out in by_rank], [out[1] for out in by_rank], across_dir, same_dir, by_rank[0][2],
            across[0])


@pytest.mark.slow
def test_resume_is_bitwise_the_uninterrupted_run(resumed):
    plans, by_rank, *_ = resumed
    for name in plans:
        outs = [out[name] for out in by_rank]
        assert _curve(outs, "legs") == _curve(outs, "straight"), name
        straight, resumed_params = _merged_params(outs, "straight_params"), _merged_params(outs, "legs_params")
        assert straight.keys() == resumed_params.keys() and straight, name
        for hf_name, tensor in straight.items():
            assert torch.equal(tensor, resumed_params[hf_name]), (name, hf_name)


@pytest.mark.slow
def test_an_expert_parallel_checkpoint_reads_through_the_restricted_unpickler(resumed):
    """The EP2 plan's checkpoint (resumed bitwise above, each rank's DCP load through ``SafeFileSystemReader``):
    its metadata, expert shards included, reads through the allow-list as DCP's own reader reads it, and the
    driver's soundness check passes it."""
    import torch.distributed.checkpoint as dcp

    from runtime.checkpoints.dcp_metadata import read_metadata

    folder = checkpoint_dir.latest_checkpoint(os.path.join(resumed[4], "moe_ep2"))
    metadata = read_metadata(folder).state_dict_metadata
    assert metadata == dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    assert any(".experts." in key for key in metadata), sorted(metadata)[:20]
    assert checkpoint_problem(folder) is None


@pytest.mark.slow
def test_resume_under_other_plans_follows_the_uninterrupted_curve(resumed, tmp_path):
    _, _, outs, directory, *_ = resumed
    straight, legs = _curve(outs, "straight"), _curve(outs, "legs")
    assert len(legs) == len(straight) == 8
    for a, b in zip(straight, legs):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert b["lr"] == a["lr"]
    reference, resumed_params = _merged_params(outs, "straight_params"), _merged_params(outs, "legs_params")
    assert reference.keys() == resumed_params.keys()
    for hf_name, tensor in reference.items():  # Adam noise floor, as in test_parity: a tenth of one step (lr 1e-3)
        assert (tensor - resumed_params[hf_name]).abs().max() <= 1e-4, hf_name
    kept = checkpoint_dir.complete_checkpoints(str(directory))
    assert [step for step, _ in kept] == [8]  # keep_last=1 pruned steps 2, 4 and 6
    assert not [n for n in os.listdir(directory) if n.endswith(checkpoint_dir.TMP_SUFFIX)]
    _assert_exports_to_hf(kept[0][1], tmp_path / "hf", resumed_params)


@pytest.mark.slow
def test_a_checkpoint_write_failing_on_a_full_disk_is_removed_and_training_goes_on(resumed):
    """``resume_ranks.FAILING_WRITES``: each failed save reports why on rank 0 (the rank that failed may be
    another), leaves no folder behind, and the next save, a step later, works."""
    *_, failing, _ = resumed
    for case, out in failing.items():
        (failed,) = out["failed"]
        assert "No space left on device" in failed["error"], case
        assert out["listing"] == [], case  # the partial step-NNNNNN.tmp was removed
        (worked,) = out["worked"]
        assert "error" not in worked and worked["step"] == failed["step"] + 1, case
        assert checkpoint_dir.is_complete(worked["path"]), case


@pytest.mark.slow
def test_a_damaged_checkpoint_is_passed_over_for_the_newest_sound_one(resumed, tmp_path, capsys):
    """Real checkpoints (of steps 2, 3 and 4, from the failing-writes scenario): a truncated shard in the newest
    makes ``--resume`` (latest) take step 3 and say why in one line, and a ``--resume`` naming it is refused
    naming step 3; an unreadable DCP metadata file is found too."""
    *_, failing, plan = resumed
    folder = tmp_path / "ck"
    for out in failing.values():
        shutil.copytree(out["worked"][0]["path"], folder / os.path.basename(out["worked"][0]["path"]))
    newest, sound = str(folder / "step-000004"), str(folder / "step-000003")
    assert checkpoint_problem(newest) is None
    with open(os.path.join(newest, "__1_0.distcp"), "r+b") as shard:
        shard.truncate(os.path.getsize(shard.name) // 2)
    assert "its shard __1_0.distcp is truncated" in shards_problem(newest)
    warnings = []
    assert preflight.check_resume("latest", str(folder), plan.model.hf_config, steps=9, problem=checkpoint_problem,
                                  warn=warnings.append) == sound
    (warning,) = warnings
    assert f"resuming from {sound}" in warning and "step-000004 (its shard __1_0.distcp is truncated" in warning
    (tmp_path / "plan.json").write_text(plan.to_json())
    assert main([str(tmp_path / "plan.json"), "--resume", newest, "--steps", "9"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is damaged: its shard __1_0.distcp is truncated" in err, err
    assert err.endswith(f"the newest sound checkpoint beside it is {sound}"), err
    with open(os.path.join(sound, ".metadata"), "r+b") as metadata:
        metadata.truncate(10)
    assert "its DCP metadata cannot be read" in checkpoint_problem(sound)


def _assert_exports_to_hf(checkpoint: str, out, params: dict[str, torch.Tensor]) -> None:
    """``python -m runtime.export`` of the last checkpoint, with no job running, loads with from_pretrained and
    holds exactly the trained parameters."""
    from transformers import AutoModelForImageTextToText

    assert export.main([checkpoint, str(out)]) == 0
    model = AutoModelForImageTextToText.from_pretrained(str(out))
    loaded = dict(model.named_parameters())
    assert loaded.keys() == params.keys()
    for hf_name, tensor in params.items():
        assert torch.equal(loaded[hf_name].detach(), tensor), hf_name


def test_export_refuses_what_is_not_a_complete_checkpoint(tmp_path, capsys):
    os.makedirs(tmp_path / "step-000003.tmp")
    assert export.main([str(tmp_path / "step-000003.tmp"), str(tmp_path / "hf")]) == 2
    assert "is not a complete training checkpoint" in capsys.readouterr().err


def test_only_complete_checkpoints_are_resumed_from(tmp_path):
    for step in (3, 6, 9):
        os.makedirs(tmp_path / f"{checkpoint_dir.checkpoint_name(step)}{checkpoint_dir.TMP_SUFFIX}")
    checkpoint_dir.mark_complete(str(tmp_path / f"step-000003{checkpoint_dir.TMP_SUFFIX}"))
    checkpoint_dir.mark_complete(str(tmp_path / f"step-000006{checkpoint_dir.TMP_SUFFIX}"))
    os.makedirs(tmp_path / "step-000012")  # renamed by hand, never marked
    assert checkpoint_dir.latest_checkpoint(str(tmp_path)) == str(tmp_path / "step-000006")
    assert checkpoint_dir.resolve_resume("latest", str(tmp_path)) == str(tmp_path / "step-000006")
    assert checkpoint_dir.resolve_resume(str(tmp_path), None) == str(tmp_path / "step-000006")
    with pytest.raises(ValueError, match="not a complete checkpoint"):
        checkpoint_dir.resolve_resume(str(tmp_path / "step-000012"), None)
    removed = checkpoint_dir.prune(str(tmp_path), keep_last=1)
    assert sorted(os.path.basename(p) for p in removed) == ["step-000003", "step-000009.tmp"]
    assert sorted(os.listdir(tmp_path)) == ["step-000006", "step-000012"]


def _complete(folder, step: int) -> str:
    os.makedirs(folder / f"{checkpoint_dir.checkpoint_name(step)}{checkpoint_dir.TMP_SUFFIX}")
    return checkpoint_dir.mark_complete(str(folder / f"{checkpoint_dir.checkpoint_name(step)}"
                                            f"{checkpoint_dir.TMP_SUFFIX}"))


def test_a_run_resumed_from_an_older_checkpoint_orders_its_own_after_the_abandoned_ones(tmp_path):
    """An earlier run wrote steps 2 and 4; a run resumed from step 2 writes step 3 (``--checkpoint-every 1
    --keep-last 1``): its step 3 is the newest, kept by pruning and picked by a later ``--resume DIR``, and the
    abandoned step 4 goes. Markers of an older version (``ok``) come first, by step."""
    for step in (2, 4):
        _complete(tmp_path, step)
    resumed_run = _complete(tmp_path, 3)
    assert checkpoint_dir.latest_checkpoint(str(tmp_path)) == resumed_run
    assert checkpoint_dir.resolve_resume(str(tmp_path), None) == resumed_run
    checkpoint_dir.prune(str(tmp_path), keep_last=1)
    assert sorted(os.listdir(tmp_path)) == ["step-000003"]
    for step in (5, 1):
        os.makedirs(tmp_path / checkpoint_dir.checkpoint_name(step))
        (tmp_path / checkpoint_dir.checkpoint_name(step) / checkpoint_dir.COMPLETE_MARKER).write_text("ok\n")
    assert [step for step, _ in checkpoint_dir.complete_checkpoints(str(tmp_path))] == [1, 5, 3]


@pytest.fixture
def plan_file(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(make_plan({}, {}).to_json())
    return str(path)


def _checkpoint(folder, *, step: int, complete: bool = True, config: dict | None = None) -> str:
    """A stand-in checkpoint folder with what preflight reads: the marker, run_state.json and config.json."""
    os.makedirs(folder)
    (folder / "run_state.json").write_text(json.dumps({"step": step, "samples_seen": step}))
    (folder / "config.json").write_text(json.dumps(config or tiny_hf_config()))
    if complete:
        (folder / checkpoint_dir.COMPLETE_MARKER).write_text("ok\n")
    return str(folder)


@pytest.mark.parametrize("args, message", [
    (["--checkpoint-dir", "{tmp}/c", "--checkpoint-every", "0"], "--checkpoint-every must be >= 1, got 0"),
    (["--keep-last", "2"], "--keep-last needs --checkpoint-dir"),
    (["--max-failures", "1"], "--max-failures needs --checkpoint-dir"),
    (["--async-checkpoint"], "--async-checkpoint needs --checkpoint-dir"),
    (["--checkpoint-dir", "{tmp}/c", "--elastic"], "--elastic re-plans when a worker is lost: give --max-failures"),
    (["--checkpoint-dir", "{tmp}/c", "--max-failures", "1", "--elastic", "-1"], "--elastic waits 0 to 86400 s"),
    (["--checkpoint-dir", "{tmp}/c", "--max-failures", "1", "--elastic", "nan"], "--elastic waits 0 to 86400 s"),
    (["--checkpoint-dir", "{tmp}/not-json/run_state.json"], "is a file, not a folder"),
    (["--checkpoint-dir", "{plan}"], "is the same file as the plan file"),
    (["--resume"], "--resume without a path needs --checkpoint-dir"),
    (["--resume", "--checkpoint-dir", "{tmp}/empty"], "holds no complete checkpoint"),
    (["--resume", "{tmp}/nope"], "is not a folder"),
    (["--resume", "{tmp}/step-000004.tmp"], "is not a complete checkpoint"),
    (["--resume", "{tmp}/step-000002", "--steps", "2"], "has done 2 steps already"),
    (["--resume", "{tmp}/other-model"], "is for another model"),
    (["--resume", "{tmp}/step-000002", "--checkpoint", "{tmp}"], "--resume and --checkpoint both"),
    (["--resume", "{tmp}/null-step"], "null-step/run_state.json: step must be a non-negative integer, got null; "
                                      "the newest sound checkpoint beside it is {tmp}/step-000002"),
    (["--resume", "{tmp}/text-count"],
     'text-count/run_state.json: samples_seen must be a non-negative integer, got "3"'),
    (["--resume", "{tmp}/not-json"], "not-json/run_state.json is not JSON"),
    (["--resume", "{tmp}/a-list"], "a-list/run_state.json holds a list, not a JSON object"),
])
def test_bad_checkpoint_flags_are_one_line_errors_before_torch_and_ray(tmp_path, plan_file, args, message):
    _checkpoint(tmp_path / "step-000002", step=2)
    _checkpoint(tmp_path / "step-000004.tmp", step=4, complete=False)
    config = tiny_hf_config()
    config["text_config"] = {**config["text_config"], "hidden_size": 8}
    _checkpoint(tmp_path / "other-model", step=2, config=config)
    os.makedirs(tmp_path / "empty")
    for name, run_state in (("null-step", '{"step": null, "samples_seen": 2}'),
                            ("text-count", '{"step": 2, "samples_seen": "3"}'), ("not-json", '{"step": 2,'),
                            ("a-list", "[2, 2]")):
        (tmp_path / _checkpoint(tmp_path / name, step=2) / "run_state.json").write_text(run_state)
    args = [a.format(tmp=tmp_path, plan=plan_file) for a in args]
    assert_one_line_error(run_light(plan_file, *args), message.format(tmp=tmp_path))


@pytest.mark.slow
def test_torchrun_checkpoints_and_resumes_under_another_plan(tmp_path):
    """Without Ray: 2 steps under TP2 with an async checkpoint, then ``--resume`` under ZeRO-3 DP2 for 2 more;
    the 4 losses follow the single-process reference (fp32 reduction order, rtol 1e-5)."""
    from tests.runtime.reference import reference_run
    from tests.runtime.test_torchrun import torchrun

    legs = [make_plan(dict(tp=2, micro_batch=2), dict(tp=2, micro_batch=2)),
            make_plan(dict(dp=2, zero=3), dict(dp=2, zero=3))]
    for index, (plan, extra) in enumerate(zip(legs, (["--async-checkpoint"], ["--resume"]))):
        (tmp_path / f"plan{index}.json").write_text(plan.to_json())
        result = torchrun(2, str(tmp_path / f"plan{index}.json"), "--steps", str(2 * (index + 1)), "--metrics",
                          str(tmp_path / f"leg{index}.jsonl"), "--checkpoint-dir", str(tmp_path / "ckpt"), *extra)
        assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for index in range(2)
               for line in (tmp_path / f"leg{index}.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r and "step" in r]
    assert [r["event"] for r in records if "event" in r] == ["checkpoint", "resume", "checkpoint"]
    assert losses == pytest.approx(reference_run(legs[0], seed=0, steps=4)["losses"], rel=1e-5)
