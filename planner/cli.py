"""``plan``: the per-module parallel layout that trains a VLM fastest on the given GPUs.

A thin layer over ``planner.api``: parse flags (``planner.arguments``), call ``top_plans`` / ``max_seq``, print,
write plan.json.
Bad input and infeasible requests print one line to stderr and exit with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from planner.arguments import dataset_of, parse_arguments, plans_for, problem_inputs
from planner.contract.file_io import check_output, is_device, refuse_shared_paths, write_output
from planner.contract.workload import DEFAULT_FPS, video_grid
from planner.cost.assumptions import DEFAULT_ASSUMPTIONS

EXIT_USER_ERROR = 2


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


def _write_trace(args: argparse.Namespace, plan) -> None:
    """--trace: the best plan's predicted step (planner.trace), re-costed on the problem it was planned on (a
    dataset's pack budget, --max-seq's image)."""
    from planner import api
    from planner.contract.trace_format import write_trace
    from planner.trace import plan_trace

    cluster, inputs = problem_inputs(args)
    if args.source is not None:
        inputs["dataset"] = replace(inputs["dataset"], source=dataset_of(args, rescan=False),
                                    pack_tokens=plan.workload.dataset.pack_tokens)
    if args.max_seq:
        inputs["workload"] = _max_seq_workload(inputs["workload"], plan.workload)
    trace = plan_trace(api.make_problem(args.model, cluster, **inputs), plan)
    try:
        write_trace(trace, args.trace)
    except OSError as e:
        raise ValueError(f"cannot write --trace {args.trace}: {e.strerror}") from None


def _max_seq_workload(asked, found):
    """The plan's ``WorkloadInputs``: what ``--max-seq`` found (its clips, or its one square image) in place of
    what was asked."""
    if found.videos:
        return replace(asked, videos=tuple(tuple(v) for v in found.videos))
    return replace(asked, image_sizes=None, vision_tokens=found.vision_tokens)


def _out_paths(out: str, count: int) -> list[Path]:
    """plan.json, plan-2.json, ... for the ranked plans."""
    path = Path(out)
    return [path] + [path.with_name(f"{path.stem}-{i}{path.suffix}") for i in range(2, count + 1)]


def check_writable(paths: list[Path], flag: str) -> None:
    """Raise a one-line ValueError unless every path can be written: its folder exists and is writable, and the
    path is a regular file, a character device or new (``planner.contract.file_io.check_output``), not a read-only one
    (checked before planning, so no plan is written when one cannot be)."""
    for path in paths:
        folder = path.parent
        check_output(path, flag)
        try:
            if not folder.is_dir():
                raise ValueError(f"cannot write {flag} {path}: no folder {folder}")
            if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
                raise ValueError(f"cannot write {flag} {path}: permission denied")
        except OSError as e:  # e.g. a name too long
            raise ValueError(f"cannot write {flag} {path}: {e.strerror}") from None


def _check_output_args(args: argparse.Namespace, out: str | None) -> None:
    """Output flags that contradict each other or cannot be written, before any planning."""
    from planner import api

    if args.out is not None and not args.out.strip():
        raise ValueError("--out needs a file path, got an empty one")
    if args.max_seq and args.top_k is not None:
        raise ValueError("--max-seq finds one plan, the longest sequence that fits: drop --top-k")
    if args.top_k is not None:
        api.check_bounds("--top-k", args.top_k, 1, api.MAX_TOP_K)  # before naming its output files
    if out:
        check_writable(_out_paths(out, args.top_k or 1), "--out")
    if args.trace is not None:
        if not args.trace.strip():
            raise ValueError("--trace needs a file path, got an empty one")
        check_writable([Path(args.trace)], "--trace")
    if args.histogram_out is not None:
        check_writable([Path(args.histogram_out)], "--histogram-out")
    refuse_shared_paths(_input_paths(args), _output_paths(args, out))


def _input_paths(args: argparse.Namespace) -> dict[str, str | None]:
    """The files and folders ``plan`` reads, by flag."""
    profile = None if args.profile in (None, "auto") else args.profile
    return {"--model": args.model, "--cluster": args.cluster_file, "--profile": profile, "--dataset": args.source,
            "--tokenizer": args.tokenizer}


def _output_paths(args: argparse.Namespace, out: str | None) -> dict[str, str | None]:
    """The files ``plan`` writes, by flag (the ranked plans as ``--out``, ``--out (plan 2)``, ...)."""
    plans = _out_paths(out, args.top_k or 1) if out else []
    return {**{"--out" + (f" (plan {i})" if i > 1 else ""): str(p) for i, p in enumerate(plans, 1)},
            "--trace": args.trace, "--histogram-out": args.histogram_out}


def _write(plans: list, out: str, asked: int) -> list[Path]:
    """Each plan to its ranked path (each written whole or not at all); the ranked paths up to ``asked`` that this
    run found no plan for are removed, so that no earlier run's plan stands beside these as if it were ranked."""
    paths = _out_paths(out, asked)
    for plan, path in zip(plans, paths):
        try:
            write_output(path, plan.to_json(), flag="--out")
        except OSError as e:
            raise ValueError(f"cannot write --out {path}: {e.strerror}") from None
    for stale in paths[len(plans):]:
        if not is_device(stale):
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
        parts.append(f"-> {w.llm_image_tokens:,} LLM {'vision' if w.videos else 'image'} tokens")
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


def render(plans: list, *, max_seq: bool = False, fps: float = DEFAULT_FPS) -> str:
    """All plans (top-k), best first; with --max-seq a headline with the longest sequence (a clip's length at
    ``fps``)."""
    head = [_max_seq_line(plans[0], fps), ""] if max_seq else []
    return "\n\n".join(["\n".join(head + [render_plan(plans[0])]), *(render_plan(p) for p in plans[1:])])


def _max_seq_line(plan, fps: float) -> str:
    """--max-seq's headline: the longest clip (a sample with clips), else the square image searched."""
    w = plan.workload
    margin = (f"at global batch {w.global_batch}, keeping {DEFAULT_ASSUMPTIONS.max_seq_memory_margin:.0%} of the "
              "usable memory for the cost model's error (max_seq_memory_margin)")
    if w.videos:
        return f"{_clip_line(plan, fps)}; {margin}"
    patch = plan.model.hf_config.get("vision_config", {}).get("patch_size", 14)
    side = round(w.vision_tokens**0.5) * patch
    return (f"longest image sequence that fits: {w.vision_tokens:,} vision tokens per sample (one {side}x{side} "
            f"image, {w.llm_image_tokens:,} LLM image tokens) {margin}")


def _clip_line(plan, fps: float) -> str:
    """The longest clip (the sample's last): frames, its length at ``fps``, the size the video processor resizes
    its frames to, and the sample's tokens as the workload line counts them."""
    from planner.api import clip_frame_bounds
    from planner.contract.families import model_from_hf_config

    w = plan.workload
    frames, height, width = w.videos[-1]
    spec = model_from_hf_config(plan.model.hf_config, plan.model.name)
    groups, rows, cols = video_grid(frames, height, width, spec)
    patch = spec.vision_input.patch_size
    most = clip_frame_bounds(spec)[1]
    bound = f" (the most a clip samples, {most}: memory is not what stops it)" if frames >= most else ""
    return (f"longest clip that fits: {frames} frames of {width}x{height} video = {_duration(frames / fps)} at "
            f"{fps:g} fps{bound}; the video processor resizes its frames to {cols * patch}x{rows * patch} "
            f"({groups} temporal groups of {rows * cols:,} patches); per sample {w.module_tokens['vision']:,} "
            f"vision tokens -> {w.llm_image_tokens:,} LLM vision tokens, {w.module_tokens['llm']:,} LLM tokens")


def _duration(seconds: float) -> str:
    """``6 min 24 s``, ``45 s``, ``1 h 2 min 5 s``."""
    minutes, rest = divmod(round(seconds, 1), 60)
    hours, minutes = divmod(int(minutes), 60)
    parts = [f"{hours} h"] * (hours > 0) + [f"{minutes} min"] * (minutes > 0) + [f"{rest:g} s"] * (rest > 0)
    return " ".join(parts) or "0 s"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``plan`` command."""
    try:
        args = parse_arguments(argv)
    except ValueError as e:
        _fail(str(e))
    if args.list_models or args.list_gpus:
        _list_models() if args.list_models else _list_gpus()
        return 0
    out = args.out if args.out is not None else (None if args.json else "plan.json")
    try:
        _check_output_args(args, out)
        plans = plans_for(args)
        paths = _write(plans, out, args.top_k or 1) if out else []
        if args.trace is not None:
            _write_trace(args, plans[0])
            paths.append(Path(args.trace))
    except (ValueError, NotImplementedError) as e:
        _fail(str(e))
    if args.json:
        text = plans[0].to_json() if len(plans) == 1 else "[\n" + ",\n".join(p.to_json().rstrip() for p in plans) + "\n]\n"
    else:
        report = render(plans, max_seq=args.max_seq, fps=args.fps or DEFAULT_FPS)
        text = f"{report}\nwrote {', '.join(map(str, paths))}\n"
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:  # `plan ... | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
