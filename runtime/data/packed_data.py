"""Conversation data for a plan made for a dataset (``plan --dataset``): native-resolution images, video clips, samples
packed into the plan's token budget.

At start every rank indexes the file the same way (``PackedConversations``): rows become messages, image sizes come
from file headers and are resized as the processor resizes (transformers' ``smart_resize`` within the plan's
min/max pixels), video files are sampled at the plan's fps as the planner sampled them
(``planner.contract.workload.sampled_frames``; a frame list is taken whole) and resized by the video processor's rule
(``video_grid``), each clip's prompt is the family's (``<|vision_start|>``, its pads, ``<|vision_end|>``; on Qwen3-VL
per temporal group, after the group's ``<t seconds>`` timestamp as ``Qwen3VLProcessor`` writes it), each
conversation is rendered through the model folder's chat template to count its tokens, and the usable samples are
packed by best-fit decreasing into packs of at most the plan's LLM-token budget (``planner.contract.packing``: the packer the
plan was priced with). An epoch visits its packs in a seeded order, so each
sample is seen once per epoch; a step's packs are dealt to the LLM's data-parallel replicas by LLM work
(``balance_packs``), and each micro-batch's images and clips to the vision replicas by vision work (``assign_vision``;
``planner.cost.balance``). Every rank thus knows every micro-batch's composition (image grids and image-token positions)
without reading a pixel, which is what the hand-off routes need. The index is cached (beside the planner's
histograms, ``planner.contract.data_rows.cache_folder``), so a restart or a recovery reads it instead of rendering every
conversation again. Only the ranks that run a sample build it (decode, patchify, tokenize with labels).

Bad data is skipped and counted (``skipped``): malformed rows, no assistant turn, no image or video, a missing or
unreadable image or video, frames of mixed sizes, a clip shorter than a temporal patch, an aspect ratio the
processor refuses, a sample longer than the budget. Images and videos may come in any order in a conversation: a
sample's vision outputs are handed over in the order of their tokens (``IndexedSample.order``), as transformers'
models place them by their pad tokens' positions. An image whose header reads but
whose pixels do not decode when the sample is built is trained on as a black image of its size and counted (the
packs are fixed by then on every rank); so are a video's frames. Only data with nothing usable stops the run.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

from planner.contract.data_rows import (
    SHORT_CLIP,
    SkippedSample,
    Video,
    cache_folder,
    check_data_root,
    file_key,
    image_header_size,
    media_files,
    media_keys,
    video_shape,
)
from planner.contract.families import model_from_hf_config
from planner.contract.file_io import read_json, write_output
from planner.contract.packing import balance_packs, pack_best_fit
from planner.contract.schema import DatasetInfo
from planner.contract.workload import DEFAULT_FPS, sampled_frames, video_grid
from planner.cost.balance import SampleWork, assign_lpt
from runtime.data.conversations import (
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    ChatTokenizer,
    conversation_of,
    open_images,
    read_conversation_rows,
)
from runtime.data.samples import IGNORE_INDEX, Sample, patchify_clip

INDEX_VERSION = 4
"""Format of the cached index and its key; a change makes new cache keys (3: clips; 4: the order of images and clips)."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "vocab.json", "merges.txt")
"""Files of a model folder that decide how a conversation tokenizes (their modification times key the cache)."""
UNDECODED_IMAGE = "image did not decode (trained as a black image)"
"""Counted when an image whose header read fails to decode while its sample is built."""
UNDECODED_VIDEO = "video did not decode (trained as black frames)"
"""Counted when a video whose header read fails to decode while its sample is built."""


@dataclass(kw_only=True, frozen=True)
class IndexedSample:
    """What every rank knows of a usable sample before building it."""

    row: int
    """Its row in the file."""
    length: int
    """LLM tokens."""
    image_spans: tuple[tuple[int, int], ...]
    """(first position, tokens) of each run of visual tokens in its sequence, in sequence order (a clip has one run
    per temporal group where timestamps part them): what the hand-off fills, in order."""
    grids: tuple[tuple[int, int, int], ...]
    """(temporal patches, height, width) in patches of each image, then of each clip, after the resize."""
    clips: int = 0
    """How many of ``grids`` (the last ones) are clips."""
    order: tuple[int, ...]
    """Indexes of ``grids`` in the order their tokens run in the sequence (a video may come before an image)."""

    @property
    def image_positions(self) -> torch.Tensor:
        """Positions of its visual (image and video) tokens in its own sequence."""
        return torch.cat([torch.arange(a, a + n) for a, n in self.image_spans])


@dataclass(kw_only=True, frozen=True)
class Clip:
    """A video as its sample takes it."""

    frames: tuple[int, ...]
    """Indices of its frames in the file or frame list, padded to whole temporal patches (the last repeated)."""
    size: tuple[int, int]
    """(height, width) in pixels every frame is resized to."""
    grid: tuple[int, int, int]
    """(temporal groups, rows, cols) in patches."""
    seconds: tuple[float, ...]
    """Each temporal group's time: the mean of its first and last frame's (``Qwen3VLProcessor._calculate_timestamps``;
    a frame list's frames are taken as sampled at the plan's fps)."""


def sequence_order(kinds: list[str], images: int) -> tuple[int, ...]:
    """Indexes into a sample's grids (its ``images`` images, then its clips) of its images and clips in the order of
    ``kinds`` (``ChatTokenizer.media_order``: ``"image"`` or ``"video"`` each, in sequence order)."""
    next_image, next_clip = itertools.count(), itertools.count(images)
    return tuple(next(next_image if kind == "image" else next_clip) for kind in kinds)


def epochs_spanned(step_packs: int, epoch_packs: int) -> int:
    """The most epochs ``step_packs`` consecutive pack positions can touch, epochs of ``epoch_packs`` packs (a step
    starting at an epoch's last pack touches one more)."""
    return -(-(step_packs - 1) // epoch_packs) + 1


class PackedConversations:
    """A conversation file indexed, packed and ordered for a dataset plan (see the module docstring)."""

    def __init__(self, path: str | Path, tokenizer_dir: str | Path, *, config: Any, dataset: DatasetInfo, seed: int,
                 work: SampleWork, normalization: tuple[tuple[float, ...], tuple[float, ...]],
                 balance: str = "modules", data_root_only: bool = False):
        self.path = Path(path)
        self.data_root_only = data_root_only
        """Rows naming a file outside the data folder are skipped and counted (``check_data_root``)."""
        vc = config.vision_config
        self.patch_size, self.merge_size = vc.patch_size, vc.spatial_merge_size
        self.min_pixels, self.max_pixels, self.budget = dataset.min_pixels, dataset.max_pixels, dataset.pack_tokens
        self.seed, self.work = seed, work
        """``work``: what a vision item and an LLM pack cost (``planner.cost.balance.plan_sample_work``)."""
        self.by_tokens = balance == "tokens"
        """The earlier split (``runtime.run.preflight.BALANCE_POLICIES``): packs by LLM tokens, images with their packs."""
        self.tokenizer_dir = Path(tokenizer_dir)
        self.chat = ChatTokenizer(tokenizer_dir, config.image_token_id)
        self.video_token_id = config.video_token_id
        self.spec = model_from_hf_config(config.to_dict(), "plan")
        """The planner's view of the model: how clips are sampled and resized (one rule for both halves)."""
        self.fps = dataset.fps or DEFAULT_FPS
        self.timestamped = self.spec.vision_input.video.group_text_tokens > 2
        """Whether each temporal group has its timestamp (``runtime.data.samples.clip_sizes``' rule)."""
        mean, std = normalization  # the family's processor's (runtime.models.vision ``VisionHooks``)
        self.processor = Qwen2VLImageProcessorPil(
            patch_size=vc.patch_size, temporal_patch_size=vc.temporal_patch_size, merge_size=vc.spatial_merge_size,
            size={"shortest_edge": self.min_pixels, "longest_edge": self.max_pixels}, image_mean=list(mean),
            image_std=list(std),
        )
        self.rows, self.skipped = read_conversation_rows(self.path)
        """``skipped``: rows left out, by reason (the index's, then images that did not decode on this rank)."""
        self.samples = self._within_budget(self._cached_index())
        if not self.samples:
            raise ValueError(f"{self.path} has no usable sample for this plan: skipped {dict(self.skipped)}")
        lengths = [s.length for s in self.samples]
        self.packs = [[i] for i in range(len(lengths))] if self.budget is None else pack_best_fit(lengths, self.budget)
        """Sample indexes of each pack of an epoch (before the epoch's shuffle)."""
        self._order: tuple[int, np.ndarray] | None = None
        """(epoch, its pack order): the last epoch asked for."""

    # ---- the index ------------------------------------------------------------------------------------------
    def _cached_index(self) -> list[IndexedSample]:
        """The index of the file as it is now: from the cache (``planner.contract.data_rows.cache_folder``), keyed by the
        file, its images, the tokenizer files and the resize and patch geometry (``_index_file``), else built and
        cached (atomically: every rank of a node may build it at once); a cache that cannot be read or written is
        ignored."""
        cache = self._index_file()
        try:
            cached = read_json(cache, kind="dataset index cache")
            self.skipped.update(cached["skipped"])
            return [IndexedSample(row=r, length=n, image_spans=tuple(map(tuple, spans)),
                                  grids=tuple(map(tuple, grids)), clips=clips, order=tuple(order))
                    for r, n, spans, grids, clips, order in cached["samples"]]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        samples, sizes, skipped = [], {}, Counter()
        for row_number, row in enumerate(self.rows):
            try:
                samples.append(self._indexed(row_number, row, sizes))
            except SkippedSample as reason:
                skipped[str(reason)] += 1
        self.skipped.update(skipped)
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            write_output(cache, json.dumps({"skipped": skipped, "samples": [
                [s.row, s.length, s.image_spans, s.grids, s.clips, s.order] for s in samples]}),
                         flag="the dataset index cache")
        except (OSError, ValueError):
            pass
        return samples

    def _index_file(self) -> Path:
        """The cache file of this index: keyed by ``planner.contract.data_rows.file_key`` (path, size, mtime) of the data file
        and of every image, video and frame its rows name (an image replaced by one of another size is indexed anew),
        the resize and patch geometry, the fps, the image and video tokens and the tokenizer files' modification
        times."""
        key = [INDEX_VERSION, file_key(self.path), self.min_pixels, self.max_pixels, self.patch_size,
               self.merge_size, self.chat.image_token_id, self.video_token_id, self.fps]
        key += media_keys(self.path.parent, self.rows, lambda row: media_files(*self._media(row)[1:]))
        for name in TOKENIZER_FILES:
            file = self.tokenizer_dir / name
            key += [name, file.stat().st_mtime_ns if file.exists() else 0]
        return cache_folder() / "runtime-index" / (hashlib.sha256(json.dumps(key).encode()).hexdigest()[:32] + ".json")

    def _within_budget(self, samples: list[IndexedSample]) -> list[IndexedSample]:
        if self.budget is None:
            return samples
        kept = [s for s in samples if s.length <= self.budget]
        if len(kept) < len(samples):
            self.skipped["longer than the pack budget"] += len(samples) - len(kept)
        return kept

    def _media(self, row: Any) -> tuple[list[dict], list[str], list[Video]]:
        """``conversation_of`` a row, refused with ``data_root_only`` when it names a file outside the folder."""
        messages, image_paths, videos = conversation_of(row)
        if self.data_root_only:
            check_data_root(self.path.parent, media_files(image_paths, videos))
        return messages, image_paths, videos

    def _indexed(self, row_number: int, row: Any, sizes: dict) -> IndexedSample:
        messages, image_paths, videos = self._media(row)
        if not image_paths and not videos:
            raise SkippedSample("no image")
        found = [image_header_size(self.path.parent / p, sizes) for p in image_paths]
        if any(size is None for size in found):
            raise SkippedSample("missing or unreadable image")
        grids = tuple((1, h // self.patch_size, w // self.patch_size) for h, w in map(self._resized, found))
        image_tokens = [h * w // self.merge_size**2 for _, h, w in grids]
        clips = [self._clip(video, sizes) for video in videos]
        ids = np.array(self.chat.render(messages, image_tokens, clip_prompts=tuple(map(self._clip_prompt, clips))))
        positions = np.flatnonzero((ids == self.chat.image_token_id) | (ids == self.video_token_id))
        clip_tokens = sum(t * h * w for t, h, w in (c.grid for c in clips)) // self.merge_size**2
        if len(positions) != sum(image_tokens) + clip_tokens:
            raise SkippedSample("image markers differ from the images")
        runs = np.split(positions, np.flatnonzero(np.diff(positions) > 1) + 1)
        spans = tuple((int(run[0]), len(run)) for run in runs if len(run))
        return IndexedSample(row=row_number, length=len(ids), image_spans=spans,
                             grids=grids + tuple(c.grid for c in clips), clips=len(clips),
                             order=sequence_order(self.chat.media_order(messages), len(grids)))

    def _clip(self, video: Video, sizes: dict) -> Clip:
        """How a row's video enters its sample: the planner's frame sampling (``sampled_frames``; a frame list
        whole) and resize (``video_grid``), or ``SkippedSample``."""
        shape = video_shape(self.path.parent, video, sizes)
        frames = list(range(shape.frames)) if not shape.fps else sampled_frames(shape.frames, shape.fps, self.fps,
                                                                                self.spec)
        temporal = self.spec.vision_input.temporal_patch_size
        if len(frames) < temporal:
            raise SkippedSample(SHORT_CLIP)
        try:
            groups, rows, cols = video_grid(len(frames), shape.height, shape.width, self.spec)
        except ValueError:
            raise SkippedSample("aspect ratio the processor refuses") from None
        frames += frames[-1:] * (groups * temporal - len(frames))
        rate = shape.fps or self.fps
        seconds = tuple((frames[g * temporal] + frames[(g + 1) * temporal - 1]) / 2 / rate for g in range(groups))
        return Clip(frames=tuple(frames), size=(rows * self.patch_size, cols * self.patch_size),
                    grid=(groups, rows, cols), seconds=seconds)

    def _clip_prompt(self, clip: Clip) -> str:
        """The family's prompt of a clip (``runtime.data.samples.SampleLayout.video_prompt``'s layout): per temporal group
        ``<t seconds>`` then its pads between the vision markers, or one marker pair around every group's pads."""
        groups, rows, cols = clip.grid
        pads = rows * cols // self.merge_size**2
        if self.timestamped:
            return "".join(f"<{t:.1f} seconds>{VISION_START}{VIDEO_PAD * pads}{VISION_END}" for t in clip.seconds)
        return VISION_START + VIDEO_PAD * pads * groups + VISION_END

    def _resized(self, size: tuple[int, int]) -> tuple[int, int]:
        try:
            return smart_resize(*size, factor=self.patch_size * self.merge_size, min_pixels=self.min_pixels,
                                max_pixels=self.max_pixels)
        except ValueError:
            raise SkippedSample("aspect ratio the processor refuses") from None

    # ---- packs and steps ------------------------------------------------------------------------------------
    def pack(self, position: int) -> list[int]:
        """Sample indexes of the pack at global position ``position`` (epoch ``position // packs``, in that epoch's
        seeded order)."""
        epoch, at = divmod(position, len(self.packs))
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.packs)))
        return self.packs[int(self._order[1][at])]

    def most_image_tokens(self, packs: int, step_packs: int) -> int:
        """The most LLM image and video tokens a micro-batch of ``packs`` packs can hold (what a pipelined LLM's
        first stage pads a micro-batch's rows to), in steps of ``step_packs`` packs: a step's packs run on across
        an epoch's end, so one pack appears in it once per epoch it spans (``epochs_spanned``) and may fill a
        micro-batch that many times."""
        per_pack = sorted((sum(n for i in pack for _, n in self.samples[i].image_spans) for pack in self.packs),
                          reverse=True)
        repeats = min(packs, epochs_spanned(step_packs, len(self.packs)))
        return sum(sorted(per_pack * repeats, reverse=True)[:packs])

    def pack_tokens(self, pack: list[int]) -> int:
        return sum(self.samples[i].length for i in pack)

    def pack_work(self, pack: list[int]) -> float:
        """The LLM's work of a pack (``planner.cost.balance.SampleWork.llm``)."""
        return self.work.llm([self.samples[i].length for i in pack])

    def step_slots(self, first: int, micro_batches: int, replicas: int, per_replica: int) -> list[list[int]]:
        """The packs (sample indexes each) of a step's slots, slot ``m * replicas * per_replica + e * per_replica + i``
        being pack ``i`` of LLM replica ``e`` in micro-batch ``m``: the step's packs from position ``first`` on,
        dealt to the replicas by LLM work (by LLM tokens with ``by_tokens``; each replica's costliest first, so
        micro-batch ``m`` holds every replica's ``m``-th)."""
        count = micro_batches * replicas * per_replica
        packs = [self.pack(first + k) for k in range(count)]
        cost = self.pack_tokens if self.by_tokens else self.pack_work
        dealt = balance_packs([cost(p) for p in packs], replicas, micro_batches * per_replica)
        slots: list[list[int]] = [[] for _ in range(count)]
        for e, mine in enumerate(dealt):
            for j, k in enumerate(mine):
                m, i = divmod(j, per_replica)
                slots[(m * replicas + e) * per_replica + i] = packs[k]
        return slots

    def vision_items(self, packs: list[list[int]]) -> list[tuple[int, int]]:
        """(sample index, entry of its ``grids``) of every image and clip of ``packs``, in the order the LLM's rows
        place their tokens: pack by pack, sample by sample, each sample's images and clips in the order of their
        tokens (``IndexedSample.order``)."""
        return [(i, k) for pack in packs for i in pack for k in self.samples[i].order]

    def assign_vision(self, packs: list[list[int]], replicas: int) -> list[list[int]]:
        """Which of the images and clips of a micro-batch's ``packs`` (``vision_items``) each vision replica runs:
        longest processing time first on their vision work (``planner.cost.balance.assign_lpt``), the same on every rank;
        with ``by_tokens``, replica ``d`` those of the ``d``-th of ``replicas`` equal runs of packs."""
        items = self.vision_items(packs)
        if not self.by_tokens:
            return assign_lpt([self.work.vision(self.samples[i].grids[k]) for i, k in items], replicas)
        per_replica = len(packs) // replicas
        first = list(itertools.accumulate((sum(len(self.samples[i].grids) for i in p) for p in packs), initial=0))
        return [list(range(first[d * per_replica], first[(d + 1) * per_replica])) for d in range(replicas)]

    # ---- samples ----------------------------------------------------------------------------------------------
    def sample(self, index: int) -> Sample:
        """Sample ``index`` of the index, built: pixel_values and image_grid_thw at native resolution (and with clips
        in the data pixel_values_videos and video_grid_thw, empty where the sample has none), input_ids,
        mm_token_type_ids and labels of its whole sequence."""
        entry = self.samples[index]
        messages, image_paths, videos = conversation_of(self.rows[entry.row])
        image_grids = entry.grids[:len(entry.grids) - entry.clips]
        sample = self._images(entry, image_paths, image_grids)
        clips = [self._clip(video, {}) for video in videos]
        if any(s.clips for s in self.samples):
            sample.update(self._clips(entry, videos, clips))
        image_tokens = [h * w // self.merge_size**2 for _, h, w in image_grids]
        ids, labels = self.chat.tokens(messages, image_tokens, tuple(map(self._clip_prompt, clips)))
        if len(ids) != entry.length:
            raise ValueError(f"{self.path} row {entry.row}: {len(ids)} tokens now, {entry.length} when the data was "
                             f"indexed: the tokenizer changed, or the index in {cache_folder()} is stale (delete it)")
        ids_t = torch.tensor(ids)
        types = ((ids_t == self.chat.image_token_id).int() + 2 * (ids_t == self.video_token_id).int()).int()
        return {**sample, "input_ids": ids_t, "mm_token_type_ids": types,
                "labels": torch.tensor(labels).masked_fill(types.bool(), IGNORE_INDEX)}

    def _images(self, entry: IndexedSample, paths: list[str], grids: tuple) -> Sample:
        """pixel_values and image_grid_thw of a sample's images (empty without any)."""
        if not paths:
            width = 3 * self.processor.temporal_patch_size * self.patch_size**2
            return {"pixel_values": torch.zeros(0, width), "image_grid_thw": torch.zeros(0, 3, dtype=torch.long)}
        try:
            images = open_images(self.path.parent, paths)
        except SkippedSample:
            self.skipped[UNDECODED_IMAGE] += 1
            images = [Image.new("RGB", (w * self.patch_size, h * self.patch_size)) for _, h, w in grids]
        out = self.processor(images=images, return_tensors="pt")
        self._check_grids(entry, "images", tuple(map(tuple, out["image_grid_thw"].tolist())), grids)
        return {"pixel_values": out["pixel_values"].float(), "image_grid_thw": out["image_grid_thw"]}

    def _clips(self, entry: IndexedSample, videos: list[Video], clips: list[Clip]) -> Sample:
        """pixel_values_videos and video_grid_thw of a sample's clips (``patchify_clip``; empty without any)."""
        width = 3 * self.processor.temporal_patch_size * self.patch_size**2
        pixels, grids = [torch.zeros(0, width)], [torch.zeros(0, 3, dtype=torch.long)]
        for video, clip in zip(videos, clips):
            patches, grid = patchify_clip(self._frames(video, clip), clip.size, self.processor)
            pixels.append(patches)
            grids.append(grid)
        grid_thw = torch.cat(grids)
        indexed = entry.grids[len(entry.grids) - entry.clips:]
        self._check_grids(entry, "clips", tuple(map(tuple, grid_thw.tolist())), indexed)
        return {"pixel_values_videos": torch.cat(pixels), "video_grid_thw": grid_thw}

    def _frames(self, video: Video, clip: Clip) -> list[Image.Image]:
        """A clip's frames decoded (PIL for a frame list, PyAV for a file: the clip's frame indices), or black ones,
        counted, when they do not decode."""
        try:
            if isinstance(video, list):
                return open_images(self.path.parent, [video[i] for i in clip.frames])
            return decode_frames(self.path.parent / video, clip.frames)
        except (OSError, ValueError):  # SkippedSample is a ValueError
            self.skipped[UNDECODED_VIDEO] += 1
            return [Image.new("RGB", clip.size[::-1])] * len(clip.frames)

    def _check_grids(self, entry: IndexedSample, what: str, grids: tuple, indexed: tuple) -> None:
        if grids != tuple(indexed):
            raise ValueError(f"{self.path} row {entry.row}: its {what} are {grids} patches now, {indexed} when the "
                             f"data was indexed: a file changed during the run, or the index in {cache_folder()} is "
                             "stale (delete it)")


VIDEO_DECODE_THREADS = 1
"""FFmpeg threads per decoded clip, for decoding and for converting its frames to RGB (swscale). One, on the calling
thread: the prefetch worker decodes in a process forked from the rank, where FFmpeg's thread pools (PyAV's default:
threads on every core; its frame converter is kept per thread, pool included) can deadlock on what the fork
inherited (PyAV-Org/PyAV#1962; NVIDIA-TAO/tao-pytorch#109), and a node's ranks decode side by side anyway."""


def decode_frames(path: Path, indices: tuple[int, ...]) -> list[Image.Image]:
    """The frames at ``indices`` of a video file, decoded in order with PyAV (``VIDEO_DECODE_THREADS``) up to the last
    one needed.

    Raises:
        ValueError: it does not decode, or decodes fewer frames than its metadata said.
    """
    import av

    wanted, found = set(indices), {}
    try:
        with av.open(str(path)) as container:
            for stream in container.streams.video[:1]:
                stream.thread_count = VIDEO_DECODE_THREADS
            for i, frame in enumerate(container.decode(video=0)):
                if i in wanted:
                    found[i] = frame.to_image(threads=VIDEO_DECODE_THREADS)
                if i >= max(indices):
                    break
    except av.FFmpegError as e:
        raise ValueError(f"{path} does not decode: {e}") from None
    if len(found) < len(wanted):
        raise ValueError(f"{path} decodes {len(found)} of the frames {sorted(wanted)}")
    return [found[i] for i in indices]
