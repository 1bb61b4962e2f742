"""Runtime pieces that need no Ray: window and sequence splits, qkv layout, rank grid, hand-off routes, data
layout, vision forward, checks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from runtime.data.samples import IGNORE_INDEX, CaptionData, SyntheticData, collate, token_sequence
from runtime.models.handoff import llm_needs
from runtime.launch.launcher import check_resources, validate_plan
from runtime.models.model import build_model
from runtime.training.optim import warmup_factor
from runtime.parallel import attention
from runtime.parallel.tensor_parallel import qkv_row_order, qkv_to_tp_layout
from runtime.models.llm import image_slots_per_rank, next_token_targets, sequence_positions
from runtime.models.linear_attention import linear_qkv_row_order
from runtime.parallel.ring import segment_causal_mask, zigzag_positions
from runtime.parallel.ulysses import kv_repeats, split_sequence, split_windows
from runtime.parallel.parallel_dims import ParallelDims
from runtime.training.trainer import RunOptions
from runtime.models.families import FAMILIES
from runtime.models.vision import shard_vision_batch
from tests.runtime.plans import (QWEN3_IMAGE_SIZE, make_plan, sample_layout, tiny_hf_config,
                                 tiny_qwen3_vl_config, tiny_qwen3_vl_moe_config)


@pytest.fixture(scope="module")
def tiny_model():
    return build_model(tiny_hf_config(), seed=0)


@pytest.fixture(scope="module")
def layout(tiny_model):
    return sample_layout(make_plan({}, {}).workload, tiny_model.config)


def test_split_windows_cuts_on_window_boundaries_near_equal():
    assert split_windows([0, 64, 96, 160, 192], 2) == [0, 96, 192]
    assert split_windows([0, 64, 96, 160, 192], 4) == [0, 64, 96, 160, 192]
    assert split_windows([0, 64, 96], 2) == [0, 64, 96]  # uneven: windows are never cut


def test_split_windows_refuses_more_ranks_than_windows():
    with pytest.raises(ValueError, match="2 attention windows"):
        split_windows([0, 64, 96], 3)


def test_split_sequence_near_equal_contiguous():
    assert split_sequence(33, 2) == [0, 17, 33]
    assert split_sequence(10, 4) == [0, 3, 6, 8, 10]
    with pytest.raises(ValueError, match="sp=4 but a sequence has only 3 tokens"):
        split_sequence(3, 4)


@pytest.mark.parametrize("q_heads, kv_heads, sp", [(4, 1, 2), (2, 1, 2), (8, 2, 4), (6, 3, 2), (4, 2, 2), (4, 4, 4)])
def test_repeated_kv_heads_split_over_sp_ranks_give_exact_gqa(q_heads, kv_heads, sp):
    torch.manual_seed(0)
    q, k, v = torch.randn(2, q_heads, 5, 4), torch.randn(2, kv_heads, 5, 4), torch.randn(2, kv_heads, 5, 4)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    expected = sdpa(q, k, v, is_causal=True, enable_gqa=True)
    repeats = kv_repeats(kv_heads, sp)
    k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    assert k.shape[1] % sp == 0
    parts = [sdpa(qj, kj, vj, is_causal=True, enable_gqa=True)
             for qj, kj, vj in zip(q.chunk(sp, dim=1), k.chunk(sp, dim=1), v.chunk(sp, dim=1))]
    torch.testing.assert_close(torch.cat(parts, dim=1), expected, rtol=0, atol=0)


def test_llm_slices_hold_their_image_tokens_and_next_token_targets(layout):
    ids = token_sequence([], layout)["input_ids"]  # <start> 24 x <image> <end> then text: 64 tokens
    row = (len(ids), (ids == layout.image_token_id).nonzero().flatten())
    slots = image_slots_per_rank([row], 4)  # slices of 16 tokens
    assert [s.tolist() for s in slots] == [list(range(15)), list(range(15, 24)), [], []]
    two = image_slots_per_rank([row, row], 4)  # each row split alike; the second row's tokens follow the first's
    assert [s.tolist() for s in two] == [list(range(15)) + list(range(24, 39)),
                                         list(range(15, 24)) + list(range(39, 48)), [], []]
    labels = torch.tensor([[5, 6, IGNORE_INDEX, 7]])
    assert next_token_targets(labels).tolist() == [[6, IGNORE_INDEX, 7, IGNORE_INDEX]]


def test_ring_layout_gives_each_cp_rank_a_head_and_a_tail_chunk_then_splits_it_over_sp():
    assert [p.tolist() for p in zigzag_positions(10, 2)] == [[0, 1, 2, 9, 10, 11], [3, 4, 5, 6, 7, 8]]  # padded: 12
    per_rank = sequence_positions(10, sp=2, cp=2)  # rank c * sp + j
    assert [p.tolist() for p in per_rank] == [[0, 1, 2], [9, 10, 11], [3, 4, 5], [6, 7, 8]]
    assert [p.tolist() for p in sequence_positions(5, sp=2)] == [[0, 1, 2], [3, 4]]  # no CP: split_sequence's


def test_a_packed_rows_ring_mask_keeps_each_position_to_its_own_sample_and_its_past():
    positions = zigzag_positions(6, 2)  # chunks of 2 (8 padded): rank 0 holds 0, 1, 6, 7; rank 1 holds 2-5
    segment_of = torch.tensor([0, 0, 0, 1, 1, 1, 2, 3])  # samples of 3 and 3 tokens, then the 2 pads
    mask = segment_causal_mask(positions, segment_of, rank=1)  # rank 1's 2, 3, 4, 5 over 0, 1, 6, 7, 2, 3, 4, 5
    assert mask.int().tolist() == [[1, 1, 0, 0, 1, 0, 0, 0],  # 2 sees 0, 1, 2
                                   [0, 0, 0, 0, 0, 1, 0, 0],  # 3 starts sample 1: itself only
                                   [0, 0, 0, 0, 0, 1, 1, 0],
                                   [0, 0, 0, 0, 0, 1, 1, 1]]


def test_ring_slices_hold_their_image_tokens_in_local_order(layout):
    ids = token_sequence([], layout)["input_ids"]  # <start> 24 x <image> <end> then text: 64 tokens
    row = (len(ids), (ids == layout.image_token_id).nonzero().flatten())
    slots = image_slots_per_rank([row], sp=1, cp=2)  # CP rank 0: chunks 0 and 3 (16 + 16 tokens), rank 1: 1 and 2
    assert [s.tolist() for s in slots] == [list(range(15)), list(range(15, 24))]
    slots = image_slots_per_rank([row], sp=1, cp=4)  # chunks of 8: rank 0 takes 0 and 7, rank 1 takes 1 and 6, ...
    assert [s.tolist() for s in slots] == [list(range(7)), list(range(7, 15)), list(range(15, 23)), [23]]


def test_llm_needs_are_each_ranks_slots_after_its_replicas_offset():
    llm = ParallelDims(name="llm", ranks=(0, 1, 2, 3), dp=2, cp=1, sp=2, tp=1, zero=0, recompute="none",
                       micro_batch=2, grad_accum=1)
    slots = [[torch.tensor([0, 1, 2, 4, 5, 6]), torch.tensor([3, 7])],  # replica 0: 8 image tokens
             [torch.tensor([0, 1]), torch.tensor([2, 3, 4])]]  # replica 1: 5
    needs = llm_needs(llm, slots, offsets=[0, 8])
    assert needs[0].tolist() == [0, 1, 2, 4, 5, 6]  # dp 0, sp 0
    assert needs[1].tolist() == [3, 7]
    assert needs[3].tolist() == [10, 11, 12]  # dp 1, sp 1
    assert sorted(torch.cat(list(needs.values())).tolist()) == list(range(13))  # every token exactly once


def test_qkv_tp_layout_gives_each_rank_its_own_q_k_v_heads():
    heads, head_dim, tp = 4, 2, 2
    rows = torch.arange(3 * heads * head_dim)  # row r belongs to (which = r // 8, head = r % 8 // 2)
    shards = qkv_to_tp_layout(rows, tp).chunk(tp)
    for rank, shard in enumerate(shards):
        which, head = shard // (heads * head_dim), shard % (heads * head_dim) // head_dim
        assert which.tolist() == [0] * 4 + [1] * 4 + [2] * 4
        assert set(head.tolist()) == {2 * rank, 2 * rank + 1}
    assert torch.equal(qkv_to_tp_layout(rows, tp), rows[qkv_row_order(len(rows), tp)])  # stored row i: HF row order[i]


def test_linear_attention_tp_layout_gives_each_rank_its_own_query_key_and_value_heads():
    key_dim, value_dim, tp = 4, 8, 2  # 2 key heads of width 2, 4 value heads of width 2
    order = linear_qkv_row_order(key_dim, value_dim, tp)
    assert order.tolist() == [0, 1, 4, 5, 8, 9, 10, 11,  # rank 0: query head 0, key head 0, value heads 0-1
                              2, 3, 6, 7, 12, 13, 14, 15]  # rank 1: query head 1, key head 1, value heads 2-3


def _dims(**kw) -> ParallelDims:
    base = dict(name="vision", ranks=tuple(range(8)), dp=2, cp=1, sp=2, tp=2, zero=0, recompute="none",
                micro_batch=1, grad_accum=1)
    return ParallelDims(**{**base, **kw})


def test_parallel_dims_grid_is_dp_cp_sp_tp_with_tp_innermost():
    dims = _dims()
    assert dims.coordinate(0) == {"pp": 0, "dp": 0, "cp": 0, "sp": 0, "tp": 0}
    assert dims.coordinate(1) == {"pp": 0, "dp": 0, "cp": 0, "sp": 0, "tp": 1}
    assert dims.coordinate(2) == {"pp": 0, "dp": 0, "cp": 0, "sp": 1, "tp": 0}
    assert dims.coordinate(5) == {"pp": 0, "dp": 1, "cp": 0, "sp": 0, "tp": 1}
    assert dims.ranks_where(dp=1, sp=1) == [6, 7]
    assert dims.batch_degree == 4


def test_pipeline_stages_are_the_outermost_blocks_of_ranks():
    dims = _dims(name="llm", dp=1, sp=1, pp=4, pp_layers=(1, 1, 1, 1))
    assert [dims.stage_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert dims.coordinate(5) == {"pp": 2, "dp": 0, "cp": 0, "sp": 0, "tp": 1}
    first = dims.stage_view(0)
    assert first.ranks == (0, 1) and first.pp == 1 and first.coordinate(1)["tp"] == 1


def test_parallel_dims_validation():
    with pytest.raises(ValueError, match="4 ranks"):
        _dims(ranks=(0, 1, 2, 3))
    with pytest.raises(NotImplementedError, match="context parallelism .* LLM and the vision tower only"):
        _dims(name="audio", sp=1, cp=2)
    _dims(sp=1, cp=2)  # the vision tower's gathered form runs
    _dims(name="llm")  # LLM sequence parallelism runs
    _dims(name="llm", sp=1, cp=2)  # and ring context parallelism


def test_synthetic_sample_matches_the_planned_layout(layout):
    sample = SyntheticData(layout, seed=0).sample(3)
    num_image_tokens = (112 // 14) * (168 // 14) // 4
    assert sample["pixel_values"].shape == (num_image_tokens * 4, 3 * 2 * 14 * 14)
    assert sample["image_grid_thw"].tolist() == [[1, 8, 12]]
    assert sample["input_ids"].shape == (layout.seq_len,) == (40 + num_image_tokens,)
    image = sample["input_ids"] == layout.image_token_id
    assert int(image.sum()) == num_image_tokens
    assert torch.equal(sample["mm_token_type_ids"].bool(), image)
    assert (sample["labels"][image] == IGNORE_INDEX).all()
    assert (sample["labels"][~image][2:] == sample["input_ids"][~image][2:]).all()


def test_synthetic_samples_are_fixed_by_seed_and_index(layout):
    a, b = SyntheticData(layout, seed=0), SyntheticData(layout, seed=0)
    assert torch.equal(a.sample(5)["pixel_values"], b.sample(5)["pixel_values"])
    assert not torch.equal(a.sample(5)["input_ids"], a.sample(6)["input_ids"])


def test_synthetic_batch_trains_the_hf_model(tiny_model, layout):
    data = SyntheticData(layout, seed=0)
    loss = tiny_model(**collate([data.sample(0), data.sample(1)])).loss
    assert 5.0 < float(loss.detach()) < 9.0  # ~ln(1024) for a random init


def _write_image(path, rng):
    Image.fromarray(rng.integers(0, 256, (50, 70, 3), dtype=np.uint8)).save(path)


def test_caption_data_from_jsonl_and_folder(tmp_path, layout):
    rng = np.random.default_rng(0)
    _write_image(tmp_path / "a.png", rng)
    (tmp_path / "a.txt").write_text("a cat")
    (tmp_path / "data.jsonl").write_text(json.dumps({"image": "a.png", "text": "a cat"}) + "\n")
    from_jsonl = CaptionData(tmp_path / "data.jsonl", layout).sample(0)
    from_folder = CaptionData(tmp_path, layout).sample(7)  # indices wrap around
    for key in from_jsonl:
        assert torch.equal(from_jsonl[key], from_folder[key]), key
    assert from_jsonl["pixel_values"].shape[0] == layout.num_patches
    text = from_jsonl["labels"][from_jsonl["labels"] != IGNORE_INDEX]
    assert bytes(text[2:].tolist()) == b"a cat"  # after the vision start / end markers


def test_caption_data_bad_input(tmp_path, layout):
    (tmp_path / "bad.jsonl").write_text('{"img": "x"}\n')
    with pytest.raises(ValueError, match="line 1"):
        CaptionData(tmp_path / "bad.jsonl", layout)
    with pytest.raises(ValueError, match="does not exist"):
        CaptionData(tmp_path / "missing", layout)


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"])
def test_vision_forward_on_whole_sequence_equals_hf_tower(model_type, layout):
    """The family's vision forward on one rank gives the HF tower's output bit for bit: the merged tokens, and for
    Qwen3-VL each DeepStack feature after them in the row."""
    config = {"qwen2_5_vl": tiny_hf_config, "qwen2_vl": tiny_qwen2_vl_config,
              "qwen3_vl": tiny_qwen3_vl_config}[model_type]()
    reference = build_model(config, seed=0)
    model = build_model(config, seed=0, attention=attention.register())
    if model_type == "qwen3_vl":
        layout = sample_layout(make_plan({}, {}, hf_config=config, image_size=QWEN3_IMAGE_SIZE).workload,
                                  model.config)
    batch = collate([SyntheticData(layout, seed=0).sample(i) for i in range(2)])
    out = reference.model.visual(batch["pixel_values"], grid_thw=batch["image_grid_thw"])
    expected = torch.cat([out.pooler_output, *(getattr(out, "deepstack_features", None) or [])], dim=-1)
    family, vision_config = FAMILIES[model_type], model.config.vision_config
    hooks = family.encoder.hooks
    shard = shard_vision_batch(batch["pixel_values"], batch["image_grid_thw"], vision_config, sp_rank=0,
                               sp_group=None, sp=1,
                               patch_inputs=hooks.patch_inputs(batch["image_grid_thw"], vision_config))
    rows = hooks.forward(model.model.visual, shard)
    assert rows.shape[-1] == 128 * family.handoff_tensors(model.config)
    got = torch.empty_like(rows)
    got[shard.merged_positions] = rows
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def tiny_qwen2_vl_config() -> dict:
    """A Qwen2-VL of the tiny model's size (no windows: every vision block attends over whole images)."""
    config = tiny_hf_config()
    config["model_type"] = "qwen2_vl"
    config["text_config"] = {**config["text_config"], "model_type": "qwen2_vl_text"}
    config["vision_config"] = {"model_type": "qwen2_vl", "depth": 2, "embed_dim": 64, "hidden_size": 128,
                               "num_heads": 4, "mlp_ratio": 2, "patch_size": 14, "spatial_merge_size": 2,
                               "temporal_patch_size": 2, "in_channels": 3}
    return config


def test_warmup_is_linear_then_flat():
    assert [warmup_factor(s, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_factor(0, 0) == 1.0


def test_check_resources_says_what_is_missing():
    plan = make_plan(dict(dp=2), dict(dp=2))
    with pytest.raises(ValueError, match=r"needs 2 CPU slots but the Ray cluster has 1 \(missing 1 CPU slots\)"):
        check_resources(plan, {"CPU": 1.0})
    check_resources(plan, {"CPU": 2.0})


@pytest.mark.parametrize(
    "vision, llm, placement, message",
    [
        (dict(tp=8), dict(tp=8), "colocated", "tp=8 does not divide the 4 attention heads of the vision tower"),
        (dict(dp=2), dict(dp=2, micro_batch=2), "colocated", "samples per micro-batch"),
        (dict(dp=2, frozen=True), dict(dp=2, frozen=True), "colocated", "frozen"),
        (dict(dp=2, ranks=[0, 1]), dict(dp=2, ranks=[0, 1]), "disjoint", "different ranks"),
        (dict(dp=3), dict(sp=3, micro_batch=3), "colocated", "sp=3 does not divide the 4 attention heads per TP rank of the LLM"),
        (dict(dp=2, attention="varlen"), dict(dp=2), "colocated",
         "module vision: attention varlen is torch's variable-length flash kernel, which needs CUDA; plan for a CPU "
         "with --attention sdpa"),
        (dict(dp=2), dict(dp=2, linear_attention="fla"), "colocated",
         "module llm: linear_attention fla is flash-linear-attention's CUDA kernel; plan for a CPU with "
         "--linear-attention torch"),
    ],
)
def test_validate_plan_refuses_in_one_line(vision, llm, placement, message):
    plan = make_plan(vision, llm, placement=placement)
    with pytest.raises(ValueError, match=message) as info:
        validate_plan(plan, RunOptions())
    assert "\n" not in str(info.value)


def test_validate_plan_refuses_more_sp_ranks_than_windows():
    plan = make_plan(dict(sp=2), dict(tp=2), image_size=(112, 112))  # 8x8 patches: a single window
    with pytest.raises(ValueError, match=r"sp=2 but a micro-batch has only 1 attention windows"):
        validate_plan(plan, RunOptions())


@pytest.mark.parametrize(("config", "size", "white"), [
    (tiny_hf_config, (112, 112), (1 - 0.48145466) / 0.26862954),  # Qwen2.5-VL's processor: CLIP's mean and std
    (tiny_qwen3_vl_config, (128, 128), 1.0),  # Qwen3-VL's: (1 - 0.5) / 0.5
])
def test_images_are_normalised_as_the_familys_checkpoints_expect(config, size, white):
    """A white image's red channel after the processor the runtime builds for the family's layout."""
    from PIL import Image

    from runtime.models.model import hf_config_from_dict

    hf = hf_config_from_dict(config())
    layout = sample_layout(make_plan({}, {}, hf_config=config(), image_size=size).workload, hf)
    pixels = SyntheticData(layout, seed=0).processor(images=[Image.new("RGB", size[::-1], "white")],
                                                      return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(pixels[:, 0], torch.full_like(pixels[:, 0], white))


def test_a_video_plan_lays_out_what_the_planner_counted_and_refuses_image_data(tmp_path):
    """A clip of 4 frames of 64 x 96 beside the image: 2 temporal groups of 4 x 6 patches (the planner's count), each
    group after its 7 timestamp tokens and between its own markers; caption or conversation data holds no clip."""
    from runtime.models.model import hf_config_from_dict
    from runtime.training.step_inputs import data_source

    plan = make_plan({}, {}, hf_config=tiny_qwen3_vl_config(), image_size=QWEN3_IMAGE_SIZE, videos=((4, 64, 96),))
    config = hf_config_from_dict(plan.model.hf_config)
    layout = sample_layout(plan.workload, config)
    assert layout.grids() == [(1, 8, 12), (2, 4, 6)] and layout.num_patches == plan.workload.module_tokens["vision"]
    assert layout.seq_len == plan.workload.module_tokens["llm"] == 40 + 24 + 2 * (7 + 1 + 6 + 1)
    ids = token_sequence([], layout)["input_ids"]
    assert int((ids == config.video_token_id).sum()) == 12
    with pytest.raises(ValueError, match="the plan's samples hold video clips of one fixed shape: .* with --dataset "
                                         "to train on its video rows"):
        data_source(plan, RunOptions(data=str(tmp_path / "captions.jsonl")), config)


def test_validate_plan_refuses_a_first_stage_the_deepstack_features_do_not_fit():
    """The tiny Qwen3-VL adds features after decoder layers 0 and 1: a first chunk of one layer cannot take them."""
    plan = make_plan(dict(dp=2, grad_accum=2), dict(pp=2, pp_layers=[1, 3], micro_batch=2, grad_accum=2),
                     hf_config=tiny_qwen3_vl_config(), image_size=QWEN3_IMAGE_SIZE)
    with pytest.raises(ValueError, match="first pipeline chunk holds 1 decoder layers, but the vision features are "
                                         "added after the first 2"):
        validate_plan(plan, RunOptions())


def _train_forward_backward(model, layout):
    batch = collate([SyntheticData(layout, seed=0).sample(i) for i in range(2)])
    model(**batch).loss.backward()


def test_selective_recompute_checkpoints_only_the_attention_core(monkeypatch, layout):
    from runtime.parallel import recompute

    calls = []
    real = attention.checkpoint
    monkeypatch.setattr(attention, "checkpoint", lambda fn, *a, **kw: calls.append(fn) or real(fn, *a, **kw))
    model = build_model(tiny_hf_config(), seed=0, attention=attention.register())
    recompute.apply_recompute(model.model.language_model, "selective")
    _train_forward_backward(model, layout)
    assert calls and all(fn is attention.sdpa_attention_forward for fn in calls)
    assert len(calls) == model.config.text_config.num_hidden_layers  # the LLM's layers only, not the vision tower


def test_full_recompute_checkpoints_every_block(layout):
    from runtime.parallel import recompute

    model = build_model(tiny_hf_config(), seed=0, attention=attention.register())
    recompute.apply_recompute(model.model.visual, "full")
    calls = []
    for block in model.model.visual.blocks:
        real = block._gradient_checkpointing_func
        block._gradient_checkpointing_func = lambda fn, *a, _real=real, **kw: calls.append(fn) or _real(fn, *a, **kw)
    _train_forward_backward(model, layout)
    assert len(calls) == len(model.model.visual.blocks)
    assert not any(layer.gradient_checkpointing for layer in model.model.language_model.layers)


def test_build_model_from_a_save_pretrained_folder(tmp_path):
    saved = build_model(tiny_hf_config(), seed=7)
    saved.save_pretrained(tmp_path)
    loaded = build_model(tiny_hf_config(), seed=0, checkpoint=str(tmp_path), attention=attention.register())
    assert loaded.config._attn_implementation == attention.ATTENTION
    expected = dict(saved.named_parameters())
    for name, param in loaded.named_parameters():
        assert torch.equal(param, expected[name]), name


def test_disjoint_schedule_is_the_one_the_cost_model_prices():
    # planner/cost/pipeline.py derives the disjoint step from this schedule: at most two encoder forwards ahead.
    from runtime.training.trainer import MAX_ENCODER_IN_FLIGHT

    assert MAX_ENCODER_IN_FLIGHT == 2


def test_under_autocast_the_llm_residual_stream_is_in_the_compute_dtype(tiny_model):
    """bf16 autocast over fp32 weights (a GPU module without FSDP): the decoder layers' inputs, which full
    recomputation saves, are bf16 as under FSDP2's bf16 parameters, not the fp32 of the embedding table."""
    from runtime.models.model import split_model

    _, llm, _ = split_model(tiny_model)
    ids = torch.randint(0, 100, (1, 12))
    seen = []
    handles = [layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0].dtype))
               for layer in llm.language_model.layers]
    positions = torch.arange(12).expand(3, 1, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        llm(ids, torch.zeros(0, tiny_model.config.text_config.hidden_size), positions)
    for handle in handles:
        handle.remove()
    assert seen == [torch.bfloat16] * len(llm.language_model.layers)


def test_under_autocast_a_norms_output_is_cast_once_for_every_linear_that_reads_it():
    """bf16 autocast over fp32 weights: q, k and v (and gate and up) save one bf16 copy of their normalised input
    between them, not one each: three copies of the hidden states fewer per decoder layer (runtime.parallel.precision
    ``cast_norm_outputs``; the dry-run measured +1.15 GiB per sample at 3B width without it)."""
    from runtime.models.model import split_model
    from runtime.parallel.precision import cast_norm_outputs, module_precision

    def saved_hidden_copies(llm) -> int:
        hidden = llm.language_model.config.hidden_size
        storages = set()

        def pack(tensor):
            if tensor.dtype == torch.bfloat16 and tensor.numel() == 12 * hidden:  # hidden states (of 12 tokens)
                storages.add(tensor.untyped_storage().data_ptr())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
                llm(torch.randint(0, 100, (1, 12)), torch.zeros(0, hidden), torch.arange(12).expand(3, 1, 12))
        return len(storages)

    plain = split_model(build_model(tiny_hf_config(), seed=0))[1]
    cast = split_model(build_model(tiny_hf_config(), seed=0))[1]
    cast_norm_outputs(cast, module_precision("bf16_mixed", "cuda", fsdp=False))
    assert saved_hidden_copies(plain) - saved_hidden_copies(cast) == 3 * len(cast.language_model.layers)


def test_the_llm_forward_keeps_no_kv_cache(tiny_model):
    """Training builds no KV cache (the config says use_cache=True; a cache would hold every layer's keys and
    values to the end of the forward, recomputed blocks included): every decoder layer is called without one."""
    from runtime.models.model import split_model

    _, llm, _ = split_model(tiny_model)
    calls = []
    handles = [layer.register_forward_pre_hook(lambda _m, _args, kwargs: calls.append(kwargs), with_kwargs=True)
               for layer in llm.language_model.layers]
    llm(torch.randint(0, 100, (1, 12)), torch.zeros(0, tiny_model.config.text_config.hidden_size),
        torch.arange(12).expand(3, 1, 12))
    for handle in handles:
        handle.remove()
    assert tiny_model.config.text_config.use_cache and len(calls) == len(llm.language_model.layers)
    assert all(c["use_cache"] is False and c.get("past_key_values") is None and c.get("cache") is None
               for c in calls)


def test_a_step_record_has_each_pipeline_stage_slowest_rank():
    """Per stage, the compute and idle time of its slowest rank (each of a stage's TP / DP ranks reports its own)."""
    from runtime.observability.metrics import step_record

    def result(rank, stage, compute, idle):
        return {"rank": rank, "loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "step_time_s": 1.0, "llm_tokens": 10,
                "peak_memory_bytes": 0, "pp_stage": stage, "pp_compute_s": compute, "pp_idle_s": idle}

    record = step_record(0, [result(0, 0, 0.5, 0.2), result(1, 0, 0.4, 0.3), result(2, 1, 0.7, 0.1),
                             result(3, 1, 0.6, 0.05)])
    assert record["pp_stages"] == [{"stage": 0, "compute_s": 0.5, "idle_s": 0.3},
                                   {"stage": 1, "compute_s": 0.7, "idle_s": 0.1}]
    plain = {k: v for k, v in result(0, 0, 0, 0).items() if not k.startswith("pp_")}
    assert "pp_stages" not in step_record(0, [plain])


@pytest.mark.parametrize("schedule,expected,weight_passes", [
    ("interleaved_1f1b", "ScheduleInterleaved1F1B", 0), ("interleaved_zb", "ScheduleInterleavedZeroBubble", 4)])
def test_plan_schedule_builds_torchs_schedule_and_times_every_compute_pass(schedule, expected, weight_passes):
    """On a fake process group: the plan's schedule is torch's; a zero-bubble one defers each chunk's weight
    gradients into actions of their own, which the compute timer wraps too."""
    import contextlib
    from types import SimpleNamespace

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from runtime.models.pipeline import MicroBatchShapes, build_schedule

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        dims = SimpleNamespace(mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("pp",)), pp=2,
                               pp_layers=(1, 1, 1, 1), grad_accum=2, pp_schedule=schedule, tp_enabled=False)
        chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
        for chunk, first in zip(chunks, (True, False)):
            chunk.first, chunk.last = first, False
        model = SimpleNamespace(chunks=chunks, ids=[0, 2])
        shapes = MicroBatchShapes(samples=1, seq_len=4, image_tokens=1, hidden=2, handoff_width=2, vocab=8,
                                  compute_dtype=torch.float32, handoff_dtype=torch.float32, rows_require_grad=True)
        timed = []
        built = build_schedule(model, dims, torch.device("cpu"), shapes, lambda out, target: out.sum(),
                               lambda action: contextlib.nullcontext(timed.append(action)))
        assert type(built).__name__ == expected
        actions = [str(a) for a in built.pipeline_order[0] if a is not None]
        assert sum("W" in a for a in actions) == weight_passes
        for stage in built._stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                with contextlib.suppress(Exception):
                    getattr(stage, name)(0)
        assert len(timed) == 3 * len(built._stages)
        assert set(timed) == {"forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"}  # each named
    finally:
        dist.destroy_process_group()


def test_every_optimizer_group_holds_one_kind_of_tensor_for_the_multi_tensor_step():
    """torch's AdamW steps multi-tensor by default on CUDA, and those calls refuse a list mixing plain tensors and
    DTensors: a TP module's norms stay plain beside its sharded weights. On a fake process group, a TP2 linear and
    a plain norm: the runtime's AdamW takes the multi-tensor step (forced here, as CUDA would choose it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from runtime.training.optim import adamw

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
        parallelize_module(model[0], init_device_mesh("cpu", (2,)), ColwiseParallel())
        optimizer = adamw(model.parameters(), lr=1e-3, weight_decay=0.0)
        for group in optimizer.param_groups:
            group["foreach"] = True
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        assert len(optimizer.param_groups) == 2
    finally:
        dist.destroy_process_group()


def test_the_balancing_loss_is_transformers_load_balancing_loss():
    """One rank holding the whole batch: the routers' recorded choices give transformers' own ``aux_loss`` (Switch
    Transformer's, over every MoE layer and token) of the same forward."""
    from runtime.parallel.experts import RouterStats

    model = build_model(tiny_qwen3_vl_moe_config(), seed=0)
    stats = RouterStats(model, num_experts=8, probabilities=True)
    ids = torch.randint(0, 100, (2, 24))
    stats.start()
    out = model(input_ids=ids, output_router_logits=True)
    targets = torch.tensor(float(ids.numel()))  # the micro-batch is the whole step: weight 1
    ours = stats.balancing_loss(None, targets, targets)
    stats.stop()
    assert out.aux_loss is not None and len(stats.counts) == 4
    torch.testing.assert_close(ours, out.aux_loss, rtol=1e-6, atol=0)


def test_busiest_rank_load_by_hand():
    """8 experts on 2 ranks (experts 0-3 and 4-7): layer 0 loads 6 + 2 (busiest 6 over the mean 4 = 1.5), layer 1
    loads 4 + 4 (1.0): 1.25 averaged."""
    from runtime.parallel.experts import busiest_rank_load

    counts = torch.tensor([[3.0, 1, 1, 1, 0, 1, 0, 1], [1.0, 1, 1, 1, 1, 1, 1, 1]])
    assert busiest_rank_load(counts, 2) == pytest.approx(1.25)
    assert busiest_rank_load(counts, 1) == pytest.approx(1.0)


def test_moe_layers_follow_transformers_sparse_step_and_dense_layers():
    from types import SimpleNamespace

    from runtime.parallel.experts import moe_layers

    config = SimpleNamespace(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[1])
    assert moe_layers(config) == [3, 5]


def _saved_bytes(fn) -> tuple[torch.Tensor, int]:
    """``fn()``'s result and the bytes autograd saved for its backward (each storage once)."""
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        return fn(), sum(storages.values())


def test_the_chunked_loss_is_the_whole_loss_and_saves_no_logits():
    """The chunked cross-entropy gives the whole-logits loss and gradients, saving for backward only what lm_head
    reads (its input, weight and targets), not the log-softmax of every token."""
    from runtime.models.loss import chunked_cross_entropy_sum, cross_entropy_sum

    torch.manual_seed(0)
    tokens, width, vocab = 40, 16, 300
    lm_head = torch.nn.Linear(width, vocab, bias=False)
    hidden = torch.randn(1, tokens, width, requires_grad=True)
    targets = torch.randint(vocab, (1, tokens))
    targets[0, :3] = IGNORE_INDEX
    whole, whole_saved = _saved_bytes(lambda: cross_entropy_sum(lm_head(hidden), targets))
    expected = torch.autograd.grad(whole, (hidden, lm_head.weight))
    chunked, chunked_saved = _saved_bytes(lambda: chunked_cross_entropy_sum(lm_head, hidden, targets, 16))
    torch.testing.assert_close(chunked, whole)
    for got, want in zip(torch.autograd.grad(chunked, (hidden, lm_head.weight)), expected):
        torch.testing.assert_close(got, want)
    assert whole_saved >= tokens * vocab * 4
    assert chunked_saved <= (tokens * width + width * vocab) * 4 + tokens * 8


@pytest.mark.parametrize("kwargs, switch, said", [
    (dict(current_s=1.0, new_s=0.5, same_layout=True), False, "prefers the running plan"),
    (dict(current_s=1.0, new_s=0.96), False, "4.0% per step is below the 5% threshold"),
    (dict(current_s=1.0, new_s=0.9, steps_left=10, switch_cost_s=1.0), False, "= 1 s does not cover the switch's 1 s"),
    (dict(current_s=1.0, new_s=0.9, steps_left=11, switch_cost_s=1.0), True, "= 1.1 s covers the switch's 1 s"),
])
def test_an_adaptive_run_switches_only_for_a_gain_that_pays_for_the_switch(kwargs, switch, said):
    from runtime.launch.adapt import decide

    args = dict(same_layout=False, steps_left=100, switch_cost_s=0.0, min_gain=0.05, basis="predicted") | kwargs
    decided, why = decide(**args)
    assert decided is switch and said in why


class _AdaptiveRun:
    """An adaptive run's decisions without Ray or the planner: a fake job per plan, a step record per step (its
    seconds, and with ``peaks`` each rank's tensors, by the plan's layout and the step), a checkpoint after each, a
    switch resumed from it (as the launcher's ``_train_recovering`` does). The planner (``Adapter._replan``) answers from
    ``prefers``: running layout -> (the plan it re-plans to, the running plan's step and the new one's under the fit);
    with memory measured, the running plan fits it up to ``fits_bytes``, and when it does not the planner re-plans to
    ``outgrown``. ``calls``: (kind, step) of each planner call."""

    def __init__(self, tmp_path, monkeypatch, *, prefers, seconds, peaks=None, fits_bytes=None, outgrown=None):
        from runtime.launch.adapt import Adapter, AdaptOptions
        from runtime.observability.metrics import MetricsLog

        self.tmp_path, self.prefers, self.seconds, self.calls = tmp_path, prefers, seconds, []
        self.peaks, self.fits_bytes, self.outgrown = peaks or {}, fits_bytes, outgrown
        self.log = MetricsLog(_TP2, steps=1, path=None)
        self.adapter = Adapter(AdaptOptions(warmup_steps=2, switch_cost_s=0.0), steps=20, folder=str(tmp_path),
                               log=self.log, memory_cap_bytes=None if peaks is None else 1 << 40)
        monkeypatch.setattr(self.adapter, "_replan", self._replan)

    def _replan(self, job, step, measured, memory, prefix="adapt"):
        from planner.contract.strategy import layout_of

        self.calls.append((prefix, step))
        current = layout_of(job.plan)
        new, current_s, new_s = self.prefers[current]
        fits = memory is None or max(memory["peak_tensor_bytes"].values()) <= self.fits_bytes
        new = new if fits else self.outgrown
        path = self.tmp_path / f"{prefix}-{step}.json"
        path.write_text(new.to_json())
        answer = dict(current_layout=current, new_layout=layout_of(new), same_layout=layout_of(new) == current,
                      current_fitted_s=current_s, new_fitted_s=new_s, planned_step_s=0.1, fitted={}, at_bound=[],
                      residuals={}, new_plan=str(path), profile="fitted")
        if memory is not None:
            peak = max(memory["peak_tensor_bytes"].values())
            answer["memory"] = dict(groups={"all": dict(measured=peak, predicted=peak)}, current_fits=fits,
                                    usable_tensor_bytes=self.fits_bytes, new_tensor_bytes=peak // 2)
        return answer

    def run(self, first, steps=20):
        """Train ``first`` for ``steps`` steps; the adapt events' (decision, step)."""
        from types import SimpleNamespace

        from planner.contract.strategy import layout_of

        plan, step = first, 0
        while step < steps:
            job = SimpleNamespace(plan=plan, steps_done=step, setup_s=0.0)
            self.adapter.job_started(job)
            while step < steps:
                record = {"step": step, "step_time_s": self.seconds[layout_of(plan)]}
                if layout_of(plan) in self.peaks:
                    peak = self.peaks[layout_of(plan)](step)
                    record["peak_tensor_bytes"] = [peak, peak - 1]
                self.log.records.append(record)
                step += 1
                new = self.adapter.at_checkpoint(job, {"step": step, "seconds": 0.0})
                if new is not None:
                    plan = new
                    self.log.rewind(step)
                    break
        self.log.close()
        return [(e["decision"], e["step"]) for e in self.log.events]


_TP2 = make_plan(dict(tp=2), dict(tp=2))
_DP2 = make_plan(dict(dp=2), dict(dp=2))
_DISJOINT = make_plan(dict(dp=1), dict(dp=1), placement="disjoint")


def _layouts(*plans):
    from planner.contract.strategy import layout_of

    return [layout_of(p) for p in plans]


def test_an_adaptive_run_goes_on_adapting_from_a_switch_that_paid(tmp_path, monkeypatch):
    """TP2 -> DP2 measured faster (kept) -> the DP2 plan fitted on the same steps prefers the disjoint plan
    (switched, measured faster again, kept) -> its fit prefers it: adapting stops; each decision one event."""
    tp2, dp2, disjoint = _layouts(_TP2, _DP2, _DISJOINT)
    run = _AdaptiveRun(tmp_path, monkeypatch, seconds={tp2: 1.0, dp2: 0.5, disjoint: 0.25},
                       prefers={tp2: (_DP2, 1.0, 0.6), dp2: (_DISJOINT, 0.5, 0.3), disjoint: (_DISJOINT, 0.25, 0.25)})
    assert run.run(_TP2) == [("switch", 3), ("kept", 6), ("switch", 6), ("kept", 9), ("keep", 9)]
    assert run.calls == [("adapt", 3), ("adapt", 6), ("adapt", 9)] and run.log.plan.placement == "disjoint"
    assert run.adapter.tried == {tp2: 1.0, dp2: 0.5, disjoint: 0.25}


def test_an_adaptive_run_stops_adapting_after_a_switch_that_did_not_pay(tmp_path, monkeypatch):
    """The DP2 plan the fit predicts faster measures slower than TP2 did: the run switches back and the planner is
    not asked again."""
    tp2, dp2 = _layouts(_TP2, _DP2)
    run = _AdaptiveRun(tmp_path, monkeypatch, prefers={tp2: (_DP2, 1.0, 0.5), dp2: (_DP2, 2.0, 2.0)},
                       seconds={tp2: 1.0, dp2: 2.0})
    assert run.run(_TP2) == [("switch", 3), ("switch back", 6)]
    assert run.calls == [("adapt", 3)] and run.log.plan is _TP2


def test_an_adaptive_run_judges_a_layout_it_ran_by_its_measurement_not_its_prediction(tmp_path, monkeypatch):
    """TP2 (1 s) -> DP2 (0.9 s, kept); DP2's fit predicts TP2 at 0.3 s, but the run measured it at 1 s: no switch
    back to it."""
    tp2, dp2 = _layouts(_TP2, _DP2)
    run = _AdaptiveRun(tmp_path, monkeypatch, prefers={tp2: (_DP2, 1.0, 0.5), dp2: (_TP2, 0.9, 0.3)},
                       seconds={tp2: 1.0, dp2: 0.9})
    assert run.run(_TP2) == [("switch", 3), ("kept", 6), ("keep", 6)]
    assert run.log.events[-1]["why"] == (f"this run measured {tp2} at 1 s per step: measured gain -11.1% per step is "
                                         "below the 5% threshold")


def test_an_adaptive_run_never_goes_back_to_a_plan_that_outgrew_its_memory(tmp_path, monkeypatch):
    """TP2's ranks measure its predicted tensors, more than the devices hold: the fit switches to DP2 whatever the
    gain; DP2 measures slower, but the run does not switch back; DP2's fit predicts TP2 faster: kept."""
    from runtime.launch.adapt import planned_tensor_bytes

    tp2, dp2 = _layouts(_TP2, _DP2)
    planned = planned_tensor_bytes(_TP2)
    run = _AdaptiveRun(tmp_path, monkeypatch, prefers={tp2: (_TP2, 1.0, 1.0), dp2: (_TP2, 2.0, 0.5)},
                       seconds={tp2: 1.0, dp2: 2.0}, fits_bytes=planned // 2, outgrown=_DP2,
                       peaks={tp2: lambda step: planned, dp2: lambda step: planned // 4})
    assert run.run(_TP2) == [("switch", 3), ("keep", 6)]
    assert run.log.events[-1]["why"] == f"the fitted model prefers {tp2}, which this run left for its memory"


def test_an_adaptive_run_re_plans_when_memory_grows_after_adapting_stopped_and_asks_only_then(tmp_path,
                                                                                             monkeypatch):
    """TP2's ranks measure twice its predicted tensors: the first checkpoint asks the planner, which finds that they
    fit, and so does the fit after the warm-up (adapting stops: the planner prefers TP2); while they hold that, no
    checkpoint asks the planner; after step 8 they grow past what fits, and the checkpoint after it re-plans on the
    memory (one of ``MAX_MEMORY_REPLANS``) and resumes under DP2, whose tensors stay under its prediction."""
    from runtime.launch.adapt import planned_tensor_bytes

    tp2, dp2 = _layouts(_TP2, _DP2)
    planned = planned_tensor_bytes(_TP2)
    run = _AdaptiveRun(tmp_path, monkeypatch, prefers={tp2: (_TP2, 1.0, 1.0), dp2: (_DP2, 1.0, 1.0)},
                       seconds={tp2: 1.0, dp2: 1.0}, fits_bytes=5 * planned // 2, outgrown=_DP2,
                       peaks={tp2: lambda step: (2 if step < 8 else 3) * planned, dp2: lambda step: planned // 2})
    assert run.run(_TP2) == [("keep", 1), ("keep", 3), ("memory re-plan", 9)]
    assert run.calls == [("memory", 1), ("adapt", 3), ("memory", 9)] and run.log.plan is not _TP2
    assert run.adapter.memory_replans == 1 and run.adapter.tried[tp2] is None


def test_an_adaptive_run_fits_medians_of_the_timers_it_ran_and_times_collectives_its_devices_can_form():
    from runtime.launch.adapt import collective_group_sizes, measured_medians
    from runtime.observability.collectives import IN_RUN_OPS
    from planner.profiles import COLLECTIVE_OPS

    records = [{"step_time_s": t, "llm_forward_s": t / 2, "vision_forward_s": 0.0} for t in (3.0, 1.0, 2.0)]
    assert measured_medians(records) == {"step_time_s": 2.0, "llm_forward_s": 1.0}
    assert collective_group_sizes(make_plan(dict(dp=2, tp=2), dict(tp=4))) == (2, 4)
    assert collective_group_sizes(make_plan(dict(dp=1), dict(dp=1))) == ()
    assert IN_RUN_OPS == COLLECTIVE_OPS  # every collective the cost model prices is timed


def test_a_memory_cap_fails_the_operation_that_crosses_it_and_only_that_one():
    """``CappedTensorMemory``: tensors up to the cap are fine, freed ones make room again; the operation whose output
    takes them past it raises torch's out-of-memory error (its output counted in the peak), as the allocator's failed
    request would."""
    from runtime.observability.memory import CappedTensorMemory

    tracker = CappedTensorMemory(5 << 20)
    with pytest.raises(torch.OutOfMemoryError, match="over the cap of 0.004883 GiB"):
        with tracker:
            kept = torch.ones(1 << 19)  # 2 MiB of fp32
            for _ in range(3):
                freed = kept * 0.5  # 4 MiB with it, each time
                del freed
            assert tracker.peak()["Total"] == 4 << 20
            over = torch.cat([kept, kept])  # 6 MiB
    assert tracker.peak()["Total"] == 6 << 20 and "over" not in locals()


def test_a_step_out_of_memory_travels_whole_and_names_what_ran_out():
    """Ray pickles a worker's error to the driver: the rank, modules, step and bytes arrive (the driver re-plans on
    them); a CUDA message's request is read from its words."""
    import pickle

    from runtime.observability.memory import StepOutOfMemory, requested_bytes

    error = pickle.loads(pickle.dumps(StepOutOfMemory(3, ["llm"], 7, 5 << 30, 4 << 30)))
    assert (error.rank, error.modules, error.step, error.tensor_bytes, error.capacity_bytes) == (3, ["llm"], 7, 5 << 30,
                                                                                                4 << 30)
    assert str(error) == "rank 3 (llm) ran out of memory in step 7: 5 GiB of tensors on a device that holds 4"
    assert requested_bytes("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has ...") == int(2.5 * (1 << 30))
    assert requested_bytes("out of memory") == 0


def test_a_clip_only_micro_batch_hands_the_tower_its_pixels_without_copying_them():
    """A 768-frame 720p clip is 1.2 GiB of fp32 patches a sample: a micro-batch of clips alone is already in sequence
    order, so ``visual_inputs`` returns the batch's own tensors (copies of them, kept to the step's end, made the
    long-clip dry-run 1.30x the planner instead of 1.08x); mixed images and clips are reordered sample by sample,
    in one copy."""
    from runtime.data.samples import visual_inputs
    from runtime.observability.memory import TensorMemory

    clips = {"input_ids": torch.zeros(2, 4, dtype=torch.long), "pixel_values_videos": torch.randn(16, 600),
             "video_grid_thw": torch.tensor([[2, 2, 2], [2, 2, 2]])}
    pixels, grid = visual_inputs(clips)
    assert pixels is clips["pixel_values_videos"] and grid is clips["video_grid_thw"]
    mixed = {**clips, "pixel_values": torch.randn(8, 600), "image_grid_thw": torch.tensor([[1, 2, 2], [1, 2, 2]])}
    pixels, grid = visual_inputs(mixed)
    expected = torch.cat([mixed["pixel_values"][:4], clips["pixel_values_videos"][:8], mixed["pixel_values"][4:],
                          clips["pixel_values_videos"][8:]])
    assert torch.equal(pixels, expected) and grid.tolist() == [[1, 2, 2], [2, 2, 2], [1, 2, 2], [2, 2, 2]]
    with TensorMemory() as memory:  # counts the batch's pixels once it sees them (its views), and the copy
        visual_inputs(mixed)
    pixel_bytes = (mixed["pixel_values"].numel() + clips["pixel_values_videos"].numel()) * 4
    assert 2 * pixel_bytes <= memory.peak()["Total"] <= 2 * pixel_bytes + 1024  # one copy, none per sample first
