"""The ``plan`` command: readable output, --json, files, and one-line errors with exit status 2."""

import json
import re
import subprocess
import sys

import pytest

from planner.cli import main
from planner.contract.schema import load_plan


def _run(argv, capsys):
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _fails(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    out, err = capsys.readouterr()
    assert info.value.code == 2
    assert err.startswith("plan: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and out == ""
    return err


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    result = subprocess.run([sys.executable, "-m", "planner.cli", "--model", "qwen-vl-32b", "--gpus", "16",
                             "--out", str(out)], capture_output=True, text=True)
    return result, out


def test_default_command_prints_the_layout(default_run):
    result, out = default_run
    assert result.returncode == 0, result.stderr
    text = result.stdout
    for expected in ("vision: 16 GPUs", "llm: 16 GPUs", "DP ", "ZeRO-", "recompute", "micro-batch", "grad accum",
                     "step time", "tokens/s", "MFU", "peak memory/GPU", "binding", "uniform TP", "ZeRO-3",
                     "solver OPTIMAL", f"wrote {out}"):
        assert expected in text
    assert load_plan(out).model.name == "qwen2.5-vl-32b"


def test_same_command_same_bytes(default_run, tmp_path):
    _, first = default_run
    again = tmp_path / "again.json"
    subprocess.run([sys.executable, "-m", "planner.cli", "--model", "qwen-vl-32b", "--gpus", "16", "--out",
                    str(again)], check=True, capture_output=True)
    assert again.read_bytes() == first.read_bytes()


def test_json_is_the_plan_and_nothing_else(capsys, tmp_path):
    code, out, err = _run(["--model", "qwen-vl-32b", "--gpus", "16", "--json"], capsys)
    assert code == 0 and err == ""
    doc = json.loads(out)
    assert doc["predicted"]["step_time_s"] > 0
    assert doc["predicted"]["tokens_per_s"] > 0
    assert doc["predicted"]["peak_memory_gib"] > 0
    for name in ("uniform_tp", "zero3"):
        b = doc["baselines"][name]
        assert (b["step_time_s"] is not None) != (b["infeasible"] is not None)
    assert not (tmp_path / "plan.json").exists()


def test_json_baseline_infeasible_reason(capsys):
    _, out, _ = _run(["--model", "qwen-vl-32b", "--gpus", "8", "--json"], capsys)
    assert json.loads(out)["baselines"]["zero3"]["infeasible"].startswith("does not fit")


def test_top_k_writes_ranked_files(capsys, tmp_path):
    out = tmp_path / "p.json"
    code, text, _ = _run(["--model", "qwen2.5-vl-tiny", "--gpu", "cpu", "--gpus", "2", "--top-k", "2",
                          "--out", str(out)], capsys)
    assert code == 0 and "plan #1" in text and "plan #2" in text
    assert load_plan(out).solver.rank == 1 and load_plan(tmp_path / "p-2.json").solver.rank == 2


def test_fix_and_workload_flags(capsys, tmp_path):
    out = tmp_path / "p.json"
    code, text, _ = _run(["--model", "qwen-vl-32b", "--gpus", "16", "--fix", "vision.sp=8", "--fix", "llm.tp=8",
                          "--image-size", "896x448", "--image-size", "448", "--text-tokens", "256",
                          "--global-batch", "32", "--frozen", "vision", "--out", str(out)], capsys)
    assert code == 0 and "fixed llm.tp=8 vision.sp=8" in text and "vision (frozen)" in text
    p = load_plan(out)
    assert p.workload.image_sizes == [(448, 896), (448, 448)] and p.workload.global_batch == 32
    assert p.module("vision").sp == 8 and p.module("llm").tp == 8 and p.module("vision").frozen


def test_experts_split_over_tp_alone_show_their_exchange(capsys, tmp_path):
    """ep=1 x tp=2: the experts are split over the TP pair, so the layout line says so and the times show EP."""
    code, text, _ = _run(["--model", "qwen3-vl-moe-tiny", "--gpu", "cpu", "--gpus", "2", "--global-batch", "2",
                          "--fix", "llm.tp=2", "--fix", "llm.ep=1", "--out", str(tmp_path / "e.json")], capsys)
    llm = text[text.index("llm:"):]
    assert code == 0 and "(experts over EP 1 x TP 2)" in llm and ", EP " in llm


def test_max_seq_headline(capsys, tmp_path):
    code, text, _ = _run(["--model", "qwen2.5-vl-tiny", "--gpu", "cpu", "--gpus", "2", "--global-batch", "2",
                          "--max-seq", "--out", str(tmp_path / "m.json")], capsys)
    assert code == 0 and text.startswith("longest image sequence that fits:")


CLIP_ARGS = ["--model", "qwen2.5-vl-3b", "--gpus", "1", "--global-batch", "1", "--video", "8x720x1280", "--max-seq"]
"""A clip that memory stops before the video processor's 768 frames (Qwen2.5-VL keeps ~560p per frame)."""


def _numbers(text: str) -> list[int]:
    return [int(n.replace(",", "")) for n in re.findall(r"\d[\d,]*", text)]


def test_max_seq_of_a_video_workload_names_a_clip_whose_tokens_agree(capsys, tmp_path):
    """The headline names the longest clip (frames, its length at 2 fps), never an image; its vision, LLM vision
    and LLM tokens are the workload line's, the plan JSON's and the trace's."""
    out, trace = tmp_path / "m.json", tmp_path / "t.json"
    code, text, _ = _run(CLIP_ARGS + ["--out", str(out), "--trace", str(trace)], capsys)
    head, workload = text.splitlines()[0], next(line for line in text.splitlines() if line.startswith("workload"))
    plan = load_plan(out)
    frames, height, width = plan.workload.videos[-1]
    tokens = plan.workload.module_tokens
    assert code == 0 and head.startswith(f"longest clip that fits: {frames} frames of 1280x720 video = ")
    assert "image" not in head and plan.workload.vision_tokens is None and not plan.workload.image_sizes, head
    seconds = frames / 2
    assert f" = {int(seconds // 60)} min " in head if seconds >= 60 else f" = {seconds:g} s at 2 fps" in head
    per_sample = _numbers(head.split("per sample ")[1].split(";")[0])
    assert per_sample == [tokens["vision"], plan.workload.llm_image_tokens, tokens["llm"]], head
    assert _numbers(workload)[:4] == [frames, 1280, 720, tokens["vision"]], workload
    assert f"-> {plan.workload.llm_image_tokens:,} LLM vision tokens" in workload
    assert f"= {tokens['llm']:,} LLM tokens/sample" in workload
    step = json.loads(trace.read_text())["otherData"]["step_time_s"]
    assert step == pytest.approx(plan.predicted.step_time_s, rel=1e-6)


def test_max_seq_of_a_clip_the_processor_stops_says_so(capsys, tmp_path):
    """Qwen3-VL's processor keeps a whole clip within one pixel budget: a tiny model fits its 768 frames, and the
    headline says the processor's bound, not memory, stopped it."""
    code, text, _ = _run(["--model", "qwen3-vl-tiny", "--gpu", "cpu", "--gpus", "2", "--global-batch", "2",
                          "--video-seconds", "1800", "--fps", "4", "--max-seq", "--out", str(tmp_path / "m.json")],
                         capsys)
    head = text.splitlines()[0]
    assert code == 0 and head.startswith("longest clip that fits: 768 frames of 1280x720 video = 3 min 12 s at 4 fps "
                                         "(the most a clip samples, 768: memory is not what stops it)"), head


def test_list_models_and_gpus(capsys):
    code, out, _ = _run(["--list-models"], capsys)
    assert code == 0 and "qwen2.5-vl-32b" in out and "qwen2.5-vl-tiny" in out
    code, out, _ = _run(["--list-gpus"], capsys)
    assert code == 0 and "h100-80gb" in out and "cpu" in out


def test_help_documents_the_defaults(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    assert "1344x1344" in out and "9,216 vision tokens" in out and "512 text tokens" in out and "4 samples per GPU" in out


@pytest.mark.parametrize("argv,match", [
    (["--model", "qwen-vl-23b", "--gpus", "8"], "unknown model 'qwen-vl-23b'; did you mean"),
    (["--model", "qwen-vl-32b", "--gpus", "0"], "--gpus must be between 1 and 65,536"),
    (["--model", "qwen-vl-32b", "--gpus", "-4"], "--gpus must be between 1 and 65,536"),
    (["--model", "qwen-vl-32b", "--gpus", "7", "--placement", "colocated", "--global-batch", "64", "--no-cp"],
     "usable GPU counts nearby"),
    (["--model", "qwen-vl-32b", "--gpus", "8", "--gpu", "h300"], "unknown device 'h300'"),
    (["--model", "qwen-vl-32b", "--gpus", "8", "--fix", "llm.tp=8", "--fix", "llm.tp=2"], "contradictory --fix"),
    (["--model", "qwen-vl-32b", "--gpus", "16", "--fix", "llm.tp=8", "--fix", "llm.sp=2"], "per TP rank"),
    (["--model", "qwen-vl-32b", "--gpus", "8", "--cluster", "/nonexistent/cluster.yaml"], "cannot read cluster file"),
    (["--model", "qwen-vl-32b", "--gpus", "8", "--profile", "/nonexistent/profile.json"], "cannot read profile"),
    (["--model", "qwen-vl-72b", "--gpus", "2"], "no plan fits 2 x h100-80gb"),
    (["--model", "qwen-vl-32b", "--gpus", "8", "--image-size", "12x"], "image size must be WxH"),
    (["--model", "qwen-vl-32b", "--gpus", "8", "--top-k", "0"], "--top-k must be between 1 and 20"),
    (["--model", "qwen-vl-32b", "--gpus", "8", "--vision-tokens", "1000"], "not a square grid"),
    (["--gpus", "8"], "give --model and --gpus"),
    (["--model", "qwen2-audio-7b", "--gpus", "8", "--max-seq"], "no vision encoder"),
    (["--model", "qwen-vl-32b", "--gpus", "many"], "invalid int value"),
    (["--model", "qwen-vl-32b", "--gpus", "8", "--time-limit", "0"], "--time-limit must be more than 0 and at most 3600 seconds"),
    (["--model", "qwen2.5-vl-tiny", "--gpu", "cpu", "--gpus", "2", "--out", "/nonexistent/dir/p.json"],
     "cannot write --out /nonexistent/dir/p.json"),
    (["--model", "qwen-vl-32b", "--gpus", "16", "--fix", "vision.pp=2"], "planned for the LLM only"),
    (["--model", "qwen-vl-3b", "--gpus", "8", "--fix", "llm.pp=2", "--fix", "llm.sp=1"], "ties lm_head to the embedding"),
    (["--model", "qwen-vl-32b", "--gpus", "16", "--no-pp", "--fix", "llm.virtual_stages=2"], "drop --no-pp"),
    (["--model", "qwen-vl-32b", "--gpus", "16", "--no-pp", "--fix", "llm.pp_schedule=interleaved_zb"],
     "llm.pp_schedule needs pipeline parallelism: drop --no-pp"),
    (["--model", "qwen-vl-32b", "--gpus", "16", "--fix", "llm.pp_schedule=zb"],
     "pp_schedule must be one of 1f1b, interleaved_1f1b, interleaved_zb"),
    (["--model", "qwen-vl-32b", "--gpus", "16", "--fix", "llm.pp=2", "--fix", "llm.pp_schedule=interleaved_zb",
      "--fix", "llm.virtual_stages=1"], "llm.pp_schedule=interleaved_zb runs virtual_stages >= 2 with pp > 1"),
    (["--model", "qwen-vl-32b", "--gpus", "16", "--fix", "vision.pp_schedule=interleaved_zb"],
     "planned for the LLM only"),
    (["--model", "qwen-vl-32b", "--gpus", "16", "--fix", "llm.pp_schedule=interleaved_zb"]
     + [f"--fix=llm.{pin}" for pin in ("pp=2", "dp=8", "tp=1", "sp=1", "cp=1", "zero=3", "recompute=none",
                                       "micro_batch=1")], "interleaved_zb with zero=3"),
    (["--model", "qwen-vl-32b", "--gpus", "128", "--fix", "llm.pp=128"], "128 pipeline chunks need 128 decoder layers, llm has 64"),
])
def test_errors_are_one_line_exit_2(argv, match, capsys):
    assert match in _fails(argv, capsys)


def test_bad_cluster_file_content(tmp_path, capsys):
    path = tmp_path / "cluster.json"
    path.write_text('{"device": "h100-80gb", "inter_node_bandwidth": "fast"}')
    assert "inter_node_bandwidth must be a positive number" in _fails(
        ["--model", "qwen-vl-32b", "--gpus", "8", "--cluster", str(path)], capsys)


def test_cluster_file_changes_the_device(tmp_path, capsys):
    path = tmp_path / "cluster.json"
    path.write_text('{"device": "h100-80gb", "memory_bytes": 150000000000}')
    out = tmp_path / "p.json"
    code, _, _ = _run(["--model", "qwen-vl-32b", "--gpus", "8", "--cluster", str(path), "--out", str(out)], capsys)
    assert code == 0 and load_plan(out).cluster.device.memory_bytes == 150000000000


def test_error_from_a_subprocess_has_no_traceback():
    result = subprocess.run([sys.executable, "-m", "planner.cli", "--model", "nope", "--gpus", "8"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("plan: error: unknown model 'nope'") and result.stderr.count("\n") == 1


def test_json_top_k_is_a_ranked_list(capsys):
    _, out, _ = _run(["--model", "qwen2.5-vl-tiny", "--gpu", "cpu", "--gpus", "2", "--top-k", "2", "--json"], capsys)
    docs = json.loads(out)
    assert [d["solver"]["rank"] for d in docs] == [1, 2]


def test_dataset_plan_and_its_histogram(tmp_path, capsys, monkeypatch):
    from PIL import Image

    monkeypatch.setenv("DHPLAN_CACHE_DIR", str(tmp_path / "cache"))
    rows = []
    for i, (w, h) in enumerate([(300, 200), (1920, 1080), (640, 480)]):
        Image.new("RGB", (w, h)).save(tmp_path / f"{i}.png")
        rows.append(json.dumps({"image": f"{i}.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "x" * 40 * (i + 1)}]}))
    (tmp_path / "d.jsonl").write_text("\n".join(rows + ["{broken"]) + "\n")
    argv = ["--model", "qwen-vl-32b", "--gpus", "8", "--profile", "none", "--dataset", str(tmp_path / "d.jsonl")]
    code, out, _ = _run(argv + ["--out", str(tmp_path / "p.json"), "--histogram-out", str(tmp_path / "h.json")],
                        capsys)
    assert code == 0
    assert "3 samples (skipped: 1 malformed row); text estimated as UTF-8 bytes / 4" in out
    assert "full; mean pack" in out and "(memory holds a replica's heaviest micro-batch)" in out
    _run(argv[:-1] + [str(tmp_path / "h.json"), "--out", str(tmp_path / "q.json")], capsys)
    first, again = load_plan(tmp_path / "p.json"), load_plan(tmp_path / "q.json")
    assert first.modules == again.modules and first.predicted == again.predicted
    assert _fails(argv + ["--image-size", "448x448"], capsys) == (
        "plan: error: --dataset gives every sample's shape: drop --image-size\n")
    assert "apply to --dataset" in _fails(argv[:-2] + ["--pack-tokens", "512"], capsys)
    refusal = "--max-seq lengthens one sample shape (an image or a clip); a --dataset gives"
    assert refusal in _fails(argv + ["--max-seq"], capsys)


def test_sp_inside_pipeline_stages_is_planned_when_pinned(capsys, tmp_path):
    main(["--model", "qwen-vl-32b", "--gpus", "16", "--fix", "llm.pp=2", "--fix", "llm.sp=2",
          "--out", str(tmp_path / "plan.json")])
    assert re.search(r"llm: 16 GPUs .*\n    PP 2 x DP \d+ x TP \d+ x SP 2", capsys.readouterr().out)
    llm = next(m for m in load_plan(tmp_path / "plan.json").modules if m.name == "llm")
    assert (llm.pp, llm.sp) == (2, 2)


def test_pipelined_plan_shows_its_stages_and_the_best_plan_without(capsys, tmp_path):
    argv = ["--model", "qwen-vl-32b", "--gpus", "4", "--gpu", "h200", "--gpus-per-node", "1", "--precision",
            "bf16_pure", "--image-size", "448", "--text-tokens", "128", "--global-batch", "4",
            "--out", str(tmp_path / "plan.json")]
    main(argv)
    out = capsys.readouterr().out
    assert re.search(r"llm: 4 GPUs .*\n    PP 4 x DP 1 x TP 1", out)
    assert re.search(r"    pipeline: .+ over 4 stages, decoder layers [\d/]+ \(\+embedding first", out)
    assert re.search(r"without PP +\d+\.\d+s", out) and "Megatron" in out


COMMAND_ONLY_FLAGS = {"model", "video_seconds", "video_size", "rescan", "data_root_only", "histogram_out", "placement", "fix", "top_k",
                      "max_seq", "time_limit", "json", "out", "trace", "list_models", "list_gpus"}
"""Flags that set no section field: the model, what turns into a video, the dataset's histogram file and its root switch, the arguments
of each search, and the output."""


def test_every_field_of_every_section_is_one_flag():
    from dataclasses import fields

    from planner import arguments

    dests = [arguments._dest(name, options) for _, _, flags in arguments.FLAG_GROUPS for name, options in flags]
    assert len(dests) == len(set(dests))
    section_fields = {f.name for _, section, _ in arguments.FLAG_GROUPS if section for f in fields(section)}
    assert section_fields - set(dests) == {"pack"}  # the command always packs a dataset
    assert set(dests) - section_fields == COMMAND_ONLY_FLAGS


def test_flags_fill_the_sections():
    from planner import arguments
    from planner.inputs import ClusterInputs, DatasetInputs, SearchOptions, WorkloadInputs

    args = arguments.build_parser().parse_args([
        "--model", "m", "--gpus", "4", "--gpu", "cpu", "--gpus-per-node", "2", "--cluster", "c.yaml", "--profile",
        "NONE", "--image-size", "448x224", "--images-per-sample", "2", "--video", "16x64x32", "--video-seconds", "8",
        "--fps", "1", "--text-tokens", "40", "--global-batch", "8", "--precision", "bf16_pure", "--frozen", "vision",
        "--dataset", "d.jsonl", "--tokenizer", "t", "--min-pixels", "10", "--max-pixels", "20", "--pack-tokens", "64",
        "--no-cp", "--no-pp", "--workers", "3", "--attention", "sdpa",
        "--linear-attention", "torch"])
    cluster, sections = arguments.problem_inputs(args)
    assert cluster == ClusterInputs(gpus=4, gpu="cpu", gpus_per_node=2, cluster_file="c.yaml", profile=None)
    assert sections == dict(
        workload=WorkloadInputs(image_sizes=[(224, 448)], images_per_sample=2, videos=((16, 64, 32), (8, 720, 1280)),
                                text_tokens=40, global_batch=8, precision="bf16_pure", frozen=["vision"]),
        dataset=DatasetInputs(source="d.jsonl", tokenizer="t", min_pixels=10, max_pixels=20, pack_tokens=64, fps=1.0),
        search=SearchOptions(allow_ring_cp=False, allow_pp=False, workers=3, attention="sdpa",
                             linear_attention="torch"))
    defaults, sections = arguments.problem_inputs(arguments.build_parser().parse_args(["--gpus", "4", "--workers", "1"]))
    assert (defaults, sections) == (ClusterInputs(gpus=4), dict(workload=WorkloadInputs(frozen=[]), dataset=None,
                                                                 search=SearchOptions()))
