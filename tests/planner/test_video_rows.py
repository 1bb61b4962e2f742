"""Video rows in a dataset (planner/contract/data_rows.py, planner/dataset.py): frame lists and video files read from headers
and container metadata, files sampled at the plan's fps as transformers' video processors sample, clips priced as
the synthetic video workload prices them, bad videos skipped with a one-line reason."""

from __future__ import annotations

import ast
import json
import math
from pathlib import Path

import numpy as np
import pytest

from planner import api
from planner.catalog import get_model
from planner.cli import main
from planner.contract.data_rows import (CACHE_ENV, MISSING_VIDEO, MIXED_FRAME_SIZES, NO_FRAMES, SHORT_CLIP, VideoShape,
                               messages_of)
from planner.dataset import DatasetHistogram, read_dataset, sample_tokens, scan_dataset
from planner.contract.workload import Workload, module_tokens, sampled_frames, video_grid
from tests.planner.video_files import write_empty_video, write_frames, write_mp4

QWEN3 = get_model("qwen3-vl-tiny")
QWEN2_5 = get_model("qwen2.5-vl-tiny")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))


def _transformers_sample_frames(module: str, cls: str):
    """``cls.sample_frames`` of transformers' ``module``, compiled from its source (the module imports torchvision,
    which the CPU venv does not install)."""
    import transformers
    import torch

    path = Path(transformers.__file__).parent / "models" / module.replace(".", "/")
    tree = ast.parse(path.with_suffix(".py").read_text())
    method = next(f for c in tree.body if isinstance(c, ast.ClassDef) and c.name == cls
                  for f in c.body if isinstance(f, ast.FunctionDef) and f.name == "sample_frames")
    namespace = {"np": np, "math": math, "torch": torch, "VideoMetadata": object, "logger": None}
    exec(compile(ast.Module(body=[method], type_ignores=[]), str(path), "exec"), namespace)
    return namespace["sample_frames"]


@pytest.mark.parametrize(("model", "module", "cls"), [
    (QWEN3, "qwen3_vl.video_processing_qwen3_vl", "Qwen3VLVideoProcessor"),
    (QWEN2_5, "qwen2_vl.video_processing_qwen2_vl", "Qwen2VLVideoProcessor"),
])
def test_files_are_sampled_as_transformers_video_processors_sample(model, module, cls):
    from types import SimpleNamespace

    sample_frames = _transformers_sample_frames(module, cls)
    video = model.vision_input.video
    processor = SimpleNamespace(fps=2, num_frames=None, min_frames=video.min_frames, max_frames=video.max_frames,
                                temporal_patch_size=model.vision_input.temporal_patch_size)
    for total in (4, 5, 9, 10, 31, 100, 2_000):
        for video_fps in (4.0, 23.976, 30.0):
            for fps in (0.5, 2.0, 3.0):
                metadata = SimpleNamespace(total_num_frames=total, fps=video_fps)
                expected = [int(i) for i in sample_frames(processor, metadata, fps=fps)]
                assert sampled_frames(total, video_fps, fps, model) == expected, (total, video_fps, fps)


def _conversation(question: str, **media) -> dict:
    return {**media, "conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": "It moves."}]}


def write_video_rows(folder: Path) -> Path:
    """A frame-list video (6 frames of 64 x 48), an MPEG-4 file (10 frames at 4 fps, 64 x 48) in the messages
    format, a row with an image and both videos, and rows with a missing file, frames of two sizes, an empty file."""
    frames = write_frames(folder, "f", [(64, 48)] * 6)
    clip = write_mp4(folder / "clip.mp4", frames=10, fps=4, width=64, height=48)
    image = write_frames(folder, "image", [(64, 64)])[0]
    mixed = write_frames(folder, "mixed", [(64, 48), (48, 64)])
    empty = write_empty_video(folder / "empty.mp4")
    rows = [
        _conversation("<video>\nWhat happens?", video=frames),
        {"messages": [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What happens?"}]},
                      {"role": "assistant", "content": "It moves."}], "videos": [clip]},
        _conversation("<image>\nA picture, <video> and <video>?", image=image, videos=[clip, frames]),
        _conversation("<video>\nWhat happens?", video="missing.mp4"),
        _conversation("<video>\nWhat happens?", video=mixed),
        _conversation("<video>\nWhat happens?", video=empty),
    ]
    path = folder / "videos.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_scan_reads_videos_from_headers_and_skips_bad_ones_with_a_reason(tmp_path):
    histogram = scan_dataset(write_video_rows(tmp_path))
    assert histogram.skipped == {MISSING_VIDEO: 1, MIXED_FRAME_SIZES: 1, NO_FRAMES: 1}
    frames, clip = VideoShape(6, 48, 64, 0.0), VideoShape(10, 48, 64, 4.0)
    assert sorted((images, videos) for _, _, images, videos in histogram.shapes) == [
        ((), (frames,)), ((), (clip,)), (((64, 64),), (clip, frames))]


def test_a_video_marker_adds_no_text_and_an_unmarked_video_opens_the_first_user_turn(tmp_path):
    """The family's video prompt (markers, timestamps) is priced per clip, not as text."""
    path = write_video_rows(tmp_path)
    path.write_text(path.read_text() + json.dumps(_conversation("What happens?", image="image0.png")) + "\n")
    texts = {videos: text for _, text, _, videos in scan_dataset(path).shapes}
    image_markers = 2  # the image row's <|vision_start|><|vision_end|>, one token each in the estimate
    assert texts[(VideoShape(6, 48, 64, 0.0),)] == texts[()] - image_markers
    marked = messages_of(_conversation("<video>\nWhat happens?", video="a.mp4"))
    unmarked = messages_of(_conversation("What happens?", video="a.mp4"))
    assert marked == unmarked
    assert marked[0][0]["content"] == [{"type": "video"}, {"type": "text", "text": "What happens?"}]
    assert marked[2] == ["a.mp4"]


def _tokens(model, fps: float, text: int, images=(), videos=()) -> tuple[int, int]:
    """(vision, LLM) tokens of one sample of this shape."""
    histogram = DatasetHistogram(source="test", text_tokens="given", skipped={}, shapes=((1, text, images, videos),))
    tokens = sample_tokens(histogram, model, fps=fps)
    return int(tokens.vision[0]), int(tokens.llm[0])


@pytest.mark.parametrize(("model", "fps", "clip_frames", "grid", "clip_llm_tokens"), [
    # Qwen3-VL: the file's 2.5 s at 2 fps is int(5) frames, linspace(0, 9, 5); 5 frames of 48 x 64 within the
    # clip's 4,096..25,165,824 pixels, factor 32: 64 x 64 (t_bar 4), 3 groups of 4 x 4 patches; each group
    # 16 / 4 = 4 LLM tokens and its timestamp and markers (7 + 2).
    (QWEN3, 2.0, 5, (3, 4, 4), 3 * (4 + 9)),
    # Qwen2.5-VL: 2.5 s at 2 fps is 5 frames, floored to whole temporal patches: 4 (frames 0, 2, 5, 7); each frame
    # within 100,352..602,112 pixels, factor 28: 48 x 64 is 3,072 pixels, beta = sqrt(100,352 / 3,072) = 5.715, so
    # ceil(9.8) x ceil(13.06) merge units = 280 x 392 pixels, 20 x 28 patches; 2 groups of 140 LLM tokens, one
    # marker pair around the clip.
    (QWEN2_5, 2.0, 4, (2, 20, 28), 2 * 140 + 2),
    # at 4 fps the Qwen3-VL file keeps all 10 frames: 5 groups
    (QWEN3, 4.0, 10, (5, 4, 4), 5 * (4 + 9)),
])
def test_clip_tokens_by_hand_are_the_synthetic_video_workloads(model, fps, clip_frames, grid, clip_llm_tokens):
    clip, frames = VideoShape(10, 48, 64, 4.0), VideoShape(6, 48, 64, 0.0)
    assert video_grid(clip_frames, 48, 64, model) == grid
    groups, rows, cols = grid
    assert _tokens(model, fps, 50, videos=(clip,)) == (groups * rows * cols, 50 + clip_llm_tokens)
    synthetic = module_tokens(Workload(videos=((clip_frames, 48, 64), (6, 48, 64)), text_tokens=50, global_batch=1),
                              model)
    assert _tokens(model, fps, 50, videos=(clip, frames)) == (synthetic["vision"].tokens, synthetic["llm"].tokens)
    # beside an image of 64 x 64: Qwen3-VL's 65,536-pixel floor makes it 256 x 256, 16 x 16 patches; Qwen2.5-VL
    # rounds it to 56 x 56, 4 x 4 patches
    image_patches = 256 if model is QWEN3 else 16
    assert _tokens(model, fps, 50, ((64, 64),), (clip, frames)) == (
        synthetic["vision"].tokens + image_patches, synthetic["llm"].tokens + image_patches // 4)


def test_a_replaced_video_is_rescanned(tmp_path):
    path = write_video_rows(tmp_path)
    assert VideoShape(10, 48, 64, 4.0) in {v for *_, videos in read_dataset(path).shapes for v in videos}
    write_mp4(tmp_path / "clip.mp4", frames=20, fps=4, width=64, height=48)
    assert VideoShape(20, 48, 64, 4.0) in {v for *_, videos in read_dataset(path).shapes for v in videos}


def test_a_clip_shorter_than_a_temporal_patch_is_skipped_with_a_reason(tmp_path):
    one = write_frames(tmp_path, "one", [(64, 48)])
    two = write_frames(tmp_path, "two", [(64, 48)] * 2)
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(_conversation("<video>Q", video=v)) + "\n" for v in (one, two)))
    tokens = sample_tokens(scan_dataset(path), QWEN3)
    assert tokens.skipped == {SHORT_CLIP: 1} and len(tokens.llm) == 1


def test_plan_for_a_video_dataset_records_its_fps(tmp_path):
    out = tmp_path / "plan.json"
    assert main(["--model", "qwen3-vl-tiny", "--gpu", "cpu", "--gpus", "2", "--dataset",
                 str(write_video_rows(tmp_path)), "--fps", "4", "--out", str(out)]) == 0
    plan = api.load_plan(str(out))
    assert plan.workload.dataset.fps == 4.0 and plan.workload.dataset.samples == 3
    # the image-and-two-clips row: 256 image patches, the file's 10 frames 5 x 16, the 6-frame list 3 x 16
    assert plan.workload.dataset.tokens_per_sample["vision"].max == 256 + 5 * 16 + 3 * 16
    assert plan.workload.module_tokens["vision"] > 0
