"""``plan``: the per-module parallel layout that trains a VLM fastest on the given GPUs.

A thin layer over ``planner.api``: parse flags, call ``top_plans`` / ``max_seq``, print, write plan.json.
Bad input and infeasible requests print one line to stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, Sequence

from planner import api
from planner.contract.hardware import PLAUSIBLE_RANGES
from planner.cost.assumptions import DEFAULT_ASSUMPTIONS
from planner.contract.schema import ATTENTION_CALLS
from planner.contract.versioned_json import write_atomically
from planner.inputs import DEFAULT_GPU, ClusterInputs, DatasetInputs, SearchOptions, WorkloadInputs

EXIT_USER_ERROR = 2

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
        _fail(f"{message} (see plan --help)")


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
    _flag("--allow-cp", dest="allow_ring_cp", action="store_true",
          help="also search ring context parallelism (cp > 1): costed, but `python -m runtime` cannot run it yet"),
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


def _fail(message: str) -> None:
    print(f"plan: error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_USER_ERROR)


def _list_models() -> None:
    from planner.catalog import list_models

    for name, aliases, params, description in list_models():
        print(f"{name:18} {params / 1e9:7.2f}B  {description}  (aliases: {', '.join(aliases) or '-'})")


def _list_gpus() -> None:
    from planner.contract.hardware import list_devices

    for name, aliases, description in list_devices():
        print(f"{name:12} {description}  (aliases: {', '.join(aliases) or '-'})")


def _section(section: type, args: argparse.Namespace) -> Any:
    """A section of ``make_problem``'s inputs from its flags (a field without one keeps its default)."""
    flagged = {_dest(name, options) for _, _, flags in FLAG_GROUPS for name, options in flags}
    return section(**{f.name: getattr(args, f.name) for f in fields(section) if f.name in flagged})


def _problem_inputs(args: argparse.Namespace) -> tuple[ClusterInputs, dict[str, Any]]:
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


def _run(args: argparse.Namespace) -> list:
    from planner.dataset import write_histogram

    if args.model is None or args.gpus is None:
        raise ValueError("give --model and --gpus (or --list-models / --list-gpus)")
    cluster, inputs = _problem_inputs(args)
    if args.source is None and (args.histogram_out or args.rescan):
        raise ValueError(f"{'--histogram-out' if args.histogram_out else '--rescan'} applies to --dataset: give one")
    if args.source is not None:
        inputs["dataset"] = replace(inputs["dataset"], source=_histogram(args, rescan=args.rescan))
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


def _histogram(args: argparse.Namespace, *, rescan: bool):
    """The --dataset's histogram, its text counted with --tokenizer or the model folder's."""
    from planner.dataset import read_dataset

    tokenizer = args.tokenizer if args.tokenizer is not None else api.model_folder_tokenizer(args.model)
    return read_dataset(args.source, tokenizer, rescan=rescan)


def _write_trace(args: argparse.Namespace, plan) -> None:
    """--trace: the best plan's predicted step (planner.trace), re-costed on the problem it was planned on (a
    dataset's pack budget, --max-seq's image)."""
    from planner.trace import plan_trace
    from planner.contract.trace_format import write_trace

    cluster, inputs = _problem_inputs(args)
    if args.source is not None:
        inputs["dataset"] = replace(inputs["dataset"], source=_histogram(args, rescan=False),
                                    pack_tokens=plan.workload.dataset.pack_tokens)
    if args.max_seq:
        inputs["workload"] = replace(inputs["workload"], image_sizes=None, vision_tokens=plan.workload.vision_tokens)
    trace = plan_trace(api.make_problem(args.model, cluster, **inputs), plan)
    try:
        write_trace(trace, args.trace)
    except OSError as e:
        raise ValueError(f"cannot write {args.trace}: {e.strerror}") from None


def _out_paths(out: str, count: int) -> list[Path]:
    """plan.json, plan-2.json, ... for the ranked plans."""
    path = Path(out)
    return [path] + [path.with_name(f"{path.stem}-{i}{path.suffix}") for i in range(2, count + 1)]


def check_writable(paths: list[Path]) -> None:
    """Raise a one-line ValueError unless every path can be written: its folder exists and is writable, and the
    path is not a folder or a read-only file (checked before planning, so no plan is written when one cannot be)."""
    for path in paths:
        folder = path.parent
        try:
            if path.is_dir():
                raise ValueError(f"cannot write {path}: it is a folder")
            if not folder.is_dir():
                raise ValueError(f"cannot write {path}: no folder {folder}")
            if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
                raise ValueError(f"cannot write {path}: permission denied")
        except OSError as e:  # e.g. a name too long
            raise ValueError(f"cannot write {path}: {e.strerror}") from None


def _check_output_args(args: argparse.Namespace, out: str | None) -> None:
    """Output flags that contradict each other or cannot be written, before any planning."""
    if args.out is not None and not args.out.strip():
        raise ValueError("--out needs a file path, got an empty one")
    if args.max_seq and args.top_k is not None:
        raise ValueError("--max-seq finds one plan, the longest sequence that fits: drop --top-k")
    if args.top_k is not None:
        api.check_bounds("--top-k", args.top_k, 1, api.MAX_TOP_K)  # before naming its output files
    if out:
        check_writable(_out_paths(out, args.top_k or 1))
    if args.trace is not None:
        if not args.trace.strip() or (out and Path(args.trace).resolve() in [p.resolve() for p in _out_paths(
                out, args.top_k or 1)]):
            raise ValueError(f"--trace needs a file path of its own (not empty, not a plan's), got {args.trace!r}")
        check_writable([Path(args.trace)])


def _write(plans: list, out: str, asked: int) -> list[Path]:
    """Each plan to its ranked path (each written whole or not at all); the ranked paths up to ``asked`` that this
    run found no plan for are removed, so that no earlier run's plan stands beside these as if it were ranked."""
    paths = _out_paths(out, asked)
    for plan, path in zip(plans, paths):
        try:
            write_atomically(path, plan.to_json())
        except OSError as e:
            raise ValueError(f"cannot write {path}: {e.strerror}") from None
    for stale in paths[len(plans):]:
        stale.unlink(missing_ok=True)
    return paths[:len(plans)]


# --- Report ------------------------------------------------------------------------------------------------------


def _ranks(ranks: list[int]) -> str:
    """``0-15`` for a contiguous block."""
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


def _count(n: float) -> str:
    """1.2M, 33.5B."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _dataset_lines(w, pipelined: bool) -> list[str]:
    d = w.dataset
    tokens = "; ".join(f"{m} p50 {t.p50:,.0f} p95 {t.p95:,.0f} max {t.max:,.0f}" for m, t in d.tokens_per_sample.items())
    skipped = ", ".join(f"{n} {why}" for why, n in d.skipped.items()) or "none"
    if d.pack_tokens is None:
        packing = "one sample per micro-batch unit (no packing)"
    else:
        packing = (f"packs of {d.pack_tokens:,} LLM tokens: {d.samples_per_pack:.2f} samples each, "
                   f"{d.packing_efficiency:.1%} full")
    heaviest = ", ".join(f"{m} {t:,.0f}" for m, t in d.heaviest_pack_tokens.items())
    return [f"dataset    {d.source}: {d.samples:,} samples (skipped: {skipped}); text {d.text_tokens}",
            f"           tokens/sample {tokens}",
            f"           {packing}; mean pack {w.module_tokens['llm']:,} LLM tokens, heaviest pack {heaviest} "
            f"(memory holds a replica's heaviest micro-batch); {w.global_batch} packs/step"] + (
        [f"           the pipelined LLM pads every pack to {d.pack_tokens:,} tokens (one shape for its schedule): "
         f"{1 - d.packing_efficiency:.1%} of its tokens are padding, priced"] if pipelined else [])


def _workload_line(plan) -> str:
    w = plan.workload
    if w.dataset is not None:
        return "\n".join(_dataset_lines(w, plan.module("llm").pp > 1))
    inputs = []
    if w.vision_tokens is not None:
        inputs.append(f"{w.vision_tokens:,} vision tokens")
    elif w.image_sizes:
        sizes = ", ".join(dict.fromkeys(f"{wd}x{h}" for h, wd in w.image_sizes))
        inputs.append(f"{'1 image' if len(w.image_sizes) == 1 else f'{len(w.image_sizes)} images'} {sizes}")
    inputs += [f"a {frames}-frame {wd}x{h} video" for frames, h, wd in w.videos]
    parts = [", ".join(inputs)] if inputs else []
    if "vision" in w.module_tokens and w.vision_tokens is None:
        parts[-1] += f" ({w.module_tokens['vision']:,} vision tokens)"
    if w.audio_seconds:
        audio_llm = w.module_tokens["llm"] - w.text_tokens - w.llm_image_tokens
        parts.append(f"{w.audio_seconds:g} s audio ({w.module_tokens.get('audio', 0):,} encoder tokens -> "
                     f"{audio_llm:,} LLM audio tokens)")
    if w.llm_image_tokens:
        parts.append(f"-> {w.llm_image_tokens:,} LLM image tokens")
    video_text = w.module_tokens["llm"] - w.text_tokens - w.llm_image_tokens if w.videos else 0
    if video_text:
        parts.append(f"+ {video_text:,} video markers and timestamps")
    parts.append(f"{'+ ' if parts else ''}{w.text_tokens:,} text = {w.module_tokens['llm']:,} LLM tokens/sample")
    return f"workload   {' '.join(parts)}; global batch {w.global_batch}"


def _module_block(m) -> list[str]:
    t = m.predicted.time_s
    frozen = " (frozen)" if m.frozen else ""
    mem = m.predicted.memory_gib
    pipeline = f"PP {m.pp} x " if m.pp > 1 else ""
    split = t.ep_comm > 0  # experts split over an EP group of ep x tp ranks, exchanging tokens
    experts = f" (experts over EP {m.ep} x TP {m.tp})" if split else ""
    lines = [
        f"{m.name}{frozen}: {len(m.ranks)} GPUs (ranks {_ranks(m.ranks)}), {_count(m.num_params)} params",
        f"    {pipeline}DP {m.dp} x TP {m.tp} x SP {m.sp} x CP {m.cp}{experts}   ZeRO-{m.zero}   recompute {m.recompute}   "
        f"micro-batch {m.micro_batch}   grad accum {m.grad_accum}",
        f"    per step: forward {t.forward:.3f} s, backward {t.backward:.3f} s, recompute {t.recompute:.3f} s, "
        f"TP {t.tp_comm:.3f} s, SP {t.sp_comm:.3f} s, CP {t.cp_comm:.3f} s, "
        + (f"EP {t.ep_comm:.3f} s, " if split else "") + f"DP exposed {t.dp_comm:.3f} s, "
        f"optimizer {t.optimizer:.3f} s, hand-off {t.handoff:.3f} s"
        + (f", PP sends {t.pp_comm:.3f} s, PP bubble {t.pp_bubble:.3f} s" if m.pp > 1 else ""),
        f"    memory per GPU {mem.total:.1f} GiB (weights {mem.weights:.1f}, grads {mem.gradients:.1f}, "
        f"optimizer {mem.optimizer:.1f}, activations {mem.activations:.1f}, buffers {mem.buffers:.1f})",
    ]
    if m.pp > 1:
        lines.append(f"    pipeline: {_pipeline_line(m)}")
    if m.predicted.expected_imbalance is not None:
        lines.append(f"    balanced per step on its own work: expected imbalance {m.predicted.expected_imbalance:.3f} "
                     f"(busiest / mean replica over {m.dp} replicas; the times above are the busiest's)")
    return lines


def _pipeline_line(m) -> str:
    """``1f1b over 4 stages, decoder layers 15/17/17/15 (+embedding first, +norm, lm_head, loss last); per
    micro-batch 0.412/0.398/... s; stage peaks 61.2/55.0/... GiB``."""
    chunks = "/".join(map(str, m.pp_layers))
    schedule = m.pp_schedule + (f" x{m.virtual_stages} chunks per stage" if m.virtual_stages > 1 else "")
    times = "/".join(f"{t:.3f}" for t in m.predicted.stage_per_micro_batch_s or [])
    peaks = "/".join(f"{g:.1f}" for g in m.predicted.stage_peak_memory_gib or [])
    return (f"{schedule} over {m.pp} stages, decoder layers {chunks} (+embedding first; +norm, lm_head, loss last); "
            f"per micro-batch {times} s; own peak {peaks} GiB per stage")


def _breakdown(b) -> str:
    return (f"weights {b.weights:.1f} + grads {b.gradients:.1f} + optimizer {b.optimizer:.1f} + activations "
            f"{b.activations:.1f} + buffers {b.buffers:.1f} + overhead {b.overhead:.1f}")


def _at(phase: str | None) -> str:
    """`` (at the llm forward)`` for the summary, nothing for a plan written before phases were recorded."""
    return "" if phase is None else f" (at the {phase})"


def _baseline_table(plan) -> list[str]:
    rows = [f"{'':12} {'step time':>10} {'tokens/s':>10} {'MFU':>6} {'peak mem':>9}  plan speed-up",
            f"{'this plan':12} {plan.predicted.step_time_s:9.3f}s {plan.predicted.tokens_per_s:10,.0f} "
            f"{plan.predicted.mfu:6.1%} {plan.predicted.peak_memory_gib:6.1f}GiB  1.00x"]
    for name, label in (("without_pp", "without PP"), ("with_pp", "with PP"), ("uniform_tp", "uniform TP"),
                        ("zero3", "ZeRO-3"), ("megatron", "Megatron")):
        b = plan.baselines.get(name)
        if b is None:
            continue
        if b.infeasible:
            rows.append(f"{label:12} {b.infeasible}")
            continue
        rows.append(f"{label:12} {b.step_time_s:9.3f}s {b.tokens_per_s:10,.0f} {b.mfu:6.1%} "
                    f"{b.peak_memory_gib:6.1f}GiB  {b.speedup:.2f}x")
        rows.append(f"{'':12}   {'; '.join(f'{m}: {s}' for m, s in (b.modules or {}).items())}")
    return rows


def render_plan(plan) -> str:
    """The readable layout of one plan."""
    c, s, p = plan.cluster, plan.solver, plan.predicted
    fixed = f", fixed {' '.join(f'{k}={v}' for k, v in s.fixed.items())}" if s.fixed else ""
    lines = [
        f"plan #{s.rank}   {plan.model.name} ({_count(plan.model.num_params)}) on {c.num_devices} x {c.device.name} "
        f"({c.devices_per_node} per node), {plan.placement}; solver {s.status} over {s.num_candidates} "
        f"candidates{fixed}",
        _workload_line(plan),
        "",
    ]
    for m in plan.modules:
        lines += _module_block(m)
    lines += [
        "",
        f"step time        {p.step_time_s:.3f} s",
        f"tokens/s         {p.tokens_per_s:,.0f} ({p.samples_per_s:.2f} samples/s)",
        f"MFU              {p.mfu:.1%}",
        f"peak memory/GPU  {p.peak_memory_gib:.1f} GiB{_at(p.peak_phase)} = {_breakdown(p.memory_breakdown_gib)}",
        f"binding          {p.binding_constraint}",
        *([f"calibrated       {p.calibration}"] if p.calibration else []),
        "",
        *_baseline_table(plan),
    ]
    return "\n".join(lines)


def render(plans: list, *, max_seq: bool = False) -> str:
    """All plans (top-k), best first; with --max-seq a headline with the longest sequence."""
    head = []
    if max_seq:
        w = plans[0].workload
        patch = plans[0].model.hf_config.get("vision_config", {}).get("patch_size", 14)
        side = round(w.vision_tokens**0.5) * patch
        head = [f"longest image sequence that fits: {w.vision_tokens:,} vision tokens per sample "
                f"(one {side}x{side} image, {w.llm_image_tokens:,} LLM image tokens) at global batch "
                f"{w.global_batch}, keeping {DEFAULT_ASSUMPTIONS.max_seq_memory_margin:.0%} of the usable memory for "
                "the cost model's error (max_seq_memory_margin)", ""]
    return "\n\n".join(["\n".join(head + [render_plan(plans[0])]), *(render_plan(p) for p in plans[1:])])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``plan`` command."""
    args = build_parser().parse_args(argv)
    if args.list_models or args.list_gpus:
        _list_models() if args.list_models else _list_gpus()
        return 0
    out = args.out if args.out is not None else (None if args.json else "plan.json")
    try:
        _check_output_args(args, out)
        plans = _run(args)
        paths = _write(plans, out, args.top_k or 1) if out else []
        if args.trace is not None:
            _write_trace(args, plans[0])
            paths.append(Path(args.trace))
    except (ValueError, NotImplementedError) as e:
        _fail(str(e))
    if args.json:
        text = plans[0].to_json() if len(plans) == 1 else "[\n" + ",\n".join(p.to_json().rstrip() for p in plans) + "\n]\n"
    else:
        text = f"{render(plans, max_seq=args.max_seq)}\nwrote {', '.join(map(str, paths))}\n"
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `plan ... | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
