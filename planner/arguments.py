"""The ``plan`` command's arguments: its parser, and the plans they ask for through ``planner.api``.

``plans_from_arguments(["--model", "qwen-vl-7b", "--gpus", "8", ...])`` is ``plan ARGS`` as a function (what a runs
table's ``args`` column means to ``python -m planner.calibrate``); ``planner.cli`` adds the output.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import fields, replace
from typing import Any, Sequence

from planner import api
from planner.contract.hardware import PLAUSIBLE_RANGES
from planner.contract.schema import ATTENTION_CALLS, LINEAR_ATTENTION_KERNELS
from planner.inputs import DEFAULT_GPU, ClusterInputs, DatasetInputs, SearchOptions, WorkloadInputs

DESCRIPTION = """\
Plan per-module parallelism (DP/TP/SP/CP/ZeRO/recompute/micro-batch, colocated or disjoint GPU groups) for
training a vision-language model, by CP-SAT over the analytical cost model (or a measured profile).

Workload defaults: one 1344x1344 image per sample (96x96 patches = 9,216 vision tokens -> 2,304 LLM image
tokens after the 2x2 merge), 512 text tokens (2,816 LLM tokens per sample), 30 s of audio for audio models,
global batch = 4 samples per GPU (64 at 16 GPUs), bf16 mixed precision with AdamW, H100 80GB, 8 per node.

examples:
  plan --model qwen-vl-32b --gpus 16
  plan --model qwen-vl-32b --gpus 16 --fix vision.sp=8 --fix llm.tp=8
  plan --model qwen-vl-32b --gpus 64 --image-size 2048x2048 --global-batch 256 --top-k 3
  plan --model qwen-vl-32b --gpus 16 --max-seq
  plan --model qwen2.5-vl-tiny --gpu cpu --gpus 2 --out tiny.json
"""


def _video(text: str) -> tuple[int, int, int]:
    """``FRAMESxHxW`` -> (frames, height, width)."""
    try:
        numbers = tuple(int(p) for p in text.lower().split("x"))
    except ValueError:
        numbers = ()
    if len(numbers) != 3 or min(numbers) <= 0:
        raise argparse.ArgumentTypeError(f"a video must be FRAMESxHxW positive integers (e.g. 240x720x1280), "
                                         f"got {text!r}")
    return numbers


def _image_size(text: str) -> tuple[int, int]:
    """``WxH`` or ``N`` (square) -> (height, width)."""
    parts = text.lower().split("x")
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"image size must be WxH or N pixels, got {text!r}") from None
    if len(numbers) == 1:
        numbers *= 2
    if len(numbers) != 2 or min(numbers) <= 0:
        raise argparse.ArgumentTypeError(f"image size must be WxH or N positive pixels, got {text!r}")
    width, height = numbers
    return height, width


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line and exit status 2 (argparse's own status, without the usage dump)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(f"{message} (see plan --help)")


def default_workers() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _profile(text: str) -> str | None:
    """--profile: a path, "auto" (also for an empty one) or None for 'none'."""
    return None if text.lower() == "none" else text or "auto"


def _flag(name: str, **options: Any) -> tuple[str, dict[str, Any]]:
    """One row of a flag table: the flag and argparse's keywords; its ``dest`` names the field of the section it
    sets (flags of the command alone keep theirs)."""
    return name, options


CLUSTER_FLAGS = (
    _flag("--model", help="catalog name/alias (plan --list-models) or a path to a config.json"),
    _flag("--gpus", type=int, help=f"number of GPUs (1 to {api.MAX_GPUS:,})"),
    _flag("--gpu", default=DEFAULT_GPU, help="hardware (plan --list-gpus; default h100-80gb)"),
    _flag("--gpus-per-node", type=int, help="GPUs per node (default: the hardware's, 8; at most "
          f"{PLAUSIBLE_RANGES['devices_per_node'].high:,g})"),
    _flag("--cluster", dest="cluster_file", metavar="FILE", help="JSON/YAML cluster file overriding the hardware's "
          "numbers (in bytes, bytes/s, FLOP/s and seconds, each within a plausible range)"),
    _flag("--profile", type=_profile, default="auto", metavar="FILE",
          help="measured profile to cost with (default: profiles/<gpu>/<model>.json if present; 'none' for the "
               "analytical model only)"),
)
"""``ClusterInputs``, and the model."""
WORKLOAD_FLAGS = (
    _flag("--image-size", dest="image_sizes", type=_image_size, action="append", metavar="WxH",
          help=f"image size in pixels, repeatable (default one 1344x1344; sides up to {api.MAX_IMAGE_SIDE:,}, at "
               f"most {api.MAX_VISION_TOKENS:,} vision tokens per sample)"),
    _flag("--images-per-sample", type=int, help="repeat the image sizes this many times (default 1; at most "
          f"{api.MAX_IMAGES_PER_SAMPLE} images per sample)"),
    _flag("--vision-tokens", type=int, help="vision tokens per sample instead of image sizes (a square grid, e.g. "
          f"9216; at most {api.MAX_VISION_TOKENS:,})"),
    _flag("--video", dest="videos", type=_video, action="append", metavar="FRAMESxHxW",
          help=f"a video clip per sample, as sampled frames x height x width, repeatable (e.g. 240x720x1280: 2 "
               f"minutes at 2 fps, 720p; {api.MIN_VIDEO_FRAMES} to {api.MAX_VIDEO_FRAMES} frames); with no "
               "--image-size the sample has no image"),
    _flag("--video-seconds", type=float, metavar="S", help="a clip of S seconds instead of --video (with --fps, "
          "default 2, and --video-size)"),
    _flag("--fps", type=float, help="frames sampled per second of --video-seconds or of --dataset's video files "
          "(default 2)"),
    _flag("--video-size", type=_image_size, metavar="WxH", help="frame size of --video-seconds (default 1280x720)"),
    _flag("--text-tokens", type=int, help="text tokens per sample (default 512; at least 2 per image + 1, at most "
          f"{api.MAX_TEXT_TOKENS:,})"),
    _flag("--audio-seconds", type=float, help="seconds of audio per sample (audio models; default 30; 0 to "
          f"{api.MAX_AUDIO_SECONDS:,g})"),
    _flag("--global-batch", type=int, help="samples per optimizer step (default 4 per GPU; at most "
          f"{api.MAX_GLOBAL_BATCH:,})"),
    _flag("--precision", default="bf16_mixed", choices=("bf16_mixed", "bf16_pure"),
          help="bf16_mixed (fp32 master + Adam, 16 B/param; default) or bf16_pure (8 B/param)"),
    _flag("--frozen", action="append", default=[], metavar="MODULE", help="freeze a module (repeatable)"),
)
"""``WorkloadInputs``; --video-seconds, --fps and --video-size make one more of its ``videos`` (--fps is
``DatasetInputs.fps`` too)."""
DATASET_FLAGS = (
    _flag("--dataset", dest="source", metavar="FILE", help="plan for a conversation / caption JSONL or JSON file "
          "(image sizes from file headers; videos, files sampled at --fps or frame lists, from their metadata) or a "
          "dataset histogram: samples are packed, step time is the busiest replica's under the per-step balancing, "
          "memory holds the heaviest micro-batch a replica gets; --global-batch still counts samples"),
    _flag("--tokenizer", metavar="DIR", help="folder whose tokenizer.json counts the dataset's text (default: the "
          "--model folder's if it has one, else estimated from UTF-8 bytes, stated in the plan)"),
    _flag("--min-pixels", type=int, metavar="N", help="fewest pixels an image is resized to (default: the model's "
          "image processor's, 3136 for Qwen2/2.5-VL, 65536 for Qwen3-VL)"),
    _flag("--max-pixels", type=int, metavar="N", help="most pixels an image is resized to (default: the model's "
          "image processor's, 12845056 for Qwen2/2.5-VL, 16777216 for Qwen3-VL)"),
    _flag("--pack-tokens", type=int, metavar="N", help="LLM-token budget of a pack (default: the fastest of 1, 2 "
          "and 4 times the longest sample, rounded up to 256)"),
    _flag("--rescan", action="store_true", help="scan --dataset again instead of reading its cached histogram (the "
          "cache is keyed by the path, size and modification time of the file, of every image it names and of the "
          "tokenizer.json, so a changed one is rescanned anyway)"),
    _flag("--data-root-only", action="store_true", help="skip and count rows naming a file outside --dataset's "
          "folder (an absolute path, ../, a symlink out), reading nothing there; by default rows may name any file"),
    _flag("--histogram-out", metavar="FILE", help="also write the dataset's histogram (a smaller --dataset for "
          "later plans)"),
)
"""``DatasetInputs`` (its ``pack`` has no flag: the command always packs), and the dataset's histogram file."""
SEARCH_FLAGS = (
    _flag("--placement", default="auto", choices=("auto", "colocated", "disjoint"),
          help="colocated: every module on all GPUs; disjoint: one GPU group per module; auto (default): the "
               "faster"),
    _flag("--fix", action="append", default=[], metavar="MODULE.FIELD=VALUE",
          help="pin a degree (fields: dp tp sp cp pp ep virtual_stages pp_schedule zero recompute micro_batch "
               "grad_accum gpus; or placement=...); pinning every field evaluates that exact strategy"),
    _flag("--no-cp", dest="allow_ring_cp", action="store_false",
          help="do not search ring context parallelism (searched by default: cp > 1 for the vision tower and the "
               "LLM, not inside a pipeline)"),
    _flag("--no-pp", dest="allow_pp", action="store_false",
          help="do not search pipeline parallelism of the LLM (searched by default: pp > 1 with 1F1B, interleaved "
               "1F1B or interleaved zero-bubble; Ulysses SP inside stages with --fix llm.sp=K)"),
    _flag("--workers", type=int, metavar="N", default=default_workers(),
          help=f"processes that cost candidates (default: the CPUs this process may use, {default_workers()} "
               "here); the plan is the same for any N"),
    _flag("--top-k", type=int, metavar="K", help=f"show the K best distinct plans (default 1, at most "
          f"{api.MAX_TOP_K})"),
    _flag("--attention", choices=ATTENTION_CALLS, help="how the runtime calls attention over windows, images and "
          "packed samples: varlen (one variable-length flash call per layer; CUDA) or sdpa (one SDPA call per "
          "segment); default: varlen on GPUs, sdpa on a CPU"),
    _flag("--linear-attention", choices=LINEAR_ATTENTION_KERNELS, help="which kernel runs linear-attention "
          "(Gated DeltaNet) layers: fla (flash-linear-attention's, one call per layer over packed samples; CUDA, "
          "pip install dhplan[gpu]) or torch (transformers' fallback per packed sample); default: fla on GPUs, "
          "torch on a CPU"),
    _flag("--max-seq", action="store_true", help="find the longest image sequence (vision tokens per sample) any "
          "plan fits (one plan: not with --top-k)"),
    _flag("--time-limit", type=float, default=None, metavar="S",
          help=f"CP-SAT time limit per solve in seconds (default 20, at most {api.MAX_TIME_LIMIT_S:g})"),
)
"""``SearchOptions``, and the arguments of each search: placement, fixes, top-k, --max-seq, the time limit."""
OUTPUT_FLAGS = (
    _flag("--json", action="store_true", help="print the plan JSON on stdout and nothing else (a JSON list with "
          "--top-k > 1)"),
    _flag("--out", metavar="PATH", help="where to write the plan (default plan.json; with --json: only when given; "
          "with --top-k K also PATH-2 ... PATH-K, all checked writable first)"),
    _flag("--trace", metavar="PATH", help="also write the best plan's predicted step as a Chrome trace (each GPU "
          "group's compute, communication, pipeline schedule and optimizer; open it in ui.perfetto.dev; `python -m "
          "runtime --trace DIR` writes the measured steps)"),
    _flag("--list-models", action="store_true", help="list catalog models and exit"),
    _flag("--list-gpus", action="store_true", help="list hardware and exit"),
)
"""The command's own."""

FLAG_GROUPS = (
    ("model and hardware", ClusterInputs, CLUSTER_FLAGS),
    ("workload (per sample)", WorkloadInputs, WORKLOAD_FLAGS),
    ("dataset (instead of the per-sample workload)", DatasetInputs, DATASET_FLAGS),
    ("search", SearchOptions, SEARCH_FLAGS),
    ("output", None, OUTPUT_FLAGS),
)
"""One argparse group per input section (``planner.inputs``), in --help's order, and the output flags."""


def _dest(name: str, options: dict[str, Any]) -> str:
    """The attribute a flag's value lands in: its section field (``dest``) or its name."""
    return options.get("dest", name.lstrip("-").replace("-", "_"))


def build_parser() -> argparse.ArgumentParser:
    """The ``plan`` command's flags, a group per input section."""
    p = _Parser(prog="plan", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    for title, _, flags in FLAG_GROUPS:
        group = p.add_argument_group(title)
        for name, options in flags:
            group.add_argument(name, **options)
    return p


def _section(section: type, args: argparse.Namespace) -> Any:
    """A section of ``make_problem``'s inputs from its flags (a field without one keeps its default)."""
    flagged = {_dest(name, options) for _, _, flags in FLAG_GROUPS for name, options in flags}
    return section(**{f.name: getattr(args, f.name) for f in fields(section) if f.name in flagged})


def problem_inputs(args: argparse.Namespace) -> tuple[ClusterInputs, dict[str, Any]]:
    """The cluster and the other sections of ``api.make_problem`` (by keyword) the flags give."""
    workload = replace(_section(WorkloadInputs, args), videos=_videos(args))
    return _section(ClusterInputs, args), dict(workload=workload, dataset=_dataset_inputs(args),
                                               search=_section(SearchOptions, args))


def _dataset_inputs(args: argparse.Namespace) -> DatasetInputs | None:
    """--dataset's section, None without one (then no flag of it may be given)."""
    if args.source is None:
        if any(v is not None for v in (args.tokenizer, args.min_pixels, args.max_pixels, args.pack_tokens)):
            raise ValueError("--tokenizer, --min-pixels, --max-pixels, --pack-tokens and fps apply to --dataset")
        return None
    return _section(DatasetInputs, args)


DEFAULT_VIDEO_SIZE = (720, 1280)
"""(height, width) of --video-seconds frames by default: 720p."""


def _videos(args: argparse.Namespace) -> tuple[tuple[int, int, int], ...]:
    """The sample's clips: every --video, and one of --video-seconds at --fps of --video-size."""
    videos = tuple(args.videos or ())
    if args.video_seconds is None:
        if (args.fps is not None and args.source is None) or args.video_size is not None:
            raise ValueError("--fps and --video-size describe --video-seconds: give it too")
        return videos
    height, width = args.video_size or DEFAULT_VIDEO_SIZE
    return videos + ((api.video_frames(args.video_seconds, api.DEFAULT_FPS if args.fps is None else args.fps), height,
                      width),)


def plans_for(args: argparse.Namespace) -> list:
    """The plans the parsed ``args`` ask for (best first)."""
    from planner.dataset import write_histogram

    if args.model is None or args.gpus is None:
        raise ValueError("give --model and --gpus (or --list-models / --list-gpus)")
    cluster, inputs = problem_inputs(args)
    given = [flag for flag, value in (("--histogram-out", args.histogram_out), ("--rescan", args.rescan),
                                      ("--data-root-only", args.data_root_only)) if value]
    if args.source is None and given:
        raise ValueError(f"{given[0]} applies to --dataset: give one")
    if args.source is not None:
        inputs["dataset"] = replace(inputs["dataset"], source=dataset_of(args, rescan=args.rescan))
    if args.histogram_out:
        try:
            write_histogram(inputs["dataset"].source, args.histogram_out)
        except OSError as e:
            raise ValueError(f"cannot write --histogram-out {args.histogram_out}: {e.strerror}") from None
    if args.source is not None and not args.max_seq:
        return api.top_plans(args.model, cluster, k=args.top_k or 1, placement=args.placement, fix=args.fix,
                             time_limit_s=args.time_limit, **inputs)
    problem = api.make_problem(args.model, cluster, **inputs)
    if args.max_seq:
        return [api.max_seq(problem, placement=args.placement, fix=args.fix, time_limit_s=args.time_limit)]
    return api.top_plans(problem, k=args.top_k or 1, placement=args.placement, fix=args.fix,
                         time_limit_s=args.time_limit)


def dataset_of(args: argparse.Namespace, *, rescan: bool):
    """The --dataset's histogram, its text counted with --tokenizer or the model folder's."""
    from planner.dataset import read_dataset

    tokenizer = args.tokenizer if args.tokenizer is not None else api.model_folder_tokenizer(args.model)
    return read_dataset(args.source, tokenizer, rescan=rescan, data_root_only=args.data_root_only)


def parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    """``plan`` arguments parsed; a mistake is a one-line ValueError."""
    return build_parser().parse_args(argv)


def plans_from_arguments(argv: Sequence[str]) -> list:
    """The plans ``plan ARGV`` makes (best first), without writing or printing anything."""
    return plans_for(parse_arguments(argv))
