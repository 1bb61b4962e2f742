"""Video rows in a dataset plan's runtime (runtime/data/packed_data.py): the index agrees with the planner's pricing of
the same file, a built clip is what the synthetic video path makes for its size, bad videos are skipped with the
planner's reasons, and a packed row of clips gets its vision rows and M-RoPE positions."""

from __future__ import annotations

import json
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

from planner.contract.data_rows import MISSING_VIDEO, MIXED_FRAME_SIZES, NO_FRAMES
from planner.contract.families import model_from_hf_config
from planner.contract.families.qwen3_vl import TIMESTAMP_TOKENS
from planner.contract.workload import sampled_frames, video_grid
from planner.dataset import sample_tokens, scan_dataset
from runtime.data.conversations import conversation_of
from runtime.data.packed_data import VIDEO_DECODE_THREADS, PackedConversations, decode_frames
from runtime.data.samples import IGNORE_INDEX, layout_image_processor, pack_rows, patchify_clip, visual_inputs
from runtime.models.families import family_of
from runtime.models.llm import packed_position_ids
from runtime.training.step_inputs import vision_items_batch
from runtime.models.model import build_model, hf_config_from_dict, split_model
from tests.planner.test_video_rows import _conversation, write_video_rows
from tests.planner.video_files import write_frames, write_mkv_claiming, write_mp4
from tests.runtime.plans import dataset_info, sample_layout, sample_work, tiny_hf_config, tiny_qwen3_vl_config
from tests.runtime.tokenizer import save_tokenizer

FPS = 2.0
CONFIGS = {"qwen2.5-vl": tiny_hf_config, "qwen3-vl": tiny_qwen3_vl_config}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DHPLAN_CACHE_DIR", str(tmp_path / "cache"))


def _indexed(path, tokenizer_dir, family: str) -> PackedConversations:
    config = hf_config_from_dict(CONFIGS[family]())
    dataset = dataset_info(4096).model_copy(update={"fps": FPS})
    return PackedConversations(path, tokenizer_dir, config=config, dataset=dataset, seed=0,
                               work=sample_work(CONFIGS[family]()),
                               normalization=family_of(config).encoder.image_normalization)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_index_agrees_with_the_planner(tmp_path, tokenizer_dir, family):
    """Same vision tokens and grids per sample as the planner priced (``sample_tokens``, text counted by the same
    tokenizer), and the same LLM tokens but for Qwen3-VL's timestamps, which the planner prices at a named
    ``TIMESTAMP_TOKENS`` each and the runtime writes out (one byte-level token per character here)."""
    path = write_video_rows(tmp_path)
    data = _indexed(path, tokenizer_dir, family)
    assert dict(data.skipped) == {MISSING_VIDEO: 1, MIXED_FRAME_SIZES: 1, NO_FRAMES: 1}
    spec = model_from_hf_config(CONFIGS[family](), "tiny")
    info = dataset_info(4096)
    planned = sample_tokens(scan_dataset(path, str(tokenizer_dir)), spec, fps=FPS, min_pixels=info.min_pixels,
                            max_pixels=info.max_pixels)
    vision, llm = [], []
    for entry in data.samples:
        vision.append(sum(t * h * w for t, h, w in entry.grids))
        stamps = sum(len(f"<{t:.1f} seconds>") - TIMESTAMP_TOKENS for t in _seconds(data, entry))
        llm.append(entry.length - (stamps if family == "qwen3-vl" else 0))
    assert sorted(vision) == sorted(planned.vision.tolist())
    assert sorted(llm) == sorted(planned.llm.tolist())
    clip = next(e for e in data.samples if e.clips == 1 and len(e.grids) == 1)
    frames = 5 if family == "qwen3-vl" else 4  # the file's 10 frames at 4 fps, 2.5 s at 2 fps (test_video_rows)
    assert clip.grids[0] in {video_grid(frames, 48, 64, spec), video_grid(6, 48, 64, spec)}


def _video_then_image_rows(folder) -> Path:
    """Row 0: a clip, then an image, then a clip in the text; row 1: the same image and first clip, image first."""
    first, second = write_frames(folder, "f", [(64, 48)] * 4), write_frames(folder, "g", [(48, 64)] * 2, seed=1)
    image = write_frames(folder, "image", [(64, 64)], seed=2)[0]
    rows = [_conversation("<video> then <image> then <video>?", image=image, videos=[first, second]),
            _conversation("<image> then <video>?", image=image, video=first)]
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_video_before_an_image_is_counted_by_the_planner_and_trains_as_transformers_places_it(
    tmp_path, tokenizer_dir
):
    """A row with a clip, an image, a clip: planned like any row, indexed with its grids in token order, and the
    LLM's loss and every gradient on its vision rows (in ``vision_items`` order, the hand-off's) are the
    single-process transformers model's, which places image and video outputs by their pad tokens."""
    path = _video_then_image_rows(tmp_path)
    assert scan_dataset(path, str(tokenizer_dir)).skipped == {}
    data = _indexed(path, tokenizer_dir, "qwen2.5-vl")
    assert dict(data.skipped) == {} and len(data.samples) == 2
    entry = next(e for e in data.samples if e.row == 0)
    assert entry.order == (1, 0, 2)  # grids are (image, clip, clip); the text runs clip, image, clip
    index = data.samples.index(entry)
    model = build_model(tiny_hf_config(), seed=0)
    _, llm, rope_index = split_model(model)
    sample = data.sample(index)
    items = data.vision_items([[index]])
    vision = vision_items_batch([sample] * len(items), [k for _, k in items], model.config.vision_config, sp=1)
    rows = torch.cat(model.model.get_image_features(vision["pixel_values"], vision["image_grid_thw"]).pooler_output)
    batch = pack_rows([sample])
    logits = llm(batch["input_ids"], rows, packed_position_ids(batch, rope_index))
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], sample["labels"][1:], ignore_index=IGNORE_INDEX)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    reference = model(**{k: v[None] if k in ("input_ids", "mm_token_type_ids", "labels") else v
                         for k, v in sample.items()}).loss
    reference.backward()
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=0)
    assert set(grads) == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_a_file_whose_header_claims_a_day_is_planned_and_indexed_as_the_frames_it_holds(tmp_path, tokenizer_dir):
    """A 6-frame Matroska file at 4 fps whose header says 24 hours: both halves take its 6 frames (the planner would
    price 345,600, the runtime train black frames for them)."""
    clip = write_mkv_claiming(tmp_path / "long.mkv", frames=6, fps=4, claimed_seconds=86_400)
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(_conversation("<video>\nWhat happens?", video=clip)) + "\n")
    (_, _, _, (shape,)), = scan_dataset(path, str(tokenizer_dir)).shapes
    assert shape.frames == 6
    spec = model_from_hf_config(CONFIGS["qwen2.5-vl"](), "tiny")
    entry, = _indexed(path, tokenizer_dir, "qwen2.5-vl").samples
    assert entry.grids == (video_grid(len(sampled_frames(6, 4.0, FPS, spec)), 48, 64, spec),)


def test_data_root_only_leaves_rows_naming_files_outside_out_of_the_index(tmp_path, tokenizer_dir):
    from planner.contract.data_rows import OUTSIDE_DATA_ROOT
    from tests.planner.test_dataset import write_rows_reaching_outside

    path = write_rows_reaching_outside(tmp_path)
    assert len(_indexed(path, tokenizer_dir, "qwen2.5-vl").samples) == 4  # by default rows may name any file
    config = hf_config_from_dict(CONFIGS["qwen2.5-vl"]())
    data = PackedConversations(path, tokenizer_dir, config=config, dataset=dataset_info(4096), seed=0,
                               work=sample_work(CONFIGS["qwen2.5-vl"]()), data_root_only=True,
                               normalization=family_of(config).encoder.image_normalization)
    assert len(data.samples) == 1 and dict(data.skipped) == {OUTSIDE_DATA_ROOT: 3}


def _seconds(data: PackedConversations, entry) -> list[float]:
    """Each temporal group's time of a sample's clips."""
    return [t for video in conversation_of(data.rows[entry.row])[2] for t in data._clip(video, {}).seconds]


def _synthetic_layout(frames: int, config):
    """The synthetic path's layout of one clip of ``frames`` 48 x 64 frames (``layout_from_plan``)."""
    from types import SimpleNamespace

    workload = SimpleNamespace(image_sizes=(), vision_tokens=None, videos=((frames, 48, 64),), text_tokens=8,
                               module_tokens={})
    return sample_layout(workload, config)


def _contains(ids: list[int], block: list[int]) -> bool:
    return any(ids[i:i + len(block)] == block for i in range(len(ids) - len(block) + 1))


@pytest.mark.parametrize("family", list(CONFIGS))
def test_a_built_clip_is_what_the_synthetic_path_makes_for_its_size(tmp_path, tokenizer_dir, family):
    """The frame list (row 0) and the file (row 1): the same grid, pixel rows (``patchify_clip`` of the same frames:
    the list's files, the file's frames at the planner's sampled indices decoded independently here) and prompt
    ids (``SampleLayout.video_prompt`` per temporal group, with the group's timestamp ids on Qwen3-VL)."""
    path = write_video_rows(tmp_path)
    data = _indexed(path, tokenizer_dir, family)
    config = hf_config_from_dict(CONFIGS[family]())
    spec = model_from_hf_config(CONFIGS[family](), "tiny")
    with av.open(str(tmp_path / "clip.mp4")) as container:
        decoded = [frame.to_image() for frame in container.decode(video=0)]
    picked = sampled_frames(10, 4.0, FPS, spec)
    frame_lists = {0: [Image.open(tmp_path / f"f{i}.png") for i in range(6)],
                   1: [decoded[i] for i in picked] + [decoded[picked[-1]]] * (len(picked) % 2)}
    for row, frames in frame_lists.items():
        index = next(i for i, e in enumerate(data.samples) if e.row == row)
        sample = data.sample(index)
        layout = _synthetic_layout(len(frames), config)
        assert sample["video_grid_thw"].tolist() == [list(layout.grids()[0])] == [list(data.samples[index].grids[0])]
        pixels, _ = patchify_clip(frames, layout.videos[0][1:], layout_image_processor(layout))
        assert torch.equal(sample["pixel_values_videos"], pixels)
        groups = layout.grids()[0][0]
        seconds = _seconds(data, data.samples[index])
        if layout.timestamp_tokens:
            stamps = [data.chat.tokenizer(f"<{t:.1f} seconds>", add_special_tokens=False).input_ids for t in seconds]
            expected = sum((layout.video_prompt(0, s)[0][:len(s) + len(layout.video_prompt(0, [])[0]) // groups]
                            for s in stamps), [])
        else:
            expected = layout.video_prompt(0, [])[0]
        ids = sample["input_ids"].tolist()
        assert _contains(ids, expected)
        video = sample["mm_token_type_ids"] == 2
        assert int(video.sum()) == layout.num_patches // layout.merge_size**2 == expected.count(layout.video_token_id)
        assert (sample["labels"][video] == -100).all()


def test_a_packed_row_of_clips_and_images_runs_them_in_sequence_order(tmp_path, tokenizer_dir):
    """Every sample packed in one row: the vision rows are each sample's images then clips (its visual tokens'
    order), and each sample's M-RoPE positions are the model's on the sample alone with its clips' grids."""
    data = _indexed(write_video_rows(tmp_path), tokenizer_dir, "qwen3-vl")
    samples = [data.sample(i) for i in range(len(data.samples))]
    batch = pack_rows(samples)
    pixels, grid = visual_inputs(batch)
    assert grid.tolist() == [list(g) for e in data.samples for g in e.grids]
    assert len(pixels) == sum(t * h * w for e in data.samples for t, h, w in e.grids)
    _, _, rope_index = split_model(build_model(tiny_qwen3_vl_config(), seed=0))
    positions = packed_position_ids(batch, rope_index)
    at = 0
    for sample in samples:
        length = len(sample["input_ids"])
        alone, _ = rope_index(sample["input_ids"][None], mm_token_type_ids=sample["mm_token_type_ids"][None],
                              image_grid_thw=sample["image_grid_thw"], video_grid_thw=sample["video_grid_thw"])
        assert torch.equal(positions[1:, :, at:at + length], alone)
        at += length
    assert at == positions.shape[-1]


def test_clips_decode_on_the_calling_thread(tmp_path, monkeypatch):
    """The prefetch worker, forked from a rank, decodes and converts frames without FFmpeg's thread pools
    (``VIDEO_DECODE_THREADS``), which can deadlock in a forked process. H.264, as most users' clips are: FFmpeg
    decodes it with slice threads on every core unless told otherwise (the tests' MPEG-4 Part 2 clips decode on one
    thread anyway); PyAV converts frames to RGB on every core unless told otherwise."""
    threads, converter_threads, open_video = [], [], av.open

    class Recorded:
        """A container whose decoded frames record their decoder's thread count."""

        def __init__(self, *args, **kwargs):
            self.container = open_video(*args, **kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return self.container.__exit__(*exc)

        def __getattr__(self, name):
            return getattr(self.container, name)

        def decode(self, *args, **kwargs):
            for frame in self.container.decode(*args, **kwargs):
                threads.append(self.container.streams.video[0].codec_context.thread_count)
                yield Converted(frame)

    class Converted:
        """A decoded frame whose conversion to RGB records the swscale threads it was given (0: every core)."""

        def __init__(self, frame):
            self.frame = frame

        def to_image(self, **kwargs):
            converter_threads.append(kwargs.get("threads", 0))
            return self.frame.to_image(**kwargs)

    clip = tmp_path / write_mp4(tmp_path / "clip.mp4", frames=6, fps=4, width=64, height=48, codec="h264")
    monkeypatch.setattr(av, "open", Recorded)
    assert len(decode_frames(clip, (1, 4))) == 2
    assert threads and set(threads) == {VIDEO_DECODE_THREADS} == {1}
    assert converter_threads == [1, 1]


@pytest.mark.slow
def test_a_model_folder_plans_for_and_trains_on_video_rows(tmp_path, ray_cluster):
    """``plan --model FOLDER --dataset d.jsonl --fps 2`` on the tiny Qwen3-VL, then two training steps of
    ``python -m runtime plan.json --data d.jsonl --tokenizer FOLDER`` (both commands' ``main`` in this process, on
    the session's Ray cluster): finite losses, the bad videos counted."""
    import json

    from planner import cli
    from runtime import __main__ as runtime_cli

    folder = save_tokenizer(tmp_path / "model")
    (folder / "config.json").write_text(json.dumps(tiny_qwen3_vl_config()))
    data = write_video_rows(tmp_path)
    plan = tmp_path / "plan.json"
    assert cli.main(["--model", str(folder), "--gpu", "cpu", "--gpus", "2", "--dataset", str(data), "--fps", str(FPS),
                     "--global-batch", "3", "--out", str(plan)]) == 0
    metrics = tmp_path / "m.jsonl"
    assert runtime_cli.main([str(plan), "--data", str(data), "--tokenizer", str(folder), "--steps", "2", "--metrics",
                             str(metrics)]) == 0
    *steps, summary = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(steps) == 2 and all(np.isfinite(s["loss"]) for s in steps)
    assert summary["data_skipped"] == {MISSING_VIDEO: 1, MIXED_FRAME_SIZES: 1, NO_FRAMES: 1}


VIDEO_PACKED_PLANS = {
    # each pack's image, frame-list and MPEG-4 clips split over the vision SP ranks on merge units, the rows sliced
    # with their tokens over the LLM's (Qwen3-VL: DeepStack features and per-group timestamps)
    "qwen3-vl/vision_sp2__llm_sp2": dict(vision=dict(sp=2, micro_batch=2), llm=dict(sp=2, micro_batch=2)),
    # Qwen2.5-VL's windows per temporal group; the rows reach the first stage of a pipelined LLM
    "qwen2.5-vl/vision_dp2__llm_pp2": dict(vision=dict(dp=2, grad_accum=2),
                                           llm=dict(pp=2, pp_layers=[2, 2], micro_batch=2, grad_accum=2)),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(VIDEO_PACKED_PLANS))
def test_packed_parity_on_video_rows(name, tmp_path, tokenizer_dir, worker_pool):
    """Packed micro-batches of the video rows (frame lists, an MPEG-4 file, a row with an image and two clips) give
    the loss, gradients and parameters of the single-process HF model run on the same samples one at a time."""
    from runtime.training.trainer import RunOptions
    from tests.runtime.plans import make_plan
    from tests.runtime.test_parity import LR, SEED, assert_parity

    family, _ = name.split("/")
    spec = dict(VIDEO_PACKED_PLANS[name])
    plan = make_plan(spec.pop("vision"), spec.pop("llm"), learning_rate=LR, pack_tokens=512,
                     hf_config=CONFIGS[family]())
    workload = plan.workload.model_copy(update={"dataset": plan.workload.dataset.model_copy(update={"fps": FPS})})
    plan = plan.model_copy(update={"workload": workload})
    options = RunOptions(seed=SEED, data=str(write_video_rows(tmp_path)), tokenizer=str(tokenizer_dir))
    assert_parity(plan, options, worker_pool)
