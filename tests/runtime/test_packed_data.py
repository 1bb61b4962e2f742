"""Dataset plans in the runtime (runtime/data/packed_data.py): the index every rank builds, packs and epochs, balanced
replicas, bad rows, packed rows and their positions, and parity of packed micro-batches against the single-process
model run on the same samples one at a time."""

from __future__ import annotations

import json
import math
from unittest import mock

import numpy as np
import pytest
import torch
from PIL import Image
from torch.nn.attention.varlen import varlen_attn

from runtime.data.samples import IGNORE_INDEX, pack_rows
from runtime.models.llm import packed_position_ids
from runtime.models.model import build_model, hf_config_from_dict, split_model
from runtime.data.packed_data import UNDECODED_IMAGE, PackedConversations
from runtime.models.families import family_of
from runtime.parallel import attention
from tests.runtime.plans import (dataset_info, make_plan, sample_work, tiny_hf_config, tiny_qwen3_5_config,
                                 tiny_qwen3_vl_config)
from tests.runtime.tokenizer import save_tokenizer
from tests.runtime.varlen_cpu import register_cpu_reference

CONFIG = hf_config_from_dict(tiny_hf_config())
IMAGE_SIZES = [(84, 140), (112, 168), (224, 56), (140, 140), (300, 400), (84, 196)]
"""(height, width): every one at least two attention windows (112 px); 300 x 400 is above the test plans'
max_pixels, so the processor shrinks it."""
PACK_TOKENS = 512


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _row(image: str | list[str], question: str, answer: str) -> dict:
    images = image if isinstance(image, list) else [image]
    return {"image": image, "conversations": [{"from": "human", "value": "<image>\n" * len(images) + question},
                                              {"from": "gpt", "value": answer}]}


def write_dataset(folder, rows: int = 12, extra: list | None = None):
    """``rows`` conversations over images of IMAGE_SIZES (random pixels), answers of different lengths, one row
    with two images; ``extra`` rows appended (strings are written as they are)."""
    rng = np.random.default_rng(0)
    for k, (h, w) in enumerate(IMAGE_SIZES):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / f"i{k}.png")
    out = [_row(f"i{k % len(IMAGE_SIZES)}.png", f"What is in picture {k}?", "a thing " * (1 + 5 * k % 13))
           for k in range(rows - 1)]
    out.append(_row(["i0.png", "i2.png"], "Compare them.", "They differ."))
    lines = [r if isinstance(r, str) else json.dumps(r) for r in out + (extra or [])]
    (folder / "d.jsonl").write_text("".join(line + "\n" for line in lines))
    return folder / "d.jsonl"


def packed(path, tokenizer_dir, pack_tokens=PACK_TOKENS, seed=0, balance="modules") -> PackedConversations:
    return PackedConversations(path, tokenizer_dir, config=CONFIG, dataset=dataset_info(pack_tokens), seed=seed,
                               work=sample_work(tiny_hf_config()), balance=balance,
                               normalization=family_of(CONFIG).encoder.image_normalization)


def test_the_index_counts_what_the_built_samples_hold(tmp_path, tokenizer_dir):
    data = packed(write_dataset(tmp_path), tokenizer_dir)
    assert len(data.samples) == 12 and not data.skipped
    for index, entry in enumerate(data.samples):
        sample = data.sample(index)
        assert len(sample["input_ids"]) == entry.length
        assert [tuple(g) for g in sample["image_grid_thw"].tolist()] == list(entry.grids)
        image = (sample["input_ids"] == CONFIG.image_token_id).nonzero().flatten()
        assert torch.equal(image, entry.image_positions)
        assert len(sample["pixel_values"]) == sum(t * h * w for t, h, w in entry.grids)
    sizes = {g[1:] for s in data.samples for g in s.grids}
    assert len(sizes) == len(IMAGE_SIZES)  # native resolution: every image keeps its own grid
    big = data.samples[4].grids[0]
    assert big[1] * big[2] * 14 * 14 <= dataset_info(PACK_TOKENS).max_pixels < 300 * 400  # shrunk to max_pixels


def test_packs_fit_the_budget_and_each_epoch_sees_every_sample_once(tmp_path, tokenizer_dir):
    data = packed(write_dataset(tmp_path), tokenizer_dir)
    assert all(data.pack_tokens(p) <= PACK_TOKENS for p in data.packs)
    assert len(data.packs) < len(data.samples)  # samples do share packs
    count = len(data.packs)
    for epoch in range(3):
        seen = sorted(i for k in range(count) for i in data.pack(epoch * count + k))
        assert seen == list(range(len(data.samples)))
    orders = [[data.packs.index(data.pack(epoch * count + k)) for k in range(count)] for epoch in range(3)]
    assert len({tuple(o) for o in orders}) > 1  # each epoch is shuffled anew
    again = packed(tmp_path / "d.jsonl", tokenizer_dir)
    assert [again.pack(k) for k in range(2 * count)] == [data.pack(k) for k in range(2 * count)]  # every rank agrees


def test_a_step_deals_its_packs_to_replicas_by_llm_work(tmp_path, tokenizer_dir):
    data = packed(write_dataset(tmp_path, rows=24), tokenizer_dir, pack_tokens=256)
    micro_batches, replicas, per_replica = 2, 2, 2

    def replica_work(slots, e):  # replica e's packs' LLM work, micro-batch by micro-batch
        return [data.pack_work(slots[(m * replicas + e) * per_replica + i]) for m in range(micro_batches)
                for i in range(per_replica)]

    def spread(slots):
        loads = [sum(replica_work(slots, e)) for e in range(replicas)]
        return max(loads) - min(loads)

    improved = False
    for first in (0, 8, 16):
        slots = data.step_slots(first, micro_batches, replicas, per_replica)
        step = [data.pack(first + k) for k in range(8)]  # the packs in the epoch's order, as dealt without balancing
        assert sorted(map(sorted, slots)) == sorted(map(sorted, step))  # the step's packs, each once
        assert spread(slots) <= spread(step)
        improved |= spread(slots) < spread(step)
        for e in range(replicas):
            assert replica_work(slots, e) == sorted(replica_work(slots, e), reverse=True)  # costliest first
    assert improved


def test_balance_tokens_deals_packs_by_llm_tokens_and_runs_each_llm_replicas_images_on_its_vision_replica(
        tmp_path, tokenizer_dir):
    """``--balance tokens``, the earlier split: the step's packs dealt by LLM tokens (not work), and vision replica
    ``d`` runs exactly the images of LLM replica ``d``'s packs, in their order."""
    from planner.contract.packing import balance_packs

    path = write_dataset(tmp_path, rows=24)
    data, modules = (packed(path, tokenizer_dir, pack_tokens=256, balance=b) for b in ("tokens", "modules"))
    replicas, per_replica = 2, 2
    data.pack_work = lambda pack: -data.pack_tokens(pack)  # were the deal by work, the lightest would go first
    for first in (0, 4, 8):
        slots = data.step_slots(first, 1, replicas, per_replica)
        step = [data.pack(first + k) for k in range(replicas * per_replica)]
        dealt = balance_packs([data.pack_tokens(p) for p in step], replicas, per_replica)
        assert slots == [step[k] for mine in dealt for k in mine]
        assigned = data.assign_vision(slots, replicas)
        items = data.vision_items(slots)
        for d in range(replicas):
            assert [items[j] for j in assigned[d]] == data.vision_items(slots[d * per_replica:(d + 1) * per_replica])
    balanced = modules.assign_vision(slots, replicas)
    assert sorted(j for mine in balanced for j in mine) == list(range(len(items)))


def _vision_dims(dp, sp=1):
    from runtime.parallel.parallel_dims import ParallelDims

    return ParallelDims(name="vision", ranks=tuple(range(dp * sp)), dp=dp, cp=1, sp=sp, tp=1, zero=0,
                        recompute="none", micro_batch=1, grad_accum=1)


def _llm_dims(dp, sp=1, first_rank=0, micro_batch=2):
    from runtime.parallel.parallel_dims import ParallelDims

    return ParallelDims(name="llm", ranks=tuple(range(first_rank, first_rank + dp * sp)), dp=dp, cp=1, sp=sp, tp=1,
                        zero=0, recompute="none", micro_batch=micro_batch, grad_accum=1)


@pytest.mark.parametrize("vision_dp, vision_sp, llm_dp, llm_sp, disjoint", [
    (3, 1, 2, 1, False), (2, 2, 2, 2, False), (4, 1, 1, 2, True), (16, 1, 2, 1, False)])
def test_each_image_is_run_once_and_its_tokens_reach_the_llm_row_that_holds_its_text(
        tmp_path, tokenizer_dir, vision_dp, vision_sp, llm_dp, llm_sp, disjoint):
    """Per step, the vision replicas take every image of each micro-batch's packs exactly once (by vision work, any
    replica from any LLM replica's packs; more replicas than images leaves some with only a filler), and the routes
    deliver each merged token, as the replica emits it in window order, to the LLM rank and row slot of that image's
    own tokens (``_assert_routes_follow_each_token``)."""
    data = packed(write_dataset(tmp_path, rows=24), tokenizer_dir, pack_tokens=256)
    vision, llm = _vision_dims(vision_dp, vision_sp), _llm_dims(llm_dp, llm_sp, vision_dp * vision_sp * disjoint)
    for first in range(0, 3 * llm_dp * llm.micro_batch, llm_dp * llm.micro_batch):
        _assert_routes_follow_each_token(data, data.step_slots(first, 1, llm_dp, llm.micro_batch), vision, llm)


def test_a_vision_replica_with_fewer_windows_than_its_sp_ranks_sends_its_tokens_beside_a_filler(
        tmp_path, tokenizer_dir):
    """Under vision SP 2, a replica whose only image has one attention window (56 x 56 px: 4 x 4 patches) runs it
    with a filler, and its pieces are what its SP ranks emit (the window on one rank, the filler's on the other): a
    filler added only for a replica without images would leave the routes one piece short of the ranks' output."""
    Image.fromarray(np.zeros((56, 56, 3), dtype=np.uint8)).save(tmp_path / "small.png")
    write_dataset(tmp_path, rows=1)
    rows = [_row("i1.png", "What is this?", "A larger picture."), _row("small.png", "And this?", "A small one.")]
    (tmp_path / "two.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = packed(tmp_path / "two.jsonl", tokenizer_dir, pack_tokens=256)
    from runtime.parallel.windows import window_layout

    vc, vision, llm = CONFIG.vision_config, _vision_dims(2, sp=2), _llm_dims(1, micro_batch=1)
    slots = data.step_slots(0, 1, 1, 1)
    assert slots == [[0, 1]] and data.samples[1].grids == ((1, 4, 4),)  # one pack: both samples
    replicas = data.assign_vision(slots, 2)
    small = [j for j, mine in enumerate(replicas) if [data.vision_items(slots)[k] for k in mine] == [(1, 0)]]
    assert small and len(window_layout(torch.tensor([(1, 4, 4)]), vc)[1]) - 1 == 1  # alone, one window
    _assert_routes_follow_each_token(data, slots, vision, llm)


def _assert_routes_follow_each_token(data, slots, vision, llm):
    """The vision replicas take every image of the micro-batch of ``slots`` exactly once, each replica's pieces are
    what its SP ranks emit (filler included), and the routes deliver each merged token, as the replica emits it in
    window order, to the LLM rank and row slot of that image's own tokens: the tokens are followed by identity,
    independently of the routes' own bookkeeping."""
    from runtime.models.llm import image_slots_per_rank
    from runtime.training.step_inputs import VisionMicroBatch, packed_routes
    from runtime.parallel.windows import merged_positions_per_rank

    vc, merge = CONFIG.vision_config, CONFIG.vision_config.spatial_merge_size**2
    llm_dp, llm_sp, vision_sp = llm.dp, llm.sp, vision.sp
    items = data.vision_items(slots)
    micro = VisionMicroBatch(items=items, replicas=data.assign_vision(slots, vision.dp))
    assert sorted(j for mine in micro.replicas for j in mine) == list(range(len(items)))  # each once
    assert len(items) == sum(len(data.samples[i].grids) for pack in slots for i in pack)  # none left out
    rows = [[i for pack in slots[e * llm.micro_batch:(e + 1) * llm.micro_batch] for i in pack]
            for e in range(llm_dp)]
    routes = packed_routes(data.samples, micro, rows, vision, llm, vc, torch.device("cpu"))
    for piece in routes.pieces:  # each piece is exactly what its SP rank emits
        mine = micro.replicas[piece.replica]
        own = merged_positions_per_rank(torch.tensor(_grids(data, items, mine, vc, vision_sp)), vc, vision_sp)
        assert len(piece.positions) == len(own[piece.sp_rank])
    # each piece's rows, by identity: (item, its token) in the replica's window order, or a filler's
    received = {rank: [None] * len(need) for rank, need in routes.needs.items()}
    for (i, rank), (keep, slot) in routes.table.items():
        piece = routes.pieces[i]
        mine = micro.replicas[piece.replica]
        tokens = [(j, t) for j in mine for t in range(_tokens(data, items[j], merge))]
        own = merged_positions_per_rank(torch.tensor(_grids(data, items, mine, vc, vision_sp)), vc, vision_sp)
        emitted = [tokens[p] if p < len(tokens) else "filler" for p in own[piece.sp_rank].tolist()]
        for row, at in zip([r for r, k in zip(emitted, keep.tolist()) if k], slot.tolist()):
            assert received[rank][at] is None  # every row from exactly one sender
            received[rank][at] = row
    # what each LLM rank's slice of its row holds, by identity: its images' tokens in sequence order
    at = 0
    for e, row in enumerate(rows):
        ordered = [(j, t) for j in range(at, at + sum(len(data.samples[i].grids) for i in row))
                   for t in range(_tokens(data, items[j], merge))]
        at += sum(len(data.samples[i].grids) for i in row)
        samples = [data.samples[i] for i in row]
        starts = np.cumsum([0] + [s.length for s in samples])
        positions = torch.cat([s.image_positions + int(a) for s, a in zip(samples, starts)])
        slices = image_slots_per_rank([(int(starts[-1]), positions)], llm_sp)
        for j in range(llm_sp):
            rank = llm.ranks_where(dp=e, sp=j)[0]
            assert received[rank] == [ordered[n] for n in slices[j].tolist()]


def _tokens(data, item, merge):
    return math.prod(data.samples[item[0]].grids[item[1]]) // merge


def _grids(data, items, mine, vc, sp):
    from runtime.training.step_inputs import needs_filler
    from runtime.models.vision import filler_grid

    grids = [data.samples[i].grids[k] for i, k in (items[j] for j in mine)]
    return grids + [filler_grid(vc, sp)] if needs_filler(grids, vc, sp) else grids


def test_a_vision_replica_with_too_few_windows_runs_a_filler_that_goes_nowhere():
    """A replica with no image, or fewer attention windows than its SP ranks, runs a filler image of zeros with
    exactly enough windows, so that each of its ranks still runs every block and its collectives."""
    from runtime.training.step_inputs import needs_filler, vision_items_batch
    from runtime.models.vision import filler_grid
    from runtime.parallel.windows import window_layout

    vc = CONFIG.vision_config
    for sp in (1, 2, 4):
        grid = filler_grid(vc, sp)
        assert len(window_layout(torch.tensor([grid]), vc)[1]) - 1 == sp
    small = (1, 4, 6)  # one 8 x 8-patch window
    assert needs_filler([], vc, 1) and not needs_filler([small], vc, 1)
    assert needs_filler([small], vc, 2) and not needs_filler([small, small], vc, 2)
    width = 3 * vc.temporal_patch_size * vc.patch_size**2
    sample = {"pixel_values": torch.arange(24 * width, dtype=torch.float32).view(24, width),
              "image_grid_thw": torch.tensor([small])}
    alone = vision_items_batch([sample], [0], vc, 2)
    assert alone["image_grid_thw"].tolist() == [list(small), list(filler_grid(vc, 2))]
    assert torch.equal(alone["pixel_values"][:24], sample["pixel_values"])
    assert not alone["pixel_values"][24:].any()
    empty = vision_items_batch([], [], vc, 1)
    assert empty["image_grid_thw"].tolist() == [list(filler_grid(vc, 1))]


def test_bad_rows_are_skipped_and_counted(tmp_path, tokenizer_dir):
    Image.new("RGB", (1000, 4)).save(tmp_path / "thin.png")
    extra = ["{not json", _row("missing.png", "Q?", "A."), {"image": "i0.png", "conversations": [
        {"from": "human", "value": "<image>\nQ?"}]}, {"conversations": [{"from": "human", "value": "Hi"},
                                                                         {"from": "gpt", "value": "Hello"}]},
             _row("i1.png", "Q?", "long " * 200), _row("thin.png", "Q?", "A.")]
    data = packed(write_dataset(tmp_path, extra=extra), tokenizer_dir)
    assert len(data.samples) == 12
    assert data.skipped == {"malformed row": 1, "missing or unreadable image": 1, "no assistant turn": 1,
                            "no image": 1, "longer than the pack budget": 1, "aspect ratio the processor refuses": 1}
    (tmp_path / "i3.png").write_bytes((tmp_path / "i3.png").read_bytes()[:200])  # the header reads, the pixels do not
    sample = data.sample(3)
    assert data.skipped[UNDECODED_IMAGE] == 1 and len(sample["pixel_values"].unique()) == 3  # black, normalised
    (tmp_path / "bad.jsonl").write_text("\n".join(json.dumps(r) for r in extra[1:4]) + "\n")
    with pytest.raises(ValueError, match="has no usable sample for this plan: skipped"):
        packed(tmp_path / "bad.jsonl", tokenizer_dir)


def test_a_packed_row_masks_each_samples_first_label():
    """The last token of a sample must not learn to predict the next sample's first token."""
    def sample(labels):
        n = len(labels)
        return {"pixel_values": torch.zeros(4, 1), "image_grid_thw": torch.tensor([[1, 2, 2]]),
                "input_ids": torch.arange(n), "mm_token_type_ids": torch.zeros(n, dtype=torch.int32),
                "labels": torch.tensor(labels)}

    batch = pack_rows([sample([5, 6, 7]), sample([8, IGNORE_INDEX])])
    assert batch["labels"].tolist() == [[IGNORE_INDEX, 6, 7, IGNORE_INDEX, IGNORE_INDEX]]
    assert batch["sample_lens"].tolist() == [3, 2] and batch["sample_images"].tolist() == [1, 1]


def test_a_packed_row_gives_each_sample_its_own_logits(tmp_path, tokenizer_dir):
    """The runtime's LLM on one packed row (4-row positions: each sample's text positions, then its M-RoPE) gives
    the logits of each sample run alone, and each sample's first label is masked."""
    data = packed(write_dataset(tmp_path), tokenizer_dir)
    model = build_model(tiny_hf_config(), seed=0, attention=attention.register()).eval()
    vision, llm, rope_index = split_model(model)
    samples = [data.sample(i) for i in (0, 4, 11)]
    batch = pack_rows(samples)
    assert (batch["labels"][0, [0, len(samples[0]["input_ids"])]] == IGNORE_INDEX).all()
    positions = packed_position_ids(batch, rope_index)
    assert positions.shape == (4, 1, batch["input_ids"].shape[1])
    with torch.no_grad():
        embeds = model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output
        logits = llm(batch["input_ids"], torch.cat(embeds), positions)
        at = 0
        for sample in samples:
            alone = model(input_ids=sample["input_ids"][None], pixel_values=sample["pixel_values"],
                          image_grid_thw=sample["image_grid_thw"], mm_token_type_ids=sample["mm_token_type_ids"][None])
            n = len(sample["input_ids"])
            torch.testing.assert_close(logits[:, at:at + n], alone.logits, rtol=1e-5, atol=1e-5)
            at += n


def test_the_prefetch_worker_builds_the_samples_and_reports_what_it_skipped(tmp_path, tokenizer_dir):
    from runtime.data.prefetch import Prefetcher

    data = packed(write_dataset(tmp_path), tokenizer_dir)
    direct = {i: data.sample(i) for i in (0, 3, 5)}
    (tmp_path / "i3.png").write_bytes((tmp_path / "i3.png").read_bytes()[:200])  # rows 3 and 9 now fail to decode
    prefetcher = Prefetcher(data)
    try:
        prefetcher.submit(8, [0, 3, 5])
        built = prefetcher.take(8, [0, 3, 5])
        assert data.skipped == {UNDECODED_IMAGE: 1}  # counted in the worker, reported here
        for i in (0, 5):
            assert all(torch.equal(built[i][k], direct[i][k]) for k in direct[i])
        assert not torch.equal(built[3]["pixel_values"], direct[3]["pixel_values"])
        prefetcher.submit(16, [1])
        assert list(prefetcher.take(8, [2])) == [2]  # another step than the one prefetched: built here
        prefetcher.submit(24, [4])
        assert list(prefetcher.take(24, [4])) == [4]  # the worker's step-16 samples were dropped
    finally:
        prefetcher.close()


PACKED_PLANS = {
    "vision_dp2__llm_dp2_zero3_accum2": dict(vision=dict(dp=2, grad_accum=2), llm=dict(dp=2, zero=3, grad_accum=2)),
    "vision_sp2__llm_sp2": dict(vision=dict(sp=2, micro_batch=2), llm=dict(sp=2, micro_batch=2)),
    "disjoint_vision_1__llm_dp2": dict(vision=dict(micro_batch=2), llm=dict(dp=2), placement="disjoint"),
    "vision_dp2__llm_pp2_2_packs_per_row": dict(vision=dict(dp=2, grad_accum=2),
                                                llm=dict(pp=2, pp_layers=[2, 2], micro_batch=2, grad_accum=2)),
    "vision_dp4__llm_pp2xdp2_interleaved_zb": dict(vision=dict(dp=4, grad_accum=2), llm=dict(
        pp=2, dp=2, pp_schedule="interleaved_zb", virtual_stages=2, pp_layers=[1, 1, 1, 1], micro_batch=2,
        grad_accum=2)),
    # Qwen3-VL: DeepStack features of ragged packs, sliced with their image tokens / padded with the row
    "qwen3_vl_vision_sp2__llm_sp2": dict(vision=dict(sp=2, micro_batch=2), llm=dict(sp=2, micro_batch=2),
                                         hf_config=tiny_qwen3_vl_config()),
    "qwen3_vl_vision_dp2__llm_pp2": dict(vision=dict(dp=2, grad_accum=2),
                                         llm=dict(pp=2, pp_layers=[2, 2], micro_batch=2, grad_accum=2),
                                         hf_config=tiny_qwen3_vl_config()),
    # Qwen3.5: its linear-attention layers restart the conv and the recurrence at every sample of a packed row
    "qwen3_5_vision_dp2__llm_dp2_zero3": dict(vision=dict(dp=2, grad_accum=2), llm=dict(dp=2, zero=3, grad_accum=2),
                                              hf_config=tiny_qwen3_5_config()),
    "qwen3_5_vision_sp2__llm_sp2": dict(vision=dict(sp=2, micro_batch=2), llm=dict(sp=2, micro_batch=2),
                                        hf_config=tiny_qwen3_5_config()),
    # ring CP2 over packed rows: each CP rank's head and tail chunks attend the group's gathered keys, their samples'
    # own; x Ulysses SP2 (2-D)
    "vision_dp2__llm_cp2": dict(vision=dict(dp=2, micro_batch=2), llm=dict(cp=2, micro_batch=2)),
    "vision_sp2xdp2__llm_cp2xsp2": dict(vision=dict(sp=2, dp=2, micro_batch=2), llm=dict(cp=2, sp=2, micro_batch=4)),
    # one pack of mostly one sample per micro-batch for two vision replicas (a dataset plan's vision replicas take
    # each micro-batch's images, whatever their count): one often gets no image (a filler, FSDP and SP or TP
    # collectives as its peers), or one with fewer windows than its SP ranks
    "empty_vision_replica_dp2xsp2_zero3__llm_tp4": dict(vision=dict(dp=2, sp=2, zero=3, grad_accum=2),
                                                        llm=dict(tp=4, grad_accum=2), pack_tokens=256),
    "empty_vision_replica_dp2xtp2_zero3__llm_tp4": dict(vision=dict(dp=2, tp=2, zero=3, grad_accum=2),
                                                        llm=dict(tp=4, grad_accum=2), pack_tokens=256),
}
EMPTY_REPLICA_PLANS = [name for name in PACKED_PLANS if name.startswith("empty_vision_replica")]
PREFETCHED = {"disjoint_vision_1__llm_dp2"}
"""Plans whose samples come from the prefetch worker."""


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PACKED_PLANS))
def test_packed_parity(name, tmp_path, tokenizer_dir, worker_pool):
    """Packed micro-batches of samples with different image sizes (vision DP, vision and LLM SP over ragged packs,
    disjoint placement, a pipelined LLM on rows padded to their budget) give the loss, gradients and parameters of
    the single-process HF model run on the same samples one at a time, each weighted by its share of the step's
    target tokens."""
    from runtime.training.trainer import RunOptions
    from tests.runtime.test_parity import LR, SEED, assert_parity

    spec = dict(PACKED_PLANS[name])
    pack_tokens = spec.pop("pack_tokens", PACK_TOKENS)
    plan = make_plan(spec.pop("vision"), spec.pop("llm"), learning_rate=LR, pack_tokens=pack_tokens, **spec)
    options = RunOptions(seed=SEED, data=str(write_dataset(tmp_path)), tokenizer=str(tokenizer_dir),
                         prefetch=name in PREFETCHED)
    if name in EMPTY_REPLICA_PLANS:  # the run does hold a micro-batch where a vision replica has no image
        from tests.runtime.test_parity import STEPS

        data = packed(options.data, tokenizer_dir, pack_tokens)
        micro_batches = [data.assign_vision([data.pack(p)], 2) for p in range(2 * STEPS)]
        assert any(not mine for replicas in micro_batches for mine in replicas)
    assert_parity(plan, options, worker_pool)


@pytest.mark.slow
def test_a_model_folder_plans_for_and_trains_on_a_mixed_resolution_dataset(tmp_path, ray_cluster, capsys):
    """``plan --model FOLDER --dataset d.jsonl`` (the folder's own tokenizer counts the text), then
    ``python -m runtime plan.json --data d.jsonl --tokenizer FOLDER`` (both commands' ``main`` in this process, on
    the session's Ray cluster: the commands' own processes are tested elsewhere): packed steps of different token
    counts, bad rows counted, measured tokens/s and peak memory beside the plan's in the summary."""
    from planner import cli
    from runtime import __main__ as runtime_cli

    folder = save_tokenizer(tmp_path / "model")
    (folder / "config.json").write_text(json.dumps(tiny_hf_config()))
    data = write_dataset(tmp_path, rows=16, extra=[_row("missing.png", "Q?", "A."), "{not json"])
    plan = tmp_path / "plan.json"
    assert cli.main(["--model", str(folder), "--gpu", "cpu", "--gpus", "2", "--dataset", str(data), "--global-batch",
                     "8", "--out", str(plan)]) == 0
    assert f"text counted by {folder}/tokenizer.json" in capsys.readouterr().out
    metrics = tmp_path / "m.jsonl"
    assert runtime_cli.main([str(plan), "--data", str(data), "--tokenizer", str(folder), "--steps", "3", "--metrics",
                             str(metrics)]) == 0
    result = capsys.readouterr()
    *steps, summary = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert all(np.isfinite(s["loss"]) for s in steps)
    budget = json.loads(plan.read_text())["workload"]["dataset"]["pack_tokens"]
    packs = json.loads(plan.read_text())["workload"]["global_batch"]
    assert all(0 < s["llm_tokens"] <= packs * budget for s in steps)
    assert summary["data_skipped"] == {"missing or unreadable image": 1, "malformed row": 1}
    assert summary["tokens_per_s"]["measured"] > 0 and summary["tokens_per_s"]["predicted"] > 0
    assert summary["peak_memory_gib"]["measured"] > 0
    assert "tokens/s" in result.out + result.err


def test_the_index_is_cached_until_the_data_or_the_tokenizer_changes(tmp_path, tokenizer_dir, monkeypatch):
    from runtime.data.conversations import ChatTokenizer

    monkeypatch.setenv("DHPLAN_CACHE_DIR", str(tmp_path / "cache"))
    path = write_dataset(tmp_path, extra=[_row("missing.png", "Q?", "A."), _row("i1.png", "Q?", "long " * 200)])
    first = packed(path, tokenizer_dir)
    assert len(list((tmp_path / "cache" / "runtime-index").iterdir())) == 1
    with monkeypatch.context() as patched:
        patched.setattr(ChatTokenizer, "render", lambda *a, **k: pytest.fail("rendered despite the cache"))
        again = packed(path, tokenizer_dir)
        assert again.samples == first.samples and again.skipped == first.skipped
        assert packed(path, tokenizer_dir, pack_tokens=4096).skipped == {"missing or unreadable image": 1}  # one index
    path.write_text(path.read_text() + json.dumps(_row("i2.png", "Q?", "A.")) + "\n")
    assert len(packed(path, tokenizer_dir).samples) == len(first.samples) + 1  # a changed file is indexed anew
    running = packed(path, tokenizer_dir)
    (tmp_path / "i0.png").unlink()
    Image.new("RGB", (56, 300)).save(tmp_path / "i0.png")  # another size under the indexed name, during a run
    with pytest.raises(ValueError, match=r"row 0: its images are .* patches now, .* when the data was indexed"):
        running.sample(0)


def test_an_image_replaced_by_one_of_another_size_is_indexed_anew(tmp_path, tokenizer_dir, monkeypatch):
    monkeypatch.setenv("DHPLAN_CACHE_DIR", str(tmp_path / "cache"))
    path = write_dataset(tmp_path)
    before = packed(path, tokenizer_dir)
    (tmp_path / "i0.png").unlink()
    Image.new("RGB", (56, 300)).save(tmp_path / "i0.png")  # the data file itself is unchanged
    after = packed(path, tokenizer_dir)
    assert len(list((tmp_path / "cache" / "runtime-index").iterdir())) == 2
    assert after.samples[0].grids != before.samples[0].grids
    after.sample(0)  # built as indexed: no "its images are ... patches now"


def test_a_micro_batch_may_hold_one_pack_once_per_epoch_its_step_spans(tmp_path, tokenizer_dir):
    """A step's packs run on across an epoch's end: positions 4..10 of 5-pack epochs touch epochs 0, 1 and 2, so a
    pipelined LLM's first stage makes room for the heaviest pack that many times in one micro-batch."""
    from runtime.data.packed_data import epochs_spanned

    assert [epochs_spanned(n, 5) for n in (1, 2, 5, 6, 7, 11)] == [1, 2, 2, 2, 3, 3]
    data = packed(write_dataset(tmp_path), tokenizer_dir)
    per_pack = sorted((sum(n for i in p for _, n in data.samples[i].image_spans) for p in data.packs), reverse=True)
    # the heaviest pack last in one epoch and first in the next
    assert data.most_image_tokens(2, step_packs=2) == per_pack[0] * 2
    assert data.most_image_tokens(3, step_packs=len(data.packs)) == per_pack[0] * 2 + per_pack[1]


def _forward_backward(model, batch):
    """The runtime's vision tower (through transformers' attention) and LLM on a packed batch: the logits and the
    gradient of every parameter of a scalar of them."""
    _, llm, rope_index = split_model(model)
    model.zero_grad()
    embeds = model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"]).pooler_output
    logits = llm(batch["input_ids"], torch.cat(embeds), packed_position_ids(batch, rope_index))
    (logits.square().mean()).backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_variable_length_attention_attends_each_segment_as_sdpa_does(tmp_path, tokenizer_dir):
    """A GPU plan's ``attention = "varlen"``: one variable-length call per layer over the vision windows and
    images (non-causal) and over a packed LLM row's samples (causal, grouped KV heads), with no mask; with the op
    run by a per-segment SDPA CPU kernel (tests.runtime.varlen_cpu), the logits and every gradient are the SDPA
    path's (per-window calls, the dense packed mask)."""
    register_cpu_reference()
    data = packed(write_dataset(tmp_path), tokenizer_dir)
    batch = pack_rows([data.sample(i) for i in (0, 4, 11)])
    sdpa = build_model(tiny_hf_config(), seed=0, attention=attention.register())
    varlen = build_model(tiny_hf_config(), seed=0, attention=attention.register())
    attention.use_planned_calls(varlen, {"vision": "varlen", "llm": "varlen"})
    calls = []
    with mock.patch.object(attention, "varlen_attn", side_effect=lambda *a, **k: calls.append(a[3]) or varlen_attn(
            *a, **k)):
        logits, grads = _forward_backward(varlen, batch)
    expected_logits, expected_grads = _forward_backward(sdpa, batch)
    config = CONFIG.vision_config
    assert len(calls) == config.depth + CONFIG.text_config.num_hidden_layers  # one call per layer
    assert len(calls[-1]) == 4  # the LLM row's three samples
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-5, msg=name)


def test_packed_segments_split_where_positions_restart():
    cu, longest = attention.packed_segments(torch.tensor([[0, 1, 2, 0, 1, 0], [5, 6, 7, 8, 9, 10]]))
    assert cu.tolist() == [0, 3, 5, 6, 12] and longest == 6
