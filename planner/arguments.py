"""The ``plan`` command's arguments: its parser, and the plans they ask for through ``planner.api``.

``plans_from_arguments(["--model", "qwen-vl-7b", "--gpus", "8", ...])`` is ``plan ARGS`` as a function (what a runs
table's ``args`` column means to ``python -m planner.calibrate``); ``planner.cli`` adds the output.
"""

from __future__ import annotations

import argparse
import os
from typing import Sequence

from planner.contract.hardware import PLAUSIBLE_RANGES
from planner.contract.schema import ATTENTION_CALLS

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



def default_workers() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1



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


def build_parser() -> argparse.ArgumentParser:
    from planner import api

    p = _Parser(prog="plan", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_argument_group("model and hardware")
    what.add_argument("--model", help="catalog name/alias (plan --list-models) or a path to a config.json")
    what.add_argument("--gpus", type=int, help=f"number of GPUs (1 to {api.MAX_GPUS:,})")
    what.add_argument("--gpu", default="h100-80gb", help="hardware (plan --list-gpus; default h100-80gb)")
    what.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: the hardware's, 8; at most "
                      f"{PLAUSIBLE_RANGES['devices_per_node'].high:,g})")
    what.add_argument("--cluster", metavar="FILE", help="JSON/YAML cluster file overriding the hardware's numbers "
                      "(in bytes, bytes/s, FLOP/s and seconds, each within a plausible range)")
    what.add_argument("--profile", metavar="FILE",
                      help="measured profile to cost with (default: profiles/<gpu>/<model>.json if present; "
                           "'none' for the analytical model only)")
    data = p.add_argument_group("workload (per sample)")
    data.add_argument("--image-size", type=_image_size, action="append", metavar="WxH",
                      help=f"image size in pixels, repeatable (default one 1344x1344; sides up to "
                           f"{api.MAX_IMAGE_SIDE:,}, at most {api.MAX_VISION_TOKENS:,} vision tokens per sample)")
    data.add_argument("--images-per-sample", type=int, help="repeat the image sizes this many times (default 1; "
                      f"at most {api.MAX_IMAGES_PER_SAMPLE} images per sample)")
    data.add_argument("--vision-tokens", type=int, help="vision tokens per sample instead of image sizes "
                      f"(a square grid, e.g. 9216; at most {api.MAX_VISION_TOKENS:,})")
    data.add_argument("--video", type=_video, action="append", metavar="FRAMESxHxW",
                      help=f"a video clip per sample, as sampled frames x height x width, repeatable (e.g. "
                           f"240x720x1280: 2 minutes at 2 fps, 720p; {api.MIN_VIDEO_FRAMES} to "
                           f"{api.MAX_VIDEO_FRAMES} frames); with no --image-size the sample has no image")
    data.add_argument("--video-seconds", type=float, metavar="S", help="a clip of S seconds instead of --video "
                      "(with --fps, default 2, and --video-size)")
    data.add_argument("--fps", type=float, help="frames sampled per second of --video-seconds or of --dataset's "
                      "video files (default 2)")
    data.add_argument("--video-size", type=_image_size, metavar="WxH", help="frame size of --video-seconds "
                      "(default 1280x720)")
    data.add_argument("--text-tokens", type=int, help="text tokens per sample (default 512; at least 2 per image "
                      f"+ 1, at most {api.MAX_TEXT_TOKENS:,})")
    data.add_argument("--audio-seconds", type=float, help="seconds of audio per sample (audio models; default 30; "
                      f"0 to {api.MAX_AUDIO_SECONDS:,g})")
    data.add_argument("--global-batch", type=int, help="samples per optimizer step (default 4 per GPU; at most "
                      f"{api.MAX_GLOBAL_BATCH:,})")
    data.add_argument("--precision", default="bf16_mixed", choices=("bf16_mixed", "bf16_pure"),
                      help="bf16_mixed (fp32 master + Adam, 16 B/param; default) or bf16_pure (8 B/param)")
    data.add_argument("--frozen", action="append", default=[], metavar="MODULE", help="freeze a module (repeatable)")
    dataset = p.add_argument_group("dataset (instead of the per-sample workload)")
    dataset.add_argument("--dataset", metavar="FILE", help="plan for a conversation / caption JSONL or JSON file "
                         "(image sizes from file headers; videos, files sampled at --fps or frame lists, from their "
                         "metadata) or a dataset histogram: samples are packed, step time is the busiest replica's "
                         "under the per-step balancing, memory holds the heaviest micro-batch a replica gets; "
                         "--global-batch still counts samples")
    dataset.add_argument("--tokenizer", metavar="DIR", help="folder whose tokenizer.json counts the dataset's text "
                         "(default: the --model folder's if it has one, else estimated from UTF-8 bytes, stated in "
                         "the plan)")
    dataset.add_argument("--min-pixels", type=int, metavar="N", help="fewest pixels an image is resized to "
                         "(default: the model's image processor's, 3136 for Qwen2/2.5-VL, 65536 for Qwen3-VL)")
    dataset.add_argument("--max-pixels", type=int, metavar="N", help="most pixels an image is resized to "
                         "(default: the model's image processor's, 12845056 for Qwen2/2.5-VL, 16777216 for Qwen3-VL)")
    dataset.add_argument("--pack-tokens", type=int, metavar="N", help="LLM-token budget of a pack (default: the "
                         "fastest of 1, 2 and 4 times the longest sample, rounded up to 256)")
    dataset.add_argument("--rescan", action="store_true", help="scan --dataset again instead of reading its cached "
                         "histogram (the cache is keyed by the path, size and modification time of the file, of every "
                         "image it names and of the tokenizer.json, so a changed one is rescanned anyway)")
    dataset.add_argument("--data-root-only", action="store_true", help="skip and count rows naming a file outside "
                         "--dataset's folder (an absolute path, ../, a symlink out), reading nothing there; by "
                         "default rows may name any file")
    dataset.add_argument("--histogram-out", metavar="FILE", help="also write the dataset's histogram (a smaller "
                         "--dataset for later plans)")
    search = p.add_argument_group("search")
    search.add_argument("--placement", default="auto", choices=("auto", "colocated", "disjoint"),
                        help="colocated: every module on all GPUs; disjoint: one GPU group per module; "
                             "auto (default): the faster")
    search.add_argument("--fix", action="append", default=[], metavar="MODULE.FIELD=VALUE",
                        help="pin a degree (fields: dp tp sp cp pp ep virtual_stages pp_schedule zero recompute "
                             "micro_batch grad_accum gpus; or placement=...); pinning every field evaluates that "
                             "exact strategy")
    search.add_argument("--allow-cp", action="store_true",
                        help="also search ring context parallelism (cp > 1): costed, but `python -m runtime` "
                             "cannot run it yet")
    search.add_argument("--no-pp", action="store_true",
                        help="do not search pipeline parallelism of the LLM (searched by default: pp > 1 with "
                             "1F1B, interleaved 1F1B or interleaved zero-bubble; Ulysses SP inside stages with "
                             "--fix llm.sp=K)")
    search.add_argument("--workers", type=int, metavar="N", default=default_workers(),
                        help="processes that cost candidates (default: the CPUs this process may use, "
                             f"{default_workers()} here); the plan is the same for any N")
    search.add_argument("--top-k", type=int, metavar="K",
                        help=f"show the K best distinct plans (default 1, at most {api.MAX_TOP_K})")
    search.add_argument("--attention", choices=ATTENTION_CALLS, help="how the runtime calls attention over "
                        "windows, images and packed samples: varlen (one variable-length flash call per layer; "
                        "CUDA) or sdpa (one SDPA call per segment); default: varlen on GPUs, sdpa on a CPU")
    search.add_argument("--max-seq", action="store_true",
                        help="find the longest image sequence (vision tokens per sample) any plan fits (one plan: "
                             "not with --top-k)")
    search.add_argument("--time-limit", type=float, default=None, metavar="S",
                        help=f"CP-SAT time limit per solve in seconds (default 20, at most {api.MAX_TIME_LIMIT_S:g})")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true",
                     help="print the plan JSON on stdout and nothing else (a JSON list with --top-k > 1)")
    out.add_argument("--out", metavar="PATH", help="where to write the plan (default plan.json; with --json: "
                     "only when given; with --top-k K also PATH-2 ... PATH-K, all checked writable first)")
    out.add_argument("--trace", metavar="PATH", help="also write the best plan's predicted step as a Chrome trace "
                     "(each GPU group's compute, communication, pipeline schedule and optimizer; open it in "
                     "ui.perfetto.dev; `python -m runtime --trace DIR` writes the measured steps)")
    out.add_argument("--list-models", action="store_true", help="list catalog models and exit")
    out.add_argument("--list-gpus", action="store_true", help="list hardware and exit")
    return p



def problem_inputs(args: argparse.Namespace) -> dict:
    """Keyword inputs of ``api.make_problem``."""
    return dict(
        gpu=args.gpu, gpus_per_node=args.gpus_per_node, cluster_file=args.cluster, image_sizes=args.image_size,
        vision_tokens=args.vision_tokens, text_tokens=args.text_tokens, images_per_sample=args.images_per_sample,
        audio_seconds=args.audio_seconds, global_batch=args.global_batch, precision=args.precision,
        videos=_videos(args),
        frozen=args.frozen, profile=None if (args.profile or "").lower() == "none" else (args.profile or "auto"),
        allow_ring_cp=args.allow_cp, allow_pp=not args.no_pp, dataset=args.dataset, tokenizer=args.tokenizer, min_pixels=args.min_pixels,
        max_pixels=args.max_pixels, pack_tokens=args.pack_tokens, workers=args.workers, attention=args.attention,
        **({"fps": args.fps} if args.dataset is not None else {}),
    )


DEFAULT_VIDEO_SIZE = (720, 1280)
"""(height, width) of --video-seconds frames by default: 720p."""


def _videos(args: argparse.Namespace) -> tuple[tuple[int, int, int], ...]:
    """The sample's clips: every --video, and one of --video-seconds at --fps of --video-size."""
    from planner import api

    videos = tuple(args.video or ())
    if args.video_seconds is None:
        if (args.fps is not None and args.dataset is None) or args.video_size is not None:
            raise ValueError("--fps and --video-size describe --video-seconds: give it too")
        return videos
    height, width = args.video_size or DEFAULT_VIDEO_SIZE
    return videos + ((api.video_frames(args.video_seconds, api.DEFAULT_FPS if args.fps is None else args.fps), height,
                      width),)


def plans_for(args: argparse.Namespace) -> list:
    from planner import api
    from planner.dataset import write_histogram

    if args.model is None or args.gpus is None:
        raise ValueError("give --model and --gpus (or --list-models / --list-gpus)")
    inputs = problem_inputs(args)
    given = [flag for flag, value in (("--histogram-out", args.histogram_out), ("--rescan", args.rescan),
                                      ("--data-root-only", args.data_root_only)) if value]
    if args.dataset is None and given:
        raise ValueError(f"{given[0]} applies to --dataset: give one")
    if args.dataset is not None:
        inputs["dataset"] = dataset_of(args, rescan=args.rescan)
    if args.histogram_out:
        try:
            write_histogram(inputs["dataset"], args.histogram_out)
        except OSError as e:
            raise ValueError(f"cannot write --histogram-out {args.histogram_out}: {e.strerror}") from None
    if args.dataset is not None and not args.max_seq:
        return api.top_plans(args.model, args.gpus, k=args.top_k or 1, placement=args.placement, fix=args.fix,
                             time_limit_s=args.time_limit, **inputs)
    problem = api.make_problem(args.model, args.gpus, **inputs)
    if args.max_seq:
        return [api.max_seq(problem, placement=args.placement, fix=args.fix, time_limit_s=args.time_limit)]
    return api.top_plans(problem, k=args.top_k or 1, placement=args.placement, fix=args.fix,
                         time_limit_s=args.time_limit)


def dataset_of(args: argparse.Namespace, *, rescan: bool):
    """The --dataset's histogram, its text counted with --tokenizer or the model folder's."""
    from planner import api
    from planner.dataset import read_dataset

    tokenizer = args.tokenizer if args.tokenizer is not None else api.model_folder_tokenizer(args.model)
    return read_dataset(args.dataset, tokenizer, rescan=rescan, data_root_only=args.data_root_only)



def parse_arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    """``plan`` arguments parsed; a mistake is a one-line ValueError."""
    return build_parser().parse_args(argv)


def plans_from_arguments(argv: Sequence[str]) -> list:
    """The plans ``plan ARGV`` makes (best first), without writing or printing anything."""
    return plans_for(parse_arguments(argv))
