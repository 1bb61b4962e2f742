"""A small byte-level tokenizer with Qwen2-VL's special tokens and chat template, saved beside nothing: built in
the test (no download), ids fitting the tiny model's vocabulary (its image token 1001, vision start / end 1003 /
1004)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = {"<|im_start|>": 996, "<|im_end|>": 997, "<|endoftext|>": 998, "<|image_pad|>": 1001,
                  "<|video_pad|>": 1002, "<|vision_start|>": 1003, "<|vision_end|>": 1004}
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2-VL's chat template, reduced to images, videos and text."""


def qwen_special_tokens(hf_config: dict) -> dict[str, int]:
    """The special tokens at a Qwen2-VL-family config's ids (its image, video and vision start / end tokens), the
    chat tokens where Qwen2-VL's vocabulary puts them, 9 to 7 ids below ``<|vision_start|>`` (151643 to 151645 for
    151652), so that a byte tokenizer drives a full-size model's embedding."""
    start = hf_config["vision_start_token_id"]
    return {"<|endoftext|>": start - 9, "<|im_start|>": start - 8, "<|im_end|>": start - 7,
            "<|image_pad|>": hf_config["image_token_id"], "<|video_pad|>": hf_config["video_token_id"],
            "<|vision_start|>": start, "<|vision_end|>": hf_config["vision_end_token_id"]}


def save_tokenizer(folder: Path, special_tokens: dict[str, int] = SPECIAL_TOKENS) -> Path:
    """Write the tokenizer (one token per byte, no merges, ``special_tokens`` at their ids) and its chat template
    into ``folder``."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: i for i, symbol in enumerate(alphabet)} | special_tokens
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return folder
