"""Start-up proportional to the shard: every plan materialises only its shards, and the full weights they make
up are exactly the single-process model's (random init) or the checkpoint's (loading); a checkpoint saved from
one plan's shards loads exactly under another.

Ranks are plain processes (tests.runtime.ranks); each builds a Trainer, as a Ray actor would.
"""

from __future__ import annotations

import pytest
import torch

from runtime.models.model import build_model, meta_model
from safetensors.torch import load_file, save_file

from tests.runtime.plans import (QWEN3_IMAGE_SIZE, make_plan, tiny_hf_config, tiny_qwen2_audio_config,
                                 tiny_qwen3_vl_config, tiny_qwen3_vl_moe_config)
from tests.runtime.sharding_checks import EXPERTS
from tests.runtime.ranks import SEED, measure_startup, run_scenarios, spawn


def merged(results: list[dict], key: tuple) -> tuple[dict, dict]:
    """One scenario's tensors from every rank (each module's first rank returns its parameters)."""
    params, buffers = {}, {}
    for result in results:
        params.update(result[key][0])
        buffers.update(result[key][1])
    return params, buffers


def tied_config() -> dict:
    return {**tiny_hf_config(), "tie_word_embeddings": True}


SPECS = {
    2: {
        "zero3_dp2": dict(vision=dict(dp=2, zero=3), llm=dict(dp=2, zero=3)),
        "uniform_tp2": dict(vision=dict(tp=2), llm=dict(tp=2)),
        "vision_sp2_zero2__llm_tp2": dict(vision=dict(sp=2, zero=2), llm=dict(tp=2)),
        "disjoint_1_1": dict(vision=dict(), llm=dict(), placement="disjoint"),
        "llm_pp2__vision_dp2": dict(vision=dict(dp=2, grad_accum=2),
                                    llm=dict(pp=2, pp_layers=[3, 1], micro_batch=2, grad_accum=2)),
        # Qwen3-VL: DeepStack mergers, the position table, q/k norms (replicated over TP)
        "qwen3_vl_uniform_tp2": dict(vision=dict(tp=2), llm=dict(tp=2), qwen3=True),
        "qwen3_vl_zero3_dp2": dict(vision=dict(dp=2, zero=3), llm=dict(dp=2, zero=3), qwen3=True),
        # Qwen2-Audio: the encoder's blocks split over TP, the projector replicated; "vision" is the audio encoder
        "qwen2_audio_uniform_tp2": dict(vision=dict(tp=2), llm=dict(tp=2), audio=True),
        "qwen2_audio_zero3_dp2": dict(vision=dict(dp=2, zero=3), llm=dict(dp=2, zero=3), audio=True),
    },
    4: {
        "vision_dp2xtp2_zero3__llm_tp2xdp2_zero3": dict(
            vision=dict(dp=2, tp=2, zero=3), llm=dict(dp=2, tp=2, zero=3)
        ),
        "vision_tp4__llm_tp2xsp2_zero1": dict(
            vision=dict(tp=4, micro_batch=2), llm=dict(tp=2, sp=2, micro_batch=2, zero=1)
        ),
        # Qwen3-VL-MoE: experts split over EP groups of 2 (and ZeRO-3 over the 2 holding each), or over 2 x TP2
        "qwen3_vl_moe_ep2_dp4_zero3": dict(vision=dict(dp=4, zero=3), llm=dict(dp=4, ep=2, zero=3), moe=True),
        "qwen3_vl_moe_ep2_tp2_zero1": dict(vision=dict(dp=2, tp=2), llm=dict(dp=2, tp=2, ep=2, zero=1), moe=True),
    },
}
"""Plans per world size: TP, SP, DP, ZeRO 1-3, FSDP x TP, PP, colocated and disjoint."""

ROUND_TRIPS = {
    2: {"uniform_tp2": "zero3_dp2", "zero3_dp2": "llm_pp2__vision_dp2", "llm_pp2__vision_dp2": "uniform_tp2",
        "qwen3_vl_uniform_tp2": "qwen3_vl_zero3_dp2", "qwen2_audio_uniform_tp2": "qwen2_audio_zero3_dp2"},
    4: {"vision_dp2xtp2_zero3__llm_tp2xdp2_zero3": "vision_tp4__llm_tp2xsp2_zero1",
        "qwen3_vl_moe_ep2_dp4_zero3": "qwen3_vl_moe_ep2_tp2_zero1"},
}
"""Saving plan -> loading plan."""


def write_hub_checkpoint(model: torch.nn.Module, path) -> None:
    """``model`` as the Hub serves it: bf16, sharded into several files with an index."""
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size="200KB")
    assert len(list(path.glob("model-*-of-*.safetensors"))) >= 2


def moe_config() -> dict:
    """The tiny Qwen3-VL-MoE with experts narrower than the model (gate_up_proj 64 x 128, not square), so that the
    Hub's transposed expert layout is told apart by its shape (as transformers tells it)."""
    config = tiny_qwen3_vl_moe_config()
    config["text_config"]["moe_intermediate_size"] = 32
    return config


def write_hub_moe_checkpoint(model: torch.nn.Module, path) -> None:
    """``write_hub_checkpoint`` with the fused experts as the Hub's Qwen3-VL-MoE files hold them: ``gate_up_proj``
    [E, hidden, 2 f] and ``down_proj`` [E, f, hidden] (transformers 4.57's layout; transformers 5 transposes them
    on load, ``conversion_mapping``)."""
    write_hub_checkpoint(model, path)
    for file in path.glob("model-*-of-*.safetensors"):
        tensors = load_file(file)
        save_file({name: t.transpose(1, 2).contiguous() if EXPERTS.search(name) else t for name, t in tensors.items()},
                  file, metadata={"format": "pt"})


@pytest.fixture(scope="module", params=[2, 4], ids=["2_ranks", "4_ranks"])
def scenarios(request, tmp_path_factory):
    """Every scenario on ``world`` spawned ranks (one spawn per world size: starting a process costs seconds)."""
    world = request.param
    tied = request.param == 4  # the 4-rank plans run the tied-embedding model (as Qwen2.5-VL-3B has)
    root = tmp_path_factory.mktemp(f"world{world}")
    families = {"qwen2_5_vl": tied_config() if tied else tiny_hf_config(), "qwen3_vl": tiny_qwen3_vl_config(),
                "qwen2_audio": tiny_qwen2_audio_config(), "qwen3_vl_moe": moe_config()}
    for family, config in families.items():
        write = write_hub_moe_checkpoint if family == "qwen3_vl_moe" else write_hub_checkpoint
        write(build_model(config, seed=11), root / family)
    plans, hubs = {}, {}
    for name, spec in SPECS[world].items():
        spec = dict(spec)
        family = ("qwen3_vl" if spec.pop("qwen3", False) else "qwen2_audio" if spec.pop("audio", False)
                  else "qwen3_vl_moe" if spec.pop("moe", False) else "qwen2_5_vl")
        size = {"qwen3_vl": dict(image_size=QWEN3_IMAGE_SIZE), "qwen2_audio": dict(audio_seconds=2.0, text_tokens=12),
                "qwen3_vl_moe": dict(image_size=QWEN3_IMAGE_SIZE), "qwen2_5_vl": {}}[family]
        plans[name] = make_plan(dict(spec.pop("vision")), dict(spec.pop("llm")), hf_config=families[family],
                                **size, **spec)
        hubs[name] = str(root / family)
    results = spawn(world, run_scenarios, plans, hubs, ROUND_TRIPS[world], str(root / "saved"))
    return dict(world=world, plans=plans, hubs=hubs, root=root, results=results)


def _from_pretrained(path) -> dict:
    from transformers import AutoConfig

    from runtime.models.model import MODEL_CLASSES

    model = MODEL_CLASSES[AutoConfig.from_pretrained(path).model_type].from_pretrained(path, dtype=torch.float32)
    return {name: p.detach() for name, p in model.named_parameters()}


def assert_same(got: dict, expected: dict, what: str) -> None:
    assert set(got) == set(expected), f"{what}: parameter names differ"
    for name, value in got.items():
        assert torch.equal(value, expected[name]), f"{what}: {name}"


@pytest.mark.slow
def test_sharded_random_init_equals_the_single_process_model(scenarios):
    for name, plan in scenarios["plans"].items():
        reference = build_model(plan.model.hf_config, seed=SEED)
        expected = {key: p.detach() for key, p in reference.named_parameters()}
        params, buffers = merged(scenarios["results"], ("init", name))
        assert_same(params, expected, name)
        for key, value in reference.named_buffers():
            assert torch.equal(buffers[key], value), f"{name}: buffer {key}"


@pytest.mark.slow
def test_sharded_loading_equals_from_pretrained(scenarios):
    for name, hub in scenarios["hubs"].items():
        assert_same(merged(scenarios["results"], ("load", name))[0], _from_pretrained(hub), name)


@pytest.mark.slow
def test_save_then_load_through_another_plan_is_exact(scenarios):
    for saving, loading in ROUND_TRIPS[scenarios["world"]].items():
        saved = merged(scenarios["results"], ("saved", saving))[0]
        assert_same(merged(scenarios["results"], ("reloaded", saving))[0], saved, f"{saving} -> {loading}")
        assert_same(_from_pretrained(scenarios["root"] / "saved" / saving), saved, f"{saving} -> from_pretrained")


def memory_config() -> dict:
    """Qwen2.5-VL-3B's structure (its widths, heads, tied embedding) with 4 vision blocks, 3 decoder layers and a
    32,768-token vocabulary (special token ids moved inside it): 0.41 B parameters, 1.66 GB in fp32, so that the
    full model outweighs a rank's share plus its largest tensor (the 32,768 x 2,048 embedding, 0.27 GB) by more
    than the slack on 2 ranks too."""
    from planner.catalog import get_model

    config = dict(get_model("qwen2.5-vl-3b").hf_config)
    special = ("bos_token_id", "eos_token_id", "vision_start_token_id", "vision_end_token_id", "vision_token_id",
               "image_token_id", "video_token_id")
    config.update({key: 32_000 + i for i, key in enumerate(special)}, vocab_size=32_768, num_hidden_layers=3)
    config["vision_config"] = {**config["vision_config"], "depth": 4, "fullatt_block_indexes": [3]}
    return config


RSS_SLACK_BYTES = 256 << 20
"""What a rank holds at start-up beyond its shards and one full tensor: process groups and their buffers, the
meta models' Python objects, the synthetic samples, allocator rounding. Observed on 2 ranks: random init grows
0.90 GiB and loading 0.82 GiB, against a 1.27 GiB bound (the whole model is 1.55 GiB)."""

MEMORY_PLANS = {
    2: ("zero3_dp2", dict(dp=2, zero=3), dict(dp=2, zero=3)),
    # the LLM's 2 KV heads allow TP2 at most: 4-way TP-sharded as TP2 x ZeRO-3 DP2
    4: ("vision_tp4__llm_tp2xzero3_dp2", dict(tp=4, micro_batch=2), dict(tp=2, dp=2, zero=3)),
}
"""Per world size, the plan that starts from random init and saves; the loading plan is the other world's
kind (TP2 on 2 ranks, ZeRO-3 DP4 on 4): ZeRO-3 and TP each start up and load once on 2 and on 4 ranks."""
LOADING_PLANS = {2: ("uniform_tp2", dict(tp=2), dict(tp=2)), 4: ("zero3_dp4", dict(dp=4, zero=3), dict(dp=4, zero=3))}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_startup_and_loading_memory_is_proportional_to_the_shard(world, tmp_path):
    """Peak RSS growth of each rank while it builds its Trainer (random init; loading a bf16 Hub-format
    checkpoint) stays below full fp32 model / ranks + the largest full tensor (drawn whole once) + slack; a rank
    that materialised the whole model (3.3 GiB) would exceed it."""
    config = memory_config()
    params = list(meta_model(config).parameters())
    full, largest = sum(p.numel() for p in params) * 4, max(p.numel() for p in params) * 4
    bound = full // world + largest + RSS_SLACK_BYTES
    assert bound < full, "the bound must catch a rank holding the whole model"
    (init_name, *init), (load_name, *load) = MEMORY_PLANS[world], LOADING_PLANS[world]
    plans = [make_plan(dict(v), dict(l), hf_config=config) for v, l in (init, load)]
    results = spawn(world, measure_startup, *plans, str(tmp_path / "checkpoint"))
    print(f"\n{world} ranks: full fp32 {full / 2**30:.2f} GiB, /ranks {full / world / 2**30:.2f} GiB, "
          f"bound {bound / 2**30:.2f} GiB; baseline RSS {[round(r['baseline'] / 2**30, 2) for r in results]} GiB")
    for phase, name in (("init", init_name), ("save", init_name), ("load", load_name)):
        peaks = [round(r[phase]["peak_growth"] / 2**30, 2) for r in results]
        print(f"  {phase} {name}: peak growth per rank {peaks} GiB, {max(r[phase]['seconds'] for r in results):.1f} s")
    for rank, result in enumerate(results):
        for phase in ("init", "load"):
            grown = result[phase]["peak_growth"]
            assert grown <= bound, f"rank {rank} {phase}: grew {grown / 2**30:.2f} GiB > {bound / 2**30:.2f} GiB"
