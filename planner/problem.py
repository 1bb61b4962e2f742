"""The planning problem: everything a plan depends on except the choices (``Problem``), built from user-level
inputs (``make_problem``) with the documented defaults and bounds.

Workload defaults (``plan --model qwen-vl-32b --gpus 16``): one 1344x1344 image per sample (96 x 96 patches =
9,216 vision tokens -> 2,304 LLM image tokens after the 2x2 merge), 512 text tokens, 30 s of audio for audio
models, and a global batch of 4 samples per GPU (64 at 16 GPUs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from planner.catalog import get_model
from planner.cost import DEFAULT_ASSUMPTIONS, CostAssumptions, LayerCostSource
from planner.cost.assumptions import FP32_STATES
from planner.dataset import (
    DatasetHistogram,
    dataset_workload,
    pack_budgets,
    pack_dataset,
    percentiles,
    read_dataset,
    sample_tokens,
)
from planner.contract.hardware import PLAUSIBLE_RANGES, Cluster, DeviceSpec, get_device, load_cluster_file, make_cluster
from planner.contract.models import ModelSpec
from planner.contract.schema import (
    ATTENTION_CALLS,
    LINEAR_ATTENTION_KERNELS,
    AttentionCalls,
    DatasetInfo,
    LinearAttentionKernel,
)
from planner.contract.strategy import PRECISIONS, Precision
from planner.contract.workload import DEFAULT_FPS, Workload, module_tokens
from planner.inputs import ClusterInputs, DatasetInputs, SearchOptions, WorkloadInputs
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
MAX_VIDEOS_PER_SAMPLE = 64
"""Most video clips per sample (--video given n times)."""
MAX_VIDEO_FRAMES = 768
"""Most frames one clip samples (Qwen-VL video processors' ``max_frames``)."""
MIN_VIDEO_FRAMES = 4
"""Fewest frames a clip samples (Qwen-VL video processors' ``min_frames``)."""
MAX_VIDEO_SECONDS = 86_400.0
"""Longest --video-seconds (a day; frames are capped at ``MAX_VIDEO_FRAMES`` anyway)."""
MAX_AUDIO_SECONDS = 3600.0
"""Largest --audio-seconds per sample (an hour)."""
MAX_DATASET_SAMPLES = 2**20
"""Most samples a dataset (or histogram) may hold, 1,048,576: per-sample token arrays and best-fit packing stay
within seconds and megabytes (a larger dataset plans as well from a random subset)."""


@dataclass(kw_only=True, frozen=True)
class Problem:
    """Everything a plan depends on, except the choices."""

    model: ModelSpec
    """The model (frozen modules already marked)."""
    cluster: Cluster
    """Devices and nodes."""
    workload: Workload
    """Sample shape and global batch."""
    precision: Precision = "bf16_mixed"
    """Training precision recipe."""
    assumptions: CostAssumptions = DEFAULT_ASSUMPTIONS
    """Cost-model knobs."""
    layer_costs: LayerCostSource | None = None
    """Measured per-layer costs (a profile), or None for the analytical model alone."""
    dataset: DatasetInfo | None = None
    """The dataset the workload's packs come from (``planner.dataset``), recorded in the plan."""
    allow_ring_cp: bool = True
    """Search ring context parallelism (cp > 1) of the modules the runtime runs it for; ``--no-cp`` turns it off,
    ``--fix MODULE.cp=N`` pins it. Context-parallel strategies that cannot beat a plan already found are not costed
    (``candidates.extend_context_parallel``)."""
    allow_pp: bool = True
    """Search pipeline parallelism of the LLM (pp > 1); ``--no-pp`` turns it off, ``--fix llm.pp=N`` pins it.
    Pipelined strategies that cannot beat a plan already found are not costed (``pipeline_floor``)."""

    workers: int = 1
    """Processes that cost candidates (forked; ``PARALLEL_MIN_STRATEGIES``): the same plan, sooner on several cores."""

    @property
    def searches_pp(self) -> bool:
        """Whether pipeline parallelism is in the space: asked for, and the micro-batches can take one shape (the
        runtime's schedule needs one): a fixed-shape plan, or a dataset's packs padded to their budget (not a
        dataset without packing)."""
        return self.allow_pp and (self.dataset is None or self.dataset.pack_tokens is not None)

    @property
    def num_gpus(self) -> int:
        """GPUs of the cluster."""
        return self.cluster.num_devices

    @property
    def usable_bytes(self) -> int:
        """Per-GPU memory the allocator can hand out (the same rounding as ``cost.combine``)."""
        return int(self.cluster.device.memory_bytes * self.assumptions.usable_memory_fraction)

    @property
    def overhead_bytes(self) -> int:
        """Framework allowance, once per GPU."""
        return self.assumptions.framework_overhead_bytes


# --- Inputs -----------------------------------------------------------------------------------------------------


def check_bounds(flag: str, value: float, low: float, high: float) -> None:
    """Raise a one-line ValueError unless ``low <= value <= high`` (NaN never is)."""
    if not low <= value <= high:
        raise ValueError(f"{flag} must be between {low:,g} and {high:,g}, got {value:g}"
                         if isinstance(value, float) else f"{flag} must be between {low:,} and {high:,}, got {value}")


def _check_sample_inputs(inputs: WorkloadInputs) -> None:
    """Every per-sample input within its bound (``MAX_*``), in one line."""
    videos, image_sizes, images_per_sample = inputs.videos, inputs.image_sizes, inputs.images_per_sample
    for frames, h, w in videos:
        check_bounds("--video frames", frames, MIN_VIDEO_FRAMES, MAX_VIDEO_FRAMES)
        check_bounds("--video sides", min(h, w), 1, MAX_IMAGE_SIDE)
        check_bounds("--video sides", max(h, w), 1, MAX_IMAGE_SIDE)
    if len(videos) > MAX_VIDEOS_PER_SAMPLE:
        raise ValueError(f"a sample may hold at most {MAX_VIDEOS_PER_SAMPLE} videos, got {len(videos)}")
    for h, w in image_sizes or ():
        check_bounds("--image-size sides", min(h, w), 1, MAX_IMAGE_SIDE)
        check_bounds("--image-size sides", max(h, w), 1, MAX_IMAGE_SIDE)
    if images_per_sample is not None:
        check_bounds("--images-per-sample", images_per_sample, 1, MAX_IMAGES_PER_SAMPLE)
    images = len(image_sizes or [DEFAULT_IMAGE_SIZE]) * (images_per_sample or 1)
    if images > MAX_IMAGES_PER_SAMPLE:
        raise ValueError(f"a sample may hold at most {MAX_IMAGES_PER_SAMPLE} images, got {images} "
                         f"(--image-size x --images-per-sample)")
    for flag, value, high in (("--vision-tokens", inputs.vision_tokens, MAX_VISION_TOKENS),
                              ("--text-tokens", inputs.text_tokens, MAX_TEXT_TOKENS),
                              ("--global-batch", inputs.global_batch, MAX_GLOBAL_BATCH)):
        if value is not None:
            check_bounds(flag, value, 0 if flag == "--text-tokens" else 1, high)
    if inputs.audio_seconds is not None:
        check_bounds("--audio-seconds", float(inputs.audio_seconds), 0.0, MAX_AUDIO_SECONDS)


def make_workload(model: ModelSpec, num_gpus: int, inputs: WorkloadInputs = WorkloadInputs()) -> Workload:
    """A workload from user inputs, with the documented defaults for what is not given (one image only when the
    sample has neither images nor videos).

    Raises:
        ValueError: inputs the model cannot take (images for an audio model, ...), in one line.
    """
    has_vision, has_audio = model.vision_input is not None, model.audio_input is not None
    _check_sample_inputs(inputs)
    image_sizes, vision_tokens, images_per_sample = inputs.image_sizes, inputs.vision_tokens, inputs.images_per_sample
    if not has_vision and (image_sizes or vision_tokens or images_per_sample or inputs.videos):
        raise ValueError(f"{model.name} has no vision encoder: drop --image-size/--vision-tokens/--images-per-sample/"
                         f"--video")
    if not has_audio and inputs.audio_seconds:
        raise ValueError(f"{model.name} has no audio encoder: drop --audio-seconds")
    if vision_tokens is not None and images_per_sample not in (None, 1):
        raise ValueError("--vision-tokens sets a whole sample's vision tokens: drop --images-per-sample")
    sizes: tuple[tuple[int, int], ...] = ()
    if has_vision and vision_tokens is None and (image_sizes or not inputs.videos):
        sizes = tuple(image_sizes or (DEFAULT_IMAGE_SIZE,)) * (images_per_sample or 1)
    default_audio = DEFAULT_AUDIO_SECONDS if has_audio else 0.0
    return Workload(
        image_sizes=sizes,
        vision_tokens=vision_tokens,
        text_tokens=DEFAULT_TEXT_TOKENS if inputs.text_tokens is None else inputs.text_tokens,
        audio_seconds=default_audio if inputs.audio_seconds is None else inputs.audio_seconds,
        global_batch=DEFAULT_SAMPLES_PER_GPU * num_gpus if inputs.global_batch is None else inputs.global_batch,
        videos=tuple(inputs.videos),
    )


def video_frames(seconds: float, fps: float) -> int:
    """Frames a Qwen-VL video processor samples from ``seconds`` of video at ``fps`` frames per second
    (``sample_frames``: ``int(seconds x fps)``, at least ``MIN_VIDEO_FRAMES``, at most ``MAX_VIDEO_FRAMES``)."""
    check_bounds("--video-seconds", float(seconds), 0.0, MAX_VIDEO_SECONDS)
    check_bounds("--fps", float(fps), 0.01, 240.0)
    return min(max(int(seconds * fps), MIN_VIDEO_FRAMES), MAX_VIDEO_FRAMES)


def make_cluster_for(inputs: ClusterInputs) -> Cluster:
    """The cluster of ``inputs.gpus`` devices of type ``inputs.gpu`` (a cluster file may redefine the device and
    node size).

    Raises:
        ValueError: bad GPU count, unknown device, unreadable cluster file, in one line.
    """
    if inputs.gpus is None:
        raise ValueError("give the number of GPUs (--gpus)")
    check_bounds("--gpus", inputs.gpus, 1, MAX_GPUS)
    if inputs.gpus_per_node is not None:
        check_bounds("--gpus-per-node", inputs.gpus_per_node, 1, int(PLAUSIBLE_RANGES["devices_per_node"].high))
    device = get_device(inputs.gpu) if inputs.cluster_file is None else load_cluster_file(inputs.cluster_file)[0]
    return make_cluster(device, inputs.gpus, inputs.gpus_per_node)


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
    cluster: ClusterInputs | int,
    *,
    workload: WorkloadInputs = WorkloadInputs(),
    dataset: DatasetInputs | None = None,
    search: SearchOptions = SearchOptions(),
    assumptions: CostAssumptions = DEFAULT_ASSUMPTIONS,
) -> Problem:
    """Everything a plan depends on, from user-level inputs (``planner.inputs``).

    Args:
        model: Catalog name or alias, config.json path, or a ModelSpec.
        cluster: The GPUs, or only their number (of the default hardware, ``DEFAULT_GPU``).
        workload: The sample shape, batch, precision and frozen modules.
        dataset: A dataset whose packed samples replace the workload's sample shape (its ``global_batch``,
            ``precision`` and ``frozen`` still apply).
        search: Which strategies the search considers and how it costs them.
        assumptions: Cost-model knobs.

    Raises:
        ValueError: any bad input, in one line.
    """
    spec = get_model(model) if isinstance(model, str) else model
    cluster = ClusterInputs(gpus=cluster) if isinstance(cluster, int) else cluster
    if search.workers < 1:
        raise ValueError(f"--workers must be at least 1, got {search.workers}")
    if workload.precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, got {workload.precision!r}")
    spec = _with_frozen(spec, list(workload.frozen))
    made_cluster = make_cluster_for(cluster)
    dataset_info = None
    if dataset is not None:
        _check_no_sample_inputs(workload)
        if dataset.tokenizer is None:
            dataset = replace(dataset, tokenizer=model_folder_tokenizer(model))
        sample_workload, dataset_info = dataset_workload_for(spec, made_cluster.num_devices, dataset,
                                                             global_batch=workload.global_batch)
    else:
        sample_workload = make_workload(spec, made_cluster.num_devices, workload)
    _check_sample(sample_workload, spec)
    if search.attention is not None and search.attention not in ATTENTION_CALLS:
        raise ValueError(f"--attention must be one of {', '.join(ATTENTION_CALLS)}, got {search.attention!r}")
    if search.linear_attention is not None and search.linear_attention not in LINEAR_ATTENTION_KERNELS:
        raise ValueError(f"--linear-attention must be one of {', '.join(LINEAR_ATTENTION_KERNELS)}, got "
                         f"{search.linear_attention!r}")
    made_cluster, layer_costs, assumptions = _profile_source(spec, made_cluster, cluster.profile, assumptions)
    assumptions = replace(
        assumptions, attention_calls=search.attention or attention_calls_for(made_cluster.device),
        linear_attention_kernel=search.linear_attention or linear_attention_kernel_for(made_cluster.device))
    return Problem(model=spec, cluster=made_cluster, workload=sample_workload, precision=workload.precision,
                   assumptions=assumptions, layer_costs=layer_costs, allow_ring_cp=search.allow_ring_cp,
                   allow_pp=search.allow_pp, dataset=dataset_info, workers=search.workers)


def _with_frozen(model: ModelSpec, frozen: list[str]) -> ModelSpec:
    """``model`` with ``frozen`` modules marked, each a module of it and not all of them."""
    for name in frozen:
        if name not in model.module_names:
            raise ValueError(f"--frozen {name}: {model.name} has modules {', '.join(model.module_names)}")
    if set(frozen) >= set(model.module_names):
        raise ValueError("every module of the plan is frozen: nothing to train")
    return model.with_frozen(frozen) if frozen else model


def attention_calls_for(device: DeviceSpec) -> AttentionCalls:
    """The attention calls the runtime makes on ``device``: one variable-length flash call per layer on a GPU
    (torch's ``varlen_attn``), one SDPA call per segment on a CPU (no variable-length kernel there)."""
    return "sdpa" if device.name.lower() == "cpu" else "varlen"


def linear_attention_kernel_for(device: DeviceSpec) -> LinearAttentionKernel:
    """The kernel linear-attention layers run on ``device``: flash-linear-attention's on a GPU (its Triton kernels
    need one), transformers' torch fallback on a CPU."""
    return "torch" if device.name.lower() == "cpu" else "fla"


def model_folder_tokenizer(model: str | ModelSpec) -> str | None:
    """The model folder when ``model`` is a config.json path (or its folder) beside a tokenizer.json, else None."""
    if not isinstance(model, str) or not os.path.exists(model):
        return None
    folder = model if os.path.isdir(model) else os.path.dirname(model) or "."
    return folder if os.path.isfile(os.path.join(folder, "tokenizer.json")) else None


SAMPLE_FLAGS = (("image_sizes", "--image-size"), ("vision_tokens", "--vision-tokens"),
                ("text_tokens", "--text-tokens"), ("images_per_sample", "--images-per-sample"),
                ("audio_seconds", "--audio-seconds"), ("videos", "--video"))
"""The fields of ``WorkloadInputs`` a dataset gives instead, with their flags."""


def _check_no_sample_inputs(workload: WorkloadInputs) -> None:
    given = [flag for name, flag in SAMPLE_FLAGS if getattr(workload, name) not in (None, ())]
    if given:
        raise ValueError(f"--dataset gives every sample's shape: drop {', '.join(given)}")


def dataset_workload_for(
    model: ModelSpec, num_gpus: int, dataset: DatasetInputs, *, global_batch: int | None = None,
) -> tuple[Workload, DatasetInfo]:
    """The packed workload of a dataset and what the plan records about it (see ``make_problem``)."""
    if model.audio_input is not None:
        raise ValueError(f"--dataset reads image-text data; {model.name} has an audio encoder")
    min_pixels = model.vision_input.min_pixels if dataset.min_pixels is None else dataset.min_pixels
    max_pixels = model.vision_input.max_pixels if dataset.max_pixels is None else dataset.max_pixels
    check_bounds("--min-pixels", min_pixels, 1, MAX_IMAGE_SIDE**2)
    check_bounds("--max-pixels", max_pixels, min_pixels, MAX_IMAGE_SIDE**2)
    pack_tokens = dataset.pack_tokens
    if pack_tokens is not None:
        check_bounds("--pack-tokens", pack_tokens, 1, MAX_TEXT_TOKENS)
    if global_batch is not None:
        check_bounds("--global-batch", global_batch, 1, MAX_GLOBAL_BATCH)
    fps = DEFAULT_FPS if dataset.fps is None else dataset.fps
    check_bounds("--fps", float(fps), 0.01, 240.0)
    source = dataset.source
    histogram = source if isinstance(source, DatasetHistogram) else read_dataset(source, dataset.tokenizer)
    check_histogram_bounds(histogram)
    tokens = sample_tokens(histogram, model, fps=fps, min_pixels=min_pixels, max_pixels=max_pixels)
    if not dataset.pack and pack_tokens is not None:
        raise ValueError("--pack-tokens sets the budget of packs: it does not apply without packing")
    budget = None if not dataset.pack else pack_budgets(tokens, (1,))[0] if pack_tokens is None else pack_tokens
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
        fps=fps if any(v.fps for *_, videos in histogram.shapes for v in videos) else None,
        tokens_per_sample={m: percentiles(v) for m, v in per_sample.items()},
        pack_tokens=packing.packed.pack_tokens, packs_per_epoch=packing.packs,
        samples_per_pack=packing.packed.samples_per_pack, packing_efficiency=packing.efficiency,
        heaviest_pack_tokens={m: t.tokens for m, t in packing.packed.heaviest},
        **({} if histogram.reading is None else {"read_from": histogram.reading.path, "tokenizer":
            histogram.reading.tokenizer, "data_root_only": histogram.reading.data_root_only}),
    )
    return workload, info


def check_histogram_bounds(histogram: DatasetHistogram) -> None:
    """A dataset's samples within the per-sample bounds of the flags (``MAX_TEXT_TOKENS``, ``MAX_IMAGE_SIDE`` for
    images and video frames, ``MAX_IMAGES_PER_SAMPLE``, ``MAX_VIDEOS_PER_SAMPLE``, ``MAX_VIDEO_FRAMES`` for a frame
    list) and at most ``MAX_DATASET_SAMPLES`` of them, else a one-line ValueError."""
    where = f"dataset {histogram.source}"
    if histogram.samples > MAX_DATASET_SAMPLES:
        raise ValueError(f"{where} has {histogram.samples:,} samples, at most {MAX_DATASET_SAMPLES:,} are planned "
                         "for: plan for a random subset of it")
    for _, text, images, videos in histogram.shapes:
        if text > MAX_TEXT_TOKENS:
            raise ValueError(f"{where} has a sample of {text:,} text tokens, at most {MAX_TEXT_TOKENS:,} are supported")
        if len(images) > MAX_IMAGES_PER_SAMPLE:
            raise ValueError(f"{where} has a sample of {len(images)} images, at most {MAX_IMAGES_PER_SAMPLE} are "
                             "supported")
        if any(max(h, w) > MAX_IMAGE_SIDE for h, w in images):
            raise ValueError(f"{where} has an image side above {MAX_IMAGE_SIDE:,} pixels")
        if len(videos) > MAX_VIDEOS_PER_SAMPLE:
            raise ValueError(f"{where} has a sample of {len(videos)} videos, at most {MAX_VIDEOS_PER_SAMPLE} are "
                             "supported")
        if any(max(v.height, v.width) > MAX_IMAGE_SIDE for v in videos):
            raise ValueError(f"{where} has a video frame side above {MAX_IMAGE_SIDE:,} pixels")
        if any(not v.fps and v.frames > MAX_VIDEO_FRAMES for v in videos):
            raise ValueError(f"{where} has a video of more than {MAX_VIDEO_FRAMES} frame files, at most "
                             f"{MAX_VIDEO_FRAMES} are supported (a video file is sampled at --fps)")


def _check_sample(workload: Workload, model: ModelSpec) -> None:
    """What the runtime would refuse about a sample, refused here with its words: no tokens, unaligned
    --vision-tokens, more than ``MAX_VISION_TOKENS``, too few text tokens for the image or audio clips' markers."""
    tokens = module_tokens(workload, model)  # raises ValueError for samples without tokens or unaligned --vision-tokens
    vision = tokens["vision"].tokens if "vision" in tokens else 0
    if vision > MAX_VISION_TOKENS:
        raise ValueError(f"a sample has {vision:,} vision tokens, at most {MAX_VISION_TOKENS:,} are supported "
                         f"(fewer or smaller images)")
    if "vision" in tokens and workload.packs is None:
        images = 1 if workload.vision_tokens is not None else len(workload.image_sizes)
        if workload.text_tokens < 2 * images + 1:  # runtime.data.samples.SampleLayout's rule
            raise ValueError(f"{workload.text_tokens} text tokens cannot hold a start and end marker for each of "
                             f"{images} images plus one text token (--text-tokens {2 * images + 1} or more)")
    clips = len(tokens["audio"].segments) if "audio" in tokens else 0
    if clips and workload.text_tokens < 2 * clips + 1:  # the audio family's AudioLayout rule
        raise ValueError(f"{workload.text_tokens} text tokens cannot hold a start and end marker for each of {clips} "
                         f"audio clips plus one text token (--text-tokens {2 * clips + 1} or more)")


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
