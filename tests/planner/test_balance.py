"""Per-module balancing (planner/cost/balance.py): a sample's work per module from the cost model, the per-step LPT
assignment, and the imbalance a dataset plan prices and prints."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner import api
from planner.cost.balance import (
    ModuleDegrees,
    SampleWork,
    StepBalance,
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
from planner.contract.hardware import get_device
from planner.contract.schema import load_plan
from planner.contract.strategy import ModuleStrategy
from planner.contract.workload import ModuleTokens, PackedTokens, packed_workload

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
    problem = api.make_problem(MODEL, api.ClusterInputs(gpus=8, profile=None))
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
    # one image per replica and micro-batch: the heaviest replica holds the heaviest pack
    assert timed.activations_per_micro_batch_bytes == mean.activations_per_micro_batch_bytes


def test_memory_holds_the_heaviest_replicas_micro_batch_not_the_mean_nor_the_heaviest_pack():
    # 4 packs of 16 x 16-patch images (256 patches, 2 x 2 windows of 8 x 8 patches, 64 merged tokens each): A holds
    # 3, B 2, C and D 1. Two vision replicas, two packs each per micro-batch: every micro-batch draws all 4 packs,
    # and LPT splits their 7 equal images 4 / 3. The heaviest replica: 4 images = 1,024 patches, 16 windows, 256
    # merged tokens, squares 4 x 256^2, i.e. per pack (micro-batch 2) 512 / 8 / 128 / 131,072 -- not the mean pack's
    # 448 patches, nor pack A's 768. The LLM replica's micro-batch: the two heaviest whole packs, 150 tokens
    # (100 + 50) and 120 (one sample, squares 14,400 above (60, 60)'s 7,200): per pack 135 tokens, squares
    # (100^2 + 50^2 + 120^2) / 2 = 13,450 -- not the heaviest pack's 150.
    image = (1, 16, 16)
    balance = StepBalance(pack_grids=((image,) * 3, (image,) * 2, (image,), (image,)),
                          pack_lengths=((100, 50), (120,), (30,), (60, 60)))
    work = SampleWork(MODEL, H100)
    vision = balance.heaviest_replica("vision", 2, 2, 1, work)
    assert (vision.tokens, vision.windows, vision.output_tokens, vision.squared_segments) == (512, 8, 128, 131072)
    llm = balance.heaviest_replica("llm", 2, 2, 1, work)
    assert (llm.tokens, llm.squared_segments) == (135, 13450)
    alone = balance.heaviest_replica("vision", 1, 2, 1, work)  # one replica: the two heaviest packs' 5 images
    assert (alone.tokens, alone.windows) == (5 * 256 / 2, 5 * 4 / 2)

    # the plan's memory is priced on it: as a workload whose heaviest pack is those tokens, not pack A's
    def tokens(images, lengths):
        return (("vision", ModuleTokens(tokens=256 * images, segments=(), windows=4 * images, output_tokens=64 * images,
                                        segment_squares=256**2 * images)),
                ("llm", ModuleTokens(tokens=sum(lengths), segments=(), segment_squares=sum(n * n for n in lengths))))

    packs = PackedTokens(mean=tokens(7 / 4, [105]), heaviest=tokens(3, [100, 50]), samples_per_pack=1.75,
                         pack_tokens=160, balance=balance)
    problem = api.make_problem(MODEL, api.ClusterInputs(gpus=2, profile=None))

    def activations(packs, module):
        s = ModuleStrategy(dp=2, micro_batch=2, zero=3)
        return module_cost(MODEL, module, problem.cluster, packed_workload(packs, 4), s, placement="colocated",
                           precision="bf16_mixed", first_rank=0, assumptions=problem.assumptions
                           ).activations_per_micro_batch_bytes

    heaviest = dict(packs.heaviest)  # the other module's: its heaviest pack's
    by_hand = dict(vision=replace(packs, balance=None, heaviest=(("vision", vision), ("llm", heaviest["llm"]))),
                   llm=replace(packs, balance=None, heaviest=(("vision", heaviest["vision"]), ("llm", llm))))
    for module in ("vision", "llm"):
        assert activations(packs, module) == activations(by_hand[module], module)
        assert activations(packs, module) != activations(replace(packs, balance=None), module)


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
