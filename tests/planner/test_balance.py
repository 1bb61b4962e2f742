"""Per-module balancing (planner/balance.py): a sample's work per module from the cost model, the per-step LPT
assignment, and the imbalance a dataset plan prices and prints."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner import api
from planner.balance import (
    ModuleDegrees,
    SampleWork,
    assign_lpt,
    balanced_workload,
    llm_micro_loads,
    step_imbalance,
)
from planner.catalog import get_model
from planner.cost import module_cost
from planner.cost.comm import Link
from planner.cost.layers import Shard, layer_terms
from planner.dataset import DatasetHistogram, pack_dataset, sample_tokens
from planner.hardware import get_device
from planner.schema import load_plan
from planner.strategy import ModuleStrategy
from planner.workload import packed_workload

MODEL = get_model("qwen-vl-32b")
H100 = get_device("h100")


def test_a_samples_work_is_its_layers_passes_on_one_rank_without_per_call_overheads():
    # a 32 x 48-patch image through Qwen2.5-VL's tower at TP 2, by hand: every layer's forward + backward +
    # recompute on one sample, 1,536 patches, one 1,536-patch segment, 4 x 6 = 24 windows of 64 patches
    work = SampleWork(MODEL, H100, degrees={"vision": ModuleDegrees(tp=2, recompute="full")})
    link = Link(bandwidth=1.0, latency=0.0)
    shard = Shard(tp=2, sp=1, cp=1, micro_batch=1, tokens=1536, segment_tokens=1536, segments=1.0, window_tokens=64,
                  windows=24.0, recompute="full", backward="full", tp_link=link, sp_link=link, cp_link=link,
                  ep_link=link, device=work.device, assumptions=work.assumptions)
    by_hand = 0.0
    for layer in MODEL.module("vision").layers:
        t = layer_terms(layer, shard)
        by_hand += layer.count * (t.forward_s + t.backward_s + t.recompute_s)
    assert work.vision((1, 32, 48)) == pytest.approx(by_hand, rel=1e-12)
    assert work.device.kernel_launch_latency == 0 and work.assumptions.host_seconds_per_op == 0
    assert work.vision((2, 32, 48)) == pytest.approx(2 * by_hand, rel=1e-2)  # a clip: one segment per group


def test_a_large_image_costs_more_than_its_patches_in_thumbnails_and_a_packs_work_follows_its_segments():
    work = SampleWork(MODEL, H100)
    assert work.vision((1, 256, 256)) > 64 * work.vision((1, 32, 32))  # full-attention blocks grow with length^2
    assert work.llm([4000, 96]) > work.llm([2048, 2048])  # same tokens, one long sample attends more
    assert work.llm([2048, 2048]) == work.llm([2048, 2048])


def test_lpt_gives_the_costliest_first_to_the_least_loaded_replica():
    # 5 -> r0; 4 -> r1; 3 -> r1 (4 < 5); 3 -> r0 (5 < 7); 3 -> r1 (7 < 8)
    assert assign_lpt([5, 4, 3, 3, 3], 2) == [[0, 3], [1, 2, 4]]
    assert assign_lpt([1.0], 3) == [[0], [], []]  # a replica may get nothing
    assert assign_lpt([2, 2, 2], 2) == [[0, 2], [1]]  # ties: the lower index, the lower replica


def test_step_imbalance_is_the_busiest_replicas_work_over_the_means_summed_over_micro_batches():
    assert step_imbalance([[3, 1], [2, 2]]) == pytest.approx((3 + 2) / (2 + 2))
    assert step_imbalance([[0, 0]]) == 1.0
    # replica 0 got packs 0 and 2, replica 1 packs 1 and 3; one pack per micro-batch
    assert llm_micro_loads([4, 3, 2, 1], [[0, 2], [1, 3]], 1) == [[4, 3], [2, 1]]


def _histogram(shapes):
    return DatasetHistogram(source="test", text_tokens="given", skipped={},
                            shapes=tuple((c, t, sizes, ()) for c, t, sizes in shapes))


def _packed(shapes, budget=8192):
    return pack_dataset(sample_tokens(_histogram(shapes), MODEL), MODEL, budget).packed


def test_the_expected_imbalance_is_simulated_on_the_datasets_packs():
    mixed = _packed([(48, 300, ((448, 448),)), (16, 300, ((1792, 1792),))], budget=None)  # a sample per pack
    alike = _packed([(64, 300, ((448, 448),))], budget=None)
    work = SampleWork(MODEL, H100)
    assert mixed.balance.pack_grids and all(len(g) >= 1 for g in mixed.balance.pack_grids)
    assert mixed.balance.expected_imbalance("vision", 1, 4, 1, work) == 1.0
    heavy_tail = mixed.balance.expected_imbalance("vision", 8, 1, 1, work)
    assert heavy_tail > 1.2  # a 1792 x 1792 image alone outweighs a replica's share
    assert alike.balance.expected_imbalance("vision", 8, 1, 1, work) == 1.0  # one image each
    assert alike.balance.expected_imbalance("vision", 8, 1, 1, work) is alike.balance.expected_imbalance(
        "vision", 8, 1, 1, work)  # memoised
    assert mixed.balance.expected_imbalance("llm", 8, 1, 2, work) >= 1.0


def test_a_dataset_plan_is_timed_on_the_busiest_replica_and_prints_its_imbalance(capsys):
    packed = _packed([(48, 300, ((448, 448),)), (16, 300, ((1792, 1792),))], budget=None)
    workload, unbalanced = packed_workload(packed, 8), packed_workload(replace(packed, balance=None), 8)
    problem = api.make_problem(MODEL, 8, profile=None)
    s = ModuleStrategy(dp=8, zero=3)

    def cost(w):
        return module_cost(MODEL, "vision", problem.cluster, w, s, placement="colocated", precision="bf16_mixed",
                           first_rank=0, assumptions=problem.assumptions)

    balanced, factor = balanced_workload(workload, MODEL, "vision", 8, 1, 1, problem.cluster.device,
                                         problem.assumptions)
    assert dict(balanced.packs.mean)["vision"].tokens == pytest.approx(dict(packed.mean)["vision"].tokens * factor)
    assert dict(balanced.packs.mean)["llm"] == dict(packed.mean)["llm"]  # the other module's mean is its own
    timed, mean = cost(workload), cost(unbalanced)
    assert timed.imbalance > 1.2 and mean.imbalance is None
    assert timed.forward_s > 1.2 * mean.forward_s
    assert timed.flops_per_step == pytest.approx(mean.flops_per_step)  # the model FLOPs are the mean's
    assert timed.activations_per_micro_batch_bytes == mean.activations_per_micro_batch_bytes  # the heaviest pack's


def test_plan_prints_each_modules_expected_imbalance(tmp_path, capsys):
    from planner.analysis import mixed_resolution_histogram
    from planner.cli import main
    from planner.dataset import write_histogram

    path = tmp_path / "h.json"
    write_histogram(mixed_resolution_histogram(samples=400), path)
    assert main(["--model", "qwen-vl-32b", "--gpus", "16", "--profile", "none", "--dataset", str(path),
                 "--out", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    plan = load_plan(tmp_path / "p.json")
    for m in plan.modules:
        assert m.predicted.expected_imbalance >= 1.0
        assert (f"balanced per step on its own work: expected imbalance {m.predicted.expected_imbalance:.3f} "
                f"(busiest / mean replica over {m.dp} replicas") in out
