"""planner.api: workload defaults, --fix, evaluation, infeasibility explanations, --max-seq, baselines, the Plan."""

import json
from dataclasses import replace

import pytest

from planner import api
from planner.analysis import strategy_of
from planner.api import Infeasible, evaluate, make_problem, max_seq, parse_fixes, plan, top_plans
from planner.inputs import ClusterInputs, SearchOptions, WorkloadInputs
from planner.catalog import get_model
from planner.cost import DEFAULT_ASSUMPTIONS, check_strategy, estimate
from planner.contract.schema import load_plan
from planner.search.solver.explain import MAX_SEQ_SIDE_PATCHES
from planner.contract.strategy import ModuleStrategy, Strategy
from planner.contract.units import GIB

M32 = "qwen-vl-32b"
TINY_CPU = ClusterInputs(gpus=2, gpu="cpu")
FULL_PIN = [
    "vision.dp=2", "vision.tp=1", "vision.sp=8", "vision.cp=1", "vision.zero=1", "vision.recompute=none",
    "vision.micro_batch=1", "llm.dp=2", "llm.tp=4", "llm.sp=1", "llm.cp=2", "llm.zero=2", "llm.recompute=full",
    "llm.micro_batch=1",
]


@pytest.fixture(scope="module")
def best32():
    return plan(M32, 16)


def test_default_workload():
    w = api.make_workload(get_model(M32), 16)
    assert w.image_sizes == ((1344, 1344),)
    assert w.text_tokens == 512 and w.global_batch == 64 and w.audio_seconds == 0
    audio = api.make_workload(get_model("qwen2-audio-7b"), 8)
    assert audio.audio_seconds == 30 and audio.image_sizes == () and audio.global_batch == 32


def test_default_plan_tokens(best32):
    w = best32.workload
    assert w.module_tokens == {"vision": 9216, "llm": 2816}
    assert w.llm_image_tokens == 2304


def test_images_per_sample_repeats_sizes():
    w = api.make_workload(get_model(M32), 8, WorkloadInputs(image_sizes=[(448, 672)], images_per_sample=3))
    assert w.image_sizes == ((448, 672),) * 3


@pytest.mark.parametrize("kwargs,match", [
    (dict(audio_seconds=10), "no audio encoder"),
    (dict(vision_tokens=9216, images_per_sample=2), "drop --images-per-sample"),
    (dict(images_per_sample=0), "between 1 and 256"),
])
def test_workload_input_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        api.make_workload(get_model(M32), 8, WorkloadInputs(**kwargs))


def test_best_plan_matches_cost_model(best32):
    assert best32.solver.status == "OPTIMAL"
    strategy = Strategy(placement=best32.placement, modules={
        m.name: ModuleStrategy(dp=m.dp, tp=m.tp, sp=m.sp, cp=m.cp, zero=m.zero, recompute=m.recompute,
                               micro_batch=m.micro_batch, grad_accum=m.grad_accum) for m in best32.modules})
    p = make_problem(M32, 16)
    e = estimate(p.model, p.cluster, p.workload, strategy)
    assert best32.predicted.step_time_s == e.step_time_s
    assert best32.predicted.peak_memory_gib * 2**30 == pytest.approx(e.peak_memory_bytes)
    assert e.fits


def test_plan_is_faster_than_or_equal_to_both_baselines(best32):
    """Both baseline families lie inside the planner's strategy space, so the optimum cannot be slower."""
    for name in ("uniform_tp", "zero3"):
        b = best32.baselines[name]
        if b.infeasible is None:
            assert b.speedup >= 1 - 1e-9
            assert b.speedup == pytest.approx(b.step_time_s / best32.predicted.step_time_s)


def test_baselines_have_their_shape(best32):
    u = best32.baselines["uniform_tp"].modules
    assert len({s.split("-")[1] for s in u.values()}) == 1  # the same TP degree everywhere
    z = best32.baselines["zero3"].modules
    assert all(s.startswith("DP16-TP1-SP1-CP1 ZeRO3") for s in z.values())


@pytest.mark.parametrize("gpus", [16, 64])
def test_each_baseline_is_the_fastest_fitting_member_of_its_family(gpus):
    """``best_of`` skips the memory of members no faster than a fitting one; it still picks what costing every
    member in full picks (ties: the first), whatever the members' order (in the families' own order the fastest
    fitting member comes first here, so they are tried reversed)."""
    from planner.search.baselines import _uniform, best_of, megatron_family, uniform_tp_family, zero3_family

    p = make_problem(M32, gpus)
    for name, family in (("uniform_tp", uniform_tp_family), ("zero3", zero3_family), ("megatron", megatron_family)):
        members = [m if isinstance(m, Strategy) else _uniform(p, m) for m in family(p)][::-1]
        full = [estimate(p.model, p.cluster, p.workload, s, p.assumptions, p.layer_costs) for s in members
                if not any(check_strategy(p.model, n, ms, p.cluster, p.workload) for n, ms in s.modules.items())]
        fitting = [e for e in full if e.fits]
        assert fitting, name
        assert best_of(p, name, members).estimate == min(fitting, key=lambda e: e.step_time_s), name


@pytest.mark.slow
def test_infeasibility_hints_count_plans_that_fit_only_pipelined():
    """72B on 16 GPUs fits no plan at the default image, and smaller images only with the LLM pipelined: the
    feasibility probes check the plans without PP first and must then cost the pipelined ones."""
    hints = {}
    for allow_pp in (True, False):
        with pytest.raises(Infeasible) as error:
            plan("qwen-vl-72b", 16, search=SearchOptions(allow_pp=allow_pp))
        hints[allow_pp] = "images up to" in str(error.value)
    assert hints == {True: True, False: False}


def test_infeasible_baseline_says_why():
    p = plan(M32, 8)
    assert p.baselines["zero3"].infeasible.startswith("does not fit: needs at least")
    assert p.baselines["zero3"].step_time_s is None


def test_plan_roundtrips_through_the_schema(best32, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(best32.to_json())
    assert load_plan(path) == best32
    ranks = sorted(r for m in best32.modules for r in m.ranks)
    assert ranks == sorted(list(range(16)) * 2) if best32.placement == "colocated" else list(range(16))


def test_same_inputs_same_bytes(best32):
    assert plan(M32, 16).to_json() == best32.to_json()


def test_tiny_cpu_plan_for_the_runtime(tmp_path):
    p = plan("qwen2.5-vl-tiny", ClusterInputs(gpus=2, gpu="cpu"))
    path = tmp_path / "tiny.json"
    path.write_text(p.to_json())
    loaded = load_plan(path)
    assert loaded.cluster.device.name == "cpu" and loaded.cluster.num_devices == 2
    assert {r for m in loaded.modules for r in m.ranks} == {0, 1}


# --- --fix -------------------------------------------------------------------------------------------------------


def test_fixes_are_honoured():
    p = plan(M32, 16, fix=["vision.sp=8", "llm.tp=8"])
    assert p.module("vision").sp == 8 and p.module("llm").tp == 8
    assert p.solver.fixed == {"llm.tp": "8", "vision.sp": "8"}
    assert p.predicted.step_time_s >= plan(M32, 16).predicted.step_time_s


def test_fix_placement_and_group_size():
    # 12 LLM GPUs need cp=3
    p = plan(M32, 16, fix=["placement=disjoint", "vision.gpus=4"], search=SearchOptions(allow_ring_cp=True))
    assert p.placement == "disjoint"
    assert p.module("vision").ranks == [12, 13, 14, 15] and p.module("llm").ranks == list(range(12))


def test_pinning_everything_evaluates_that_strategy():
    p = plan(M32, 16, fix=FULL_PIN)
    assert p.solver.status == "EVALUATED"
    assert (p.module("llm").tp, p.module("llm").cp, p.module("llm").grad_accum) == (4, 2, 32)


@pytest.mark.parametrize("fix,match", [
    (["llm.tp=8", "llm.tp=4"], "contradictory --fix: llm.tp=8 and llm.tp=4"),
    (["vision.grad_accum=2", "llm.grad_accum=4"], "share one grad_accum"),
    (["placement=colocated", "vision.gpus=4"], "colocated spans all 16 GPUs"),
    (["placement=disjoint", "vision.gpus=8", "llm.gpus=12"], "pinned to 20 GPUs"),
    (["llm.dp=2", "llm.tp=2", "llm.sp=1", "llm.cp=2", "llm.pp=1", "llm.gpus=16"], "pp\\*dp\\*tp\\*sp\\*cp = 8"),
    (["audio.tp=2"], "has modules vision, llm"),
    (["llm.width=2"], "field must be one of"),
    (["llm.tp=two"], "must be a whole number"),
    (["llm.zero=4"], "0, 1, 2 or 3"),
    (["llm.recompute=some"], "recompute must be one of"),
    (["llm.tp"], "MODULE.FIELD=VALUE"),
    (["placement=everywhere"], "placement must be one of"),
])
def test_bad_fixes_are_one_line_errors(fix, match):
    with pytest.raises(ValueError, match=match):
        parse_fixes(fix, get_model(M32), 16)


def test_fix_that_breaks_a_rule_names_the_rule():
    with pytest.raises(ValueError, match="sp=2 does not divide the 5 attention heads per TP rank"):
        plan(M32, 16, fix=["llm.tp=8", "llm.sp=2"])


def test_fix_placement_contradicting_placement_flag():
    with pytest.raises(ValueError, match="contradictory"):
        plan(M32, 16, placement="colocated", fix=["placement=disjoint"])


def test_evaluate_a_hand_made_strategy():
    s = ModuleStrategy(dp=2, tp=4, cp=2, zero=2, recompute="full", micro_batch=1, grad_accum=32)
    v = ModuleStrategy(dp=2, sp=8, zero=1, micro_batch=1, grad_accum=32)
    p = evaluate(M32, Strategy(placement="colocated", modules={"vision": v, "llm": s}))
    assert p.solver.status == "EVALUATED" and p.cluster.num_devices == 16


def test_evaluating_a_strategy_that_does_not_fit_explains():
    s = ModuleStrategy(dp=16, zero=0, micro_batch=4, grad_accum=1)
    with pytest.raises(Infeasible, match="does not fit: all GPUs need .* GiB over"):
        evaluate(M32, Strategy(placement="colocated", modules={"vision": s, "llm": s}))


# --- infeasible / --max-seq --------------------------------------------------------------------------------------


def test_infeasible_names_module_need_and_smallest_gpu_count():
    with pytest.raises(Infeasible) as info:
        plan(M32, 4, placement="colocated")
    message = str(info.value)
    assert "llm does not fit: its smallest need is" in message and "GiB over" in message
    assert "\n" not in message
    gpus = int(message.split("--gpus ")[1].split(")")[0])
    plan(M32, gpus, placement="colocated", workload=WorkloadInputs(global_batch=16))  # fits at that count (same batch)
    with pytest.raises(ValueError):  # Infeasible, or a count the model cannot use
        plan(M32, gpus - 1, placement="colocated", workload=WorkloadInputs(global_batch=16))


def test_unusable_gpu_count_suggests_usable_ones():
    with pytest.raises(ValueError, match=r"no valid vision strategy on 7 GPUs .*usable GPU counts nearby: 4 or 8"):
        plan(M32, 7, workload=WorkloadInputs(global_batch=64), placement="colocated",
             search=SearchOptions(allow_ring_cp=False))


def test_infeasible_suggests_a_sequence_that_fits():
    with pytest.raises(Infeasible) as info:
        plan(M32, 16, workload=WorkloadInputs(image_sizes=[(8000, 8000)], images_per_sample=4),
             search=SearchOptions(allow_ring_cp=False))
    tokens = int(str(info.value).split("--vision-tokens ")[1].split(")")[0])
    assert plan(M32, 16, workload=WorkloadInputs(vision_tokens=tokens)).workload.vision_tokens == tokens


@pytest.mark.slow
def test_max_seq_is_the_longest_square_image_that_fits_inside_the_margin():
    """The longest sequence leaves ``max_seq_memory_margin`` of the usable memory free: one merge unit more does
    not fit in what remains, though it may fit in all of it."""
    p = max_seq(M32, 16)
    tokens = p.workload.vision_tokens
    side = round(tokens**0.5)
    assert side * side == tokens and side % 2 == 0
    a = DEFAULT_ASSUMPTIONS
    inside = replace(a, usable_memory_fraction=a.usable_memory_fraction * (1 - a.max_seq_memory_margin))
    usable = p.cluster.device.memory_bytes * inside.usable_memory_fraction
    assert p.predicted.peak_memory_gib * GIB <= usable + 1
    with pytest.raises(Infeasible):
        plan(M32, 16, workload=WorkloadInputs(vision_tokens=(side + 2) ** 2), assumptions=inside)


def test_max_seq_small_model_cpu():
    p = max_seq("qwen2.5-vl-tiny", TINY_CPU, workload=WorkloadInputs(global_batch=2))
    side = round(p.workload.vision_tokens**0.5)
    if side * 2 < MAX_SEQ_SIDE_PATCHES:
        with pytest.raises(Infeasible):
            plan("qwen2.5-vl-tiny", TINY_CPU, workload=WorkloadInputs(global_batch=2, vision_tokens=(side + 2) ** 2))


def test_max_seq_of_a_clip_is_the_most_frames_that_fit_inside_the_margin():
    """A clip is lengthened, not an image: its answer fits in all but ``max_seq_memory_margin`` of the usable
    memory, and one temporal group (two frames) more does not, below the processor's 768 frames."""
    workload = WorkloadInputs(videos=[(8, 720, 1280)], global_batch=1)
    p = max_seq("qwen2.5-vl-3b", 1, workload=workload)
    (frames, height, width), = p.workload.videos
    assert (height, width) == (720, 1280) and frames % 2 == 0 and 8 < frames < 768
    assert p.workload.vision_tokens is None and not p.workload.image_sizes
    a = DEFAULT_ASSUMPTIONS
    inside = replace(a, usable_memory_fraction=a.usable_memory_fraction * (1 - a.max_seq_memory_margin))
    assert p.predicted.peak_memory_gib * GIB <= p.cluster.device.memory_bytes * inside.usable_memory_fraction + 1
    longer = replace(workload, videos=[(frames + 2, height, width)])
    with pytest.raises(Infeasible):
        plan("qwen2.5-vl-3b", 1, workload=longer, assumptions=inside)


def test_max_seq_needs_a_vision_model():
    with pytest.raises(ValueError, match="no vision encoder"):
        max_seq("qwen2-audio-7b", 8)


def test_top_plans_ranked_with_both_placements():
    plans = top_plans(M32, 16, k=3)
    assert [p.solver.rank for p in plans] == [1, 2, 3]
    times = [p.predicted.step_time_s for p in plans]
    assert times == sorted(times)
    assert len({json.dumps([m.model_dump() for m in p.modules]) for p in plans}) == 3


def test_disjoint_placement_of_three_modules_is_refused():
    from planner.contract.models import ModelSpec

    vl, audio = get_model("qwen2.5-vl-tiny"), get_model("qwen2-audio-7b")
    three = ModelSpec(name="three", family="qwen2_5_vl", hf_config={}, vision_input=vl.vision_input,
                      audio_input=audio.audio_input,
                      modules=(vl.module("vision"), audio.module("audio"), vl.module("llm")))
    with pytest.raises(NotImplementedError, match="exactly one encoder"):
        plan(three, ClusterInputs(gpus=4, gpu="cpu", profile=None), placement="disjoint")


def test_evaluating_an_invalid_strategy_names_the_rule():
    llm = ModuleStrategy(dp=1, tp=8, sp=2, zero=1, micro_batch=1, grad_accum=64)
    vision = ModuleStrategy(dp=1, sp=16, zero=1, micro_batch=1, grad_accum=64)
    with pytest.raises(ValueError, match="llm: sp=2 does not divide the 5 attention heads per TP rank"):
        evaluate(M32, Strategy(placement="colocated", modules={"vision": vision, "llm": llm}))


PP4_CLUSTER = ClusterInputs(gpus=4, gpu="h200", gpus_per_node=1)
PP4 = WorkloadInputs(precision="bf16_pure", image_sizes=[(448, 448)], text_tokens=128, global_batch=4)
"""32B on 4 H200, one per node: pipelining the LLM is the fastest plan (PP moves activations where ZeRO moves
weights over the NIC)."""


@pytest.fixture(scope="module")
def pipelined32():
    return plan(M32, PP4_CLUSTER, workload=PP4)


def test_a_pinned_zero_bubble_schedule_is_planned_and_costed_as_one():
    layout = ["llm.pp=2", "llm.dp=2", "llm.tp=1", "llm.sp=1", "llm.cp=1", "llm.zero=2", "llm.recompute=none",
              "llm.micro_batch=1"]
    zero_bubble = plan(M32, PP4_CLUSTER, fix=[*layout, "llm.pp_schedule=interleaved_zb"], workload=PP4).module("llm")
    interleaved = plan(M32, PP4_CLUSTER, fix=[*layout, "llm.pp_schedule=interleaved_1f1b"], workload=PP4).module("llm")
    assert (zero_bubble.pp_schedule, zero_bubble.virtual_stages) == ("interleaved_zb", 2)
    # the same layout loses less to its bubble when the weight gradients fill it
    assert 0 < zero_bubble.predicted.time_s.pp_bubble < interleaved.predicted.time_s.pp_bubble


def test_pipelined_plan_records_its_stages(pipelined32, tmp_path):
    llm = pipelined32.module("llm")
    assert llm.pp > 1 and len(llm.ranks) == 4
    assert len(llm.pp_layers) == llm.pp * llm.virtual_stages and sum(llm.pp_layers) == 64
    assert len(llm.predicted.stage_per_micro_batch_s) == llm.pp == len(llm.predicted.stage_peak_memory_gib)
    assert llm.predicted.time_s.pp_bubble > 0
    path = tmp_path / "plan.json"
    path.write_text(pipelined32.to_json())
    assert load_plan(path) == pipelined32
    # the plan file re-costs to the same prediction
    assert evaluate(M32, strategy_of(pipelined32), PP4_CLUSTER, workload=PP4).predicted.step_time_s == pytest.approx(
        pipelined32.predicted.step_time_s)


def test_pipelined_plan_says_what_pipelining_gains(pipelined32):
    without = pipelined32.baselines["without_pp"]
    assert without.speedup > 1 and "PP" not in " ".join(without.modules.values())
    assert "megatron" in pipelined32.baselines
    flat = plan(M32, PP4_CLUSTER, search=SearchOptions(allow_pp=False), workload=PP4)
    assert flat.module("llm").pp == 1 and "without_pp" not in flat.baselines and "with_pp" not in flat.baselines
    assert flat.predicted.step_time_s == pytest.approx(without.step_time_s)


def test_pipelined_plan_file_is_checked(pipelined32, tmp_path):
    data = json.loads(pipelined32.to_json())
    llm = next(m for m in data["modules"] if m["name"] == "llm")
    llm["pp_layers"] = llm["pp_layers"][:-1]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="needs pp_layers of"):
        load_plan(path)


@pytest.mark.parametrize("placement", ["colocated", "disjoint"])
def test_pipelined_plan_records_each_stages_gpu_peak(placement):
    """Each stage's GPUs at their own heaviest moment (colocated: with the vision tower), overhead included; the
    largest is the plan's peak (disjoint: the LLM group's), and the stages differ as their own shares do."""
    pipelined = plan(M32, PP4_CLUSTER, placement=placement, workload=PP4)
    llm, predicted = pipelined.module("llm"), pipelined.predicted
    stages, own = predicted.stage_memory_breakdown_gib, llm.predicted.stage_memory_gib
    assert llm.pp > 1 and len(stages) == len(own) == len(predicted.stage_peak_phases) == llm.pp
    for gpu, alone, own_peak in zip(stages, own, llm.predicted.stage_peak_memory_gib):
        assert alone.total == pytest.approx(own_peak)
        assert gpu.total >= alone.total + gpu.overhead
    group = predicted.memory_breakdown_gib if placement == "colocated" else llm.predicted.memory_gib
    assert max(s.total for s in stages) == pytest.approx(group.total)
    assert len({round(s.total, 6) for s in stages}) > 1


def test_the_plan_records_the_linear_attention_kernel_it_priced(tmp_path):
    """Qwen3.5's LLM runs fla's kernel on GPUs and transformers' torch fallback on a CPU (``--linear-attention``
    overrides either), priced as it runs (the torch rule keeps more); a module without linear-attention layers
    records none; a plan from before schema version 9 reads as one without the field (its layers ran torch)."""
    gpu, cpu = (plan("qwen3.5-tiny", ClusterInputs(gpus=2, gpu=gpu)) for gpu in ("h100-80gb", "cpu"))
    assert [(m.name, m.linear_attention) for m in gpu.modules] == [("vision", None), ("llm", "fla")]
    assert cpu.module("llm").linear_attention == "torch"
    pinned = [f"{m.name}.{field}={getattr(m, field)}" for m in gpu.modules
              for field in ("dp", "tp", "sp", "cp", "zero", "micro_batch")] + ["llm.recompute=none",
                                                                            "vision.recompute=none"]
    fla, on_torch = (plan("qwen3.5-tiny", ClusterInputs(gpus=2, gpu="h100-80gb"), fix=pinned,
                          search=SearchOptions(linear_attention=kernel)).module("llm") for kernel in ("fla", "torch"))
    assert (fla.linear_attention, on_torch.linear_attention) == ("fla", "torch")
    assert on_torch.predicted.memory_gib.activations > fla.predicted.memory_gib.activations
    with pytest.raises(ValueError, match="^--linear-attention must be one of fla, torch, got 'triton'$"):
        make_problem("qwen3.5-tiny", 2, search=SearchOptions(linear_attention="triton"))
    document = json.loads(gpu.to_json())
    document["schema_version"] = 8
    for module in document["modules"]:
        del module["linear_attention"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(document))
    assert {m.linear_attention for m in load_plan(path).modules} == {None}
