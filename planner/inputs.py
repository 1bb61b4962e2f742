"""The planner's inputs in sections: the cluster, the workload, a dataset instead of the workload's sample shape,
and the search's options. ``planner.problem.make_problem`` turns them into one ``Problem`` (defaults, bounds and
one-line errors live there); the ``plan`` command builds one argparse group per section (``planner.cli``).

Example: ``make_problem("qwen-vl-32b", ClusterInputs(gpus=16, gpu="a100-80gb"),
workload=WorkloadInputs(image_sizes=[(448, 448)]), search=SearchOptions(allow_pp=False))``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from planner.dataset import DatasetHistogram

DEFAULT_GPU = "h100-80gb"
"""Hardware when none is named."""


@dataclass(kw_only=True, frozen=True)
class ClusterInputs:
    """The GPUs a plan is for (``plan``'s "model and hardware" flags)."""

    gpus: int
    """Number of GPUs."""
    gpu: str = DEFAULT_GPU
    """Catalog device name (``plan --list-gpus``)."""
    gpus_per_node: int | None = None
    """GPUs per node (default: the device's)."""
    cluster_file: str | None = None
    """JSON/YAML file redefining the device's numbers (``planner.contract.hardware.load_cluster_file``)."""
    profile: str | None = "auto"
    """Measured profile to cost with: a path, "auto" (the committed profile of this device and model, if any) or
    None (the analytical model only)."""


@dataclass(kw_only=True, frozen=True)
class WorkloadInputs:
    """What one step trains: the shape of a sample (unless a dataset gives it), the batch, the precision and the
    frozen modules (``plan``'s "workload (per sample)" flags)."""

    image_sizes: Sequence[tuple[int, int]] | None = None
    """(height, width) of each image of a sample (default one 1344x1344)."""
    images_per_sample: int | None = None
    """Repeat ``image_sizes`` this many times per sample."""
    vision_tokens: int | None = None
    """Vision tokens per sample (a square merge-aligned grid) instead of image sizes."""
    videos: Sequence[tuple[int, int, int]] = ()
    """(sampled frames, height, width) of each video clip of a sample (``planner.problem.video_frames`` turns
    seconds and fps into frames)."""
    text_tokens: int | None = None
    """Text tokens per sample (default 512)."""
    audio_seconds: float | None = None
    """Seconds of audio per sample (audio models; default 30)."""
    global_batch: int | None = None
    """Samples per step (default 4 per GPU); with a dataset too."""
    precision: str = "bf16_mixed"
    """Training precision recipe: bf16_mixed or bf16_pure."""
    frozen: Sequence[str] = ()
    """Modules to freeze."""


@dataclass(kw_only=True, frozen=True)
class DatasetInputs:
    """A dataset whose samples, packed, replace the workload's sample shape (``plan``'s "dataset" flags);
    ``WorkloadInputs.global_batch`` still counts samples."""

    source: str | DatasetHistogram
    """A conversation / caption JSONL or JSON file, or a dataset histogram (``planner.dataset``)."""
    tokenizer: str | None = None
    """Folder with the tokenizer.json that counts the dataset's text (default: the model's folder when the model is
    a config.json beside one, else an estimate, stated)."""
    min_pixels: int | None = None
    """Fewest pixels the processor resizes an image to (default the model's processor's)."""
    max_pixels: int | None = None
    """Most pixels the processor resizes an image to (default the model's processor's)."""
    pack_tokens: int | None = None
    """LLM-token budget of a pack (default: the longest sample, rounded up to 256; ``planner.api.top_plans`` also
    tries twice and four times that and keeps the fastest)."""
    pack: bool = True
    """False: every sample is a micro-batch unit of its own (how a plan made for one image size meets the dataset);
    ``pack_tokens`` then does not apply."""
    fps: float | None = None
    """Frames sampled per second of the dataset's video files (default ``planner.contract.workload.DEFAULT_FPS``)."""


@dataclass(kw_only=True, frozen=True)
class SearchOptions:
    """Which strategies the search considers and how it costs them (``plan``'s "search" flags that the problem
    records; placement, fixes, top-k and the time limit are arguments of each search, ``planner.api``)."""

    allow_ring_cp: bool = True
    """Search ring context parallelism (cp > 1; False: plans without it only)."""
    allow_pp: bool = True
    """Search pipeline parallelism of the LLM (False: plans without it only)."""
    workers: int = 1
    """Processes that cost candidates (``Problem.workers``): the same plan, sooner on several cores."""
    attention: str | None = None
    """How the runtime calls attention (``varlen`` or ``sdpa``, ``planner.contract.schema.AttentionCalls``);
    default: what it runs on the hardware (``planner.problem.attention_calls_for``)."""
    linear_attention: str | None = None
    """Which kernel runs linear-attention layers (``fla`` or ``torch``,
    ``planner.contract.schema.LinearAttentionKernel``); default: what runs on the hardware
    (``planner.problem.linear_attention_kernel_for``)."""
