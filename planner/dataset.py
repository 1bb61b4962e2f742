"""A training dataset as the planner sees it: each sample's image sizes and videos' frames and sizes (read from file
headers and container metadata, never decoded) and text tokens; images resized as Qwen-VL's processor resizes, video
files sampled at the plan's fps and clips resized as the model's video processor does; packed into packs of a token
budget, priced by the mean pack (step time) and the heaviest pack (memory).

A scan is kept as a histogram (identical (text tokens, image sizes, videos) samples counted once): written to a cache
keyed by the path, size and modification time (ns) of the file, of every image, video and frame it names and of the
tokenizer.json, so the next plan of the same data reads only the histogram and a changed file is rescanned
(``--rescan`` ignores the cache), and accepted as a dataset itself (``--dataset hist.json``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from planner.contract.data_rows import (
    MAX_DATASET_BYTES,
    SHORT_CLIP,
    SkippedSample,
    VideoShape,
    cache_folder,
    check_data_root,
    file_key,
    image_header_size,
    media_files,
    media_keys,
    messages_of,
    read_rows,
    video_shape,
)
from planner.contract.file_io import parse_json, read_json, read_text, write_output
from planner.contract.models import ModelSpec
from planner.contract.packing import pack_best_fit
from planner.contract.workload import (
    DEFAULT_FPS,
    ModuleTokens,
    PackedTokens,
    Workload,
    image_windows,
    packed_workload,
    sampled_frames,
    smart_resize,
    video_grid,
    video_text_tokens,
    vision_tokens,
)
from planner.cost.balance import StepBalance

CHAT_TOKENS_PER_TURN = 5
"""Tokens Qwen2's chat template adds around each turn: ``<|im_start|>``, the role, a newline, ``<|im_end|>``,
a newline."""
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
"""The system turn Qwen2-VL's chat template adds to a conversation that has none."""
BYTES_PER_TOKEN = 4.0
"""Estimate of UTF-8 bytes per text token when no tokenizer is given (about four characters per token is the
usual figure for English under byte-level BPE vocabularies such as Qwen2's); stated in the plan when used."""
HISTOGRAM_FORMAT = "dhplan-dataset-histogram"
HISTOGRAM_VERSION = 2
"""2: each shape lists its videos."""
PERCENTILES = (50, 95)


@dataclass(frozen=True)
class DatasetReading:
    """How ``read_dataset`` read a histogram: what a re-plan reads again (``planner.replan``)."""

    path: str
    """The file given as the dataset (data, or a histogram file), absolute."""
    tokenizer: str | None
    """The folder whose tokenizer.json counted the text, absolute (None: the stated estimate)."""
    data_root_only: bool
    """Rows naming a file outside the data file's folder were skipped."""


@dataclass(kw_only=True, frozen=True)
class DatasetHistogram:
    """What a dataset's samples look like before resizing: counts of identical (text tokens, image sizes, videos)."""

    source: str
    """The file scanned."""
    text_tokens: str
    """How text tokens were counted (the tokenizer, or the stated estimate)."""
    shapes: tuple[tuple[int, int, tuple[tuple[int, int], ...], tuple[VideoShape, ...]], ...]
    """(count, text tokens incl. chat template and image markers (a video's prompt is the family's, added when
    priced), (height, width) of each image in pixels, each video's (frames, height, width, fps; 0 for frames))."""
    skipped: dict[str, int]
    """Rows that cannot be samples, by reason."""
    reading: DatasetReading | None = field(default=None, compare=False)
    """How it was read from a file (None: made in memory); not part of what it is."""

    @property
    def samples(self) -> int:
        return sum(count for count, *_ in self.shapes)

    def to_json(self) -> dict[str, Any]:
        return {"format": HISTOGRAM_FORMAT, "version": HISTOGRAM_VERSION, "source": self.source,
                "text_tokens": self.text_tokens, "skipped": self.skipped,
                "shapes": [[c, t, [list(s) for s in sizes], [list(v) for v in videos]]
                           for c, t, sizes, videos in self.shapes]}

    @classmethod
    def from_json(cls, data: Any, path: Path) -> DatasetHistogram:
        if not isinstance(data, dict) or data.get("format") != HISTOGRAM_FORMAT:
            raise ValueError(f"{path} is not a dataset histogram (no \"format\": \"{HISTOGRAM_FORMAT}\")")
        if data.get("version") != HISTOGRAM_VERSION:
            raise ValueError(f"dataset histogram {path} has version {data.get('version')!r}, this tool reads "
                             f"{HISTOGRAM_VERSION}: rescan the data")
        try:
            shapes = tuple((int(c), int(t), tuple((int(h), int(w)) for h, w in sizes),
                            tuple(VideoShape(int(f), int(h), int(w), float(fps)) for f, h, w, fps in videos))
                           for c, t, sizes, videos in data["shapes"])
            histogram = cls(source=str(data["source"]), text_tokens=str(data["text_tokens"]), shapes=shapes,
                            skipped={str(k): int(v) for k, v in data.get("skipped", {}).items()})
        except (KeyError, TypeError, ValueError, OverflowError, AttributeError):  # AttributeError: "skipped" no dict
            raise ValueError(f"dataset histogram {path} is malformed: expected shapes [[count, text_tokens, "
                             "[[height, width], ...], [[frames, height, width, fps], ...]], ...]") from None
        if any(c < 1 or t < 0 or any(h < 1 or w < 1 for h, w in sizes)
               or any(min(v[:3]) < 1 or not 0 <= v.fps < math.inf for v in videos) for c, t, sizes, videos in shapes):
            raise ValueError(f"dataset histogram {path} has a count below 1, negative text tokens, an empty image or "
                             "video, or a bad frame rate")
        return histogram


# ---- scanning ---------------------------------------------------------------------------------------------------


VISION_MARKERS = "<|vision_start|><|vision_end|>"
"""What the chat template writes around an image's pads (the pads are counted as image tokens)."""


def _texts(row: Any) -> tuple[list[tuple[str, str]], list[str], list]:
    """((kind, text) pieces to count, image paths, videos) of one row. A conversation gives one ``turn`` per message
    as Qwen2-VL's chat template renders it (``<|im_start|>role\\n...<|im_end|>\\n``, images as their markers,
    videos as nothing: the family's video prompt is counted when priced), with the default system turn the template
    adds to a conversation without one; a caption gives its text and one ``markers`` piece per image (the runtime's
    caption layout)."""
    if isinstance(row, dict) and "text" in row and "conversations" not in row and "messages" not in row:
        if "image" not in row:
            raise SkippedSample("malformed row")
        images = [str(p) for p in (row["image"] if isinstance(row["image"], list) else [row["image"]])]
        return [("caption", str(row["text"]))] + [("markers", VISION_MARKERS)] * len(images), images, []
    messages, images, videos = messages_of(row)
    if not any(m["role"] == "assistant" for m in messages):
        raise SkippedSample("no assistant turn")
    pieces = [] if messages[0]["role"] == "system" else [("turn", _turn("system", DEFAULT_SYSTEM_PROMPT))]
    for message in messages:
        content = message["content"]
        if not isinstance(content, str):
            content = "".join(_part_text(c) for c in content if isinstance(c, dict))
        pieces.append(("turn", _turn(message["role"], content)))
    return pieces, [str(p) for p in images], videos


def _part_text(part: dict) -> str:
    """What a content part adds to the counted text: an image its markers, a video nothing, text itself."""
    kind = part.get("type")
    return VISION_MARKERS if kind == "image" else "" if kind == "video" else str(part.get("text", ""))


def _turn(role: str, content: str) -> str:
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


SPECIAL_TOKENS = ("<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>")


class _TextCounter:
    """Token counts of texts: a ``tokenizers`` tokenizer.json (exact for Qwen2-VL's template and that tokenizer),
    or the estimate: UTF-8 bytes / ``BYTES_PER_TOKEN`` for text, one token per special marker, and
    ``CHAT_TOKENS_PER_TURN`` for a turn's frame."""

    def __init__(self, tokenizer_dir: str | None):
        self.tokenizer = None
        self.how = (f"estimated as UTF-8 bytes / {BYTES_PER_TOKEN:g} + {CHAT_TOKENS_PER_TURN} per chat turn "
                    "(no --tokenizer)")
        if tokenizer_dir is not None:
            path = Path(tokenizer_dir) / "tokenizer.json"
            if not path.is_file():
                raise ValueError(f"--tokenizer {tokenizer_dir} has no tokenizer.json")
            try:
                from tokenizers import Tokenizer
            except ImportError:
                raise ValueError("--tokenizer needs the `tokenizers` package: pip install tokenizers") from None
            try:
                self.tokenizer = Tokenizer.from_file(str(path))
            except Exception as e:  # the Rust library raises its own exception type
                raise ValueError(f"cannot read {path}: {str(e).splitlines()[0]}") from None
            self.how = f"counted by {path} through Qwen2-VL's chat template"

    def counts(self, pieces: list[tuple[str, str]]) -> list[int]:
        if self.tokenizer is not None:
            return [len(e.ids) for e in self.tokenizer.encode_batch([t for _, t in pieces], add_special_tokens=False)]
        return [self._estimate(kind, text) for kind, text in pieces]

    @staticmethod
    def _estimate(kind: str, text: str) -> int:
        specials = sum(text.count(t) for t in SPECIAL_TOKENS)
        for token in SPECIAL_TOKENS:
            text = text.replace(token, "")
        frame = CHAT_TOKENS_PER_TURN - 2 if kind == "turn" else 0  # the two specials of the frame are counted above
        if kind == "turn":
            text = text.split("\n", 1)[1][:-1]  # the role and the two newlines are the frame's
        return math.ceil(len(text.encode()) / BYTES_PER_TOKEN) + specials + frame


def _rows(path: Path) -> tuple[list[Any], int]:
    """``read_rows`` with a one-line error."""
    try:
        return read_rows(path)
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read dataset {path}: {e}") from None


def scan_dataset(path: Path, tokenizer_dir: str | None = None, *, data_root_only: bool = False) -> DatasetHistogram:
    """The histogram of a conversation or caption JSONL / JSON file; bad rows are counted, not raised (with
    ``data_root_only``, rows naming a file outside the file's folder too: ``check_data_root``).

    Raises:
        ValueError: the file cannot be read, or nothing in it is usable.
    """
    return _scan_rows(path, *_rows(path), tokenizer_dir, data_root_only)


def _media(path: Path, row: Any, data_root_only: bool) -> tuple[list[tuple[str, str]], list[str], list]:
    """``_texts`` of a row, refused with ``data_root_only`` when it names a file outside the data folder."""
    pieces, images, videos = _texts(row)
    if data_root_only:
        check_data_root(path.parent, media_files(images, videos))
    return pieces, images, videos


def _scan_rows(path: Path, rows: list[Any], malformed: int, tokenizer_dir: str | None,
               data_root_only: bool) -> DatasetHistogram:
    counter = _TextCounter(tokenizer_dir)
    skipped: Counter[str] = Counter({"malformed row": malformed} if malformed else {})
    sizes: dict[Path, tuple[int, int] | None] = {}
    samples: list[tuple[list[tuple[str, str]], tuple[tuple[int, int], ...], tuple[VideoShape, ...]]] = []
    for row in rows:
        try:
            pieces, images, videos = _media(path, row, data_root_only)
            found = tuple(image_header_size(path.parent / p, sizes) for p in images)
            if any(size is None for size in found):
                raise SkippedSample("missing or unreadable image")
            samples.append((pieces, found, tuple(video_shape(path.parent, v, sizes) for v in videos)))
        except SkippedSample as reason:
            skipped[str(reason)] += 1
    counts = counter.counts([piece for pieces, _, _ in samples for piece in pieces])
    shapes: Counter[tuple[int, tuple[tuple[int, int], ...], tuple[VideoShape, ...]]] = Counter()
    at = 0
    for pieces, images, videos in samples:
        shapes[(sum(counts[at:at + len(pieces)]), images, videos)] += 1
        at += len(pieces)
    if not shapes:
        raise ValueError(f"dataset {path} has no usable sample: skipped {dict(skipped) or 'no rows'}")
    return DatasetHistogram(source=str(path), text_tokens=counter.how, skipped=dict(skipped),
                            shapes=tuple((c, *shape) for shape, c in sorted(shapes.items())))


def _cache_file(path: Path, rows: list[Any], tokenizer_dir: str | None, data_root_only: bool) -> Path:
    """Where the histogram of ``path`` with these ``rows``, counted with ``tokenizer_dir``, is cached: keyed by
    ``file_key`` of the file, of each image, video and frame its rows name (with ``data_root_only``, those of the
    rows inside its folder: a scan that skips a row keys without its files) and of the tokenizer.json, so that
    replacing any of them (an image by a larger one) misses the cache."""
    key = [file_key(path)] + media_keys(
        path.parent, rows, lambda row: media_files(*_media(path, row, data_root_only)[1:]))
    if tokenizer_dir is not None:
        key.append(file_key(Path(tokenizer_dir) / "tokenizer.json"))
    return cache_folder() / (hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32] + ".json")


def read_dataset(path: str | Path, tokenizer_dir: str | None = None, *, rescan: bool = False,
                 data_root_only: bool = False) -> DatasetHistogram:
    """A dataset histogram: the file itself if it is one, else the cached scan of the data (``_cache_file``; not
    with ``rescan``), else a new scan (then cached; a cache that cannot be written is skipped). ``data_root_only``:
    rows naming a file outside the data file's folder are skipped and counted, nothing outside is read.

    Raises:
        ValueError: a missing or unreadable file, a bad histogram, or data with nothing usable; one line.
    """
    reading = DatasetReading(os.path.abspath(path), tokenizer_dir and os.path.abspath(tokenizer_dir), data_root_only)
    return replace(_read_dataset(Path(path), tokenizer_dir, rescan, data_root_only), reading=reading)


def _read_dataset(path: Path, tokenizer_dir: str | None, rescan: bool, data_root_only: bool) -> DatasetHistogram:
    if not path.is_file():
        raise ValueError(f"--dataset {path} is not a file")
    text = read_text(path, kind="--dataset", max_bytes=MAX_DATASET_BYTES)
    try:
        whole = parse_json(text, where=f"--dataset {path}")
    except ValueError:
        whole = None  # JSONL (or not JSON at all: the scan says so)
    if isinstance(whole, dict) and "shapes" in whole:
        return DatasetHistogram.from_json(whole, path)
    rows, malformed = _rows(path)
    cache = _cache_file(path, rows, tokenizer_dir, data_root_only)
    if cache.is_file() and not rescan:
        try:
            return DatasetHistogram.from_json(read_json(cache, kind="dataset cache"), cache)
        except (ValueError, OSError):
            pass  # a damaged cache entry is rescanned and rewritten
    histogram = _scan_rows(path, rows, malformed, tokenizer_dir, data_root_only)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_output(cache, json.dumps(histogram.to_json()), flag="the dataset cache")
    except OSError:
        pass
    return histogram


def write_histogram(histogram: DatasetHistogram, path: str | Path) -> None:
    write_output(path, json.dumps(histogram.to_json()), flag="--histogram-out")


# ---- tokens and packs ---------------------------------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class SampleTokens:
    """Per-sample token arrays of a dataset (one entry per sample, histogram counts expanded)."""

    vision: np.ndarray
    """Vision patches."""
    vision_squares: np.ndarray
    """Sum over the sample's images of (patches per image)^2."""
    windows: np.ndarray
    """Attention windows of the sample's images."""
    llm: np.ndarray
    """LLM tokens (text + merged image tokens)."""
    skipped: dict[str, int]
    """Samples dropped while resizing (aspect ratio), by reason."""
    shape: np.ndarray
    """Each sample's entry in ``grids``."""
    grids: tuple[tuple[tuple[int, int, int], ...], ...]
    """(temporal patches or groups, rows, cols) in patches of each image, then each clip, of a sample shape."""


def sample_tokens(histogram: DatasetHistogram, model: ModelSpec, *, fps: float = DEFAULT_FPS,
                  min_pixels: int | None = None, max_pixels: int | None = None) -> SampleTokens:
    """Each sample's tokens per module after the processor's resize of its images (between ``min_pixels`` and
    ``max_pixels``, by default the model's image processor's) and its clips (video files sampled at ``fps``,
    ``clip_frames``), the clips priced as a synthetic workload's (``planner.contract.workload``: a full-attention segment
    per temporal group, the family's prompt text per clip and per group).

    Raises:
        ValueError: the model has no vision encoder but the data has images or videos, or it has one and no sample
            has either, or no sample is left.
    """
    vi = model.vision_input
    if vi is not None and not any(images or videos for _, _, images, videos in histogram.shapes):
        skipped = f" (skipped: {histogram.skipped})" if histogram.skipped else ""
        raise ValueError(f"dataset {histogram.source} has no sample with an image or a video{skipped}, so "
                         f"{model.name}'s vision encoder would have nothing to train on: give rows that name image or "
                         "video files (\"image\": \"a.jpg\", \"video\": \"a.mp4\", relative to the dataset file)")
    if vi is not None:
        min_pixels = vi.min_pixels if min_pixels is None else min_pixels
        max_pixels = vi.max_pixels if max_pixels is None else max_pixels
    rows, skipped = [], Counter()
    for count, text, images, videos in histogram.shapes:
        if (images or videos) and vi is None:
            raise ValueError(f"{model.name} has no vision encoder and {histogram.source} has images or videos")
        try:
            grids = [smart_resize(h, w, vi.patch_size * vi.spatial_merge_size, min_pixels, max_pixels)
                     for h, w in images] if images else []
            clips = Workload(videos=tuple((clip_frames(v, fps, model), v.height, v.width) for v in videos),
                             global_batch=1)
            clip_tokens = vision_tokens(clips, model) if videos else ModuleTokens(tokens=0, segments=())
        except ValueError as reason:
            skipped[str(reason)] += count
            continue
        patches = [(h // vi.patch_size) * (w // vi.patch_size) for h, w in grids]
        items = tuple((1, h // vi.patch_size, w // vi.patch_size) for h, w in grids) + tuple(
            video_grid(*clip, model) for clip in clips.videos)
        windows = sum(image_windows(h // vi.patch_size, w // vi.patch_size, model) for h, w in grids)
        merged = sum(patches) // vi.spatial_merge_size**2 if grids else 0
        llm = text + merged + clip_tokens.output_tokens + (video_text_tokens(clips, model) if videos else 0)
        squares = sum(p * p for p in patches) + clip_tokens.squared_segments
        rows.append((count, sum(patches) + clip_tokens.tokens, squares, windows + clip_tokens.windows, llm, items))
    if not rows:
        raise ValueError(f"no sample of {histogram.source} can be resized: skipped {dict(skipped)}")
    counts = np.array([r[0] for r in rows])
    column = lambda i: np.repeat(np.array([r[i] for r in rows], dtype=np.int64), counts)  # noqa: E731
    return SampleTokens(vision=column(1), vision_squares=column(2), windows=column(3), llm=column(4),
                        skipped=dict(skipped), shape=np.repeat(np.arange(len(rows)), counts),
                        grids=tuple(r[5] for r in rows))


def clip_frames(video: VideoShape, fps: float, model: ModelSpec) -> int:
    """Frames of a clip as the model's video processor samples it: a frame list's own, a file's at ``fps``
    (``planner.contract.workload.sampled_frames``).

    Raises:
        ValueError: ``SHORT_CLIP``.
    """
    frames = video.frames if not video.fps else len(sampled_frames(video.frames, video.fps, fps, model))
    if frames < model.vision_input.temporal_patch_size:
        raise ValueError(SHORT_CLIP)
    return frames


@dataclass(kw_only=True, frozen=True)
class Packing:
    """A dataset's epoch packed for one token budget, and the statistics the plan records."""

    packed: PackedTokens
    packs: int
    """Packs per epoch."""
    samples: int
    """Samples packed (those longer than the budget are left out)."""
    too_long: int
    """Samples longer than the budget (skipped)."""
    efficiency: float | None
    """Real LLM tokens / (packs * budget); None without packing."""


def _vision_tokens(sums: dict[str, float]) -> ModuleTokens:
    return ModuleTokens(tokens=sums["vision"], segments=(), windows=sums["windows"], output_tokens=sums["merged"],
                        segment_squares=sums["vision_squares"])


def _llm_tokens(sums: dict[str, float]) -> ModuleTokens:
    return ModuleTokens(tokens=sums["llm"], segments=(), segment_squares=sums["llm_squares"])


def pack_dataset(tokens: SampleTokens, model: ModelSpec, pack_tokens: int | None) -> Packing:
    """Best-fit-decreasing packs of at most ``pack_tokens`` LLM tokens (``planner.contract.packing``), or one sample per pack
    when None: the mean pack, and per module the heaviest (most tokens, then the largest squared segments).

    Raises:
        ValueError: every sample is longer than the budget.
    """
    vision = model.vision_input is not None
    merge = model.vision_input.spatial_merge_size**2 if vision else 1
    keep = np.ones(len(tokens.llm), bool) if pack_tokens is None else tokens.llm <= pack_tokens
    if not keep.any():
        raise ValueError(f"every sample is longer than the pack budget of {pack_tokens:,} LLM tokens (the shortest "
                         f"has {int(tokens.llm.min()):,}): raise --pack-tokens")
    per_sample = {"vision": tokens.vision[keep], "vision_squares": tokens.vision_squares[keep],
                  "windows": tokens.windows[keep], "merged": tokens.vision[keep] // merge, "llm": tokens.llm[keep],
                  "llm_squares": tokens.llm[keep] ** 2}
    if pack_tokens is None:
        packs = [[i] for i in range(len(per_sample["llm"]))]
        order, starts = np.arange(len(per_sample["llm"])), np.arange(len(per_sample["llm"]))
    else:
        packs = pack_best_fit(per_sample["llm"].tolist(), pack_tokens)
        order = np.fromiter((i for p in packs for i in p), dtype=np.int64, count=len(per_sample["llm"]))
        starts = np.cumsum([0] + [len(p) for p in packs[:-1]])
    sums = {name: np.add.reduceat(values[order], starts) for name, values in per_sample.items()}
    mean = {name: float(values.mean()) for name, values in sums.items()}

    def heaviest(size: str, squares: str) -> dict[str, float]:
        pick = int(np.lexsort((sums[squares], sums[size]))[-1])
        return {name: float(values[pick]) for name, values in sums.items()}

    mean_tokens = (("llm", _llm_tokens(mean)),)
    heavy_tokens = (("llm", _llm_tokens(heaviest("llm", "llm_squares"))),)
    if vision:
        mean_tokens = (("vision", _vision_tokens(mean)),) + mean_tokens
        heavy_tokens = (("vision", _vision_tokens(heaviest("vision", "vision_squares"))),) + heavy_tokens
    count = len(starts)
    shapes, lengths = tokens.shape[keep], per_sample["llm"]
    balance = StepBalance(pack_grids=tuple(tuple(g for i in p for g in tokens.grids[shapes[i]]) for p in packs),
                          pack_lengths=tuple(tuple(int(lengths[i]) for i in p) for p in packs))
    packed = PackedTokens(mean=mean_tokens, heaviest=heavy_tokens, samples_per_pack=len(order) / count,
                          pack_tokens=pack_tokens, balance=balance)
    return Packing(packed=packed, packs=count, samples=len(order), too_long=int((~keep).sum()),
                   efficiency=None if pack_tokens is None else float(sums["llm"].sum()) / (count * pack_tokens))


def pack_budgets(tokens: SampleTokens, multiples: tuple[int, ...] = (1, 2, 4), round_to: int = 256) -> list[int]:
    """Candidate pack budgets: ``multiples`` of the longest sample's LLM tokens, rounded up to ``round_to``."""
    longest = int(tokens.llm.max())
    base = -(-longest // round_to) * round_to
    return [base * m for m in multiples]


def percentiles(values: np.ndarray) -> dict[str, float]:
    """p50, p95 and max of per-sample tokens."""
    out = {f"p{p}": float(np.percentile(values, p)) for p in PERCENTILES}
    return {**out, "max": float(values.max())}


def dataset_workload(packing: Packing, samples_per_step: int, num_gpus: int) -> Workload:
    """The cost model's workload of a packing: ``samples_per_step`` samples as packs per step, rounded to a
    multiple of the largest power of two that divides ``num_gpus`` (so every power-of-two DP degree splits it)."""
    multiple = num_gpus & -num_gpus
    packs = max(1, round(samples_per_step / packing.packed.samples_per_pack / multiple)) * multiple
    return packed_workload(packing.packed, packs)
