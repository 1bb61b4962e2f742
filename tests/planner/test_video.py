"""Video workloads: a clip's vision and LLM tokens as the model's video processor and prompt make them."""

from __future__ import annotations

import pytest

from planner import api
from planner.catalog import get_model
from planner.cli import main
from planner.contract.workload import Workload, module_tokens, video_grid


def test_two_minutes_of_720p_at_2_fps_on_qwen3_vl_by_hand():
    """240 frames of 720x1280 within Qwen3-VL's 25,165,824-pixel clip budget: factor 32, beta =
    sqrt(240 x 720 x 1280 / 25,165,824) = 2.959, so 224 x 416 (7 x 13 merge units); 120 temporal groups of 14 x 26
    patches; each group adds its timestamp (7 tokens) and a vision start/end pair."""
    model = get_model("qwen3-vl-32b")
    assert video_grid(240, 720, 1280, model) == (120, 14, 26)
    tokens = module_tokens(Workload(videos=((240, 720, 1280),), text_tokens=512, global_batch=1), model)
    assert tokens["vision"].tokens == 120 * 14 * 26 == 43_680
    assert tokens["vision"].segments == (364,) * 120  # one full-attention segment per temporal group
    assert tokens["vision"].output_tokens == 10_920
    assert tokens["llm"].tokens == 512 + 10_920 + 120 * (7 + 2)


def test_qwen2_5_vl_bounds_each_frame():
    """Qwen2.5-VL resizes each frame within 100,352..602,112 pixels (its video processor's size), factor 28: 720 x
    1280 is 921,600 pixels, beta = 1.237, so 560 x 1008 = 40 x 72 patches; 16 frames are 8 temporal groups, one
    marker pair around the clip."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize  # the video one's twin

    # Qwen2VLVideoProcessor.size (its module imports torchvision, which the CPU venv does not install)
    assert smart_resize(720, 1280, 28, 128 * 28 * 28, 768 * 28 * 28) == (560, 1008)
    model = get_model("qwen2.5-vl-7b")
    assert video_grid(16, 720, 1280, model) == (8, 40, 72)
    tokens = module_tokens(Workload(videos=((16, 720, 1280),), text_tokens=100, global_batch=1), model)
    assert tokens["llm"].tokens == 100 + 8 * 40 * 72 // 4 + 2
    assert tokens["vision"].windows == 8 * 5 * 9  # 112-pixel windows (8 x 8 patches) per group, padded at edges


def test_odd_frame_counts_pad_to_whole_temporal_patches():
    assert video_grid(5, 448, 448, get_model("qwen3-vl-8b"))[0] == 3


def test_video_flags(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["--model", "qwen3-vl-tiny", "--gpu", "cpu", "--gpus", "2", "--video-seconds", "3", "--fps", "2",
                 "--video-size", "64x64", "--text-tokens", "32", "--out", str(out)]) == 0
    plan = api.load_plan(str(out))
    assert plan.workload.videos == [(6, 64, 64)] and plan.workload.image_sizes == []
    assert "a 6-frame 64x64 video" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "message"), [
    (["--video", "240x720"], "a video must be FRAMESxHxW positive integers"),
    (["--video", "2x720x1280"], "--video frames must be between 4 and 768, got 2"),
    (["--fps", "4"], "--fps and --video-size describe --video-seconds"),
    (["--video-seconds", "-1"], "--video-seconds must be between 0 and"),
])
def test_bad_video_inputs_are_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["--model", "qwen3-vl-8b", "--gpus", "8", *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_an_audio_model_has_no_video():
    with pytest.raises(ValueError, match="no vision encoder: drop .*--video"):
        api.make_problem("qwen2-audio-7b", 8, workload=api.WorkloadInputs(videos=[(16, 448, 448)]))
