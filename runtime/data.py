"""Training samples shaped like the plan's workload: synthetic, or from a local image-caption folder / JSONL.

Images go through transformers' own Qwen2-VL image processor (the PIL backend), so ``pixel_values`` are the
flattened ``C*T*P*P`` patches in merge-window order and ``image_grid_thw`` is ``(1, H/P, W/P)`` per image,
exactly as the model expects. A sample's token sequence is, per image, ``<vision_start> <image_pad>*M
<vision_end>``, then text; labels are -100 on the image tokens and on padding.

Each sample is a pure function of (seed, global sample index), so every rank (and the single-process reference
in the tests) can build any sample; DP replica ``d`` of a micro-batch takes its own slice of the indices.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

IGNORE_INDEX = -100
"""Label value the loss skips (transformers' convention)."""

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
"""Files a caption folder may hold as images (each beside a ``.txt`` caption of the same stem)."""

Sample = dict[str, torch.Tensor]
"""pixel_values [N, C*T*P*P], image_grid_thw [I, 3], input_ids [L], mm_token_type_ids [L], labels [L]."""


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

    def __post_init__(self) -> None:
        if self.text_tokens < 2 * len(self.image_sizes) + 1:
            raise ValueError(
                f"{self.text_tokens} text tokens cannot hold a start and end marker for each of "
                f"{len(self.image_sizes)} images plus one text token"
            )

    def image_tokens(self) -> list[int]:
        """LLM tokens each image becomes (patches / merge_size**2)."""
        return [(h // self.patch_size) * (w // self.patch_size) // self.merge_size**2 for h, w in self.image_sizes]

    @property
    def num_patches(self) -> int:
        """Vision patches per sample."""
        return sum(t * self.merge_size**2 for t in self.image_tokens())

    @property
    def seq_len(self) -> int:
        """LLM sequence length per sample."""
        return self.text_tokens + sum(self.image_tokens())


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


def layout_from_plan(workload: Any, config: Any) -> SampleLayout:
    """The sample layout of a plan's workload (``plan.workload``) for an HF model config.

    Raises:
        ValueError: the workload has no image or has video clips, or its token counts disagree with the plan's.
    """
    if getattr(workload, "videos", None):
        raise ValueError("the plan's samples hold video clips, which the runtime does not train yet (plan them for "
                         "sizing; run image plans)")
    vc = config.vision_config
    factor = vc.patch_size * vc.spatial_merge_size
    if workload.image_sizes:
        sizes = tuple((round_to_multiple(h, factor), round_to_multiple(w, factor)) for h, w in workload.image_sizes)
    elif workload.vision_tokens:
        side = math.isqrt(workload.vision_tokens) * vc.patch_size
        sizes = ((side, side),)
    else:
        raise ValueError("the plan's workload has no image; the runtime trains vision-language models")
    special = [config.image_token_id, config.vision_start_token_id, config.vision_end_token_id]
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
    )
    planned = workload.module_tokens.get("vision")
    if planned is not None and planned != layout.num_patches:
        raise ValueError(f"plan says {planned} vision tokens per sample, its image sizes give {layout.num_patches}")
    return layout


class Source(Protocol):
    """Anything that returns sample ``index`` of a run."""

    def sample(self, index: int) -> Sample: ...


def layout_image_processor(layout: SampleLayout) -> Qwen2VLImageProcessorPil:
    """Transformers' Qwen2-VL image processor (PIL backend) for the layout's patch geometry."""
    return Qwen2VLImageProcessorPil(
        patch_size=layout.patch_size, temporal_patch_size=layout.temporal_patch_size, merge_size=layout.merge_size
    )


def patchify(images: list[Image.Image], layout: SampleLayout, processor: Qwen2VLImageProcessorPil) -> Sample:
    """pixel_values and image_grid_thw of a sample's images, resized to the layout's sizes, by the HF processor."""
    pixels, grids = [], []
    for image, (h, w) in zip(images, layout.image_sizes, strict=True):
        image = image.convert("RGB").resize((w, h), Image.Resampling.BICUBIC)
        out = processor(images=[image], size={"shortest_edge": h * w, "longest_edge": h * w}, return_tensors="pt")
        pixels.append(out["pixel_values"])
        grids.append(out["image_grid_thw"])
    return {"pixel_values": torch.cat(pixels).float(), "image_grid_thw": torch.cat(grids)}


def token_sequence(text_ids: list[int], layout: SampleLayout) -> Sample:
    """input_ids, mm_token_type_ids and labels: the image blocks, then ``text_ids`` cut or padded to fit."""
    ids, types = [], []
    for num in layout.image_tokens():
        ids += [layout.vision_start_token_id] + [layout.image_token_id] * num + [layout.vision_end_token_id]
        types += [0] + [1] * num + [0]
    room = layout.text_tokens - 2 * len(layout.image_sizes)
    text = list(text_ids[:room])
    labels = list(ids) + text + [IGNORE_INDEX] * (room - len(text))
    ids += text + [layout.pad_token_id] * (room - len(text))
    types += [0] * room
    labels = [IGNORE_INDEX if t == 1 else lab for lab, t in zip(labels, types)]
    return {
        "input_ids": torch.tensor(ids),
        "mm_token_type_ids": torch.tensor(types, dtype=torch.int32),
        "labels": torch.tensor(labels),
    }


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
        return {**patchify(images, self.layout, self.processor), **token_sequence(text, self.layout)}


class CaptionData:
    """Image-caption pairs from a JSONL file (``{"image": path, "text": str}`` per line) or a folder of images
    with same-stem ``.txt`` captions. Captions become UTF-8 byte ids (mod the text vocabulary) — the runtime
    ships no tokenizer; samples repeat when the run needs more than the files hold.
    """

    def __init__(self, path: str | Path, layout: SampleLayout):
        if len(layout.image_sizes) != 1:
            raise ValueError(f"caption data has one image per sample, the plan has {len(layout.image_sizes)}")
        self.layout = layout
        self.processor = layout_image_processor(layout)
        self.pairs = self._read(Path(path))

    @staticmethod
    def _read(path: Path) -> list[tuple[Path, str]]:
        if path.is_dir():
            pairs = [
                (p, p.with_suffix(".txt").read_text().strip())
                for p in sorted(path.iterdir())
                if p.suffix.lower() in IMAGE_SUFFIXES and p.with_suffix(".txt").exists()
            ]
        elif path.is_file():
            pairs = []
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    pairs.append(((path.parent / row["image"]).resolve(), str(row["text"])))
                except (json.JSONDecodeError, KeyError, TypeError):
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


def collate(samples: list[Sample]) -> Sample:
    """A micro-batch: patches and grids concatenated (the vision tower packs them), token tensors stacked."""
    return {
        "pixel_values": torch.cat([s["pixel_values"] for s in samples]),
        "image_grid_thw": torch.cat([s["image_grid_thw"] for s in samples]),
        "input_ids": torch.stack([s["input_ids"] for s in samples]),
        "mm_token_type_ids": torch.stack([s["mm_token_type_ids"] for s in samples]),
        "labels": torch.stack([s["labels"] for s in samples]),
    }


def pack_rows(samples: list[Sample]) -> Sample:
    """A packed micro-batch: patches and grids concatenated, every sample's tokens back to back in one row [1, L]
    (no padding). Each sample's first label is IGNORE_INDEX: the token before it belongs to another sample, so it
    is nobody's next token. ``sample_lens`` and ``sample_images`` give each sample's tokens and images."""
    labels = [s["labels"].clone() for s in samples]
    for row in labels:
        row[0] = IGNORE_INDEX
    return {
        "pixel_values": torch.cat([s["pixel_values"] for s in samples]),
        "image_grid_thw": torch.cat([s["image_grid_thw"] for s in samples]),
        "input_ids": torch.cat([s["input_ids"] for s in samples])[None],
        "mm_token_type_ids": torch.cat([s["mm_token_type_ids"] for s in samples])[None],
        "labels": torch.cat(labels)[None],
        "sample_lens": torch.tensor([len(s["input_ids"]) for s in samples]),
        "sample_images": torch.tensor([len(s["image_grid_thw"]) for s in samples]),
    }
