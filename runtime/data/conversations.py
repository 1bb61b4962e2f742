"""Conversation data through the model folder's own tokenizer and chat template, loss on the assistant turns only.

Formats: the Qwen-VL / LLaVA conversations and the messages rows that ``planner.contract.data_rows`` reads.

The folder's tokenizer renders the conversation with its chat template; each image's ``<|image_pad|>`` becomes as
many pads as the image has merged tokens (what Qwen-VL's processor does), and each video's
``<|vision_start|><|video_pad|><|vision_end|>`` its clip's prompt (``runtime.data.packed_data``: the family's markers,
pads and timestamps). Labels are the tokens of each assistant
turn (its text and end-of-turn marker), -100 elsewhere, found by rendering the conversation up to each turn
(``ChatTokenizer``).

``ConversationData`` gives samples of a fixed-shape plan's layout: images are resized to the layout's sizes and
sequences padded or cut to its length. A sample that cannot take that shape — another image count, a sequence
whose images or first assistant token lie beyond the cut — is skipped and counted, as are malformed lines, missing
or unreadable images and conversations without an assistant turn; sample ``i`` is then the next usable row. Only
data with nothing usable stops the run. Plans made for a dataset read it at native resolution instead
(runtime.data.packed_data).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from transformers import AutoTokenizer

from planner.contract.data_rows import SkippedSample, Video, check_data_root, media_files, messages_of, read_rows
from runtime.data.samples import IGNORE_INDEX, Sample, SampleLayout, layout_image_processor, patchify

IMAGE_PAD = "<|image_pad|>"
"""The pad token Qwen-VL's chat template writes once per image."""
VISION_START, VIDEO_PAD, VISION_END = "<|vision_start|>", "<|video_pad|>", "<|vision_end|>"
VIDEO_BLOCK = VISION_START + VIDEO_PAD + VISION_END
"""What Qwen-VL's chat template writes once per video (the processor replaces it with the clip's prompt)."""
MEDIA = re.compile(f"({re.escape(IMAGE_PAD)}|{re.escape(VIDEO_BLOCK)})")


class ChatTokenizer:
    """The model folder's tokenizer and chat template: a conversation's token ids and assistant-turn labels."""

    def __init__(self, tokenizer_dir: str | Path, image_token_id: int):
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load a tokenizer from {tokenizer_dir}: {str(e).splitlines()[0]}") from None
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer in {tokenizer_dir} has no chat template: conversation data needs one")
        pad_id = self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        if pad_id != image_token_id:
            raise ValueError(f"the tokenizer in {tokenizer_dir} maps {IMAGE_PAD} to {pad_id}, the model's image token "
                             f"is {image_token_id}: give the model's own tokenizer")
        self.image_token_id = image_token_id

    def media_order(self, messages: list[dict]) -> list[str]:
        """``"image"`` or ``"video"`` for each image and video of ``messages``, in the order the chat template writes
        their markers (the order of their tokens in the sequence, whatever the order of the row's parts)."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        return ["image" if marker == IMAGE_PAD else "video" for marker in MEDIA.findall(text)]

    def render(self, messages: list[dict], image_tokens: list[int], *, generation_prompt: bool = False,
               clip_prompts: tuple[str, ...] = ()) -> list[int]:
        """Token ids of ``messages`` through the chat template, image ``i``'s pad expanded to ``image_tokens[i]``
        and video ``j``'s block replaced by ``clip_prompts[j]``."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        pieces = MEDIA.split(text)
        expanded, images, videos = pieces[0], iter(image_tokens), iter(clip_prompts)
        for marker, piece in zip(pieces[1::2], pieces[2::2]):
            media = next(images, None) if marker == IMAGE_PAD else next(videos, None)
            if media is None:
                raise SkippedSample(f"{'image' if marker == IMAGE_PAD else 'video'} markers differ from the "
                                    f"{'images' if marker == IMAGE_PAD else 'videos'}")
            expanded += (IMAGE_PAD * media if marker == IMAGE_PAD else media) + piece
        return self.tokenizer(expanded, add_special_tokens=False).input_ids

    def tokens(self, messages: list[dict], image_tokens: list[int], clip_prompts: tuple[str, ...] = ()
               ) -> tuple[list[int], list[int]]:
        """(input ids, labels): labels are the tokens each assistant turn adds to the rendered conversation."""
        ids = self.render(messages, image_tokens, clip_prompts=clip_prompts)
        if ids.count(self.image_token_id) != sum(image_tokens):
            raise SkippedSample("image markers differ from the images")
        labels = [IGNORE_INDEX] * len(ids)
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                prefix = self.render(messages[:i], image_tokens, generation_prompt=True, clip_prompts=clip_prompts)
                end = len(self.render(messages[: i + 1], image_tokens, clip_prompts=clip_prompts))
                if ids[: len(prefix)] != prefix:
                    raise SkippedSample("the chat template does not render turns as prefixes")
                labels[len(prefix):end] = ids[len(prefix):end]
        return ids, labels


def conversation_of(row: Any) -> tuple[list[dict], list[str], list[Video]]:
    """(messages, image paths, videos) of a row with an assistant turn, or ``SkippedSample``."""
    messages, image_paths, videos = messages_of(row)
    if not any(m["role"] == "assistant" for m in messages):
        raise SkippedSample("no assistant turn")
    return messages, [str(p) for p in image_paths], videos


def open_images(folder: Path, paths: list[str]) -> list[Image.Image]:
    """The images (RGB, decoded), or ``SkippedSample`` when one is missing or unreadable."""
    images = []
    for p in paths:
        try:
            with Image.open(folder / p) as image:
                images.append(image.convert("RGB"))
        except (OSError, ValueError, Image.DecompressionBombError):
            raise SkippedSample("missing or unreadable image") from None
    return images


def read_conversation_rows(path: Path) -> tuple[list[Any], Counter[str]]:
    """The rows of a conversation file and the malformed-line count, or a one-line error when it has none."""
    if not path.is_file():
        raise ValueError(f"data file {path} does not exist")
    rows, malformed = read_rows(path)
    if not rows:
        raise ValueError(f"{path} holds no rows ({malformed} malformed line(s))")
    return rows, Counter({"malformed row": malformed} if malformed else {})


class ConversationData:
    """Samples of a conversation file in a fixed-shape plan's layout (see the module docstring)."""

    def __init__(self, path: str | Path, layout: SampleLayout, tokenizer_dir: str | Path, *,
                 data_root_only: bool = False):
        self.path, self.layout, self.data_root_only = Path(path), layout, data_root_only
        self.rows, self.skipped = read_conversation_rows(self.path)
        self.chat = ChatTokenizer(tokenizer_dir, layout.image_token_id)
        self.processor = layout_image_processor(layout)
        """``skipped``: rows skipped so far (this process), by reason."""
        self._seen: set[int] = set()

    def sample(self, index: int) -> Sample:
        """Sample ``index``: row ``index`` (modulo the rows), or the next usable one."""
        for k in range(len(self.rows)):
            row = (index + k) % len(self.rows)
            if row in self._seen:
                continue
            try:
                return self.build(self.rows[row])
            except SkippedSample as reason:
                self._seen.add(row)
                self.skipped[str(reason)] += 1
        raise ValueError(f"{self.path} has no usable sample for this plan: skipped {dict(self.skipped)}")

    def build(self, row: Any) -> Sample:
        """One row as a sample of the layout, or ``SkippedSample``."""
        messages, image_paths, videos = conversation_of(row)
        if self.data_root_only:
            check_data_root(self.path.parent, media_files(image_paths, videos))
        if len(image_paths) != len(self.layout.image_sizes):
            raise SkippedSample("image count differs from the plan's")
        if videos:
            raise SkippedSample("a video in a plan of images (plan the data with --dataset)")
        images = open_images(self.path.parent, image_paths)
        ids, labels = self.chat.tokens(messages, self.layout.image_tokens())
        return {**patchify(images, self.layout, self.processor), **self._fit(ids, labels)}

    def _fit(self, ids: list[int], labels: list[int]) -> Sample:
        """input_ids, mm_token_type_ids and labels of exactly the layout's length: padded, or cut after the images
        when at least one assistant token stays."""
        length = self.layout.seq_len
        image = self.layout.image_token_id
        if len(ids) > length:
            if image in ids[length:] or all(label == IGNORE_INDEX for label in labels[:length]):
                raise SkippedSample("longer than the plan's sequence")
            ids, labels = ids[:length], labels[:length]
        pad = length - len(ids)
        ids = ids + [self.layout.pad_token_id] * pad
        labels = labels + [IGNORE_INDEX] * pad
        types = [1 if t == image else 0 for t in ids]
        return {
            "input_ids": torch.tensor(ids),
            "mm_token_type_ids": torch.tensor(types, dtype=torch.int32),
            "labels": torch.tensor([IGNORE_INDEX if t else lab for lab, t in zip(labels, types)]),
        }
