"""Why no plan fits, and what would: the module over the limit and by how much, the smallest GPU count, the longest
image sequence. The searches decide feasibility straight from the candidates (``candidates.feasible``), exactly
as the CP-SAT model would, without solving.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Mapping

from planner.search.candidates import (Candidates, Fixes, build_candidates, extend_context_parallel, extend_pipelined,
                                       feasible, least_colocated_need)
from planner.search.enumeration import divisors, module_strategies, sp_degrees
from planner.contract.models import ModelSpec
from planner.contract.rules import CONTEXT_PARALLEL_MODULES
from planner.problem import DEFAULT_SAMPLES_PER_GPU, MAX_VIDEO_FRAMES, MIN_VIDEO_FRAMES, Problem
from planner.contract.units import GIB
from planner.contract.strategy import Placement
from planner.contract.workload import Workload

MAX_GPU_SEARCH = 65536
"""Largest GPU count the infeasibility explanation searches."""
MAX_GPU_COUNTS_SCANNED = 32
"""Most GPU counts ``smallest_gpu_count`` tries one by one, smallest first, when none of its doubling probes fits
(fitting is not monotone where the global batch caps data parallelism: the counts between two probes may fit)."""
MAX_SEQ_SIDE_PATCHES = 2048
"""Largest image side (in patches) the sequence search tries: 4M vision tokens."""


class Infeasible(ValueError):
    """No plan fits; the message says which module, by how much, and what would fit."""


def candidates_or_error(problem: Problem, placements: list[Placement], fixes: Fixes,
                        pipeline_limit_s: float = math.inf, defer_cp: bool = False) -> dict[str, Candidates]:
    """Candidates of each placement (``build_candidates``); a module no fix allows is a one-line error."""
    result = {p: build_candidates(problem, p, fixes, pipeline_limit_s=pipeline_limit_s, defer_cp=defer_cp)
              for p in placements}
    for cands in result.values():
        for module, reason in cands.invalid.items():
            if all(module in c.invalid for c in result.values()):
                if fixes.get(module):
                    raise ValueError(f"--fix: no valid {module} strategy: {reason}")
                raise ValueError(f"no valid {module} strategy on {problem.num_gpus} GPUs ({reason}); "
                                 f"{_usable_counts_hint(problem)}")
    return result


def _usable(problem: Problem, num_gpus: int) -> bool:
    """Whether every module has a valid colocated layout on ``num_gpus`` GPUs (memory aside)."""
    there = variant(problem, num_gpus=num_gpus)
    return all(module_strategies(there, m, num_gpus, {}, {})[0] for m in problem.model.module_names)


def _layout_counts(problem: Problem, module: str) -> set[int]:
    """dp * tp * sp over the degrees ``candidates._layouts`` tries: the GPU counts the module can use without
    context parallelism."""
    node, batch = problem.cluster.devices_per_node, problem.workload.global_batch
    return {dp * tp * sp for dp in divisors(batch) for tp in divisors(node) for sp in sp_degrees(problem.model, module)}


def layout_gpu_counts(problem: Problem, low: int, high: int) -> list[int]:
    """GPU counts in [low, high] that every module could use by arithmetic alone, ascending: a superset of the
    counts ``_usable`` accepts, found from the degrees rather than by trying every count. A module that may use
    context parallelism (the LLM or the vision tower, with ``allow_ring_cp``) can use any multiple of its
    dp * tp * sp; the audio encoder only dp * tp * sp itself."""
    finite, multiples = [], []
    for module in problem.model.module_names:
        counts = _layout_counts(problem, module)
        cp_allowed = problem.allow_ring_cp and module in CONTEXT_PARALLEL_MODULES
        (multiples if cp_allowed else finite).append(counts)
    if finite:
        found = {k for k in set.intersection(*finite) if low <= k <= high}
    else:
        found = {k for b in set.union(*multiples) for k in range(-(-low // b) * b, high + 1, b)}
    return sorted(k for k in found if all(any(k % b == 0 for b in counts) for counts in multiples))


def _usable_counts_hint(problem: Problem) -> str:
    """``usable GPU counts nearby: 6, 8`` (or a hint about the batch)."""
    n = problem.num_gpus
    below = next((k for k in reversed(layout_gpu_counts(problem, 1, n - 1)) if _usable(problem, k)), None)
    above = next((k for k in layout_gpu_counts(problem, n + 1, 4 * n) if _usable(problem, k)), None)
    nearby = [str(k) for k in (below, above) if k is not None]
    if not nearby:
        return f"try a global batch with more divisors than {problem.workload.global_batch}"
    return f"usable GPU counts nearby: {' or '.join(nearby)} (or a global batch divisible by {n})"


def explain_infeasible(problem: Problem, all_cands: Mapping[str, Candidates], fixes: Fixes) -> str:
    """One line: which module does not fit and by how much, and the smallest GPU count / longest image sequence
    that would fit."""
    usable = problem.usable_bytes
    what = _what_does_not_fit(problem, all_cands)
    hints = []
    more_gpus = smallest_gpu_count(problem, list(all_cands), fixes)
    if more_gpus is not None:
        hints.append(f"the smallest GPU count that fits is {more_gpus} "
                     f"({_gpus_flags(problem, more_gpus, list(all_cands), fixes)})")
    if problem.model.vision_input is not None:
        tokens = _longest_fitting_tokens(problem, list(all_cands), fixes)
        if tokens is not None:
            hints.append(f"at {problem.num_gpus} GPUs images up to {tokens:,} vision tokens per sample fit "
                         f"(--vision-tokens {tokens})")
    if not hints:
        hints.append(f"no GPU count up to {MAX_GPU_SEARCH:,} fits {_batch(problem)}, which caps data parallelism "
                     f"(and so ZeRO sharding){_default_batch_note(problem)}; try --global-batch with more GPUs, or "
                     f"--precision bf16_pure")
    return f"no plan fits {problem.num_gpus} x {problem.cluster.device.name} ({usable / GIB:.1f} GiB usable per " \
           f"GPU): {what}; {'; '.join(hints)}"


def _batch(problem: Problem) -> str:
    """``a global batch of 4 samples`` (packs for a dataset)."""
    return f"a global batch of {problem.workload.global_batch:,} {'packs' if problem.dataset else 'samples'}"


def _default_batch(problem: Problem) -> bool:
    """Whether the global batch is (or equals) the default, which grows with the GPU count."""
    return problem.dataset is None and problem.workload.global_batch == DEFAULT_SAMPLES_PER_GPU * problem.num_gpus


def _default_batch_note(problem: Problem) -> str:
    return f" (the default, {DEFAULT_SAMPLES_PER_GPU} per GPU: it grows with --gpus)" if _default_batch(problem) else ""


def _gpus_flags(problem: Problem, num_gpus: int, placements: list[str], fixes: Fixes) -> str:
    """``--gpus N``, or, where the default global batch grows with the GPU count and does not fit at ``num_gpus``
    GPUs when it has grown, ``--gpus N --global-batch B`` and why."""
    if not _default_batch(problem):
        return f"--gpus {num_gpus}"
    grown = replace(problem.workload, global_batch=DEFAULT_SAMPLES_PER_GPU * num_gpus)
    if _fits(variant(problem, num_gpus=num_gpus, workload=grown), placements, fixes):
        return f"--gpus {num_gpus}"
    return (f"--gpus {num_gpus} --global-batch {problem.workload.global_batch}: the default global batch, "
            f"{DEFAULT_SAMPLES_PER_GPU} per GPU, grows with --gpus and {grown.global_batch:,} does not fit there")


def _what_does_not_fit(problem: Problem, all_cands: Mapping[str, Candidates]) -> str:
    """The module (or module combination) that does not fit, with its smallest need."""
    usable, overhead = problem.usable_bytes, problem.overhead_bytes
    worst = None
    for module in problem.model.module_names:
        needs = [c.smallest[module] for c in all_cands.values() if module in c.smallest]
        if not needs:
            continue
        least = min(needs, key=lambda c: c.memory_bytes)
        need = least.memory_bytes + overhead
        if need > usable and (worst is None or need - usable > worst[1] - usable):
            worst = (module, need, least)
    if worst is not None:
        module, need, least = worst
        return (f"{module} does not fit: its smallest need is {need / GIB:.1f} GiB per GPU "
                f"({least.strategy.describe()} on {least.gpus} GPUs), {(need - usable) / GIB:.1f} GiB over")
    if "colocated" in all_cands:
        cands = all_cands["colocated"]
        names = " + ".join(cands.by_module)
        least = least_colocated_need(cands)
        if least is None:
            return f"colocated, {names} each fit alone but at no common grad_accum (all modules share one)"
        grad_accum, need = least[0], least[1] + overhead
        return (f"colocated, {names} together need at least {need / GIB:.1f} GiB per GPU (grad_accum "
                f"{grad_accum}), {_amount_over(need - usable)} over (each fits alone)")
    return f"no split of the {problem.num_gpus} GPUs gives every module a group it fits in"


def _amount_over(excess_bytes: int) -> str:
    """``2.5 GiB``, or MiB below 0.1 GiB so that a small excess does not read as 0.0."""
    return f"{excess_bytes / GIB:.1f} GiB" if excess_bytes >= 0.1 * GIB else f"{excess_bytes / 2**20:.1f} MiB"


def variant(problem: Problem, *, num_gpus: int | None = None, workload: Workload | None = None) -> Problem:
    """The same problem on another number of GPUs or with another workload."""
    cluster = problem.cluster if num_gpus is None else replace(problem.cluster, num_devices=num_gpus)
    return replace(problem, cluster=cluster, workload=workload or problem.workload)


def _fits(problem: Problem, placements: list[str], fixes: Fixes) -> bool:
    """Whether some plan of one of ``placements`` fits (no solve: ``candidates.feasible``). Context-parallel
    strategies are costed only when no plan without them fits, and then pipelined LLM strategies only when none
    fits without those (each can only add plans); of either, only those whose bounds leave them a chance to fit a GPU
    (``fits_only``)."""
    for p in placements:
        try:
            cands = build_candidates(problem, p, fixes, pipeline_limit_s=-math.inf, defer_cp=True)
        except NotImplementedError:
            continue
        if feasible(problem, cands) or any(
                extend(problem, cands, math.inf, fits_only=True) and feasible(problem, cands)
                for extend in (extend_context_parallel, extend_pipelined)):
            return True
    return False


def _gpu_counts_above(problem: Problem) -> list[int]:
    """Counts to try, ascending: those the layouts can use (``layout_gpu_counts``) up to one node, then whole nodes,
    up to MAX_GPU_SEARCH."""
    node = problem.cluster.devices_per_node
    return [n for n in layout_gpu_counts(problem, problem.num_gpus + 1, MAX_GPU_SEARCH) if n <= node or n % node == 0]


def smallest_gpu_count(problem: Problem, placements: list[str], fixes: Fixes) -> int | None:
    """Smallest GPU count above the problem's at which some plan fits (same batch; fixes without ``gpus``).

    Probes ``_gpu_counts_above`` at doubling positions until one fits, then bisects between it and the last probe
    that did not, so a search over thousands of counts costs a few dozen feasibility checks. Fitting is taken as
    monotone over these counts (memory per GPU falls as GPUs are added; the counts the batch cannot use are not in
    the list) until the batch caps data parallelism: when no probe fits, the counts between them are tried
    smallest first (``MAX_GPU_COUNTS_SCANNED``).
    """
    fixes = {m: {k: v for k, v in f.items() if k != "gpus"} for m, f in fixes.items()}
    counts = _gpu_counts_above(problem)

    def fits(index: int) -> bool:
        return _fits(variant(problem, num_gpus=counts[index]), placements, fixes)

    if not counts:
        return None
    low, high = -1, 0  # counts[low] does not fit (-1: none tried), counts[high] is the probe
    probed = set()
    while not fits(high):
        probed.add(high)
        if high == len(counts) - 1:
            between = [i for i in range(len(counts)) if i not in probed][:MAX_GPU_COUNTS_SCANNED]
            return next((counts[i] for i in between if fits(i)), None)
        low, high = high, min(2 * high + 1, len(counts) - 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return counts[high]


def vision_workload(problem: Problem, side: int) -> Workload:
    """The problem's workload with one square image of ``side`` x ``side`` patches per sample."""
    return replace(problem.workload, image_sizes=(), vision_tokens=side * side)


def longest_side(problem: Problem, placements: list[str], fixes: Fixes) -> int | None:
    """Largest merge-aligned square side (patches) at which a plan fits, by bisection; None if even the smallest
    image does not fit."""
    merge = problem.model.vision_input.spatial_merge_size

    def fits(units: int) -> bool:
        return _fits(variant(problem, workload=vision_workload(problem, units * merge)), placements, fixes)

    if not fits(1):
        return None
    low, high = 1, 2
    while high * merge <= MAX_SEQ_SIDE_PATCHES and fits(high):
        low, high = high, high * 2
    high = min(high, MAX_SEQ_SIDE_PATCHES // merge + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low * merge


def clip_frame_bounds(model: ModelSpec) -> tuple[int, int]:
    """Fewest and most frames of a clip the clip search tries, in whole temporal patches: the planner's and the
    video processor's bounds (``MIN_VIDEO_FRAMES``.. ``MAX_VIDEO_FRAMES``, ``VideoInputSpec.min_frames/max_frames``)."""
    vi = model.vision_input
    patch = vi.temporal_patch_size
    low = max(MIN_VIDEO_FRAMES, vi.video.min_frames)
    return math.ceil(low / patch) * patch, min(MAX_VIDEO_FRAMES, vi.video.max_frames) // patch * patch


def clip_workload(problem: Problem, frames: int) -> Workload:
    """The problem's workload with its last clip resampled to ``frames`` frames (same frame size; the images and
    other clips as they are)."""
    *others, (_, height, width) = problem.workload.videos
    return replace(problem.workload, videos=(*others, (frames, height, width)))


def longest_clip(problem: Problem, placements: list[str], fixes: Fixes) -> int | None:
    """Most frames (whole temporal patches, within ``clip_frame_bounds``) of the workload's last clip at which a
    plan fits: bisection over temporal groups, then up one group at a time while the next still fits (the resize
    makes memory not quite monotone in frames), so one group more never fits below the bound; None if even the
    shortest clip does not fit."""
    patch = problem.model.vision_input.temporal_patch_size
    low, high = (f // patch for f in clip_frame_bounds(problem.model))

    def fits(groups: int) -> bool:
        return _fits(variant(problem, workload=clip_workload(problem, groups * patch)), placements, fixes)

    if not fits(low):
        return None
    top = high
    while high - low > 0:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    while low < top and fits(low + 1):
        low += 1
    return low * patch


def _longest_fitting_tokens(problem: Problem, placements: list[str], fixes: Fixes) -> int | None:
    side = longest_side(problem, placements, fixes)
    return None if side is None else side * side
