"""Plans as tables, for notebooks: compare plans, sweep the planner over a grid, find the longest image sequence
each strategy fits, and check the cost model against committed profiles.

* ``compare(plans) -> DataFrame``: one row per Plan (placement, per-module degrees, step time, tokens/s, MFU, peak
  memory and its breakdown, the binding module, speed-up vs the baselines).
* ``sweep(model=..., gpus=[...], ...) -> DataFrame``: the planner (and optionally the baselines) over a grid; a
  point where nothing fits is a row with ``feasible=False`` and the planner's one-line reason.
* ``baseline_plans`` / ``longest_sequence(s)``: the baselines as full Plans, and the longest square image each
  strategy fits.
* ``layer_fidelity`` / ``load_fidelity_results``: measured (profiles, fidelity benchmark) vs predicted.
* ``plot_*``: the figures the notebooks and ``scripts/make_figures.py`` share (they draw on a given Axes).

Imports pandas; OR-Tools only when a plan is solved (through ``planner.api``); never torch, ray or transformers.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from planner.api import DEFAULT_GPU, Infeasible, evaluate, make_problem, max_seq, plan, with_max_seq_margin
from planner.inputs import ClusterInputs, DatasetInputs, SearchOptions, WorkloadInputs
from planner.dataset import DatasetHistogram
from planner.search.baselines import best_of, megatron_family, uniform_tp_family, zero3_family
from planner.catalog import get_model
from planner.cost import DEFAULT_ASSUMPTIONS, CostAssumptions, estimate
from planner.problem import Problem
from planner.cost.comm import Link
from planner.cost.layers import Shard, layer_terms
from planner.contract.hardware import DeviceSpec, get_device
from planner.contract.models import ModelSpec
from planner.profiles import LayerPoint, MemoryPoint, Profile, device_from_profile, load_profile
from planner.contract.schema import Plan
from planner.contract.strategy import Strategy, strategy_of
from planner.contract.workload import Workload, module_tokens, smart_resize

__all__ = [
    "BASELINES", "MEMORY_PARTS", "MODULE_FIELDS", "STRATEGIES", "STRATEGY_LABELS", "baseline_plans",
    "binding_module", "compare", "layer_fidelity", "load_fidelity_results", "longest_sequence", "longest_sequences",
    "plan_row", "plot_longest_sequences", "plot_memory", "plot_step_trace", "plot_throughput", "sweep",
    "dataset_comparison",
    "mixed_resolution_histogram", "strategy_of",
]

BASELINES = {"uniform_tp": uniform_tp_family, "zero3": zero3_family, "megatron": megatron_family}
"""Baseline name -> the family of module strategies it is the best of (``planner.search.baselines``)."""
STRATEGIES = ("auto", *BASELINES)
"""What a row's ``strategy`` column holds: the planner's plan (auto) or a baseline."""
STRATEGY_LABELS = {"auto": "planner (auto)", "uniform_tp": "uniform TP", "zero3": "ZeRO-3", "megatron": "Megatron"}
"""Short names for legends."""
MEMORY_PARTS = ("weights", "gradients", "optimizer", "activations", "buffers", "overhead")
"""Memory breakdown columns ``<part>_gib`` (per GPU, on the GPU with the peak)."""
MODULE_FIELDS = ("dp", "tp", "sp", "cp", "pp", "zero", "recompute", "micro_batch", "grad_accum")
"""Per-module degree columns ``<module>_<field>``."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per activation element of a profile's dtype."""
FIDELITY_KEYS = ("name", "predicted_s", "measured_s")
"""Keys every row of a fidelity results file must have."""
MAX_SIDE_PATCHES = 2048
"""Largest square image side (patches) the baseline search tries: 4M vision tokens, as ``planner.api.max_seq``."""


# --- compare ----------------------------------------------------------------------------------------------------


def module_step_time(plan: Plan, name: str) -> float:
    """Seconds one step keeps a module's GPUs busy: grad_accum micro-batches, exposed DP communication, optimizer."""
    m = plan.module(name)
    t = m.predicted.time_s
    return m.grad_accum * t.per_micro_batch + t.dp_comm + t.optimizer


def binding_module(plan: Plan) -> str:
    """The module that sets the step time: the one taking the most of the step (colocated), or the slowest
    pipeline stage per micro-batch (disjoint) -- the cost model's own rule (``cost.estimate``)."""
    if plan.placement == "disjoint":
        return max(plan.modules, key=lambda m: m.predicted.time_s.per_micro_batch).name
    return max(plan.modules, key=lambda m: module_step_time(plan, m.name)).name


def _speedups(plan: Plan) -> dict[str, float]:
    """``speedup_vs_<baseline>`` (baseline step / plan step; NaN when the baseline does not fit; also over the
    planner's best plan on the other side of pipeline parallelism, ``with_pp`` / ``without_pp``, when it searched
    PP) and the speed-up over the fastest reference baseline (``BASELINES``) that fits."""
    speedups = {f"speedup_vs_{name}": (math.nan if b.speedup is None else b.speedup)
                for name, b in plan.baselines.items()}
    fitting = [s for name, s in speedups.items() if name.removeprefix("speedup_vs_") in BASELINES and not math.isnan(s)]
    speedups["speedup_vs_best_baseline"] = min(fitting) if fitting else math.nan
    return speedups


def plan_row(plan: Plan) -> dict[str, Any]:
    """One plan as a flat dict (the columns of ``compare``)."""
    p = plan.predicted
    row: dict[str, Any] = {
        "model": plan.model.name,
        "gpu": plan.cluster.device.name,
        "num_gpus": plan.cluster.num_devices,
        "vision_tokens": plan.workload.module_tokens.get("vision", 0),
        "llm_tokens": plan.workload.module_tokens["llm"],
        "global_batch": plan.workload.global_batch,
        "placement": plan.placement,
        "status": plan.solver.status,
    }
    for m in plan.modules:
        row[f"{m.name}_gpus"] = len(m.ranks)
        row.update({f"{m.name}_{f}": getattr(m, f) for f in MODULE_FIELDS})
        row[f"{m.name}_time_s"] = module_step_time(plan, m.name)
    row.update(step_time_s=p.step_time_s, tokens_per_s=p.tokens_per_s, samples_per_s=p.samples_per_s, mfu=p.mfu,
               peak_memory_gib=p.peak_memory_gib)
    row.update({f"{part}_gib": getattr(p.memory_breakdown_gib, part) for part in MEMORY_PARTS})
    row.update(binding_module=binding_module(plan), binding=p.binding_constraint)
    row.update(_speedups(plan))
    return row


def compare(plans: Sequence[Plan] | Mapping[str, Plan]) -> pd.DataFrame:
    """One row per plan: placement, per-module degrees (``vision_tp``, ``llm_dp``, ...), step time, tokens/s,
    MFU, peak memory per GPU and its breakdown (``weights_gib`` ...), the binding module, and the speed-up over
    each baseline the plan file records (``speedup_vs_uniform_tp``, ``speedup_vs_zero3``, ``speedup_vs_megatron``;
    NaN where a baseline
    does not fit) and over the best of them.

    Args:
        plans: Plans (from ``plan``, ``evaluate``, ``load_plan``), or a mapping label -> plan (labels become the
            index).
    """
    if isinstance(plans, Mapping):
        return pd.DataFrame([plan_row(p) for p in plans.values()], index=pd.Index(list(plans), name="label"))
    return pd.DataFrame([plan_row(p) for p in plans])


# --- baselines as plans ----------------------------------------------------------------------------------------


def _baseline_strategy(problem: Problem, name: str) -> Strategy | str:
    """The fastest fitting member of a baseline family as a whole-model Strategy, or why none fits."""
    outcome = best_of(problem, name, BASELINES[name](problem))
    if outcome.estimate is None:
        return outcome.infeasible
    modules = {m: c.strategy for m, c in outcome.estimate.modules.items()}
    return Strategy(placement="colocated", modules=modules, precision=problem.precision)


def baseline_plans(model: str | ModelSpec | Problem, cluster: ClusterInputs | int | None = None,
                   **inputs: Any) -> dict[str, Plan | str]:
    """Each baseline's best strategy as an evaluated Plan (so it has a memory breakdown, like the planner's plan),
    or the one-line reason it does not fit. Inputs as for ``planner.api.make_problem``."""
    problem = model if isinstance(model, Problem) else make_problem(model, cluster, **inputs)
    result: dict[str, Plan | str] = {}
    for name in BASELINES:
        strategy = _baseline_strategy(problem, name)
        result[name] = strategy if isinstance(strategy, str) else evaluate(problem, strategy)
    return result


# --- sweep ------------------------------------------------------------------------------------------------------


def _image(size: int | tuple[int, int] | None) -> tuple[int, int] | None:
    """A square side or (height, width) as (height, width); None keeps the planner's default image."""
    if size is None:
        return None
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _point_row(problem: Problem, image: tuple[int, int] | None, requested: str) -> dict[str, Any]:
    """The grid coordinates of a point (also the whole row when nothing fits)."""
    tokens = module_tokens(problem.workload, problem.model)
    return {
        "model": problem.model.name,
        "gpu": problem.cluster.device.name,
        "num_gpus": problem.num_gpus,
        "image": None if image is None else f"{image[0]}x{image[1]}",
        "vision_tokens": tokens["vision"].tokens if "vision" in tokens else 0,
        "llm_tokens": tokens["llm"].tokens,
        "global_batch": problem.workload.global_batch,
        "requested_placement": requested,
    }


def _outcome_row(point: dict[str, Any], strategy: str, outcome: Plan | str) -> dict[str, Any]:
    if isinstance(outcome, str):
        return {**point, "strategy": strategy, "feasible": False, "reason": outcome}
    return {**point, **plan_row(outcome), "strategy": strategy, "feasible": True, "reason": None}


def _planned(problem: Problem, placement: str, time_limit_s: float | None) -> Plan | str:
    """The planner's plan, or its one-line explanation when nothing fits (or no layout is valid)."""
    try:
        return plan(problem, placement=placement, time_limit_s=time_limit_s)
    except ValueError as e:  # Infeasible, or no valid layout at this GPU count / batch
        return str(e)


def sweep(
    model: str | ModelSpec | Sequence[str | ModelSpec],
    *,
    gpus: Sequence[int],
    image_sizes: Sequence[int | tuple[int, int] | None] = (None,),
    global_batches: Sequence[int | None] = (None,),
    gpu_types: Sequence[str] = (DEFAULT_GPU,),
    placements: Sequence[str] = ("auto",),
    baselines: bool = False,
    time_limit_s: float | None = None,
    workload: WorkloadInputs = WorkloadInputs(),
    search: SearchOptions = SearchOptions(),
    **cluster: Any,
) -> pd.DataFrame:
    """Run the planner over the grid model x GPU type x GPU count x image size x global batch x placement.

    Every point is a row: the ``compare`` columns plus ``image``, ``requested_placement``, ``strategy``
    (``auto``; with ``baselines=True`` also ``uniform_tp`` and ``zero3``, once per point), ``feasible`` and
    ``reason`` (the planner's one-line explanation when nothing fits; the other columns are then NaN).

    Args:
        model: A catalog name / config path / ModelSpec, or a list of them.
        gpus: GPU counts (each grid argument may also be a single value).
        image_sizes: One image per sample of each size: a square side in pixels, (height, width), or None for
            the planner's default (1344x1344).
        global_batches: Samples per step; None is the planner's default (4 per GPU).
        gpu_types: Catalog device names.
        placements: auto, colocated and/or disjoint.
        baselines: Also add the uniform-TP and ZeRO-3 baselines' best strategies (evaluated Plans) as rows.
        time_limit_s: CP-SAT time limit per solve (default: the solver's).
        workload: The rest of the workload, the same at every point (its image sizes and global batch are the
            grid's).
        search: The search's options at every point.
        **cluster: The other ``ClusterInputs`` fields at every point (``profile=None``, ``cluster_file=...``).

    Raises:
        ValueError: a bad input (unknown model or GPU, unaligned vision tokens), in one line.
    """
    rows = []
    grid = (_as_list(v) for v in (model, gpu_types, gpus, image_sizes, global_batches))
    for spec, gpu, n, size, batch in itertools.product(*grid):
        image = _image(size)
        sizes = None if image is None else [image]
        problem = make_problem(spec, ClusterInputs(gpus=n, gpu=gpu, **cluster), search=search,
                               workload=replace(workload, image_sizes=sizes, global_batch=batch))
        for requested in _as_list(placements):
            point = _point_row(problem, image, requested)
            rows.append(_outcome_row(point, "auto", _planned(problem, requested, time_limit_s)))
        if baselines:
            point = _point_row(problem, image, "colocated")
            rows += [_outcome_row(point, name, outcome) for name, outcome in baseline_plans(problem).items()]
    return pd.DataFrame(rows)


# --- longest sequence per strategy ------------------------------------------------------------------------------


def _largest(fits: Callable[[int], bool], limit: int) -> int | None:
    """Largest u in [1, limit] with fits(u), for a monotone (true, ..., true, false, ...) predicate: doubling
    then bisection. None when fits(1) is false."""
    if not fits(1):
        return None
    low, high = 1, 2
    while high <= limit and fits(high):
        low, high = high, 2 * high
    high = min(high, limit + 1)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def _with_square_image(problem: Problem, side_patches: int) -> Problem:
    workload: Workload = replace(problem.workload, image_sizes=(), vision_tokens=side_patches * side_patches)
    return replace(problem, workload=workload)


def longest_sequence(model: str | ModelSpec, cluster: ClusterInputs | int, *, strategy: str = "auto",
                     **inputs: Any) -> int | None:
    """Vision tokens per sample of the longest square (merge-aligned) image ``strategy`` fits at the given batch,
    or None when even the smallest image does not fit.

    ``auto`` is ``planner.api.max_seq`` (any plan the planner can find); a baseline name searches that baseline's
    family (``planner.search.baselines``) by bisection over the image side.
    """
    if strategy == "auto":
        try:
            return max_seq(model, cluster, **inputs).workload.vision_tokens
        except Infeasible:
            return None
    if strategy not in BASELINES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    problem = with_max_seq_margin(make_problem(model, cluster, **inputs))
    if problem.model.vision_input is None:
        raise ValueError(f"{problem.model.name} has no vision encoder: there is no image sequence to lengthen")
    merge = problem.model.vision_input.spatial_merge_size

    def fits(units: int) -> bool:
        at = _with_square_image(problem, units * merge)
        return best_of(at, strategy, BASELINES[strategy](at)).estimate is not None

    units = _largest(fits, MAX_SIDE_PATCHES // merge)
    return None if units is None else (units * merge) ** 2


def longest_sequences(
    model: str | ModelSpec, gpus: Sequence[int], strategies: Iterable[str] = STRATEGIES, **inputs: Any
) -> pd.DataFrame:
    """``longest_sequence`` for every (GPU count, strategy): columns num_gpus, strategy, vision_tokens (NaN when
    nothing fits) and image_px (the square image's side in pixels)."""
    spec = get_model(model) if isinstance(model, str) else model
    patch = spec.vision_input.patch_size if spec.vision_input is not None else 0
    rows = []
    for n, strategy in itertools.product(gpus, strategies):
        tokens = longest_sequence(spec, n, strategy=strategy, **inputs)
        side = math.nan if tokens is None else math.isqrt(tokens) * patch
        rows.append({"model": spec.name, "num_gpus": n, "strategy": strategy,
                     "vision_tokens": math.nan if tokens is None else tokens, "image_px": side})
    return pd.DataFrame(rows)


# --- datasets ---------------------------------------------------------------------------------------------------


def mixed_resolution_histogram(samples: int = 5000, seed: int = 0) -> DatasetHistogram:
    """A made-up mixed-resolution caption workload (a stated mixture, not measured from a real dataset): 55 % web
    photos (short side log-normal around 480 px), 30 % camera photos (around 1,500 px), 15 % screenshots and
    scans (720p to 4K, phone portrait, A4 at 300 dpi); aspect ratios 4:3, 3:2, 16:9 and 1:1, a quarter portrait;
    text log-normal around 120 tokens (20 to 2,048), one image per sample."""
    rng = np.random.default_rng(seed)
    kind = rng.choice(3, size=samples, p=[0.55, 0.30, 0.15])
    short = np.where(kind == 0, rng.lognormal(np.log(480), 0.35, samples), rng.lognormal(np.log(1500), 0.3, samples))
    short = np.clip(short, 150, 4000)
    aspect = rng.choice([4 / 3, 3 / 2, 16 / 9, 1.0], size=samples, p=[0.4, 0.25, 0.25, 0.1])
    portrait = rng.random(samples) < 0.25
    screens = np.array([(720, 1280), (1080, 1920), (1440, 2560), (2160, 3840), (1920, 1080), (3508, 2480)])
    screen = screens[rng.integers(0, len(screens), samples)]
    text = np.clip(rng.lognormal(np.log(120), 0.8, samples), 20, 2048).astype(int)
    shapes: dict[tuple[int, tuple[tuple[int, int], ...]], int] = {}
    for i in range(samples):
        if kind[i] == 2:
            h, w = (int(v) for v in screen[i])
        else:
            h, w = int(short[i]), int(short[i] * aspect[i])
            h, w = (w, h) if portrait[i] else (h, w)
        key = (int(text[i]), ((h, w),))
        shapes[key] = shapes.get(key, 0) + 1
    return DatasetHistogram(source=f"mixed_resolution_histogram(samples={samples}, seed={seed})",
                            text_tokens="drawn (log-normal around 120)", skipped={},
                            shapes=tuple((c, t, sizes, ()) for (t, sizes), c in sorted(shapes.items())))


def _resized_images(histogram: DatasetHistogram, model: ModelSpec, min_pixels: int, max_pixels: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(resized (height, width) of every image, each weighted by its count; text tokens per sample likewise)."""
    vi = model.vision_input
    sizes, weights, texts, counts = [], [], [], []
    for count, text, images, _ in histogram.shapes:
        for h, w in images:
            try:
                sizes.append(smart_resize(h, w, vi.patch_size * vi.spatial_merge_size, min_pixels, max_pixels))
                weights.append(count)
            except ValueError:
                continue
        texts.append(text)
        counts.append(count)
    return np.repeat(np.array(sizes), weights, axis=0), np.repeat(np.array(texts), counts)


def _layout(plan: Plan) -> str:
    return "; ".join(f"{m.name} DP{m.dp} TP{m.tp} SP{m.sp} Z{m.zero} rc={m.recompute} mb={m.micro_batch} "
                     f"ga={m.grad_accum}" for m in plan.modules)


def dataset_comparison(
    model: str, gpus: int, histogram: DatasetHistogram, *, min_pixels: int | None = None,
    max_pixels: int | None = None, global_batch: int | None = None, profile: str | None = None,
    time_limit_s: float | None = None,
) -> pd.DataFrame:
    """What planning for a dataset buys: plans made for the dataset (packed, and each sample alone), for its mean
    image and for its largest image (both with the mean text, one image per sample), each then costed on the
    dataset as it runs (the fixed-shape plans see every sample as its own micro-batch unit, so their memory must
    hold micro-batches of the largest samples). One row per plan: what it promised, its tokens/s and peak memory
    on the dataset, and whether it fits the heaviest micro-batch."""
    spec = get_model(model)
    pixels = dict(min_pixels=spec.vision_input.min_pixels if min_pixels is None else min_pixels,
                  max_pixels=spec.vision_input.max_pixels if max_pixels is None else max_pixels)
    cluster = ClusterInputs(gpus=gpus, profile=profile)
    unpacked = make_problem(spec, cluster, workload=WorkloadInputs(global_batch=global_batch),
                            dataset=DatasetInputs(source=histogram, pack=False, **pixels))
    sizes, texts = _resized_images(histogram, spec, pixels["min_pixels"], pixels["max_pixels"])
    mean_image = tuple(int(v) for v in sizes.mean(axis=0).round())
    largest_image = tuple(int(v) for v in sizes[np.argmax(sizes.prod(axis=1))])
    fixed = WorkloadInputs(text_tokens=int(round(texts.mean())), global_batch=unpacked.workload.global_batch)
    plans = {
        "the dataset (packed)": plan(spec, cluster, workload=WorkloadInputs(global_batch=global_batch),
                                     dataset=DatasetInputs(source=histogram, **pixels), time_limit_s=time_limit_s),
        "the dataset (unpacked)": plan(unpacked, time_limit_s=time_limit_s),
        f"the mean image {mean_image[1]}x{mean_image[0]}": plan(
            spec, cluster, workload=replace(fixed, image_sizes=[mean_image]), time_limit_s=time_limit_s),
        f"the largest image {largest_image[1]}x{largest_image[0]}": plan(
            spec, cluster, workload=replace(fixed, image_sizes=[largest_image]), time_limit_s=time_limit_s),
    }
    rows = []
    for label, p in plans.items():
        on_data = p.predicted if p.workload.dataset is not None else None
        if on_data is None:
            e = estimate(unpacked.model, unpacked.cluster, unpacked.workload, strategy_of(p), unpacked.assumptions,
                         unpacked.layer_costs)
            tokens_s, memory, fits = e.tokens_per_s, e.peak_memory_bytes / 1024**3, e.fits
        else:
            tokens_s, memory, fits = on_data.tokens_per_s, on_data.peak_memory_gib, True
        dataset_info = p.workload.dataset
        rows.append({"planned_for": label, "pack_tokens": dataset_info.pack_tokens if dataset_info else None,
                     "layout": _layout(p), "promised_tokens_per_s": p.predicted.tokens_per_s,
                     "dataset_tokens_per_s": tokens_s, "dataset_peak_memory_gib": memory,
                     "fits_heaviest_micro_batch": fits})
    table = pd.DataFrame(rows).set_index("planned_for")
    table.attrs["usable_gib"] = unpacked.usable_bytes / 1024**3
    return table


# --- fidelity ---------------------------------------------------------------------------------------------------


def _profile_device(profile: Profile) -> DeviceSpec:
    """The device the analytical model uses for this profile: the catalog entry of its hardware with the
    profile's measured numbers (FakeTensor profiles, which time nothing, use the default GPU)."""
    try:
        base = get_device(profile.hardware)
    except ValueError:
        base = get_device(DEFAULT_GPU)
    return device_from_profile(base, profile)


def _shard(
    model: ModelSpec, point: LayerPoint | MemoryPoint, device: DeviceSpec, assumptions: CostAssumptions
) -> Shard:
    """The cost model's view of a profiled shard: one square image / one sequence of ``seq_len`` tokens per
    sample, no recomputation, full backward (what the profiler runs)."""
    layer = model.module(point.module).layer(point.layer)
    window = layer.attention.window_patches if layer.attention is not None else None
    link = Link(bandwidth=device.intra_node_bandwidth, latency=device.intra_node_latency)
    return Shard(
        tp=point.tp, sp=point.sp, cp=1, micro_batch=point.micro_batch,
        tokens=point.micro_batch * point.seq_len / point.sp, segment_tokens=point.seq_len, segments=1.0,
        window_tokens=float(window) if window else 0.0, windows=point.seq_len / window if window else 0.0,
        recompute="none", backward="full", tp_link=link, sp_link=link, cp_link=link,
        device=device, assumptions=assumptions,
    )


def _fidelity_row(source: str, quantity: str, point: LayerPoint | MemoryPoint, measured: float,
                  predicted: float) -> dict[str, Any]:
    return {
        "source": source, "quantity": quantity, "module": point.module, "layer": point.layer, "tp": point.tp,
        "sp": point.sp, "seq_len": point.seq_len, "micro_batch": point.micro_batch, "measured": measured,
        "predicted": predicted, "error": predicted / measured - 1 if measured > 0 else math.nan,
    }


def layer_fidelity(
    profile: str | Path | Profile, model: str | ModelSpec | None = None,
    assumptions: CostAssumptions = DEFAULT_ASSUMPTIONS,
) -> pd.DataFrame:
    """Every measured layer shard of a profile next to the analytical cost model at the same shard.

    Rows (``quantity``): ``time_s`` -- forward + backward compute of a timed point (median) vs the roofline
    model on the profile's measured device; ``activation_bytes`` -- bytes autograd saved for backward (timed
    points and FakeTensor memory points) vs the Korthikanti-style activation model. The analytical model uses
    the profile's dtype for activations. ``error`` = predicted / measured - 1 (NaN when nothing was measured).

    Args:
        profile: A profile file or a loaded Profile.
        model: The profiled model (name or config path); default: the catalog entry named in the profile.
        assumptions: Cost-model knobs (``activation_bytes`` is replaced by the profile's dtype).
    """
    profile = profile if isinstance(profile, Profile) else load_profile(profile)
    spec = model if isinstance(model, ModelSpec) else get_model(model or profile.model)
    if spec.name != profile.model:
        raise ValueError(f"the profile measured {profile.model}, not {spec.name}")
    dtype = profile.provenance.dtype
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"profile dtype {dtype} is not one of {', '.join(DTYPE_BYTES)}")
    assumptions = replace(assumptions, activation_bytes=DTYPE_BYTES[dtype])
    device = _profile_device(profile)
    source = f"{profile.hardware}/{profile.model}"
    rows = []
    for p in profile.layers:
        terms = layer_terms(spec.module(p.module).layer(p.layer), _shard(spec, p, device, assumptions))
        rows.append(_fidelity_row(source, "time_s", p, p.forward.median_s + p.backward.median_s,
                                  terms.forward_s + terms.backward_s))
        rows.append(_fidelity_row(source, "activation_bytes", p, p.saved_activation_bytes, terms.saved_bytes))
    for p in profile.memory:
        terms = layer_terms(spec.module(p.module).layer(p.layer), _shard(spec, p, device, assumptions))
        rows.append(_fidelity_row(source, "activation_bytes", p, p.saved_activation_bytes, terms.saved_bytes))
    return pd.DataFrame(rows)


def load_fidelity_results(path: str | Path) -> pd.DataFrame:
    """The fidelity benchmark's results (``benchmarks/fidelity_cpu.py --json FILE``): a JSON list of rows
    ``{"name", "strategy", "predicted_s", "measured_s", ...}``, one per planned-and-run configuration. Returns
    them with ``error`` = predicted / measured - 1 recomputed.

    Raises:
        ValueError: unreadable file or rows without the keys, in one line.
    """
    path = Path(path)
    try:
        rows = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read fidelity results {path}: {e}") from None
    if not isinstance(rows, list) or not rows or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{path}: expected a non-empty JSON list of result rows")
    missing = [k for k in FIDELITY_KEYS if any(k not in r for r in rows)]
    if missing:
        raise ValueError(f"{path}: rows lack {', '.join(missing)} (write it with benchmarks/fidelity_cpu.py --json)")
    frame = pd.DataFrame(rows)
    frame["error"] = frame["predicted_s"] / frame["measured_s"] - 1
    return frame


# --- figures ----------------------------------------------------------------------------------------------------


def plot_throughput(frame: pd.DataFrame, ax, *, x: str = "vision_tokens", y: str = "tokens_per_s") -> None:
    """One line per strategy of ``y`` against ``x`` (rows of one GPU count from ``sweep``); a baseline's last
    fitting point is marked with an x where larger inputs stop fitting."""
    for strategy, rows in frame.groupby("strategy", sort=False):
        rows = rows.sort_values(x)
        fitting = rows[rows["feasible"]]
        (line,) = ax.plot(fitting[x], fitting[y], marker="o", label=STRATEGY_LABELS.get(strategy, strategy))
        if len(fitting) and len(fitting) < len(rows):
            last = fitting.iloc[-1]
            ax.plot([last[x]], [last[y]], marker="x", markersize=12, color=line.get_color(), linestyle="none")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("vision tokens per sample" if x == "vision_tokens" else x)
    ax.set_ylabel("LLM tokens / s" if y == "tokens_per_s" else y)
    ax.grid(True, alpha=0.3)
    ax.legend()


def plot_memory(frame: pd.DataFrame, ax, *, label: Callable[[pd.Series], str]) -> None:
    """Per-GPU memory breakdown of each feasible row as a stacked bar (on the GPU with the peak), each bar named by
    ``label(row)``."""
    rows = frame[frame["feasible"]] if "feasible" in frame else frame
    names = [label(r) for _, r in rows.iterrows()]
    bottom = [0.0] * len(rows)
    for part in MEMORY_PARTS:
        values = rows[f"{part}_gib"].tolist()
        ax.bar(names, values, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel("GiB per GPU (peak GPU)")
    ax.tick_params(axis="x", rotation=90)
    ax.legend(fontsize="small")


def plot_longest_sequences(frame: pd.DataFrame, ax) -> None:
    """Grouped bars: the longest vision sequence per sample of each strategy at each GPU count (from
    ``longest_sequences``)."""
    table = frame.pivot(index="num_gpus", columns="strategy", values="vision_tokens")
    table = table[[s for s in STRATEGIES if s in table.columns]].rename(columns=STRATEGY_LABELS)
    table.plot.bar(ax=ax, logy=True, rot=0)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("longest vision tokens per sample")
    ax.grid(True, axis="y", alpha=0.3)


TRACE_COLORS = (("recompute", "tab:purple"), ("weights", "tab:brown"), ("forward", "tab:blue"),
                ("backward", "tab:orange"), ("optimizer", "tab:red"), ("overhead", "tab:olive"))
"""Colour of a compute span by the first of these words in its name; communication spans are grey."""


def plot_step_trace(trace: Mapping[str, Any], ax, *, title: str = "", until_s: float | None = None,
                    legend: bool = False) -> None:
    """One step's trace (``planner.contract.trace_format``: ``plan --trace`` or ``python -m runtime --trace``) as bars, one
    row per rank and lane, time in ms; ``until_s`` fixes the x range (to compare two traces at one scale). The whole
    step's span (a measured trace's host lane) is left out."""
    from planner.contract.trace_format import LANES

    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] != "step"]
    rows = sorted({(e["pid"], e["tid"]) for e in spans})
    lanes = {tid: lane for lane, tid in LANES.items()}
    for y, (pid, tid) in enumerate(rows):
        mine = [e for e in spans if (e["pid"], e["tid"]) == (pid, tid)]
        colors = [next((c for word, c in TRACE_COLORS if word in e["name"]), "tab:gray") for e in mine]
        ax.broken_barh([(e["ts"] / 1e3, e["dur"] / 1e3) for e in mine], (y - 0.4, 0.8), facecolors=colors,
                       edgecolors="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)), [f"{names.get(pid, pid)}\n{lanes[tid]}" for pid, tid in rows], fontsize="small")
    ax.invert_yaxis()
    ax.set_xlim(0, (until_s or trace["otherData"]["step_time_s"]) * 1e3)
    ax.set_xlabel("ms from the step's start")
    ax.set_title(title, fontsize="medium")
    ax.grid(True, axis="x", alpha=0.3)
    if legend:
        from matplotlib.patches import Patch

        kinds = [(word, color) for word, color in TRACE_COLORS if any(word in e["name"] for e in spans)]
        ax.legend(handles=[Patch(color=c, label=w) for w, c in kinds + [("communication", "tab:gray")]],
                  fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
