"""Bad input to ``python -m runtime``: one line ``runtime: error: ...``, exit status 2, no traceback, and found
before torch, Ray or transformers is imported (each case runs the CLI with those imports blocked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest

from tests.runtime.plans import make_plan, tiny_hf_config

BLOCKED = ("torch", "ray", "transformers")
WITHOUT_HEAVY_IMPORTS = (
    "import sys\n"
    f"for name in {BLOCKED!r}:\n"
    "    sys.modules[name] = None  # importing it now raises ImportError\n"
    "from runtime.__main__ import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)
TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


def run_light(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m runtime ARGS`` with torch, Ray and transformers made unimportable."""
    return subprocess.run([sys.executable, "-c", WITHOUT_HEAVY_IMPORTS, *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def write_checkpoint(folder: Path, config: dict | str, weights: bool = True) -> str:
    """A folder shaped like save_pretrained's output (the weights file is not read by the checks)."""
    folder.mkdir()
    (folder / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    if weights:
        (folder / "model.safetensors").write_bytes(b"")
    return str(folder)


def other_model_config() -> dict:
    config = tiny_hf_config()
    return {**config, "text_config": {**config["text_config"], "hidden_size": 256}}


def a_file(tmp: Path) -> str:
    (tmp / "file").write_text("x")
    return str(tmp / "file")


def a_fifo(tmp: Path) -> str:
    os.mkfifo(tmp / "fifo")
    return str(tmp / "fifo")


def not_utf8(tmp: Path) -> str:
    (tmp / "data.jsonl").write_bytes(b'{"image": "a.png", "text": "a"}\n{"image": "b.png", "text": "\xff"}\n')
    return str(tmp / "data.jsonl")


def caption_rows(tmp: Path) -> str:
    (tmp / "captions.jsonl").write_text('{"image": "a.png", "text": "a"}\n')
    return str(tmp / "captions.jsonl")


def conversations(tmp: Path) -> str:
    (tmp / "chat.jsonl").write_text('{"image": "a.png", "conversations": [{"from": "human", "value": "hi"}]}\n')
    return str(tmp / "chat.jsonl")


# (case id, extra CLI arguments built in tmp_path, the exact message after "runtime: error: " with {tmp})
CASES: list[tuple[str, Callable[[Path], list[str]], str]] = [
    ("checkpoint_missing", lambda t: ["--checkpoint", str(t / "nope")], "checkpoint {tmp}/nope does not exist"),
    ("checkpoint_is_a_file", lambda t: ["--checkpoint", a_file(t)],
     "checkpoint {tmp}/file is not a folder written by save_pretrained"),
    ("checkpoint_empty_folder", lambda t: ["--checkpoint", str(t)],
     "checkpoint {tmp} has no config.json: not a folder written by save_pretrained"),
    ("checkpoint_corrupt_config", lambda t: ["--checkpoint", write_checkpoint(t / "ck", '{"model_type": ')],
     "checkpoint config {tmp}/ck/config.json is not JSON: Expecting value at line 1"),
    ("checkpoint_config_not_an_object", lambda t: ["--checkpoint", write_checkpoint(t / "ck", "[1, 2]")],
     "checkpoint {tmp}/ck: config.json holds a list, not a JSON object"),
    ("checkpoint_without_weights", lambda t: ["--checkpoint", write_checkpoint(t / "ck", tiny_hf_config(), False)],
     "checkpoint {tmp}/ck has no weights (model.safetensors or model.safetensors.index.json)"),
    ("checkpoint_of_another_model", lambda t: ["--checkpoint", write_checkpoint(t / "ck", other_model_config())],
     "checkpoint {tmp}/ck is for another model than the plan's qwen2_5_vl: text_config.hidden_size is 256 there, "
     "128 in the plan"),
    ("metrics_in_missing_folder", lambda t: ["--metrics", str(t / "nope" / "m.jsonl")],
     "--metrics {tmp}/nope/m.jsonl: {tmp}/nope is not an existing folder"),
    ("metrics_under_a_file", lambda t: ["--metrics", a_file(t) + "/m.jsonl"],
     "--metrics {tmp}/file/m.jsonl: {tmp}/file is not an existing folder"),
    ("metrics_is_a_folder", lambda t: ["--metrics", str(t)],
     "cannot write --metrics {tmp}: it is a folder, not a regular file: give a file path"),
    ("metrics_is_a_fifo", lambda t: ["--metrics", a_fifo(t)],  # was: blocked forever opening it to write
     "cannot write --metrics {tmp}/fifo: it is a named pipe (FIFO), not a regular file: give a file path"),
    ("metrics_is_the_data", lambda t: ["--data", caption_rows(t), "--metrics", caption_rows(t)],
     "--metrics {tmp}/captions.jsonl is the same file as --data {tmp}/captions.jsonl: it would be overwritten; "
     "give --metrics a path of its own"),
    ("trace_is_the_save_folder", lambda t: ["--save", str(t / "out"), "--trace", str(t / "x" / ".." / "out")],
     "--trace {tmp}/x/../out is the same file as --save {tmp}/out: it would be overwritten; give --trace a path of "
     "its own"),
    ("save_is_a_file", lambda t: ["--save", a_file(t)], "--save {tmp}/file is a file, not a folder"),
    ("save_under_a_file", lambda t: ["--save", a_file(t) + "/out/weights"],
     "--save {tmp}/file/out/weights cannot be written: Not a directory"),
    ("data_missing", lambda t: ["--data", str(t / "nope.jsonl")], "data path {tmp}/nope.jsonl does not exist"),
    ("data_not_utf8", lambda t: ["--data", not_utf8(t)],
     "data file {tmp}/data.jsonl line 2 is not UTF-8 text: expected JSONL"),
    ("data_neither_file_nor_folder", lambda t: ["--data", a_fifo(t)],
     "data path {tmp}/fifo is neither a JSONL file nor a folder of images"),
    ("conversations_without_tokenizer", lambda t: ["--data", conversations(t)],
     "{tmp}/chat.jsonl holds conversations: give --tokenizer DIR, the model folder whose tokenizer and chat "
     "template they go through"),
    ("seed_negative", lambda t: ["--seed", "-1"],
     "--seed must be 0 to 9,223,372,036,854,775,807 (what torch and numpy seed with), got -1"),
    ("seed_huge", lambda t: ["--seed", str(10**23)],
     "--seed must be 0 to 9,223,372,036,854,775,807 (what torch and numpy seed with), got 100000000000000000000000"),
    ("balance_unknown", lambda t: ["--balance", "lpt"], "--balance must be modules or tokens, got 'lpt'"),
    ("balance_of_fixed_shapes", lambda t: ["--balance", "tokens"], "--balance tokens splits a dataset plan's packs; "
     "this plan's samples are of one fixed shape (plan with --dataset, or drop --balance)"),
    ("adapt_without_checkpoints", lambda t: ["--adapt"],
     "--adapt switches plans at checkpoints: give --checkpoint-dir and --checkpoint-every K"),
    ("adapt_zero_steps", lambda t: ["--adapt", "0"], "--adapt measures at least 1 step before re-planning, got 0"),
    ("adapt_gain_of_a_whole_step", lambda t: ["--adapt", "--adapt-min-gain", "1"],
     "--adapt-min-gain is a share of the step in [0, 1), got 1"),
    ("switch_cost_without_adapt", lambda t: ["--switch-cost", "3"],
     "--switch-cost sets how --adapt decides: give --adapt too"),
    ("memory_cap_zero", lambda t: ["--memory-cap-gib", "0"], "--memory-cap-gib must be a positive number of GiB, got 0"),
    ("memory_cap_nan", lambda t: ["--memory-cap-gib", "nan"],
     "--memory-cap-gib must be a positive number of GiB, got nan"),
    ("tokenizer_without_tokenizer_files", lambda t: ["--data", conversations(t), "--tokenizer", str(t)],
     "--tokenizer {tmp} is not a folder with a tokenizer (no tokenizer_config.json)"),
]


@pytest.fixture
def plan_path(tmp_path) -> str:
    path = tmp_path / "plans" / "plan.json"
    path.parent.mkdir()
    path.write_text(make_plan({}, {}).to_json())
    return str(path)


def assert_exactly(result: subprocess.CompletedProcess, message: str, status: int = 2) -> None:
    assert result.returncode == status, result.stderr
    assert result.stderr == f"runtime: error: {message}\n", result.stderr


@pytest.mark.parametrize("args, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_path_is_refused_in_one_line_before_torch_and_ray(tmp_path, plan_path, args, message):
    work = tmp_path / "work"
    work.mkdir()
    assert_exactly(run_light(plan_path, *args(work)), message.format(tmp=work))


def test_plan_typo_is_refused_before_torch_and_ray(tmp_path):
    plan = json.loads(make_plan({}, {}).to_json())
    plan["modules"][0]["tp"] = "two"
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    result = run_light(str(tmp_path / "plan.json"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"runtime: error: plan {tmp_path}/plan.json") and "tp" in result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr


def test_frozen_plan_is_refused_before_torch_and_ray(tmp_path):
    (tmp_path / "plan.json").write_text(make_plan(dict(frozen=True), dict(frozen=True)).to_json())
    assert_exactly(run_light(str(tmp_path / "plan.json")), "every module of the plan is frozen: nothing to train")


def test_dataset_plan_needs_conversation_data_and_is_not_dry_run(tmp_path):
    (tmp_path / "plan.json").write_text(make_plan({}, {}, pack_tokens=256).to_json())
    plan = str(tmp_path / "plan.json")
    needs_data = ("this plan was made for the dataset d.jsonl: give --data FILE of conversation or messages rows "
                  "(that file, or another like it) and --tokenizer DIR")
    assert_exactly(run_light(plan), needs_data)
    (tmp_path / "captions.jsonl").write_text(json.dumps({"image": "a.png", "text": "a cat"}) + "\n")
    assert_exactly(run_light(plan, "--data", str(tmp_path / "captions.jsonl")), needs_data)
    assert_exactly(run_light(plan, "--dry-run"), "--dry-run measures fixed-shape plans; one made for a dataset (its "
                   "heaviest pack) is not synthesised yet: plan with --image-size/--text-tokens to dry-run")


def test_torchrun_world_size_other_than_the_plans_devices(plan_path):
    assert_exactly(run_light(plan_path, env=TORCHRUN_ENV),
                   "torchrun started 3 processes but the plan uses 1 devices: run torchrun with 1 processes in all "
                   "(--nnodes x --nproc-per-node = 1)")


def test_blocked_imports_do_fail_a_run_that_passes_the_checks(plan_path):
    """The harness can fail: a good plan gets past the checks and then needs torch."""
    result = run_light(plan_path, "--steps", "1")
    assert result.returncode == 1 and "ModuleNotFoundError" in result.stderr, result.stderr


def write_config_and_weights(folder: str) -> None:
    """A stand-in for save_checkpoint: what save_pretrained leaves, or its error."""
    os.makedirs(folder, exist_ok=True)
    Path(folder, "config.json").write_text("{}")
    Path(folder, "model.safetensors").write_bytes(b"")


def test_weights_that_cannot_go_to_save_go_to_a_timestamped_folder_here(tmp_path, monkeypatch):
    from runtime.run.preflight import SavedElsewhere, save_with_fallback

    monkeypatch.chdir(tmp_path)
    Path(tmp_path, "taken").write_text("a file where the folder should be")
    with pytest.raises(SavedElsewhere, match=rf"^cannot save to {tmp_path}/taken \(.*\); the trained weights were "
                                             rf"written to {tmp_path}/dhplan-weights-\d{{8}}-\d{{6}}$") as caught:
        save_with_fallback(write_config_and_weights, str(tmp_path / "taken"))
    folder = str(caught.value).split("written to ")[-1]
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]


def test_a_save_that_leaves_no_loadable_folder_falls_back_and_one_that_never_works_says_so(tmp_path, monkeypatch):
    from runtime.run.preflight import SavedElsewhere, save_with_fallback

    monkeypatch.chdir(tmp_path)
    written = []
    with pytest.raises(SavedElsewhere):  # returned without error but wrote nothing (as save_pretrained onto a file)
        save_with_fallback(lambda folder: written.append(folder) if not written else write_config_and_weights(folder),
                           str(tmp_path / "out"))

    def disk_full(folder: str) -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match=r"nor to .*dhplan-weights-.* or .*: the trained weights are lost$"):
        save_with_fallback(disk_full, str(tmp_path / "out"))
