"""The planner as functions: ``plan``, ``top_plans``, ``evaluate``, ``max_seq`` -> ``schema.Plan``.

The ``plan`` command is a thin layer over these. Every function takes the model (a catalog name, a config.json
path, a ``ModelSpec``) or a ready ``Problem``, plus the inputs of ``make_problem`` as keywords. User mistakes
raise ``ValueError`` with one line; ``Infeasible`` (a ValueError) explains a request no plan fits.

Workload defaults (``plan --model qwen-vl-32b --gpus 16``): one 1344x1344 image per sample (96 x 96 patches =
9,216 vision tokens -> 2,304 LLM image tokens after the 2x2 merge), 512 text tokens, 30 s of audio for audio
models, and a global batch of 4 samples per GPU (64 at 16 GPUs).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Iterable, Mapping, Sequence

from planner.baselines import BASELINE_DESCRIPTIONS, BaselineOutcome, baselines
from planner.candidates import Candidates, Problem, extend_pipelined, pipelined_options
from planner.catalog import get_model
from planner.cost import DEFAULT_ASSUMPTIONS, CostAssumptions, Estimate, estimate
from planner.cost.assumptions import FP32_STATES
from planner.cost.report import module_predictions, prediction
from planner.cost.results import GIB
from planner.dataset import (
    DEFAULT_MAX_PIXELS,
    DEFAULT_MIN_PIXELS,
    DatasetHistogram,
    dataset_workload,
    pack_budgets,
    pack_dataset,
    percentiles,
    read_dataset,
    sample_tokens,
)
from planner.hardware import PLAUSIBLE_RANGES, Cluster, get_device, load_cluster_file, make_cluster
from planner.models import ModelSpec
from planner.schema import (
    SCHEMA_VERSION,
    BaselineResult,
    ClusterInfo,
    DatasetInfo,
    DeviceInfo,
    ModelInfo,
    ModulePlan,
    ModulePrediction,
    Plan,
    SolverInfo,
    TrainingInfo,
    WorkloadInfo,
    load_plan,
)
from planner.solver.explain import (
    Infeasible,
    candidates_or_error,
    explain_infeasible,
    longest_side,
    variant,
    vision_workload,
)
from planner.solver.fixes import fixed_text, parse_fixes, pinned_strategy, placements_to_solve
from planner.strategy import PLACEMENTS, PRECISIONS, Placement, Strategy
from planner.workload import Workload, module_tokens

__all__ = [
    "Infeasible", "Problem", "evaluate", "load_plan", "make_problem", "make_workload", "max_seq", "parse_fixes",
    "plan", "top_plans",
]

DEFAULT_GPU = "h100-80gb"
"""Hardware when none is named."""
DEFAULT_IMAGE_SIZE = (1344, 1344)
"""(height, width) of the default image: 96 x 96 patches of 14 px = 9,216 vision tokens, 2,304 after merging."""
DEFAULT_TEXT_TOKENS = 512
"""Text tokens per sample by default."""
DEFAULT_AUDIO_SECONDS = 30.0
"""Seconds of audio per sample by default for audio models (one Whisper window)."""
DEFAULT_SAMPLES_PER_GPU = 4
"""Default global batch = this many samples per GPU."""
MAX_GPUS = 65_536
"""Largest --gpus (the largest count the infeasibility explanation searches)."""
MAX_GLOBAL_BATCH = 2**20
"""Largest --global-batch, 1,048,576 samples per step."""
MAX_IMAGES_PER_SAMPLE = 256
"""Largest number of images per sample (--image-size given n times, times --images-per-sample)."""
MAX_IMAGE_SIDE = 32_768
"""Largest image side in pixels."""
MAX_VISION_TOKENS = 2**22
"""Largest vision tokens per sample, 4,194,304 (one 28,672-pixel square image; the --max-seq search's limit)."""
MAX_TEXT_TOKENS = 2**20
"""Largest --text-tokens, 1,048,576 per sample."""
MAX_AUDIO_SECONDS = 3600.0
"""Largest --audio-seconds per sample (an hour)."""
MAX_TIME_LIMIT_S = 3600.0
"""Largest --time-limit per solve in seconds."""
MAX_TOP_K = 20
"""Largest --top-k."""
OBJECTIVE_TOLERANCE_S = 5e-9
"""The solver's integer step time (ns, at most four rounded terms) vs the cost model's float step time."""
OBJECTIVE_RELATIVE_TOLERANCE = 1e-12
"""The same comparison for long steps, where the float step time itself carries more than a nanosecond of rounding."""


# --- Inputs -----------------------------------------------------------------------------------------------------


def check_bounds(flag: str, value: float, low: float, high: float) -> None:
    """Raise a one-line ValueError unless ``low <= value <= high`` (NaN never is)."""
    if not low <= value <= high:
        raise ValueError(f"{flag} must be between {low:,g} and {high:,g}, got {value:g}"
                         if isinstance(value, float) else f"{flag} must be between {low:,} and {high:,}, got {value}")


def _check_sample_inputs(
    image_sizes: Sequence[tuple[int, int]] | None,
    vision_tokens: int | None,
    text_tokens: int | None,
    images_per_sample: int | None,
    audio_seconds: float | None,
    global_batch: int | None,
) -> None:
    """Every per-sample input within its bound (``MAX_*``), in one line."""
    for h, w in image_sizes or ():
        check_bounds("--image-size sides", min(h, w), 1, MAX_IMAGE_SIDE)
        check_bounds("--image-size sides", max(h, w), 1, MAX_IMAGE_SIDE)
    if images_per_sample is not None:
        check_bounds("--images-per-sample", images_per_sample, 1, MAX_IMAGES_PER_SAMPLE)
    images = len(image_sizes or [DEFAULT_IMAGE_SIZE]) * (images_per_sample or 1)
    if images > MAX_IMAGES_PER_SAMPLE:
        raise ValueError(f"a sample may hold at most {MAX_IMAGES_PER_SAMPLE} images, got {images} "
                         f"(--image-size x --images-per-sample)")
    for flag, value, high in (("--vision-tokens", vision_tokens, MAX_VISION_TOKENS),
                              ("--text-tokens", text_tokens, MAX_TEXT_TOKENS),
                              ("--global-batch", global_batch, MAX_GLOBAL_BATCH)):
        if value is not None:
            check_bounds(flag, value, 0 if flag == "--text-tokens" else 1, high)
    if audio_seconds is not None:
        check_bounds("--audio-seconds", float(audio_seconds), 0.0, MAX_AUDIO_SECONDS)


def make_workload(
    model: ModelSpec,
    num_gpus: int,
    *,
    image_sizes: Sequence[tuple[int, int]] | None = None,
    vision_tokens: int | None = None,
    text_tokens: int | None = None,
    images_per_sample: int | None = None,
    audio_seconds: float | None = None,
    global_batch: int | None = None,
) -> Workload:
    """A workload from user inputs, with the documented defaults for what is not given.

    Raises:
        ValueError: inputs the model cannot take (images for an audio model, ...), in one line.
    """
    has_vision, has_audio = model.vision_input is not None, model.audio_input is not None
    _check_sample_inputs(image_sizes, vision_tokens, text_tokens, images_per_sample, audio_seconds, global_batch)
    if not has_vision and (image_sizes or vision_tokens or images_per_sample):
        raise ValueError(f"{model.name} has no vision encoder: drop --image-size/--vision-tokens/--images-per-sample")
    if not has_audio and audio_seconds:
        raise ValueError(f"{model.name} has no audio encoder: drop --audio-seconds")
    if vision_tokens is not None and images_per_sample not in (None, 1):
        raise ValueError("--vision-tokens sets a whole sample's vision tokens: drop --images-per-sample")
    sizes: tuple[tuple[int, int], ...] = ()
    if has_vision and vision_tokens is None:
        sizes = tuple(image_sizes or (DEFAULT_IMAGE_SIZE,)) * (images_per_sample or 1)
    default_audio = DEFAULT_AUDIO_SECONDS if has_audio else 0.0
    return Workload(
        image_sizes=sizes,
        vision_tokens=vision_tokens,
        text_tokens=DEFAULT_TEXT_TOKENS if text_tokens is None else text_tokens,
        audio_seconds=default_audio if audio_seconds is None else audio_seconds,
        global_batch=DEFAULT_SAMPLES_PER_GPU * num_gpus if global_batch is None else global_batch,
    )


def make_cluster_for(
    num_gpus: int | None, gpu: str = DEFAULT_GPU, gpus_per_node: int | None = None, cluster_file: str | None = None
) -> Cluster:
    """The cluster of ``num_gpus`` devices of type ``gpu`` (a cluster file may redefine the device and node size).

    Raises:
        ValueError: bad GPU count, unknown device, unreadable cluster file, in one line.
    """
    if num_gpus is None:
        raise ValueError("give the number of GPUs (--gpus)")
    check_bounds("--gpus", num_gpus, 1, MAX_GPUS)
    if gpus_per_node is not None:
        check_bounds("--gpus-per-node", gpus_per_node, 1, int(PLAUSIBLE_RANGES["devices_per_node"].high))
    if cluster_file is not None:
        device, _ = load_cluster_file(cluster_file)
    else:
        device = get_device(gpu)
    return make_cluster(device, num_gpus, gpus_per_node)


ACTIVATION_BYTES_BY_DTYPE = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per activation element of the dtypes a profile can be measured in."""


def _architecture(model: ModelSpec) -> tuple:
    """What a profile's measurements depend on: every module's layers with their dimensions (not frozen flags)."""
    return tuple((m.name, m.layers) for m in model.modules)


def check_profile_matches(profile: Any, path: Any, model: ModelSpec, device_name: str) -> None:
    """Raise a one-line ValueError unless ``profile`` was measured on ``device_name`` for ``model``'s architecture
    and dimensions (its model by name, or a catalog model with the same layers)."""
    if profile.hardware != device_name:
        raise ValueError(f"profile {path} was measured on {profile.hardware}, the plan is for {device_name}: give "
                         f"--gpu {profile.hardware}, a profile of {device_name}, or --profile none")
    if profile.model == model.name:
        return
    try:
        same = _architecture(get_model(profile.model)) == _architecture(model)
    except ValueError:  # not a catalog name: nothing to compare the layers with
        same = False
    if not same:
        raise ValueError(f"profile {path} was measured for {profile.model}, whose layers differ from {model.name}'s: "
                         f"give the profile of {model.name}, or --profile none")


def _profile_source(
    model: ModelSpec, cluster: Cluster, profile: str | None, assumptions: CostAssumptions
) -> tuple[Cluster, Any, CostAssumptions]:
    """The cluster with measured device numbers, a layer-cost source and the assumptions in the profile's dtype,
    from ``profile``: a path, ``"auto"`` (the committed profile of this device and model, if any) or None
    (analytical only). Devices sharing a host slow each other; the source scales layer times by the factor the
    profile measured for this many devices; its measured host cost per operator call replaces the assumed one, and
    its calibration's fitted assumptions replace the defaults. A
    profile measured in fp32 (the CPU runtime's dtype) makes the
    activations, messages and hand-offs it does not measure 4 bytes per element too, and the model states fp32
    (``FP32_STATES``: weights, gradients, gradient messages and the optimizer step)."""
    if profile is None:
        return cluster, None, assumptions
    from planner import profiles

    path = profiles.find_profile(cluster.device.name, model.name) if profile == "auto" else profile
    if path is None:
        return cluster, None, assumptions
    loaded = profiles.load_profile(path)
    check_profile_matches(loaded, path, model, cluster.device.name)
    device = profiles.device_from_profile(cluster.device, loaded)
    assumptions = profiles.apply_calibration(profile_assumptions(loaded, assumptions), loaded.calibration)
    source = profiles.ProfileCostSource(loaded, concurrent_devices=cluster.num_devices,
                                        time_scale=assumptions.measured_time_scale, path=str(path))
    return replace(cluster, device=device), source, assumptions


def profile_assumptions(profile: Any, assumptions: CostAssumptions) -> CostAssumptions:
    """``assumptions`` as a profile's measurements set them (before its calibration): its dtype's activation bytes,
    fp32 model states where it was measured in fp32, its measured host cost per operator call, the per-parameter
    optimizer of a CPU."""
    element = ACTIVATION_BYTES_BY_DTYPE.get(profile.provenance.dtype, assumptions.activation_bytes)
    assumptions = replace(assumptions, activation_bytes=element)
    if profile.device is not None and profile.device.host_seconds_per_op is not None:
        assumptions = replace(assumptions, host_seconds_per_op=profile.device.host_seconds_per_op,
                              dtensor_seconds_per_op=profile.device.dtensor_seconds_per_op or 0.0)
    if profile.provenance.dtype == "float32":  # the runtime trains in fp32 where it was measured so (CPU)
        assumptions = replace(assumptions, bf16_mixed=FP32_STATES, bf16_pure=FP32_STATES)
    if profile.provenance.device_name == "cpu":  # torch's AdamW steps per parameter off CUDA
        assumptions = replace(assumptions, optimizer_foreach=False)
    return assumptions


def make_problem(
    model: str | ModelSpec,
    gpus: int | None = None,
    *,
    gpu: str = DEFAULT_GPU,
    gpus_per_node: int | None = None,
    cluster_file: str | None = None,
    cluster: Cluster | None = None,
    workload: Workload | None = None,
    image_sizes: Sequence[tuple[int, int]] | None = None,
    vision_tokens: int | None = None,
    text_tokens: int | None = None,
    images_per_sample: int | None = None,
    audio_seconds: float | None = None,
    global_batch: int | None = None,
    precision: str = "bf16_mixed",
    frozen: Iterable[str] = (),
    profile: str | None = "auto",
    assumptions: CostAssumptions = DEFAULT_ASSUMPTIONS,
    allow_ring_cp: bool = False,
    allow_pp: bool = True,
    dataset: str | DatasetHistogram | None = None,
    tokenizer: str | None = None,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    pack_tokens: int | None = None,
    pack: bool = True,
    workers: int = 1,
) -> Problem:
    """Everything a plan depends on, from user-level inputs.

    Args:
        model: Catalog name or alias, config.json path, or a ModelSpec.
        gpus: Number of GPUs (ignored when ``cluster`` is given).
        gpu: Catalog device name.
        gpus_per_node: GPUs per node (default: the device's).
        cluster_file: JSON/YAML file redefining the device (see ``hardware.load_cluster_file``).
        cluster: A ready cluster instead of gpus/gpu/gpus_per_node/cluster_file.
        workload: A ready workload instead of the per-field inputs below.
        image_sizes: (height, width) of each image of a sample (default one 1344x1344).
        vision_tokens: Vision tokens per sample (a square merge-aligned grid) instead of image sizes.
        text_tokens: Text tokens per sample (default 512).
        images_per_sample: Repeat ``image_sizes`` this many times per sample.
        audio_seconds: Seconds of audio per sample (audio models; default 30).
        global_batch: Samples per step (default 4 per GPU).
        precision: bf16_mixed or bf16_pure.
        frozen: Modules to freeze.
        profile: Profile file, "auto" (the committed profile of this device/model if any) or None.
        assumptions: Cost-model knobs.
        allow_ring_cp: Also search ring context parallelism, which the runtime cannot execute yet.
        allow_pp: Search pipeline parallelism of the LLM (False: plans without it only).
        dataset: A conversation / caption JSONL or JSON file, or a dataset histogram (``planner.dataset``): plan for
            its samples, packed; replaces the per-sample inputs (``global_batch`` still counts samples).
        tokenizer: Folder with the tokenizer.json that counts the dataset's text (default: the model's folder when
            ``model`` is a config.json beside one, else an estimate, stated).
        min_pixels: Fewest pixels the processor resizes a dataset image to (default Qwen2.5-VL's).
        max_pixels: Most pixels the processor resizes a dataset image to (default Qwen2.5-VL's).
        pack_tokens: LLM-token budget of a pack (default: the longest sample, rounded up to 256; ``top_plans``
            also tries twice and four times that and keeps the fastest).
        pack: False: every dataset sample is a micro-batch unit of its own (how a plan made for one image size
            meets the dataset); ``pack_tokens`` then does not apply.
        workers: Processes that cost candidates (``Problem.workers``): the same plan, sooner on several cores.

    Raises:
        ValueError: any bad input, in one line.
    """
    spec = get_model(model) if isinstance(model, str) else model
    if workers < 1:
        raise ValueError(f"--workers must be at least 1, got {workers}")
    if precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    frozen = list(frozen)
    for name in frozen:
        if name not in spec.module_names:
            raise ValueError(f"--frozen {name}: {spec.name} has modules {', '.join(spec.module_names)}")
    if set(frozen) >= set(spec.module_names):
        raise ValueError("every module of the plan is frozen: nothing to train")
    spec = spec.with_frozen(frozen) if frozen else spec
    cluster = cluster or make_cluster_for(gpus, gpu, gpus_per_node, cluster_file)
    dataset_info = None
    if dataset is not None:
        tokenizer = tokenizer if tokenizer is not None else model_folder_tokenizer(model)
        sample_inputs = dict(image_sizes=image_sizes, vision_tokens=vision_tokens, text_tokens=text_tokens,
                             images_per_sample=images_per_sample, audio_seconds=audio_seconds)
        _check_no_sample_inputs(workload, sample_inputs)
        workload, dataset_info = dataset_workload_for(
            spec, cluster.num_devices, dataset, tokenizer=tokenizer, min_pixels=min_pixels, max_pixels=max_pixels,
            pack_tokens=pack_tokens, pack=pack, global_batch=global_batch)
    elif any(v is not None for v in (tokenizer, min_pixels, max_pixels, pack_tokens)):
        raise ValueError("--tokenizer, --min-pixels, --max-pixels and --pack-tokens apply to --dataset")
    workload = workload or make_workload(
        spec, cluster.num_devices, image_sizes=image_sizes, vision_tokens=vision_tokens, text_tokens=text_tokens,
        images_per_sample=images_per_sample, audio_seconds=audio_seconds, global_batch=global_batch,
    )
    _check_sample(workload, spec)
    cluster, layer_costs, assumptions = _profile_source(spec, cluster, profile, assumptions)
    return Problem(model=spec, cluster=cluster, workload=workload, precision=precision, assumptions=assumptions,
                   layer_costs=layer_costs, allow_ring_cp=allow_ring_cp, allow_pp=allow_pp,
                   dataset=dataset_info, workers=workers)


def model_folder_tokenizer(model: str | ModelSpec) -> str | None:
    """The model folder when ``model`` is a config.json path (or its folder) beside a tokenizer.json, else None."""
    if not isinstance(model, str) or not os.path.exists(model):
        return None
    folder = model if os.path.isdir(model) else os.path.dirname(model) or "."
    return folder if os.path.isfile(os.path.join(folder, "tokenizer.json")) else None


def _check_no_sample_inputs(workload: Workload | None, inputs: Mapping[str, Any]) -> None:
    given = [name for name, value in inputs.items() if value is not None]
    if workload is not None or given:
        flags = ", ".join("--image-size" if name == "image_sizes" else "--" + name.replace("_", "-")
                          for name in given) or "workload"
        raise ValueError(f"--dataset gives every sample's shape: drop {flags}")


def dataset_workload_for(
    model: ModelSpec, num_gpus: int, dataset: str | DatasetHistogram, *, tokenizer: str | None = None,
    min_pixels: int | None = None, max_pixels: int | None = None, pack_tokens: int | None = None,
    pack: bool = True, global_batch: int | None = None,
) -> tuple[Workload, DatasetInfo]:
    """The packed workload of a dataset and what the plan records about it (see ``make_problem``)."""
    if model.audio_input is not None:
        raise ValueError(f"--dataset reads image-text data; {model.name} has an audio encoder")
    min_pixels = DEFAULT_MIN_PIXELS if min_pixels is None else min_pixels
    max_pixels = DEFAULT_MAX_PIXELS if max_pixels is None else max_pixels
    check_bounds("--min-pixels", min_pixels, 1, MAX_IMAGE_SIDE**2)
    check_bounds("--max-pixels", max_pixels, min_pixels, MAX_IMAGE_SIDE**2)
    if pack_tokens is not None:
        check_bounds("--pack-tokens", pack_tokens, 1, MAX_TEXT_TOKENS)
    if global_batch is not None:
        check_bounds("--global-batch", global_batch, 1, MAX_GLOBAL_BATCH)
    histogram = dataset if isinstance(dataset, DatasetHistogram) else read_dataset(dataset, tokenizer)
    tokens = sample_tokens(histogram, model, min_pixels=min_pixels, max_pixels=max_pixels)
    if not pack and pack_tokens is not None:
        raise ValueError("--pack-tokens sets the budget of packs: it does not apply without packing")
    budget = None if not pack else pack_budgets(tokens, (1,))[0] if pack_tokens is None else pack_tokens
    packing = pack_dataset(tokens, model, budget)
    samples = DEFAULT_SAMPLES_PER_GPU * num_gpus if global_batch is None else global_batch
    workload = dataset_workload(packing, samples, num_gpus)
    skipped = {**histogram.skipped, **tokens.skipped}
    if packing.too_long:
        skipped["longer than the pack budget"] = packing.too_long
    per_sample = {"llm": tokens.llm} if model.vision_input is None else {"vision": tokens.vision, "llm": tokens.llm}
    info = DatasetInfo(
        source=histogram.source, samples=packing.samples, skipped=skipped, text_tokens=histogram.text_tokens,
        min_pixels=min_pixels, max_pixels=max_pixels,
        tokens_per_sample={m: percentiles(v) for m, v in per_sample.items()},
        pack_tokens=packing.packed.pack_tokens, packs_per_epoch=packing.packs,
        samples_per_pack=packing.packed.samples_per_pack, packing_efficiency=packing.efficiency,
        heaviest_pack_tokens={m: t.tokens for m, t in packing.packed.heaviest},
    )
    return workload, info


def _check_sample(workload: Workload, model: ModelSpec) -> None:
    """What the runtime would refuse about a sample, refused here with its words: no tokens, unaligned
    --vision-tokens, more than ``MAX_VISION_TOKENS``, too few text tokens for the image markers."""
    tokens = module_tokens(workload, model)  # raises ValueError for samples without tokens or unaligned --vision-tokens
    vision = tokens["vision"].tokens if "vision" in tokens else 0
    if vision > MAX_VISION_TOKENS:
        raise ValueError(f"a sample has {vision:,} vision tokens, at most {MAX_VISION_TOKENS:,} are supported "
                         f"(fewer or smaller images)")
    if "vision" in tokens and workload.packs is None:
        images = 1 if workload.vision_tokens is not None else len(workload.image_sizes)
        if workload.text_tokens < 2 * images + 1:  # runtime.data.SampleLayout's rule
            raise ValueError(f"{workload.text_tokens} text tokens cannot hold a start and end marker for each of "
                             f"{images} images plus one text token (--text-tokens {2 * images + 1} or more)")


def _as_problem(model: str | ModelSpec | Problem, gpus: int | None, inputs: Mapping[str, Any]) -> Problem:
    if isinstance(model, Problem):
        if inputs or gpus is not None:
            raise TypeError("pass either a Problem or model inputs, not both")
        return model
    return make_problem(model, gpus, **inputs)


# --- Solving ----------------------------------------------------------------------------------------------------


@dataclass(kw_only=True, frozen=True)
class _Ranked:
    """A solved strategy before it becomes a Plan."""

    strategy: Strategy
    status: str
    objective_s: float
    num_candidates: int


def _strategy(problem: Problem, placement: Placement, choice: Mapping[str, Any]) -> Strategy:
    return Strategy(placement=placement, modules={m: choice[m].strategy for m in problem.model.module_names},
                    precision=problem.precision)


def _check_time_limit(time_limit_s: float | None) -> None:
    if time_limit_s is not None and not 0 < time_limit_s <= MAX_TIME_LIMIT_S:
        raise ValueError(f"--time-limit must be more than 0 and at most {MAX_TIME_LIMIT_S:g} seconds, "
                         f"got {time_limit_s:g}")


def _solve(problem: Problem, placement: str, fix: Any, top_k: int, time_limit_s: float | None
           ) -> tuple[list[_Ranked], dict, list[_Ranked] | None]:
    """Ranked strategies (best first) over the requested placements, the fixes as given, and, when pipeline
    parallelism was in the space, the best plan on the other side of it (without PP if the best pipelines, with
    PP if not: ``pipeline_alternative``).

    When the LLM may or may not be pipelined, the plans without PP are solved first; a pipelined strategy is
    costed only once its floor (``candidates.pipeline_floor``) is within the ``top_k``-th of them, or, to find the
    best pipelined plan when none is among the best, within a limit raised until that plan is proven
    (``_best_pipelined``). Every pipelined strategy left out belongs only to plans slower than one found, so the
    answer is the full search's."""
    from planner.solver.cp_sat import DEFAULT_SETTINGS

    pinned, fixes = parse_fixes(fix or (), problem.model, problem.num_gpus, allow_pp=problem.allow_pp)
    llm_fixes = fixes.get("llm", {})
    check_pipelined_dataset(problem, llm_fixes.get("pp"), llm_fixes.get("sp"))
    placements = placements_to_solve(problem, placement, pinned, fixes)
    settings = DEFAULT_SETTINGS if time_limit_s is None else replace(DEFAULT_SETTINGS, time_limit_s=time_limit_s)
    if pipelined_options(problem, fixes) != (False, True):  # one world: no PP, or PP pinned
        all_cands = candidates_or_error(problem, placements, fixes)
        ranked = _ranked(problem, all_cands, top_k, settings)
        if not ranked:
            raise Infeasible(explain_infeasible(problem, all_cands, fixes))
        return ranked, fixed_text(pinned, fixes), None
    all_cands = candidates_or_error(problem, placements, fixes, pipeline_limit_s=0.0)
    flat = _ranked(problem, _world(all_cands, False), top_k, settings)
    limit_s = _solver_s(problem, flat[-1]) if len(flat) == top_k else math.inf
    _extend_pipelined(problem, all_cands, limit_s)
    piped = _ranked(problem, _world(all_cands, True), top_k, settings)
    ranked = sorted(flat + piped, key=_rank_order)[:top_k]  # of equal steps, the plan without PP first
    if not ranked:
        raise Infeasible(explain_infeasible(problem, all_cands, fixes))
    if is_pipelined(ranked[0].strategy):
        alternative = flat[:1]
    else:
        alternative = _best_pipelined(problem, all_cands, piped[:1], limit_s, settings)
    return [replace(r, num_candidates=all_cands[r.strategy.placement].count) for r in ranked], \
        fixed_text(pinned, fixes), alternative


PIPELINE_LIMIT_STEP = 1.15
"""Factor by which ``_best_pipelined`` raises its limit while no pipelined plan fits under it (a speed knob only:
the plan found does not depend on it)."""


def _best_pipelined(problem: Problem, all_cands: Mapping[str, Candidates], best: list[_Ranked], limit_s: float,
                    settings: Any) -> list[_Ranked]:
    """The best pipelined plan ([] if none fits), given the best ``best`` among the strategies costed so far, all
    of those with floors up to ``limit_s``: it is proven once it takes at most the limit (any better plan's
    strategies are then costed); else the limit rises to it, or while there is none by ``PIPELINE_LIMIT_STEP`` (at
    least to the next floor)."""
    while True:
        if best and _solver_s(problem, best[0]) <= limit_s:
            return best
        floors = [f for cands in all_cands.values() for f, _ in cands.deferred if f < math.inf]
        if not floors:  # what is left has no encoder candidate to form a plan with
            return best
        limit_s = _solver_s(problem, best[0]) if best else max(limit_s * PIPELINE_LIMIT_STEP, min(floors))
        if _extend_pipelined(problem, all_cands, limit_s):
            best = _ranked(problem, _world(all_cands, True), 1, settings)


def _solver_s(problem: Problem, ranked: _Ranked) -> float:
    """The solver's step time of a ranked plan (without the fixed per-step overhead), in seconds."""
    return ranked.objective_s - problem.assumptions.step_overhead_s


def _rank_order(r: _Ranked) -> tuple:
    return r.objective_s, PLACEMENTS.index(r.strategy.placement)


def _world(all_cands: Mapping[str, Candidates], pipelined: bool) -> dict[str, Candidates]:
    """Each placement's candidates of plans whose LLM is (or is not) pipelined."""
    return {p: _only_pipelined(c, pipelined) for p, c in all_cands.items()}


def _extend_pipelined(problem: Problem, all_cands: Mapping[str, Candidates], limit_s: float) -> int:
    """Cost the deferred pipelined strategies of plans that could take at most ``limit_s`` (solver seconds);
    returns how many were costed."""
    return sum(extend_pipelined(problem, cands, limit_s) for cands in all_cands.values())


def _ranked(problem: Problem, all_cands: Mapping[str, Candidates], top_k: int, settings: Any) -> list[_Ranked]:
    """The ``top_k`` best solutions over the placements' candidates, best first."""
    from planner.solver.cp_sat import solve

    budget = problem.usable_bytes - problem.overhead_bytes
    ranked = []
    for p, cands in all_cands.items():
        for sol in solve(cands, problem.num_gpus, budget, top_k=top_k, settings=settings):
            ranked.append(_Ranked(strategy=_strategy(problem, p, sol.choice), status=sol.status,
                                  objective_s=sol.objective_ns / 1e9 + problem.assumptions.step_overhead_s,
                                  num_candidates=cands.count))
    ranked.sort(key=_rank_order)
    return ranked[:top_k]


def _only_pipelined(cands: Candidates, pipelined: bool) -> Candidates:
    """The candidates of plans whose LLM is (or is not) pipelined."""
    return replace(cands, by_module={m: [c for c in cs if c.pipelined == pipelined]
                                     for m, cs in cands.by_module.items()})


def is_pipelined(strategy: Strategy) -> bool:
    """Whether a strategy pipelines a module."""
    return any(s.pp > 1 for s in strategy.modules.values())


def pipeline_alternative(problem: Problem, alternative: list[_Ranked] | None, chosen: Strategy
                         ) -> dict[str, BaselineOutcome]:
    """The best plan on the other side of pipeline parallelism (``_solve``) as a reference row, ``without_pp`` or
    ``with_pp``, so that a plan shows what pipelining gains or loses; {} when PP was not searched."""
    if alternative is None:
        return {}
    name = "without_pp" if is_pipelined(chosen) else "with_pp"
    if not alternative:
        return {name: BaselineOutcome(name=name, estimate=None, infeasible="no plan fits")}
    e = estimate(problem.model, problem.cluster, problem.workload, alternative[0].strategy, problem.assumptions,
                 problem.layer_costs)
    return {name: BaselineOutcome(name=name, estimate=e)}


# --- Plan document ----------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def planner_version() -> str:
    """The installed dhplan version."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dhplan")
    except PackageNotFoundError:
        return "unknown"


def _module_plan(problem: Problem, strategy: Strategy, name: str, prediction: ModulePrediction,
                 pp_layers: list[int] | None) -> ModulePlan:
    s = strategy.modules[name]
    spec = problem.model.module(name)
    return ModulePlan(
        name=name, ranks=strategy.module_ranks()[name], dp=s.dp, tp=s.tp, sp=s.sp, cp=s.cp, pp=s.pp,
        pp_schedule=s.pp_schedule, virtual_stages=s.virtual_stages, pp_layers=pp_layers,
        zero=s.zero, recompute=s.recompute, micro_batch=s.micro_batch, grad_accum=s.grad_accum, frozen=spec.frozen,
        num_params=spec.num_params, predicted=prediction,
    )


def _baseline_result(outcome: BaselineOutcome, plan_step_s: float) -> BaselineResult:
    """A baseline in the plan file."""
    description = BASELINE_DESCRIPTIONS[outcome.name]
    e = outcome.estimate
    if e is None:
        return BaselineResult(description=description, infeasible=outcome.infeasible)
    return BaselineResult(
        description=description, step_time_s=e.step_time_s, tokens_per_s=e.tokens_per_s,
        peak_memory_gib=e.peak_memory_bytes / GIB, mfu=e.mfu, speedup=e.step_time_s / plan_step_s,
        modules={m: c.strategy.describe() for m, c in e.modules.items()},
    )


def calibration_note(problem: Problem) -> str | None:
    """Where the calibrated assumptions the problem is costed with come from (None without a calibration)."""
    profile = getattr(problem.layer_costs, "profile", None)
    calibration = getattr(profile, "calibration", None)
    if calibration is None:
        return None
    from planner.profiles import describe_calibration

    return f"profile {profile.hardware}/{profile.model} {describe_calibration(calibration)}"


def _binding(e: Estimate) -> str:
    return (f"{e.binding_constraint}; peak memory {e.peak_memory_bytes / GIB:.1f} of "
            f"{e.usable_memory_bytes / GIB:.1f} GiB usable")


def build_plan(
    problem: Problem,
    strategy: Strategy,
    *,
    status: str,
    num_candidates: int,
    rank: int = 1,
    fixed: Mapping[str, str] | None = None,
    reference: Mapping[str, BaselineOutcome] | None = None,
    objective_s: float | None = None,
) -> Plan:
    """The Plan document of ``strategy``: re-costed with ``cost.estimate``, with the baselines. ``objective_s``,
    the solver's step time, must agree with the re-costed one up to the solver's nanosecond rounding."""
    e = estimate(problem.model, problem.cluster, problem.workload, strategy, problem.assumptions, problem.layer_costs)
    tolerance = max(OBJECTIVE_TOLERANCE_S, OBJECTIVE_RELATIVE_TOLERANCE * e.step_time_s)
    assert objective_s is None or abs(objective_s - e.step_time_s) <= tolerance, (
        f"solver objective {objective_s} s != cost model {e.step_time_s} s"
    )
    model, device, w = problem.model, problem.cluster.device, problem.workload
    tokens = module_tokens(w, model)
    reference = baselines(problem) if reference is None else reference
    predicted = prediction(e).model_copy(update={"binding_constraint": _binding(e),
                                                 "calibration": calibration_note(problem),
                                                 "profile": getattr(problem.layer_costs, "path", None)})
    predictions = module_predictions(e)
    return Plan(
        schema_version=SCHEMA_VERSION,
        planner_version=planner_version(),
        model=ModelInfo(name=model.name, family=model.family, hf_config=dict(model.hf_config),
                        num_params=model.num_params, module_params={m.name: m.num_params for m in model.modules}),
        cluster=ClusterInfo(
            device=DeviceInfo(**{k: getattr(device, k) for k in DeviceInfo.model_fields}),
            num_devices=problem.num_gpus, devices_per_node=problem.cluster.devices_per_node,
        ),
        workload=WorkloadInfo(
            image_sizes=list(w.image_sizes), vision_tokens=w.vision_tokens, text_tokens=w.text_tokens,
            audio_seconds=w.audio_seconds, global_batch=w.global_batch,
            module_tokens={m: round(t.tokens) for m, t in tokens.items()},
            llm_image_tokens=round(tokens["vision"].output_tokens) if "vision" in tokens else 0,
            dataset=problem.dataset,
        ),
        training=TrainingInfo(precision=problem.precision),
        placement=strategy.placement,
        modules=[_module_plan(problem, strategy, m, predictions[m], list(e.modules[m].chunk_layers) or None)
                 for m in model.module_names],
        predicted=predicted,
        baselines={name: _baseline_result(o, predicted.step_time_s) for name, o in reference.items()},
        solver=SolverInfo(status=status, num_candidates=num_candidates, rank=rank, fixed=dict(fixed or {})),
    )


# --- Public functions -------------------------------------------------------------------------------------------


def top_plans(
    model: str | ModelSpec | Problem,
    gpus: int | None = None,
    *,
    k: int = 1,
    placement: str = "auto",
    fix: Iterable[str] | Mapping[str, Any] | None = None,
    time_limit_s: float | None = None,
    **inputs: Any,
) -> list[Plan]:
    """The ``k`` best distinct plans, best first (fewer if fewer exist). Fixes that pin every field evaluate that
    one strategy (status EVALUATED).

    Raises:
        ValueError: bad input; Infeasible (a ValueError) when no plan fits, with the explanation.
    """
    check_bounds("--top-k", k, 1, MAX_TOP_K)
    _check_time_limit(time_limit_s)
    budgets = _pack_budget_problems(model, gpus, inputs)
    if budgets:
        return _best_over(budgets, k=k, placement=placement, fix=fix, time_limit_s=time_limit_s)
    problem = _as_problem(model, gpus, inputs)
    pinned = pinned_strategy(problem, placement, fix)
    reference = baselines(problem)
    if pinned is not None:
        return [_evaluated(problem, pinned, fix, reference)]
    ranked, fixed, alternative = _solve(problem, placement, fix, k, time_limit_s)
    return [
        build_plan(problem, r.strategy, status=r.status, num_candidates=r.num_candidates, rank=i + 1, fixed=fixed,
                   reference={**reference, **pipeline_alternative(problem, alternative, ranked[0].strategy)},
                   objective_s=r.objective_s)
        for i, r in enumerate(ranked)
    ]


PACK_BUDGET_MULTIPLES = (1, 2, 4)
"""Pack budgets ``top_plans`` tries for a dataset without ``pack_tokens``: these multiples of the longest sample."""


def _pack_budget_problems(model: Any, gpus: int | None, inputs: dict[str, Any]) -> list[Problem]:
    """One problem per candidate pack budget for a dataset whose budget is left to the planner, else []."""
    if isinstance(model, Problem) or inputs.get("dataset") is None or inputs.get("pack_tokens") is not None \
            or not inputs.get("pack", True):
        return []
    dataset = inputs["dataset"]
    if not isinstance(dataset, DatasetHistogram):
        tokenizer = inputs.get("tokenizer")
        dataset = read_dataset(dataset, tokenizer if tokenizer is not None else model_folder_tokenizer(model))
    first = make_problem(model, gpus, **{**inputs, "dataset": dataset})
    base = first.dataset.pack_tokens
    return [first] + [make_problem(model, gpus, **{**inputs, "dataset": dataset, "pack_tokens": base * m})
                      for m in PACK_BUDGET_MULTIPLES[1:]]


def _best_over(problems: list[Problem], *, k: int, **solve: Any) -> list[Plan]:
    """The ``k`` plans of most LLM tokens per second over several problems (pack budgets), re-ranked; the first
    problem's infeasibility when none fits."""
    plans, first_error = [], None
    for problem in problems:
        try:
            plans += top_plans(problem, k=k, **solve)
        except Infeasible as e:
            first_error = first_error or e
    if not plans:
        raise first_error
    plans.sort(key=lambda p: -p.predicted.tokens_per_s)
    return [p.model_copy(update={"solver": p.solver.model_copy(update={"rank": i + 1})})
            for i, p in enumerate(plans[:k])]


def plan(
    model: str | ModelSpec | Problem,
    gpus: int | None = None,
    *,
    placement: str = "auto",
    fix: Iterable[str] | Mapping[str, Any] | None = None,
    time_limit_s: float | None = None,
    **inputs: Any,
) -> Plan:
    """The fastest plan that fits (proven optimal within the strategy space unless the time limit stops CP-SAT).

    Example: ``plan("qwen-vl-32b", 16, fix=["llm.tp=8"])``.

    Raises:
        ValueError: bad input; Infeasible (a ValueError) when no plan fits, with the explanation.
    """
    return top_plans(model, gpus, k=1, placement=placement, fix=fix, time_limit_s=time_limit_s, **inputs)[0]


def _evaluated(problem: Problem, strategy: Strategy, fix: Any, reference: Mapping[str, BaselineOutcome]) -> Plan:
    if "llm" in strategy.modules:
        check_pipelined_dataset(problem, strategy.modules["llm"].pp, strategy.modules["llm"].sp)
    _check_fits(problem, strategy)
    fixed = {} if fix is None else fixed_text(*parse_fixes(fix, problem.model, problem.num_gpus,
                                                           allow_pp=problem.allow_pp))
    return build_plan(problem, strategy, status="EVALUATED", num_candidates=1, fixed=fixed, reference=reference)


def check_pipelined_dataset(problem: Problem, pp: int | None, sp: int | None) -> None:
    """What the runtime does not run of a dataset plan's pipelined LLM (``pp`` stages, ``sp`` inside each; None:
    not pinned), refused in one line: a dataset without packing (its micro-batches have no budget to pad to), and
    Ulysses SP inside the stages (each micro-batch's samples split the sequence differently)."""
    if problem.dataset is None or pp in (None, 1):
        return
    if problem.dataset.pack_tokens is None:
        raise ValueError(f"llm.pp={pp} on a dataset needs packing: a pipelined LLM's micro-batches are padded to the "
                         "pack budget (plan with packs, or without pinning llm.pp)")
    if sp not in (None, 1):
        raise ValueError(f"llm.pp={pp} with llm.sp={sp} on a dataset is not run: a dataset plan's pipelined LLM runs "
                         "without SP inside its stages (drop one of the two)")


def _check_fits(problem: Problem, strategy: Strategy) -> None:
    """Raise Infeasible, with the breakdown, when an evaluated strategy does not fit."""
    e = estimate(problem.model, problem.cluster, problem.workload, strategy, problem.assumptions, problem.layer_costs)
    if not e.fits:
        raise Infeasible(
            f"this strategy does not fit: {e.peak_group} GPUs need {e.peak_memory_bytes / GIB:.1f} GiB "
            f"({e.peak_breakdown.describe()}) of {e.usable_memory_bytes / GIB:.1f} GiB usable, "
            f"{(e.peak_memory_bytes - e.usable_memory_bytes) / GIB:.1f} GiB over"
        )


def evaluate(model: str | ModelSpec | Problem, strategy: Strategy, gpus: int | None = None, **inputs: Any) -> Plan:
    """The Plan of one exact strategy (status EVALUATED), e.g. a hand-made layout.

    Raises:
        ValueError: the strategy breaks a validity rule; Infeasible when it does not fit in memory.
    """
    problem = _as_problem(model, gpus if gpus is not None else (None if isinstance(model, Problem) else strategy.num_gpus), inputs)
    return _evaluated(problem, strategy, None, baselines(problem))


def max_seq(
    model: str | ModelSpec | Problem,
    gpus: int | None = None,
    *,
    placement: str = "auto",
    fix: Iterable[str] | Mapping[str, Any] | None = None,
    time_limit_s: float | None = None,
    **inputs: Any,
) -> Plan:
    """The plan at the longest image sequence (vision tokens per sample, one square merge-aligned image) that any
    plan fits at the given batch; ``plan.workload.vision_tokens`` holds it.

    Raises:
        ValueError: not a vision model, or bad input; Infeasible when even the smallest image does not fit.
    """
    _check_time_limit(time_limit_s)
    problem = _as_problem(model, gpus, inputs)
    if problem.dataset is not None:
        raise ValueError("--max-seq searches one image size per sample; a dataset gives its own: drop one of them")
    if problem.model.vision_input is None:
        raise ValueError(f"--max-seq searches image sequence lengths; {problem.model.name} has no vision encoder")
    pinned, fixes = parse_fixes(fix or (), problem.model, problem.num_gpus, allow_pp=problem.allow_pp)
    placements = placements_to_solve(problem, placement, pinned, fixes)
    side = longest_side(problem, placements, fixes)
    if side is None:
        smallest = variant(problem, workload=vision_workload(problem, problem.model.vision_input.spatial_merge_size))
        raise Infeasible(explain_infeasible(smallest, candidates_or_error(smallest, placements, fixes), fixes))
    longest = variant(problem, workload=vision_workload(problem, side))
    return plan(longest, placement=placement, fix=fix, time_limit_s=time_limit_s)
