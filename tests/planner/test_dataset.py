"""Planning for a dataset (planner/dataset.py, planner/contract/packing.py): header-only image sizes, the processor's resize,
text counts that match the runtime's rendering, packing, the cache, and plans whose memory holds the heaviest pack."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from planner import api, dataset
from planner.catalog import get_model
from planner.cli import main
from planner.contract.data_rows import CACHE_ENV
from planner.contract.packing import balance_packs, pack_best_fit
from planner.contract.strategy import ModuleStrategy
from planner.contract.workload import MAX_ASPECT_RATIO, PackedTokens, packed_workload, pipeline_padded, smart_resize
from planner.cost import module_cost
from planner.dataset import (
    DatasetHistogram,
    pack_dataset,
    read_dataset,
    sample_tokens,
    scan_dataset,
)
from planner.inputs import ClusterInputs, DatasetInputs, WorkloadInputs

MODEL = get_model("qwen-vl-32b")
NO_PROFILE_8 = ClusterInputs(gpus=8, profile=None)
"""Eight GPUs of the default hardware, costed analytically."""
NO_PROFILE_16 = ClusterInputs(gpus=16, profile=None)
"""Sixteen of them."""


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))


def _image(path, width, height):
    Image.new("RGB", (width, height)).save(path)
    return path.name


def _row(image, answer="A red square."):
    return {"image": image, "conversations": [{"from": "human", "value": "<image>\nWhat is in the picture?"},
                                               {"from": "gpt", "value": answer}]}


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


@given(st.integers(1, 8000), st.integers(1, 8000), st.sampled_from([(3136, 1003520), (3136, 12845056), (200_000, 400_000)]))
@settings(max_examples=300, deadline=None)
def test_resize_is_the_processors(height, width, pixels):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        with pytest.raises(ValueError, match="aspect ratio"):
            smart_resize(height, width, 28, *pixels)
        return
    assert smart_resize(height, width, 28, *pixels) == hf_smart_resize(height, width, 28, *pixels)


@given(st.integers(2, 800), st.integers(1, 4000), st.integers(1, 4000))
@settings(max_examples=300, deadline=None)
def test_clip_resize_is_the_qwen3_video_processors(frames, height, width):
    """A clip's resize within the budget of every frame (Qwen3-VL's video_preprocessor_config.json bounds)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as hf_clip_resize

    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        return  # both refuse (the image test checks ours says why)
    ours = smart_resize(height, width, 32, 4096, 25_165_824, frames=frames, temporal_patch=2)
    assert ours == hf_clip_resize(frames, height, width, temporal_factor=2, factor=32, min_pixels=4096,
                                  max_pixels=25_165_824)


@given(st.lists(st.integers(1, 100), min_size=1, max_size=200), st.integers(100, 300))
@settings(max_examples=200, deadline=None)
def test_best_fit_packs_every_sample_once_within_the_budget(lengths, budget):
    packs = pack_best_fit(lengths, budget)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    fills = sorted(sum(lengths[i] for i in p) for p in packs)
    assert fills[-1] <= budget
    # a pack opens only when its first sample fits no open pack, so no two packs would fit in one
    assert len(fills) == 1 or fills[0] + fills[1] > budget


def test_best_fit_takes_the_tightest_pack():
    # decreasing: 6 | 5 | 4 -> the pack with room 4 (beside 6) | 3 -> room 5 (beside 5) | 2 -> room 2 (beside 5, 3)
    assert pack_best_fit([6, 5, 4, 3, 2], 10) == [[0, 2], [1, 3, 4]]
    with pytest.raises(ValueError, match="between 1 and the budget 10"):
        pack_best_fit([11], 10)


def test_scan_reads_sizes_from_headers_and_counts_bad_rows(tmp_path):
    wide, tall = _image(tmp_path / "w.png", 640, 480), _image(tmp_path / "t.jpg", 300, 1200)
    (tmp_path / "broken.png").write_bytes(b"not an image")
    rows = [_row(wide), _row(tall), _row(wide), _row("missing.png"), _row("broken.png"), "{not json",
            {"image": wide, "conversations": [{"from": "human", "value": "<image>hi"}]},
            {"image": wide, "text": "a caption"}]
    histogram = scan_dataset(_write(tmp_path / "d.jsonl", rows))
    assert histogram.samples == 4
    assert histogram.skipped == {"malformed row": 1, "missing or unreadable image": 2, "no assistant turn": 1}
    sizes = sorted({images for _, _, images, _ in histogram.shapes})
    assert sizes == [((480, 640),), ((1200, 300),)]  # (height, width)
    assert max(c for c, *_ in histogram.shapes) == 2  # the two identical rows are counted once


def test_text_tokens_are_what_the_runtime_renders(tmp_path):
    """With the model folder's tokenizer, a conversation's text tokens are exactly the runtime's rendering of it
    less its image pads (the byte-level test tokenizer: one token per byte of text)."""
    from runtime.data.conversations import ConversationData
    from runtime.models.model import hf_config_from_dict
    from tests.runtime.plans import make_plan, sample_layout
    from tests.runtime.tokenizer import save_tokenizer

    tokenizer = save_tokenizer(tmp_path / "tokenizer")
    image = _image(tmp_path / "a.png", 56, 56)
    rows = [_row(image), {"image": image, "conversations": [
        {"from": "system", "value": "Be brief."}, {"from": "human", "value": "<image>\nWhat is it?"},
        {"from": "gpt", "value": "A square, or something close to one."}, {"from": "human", "value": "Sure?"},
        {"from": "gpt", "value": "Yes."}]}]
    path = _write(tmp_path / "d.jsonl", rows)
    plan = make_plan({}, {}, text_tokens=400)
    layout = sample_layout(plan.workload, hf_config_from_dict(plan.model.hf_config))
    runtime = ConversationData(path, layout, tokenizer)
    histogram = scan_dataset(path, str(tokenizer))
    counted = sorted(t for _, t, *_ in histogram.shapes)
    rendered = []
    for row in rows:
        messages, _, _ = dataset.messages_of(row)
        ids = runtime.chat.render(messages, layout.image_tokens())
        rendered.append(len(ids) - ids.count(layout.image_token_id))
    assert counted == sorted(rendered)
    assert "estimated" in scan_dataset(path).text_tokens and "counted by" in histogram.text_tokens


def test_a_second_read_uses_the_cache_and_a_changed_file_is_rescanned(tmp_path, monkeypatch):
    image = _image(tmp_path / "a.png", 640, 480)
    path = _write(tmp_path / "d.jsonl", [_row(image)])
    first = read_dataset(path)
    scans = []
    monkeypatch.setattr(dataset, "_scan_rows", lambda *a: scans.append(a) or first)
    assert read_dataset(path) == first and scans == []
    _write(path, [_row(image), _row(image, "Another answer, longer.")])
    read_dataset(path)
    assert len(scans) == 1
    read_dataset(path, rescan=True)
    assert len(scans) == 2


def test_a_replaced_image_is_rescanned(tmp_path, capsys):
    path = _write(tmp_path / "d.jsonl", [_row(_image(tmp_path / "a.png", 640, 480))])
    assert read_dataset(path).shapes[0][2] == ((480, 640),)
    _image(tmp_path / "a.png", 1280, 960)
    assert read_dataset(path).shapes[0][2] == ((960, 1280),)
    with pytest.raises(SystemExit):
        main(["--model", "qwen-vl-32b", "--gpus", "8", "--rescan", "--out", str(tmp_path / "p.json")])
    assert "--rescan applies to --dataset" in capsys.readouterr().err


def test_a_dataset_without_images_is_refused_in_one_line(tmp_path):
    text_only = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path = _write(tmp_path / "d.jsonl", [text_only, _row("missing.png")])
    with pytest.raises(ValueError, match=r"has no sample with an image or a video \(skipped: \{'missing or unreadable image': 1"
                                         r"\}\), so qwen2.5-vl-tiny's vision encoder would have nothing to train on"):
        api.make_problem("qwen2.5-vl-tiny", ClusterInputs(gpus=2, gpu="cpu"), dataset=DatasetInputs(source=str(path)))


def test_a_histogram_file_is_a_dataset(tmp_path):
    image = _image(tmp_path / "a.png", 640, 480)
    histogram = scan_dataset(_write(tmp_path / "d.jsonl", [_row(image)] * 3))
    dataset.write_histogram(histogram, tmp_path / "h.json")
    assert read_dataset(tmp_path / "h.json") == histogram
    bad = {"format": dataset.HISTOGRAM_FORMAT, "version": dataset.HISTOGRAM_VERSION, "shapes": [[0, 5, [], []]],
           "source": "x", "text_tokens": "x"}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="count below 1"):
        read_dataset(tmp_path / "bad.json")
    (tmp_path / "old.json").write_text(json.dumps({**bad, "version": 1, "shapes": [[1, 5, [[448, 448]]]]}))
    with pytest.raises(ValueError, match="has version 1, this tool reads 2: rescan the data"):
        read_dataset(tmp_path / "old.json")


def _histogram(shapes):
    """A histogram of (count, text tokens, images) shapes without videos."""
    return DatasetHistogram(source="test", text_tokens="given", shapes=tuple((*s, ()) for s in shapes), skipped={})


def test_packs_by_hand():
    # 448x448 -> 32x32 patches = 1024 patches, 256 LLM image tokens; 224x224 -> 256 patches, 64 tokens
    h = _histogram([(1, 100, ((448, 448),)), (2, 36, ((224, 224),)), (1, 44, ((224, 224),))])
    tokens = sample_tokens(h, MODEL)
    assert sorted(tokens.llm.tolist()) == [100, 100, 108, 356]
    packing = pack_dataset(tokens, MODEL, 456)  # 356 | 108 (no room beside 356) | 100 -> beside 356 | 100 -> beside 108
    assert packing.packs == 2 and packing.samples == 4
    assert packing.efficiency == pytest.approx(664 / (2 * 456))
    mean, heaviest = dict(packing.packed.mean), dict(packing.packed.heaviest)
    assert mean["llm"].tokens == 332 and mean["vision"].tokens == (1024 + 3 * 256) / 2
    assert heaviest["llm"].tokens == 456 and heaviest["llm"].segment_squares == 356**2 + 100**2
    assert heaviest["vision"].tokens == 1024 + 256 and heaviest["vision"].segment_squares == 1024**2 + 256**2
    alone = pack_dataset(tokens, MODEL, None)
    assert alone.packs == 4 and dict(alone.packed.heaviest)["llm"].tokens == 356
    assert pack_dataset(tokens, MODEL, 200).too_long == 1


def test_a_packed_plan_is_timed_on_the_mean_pack_and_sized_on_the_heaviest():
    h = _histogram([(30, 300, ((448, 448),)), (2, 300, ((1344, 1344),))])
    packed = replace(pack_dataset(sample_tokens(h, MODEL), MODEL, 4096).packed, balance=None)  # its mean pack alone
    workload = packed_workload(packed, 8)
    mean_only = packed_workload(PackedTokens(mean=packed.mean, heaviest=packed.mean, samples_per_pack=1.0,
                                             pack_tokens=4096), 8)
    heavy_only = packed_workload(PackedTokens(mean=packed.heaviest, heaviest=packed.heaviest, samples_per_pack=1.0,
                                              pack_tokens=4096), 8)
    problem = api.make_problem(MODEL, NO_PROFILE_8)
    s = ModuleStrategy(dp=8, zero=3)
    costs = [module_cost(MODEL, "llm", problem.cluster, w, s, placement="colocated", precision="bf16_mixed",
                         first_rank=0) for w in (workload, mean_only, heavy_only)]
    assert costs[0].total_s == costs[1].total_s < costs[2].total_s
    assert costs[0].activations_per_micro_batch_bytes == costs[2].activations_per_micro_batch_bytes
    assert costs[0].activations_per_micro_batch_bytes > costs[1].activations_per_micro_batch_bytes


def test_a_pipelined_llm_is_costed_on_packs_padded_to_the_budget():
    h = _histogram([(1, 100, ((448, 448),)), (2, 36, ((224, 224),)), (1, 44, ((224, 224),))])
    packed = pack_dataset(sample_tokens(h, MODEL), MODEL, 456).packed  # packs of 456 and 208 tokens (test above)
    workload = packed_workload(packed, 8)
    padded = pipeline_padded(workload)
    mean, heavy = dict(padded.packs.mean)["llm"], dict(padded.heaviest().packs.mean)["llm"]
    assert mean.tokens == 456 and mean.squared_segments == (356**2 + 100**2 + 108**2 + 100**2) / 2 + (456 - 332)
    assert heavy.tokens == 456 and heavy.squared_segments == 356**2 + 100**2  # full: nothing padded
    assert dict(padded.packs.mean)["vision"] == dict(packed.mean)["vision"]
    assert pipeline_padded(workload) is padded  # memoised
    assert pipeline_padded(padded).packs.mean == padded.packs.mean  # padded once
    by_hand = packed_workload(PackedTokens(mean=(("vision", dict(packed.mean)["vision"]), ("llm", mean)),
                                           heaviest=(("vision", dict(packed.heaviest)["vision"]), ("llm", heavy)),
                                           samples_per_pack=packed.samples_per_pack, pack_tokens=456), 8)
    cluster = api.make_problem(MODEL, NO_PROFILE_8).cluster

    def cost(w, s):
        return module_cost(MODEL, "llm", cluster, w, s, placement="colocated", precision="bf16_mixed", first_rank=0)

    pipelined = ModuleStrategy(dp=1, pp=2, tp=4, grad_accum=2, micro_batch=4)
    flat = ModuleStrategy(dp=1, tp=8, micro_batch=8)
    assert cost(workload, pipelined) == cost(by_hand, pipelined)
    assert cost(workload, flat).total_s < cost(by_hand, flat).total_s  # without PP nothing is padded


def test_a_dataset_plan_pipelines_its_llm_on_padded_packs_or_says_why_not(tmp_path, capsys):
    from planner.cli import main

    rows = [_row(_image(tmp_path / f"{i}.png", w, h), "word " * (10 + 7 * i))
            for i, (w, h) in enumerate([(300, 200), (640, 480), (1024, 768), (1920, 1080)] * 2)]
    path = _write(tmp_path / "d.jsonl", rows)
    assert api.make_problem("qwen-vl-32b", NO_PROFILE_16, dataset=DatasetInputs(source=str(path))).searches_pp
    unpacked = DatasetInputs(source=str(path), pack=False)
    assert not api.make_problem("qwen-vl-32b", NO_PROFILE_16, dataset=unpacked).searches_pp
    plan = api.plan("qwen-vl-32b", NO_PROFILE_16, dataset=DatasetInputs(source=str(path)), fix=["llm.pp=2"])
    assert plan.module("llm").pp == 2 and plan.workload.dataset.pack_tokens is not None
    assert main(["--model", "qwen-vl-32b", "--gpus", "16", "--profile", "none", "--dataset", str(path),
                 "--fix", "llm.pp=2", "--out", str(tmp_path / "p.json")]) == 0
    d, out = plan.workload.dataset, capsys.readouterr().out
    assert f"the pipelined LLM pads every pack to {d.pack_tokens:,} tokens (one shape for its schedule): " \
           f"{1 - d.packing_efficiency:.1%} of its tokens are padding" in out
    with pytest.raises(ValueError, match=r"^llm.pp=2 on a dataset needs packing: a pipelined LLM's micro-batches"):
        api.plan("qwen-vl-32b", NO_PROFILE_16, dataset=unpacked, fix=["llm.pp=2"])
    sp_pinned = api.plan("qwen-vl-32b", NO_PROFILE_16, dataset=DatasetInputs(source=str(path)), fix=["llm.sp=2"])
    assert sp_pinned.module("llm").sp == 2 and sp_pinned.baselines["with_pp"].infeasible  # none with SP inside
    with pytest.raises(ValueError, match=r"^llm.pp=2 with llm.sp=2 on a dataset is not run"):
        api.plan("qwen-vl-32b", NO_PROFILE_16, dataset=DatasetInputs(source=str(path)), fix=["llm.pp=2", "llm.sp=2"])


def test_plan_for_a_dataset(tmp_path):
    rng = np.random.default_rng(0)
    rows = []
    for i, (w, h) in enumerate([(300, 200), (640, 480), (1024, 768), (1920, 1080)] * 4):
        rows.append(_row(_image(tmp_path / f"{i}.png", w, h), "word " * int(rng.integers(5, 60))))
    path = _write(tmp_path / "d.jsonl", rows)
    plan = api.plan("qwen-vl-32b", NO_PROFILE_16, dataset=DatasetInputs(source=str(path)),
                    workload=WorkloadInputs(global_batch=64))
    d = plan.workload.dataset
    assert d.samples == 16 and d.pack_tokens is not None and d.pack_tokens % 256 == 0
    assert d.pack_tokens >= d.tokens_per_sample["llm"].max
    assert plan.workload.global_batch % 16 == 0
    assert plan.predicted.samples_per_s == pytest.approx(
        plan.predicted.step_time_s ** -1 * plan.workload.global_batch * d.samples_per_pack)
    assert d.heaviest_pack_tokens["llm"] <= d.pack_tokens
    pinned = api.plan("qwen-vl-32b", NO_PROFILE_16,
                      dataset=DatasetInputs(source=str(path), pack_tokens=d.pack_tokens * 4))
    assert pinned.workload.dataset.pack_tokens == d.pack_tokens * 4


@pytest.mark.parametrize("workload, inputs, message", [
    ({"image_sizes": [(448, 448)]}, {}, "--dataset gives every sample's shape: drop --image-size"),
    ({"videos": [(16, 448, 448)], "text_tokens": 9}, {}, "drop --text-tokens, --video$"),
    ({}, {"pack_tokens": 10}, "every sample is longer than the pack budget of 10 LLM tokens"),
    ({}, {"max_pixels": 100, "min_pixels": 3136}, "--max-pixels must be between 3,136"),
])
def test_bad_dataset_inputs_are_one_line(tmp_path, workload, inputs, message):
    path = _write(tmp_path / "d.jsonl", [_row(_image(tmp_path / "a.png", 640, 480))])
    with pytest.raises(ValueError, match=message):
        api.make_problem("qwen-vl-32b", NO_PROFILE_8, workload=WorkloadInputs(**workload),
                         dataset=DatasetInputs(source=str(path), **inputs))


def test_nothing_usable_is_refused(tmp_path):
    path = _write(tmp_path / "d.jsonl", [_row("missing.png"), "oops"])
    with pytest.raises(ValueError, match=r"no usable sample: skipped \{'malformed row': 1, 'missing or unreadable"):
        read_dataset(path)


def test_a_caption_that_names_the_histogram_format_is_still_data(tmp_path):
    image = _image(tmp_path / "a.png", 640, 480)
    path = _write(tmp_path / "d.jsonl", [{"image": image, "text": f"about {dataset.HISTOGRAM_FORMAT} files"}] * 2)
    assert read_dataset(path).samples == 2


def test_a_model_folder_with_a_tokenizer_counts_the_text(tmp_path):
    from tests.runtime.plans import tiny_hf_config
    from tests.runtime.tokenizer import save_tokenizer

    folder = save_tokenizer(tmp_path / "model")
    (folder / "config.json").write_text(json.dumps(tiny_hf_config()))
    path = _write(tmp_path / "d.jsonl", [_row(_image(tmp_path / "a.png", 56, 56))])
    for model in (str(folder), str(folder / "config.json")):
        problem = api.make_problem(model, ClusterInputs(gpus=1, gpu="cpu", profile=None),
                                   dataset=DatasetInputs(source=str(path)))
        assert problem.dataset.text_tokens.startswith(f"counted by {folder}")
    problem = api.make_problem("qwen-vl-32b", NO_PROFILE_8, dataset=DatasetInputs(source=str(path)))
    assert problem.dataset.text_tokens.startswith("estimated")


def test_histogram_out_counts_with_the_model_folders_tokenizer(tmp_path, capsys):
    from planner.cli import main
    from tests.runtime.plans import tiny_hf_config
    from tests.runtime.tokenizer import save_tokenizer

    folder = save_tokenizer(tmp_path / "model")
    (folder / "config.json").write_text(json.dumps(tiny_hf_config()))
    path = _write(tmp_path / "d.jsonl", [_row(_image(tmp_path / "a.png", 56, 56))])
    assert main(["--model", str(folder), "--gpus", "1", "--gpu", "cpu", "--profile", "none", "--dataset", str(path),
                 "--histogram-out", str(tmp_path / "h.json"), "--out", str(tmp_path / "p.json")]) == 0
    assert read_dataset(tmp_path / "h.json").text_tokens.startswith(f"counted by {folder}")


def test_balance_packs_deals_largest_first_to_the_least_loaded_bin_with_room():
    # largest first: 10 -> bin 0; 9 -> bin 1; 8 -> bin 1 (9 < 10); the 1s: bin 0 (10 < 17), bin 0 (now full), bin 1
    assert balance_packs([1, 10, 1, 9, 8, 1], bins=2, per_bin=3) == [[1, 0, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="5 loads cannot fill 2 bins of 3"):
        balance_packs([1] * 5, bins=2, per_bin=3)


@pytest.mark.parametrize("shapes, skipped, message", [
    ([[10**20, 10, [[448, 448]], []]], {}, "has 100,000,000,000,000,000,000 samples, at most 1,048,576"),
    ([[10**9, 10, [[448, 448]], []]], {}, "has 1,000,000,000 samples, at most 1,048,576"),  # once a minute of np.repeat
    ([[1, 10**14, [[448, 448]], []]], {}, "a sample of 100,000,000,000,000 text tokens, at most 1,048,576"),
    ([[1, 10, [[10**11, 448]], []]], {}, "has an image side above 32,768 pixels"),
    ([[1, 10, [[448, 448]], []]], {"x": 1e400}, "is malformed"),  # once an OverflowError
])
def test_a_histogram_with_huge_numbers_is_refused_in_one_line(tmp_path, shapes, skipped, message):
    path = tmp_path / "h.json"
    path.write_text(json.dumps({"format": dataset.HISTOGRAM_FORMAT, "version": dataset.HISTOGRAM_VERSION,
                                "source": "x", "text_tokens": "estimated", "skipped": skipped, "shapes": shapes}))
    with pytest.raises(ValueError, match=message):
        api.make_problem("qwen-vl-7b", NO_PROFILE_8, dataset=DatasetInputs(source=str(path)))


def write_rows_reaching_outside(tmp_path):
    """data/rows.jsonl whose rows name data/in.png, then out/out.png as ``../out/out.png``, by its absolute path and
    through the symlink data/link.png; returns the file."""
    (tmp_path / "data").mkdir()
    (tmp_path / "out").mkdir()
    inside, outside = tmp_path / "data" / "in.png", tmp_path / "out" / "out.png"
    _image(inside, 64, 64), _image(outside, 64, 64)
    (tmp_path / "data" / "link.png").symlink_to(outside)
    return _write(tmp_path / "data" / "rows.jsonl",
                  [_row("in.png"), _row("../out/out.png"), _row(str(outside)), _row("link.png")])


def test_data_root_only_skips_and_counts_rows_naming_files_outside_the_data_folder(tmp_path, capsys):
    from planner.contract.data_rows import OUTSIDE_DATA_ROOT

    path = write_rows_reaching_outside(tmp_path)
    assert dataset.read_dataset(path).samples == 4  # by default rows may name any file
    kept = dataset.read_dataset(path, data_root_only=True)  # not the cached scan of the first read
    assert kept.samples == 1 and kept.skipped == {OUTSIDE_DATA_ROOT: 3}
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "qwen2.5-vl-tiny", "--gpus", "2", "--data-root-only"])
    assert exit_.value.code == 2 and "--data-root-only applies to --dataset" in capsys.readouterr().err
