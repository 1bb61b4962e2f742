"""Conversation data (runtime/data/conversations.py): both formats, the chat template, loss on assistant turns only,
bad rows skipped and counted."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from runtime.data.conversations import ConversationData, messages_of
from runtime.data.samples import IGNORE_INDEX
from runtime.models.model import hf_config_from_dict
from runtime.run.preflight import is_conversation_file
from tests.runtime.plans import make_plan, sample_layout
from tests.runtime.tokenizer import save_tokenizer

PLAN = make_plan({}, {}, text_tokens=200)


@pytest.fixture(scope="module")
def layout():
    return sample_layout(PLAN.workload, hf_config_from_dict(PLAN.model.hf_config))


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _image(path, size=(60, 90)):
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (*size, 3), dtype=np.uint8)).save(path)
    return path.name


def _llava(image, question="What is in the picture?", answer="A red square.", **extra):
    return {"image": image, "conversations": [{"from": "human", "value": f"<image>\n{question}"},
                                               {"from": "gpt", "value": answer}], **extra}


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_both_formats_give_the_same_messages():
    llava = messages_of(_llava("a.png"))
    chat = messages_of({"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                                                                     "text": "What is in the picture?"}]},
                                     {"role": "assistant", "content": [{"type": "text", "text": "A red square."}]}],
                        "images": ["a.png"]})
    assert llava == chat
    # an image without a marker opens the first user turn
    unmarked = messages_of({"image": "a.png", "conversations": [{"from": "human", "value": "Hi"},
                                                                {"from": "gpt", "value": "Hello"}]})
    assert unmarked[0][0]["content"] == [{"type": "image"}, {"type": "text", "text": "Hi"}]


def test_loss_is_on_the_assistant_turns_only(tmp_path, layout, tokenizer_dir):
    image = _image(tmp_path / "a.png")
    row = {"image": image, "conversations": [
        {"from": "human", "value": "<image>\nWhat is in the picture?"}, {"from": "gpt", "value": "A red square."},
        {"from": "human", "value": "And its colour?"}, {"from": "gpt", "value": "Red."}]}
    data = ConversationData(_write(tmp_path / "d.jsonl", [row]), layout, tokenizer_dir)
    sample = data.sample(0)
    ids, labels, types = sample["input_ids"], sample["labels"], sample["mm_token_type_ids"]
    assert ids.shape == (layout.seq_len,) and sample["pixel_values"].shape[0] == layout.num_patches
    assert int((ids == layout.image_token_id).sum()) == layout.image_tokens()[0] == int(types.sum())
    learned = data.chat.tokenizer.decode(labels[labels != IGNORE_INDEX].tolist())
    assert learned == "A red square.<|im_end|>\nRed.<|im_end|>\n"
    text = data.chat.tokenizer.decode(ids[ids != layout.pad_token_id].tolist())
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                           "<|vision_start|><|image_pad|>") and "And its colour?" in text


def test_bad_rows_are_skipped_and_counted(tmp_path, layout, tokenizer_dir):
    good = _image(tmp_path / "a.png")
    _image(tmp_path / "b.png")
    (tmp_path / "broken.png").write_bytes(b"not a png")
    rows = ['{"conversations": [', _llava("missing.png"), _llava("broken.png"), _llava(["a.png", "b.png"]),
            {"image": good, "conversations": [{"from": "human", "value": "<image> hi"}]}, {"messages": "nope"},
            {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]},
                          {"role": "assistant", "content": "y"}], "images": [good]},
            _llava(good), _llava(good, answer="x" * 400)]
    data = ConversationData(_write(tmp_path / "d.jsonl", rows), layout, tokenizer_dir)
    first = data.sample(0)
    assert data.chat.tokenizer.decode(first["labels"][first["labels"] != IGNORE_INDEX].tolist()).startswith("A red")
    assert all(torch.equal(data.sample(i)["input_ids"], first["input_ids"]) for i in range(len(data.rows) - 1))
    assert data.skipped == {"malformed row": 2, "missing or unreadable image": 2,
                            "image count differs from the plan's": 1, "no assistant turn": 1,
                            "image markers differ from the images": 1}
    # a long answer is cut after the images, keeping the tokens that fit
    cut = data.build(_llava(good, answer="x" * 400))
    assert cut["input_ids"].shape == (layout.seq_len,) and (cut["labels"] != IGNORE_INDEX).any()


def test_data_with_nothing_usable_is_a_one_line_error(tmp_path, layout, tokenizer_dir):
    data = ConversationData(_write(tmp_path / "d.jsonl", [_llava("missing.png")]), layout, tokenizer_dir)
    with pytest.raises(ValueError, match="no usable sample for this plan: skipped {'missing or unreadable image': 1}"):
        data.sample(0)
    assert is_conversation_file(tmp_path / "d.jsonl")
    with pytest.raises(ValueError, match="no chat template|cannot load a tokenizer"):
        ConversationData(tmp_path / "d.jsonl", layout, tmp_path)


@pytest.mark.slow
def test_a_conversation_file_trains_from_the_command_line(tmp_path, tokenizer_dir, ray_cluster):
    from tests.runtime.test_cli import assert_one_line_error, run_cli

    (tmp_path / "plan.json").write_text(make_plan(dict(dp=2), dict(dp=2), text_tokens=200).to_json())
    good = _image(tmp_path / "a.png")
    data = _write(tmp_path / "d.jsonl", [_llava(good), _llava("missing.png"), _llava(good, question="Shape?")])
    env = {"RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    metrics = tmp_path / "m.jsonl"
    result = run_cli(str(tmp_path / "plan.json"), "--data", str(data), "--tokenizer", str(tokenizer_dir),
                     "--steps", "2", "--metrics", str(metrics), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert all(np.isfinite(r["loss"]) for r in rows if not r.get("summary"))
    assert rows[-1]["data_skipped"] == {"missing or unreadable image": 1}
    assert_one_line_error(run_cli(str(tmp_path / "plan.json"), "--data", str(data), "--steps", "1", env=env),
                          "give --tokenizer DIR")


def test_conversations_need_a_tokenizer_and_no_llm_sequence_parallelism(tmp_path):
    from runtime.run.preflight import check_conversations

    data = str(_write(tmp_path / "d.jsonl", [_llava("a.png")]))
    with pytest.raises(ValueError, match="give --tokenizer DIR"):
        check_conversations(PLAN, data, None)
    with pytest.raises(NotImplementedError, match="LLM sequence parallelism"):
        check_conversations(make_plan({}, dict(sp=2)), data, "tok")
    captions = str(_write(tmp_path / "c.jsonl", [{"image": "a.png", "text": "a cat"}]))
    with pytest.raises(ValueError, match="--tokenizer applies to conversation data"):
        check_conversations(PLAN, captions, "tok")
    check_conversations(PLAN, data, "tok")


def test_data_root_only_skips_rows_naming_files_outside_as_the_planner_does(tmp_path, layout, tokenizer_dir):
    from planner.contract.data_rows import OUTSIDE_DATA_ROOT
    from runtime.data.samples import CaptionData
    from tests.planner.test_dataset import write_rows_reaching_outside

    path = write_rows_reaching_outside(tmp_path)
    assert ConversationData(path, layout, tokenizer_dir).sample(1) is not None  # by default rows may name any file
    data = ConversationData(path, layout, tokenizer_dir, data_root_only=True)
    assert all(data.sample(i) is not None for i in range(4)) and data.skipped == {OUTSIDE_DATA_ROOT: 3}
    captions = _write(tmp_path / "data" / "captions.jsonl", [{"image": "in.png", "text": "a"},
                                                             {"image": "../out/out.png", "text": "b"}])
    assert len(CaptionData(captions, layout).pairs) == 2
    with pytest.raises(ValueError, match=r"image .*out\.png is outside the data folder .*--data-root-only"):
        CaptionData(captions, layout, data_root_only=True)
