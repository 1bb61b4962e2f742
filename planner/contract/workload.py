"""What one training sample looks like, and how many tokens each module sees for it."""

from __future__ import annotations

from dataclasses import dataclass, replace
import math
from typing import Any, Protocol

import numpy as np

from planner.contract.models import ModelSpec


class PackBalance(Protocol):
    """A dataset's packs as the per-step assignment sees them: what the cost model asks of
    ``planner.cost.balance.StepBalance`` (``work``: its ``SampleWork``)."""

    def expected_imbalance(self, module: str, replicas: int, per_replica: int, micro_batches: int,
                           work: Any) -> float:
        """The expected ``step_imbalance`` of ``module`` under the per-step assignment."""

    def heaviest_replica(self, module: str, replicas: int, per_replica: int, micro_batches: int,
                         work: Any) -> ModuleTokens:
        """What one replica of ``module`` holds in its heaviest micro-batch, per pack."""


@dataclass(kw_only=True, frozen=True)
class Workload:
    """Samples of a multimodal training step."""

    image_sizes: tuple[tuple[int, int], ...] = ()
    """(height, width) in pixels of each image in one sample."""
    vision_tokens: int | None = None
    """Vision-tower tokens (patches) per sample given directly; overrides image_sizes (square images assumed)."""
    text_tokens: int = 0
    """Text tokens per sample."""
    audio_seconds: float = 0.0
    """Seconds of audio per sample."""
    videos: tuple[tuple[int, int, int], ...] = ()
    """(sampled frames, height, width) of each video clip in one sample."""
    global_batch: int
    """Samples per optimizer step; with ``packs``, packs per optimizer step."""
    packs: PackedTokens | None = None
    """A dataset plan: one sample of the cost model is one pack of real samples (``planner.dataset``), and
    ``module_tokens`` gives the mean pack; the other per-sample fields are unused."""

    @property
    def samples_per_unit(self) -> float:
        """Real samples in one cost-model sample: the mean samples per pack, or 1."""
        return 1.0 if self.packs is None else self.packs.samples_per_pack

    def heaviest(self) -> Workload | None:
        """The workload whose one sample is the heaviest pack (what memory must hold), or None without packs."""
        return None if self.packs is None else self.packs.heaviest_workload

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise ValueError(f"global batch must be >= 1, got {self.global_batch}")
        if self.text_tokens < 0 or self.audio_seconds < 0:
            raise ValueError("text tokens and audio seconds must be >= 0")
        for h, w in self.image_sizes:
            if h <= 0 or w <= 0:
                raise ValueError(f"image size must be positive, got {h}x{w}")
        for frames, h, w in self.videos:
            if frames <= 0 or h <= 0 or w <= 0:
                raise ValueError(f"a video needs positive frames and size, got {frames}x{h}x{w}")
        if self.vision_tokens is not None and self.vision_tokens <= 0:
            raise ValueError(f"vision tokens must be > 0, got {self.vision_tokens}")


@dataclass(kw_only=True, frozen=True)
class ModuleTokens:
    """Tokens one sample puts through a module, and how attention segments them. A mean over packs
    (``PackedTokens``) has fractional counts and gives the sum of squared segment lengths directly."""

    tokens: float
    """Tokens per sample entering the module (vision: patches; audio: encoder positions; llm: sequence)."""
    segments: tuple[int, ...]
    """Lengths of the independent full-attention segments (one per image / clip; one sequence for the LLM)."""
    windows: float = 0
    """Attention windows per sample for window-attention blocks (0 when the module has none)."""
    output_tokens: float = 0
    """Tokens per sample the module hands to the LLM (after merge / pooling); 0 for the LLM."""
    segment_squares: float | None = None
    """Sum of squared segment lengths when ``segments`` does not list them (a mean over packs)."""

    @property
    def squared_segments(self) -> float:
        """Sum of squared full-attention segment lengths (what attention FLOPs and scores scale with)."""
        return sum(s * s for s in self.segments) if self.segment_squares is None else self.segment_squares


@dataclass(kw_only=True, frozen=True, eq=False)
class PackedTokens:
    """Per-module tokens of a dataset's packs: the mean pack (what step time averages over) and the heaviest
    (per module, what memory must hold), from ``planner.dataset``."""

    mean: tuple[tuple[str, ModuleTokens], ...]
    """(module, mean tokens per pack)."""
    heaviest: tuple[tuple[str, ModuleTokens], ...]
    """(module, the tokens of the pack heaviest for that module: the most tokens, then the largest squares)."""
    samples_per_pack: float
    """Mean real samples per pack."""
    pack_tokens: int | None
    """LLM-token budget of a pack; None: every sample is a pack of its own (no packing)."""
    heaviest_workload: Workload | None = None
    """The workload of one heaviest pack (set by ``packed_workload``)."""
    balance: PackBalance | None = None
    """The packs' items as the per-step assignment sees them (``planner.cost.balance``): what prices each module's
    slowest replica; None: the mean pack is priced."""


def packed_workload(packs: PackedTokens, global_batch: int) -> Workload:
    """A workload of ``global_batch`` packs per step, with its heaviest-pack twin for memory."""
    heavy = PackedTokens(mean=packs.heaviest, heaviest=packs.heaviest, samples_per_pack=packs.samples_per_pack,
                         pack_tokens=packs.pack_tokens)
    full = replace(packs, heaviest_workload=Workload(global_batch=global_batch, packs=heavy))
    return Workload(global_batch=global_batch, packs=full)


def pipeline_padded(workload: Workload) -> Workload:
    """A dataset workload as a pipelined LLM runs it: every pack's LLM sequence padded to the pack budget (torch's
    pipeline schedule exchanges one shape per micro-batch), the padding one-token segments (each pad token attends
    to itself only, ``runtime.models.llm.pad_packed_row``), so a pack of ``n`` tokens and squared segments ``q`` costs as
    ``budget`` tokens and ``q + budget - n``. Other modules' tokens are unchanged; without packs or without a
    budget, the workload itself. Memoised by identity."""
    packs = workload.packs
    if packs is None or packs.pack_tokens is None:
        return workload
    found = _PADDED.get(id(workload))
    if found is None or found[0] is not workload:
        if len(_PADDED) >= 64:
            _PADDED.clear()
        budget = packs.pack_tokens

        def padded(tokens: tuple[tuple[str, ModuleTokens], ...]) -> tuple[tuple[str, ModuleTokens], ...]:
            return tuple((m, replace(t, tokens=budget, segment_squares=t.squared_segments + budget - t.tokens)
                          if m == "llm" else t) for m, t in tokens)

        heavy = replace(packs, mean=padded(packs.heaviest), heaviest=padded(packs.heaviest), heaviest_workload=None)
        full = replace(packs, mean=padded(packs.mean), heaviest=padded(packs.heaviest),
                       heaviest_workload=Workload(global_batch=workload.global_batch, packs=heavy))
        found = _PADDED[id(workload)] = (workload, replace(workload, packs=full))
    return found[1]


_PADDED: dict[int, tuple[Workload, Workload]] = {}


def round_to_multiple(pixels: int, factor: int) -> int:
    """Round an image side to the nearest multiple of ``factor`` (at least one), as Qwen-VL's smart_resize does."""
    return max(factor, round(pixels / factor) * factor)


MAX_ASPECT_RATIO = 200
"""Longest over shortest side the Qwen-VL processors accept."""


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int, frames: int = 1,
                 temporal_patch: int = 2) -> tuple[int, int]:
    """(height, width) an image (``frames`` = 1) or a clip of ``frames`` frames is resized to: each side a multiple
    of ``factor`` (patch * merge), ``frames x`` the area within [min_pixels, max_pixels], the aspect ratio kept as
    closely as possible (``smart_resize`` of transformers' image_processing_qwen2_vl; of video_processing_qwen3_vl
    for a clip, whose budget covers every frame, counted in whole ``temporal_patch`` groups).

    Raises:
        ValueError: an aspect ratio above ``MAX_ASPECT_RATIO``.
    """
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"aspect ratio above {MAX_ASPECT_RATIO}")
    if frames > 1 and (height < factor or width < factor):
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = frames if frames == 1 else round(frames / temporal_patch) * temporal_patch
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_grid(height: int, width: int, model: ModelSpec) -> tuple[int, int]:
    """Patch grid (rows, cols) of one image after resizing to multiples of patch_size * spatial_merge_size."""
    vi = model.vision_input
    factor = vi.patch_size * vi.spatial_merge_size
    return round_to_multiple(height, factor) // vi.patch_size, round_to_multiple(width, factor) // vi.patch_size


def video_grid(frames: int, height: int, width: int, model: ModelSpec) -> tuple[int, int, int]:
    """(temporal groups, rows, cols) of a clip of ``frames`` sampled frames as the model's video processor makes it:
    frames padded to whole temporal patches (the last frame repeated), every frame resized alike within the
    processor's pixel bounds (per frame, or for the whole clip: ``VideoInputSpec.pixels_per_clip``)."""
    vi = model.vision_input
    video, factor = vi.video, vi.patch_size * vi.spatial_merge_size
    if frames < vi.temporal_patch_size:
        raise ValueError(f"a clip needs at least {vi.temporal_patch_size} frames (one temporal patch), got {frames}")
    h, w = smart_resize(height, width, factor, video.min_pixels, video.max_pixels,
                        frames=frames if video.pixels_per_clip else 1, temporal_patch=vi.temporal_patch_size)
    return math.ceil(frames / vi.temporal_patch_size), h // vi.patch_size, w // vi.patch_size


DEFAULT_FPS = 2.0
"""Frames sampled per second of --video-seconds and of a dataset's video files (the Qwen-VL video processors'
default)."""


def sampled_frames(total: int, video_fps: float, fps: float, model: ModelSpec) -> list[int]:
    """Indices of the frames the model's video processor samples at ``fps`` frames per second from a video file of
    ``total`` frames at ``video_fps`` (transformers' ``sample_frames``, min/max frames from ``VideoInputSpec``).

    ``Qwen3VLVideoProcessor``: n = int(total / video_fps * fps) within [min_frames, min(max_frames, total)],
    ``np.linspace(0, total - 1, n).round()``. ``Qwen2VLVideoProcessor``: n = total / video_fps * fps within
    [min_frames, max_frames'], max_frames' = min(max_frames, total) floored to whole temporal patches, n floored
    likewise, every (total / n)-th frame (``torch.arange(0, total, total / n).int()``, here in exact integers)."""
    vi = model.vision_input
    video, patch = vi.video, vi.temporal_patch_size
    wanted = total / video_fps * fps
    if not video.samples_whole_temporal_patches:
        count = min(max(int(wanted), video.min_frames), video.max_frames, total)
        return np.linspace(0, total - 1, count).round().astype(int).tolist()
    most = math.floor(min(video.max_frames, total) / patch) * patch
    count = math.floor(min(max(wanted, video.min_frames), most, total) / patch) * patch
    return [i * total // count for i in range(count)]


def video_text_tokens(workload: Workload, model: ModelSpec) -> int:
    """LLM text tokens the prompt adds around a sample's clips: per clip, and per temporal group (timestamps)."""
    if not workload.videos:
        return 0
    video = model.vision_input.video
    groups = sum(video_grid(f, h, w, model)[0] for f, h, w in workload.videos)
    return len(workload.videos) * video.clip_text_tokens + groups * video.group_text_tokens


def image_windows(rows: int, cols: int, model: ModelSpec) -> int:
    """Attention windows covering a patch grid (windows are padded at the edges, as in Qwen2.5-VL)."""
    vi = model.vision_input
    if vi.window_size is None:
        return 0
    side = vi.window_size // vi.patch_size
    return math.ceil(rows / side) * math.ceil(cols / side)


def vision_tokens(workload: Workload, model: ModelSpec) -> ModuleTokens:
    """Vision-tower tokens of one sample: (H/patch)*(W/patch) patches per image (one temporal patch per image),
    and per video clip as many such grids as it has temporal groups; each image and each temporal group of a clip
    is a full-attention segment of its own (``cu_seqlens`` of transformers' Qwen-VL vision towers)."""
    vi = model.vision_input
    merge = vi.spatial_merge_size**2
    if workload.vision_tokens is not None:
        side = max(vi.spatial_merge_size, round(math.sqrt(workload.vision_tokens) / vi.spatial_merge_size) * vi.spatial_merge_size)
        grids = [(side, side)]
        if side * side != workload.vision_tokens:
            raise ValueError(
                f"--vision-tokens {workload.vision_tokens} is not a square grid of merge-aligned patches; "
                f"try {side * side} (a {side * vi.patch_size}x{side * vi.patch_size} image)"
            )
    else:
        grids = [image_grid(h, w, model) for h, w in workload.image_sizes]
    for frames, h, w in workload.videos:
        groups, rows, cols = video_grid(frames, h, w, model)
        grids += [(rows, cols)] * groups
    segments = tuple(r * c for r, c in grids)
    return ModuleTokens(
        tokens=sum(segments),
        segments=segments,
        windows=sum(image_windows(r, c, model) for r, c in grids),
        output_tokens=sum(segments) // merge,
    )


def audio_tokens(workload: Workload, model: ModelSpec) -> ModuleTokens:
    """Audio-encoder positions of one sample: clips of at most max_seconds, each padded to a whole pass; the LLM
    takes each clip's tokens of its real length (``clip_llm_tokens``)."""
    ai = model.audio_input
    if workload.audio_seconds <= 0:
        return ModuleTokens(tokens=0, segments=(), output_tokens=0)
    clips = math.ceil(workload.audio_seconds / ai.max_seconds)
    per_clip = ai.max_seconds * ai.encoder_tokens_per_second
    segments = (per_clip,) * clips
    last = workload.audio_seconds - (clips - 1) * ai.max_seconds
    output = (clips - 1) * clip_llm_tokens(ai.max_seconds, model) + clip_llm_tokens(last, model)
    return ModuleTokens(tokens=sum(segments), segments=segments, output_tokens=output)


def clip_llm_tokens(seconds: float, model: ModelSpec) -> int:
    """LLM audio tokens of a clip of ``seconds`` (one pass at most): Qwen2-Audio's processor writes as many audio
    tokens as the encoder keeps of the clip's real mel frames (``Qwen2AudioEncoder._get_feat_extract_output_lengths``:
    the stride-2 convolution, then the 2x pool, on ``ceil(seconds * 100)`` frames, Whisper's 10 ms hop); the
    padding to a whole pass is attended over (masked) but never reaches the LLM. 30 s: 3,000 frames -> 1,500 -> 750."""
    ai = model.audio_input
    frames = math.ceil(round(seconds * ai.encoder_tokens_per_second * ai.conv_stride, 6))
    positions = (frames - 1) // ai.conv_stride + 1
    return (positions - ai.pool_stride) // ai.pool_stride + 1


def module_tokens(workload: Workload, model: ModelSpec) -> dict[str, ModuleTokens]:
    """Per-module token counts of one sample; the LLM sequence is text plus every encoder's output tokens.
    Memoised by the objects' identity (the planner asks thousands of times per plan)."""
    key = (id(workload), id(model))
    found = _MODULE_TOKENS.get(key)
    if found is None or found[0] is not workload or found[1] is not model:
        if len(_MODULE_TOKENS) >= 256:
            _MODULE_TOKENS.clear()
        found = _MODULE_TOKENS[key] = (workload, model, _module_tokens(workload, model))
    return dict(found[2])


_MODULE_TOKENS: dict[tuple[int, int], tuple[Workload, ModelSpec, dict[str, ModuleTokens]]] = {}


def _module_tokens(workload: Workload, model: ModelSpec) -> dict[str, ModuleTokens]:
    """``module_tokens``, computed."""
    if workload.packs is not None:
        return dict(workload.packs.mean)
    tokens: dict[str, ModuleTokens] = {}
    if model.vision_input is not None and "vision" in model.module_names:
        tokens["vision"] = vision_tokens(workload, model)
    if model.audio_input is not None and "audio" in model.module_names:
        tokens["audio"] = audio_tokens(workload, model)
    llm_len = workload.text_tokens + video_text_tokens(workload, model) + sum(t.output_tokens for t in tokens.values())
    if llm_len <= 0:
        raise ValueError("a sample has no tokens: give --text-tokens, an image size or audio seconds")
    tokens["llm"] = ModuleTokens(tokens=llm_len, segments=(llm_len,))
    return tokens
