"""Training samples shaped like the plan's workload: synthetic, or from a local image-caption folder / JSONL.

Images go through transformers' own Qwen2-VL image processor (the PIL backend), so ``pixel_values`` are the
flattened ``C*T*P*P`` patches in merge-window order and ``image_grid_thw`` is ``(1, H/P, W/P)`` per image,
exactly as the model expects. A video clip's frames go through the same processor one by one, and consecutive
frames fill each temporal patch (``patchify_clip``): ``pixel_values_videos`` and ``video_grid_thw`` ``(T/2, H/P,
W/P)`` as the video processor lays them out. A sample's token sequence is, per image, ``<vision_start>
<image_pad>*M <vision_end>``, then per clip its prompt (``video_prompt``), then text; labels are -100 on the image
and video tokens and on padding.

Each sample is a pure function of (seed, global sample index), so every rank (and the single-process reference
in the tests) can build any sample; DP replica ``d`` of a micro-batch takes its own slice of the indices.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from planner.contract.data_rows import MAX_DATASET_BYTES, SkippedSample, check_data_root
from planner.contract.families import model_from_hf_config
from planner.contract.file_io import read_text
from planner.contract.workload import video_grid
from runtime.parallel.windows import merged_positions_per_rank

IGNORE_INDEX = -100
"""Label value the loss skips (transformers' convention)."""

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
"""Files a caption folder may hold as images (each beside a ``.txt`` caption of the same stem)."""

Sample = dict[str, torch.Tensor]
"""pixel_values [N, C*T*P*P], image_grid_thw [I, 3], input_ids [L], mm_token_type_ids [L], labels [L]; with clips,
pixel_values_videos [N_v, C*T*P*P] and video_grid_thw [V, 3]."""


@dataclass(kw_only=True, frozen=True)
class SampleLayout:
    """What every sample of a run looks like; all samples share it so micro-batches stack without padding."""

    image_sizes: tuple[tuple[int, int], ...]
    """(height, width) in pixels of each image, already multiples of patch_size * merge_size."""
    text_tokens: int
    """Text tokens per sample, including one vision start and end marker per image."""
    patch_size: int
    """Vision patch side in pixels."""
    merge_size: int
    """Patches merged per side before the LLM."""
    temporal_patch_size: int
    """Frames per temporal patch (a still image is repeated this many times)."""
    image_token_id: int
    """The ``<image_pad>`` token."""
    vision_start_token_id: int
    """The ``<vision_start>`` token."""
    vision_end_token_id: int
    """The ``<vision_end>`` token."""
    pad_token_id: int
    """Token used to pad short captions (label -100)."""
    text_ids: tuple[int, int]
    """[first, end) of the longest run of ids that are not special tokens: random and byte-level text ids are drawn
    from it (below the first special token, where a vocabulary puts them last)."""
    videos: tuple[tuple[int, int, int], ...] = ()
    """(frames, height, width) of each clip after the video processor's resize (frames a multiple of the temporal
    patch: the last frame repeated)."""
    video_token_id: int = -1
    """The ``<video_pad>`` token (unused without clips)."""
    timestamp_tokens: int = 0
    """Text tokens before each temporal group's start marker (Qwen3-VL's ``<t seconds>``), 0 where a clip has one
    marker pair around all its groups (Qwen2-VL, Qwen2.5-VL)."""
    normalization: tuple[tuple[float, ...], tuple[float, ...]] = ((), ())
    """(image_mean, image_std) the family's checkpoints normalise pixels with (runtime.models.vision
    ``VisionHooks.image_normalization``); empty: the processor's defaults."""

    def __post_init__(self) -> None:
        if self.text_tokens < 2 * len(self.image_sizes) + 1:
            raise ValueError(
                f"{self.text_tokens} text tokens cannot hold a start and end marker for each of "
                f"{len(self.image_sizes)} images plus one text token"
            )

    def image_tokens(self) -> list[int]:
        """LLM tokens each image becomes (patches / merge_size**2)."""
        return [(h // self.patch_size) * (w // self.patch_size) // self.merge_size**2 for h, w in self.image_sizes]

    def grids(self) -> list[tuple[int, int, int]]:
        """(temporal patches, rows, cols) of a sample's visual inputs in sequence order: its images, then clips."""
        images = [(1, h // self.patch_size, w // self.patch_size) for h, w in self.image_sizes]
        return images + [(f // self.temporal_patch_size, h // self.patch_size, w // self.patch_size)
                         for f, h, w in self.videos]

    def video_prompt(self, clip: int, timestamp_ids: list[int]) -> tuple[list[int], list[int]]:
        """(ids, mm_token_type_ids) of clip ``clip``'s prompt: per temporal group, ``timestamp_ids`` (its
        ``timestamp_tokens`` text ids) then ``<vision_start> <video_pad>*n <vision_end>``; without timestamps one
        marker pair around every group's pads."""
        groups, rows, cols = self.grids()[len(self.image_sizes) + clip]
        pads = rows * cols // self.merge_size**2
        if not self.timestamp_tokens:
            return ([self.vision_start_token_id] + [self.video_token_id] * groups * pads + [self.vision_end_token_id],
                    [0] + [2] * groups * pads + [0])
        ids, types = [], []
        block = [self.vision_start_token_id] + [self.video_token_id] * pads + [self.vision_end_token_id]
        for _ in range(groups):
            ids += timestamp_ids + block
            types += [0] * (len(timestamp_ids) + 1) + [2] * pads + [0]
        return ids, types

    @property
    def num_patches(self) -> int:
        """Vision patches per sample."""
        return sum(t * h * w for t, h, w in self.grids())

    @property
    def seq_len(self) -> int:
        """LLM sequence length per sample."""
        return self.text_tokens + sum(len(self.video_prompt(c, [0] * self.timestamp_tokens)[0])
                                      for c in range(len(self.videos))) + sum(self.image_tokens())

    def template_ids(self) -> torch.Tensor:
        """The token ids of every sample where it matters to the hand-off: its image and video tokens' places."""
        return token_sequence([], self)["input_ids"]

    def handoff_mask(self, ids: torch.Tensor) -> torch.Tensor:
        """Where the image and video tokens are."""
        return (ids == self.image_token_id) | (ids == self.video_token_id)

    def output_positions_per_rank(self, samples: int, config: Any, sp: int) -> list[torch.Tensor]:
        """Replica-order index of the merged tokens each of ``sp`` vision SP ranks emits for ``samples`` samples."""
        return merged_positions_per_rank(torch.tensor(self.grids() * samples), config.vision_config, sp)


def round_to_multiple(pixels: int, factor: int) -> int:
    """Nearest multiple of ``factor`` (at least one), as Qwen-VL's smart_resize rounds an image side."""
    return max(factor, round(pixels / factor) * factor)


def ordinary_ids(vocab_size: int, special: list[int]) -> tuple[int, int]:
    """[first, end) of the longest run of ids in the vocabulary that holds no special token (the earliest of equals).

    Raises:
        ValueError: the special tokens leave no ordinary id.
    """
    bounds = sorted({-1, vocab_size, *(i for i in special if 0 <= i < vocab_size)})
    first, end = max(((a + 1, b) for a, b in zip(bounds, bounds[1:])), key=lambda run: (run[1] - run[0], -run[0]))
    if end <= first:
        raise ValueError(f"the {vocab_size}-token vocabulary has no id besides the special tokens {sorted(special)}")
    return first, end


def layout_from_plan(workload: Any, config: Any, *,
                     normalization: tuple[tuple[float, ...], tuple[float, ...]]) -> SampleLayout:
    """The sample layout of a plan's workload (``plan.workload``) for an HF model config; ``normalization``: its
    family's (runtime.models.families: ``encoder.layout_from_plan`` passes it).

    Raises:
        ValueError: the workload has no image or has video clips, or its token counts disagree with the plan's.
    """
    vc = config.vision_config
    factor = vc.patch_size * vc.spatial_merge_size
    if workload.image_sizes:
        sizes = tuple((round_to_multiple(h, factor), round_to_multiple(w, factor)) for h, w in workload.image_sizes)
    elif workload.vision_tokens:
        side = math.isqrt(workload.vision_tokens) * vc.patch_size
        sizes = ((side, side),)
    elif workload.videos:
        sizes = ()
    else:
        raise ValueError("the plan's workload has no image; the runtime trains vision-language models")
    videos, timestamps = clip_sizes(workload.videos, config)
    special = [config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id]
    text_config = config.get_text_config()
    pad = text_config.pad_token_id if text_config.pad_token_id is not None else 0
    layout = SampleLayout(
        image_sizes=sizes,
        text_tokens=workload.text_tokens,
        patch_size=vc.patch_size,
        merge_size=vc.spatial_merge_size,
        temporal_patch_size=vc.temporal_patch_size,
        image_token_id=config.image_token_id,
        vision_start_token_id=config.vision_start_token_id,
        vision_end_token_id=config.vision_end_token_id,
        pad_token_id=pad,
        text_ids=ordinary_ids(text_config.vocab_size, special),
        videos=videos,
        video_token_id=config.video_token_id,
        timestamp_tokens=timestamps,
        normalization=normalization,
    )
    planned = workload.module_tokens.get("vision")
    if planned is not None and planned != layout.num_patches:
        raise ValueError(f"plan says {planned} vision tokens per sample, its image sizes give {layout.num_patches}")
    return layout


def clip_sizes(clips: Any, config: Any) -> tuple[tuple[tuple[int, int, int], ...], int]:
    """((frames, height, width) of each of a plan's clips, ``(frames, height, width)`` as sampled, after the model's
    video processor resizes them (the planner's ``video_grid``: one rule for both halves), and the timestamp tokens
    before each temporal group (the family's per-group prompt text less its two markers)."""
    if not clips:
        return (), 0
    spec = model_from_hf_config(config.to_dict(), "plan")
    vi = spec.vision_input
    sizes = []
    for frames, height, width in clips:
        groups, rows, cols = video_grid(frames, height, width, spec)
        sizes.append((groups * vi.temporal_patch_size, rows * vi.patch_size, cols * vi.patch_size))
    return tuple(sizes), max(vi.video.group_text_tokens - 2, 0)


class Source(Protocol):
    """Anything that returns sample ``index`` of a run."""

    def sample(self, index: int) -> Sample: ...


def layout_image_processor(layout: SampleLayout) -> Qwen2VLImageProcessorPil:
    """Transformers' Qwen2-VL image processor (PIL backend) for the layout's patch geometry and the family's pixel
    normalisation."""
    mean, std = layout.normalization
    return Qwen2VLImageProcessorPil(
        patch_size=layout.patch_size, temporal_patch_size=layout.temporal_patch_size, merge_size=layout.merge_size,
        **({"image_mean": list(mean), "image_std": list(std)} if mean else {}),
    )


def patchify(images: list[Image.Image], layout: SampleLayout, processor: Qwen2VLImageProcessorPil) -> Sample:
    """pixel_values and image_grid_thw of a sample's images, resized to the layout's sizes, by the HF processor (none
    for a sample of clips only)."""
    if not images:
        return {}
    pixels, grids = [], []
    for image, (h, w) in zip(images, layout.image_sizes, strict=True):
        image = image.convert("RGB").resize((w, h), Image.Resampling.BICUBIC)
        out = processor(images=[image], size={"shortest_edge": h * w, "longest_edge": h * w}, return_tensors="pt")
        pixels.append(out["pixel_values"])
        grids.append(out["image_grid_thw"])
    return {"pixel_values": torch.cat(pixels).float(), "image_grid_thw": torch.cat(grids)}


def patchify_clip(frames: list[Image.Image], size: tuple[int, int], processor: Qwen2VLImageProcessorPil
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values_videos [T/2 * h * w, C*T*P*P], video_grid_thw [1, 3]) of a clip's frames resized to ``size``:
    each frame through the image processor (which repeats a still image over the temporal patch), then each
    temporal patch filled with consecutive frames instead: the video processor's layout (``Qwen2VLVideoProcessor``
    / ``Qwen3VLVideoProcessor`` patchify [t, T, C, h, w] alike; their torchvision backend is not installed here)."""
    temporal, height, width = processor.temporal_patch_size, *size
    per_frame = []
    for frame in frames:
        frame = frame.convert("RGB").resize((width, height), Image.Resampling.BICUBIC)
        out = processor(images=[frame], size={"shortest_edge": height * width, "longest_edge": height * width},
                        return_tensors="pt")
        patches = out["pixel_values"].float()
        per_frame.append(patches.view(patches.shape[0], 3, temporal, -1)[:, :, 0])  # [h*w, C, P*P]
    groups = len(frames) // temporal
    clip = torch.stack(per_frame).view(groups, temporal, *per_frame[0].shape)  # [t, T, h*w, C, P*P]
    pixels = clip.permute(0, 2, 3, 1, 4).reshape(groups * per_frame[0].shape[0], -1)  # [t*h*w, C*T*P*P]
    grid = torch.tensor([[groups, height // processor.patch_size, width // processor.patch_size]])
    return pixels, grid


def token_sequence(text_ids: list[int], layout: SampleLayout, timestamp_ids: list[int] | None = None) -> Sample:
    """input_ids, mm_token_type_ids and labels: the image blocks, each clip's prompt (``timestamp_ids`` before each
    temporal group where the family has them), then ``text_ids`` cut or padded to fit."""
    ids, types = [], []
    for num in layout.image_tokens():
        ids += [layout.vision_start_token_id] + [layout.image_token_id] * num + [layout.vision_end_token_id]
        types += [0] + [1] * num + [0]
    stamp = (timestamp_ids or [layout.text_ids[0]] * layout.timestamp_tokens)[:layout.timestamp_tokens]
    for clip in range(len(layout.videos)):
        clip_ids, clip_types = layout.video_prompt(clip, stamp)
        ids, types = ids + clip_ids, types + clip_types
    room = layout.text_tokens - 2 * len(layout.image_sizes)
    text = list(text_ids[:room])
    labels = list(ids) + text + [IGNORE_INDEX] * (room - len(text))
    ids += text + [layout.pad_token_id] * (room - len(text))
    types += [0] * room
    labels = [IGNORE_INDEX if t != 0 else lab for lab, t in zip(labels, types)]
    return {
        "input_ids": torch.tensor(ids),
        "mm_token_type_ids": torch.tensor(types, dtype=torch.int32),
        "labels": torch.tensor(labels),
    }


def visual_inputs(batch: Sample) -> tuple[torch.Tensor, torch.Tensor]:
    """(patches, grid_thw) of a micro-batch's images and clips in sequence order, sample by sample (its images,
    then its clips): what the vision tower runs and the hand-off routes, one row per visual token in that order.
    ``collate`` keeps images and clips apart, as the HF model takes them; a packed row counts each sample's
    (``sample_images``, ``sample_videos``)."""
    if "video_grid_thw" not in batch:
        return batch["pixel_values"], batch["image_grid_thw"]
    if "image_grid_thw" not in batch:  # clips only, already in sequence order: no copy of a long clip's pixels
        return batch["pixel_values_videos"], batch["video_grid_thw"]
    samples = batch["input_ids"].shape[0] if "sample_lens" not in batch else len(batch["sample_lens"])
    per_kind = []
    for kind, grid_key, counts in (("pixel_values", "image_grid_thw", "sample_images"),
                                   ("pixel_values_videos", "video_grid_thw", "sample_videos")):
        grids = batch[grid_key]
        per_sample = batch[counts].tolist() if counts in batch else [len(grids) // samples] * samples
        grid_bounds = [0, *itertools.accumulate(per_sample)]
        row_bounds = [0, *itertools.accumulate(grids.prod(-1).tolist())]
        per_kind.append([(batch[kind][row_bounds[a]:row_bounds[b]], grids[a:b])
                         for a, b in zip(grid_bounds, grid_bounds[1:])])
    in_order = [part for images, clips in zip(*per_kind) for part in (images, clips)]
    # one concatenation of views: a single copy of the pixels (a long clip's are GiBs), no per-sample copies first
    return torch.cat([pixels for pixels, _ in in_order]), torch.cat([grid for _, grid in in_order])


class SyntheticData:
    """Random images (uniform pixels) and random text of the planned shape; sample i is fixed by (seed, i)."""

    def __init__(self, layout: SampleLayout, seed: int):
        self.layout = layout
        self.seed = seed
        self.processor = layout_image_processor(layout)

    def sample(self, index: int) -> Sample:
        rng = np.random.default_rng([self.seed, index])
        images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in self.layout.image_sizes]
        room = self.layout.text_tokens - 2 * len(self.layout.image_sizes)
        text = rng.integers(*self.layout.text_ids, room).tolist()
        stamp = rng.integers(*self.layout.text_ids, self.layout.timestamp_tokens).tolist()
        sample = {**patchify(images, self.layout, self.processor), **token_sequence(text, self.layout, stamp)}
        if self.layout.videos:
            clips = [patchify_clip([Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
                                    for _ in range(frames)], (h, w), self.processor)
                     for frames, h, w in self.layout.videos]
            sample["pixel_values_videos"] = torch.cat([pixels for pixels, _ in clips])
            sample["video_grid_thw"] = torch.cat([grid for _, grid in clips])
        return sample


class CaptionData:
    """Image-caption pairs from a JSONL file (``{"image": path, "text": str}`` per line) or a folder of images
    with same-stem ``.txt`` captions. Captions become UTF-8 byte ids (mod the text vocabulary) — the runtime
    ships no tokenizer; samples repeat when the run needs more than the files hold.
    """

    def __init__(self, path: str | Path, layout: SampleLayout, *, data_root_only: bool = False):
        if len(layout.image_sizes) != 1:
            raise ValueError(f"caption data has one image per sample, the plan has {len(layout.image_sizes)}")
        self.layout = layout
        self.processor = layout_image_processor(layout)
        self.pairs = self._read(Path(path))
        if data_root_only:
            self._check_inside(Path(path))

    def _check_inside(self, path: Path) -> None:
        """Refuse, in one line, an image that resolves outside the data folder (``--data-root-only``)."""
        root = path if path.is_dir() else path.parent
        for image, _ in self.pairs:
            try:
                check_data_root(root, [str(image)])
            except SkippedSample:
                raise ValueError(f"{path}: image {image} is outside the data folder {root} "
                                 "(--data-root-only)") from None

    @staticmethod
    def _read(path: Path) -> list[tuple[Path, str]]:
        if path.is_dir():
            pairs = [
                (p, read_text(p.with_suffix(".txt"), kind="caption").strip())
                for p in sorted(path.iterdir())
                if p.suffix.lower() in IMAGE_SUFFIXES and p.with_suffix(".txt").exists()
            ]
        elif path.is_file():
            pairs = []
            for n, line in enumerate(read_text(path, kind="data file", max_bytes=MAX_DATASET_BYTES).splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    pairs.append(((path.parent / row["image"]).resolve(), str(row["text"])))
                except (json.JSONDecodeError, RecursionError, KeyError, TypeError):
                    raise ValueError(f'{path} line {n} is not {{"image": path, "text": caption}}') from None
        else:
            raise ValueError(f"data path {path} does not exist")
        if not pairs:
            raise ValueError(f"{path} holds no image-caption pairs")
        return pairs

    def sample(self, index: int) -> Sample:
        image_path, caption = self.pairs[index % len(self.pairs)]
        try:
            image = Image.open(image_path)
        except OSError as e:
            raise ValueError(f"cannot read image {image_path}: {e}") from None
        first, end = self.layout.text_ids
        text = [first + b % (end - first) for b in caption.encode()]
        return {**patchify([image], self.layout, self.processor), **token_sequence(text, self.layout)}


VISUAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
"""A sample's patches and grids, images' and clips' (a sample of clips only has no image keys)."""
ENCODER_KEYS = (*VISUAL_KEYS, "input_features", "feature_attention_mask")
"""What the encoders take, concatenated over a micro-batch's samples (audio: clips' mel features and masks)."""
TOKEN_KEYS = ("input_ids", "mm_token_type_ids", "labels")
"""Per-token tensors, stacked into [B, L] (audio samples have no ``mm_token_type_ids``)."""


def collate(samples: list[Sample]) -> Sample:
    """A micro-batch: the encoders' inputs concatenated (the vision tower packs them), token tensors stacked."""
    return {
        **{key: torch.cat([s[key] for s in samples]) for key in ENCODER_KEYS if key in samples[0]},
        **{key: torch.stack([s[key] for s in samples]) for key in TOKEN_KEYS if key in samples[0]},
    }


def pack_rows(samples: list[Sample]) -> Sample:
    """A packed micro-batch: patches and grids concatenated, every sample's tokens back to back in one row [1, L]
    (no padding). Each sample's first label is IGNORE_INDEX: the token before it belongs to another sample, so it
    is nobody's next token. ``sample_lens``, ``sample_images`` (and with clips ``sample_videos``) give each sample's
    tokens, images (and clips)."""
    labels = [s["labels"].clone() for s in samples]
    for row in labels:
        row[0] = IGNORE_INDEX
    clips = {}
    if any("video_grid_thw" in s for s in samples):
        clips = {"pixel_values_videos": torch.cat([s["pixel_values_videos"] for s in samples]),
                 "video_grid_thw": torch.cat([s["video_grid_thw"] for s in samples]),
                 "sample_videos": torch.tensor([len(s["video_grid_thw"]) for s in samples])}
    return {**clips,
        "pixel_values": torch.cat([s["pixel_values"] for s in samples]),
        "image_grid_thw": torch.cat([s["image_grid_thw"] for s in samples]),
        "input_ids": torch.cat([s["input_ids"] for s in samples])[None],
        "mm_token_type_ids": torch.cat([s["mm_token_type_ids"] for s in samples])[None],
        "labels": torch.cat(labels)[None],
        "sample_lens": torch.tensor([len(s["input_ids"]) for s in samples]),
        "sample_images": torch.tensor([len(s["image_grid_thw"]) for s in samples]),
    }
