"""Rows of a conversation or caption file and the sizes of their images and videos, torch-free: the planner reads a
dataset's shapes with them and the runtime its samples.

Formats, one row per JSONL line (or a JSON list of rows):

- Qwen-VL / LLaVA: ``{"image": "a.jpg" | ["a.jpg", ...], "video": VIDEO, "conversations": [{"from": "human",
  "value": "<image>\\n<video>\\n..."}, {"from": "gpt", "value": "..."}, ...]}`` (``from``: system / human / gpt; each
  ``<image>`` / ``<video>`` marks where an image / a video goes, those without a marker open the first user turn;
  ``"videos": [VIDEO, ...]`` for several);
- messages: ``{"messages": [{"role": "user", "content": "..." | [{"type": "image"}, {"type": "video"}, {"type": "text",
  "text": "..."}]}, ...], "images": [...], "videos": [VIDEO, ...]}``;
- captions: ``{"image": "a.jpg", "text": "..."}``.

A VIDEO is a video file (``"clip.mp4"``: sampled at the plan's fps as the model's video processor samples) or a list
of frame image files (``["f0.jpg", "f1.jpg", ...]``: frames already sampled, all of one size).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, NamedTuple

from planner.contract.file_io import parse_json, read_text

IMAGE_MARKER = "<image>"
"""Where an image goes in a Qwen-VL / LLaVA turn."""
VIDEO_MARKER = "<video>"
"""Where a video goes in a Qwen-VL / LLaVA turn."""
MISSING_VIDEO = "missing or unreadable video"
"""Counted for a video file PyAV cannot open (or without a video stream), or a frame that does not read."""
MIXED_FRAME_SIZES = "video frames of different sizes"
"""Counted for a frame-list video whose frames are not all of one size."""
NO_FRAMES = "video without frames"
"""Counted for a video file or frame list with no frame."""
SHORT_CLIP = "video of fewer sampled frames than one temporal patch"
"""Counted for a clip too short for the vision tower's first temporal patch."""
OUTSIDE_DATA_ROOT = "a file outside the data folder (--data-root-only)"
"""Counted, with ``--data-root-only``, for a row naming a file that resolves outside the dataset file's folder."""
CACHE_ENV = "DHPLAN_CACHE_DIR"
"""Environment variable naming the folder where what was read of a dataset is cached (default
``~/.cache/dhplan/datasets``): the planner's histograms and the runtime's indexes."""
MAX_DATASET_BYTES = 16 * 2**30
"""Largest dataset file read (16 GiB; it is read whole: the largest public conversation sets are about 1 GiB)."""
ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
"""``from`` / ``role`` values -> chat-template roles."""


class SkippedSample(ValueError):
    """A row that cannot become a sample; its message is the reason it is counted under."""


def read_rows(path: Path) -> tuple[list[Any], int]:
    """The rows of a JSONL or JSON-list file (``planner.contract.file_io``: a regular file of at most ``MAX_DATASET_BYTES``,
    rows nested at most ``MAX_DEPTH`` deep) and how many lines were not JSON (or nested deeper).

    Raises:
        ValueError: the file cannot be read, is not UTF-8, or is a JSON list that does not parse; one line.
    """
    text = read_text(path, kind="dataset", max_bytes=MAX_DATASET_BYTES)
    if text.lstrip().startswith("["):
        rows = parse_json(text, where=f"dataset {path}")
        return list(rows), 0
    rows, malformed = [], 0
    for line in text.splitlines():
        if line.strip():
            try:
                rows.append(parse_json(line, where="a row"))
            except ValueError:
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


Video = str | list[str]
"""A video as a row names it: a video file, or its frame image files."""


def _videos(value: Any) -> list[Video]:
    """The videos of a ``"videos"`` list: each a file name or a list of frame file names."""
    videos = _as_list(value)
    if not all(isinstance(v, str) or (isinstance(v, list) and all(isinstance(f, str) for f in v)) for v in videos):
        raise SkippedSample("malformed row")
    return videos


def messages_of(row: Any) -> tuple[list[dict], list[str], list[Video]]:
    """(chat-template messages, image paths, videos) of one row in either format."""
    if not isinstance(row, dict):
        raise SkippedSample("malformed row")
    return _parts_of(row)


def _parts_of(row: dict) -> tuple[list[dict], list[str], list[Video]]:
    """``messages_of`` of a row known to be a dict (images and videos in any order)."""
    if "messages" in row:
        messages, images = row["messages"], _as_list(row.get("images"))
        if not isinstance(messages, list) or not all(_message(m) for m in messages):
            raise SkippedSample("malformed row")
        return ([{"role": ROLES[m["role"]], "content": m.get("content", "")} for m in messages], images,
                _videos(row.get("videos")))
    turns = row.get("conversations")
    if not isinstance(turns, list) or not all(isinstance(t, dict) and _role(t.get("from")) for t in turns):
        raise SkippedSample("malformed row")
    images = _as_list(row.get("image", row.get("images")))
    videos = _videos([row["video"]] if "video" in row else row.get("videos"))
    messages = [{"role": ROLES[turn["from"]], "content": _turn_content(str(turn.get("value", "")))} for turn in turns]
    unmarked = {kind: len(found) - sum(str(t.get("value", "")).count(marker) for t in turns)
                for kind, marker, found in (("image", IMAGE_MARKER, images), ("video", VIDEO_MARKER, videos))}
    if any(n > 0 for n in unmarked.values()):
        first_user = next((m for m in messages if m["role"] == "user"), None)
        if first_user is None:
            raise SkippedSample("malformed row")
        first_user["content"] = ([{"type": "image"}] * max(unmarked["image"], 0)
                                 + [{"type": "video"}] * max(unmarked["video"], 0) + first_user["content"])
    return messages, images, videos


def _turn_content(value: str) -> list[dict]:
    """A Qwen-VL / LLaVA turn's text as content parts: each marker an image or video part, the text between."""
    content: list[dict] = []
    for i, piece in enumerate(re.split(f"({IMAGE_MARKER}|{VIDEO_MARKER})", value)):
        if i % 2:
            content.append({"type": "image" if piece == IMAGE_MARKER else "video"})
        elif piece.strip("\n"):
            content.append({"type": "text", "text": piece.strip("\n") if i else piece.rstrip("\n")})
    return content


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


class VideoShape(NamedTuple):
    """What a video's header says, nothing decoded."""

    frames: int
    """Frames of the file, or of the frame list."""
    height: int
    width: int
    fps: float
    """The file's frame rate (its frames are sampled at the plan's fps); 0 for a frame list (already sampled)."""


def video_shape(folder: Path, video: Video, sizes: dict[Path, tuple[int, int] | None]) -> VideoShape:
    """The shape of a video named by a row (relative to ``folder``): a frame list's from its frames' headers, a
    file's from its container and stream metadata (PyAV, imported only here; nothing is decoded).

    Raises:
        SkippedSample: ``MISSING_VIDEO``, ``MIXED_FRAME_SIZES`` or ``NO_FRAMES``.
    """
    if isinstance(video, list):
        found = {image_header_size(folder / frame, sizes) for frame in video}
        if not found:
            raise SkippedSample(NO_FRAMES)
        if None in found:
            raise SkippedSample(MISSING_VIDEO)
        if len(found) > 1:
            raise SkippedSample(MIXED_FRAME_SIZES)
        (height, width), = found
        return VideoShape(frames=len(video), height=height, width=width, fps=0.0)
    return _video_file_shape(folder / video)


HEADER_LENGTH_SLACK = 0.9
"""Share of a video file's claimed length its stream must reach for the claim to stand (rates and durations are
rounded in containers); a stream that ends sooner is counted instead (``checked_frames``)."""


def _video_file_shape(path: Path) -> VideoShape:
    """``video_shape`` of a video file: its first video stream's frame count (``stream.frames``, what transformers'
    ``read_video_pyav`` reads; from the duration where the container records none) as far as the stream bears it
    out (``checked_frames``), average rate and size."""
    import av

    frames = fps = height = width = 0
    try:
        with av.open(str(path)) as container:
            if container.streams.video:
                stream = container.streams.video[0]
                fps, frames = float(stream.average_rate or 0), stream.frames
                if not frames and fps and container.duration:
                    frames = round(container.duration / av.time_base * fps)
                if frames and fps:
                    frames = checked_frames(container, stream, frames, fps)
                height, width = stream.codec_context.height, stream.codec_context.width
    except (OSError, ValueError, av.FFmpegError):
        raise SkippedSample(MISSING_VIDEO) from None
    if not frames:
        raise SkippedSample(NO_FRAMES)
    if not fps or not height or not width:
        raise SkippedSample(MISSING_VIDEO)
    return VideoShape(frames=frames, height=height, width=width, fps=fps)


def checked_frames(container: Any, stream: Any, claimed: int, fps: float) -> int:
    """``claimed`` frames when the stream reaches the claimed last frame's time (within ``HEADER_LENGTH_SLACK``:
    one seek to the keyframe before it and the packets after, nothing decoded), else the stream's packets counted
    from its start (a header that misreports the length: a 3-frame file that says 24 hours is 3 frames)."""
    start = stream.start_time or 0
    last = start + HEADER_LENGTH_SLACK * (claimed - 1) / fps / stream.time_base
    container.seek(int(last), stream=stream, backward=True)
    if any(packet.pts is not None and packet.pts >= last for packet in container.demux(stream)):
        return claimed
    container.seek(int(start), stream=stream, backward=True)
    return sum(1 for packet in container.demux(stream) if packet.size)


def media_files(images: list[str], videos: list[Video]) -> list[str]:
    """Every file a row's images and videos name: its images, video files and frames."""
    return [str(p) for p in images] + [f for v in videos for f in (v if isinstance(v, list) else [v])]


def check_data_root(folder: Path, names: list[str]) -> None:
    """``SkippedSample(OUTSIDE_DATA_ROOT)`` when a file a row names (relative to ``folder``, or absolute) resolves,
    symlinks followed, outside ``folder``: what ``--data-root-only`` keeps reads inside, in both halves."""
    root = folder.resolve()
    for name in names:
        try:
            inside = (folder / name).resolve().is_relative_to(root)
        except (OSError, ValueError):  # a symlink loop, a NUL byte
            inside = False
        if not inside:
            raise SkippedSample(OUTSIDE_DATA_ROOT)


def file_key(path: Path) -> list[Any]:
    """(resolved path, size, mtime in ns) of a file, what a cache of anything read from it is keyed on; a missing or
    unreadable one is keyed as such (its row is skipped until it appears, which changes the key)."""
    try:
        stat = path.stat()
    except (OSError, ValueError):  # ValueError: a path with a NUL byte
        return [str(path), None]
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def media_keys(folder: Path, rows: list[Any], files_of: Callable[[Any], list[str]]) -> list[list[Any]]:
    """``file_key`` of every image, video and frame file the rows name (``files_of(row)``, relative to ``folder``),
    each once, in order; rows ``files_of`` refuses with ``SkippedSample`` name none. A cache of what was read of the
    rows keyed on these misses when a file is replaced (an image by a larger one, say)."""
    files: dict[Path, None] = {}
    for row in rows:
        try:
            files.update(dict.fromkeys(folder / str(p) for p in files_of(row)))
        except SkippedSample:
            pass
    return [file_key(file) for file in files]


def cache_folder() -> Path:
    """Where dataset caches live (``CACHE_ENV``)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dhplan" / "datasets")
