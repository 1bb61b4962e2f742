"""``planner.replan``: a plan re-planned for another device count keeps its problem (model, device, sample,
global batch, precision, training settings, pins); the command's errors are one line."""

from __future__ import annotations

import json
import os

import pytest
from PIL import Image

from planner import api
from planner.contract.schema import load_plan
from planner.dataset import read_dataset
from planner.replan import main, replan


@pytest.fixture(scope="module")
def tiny_plan():
    plan = api.plan("qwen2.5-vl-tiny", api.ClusterInputs(gpus=4, gpu="cpu"), fix={"vision.zero": 1},
                    workload=api.WorkloadInputs(image_sizes=[(168, 112)], text_tokens=40, global_batch=8))
    return plan.model_copy(update={"training": plan.training.model_copy(update={"learning_rate": 3e-4})})


def test_the_same_device_count_gives_the_same_plan(tiny_plan):
    again, note = replan(tiny_plan, 4)
    assert note is None
    assert again.modules == tiny_plan.modules and again.predicted == tiny_plan.predicted


def test_fewer_devices_keep_the_problem_and_the_global_batch(tiny_plan):
    new, note = replan(tiny_plan, 2)
    assert note is None and new.cluster.num_devices == 2
    assert new.cluster.device == tiny_plan.cluster.device and new.model == tiny_plan.model
    assert new.workload == tiny_plan.workload.model_copy(update={"module_tokens": new.workload.module_tokens})
    assert new.training == tiny_plan.training  # the learning rate set by hand, not the planner's default
    assert new.module("vision").zero == 1 and new.solver.fixed == {"vision.zero": "1"}
    for m in new.modules:
        assert m.dp * m.micro_batch * m.grad_accum == 8


def test_pins_no_plan_on_the_new_count_keeps_are_dropped_with_a_note():
    plan = api.plan("qwen2.5-vl-tiny", api.ClusterInputs(gpus=4, gpu="cpu"), fix={"llm.tp": 4},
                    workload=api.WorkloadInputs(global_batch=8))
    new, note = replan(plan, 2)
    assert new.cluster.num_devices == 2 and note.startswith("pins llm.tp=4 dropped: ")


def _dataset(folder) -> str:
    """A caption file in ``folder/data`` of six images there, of three sizes, and one row naming an image outside it."""
    (folder / "data").mkdir()
    rows = []
    for i, (w, h) in enumerate([(112, 84), (224, 168), (336, 224)] * 2 + [(448, 336)]):
        Image.new("RGB", (w, h)).save(folder / ("outside.png" if i == 6 else f"data/{i}.png"))
        rows.append({"image": "../outside.png" if i == 6 else f"{i}.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat is in the picture?"}, {"from": "gpt", "value": "word " * (5 + i)}]})
    (folder / "data" / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(folder / "data" / "d.jsonl")


def test_a_dataset_plan_is_re_planned_on_its_dataset_read_again(tmp_path):
    """The dataset (its file, as it was read: here without the row outside its folder), the pixel bounds, the pack
    budget and the global batch (in packs) are the plan's; the new plan is the one ``plan --dataset`` makes for the
    new device count with them."""
    histogram = read_dataset(_dataset(tmp_path), data_root_only=True)  # as plan --dataset F --data-root-only reads
    dataset = api.DatasetInputs(source=histogram, max_pixels=224 * 224, pack_tokens=512)
    plan = api.plan("qwen2.5-vl-tiny", api.ClusterInputs(gpus=4, gpu="cpu"), dataset=dataset,
                    workload=api.WorkloadInputs(global_batch=24))
    d = plan.workload.dataset
    assert d.read_from == str(tmp_path / "data" / "d.jsonl") and d.data_root_only and d.samples == 6
    new, note = replan(plan, 2)
    assert note is None and new.cluster.num_devices == 2
    assert new.workload.dataset == d and new.workload.global_batch == plan.workload.global_batch  # packs
    assert plan.workload.global_batch * d.samples_per_pack == 24
    direct = api.plan("qwen2.5-vl-tiny", api.ClusterInputs(gpus=2, gpu="cpu"), workload=api.WorkloadInputs(
        global_batch=24), dataset=dataset)
    assert new.modules == direct.modules and new.predicted == direct.predicted


def test_a_dataset_plan_whose_dataset_cannot_be_read_again_is_refused_in_one_line(tmp_path):
    from planner.analysis import mixed_resolution_histogram

    in_memory = api.plan("qwen2.5-vl-tiny", api.ClusterInputs(gpus=2, gpu="cpu"),
                         dataset=api.DatasetInputs(source=mixed_resolution_histogram(samples=50), pack_tokens=16384))
    with pytest.raises(ValueError, match=r"^the plan's dataset \(.*\) was a histogram made in memory, which a "
                                         r"re-plan cannot read again: plan from its file with `plan --dataset FILE`$"):
        replan(in_memory, 1)
    path = _dataset(tmp_path)
    plan = api.plan("qwen2.5-vl-tiny", api.ClusterInputs(gpus=2, gpu="cpu"), dataset=api.DatasetInputs(source=path))
    os.remove(path)
    with pytest.raises(ValueError, match=r"^the plan's dataset cannot be read again: --dataset .*d.jsonl is not a "
                                         r"file$"):
        replan(plan, 1)


def test_the_command_writes_the_plan_and_refuses_bad_input_in_one_line(tiny_plan, tmp_path, capsys):
    old, new = tmp_path / "plan.json", tmp_path / "new.json"
    old.write_text(tiny_plan.to_json())
    assert main([str(old), "--gpus", "1", "--out", str(new)]) == 0
    assert load_plan(new).cluster.num_devices == 1
    assert capsys.readouterr().out.startswith("replan: 1 devices: vision DP1")
    for args, message in ((["--gpus", "0", "--out", str(new)], "--gpus must be between 1 and"),
                          (["--gpus", "2", "--out", str(old)], "is the same file as plan"),
                          (["--gpus", "2", "--out", str(tmp_path / "missing" / "p.json")], "cannot write --out")):
        assert main([str(old), *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("replan: error: ") and message in err, err


def test_the_device_keeps_the_numbers_the_plan_recorded(tmp_path):
    """A plan made on a cluster file (a 50 Gb/s network) re-plans on that network, not the catalog device's."""
    slow = tmp_path / "slow.yaml"
    slow.write_text("device: h100-80gb\ninter_node_bandwidth: 6.25e9\n")
    plan = api.plan("qwen2.5-vl-tiny", api.ClusterInputs(gpus=16, cluster_file=str(slow), profile=None))
    new, _ = replan(plan, 8)
    assert new.cluster.device == plan.cluster.device and new.cluster.device.inter_node_bandwidth == 6.25e9


def test_a_gpu_plan_on_the_torch_linear_attention_kernel_re_plans_on_it():
    """A Qwen3.5 plan made with ``--linear-attention torch`` (a GPU cluster without fla-core) keeps it: the GPU
    default, fla, would stop the restarted run."""
    plan = api.plan("qwen3.5-tiny", api.ClusterInputs(gpus=4, gpu="h100-80gb", profile=None),
                    search=api.SearchOptions(linear_attention="torch"))
    new, _ = replan(plan, 2)
    assert new.module("llm").linear_attention == "torch"


def test_a_dataset_plan_made_with_a_relative_path_is_re_planned_from_another_folder(tmp_path, monkeypatch, capsys):
    """``plan --dataset data/d.jsonl`` in one folder, ``python -m planner.replan`` in another (as the runtime's
    elastic re-plan may run): the plan records the dataset's absolute path."""
    from planner.cli import main as plan_main

    _dataset(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert plan_main(["--model", "qwen2.5-vl-tiny", "--gpu", "cpu", "--gpus", "2", "--dataset", "data/d.jsonl",
                      "--data-root-only", "--global-batch", "12", "--out", "plan.json"]) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main([str(tmp_path / "plan.json"), "--gpus", "1", "--out", "new.json"]) == 0
    old, new = load_plan(tmp_path / "plan.json"), load_plan(elsewhere / "new.json")
    assert new.workload.dataset == old.workload.dataset and new.workload.dataset.samples == 6
    assert new.workload.global_batch == old.workload.global_batch and new.cluster.num_devices == 1
