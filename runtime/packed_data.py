"""Conversation data for a plan made for a dataset (``plan --dataset``): native-resolution images, samples packed
into the plan's token budget.

At start every rank indexes the file the same way (``PackedConversations``): rows become messages, image sizes come
from file headers and are resized as the processor resizes (transformers' ``smart_resize`` within the plan's
min/max pixels), each conversation is rendered through the model folder's chat template to count its tokens, and
the usable samples are packed by best-fit decreasing into packs of at most the plan's LLM-token budget
(``planner.packing``: the packer the plan was priced with). An epoch visits its packs in a seeded order, so each
sample is seen once per epoch; a step's packs are dealt to the LLM's data-parallel replicas by tokens
(``balance_packs``). Every rank thus knows every micro-batch's composition — image grids and image-token positions —
without reading a pixel, which is what the hand-off routes need. The index is cached (beside the planner's
histograms, ``planner.data_rows.cache_folder``), so a restart or a recovery reads it instead of rendering every
conversation again. Only the ranks that run a sample build it (decode, patchify, tokenize with labels).

Bad data is skipped and counted (``skipped``): malformed rows, no assistant turn, no image, a missing or unreadable
image, an aspect ratio the processor refuses, a sample longer than the budget. An image whose header reads but
whose pixels do not decode when the sample is built is trained on as a black image of its size and counted (the
packs are fixed by then on every rank). Only data with nothing usable stops the run.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

from runtime.families import family_of

from planner.data_rows import SkippedSample, cache_folder, file_key, image_header_size, media_keys
from planner.packing import balance_packs, pack_best_fit
from planner.schema import DatasetInfo
from runtime.conversations import ChatTokenizer, conversation_of, open_images, read_conversation_rows
from runtime.data import IGNORE_INDEX, Sample

INDEX_VERSION = 2
"""Format of the cached index and its key; a change makes new cache keys."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "vocab.json", "merges.txt")
"""Files of a model folder that decide how a conversation tokenizes (their modification times key the cache)."""
UNDECODED_IMAGE = "image did not decode (trained as a black image)"
"""Counted when an image whose header read fails to decode while its sample is built."""


@dataclass(kw_only=True, frozen=True)
class IndexedSample:
    """What every rank knows of a usable sample before building it."""

    row: int
    """Its row in the file."""
    length: int
    """LLM tokens."""
    image_spans: tuple[tuple[int, int], ...]
    """(first position, tokens) of each image's run of image tokens in its sequence."""
    grids: tuple[tuple[int, int, int], ...]
    """(frames, height, width) in patches of each image after the resize."""

    @property
    def image_positions(self) -> torch.Tensor:
        """Positions of its image tokens in its own sequence."""
        return torch.cat([torch.arange(a, a + n) for a, n in self.image_spans])


class PackedConversations:
    """A conversation file indexed, packed and ordered for a dataset plan (see the module docstring)."""

    def __init__(self, path: str | Path, tokenizer_dir: str | Path, *, config: Any, dataset: DatasetInfo, seed: int):
        self.path = Path(path)
        vc = config.vision_config
        self.patch_size, self.merge_size = vc.patch_size, vc.spatial_merge_size
        self.min_pixels, self.max_pixels, self.budget = dataset.min_pixels, dataset.max_pixels, dataset.pack_tokens
        self.seed = seed
        self.tokenizer_dir = Path(tokenizer_dir)
        self.chat = ChatTokenizer(tokenizer_dir, config.image_token_id)
        mean, std = family_of(config).IMAGE_NORMALIZATION
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
        """The index of the file as it is now: from the cache (``planner.data_rows.cache_folder``), keyed by the
        file, its images, the tokenizer files and the resize and patch geometry (``_index_file``), else built and
        cached (atomically: every rank of a node may build it at once); a cache that cannot be read or written is
        ignored."""
        cache = self._index_file()
        try:
            cached = json.loads(cache.read_text())
            self.skipped.update(cached["skipped"])
            return [IndexedSample(row=r, length=n, image_spans=tuple(map(tuple, spans)),
                                  grids=tuple(map(tuple, grids))) for r, n, spans, grids in cached["samples"]]
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
            partial = cache.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps({"skipped": skipped, "samples": [
                [s.row, s.length, s.image_spans, s.grids] for s in samples]}))
            os.replace(partial, cache)
        except OSError:
            pass
        return samples

    def _index_file(self) -> Path:
        """The cache file of this index: keyed by ``planner.data_rows.file_key`` (path, size, mtime) of the data file
        and of every image its rows name (an image replaced by one of another size is indexed anew), the resize and
        patch geometry, the image token and the tokenizer files' modification times."""
        key = [INDEX_VERSION, file_key(self.path), self.min_pixels, self.max_pixels, self.patch_size,
               self.merge_size, self.chat.image_token_id]
        key += media_keys(self.path.parent, self.rows, lambda row: conversation_of(row)[1])
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

    def _indexed(self, row_number: int, row: Any, sizes: dict) -> IndexedSample:
        messages, image_paths, _ = conversation_of(row)
        if not image_paths:
            raise SkippedSample("no image")
        found = [image_header_size(self.path.parent / p, sizes) for p in image_paths]
        if any(size is None for size in found):
            raise SkippedSample("missing or unreadable image")
        grids = tuple((1, h // self.patch_size, w // self.patch_size) for h, w in map(self._resized, found))
        image_tokens = [h * w // self.merge_size**2 for _, h, w in grids]
        ids = self.chat.render(messages, image_tokens)
        positions = np.flatnonzero(np.array(ids) == self.chat.image_token_id)
        if len(positions) != sum(image_tokens):
            raise SkippedSample("image markers differ from the images")
        starts = np.cumsum([0] + image_tokens[:-1])
        spans = tuple((int(positions[s]), n) for s, n in zip(starts, image_tokens))
        return IndexedSample(row=row_number, length=len(ids), image_spans=spans, grids=grids)

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

    def most_image_tokens(self, packs: int) -> int:
        """The most LLM image tokens any ``packs`` packs hold together (what a pipelined LLM's first stage pads a
        micro-batch's image rows to)."""
        per_pack = sorted((sum(n for i in pack for _, n in self.samples[i].image_spans) for pack in self.packs),
                          reverse=True)
        return sum(per_pack[:packs])

    def pack_tokens(self, pack: list[int]) -> int:
        return sum(self.samples[i].length for i in pack)

    def step_slots(self, first: int, micro_batches: int, replicas: int, per_replica: int) -> list[list[int]]:
        """The packs (sample indexes each) of a step's slots, slot ``m * replicas * per_replica + e * per_replica + i``
        being pack ``i`` of LLM replica ``e`` in micro-batch ``m``: the step's packs from position ``first`` on,
        dealt to the replicas by LLM tokens (each replica's largest first, so micro-batch ``m`` holds every
        replica's ``m``-th largest)."""
        count = micro_batches * replicas * per_replica
        packs = [self.pack(first + k) for k in range(count)]
        dealt = balance_packs([self.pack_tokens(p) for p in packs], replicas, micro_batches * per_replica)
        slots: list[list[int]] = [[] for _ in range(count)]
        for e, mine in enumerate(dealt):
            for j, k in enumerate(mine):
                m, i = divmod(j, per_replica)
                slots[(m * replicas + e) * per_replica + i] = packs[k]
        return slots

    # ---- samples ----------------------------------------------------------------------------------------------
    def sample(self, index: int) -> Sample:
        """Sample ``index`` of the index, built: pixel_values and image_grid_thw at native resolution, input_ids,
        mm_token_type_ids and labels of its whole sequence."""
        entry = self.samples[index]
        messages, image_paths, _ = conversation_of(self.rows[entry.row])
        try:
            images = open_images(self.path.parent, image_paths)
        except SkippedSample:
            self.skipped[UNDECODED_IMAGE] += 1
            images = [Image.new("RGB", (w * self.patch_size, h * self.patch_size)) for _, h, w in entry.grids]
        out = self.processor(images=images, return_tensors="pt")
        grids = tuple(map(tuple, out["image_grid_thw"].tolist()))
        if grids != entry.grids:
            raise ValueError(f"{self.path} row {entry.row}: its images are {grids} patches now, {entry.grids} when the "
                             f"data was indexed: an image changed during the run, or the index in {cache_folder()} is "
                             "stale (delete it)")
        image_tokens = [h * w // self.merge_size**2 for _, h, w in entry.grids]
        ids, labels = self.chat.tokens(messages, image_tokens)
        if len(ids) != entry.length:
            raise ValueError(f"{self.path} row {entry.row}: {len(ids)} tokens now, {entry.length} when the data was "
                             f"indexed: the tokenizer changed, or the index in {cache_folder()} is stale (delete it)")
        types = torch.tensor([1 if t == self.chat.image_token_id else 0 for t in ids], dtype=torch.int32)
        labels_t = torch.tensor(labels)
        return {"pixel_values": out["pixel_values"].float(), "image_grid_thw": out["image_grid_thw"],
                "input_ids": torch.tensor(ids), "mm_token_type_ids": types,
                "labels": labels_t.masked_fill(types.bool(), IGNORE_INDEX)}
