"""Rows of a conversation or caption file and their images' sizes, torch-free: the planner reads a dataset's shapes
with them and the runtime its samples.

Formats, one row per JSONL line (or a JSON list of rows):

- Qwen-VL / LLaVA: ``{"image": "a.jpg" | ["a.jpg", ...], "conversations": [{"from": "human", "value": "<image>\\n..."},
  {"from": "gpt", "value": "..."}, ...]}`` (``from``: system / human / gpt; each ``<image>`` marks where an image
  goes, images without a marker open the first user turn);
- messages: ``{"messages": [{"role": "user", "content": "..." | [{"type": "image"}, {"type": "text", "text": "..."}]},
  ...], "images": [...]}``;
- captions: ``{"image": "a.jpg", "text": "..."}``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

IMAGE_MARKER = "<image>"
"""Where an image goes in a Qwen-VL / LLaVA turn."""
CACHE_ENV = "DHPLAN_CACHE_DIR"
"""Environment variable naming the folder where what was read of a dataset is cached (default
``~/.cache/dhplan/datasets``): the planner's histograms and the runtime's indexes."""
ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
"""``from`` / ``role`` values -> chat-template roles."""


class SkippedSample(ValueError):
    """A row that cannot become a sample; its message is the reason it is counted under."""


def read_rows(path: Path) -> tuple[list[Any], int]:
    """The rows of a JSONL or JSON-list file and how many lines were not JSON."""
    text = path.read_text()
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not a JSON list: {e.msg} at line {e.lineno}") from None
        return list(rows), 0
    rows, malformed = [], 0
    for line in text.splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                malformed += 1
    return rows, malformed


def _as_list(value: Any) -> list:
    return [] if value is None else value if isinstance(value, list) else [value]


def _role(value: Any) -> bool:
    """Whether ``value`` is a known role (any JSON value may stand there: a list is not hashable)."""
    return isinstance(value, str) and value in ROLES


def _message(m: Any) -> bool:
    """Whether ``m`` is a message: a known role and, if it has content, text or a list of parts."""
    return isinstance(m, dict) and _role(m.get("role")) and isinstance(m.get("content", ""), (str, list))


def messages_of(row: Any) -> tuple[list[dict], list[str]]:
    """(chat-template messages, image paths) of one row in either format."""
    if not isinstance(row, dict):
        raise SkippedSample("malformed row")
    if "messages" in row:
        messages, images = row["messages"], _as_list(row.get("images"))
        if not isinstance(messages, list) or not all(_message(m) for m in messages):
            raise SkippedSample("malformed row")
        return [{"role": ROLES[m["role"]], "content": m.get("content", "")} for m in messages], images
    turns = row.get("conversations")
    if not isinstance(turns, list) or not all(isinstance(t, dict) and _role(t.get("from")) for t in turns):
        raise SkippedSample("malformed row")
    images = _as_list(row.get("image", row.get("images")))
    messages = []
    for turn in turns:
        pieces = str(turn.get("value", "")).split(IMAGE_MARKER)
        content: list[dict] = []
        for i, piece in enumerate(pieces):
            if i:
                content.append({"type": "image"})
            if piece.strip("\n"):
                content.append({"type": "text", "text": piece.strip("\n") if i else piece.rstrip("\n")})
        messages.append({"role": ROLES[turn["from"]], "content": content})
    marked = sum(str(t.get("value", "")).count(IMAGE_MARKER) for t in turns)
    if marked < len(images):
        first_user = next((m for m in messages if m["role"] == "user"), None)
        if first_user is None:
            raise SkippedSample("malformed row")
        first_user["content"] = [{"type": "image"}] * (len(images) - marked) + first_user["content"]
    return messages, images


def image_header_size(path: Path, sizes: dict[Path, tuple[int, int] | None]) -> tuple[int, int] | None:
    """(height, width) from the file's header (PIL opens lazily: nothing is decoded), None if unreadable."""
    if path not in sizes:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(path) as image:
                width, height = image.size
            sizes[path] = (height, width)
        except (OSError, UnidentifiedImageError, ValueError, Image.DecompressionBombError):
            sizes[path] = None
    return sizes[path]


def file_key(path: Path) -> list[Any]:
    """(resolved path, size, mtime in ns) of a file, what a cache of anything read from it is keyed on; a missing or
    unreadable one is keyed as such (its row is skipped until it appears, which changes the key)."""
    try:
        stat = path.stat()
    except (OSError, ValueError):  # ValueError: a path with a NUL byte
        return [str(path), None]
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def image_keys(folder: Path, rows: list[Any], images_of: Callable[[Any], list[str]]) -> list[list[Any]]:
    """``file_key`` of every image file the rows name (``images_of(row)``, relative to ``folder``), each once, in
    order; rows ``images_of`` refuses with ``SkippedSample`` name none. A cache of what was read of the rows keyed
    on these misses when an image is replaced (by a larger one, say)."""
    images: dict[Path, None] = {}
    for row in rows:
        try:
            images.update(dict.fromkeys(folder / str(p) for p in images_of(row)))
        except SkippedSample:
            pass
    return [file_key(image) for image in images]


def cache_folder() -> Path:
    """Where dataset caches live (``CACHE_ENV``)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dhplan" / "datasets")
