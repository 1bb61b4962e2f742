"""The planner-runtime contract: every strategy the planner's candidate generator can emit, the runtime's plan
validation (``runtime.launch.driver.validate_plan``) accepts, for every catalog model the runtime builds, on a few
cluster shapes and workloads (a short sequence among them, where SP degrees meet the token counts); and a sample
of them builds its first rank under the dry-run (fake tensors, the plan's world), at full size.

Strategies that differ only in ZeRO stage or recomputation are checked once. Each emitted strategy is put in a plan with one partner of the other module (same grad_accum, so the two
modules' batches line up as the runtime requires), through the planner's own ``build_plan``: every strategy of
either module is in at least one plan.
"""

from __future__ import annotations

import itertools
import json
import random

import pytest

from planner.api import ClusterInputs, WorkloadInputs, make_problem, plan
from planner.search.enumeration import group_sizes, module_strategies
from planner.plan_document import build_plan
from planner.catalog import get_model, list_models
from planner.contract.strategy import Strategy
from runtime.launch.driver import validate_plan
from runtime.models.model import MODEL_CLASSES, hf_config_from_dict
from runtime.training.trainer import RunOptions

NO_PROFILE_8 = ClusterInputs(gpus=8, profile=None)
"""Eight GPUs of the default hardware, costed analytically."""
CLUSTERS = ((8, 8), (16, 8), (6, 2))
"""(GPUs, GPUs per node): one node, two nodes, and a count whose divisors are not powers of two."""
WORKLOADS = {
    "default": {},
    "short": {"image_sizes": [(28, 28)], "text_tokens": 3, "global_batch": 8},
}
"""The planner's default sample, and the shortest one (one merged image token, a 4-token LLM sequence)."""


def audio_workloads(model: str) -> dict[str, dict]:
    """An audio model's: the default (30 s), and one clip (a whole encoder pass) with the shortest text (the clip's
    two markers and one token)."""
    clip = get_model(model).audio_input.max_seconds
    return {"default": {}, "short": {"audio_seconds": clip, "text_tokens": 3, "global_batch": 8}}

RUNTIME_MODELS = [name for name, *_ in list_models() if get_model(name).family in MODEL_CLASSES]
"""Catalog models whose family the runtime builds."""


def runtime_key(s) -> tuple:
    """What the runtime's validation reads of a module's strategy: its degrees, batch split and schedule (ZeRO
    stage and recomputation change memory and time, not whether the runtime runs it; the plan schema checks their
    combinations with the schedule)."""
    return (s.gpus, s.pp, s.dp, s.tp, s.sp, s.cp, s.micro_batch, s.grad_accum, s.pp_schedule, s.virtual_stages)


def emitted_plans(model: str, gpus: int, per_node: int, workload: dict):
    """(description, Plan) for every strategy of every module the candidate generator emits, each paired with a
    partner of the other module; with pipeline parallelism searched."""
    problem = make_problem(model, ClusterInputs(gpus=gpus, gpus_per_node=per_node, profile=None),
                           workload=WorkloadInputs(**workload))
    names = problem.model.module_names
    for placement in ("colocated", "disjoint"):
        by_module = {}
        for module in names:
            strategies = [s for size in group_sizes(problem, module, placement)
                          for series, _ in [module_strategies(problem, module, size, {}, {})]
                          for s in itertools.chain.from_iterable(series)]
            by_module[module] = list({runtime_key(s): s for s in strategies}.values())
        for module, other in (names, names[::-1]):
            for strategy in by_module[module]:
                partner = next((p for p in by_module[other] if p.grad_accum == strategy.grad_accum
                                and (placement == "colocated" or p.gpus + strategy.gpus == gpus)), None)
                if partner is None:
                    continue
                modules = {module: strategy, other: partner}
                whole = Strategy(placement=placement, modules={m: modules[m] for m in names})
                plan = build_plan(problem, whole, status="EVALUATED", num_candidates=1, reference={})
                yield f"{model} {placement} {module} {strategy.describe()}", plan


def test_runtime_builds_every_catalog_family():
    """... every one of them: the planner prices no family the runtime cannot run."""
    assert set(RUNTIME_MODELS) == {name for name, *_ in list_models()}


@pytest.fixture
def config_built_once(monkeypatch):
    """``validate_plan`` builds the transformers config of the plan's model each call (two thirds of its time);
    the emitted plans of one model share it, so it is built once per model here (it is only read)."""
    from runtime.launch import driver

    built = {}

    def once(hf_config: dict):
        key = json.dumps(hf_config, sort_keys=True)
        if key not in built:
            built[key] = hf_config_from_dict(hf_config)
        return built[key]

    monkeypatch.setattr(driver, "hf_config_from_dict", once)


@pytest.mark.slow
@pytest.mark.parametrize("model", RUNTIME_MODELS)
def test_runtime_accepts_every_emitted_strategy(model, config_built_once):
    refused, checked = [], 0
    workloads = audio_workloads(model) if get_model(model).audio_input is not None else WORKLOADS
    for (gpus, per_node), workload in itertools.product(CLUSTERS, workloads.values()):
        for what, emitted in emitted_plans(model, gpus, per_node, workload):
            checked += 1
            try:
                validate_plan(emitted, RunOptions())
            except (ValueError, NotImplementedError) as e:
                refused.append(f"{what} on {gpus} GPUs {workload}: {e}")
    assert checked > 0
    assert not refused, f"{len(refused)} of {checked} emitted plans refused, e.g. {refused[:3]}"


def test_audio_beyond_whole_clips_is_refused_in_one_line():
    """The runtime trains Qwen2-Audio on whole 30 s clips (one encoder pass each, as the planner prices them); 45 s
    per sample is refused before any work, saying what to plan instead."""
    with pytest.raises(ValueError, match=r"^the runtime trains on whole 30 s clips \(one encoder pass each\); the "
                                         r"plan has 45 s of audio per sample: plan with a multiple of 30 s$"):
        validate_plan(plan("qwen2-audio-7b", NO_PROFILE_8, workload=WorkloadInputs(audio_seconds=45)), RunOptions())


def test_audio_data_and_dry_run_are_refused_in_one_line(tmp_path):
    """The runtime reads no audio files and the dry-run measures vision-language plans: an audio plan says so
    before any work."""
    from runtime.dry_run import dry_run

    audio = plan("qwen2-audio-7b", NO_PROFILE_8)
    (tmp_path / "d.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match=r"^--data .*d\.jsonl: the runtime reads no audio data yet; an audio plan "
                                         r"trains on synthetic samples \(leave out --data\)$"):
        validate_plan(audio, RunOptions(data=str(tmp_path / "d.jsonl")))
    with pytest.raises(NotImplementedError, match=r"^--dry-run measures vision-language plans; qwen2-audio-7b has "
                                                  r"an audio encoder: run it for real \(python -m runtime\)$"):
        dry_run(audio, RunOptions())


def test_decoder_only_model_is_refused_in_one_line():
    """The planner plans a decoder-only config.json (for published text-model runs, issue 32); the runtime trains
    vision-language models and says so before any work."""
    from planner.contract.families import model_from_hf_config

    llama = model_from_hf_config(dict(model_type="llama", vocab_size=1000, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=4), "tiny-llama")
    with pytest.raises(NotImplementedError, match=r"^the runtime runs plans with one encoder \(vision or audio\) and "
                                                  r"an llm, this one has \['llm'\]$"):
        validate_plan(plan(llama, ClusterInputs(gpus=2, gpu="cpu", profile=None)), RunOptions())


DRY_RUN_SAMPLE = 2
"""Emitted plans (seeded draw) whose first rank the dry-run builds and steps, beside the named one below."""


def shallow(plan):
    """``plan`` with its model cut to one decoder layer per pipeline chunk and two vision blocks: every width,
    head count and degree as emitted (what decides whether the runtime can shard it), a fraction of the fake
    dispatch."""
    llm = plan.module("llm")
    chunks = llm.pp * llm.virtual_stages
    config = json.loads(json.dumps(plan.model.hf_config))
    text = config.get("text_config", config)
    text["num_hidden_layers"] = config["num_hidden_layers"] = chunks
    vision = config["vision_config"]
    vision["depth"] = 2
    if "fullatt_block_indexes" in vision:
        vision["fullatt_block_indexes"] = [1]
    modules = [m.model_copy(update={"pp_layers": [1] * chunks}) if m.name == "llm" and m.pp > 1 else m
               for m in plan.modules]
    return plan.model_copy(update={"model": plan.model.model_copy(update={"hf_config": config}), "modules": modules})


@pytest.mark.slow
def test_a_sample_of_emitted_plans_builds_under_the_dry_run():
    """Role builds of emitted plans at their full widths (one layer per pipeline chunk): the plan a new user found
    refused (LLM TP8 over Qwen2.5-VL-3B's 2 KV heads) and a seeded draw of short-sequence plans (a draw found
    vision TP8 over Qwen2.5-VL-7B's 3,420-wide vision MLP, now refused by both halves)."""
    from runtime.dry_run.measure import measure_role

    short = WORKLOADS["short"]
    tp8 = next(emitted for _, emitted in emitted_plans("qwen2.5-vl-3b", 8, 8, short)
               if emitted.module("llm").tp == 8 and emitted.placement == "colocated")
    drawn = random.Random(0).sample(list(emitted_plans("qwen2.5-vl-7b", 8, 8, short)), DRY_RUN_SAMPLE)
    for sample in [tp8, *(sample for _, sample in drawn)]:
        role = measure_role(shallow(sample), 0, RunOptions())
        assert role.peak.get("Total", 0) > 0
