"""The Plan: the one versioned JSON document that crosses from the planner to the runtime.

Only pydantic and torch-free planner modules are imported here, so the runtime can validate plans without pulling
in the solver.
Bump ``SCHEMA_VERSION`` on any change a reader of an older version would misread.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from planner.contract.hardware import PLAUSIBLE_RANGES, DeviceSpec, check_plausible, with_host_fields
from planner.contract.versioned_json import read_versioned, validated

SCHEMA_VERSION = 9
READABLE_SCHEMA_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9)
"""Version 2 added ``workload.dataset``, version 3 pipeline parallelism (``pp``, ``pp_schedule``,
``virtual_stages``, ``pp_layers``), version 4 video clips (``workload.videos``), version 5 the fps a dataset's video
files are sampled at (``workload.dataset.fps``), version 6 expert parallelism (a module's ``ep``), version 7 the
attention kernel and the chunked loss a module was priced with (``attention``, ``loss_chunk_tokens``), version 8 how
a dataset plan's dataset was read (``workload.dataset.read_from``, ``tokenizer``, ``data_root_only``), version 9 the
kernel a module's linear-attention layers were priced with (``linear_attention``); an older plan reads as one without
them (per-segment SDPA, the whole logits at once, a dataset a re-plan cannot read again, linear attention on
transformers' torch fallback)."""
Source = Literal["analytical", "measured", "calibrated"]
AttentionCalls = Literal["varlen", "sdpa"]
"""How a module calls attention over segmented sequences (windows, images, packed samples): ``varlen`` one
variable-length flash call per layer over all segments (torch's ``varlen_attn`` / flash-attn's varlen API, CUDA),
``sdpa`` one SDPA call per segment (transformers' loop; the CPU path)."""
ATTENTION_CALLS: tuple[AttentionCalls, ...] = ("varlen", "sdpa")
LinearAttentionKernel = Literal["fla", "torch"]
"""How a module's Gated DeltaNet (linear-attention) layers run: ``fla`` flash-linear-attention's chunked delta rule
and causal conv, one call each per layer over the packed row's ``cu_seqlens`` (the fla-core package, CUDA),
``torch`` transformers' torch fallbacks once per packed segment (the CPU path)."""
LINEAR_ATTENTION_KERNELS: tuple[LinearAttentionKernel, ...] = ("fla", "torch")


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MemoryBreakdown(_Frozen):
    """Per-GPU memory in GiB, by what holds it."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float = Field(description="temporary and communication buffers")
    overhead: float = Field(description="framework / allocator allowance")

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers + self.overhead


PASS_TIME_DOCS = {
    "forward_s": "forward compute",
    "backward_s": "backward compute (without recomputation)",
    "recompute_s": "forward compute re-run in the backward",
    "tp_comm_s": "exposed tensor-parallel collectives",
    "sp_comm_s": "exposed Ulysses all-to-alls",
    "cp_comm_s": "exposed ring-attention KV passing",
    "ep_comm_s": "exposed expert-parallel token dispatch and combine all-to-alls",
}
"""Each term and what it holds (its description in the Plan); the cost model's ``planner.cost.times.PassTimes`` has
these fields with the unit suffix."""


_PassTime = create_model(
    "_PassTime", __base__=_Frozen,
    **{name.removesuffix("_s"): (float, Field(description=doc, **({"default": 0.0} if name == "ep_comm_s" else {})))
       for name, doc in PASS_TIME_DOCS.items()},
)
"""The pass-time terms, named without the unit suffix (``ep_comm`` 0 in plans before schema version 6)."""


class ModuleTime(_PassTime):
    """Seconds one optimizer step spends in a module on one of its GPUs, by cause."""

    dp_comm: float = Field(description="exposed (not overlapped) data-parallel / ZeRO communication")
    optimizer: float = Field(description="the optimizer step over this GPU's optimizer shard")
    handoff: float = Field(description="sending this module's output to the next module and its gradient back")
    pp_comm: float = Field(default=0.0, description="exposed point-to-point sends between pipeline stages")
    pp_bubble: float = Field(default=0.0, description="pipeline fill and drain (idle) on the slowest stage")
    per_micro_batch: float = Field(description="forward+backward+recompute+tp/sp/cp comm+handoff+pp sends of one "
                                   "micro-batch (pipelined: on the slowest stage)")


class ModulePrediction(_Frozen):
    """The cost model's numbers for one module."""

    time_s: ModuleTime
    memory_gib: MemoryBreakdown
    flops_per_step: float = Field(description="model FLOPs of this module per step, all GPUs")
    sources: dict[str, Source] = Field(description="which source each number came from, by layer or quantity")
    stage_per_micro_batch_s: list[float] | None = Field(default=None, description="pp > 1: each pipeline stage's "
                                                        "time for one micro-batch (its compute and transfers)")
    stage_peak_memory_gib: list[float] | None = Field(default=None, description="pp > 1: each pipeline stage's own "
                                                      "peak (this module's share alone)")
    stage_memory_gib: list[MemoryBreakdown] | None = Field(default=None, description="pp > 1: each pipeline "
                                                           "stage's breakdown at its own peak (this module alone)")
    expected_imbalance: float | None = Field(default=None, description="a dataset plan: the busiest replica's work "
                                             "over the mean replica's, expected under the per-step assignment "
                                             "(planner.cost.balance); the times are the busiest replica's")


ZERO_BUBBLE_SCHEDULES = ("interleaved_zb",)
"""Pipeline schedules that split each backward into an input-gradient and a deferred weight-gradient pass (Qi et al.
2023)."""


def zero_bubble_reasons(zero: int, recompute: str) -> list[str]:
    """What a zero-bubble schedule does not run with: ZeRO-3, whose resharded parameters torch's weight-gradient pass
    does not see (its gradients come out wrong, silently, in torch 2.13), and full recomputation, which the weight
    pass repeats once per parameter group. A plan with either is invalid."""
    reasons = []
    if zero == 3:
        reasons.append("interleaved_zb with zero=3: torch's weight-gradient pass misses ZeRO-3's resharded "
                       "parameters (wrong gradients); use zero <= 2 or interleaved_1f1b")
    if recompute == "full":
        reasons.append("interleaved_zb with recompute=full: the weight-gradient pass would recompute each block once "
                       "per parameter group; use selective recomputation or interleaved_1f1b")
    return reasons


class ModulePlan(_Frozen):
    """One module's layout."""

    name: str
    ranks: list[int] = Field(description="global ranks; rank r of the module is ranks[r], grid pp x dp x cp x sp x tp")
    dp: int = Field(ge=1)
    tp: int = Field(ge=1)
    sp: int = Field(ge=1)
    cp: int = Field(ge=1)
    pp: int = Field(default=1, ge=1, description="pipeline stages")
    pp_schedule: Literal["1f1b", "interleaved_1f1b", "interleaved_zb"] = "1f1b"
    virtual_stages: int = Field(default=1, ge=1, description="model chunks per pipeline rank (the interleaved "
                                "schedules)")
    pp_layers: list[int] | None = Field(default=None, description="pp > 1: decoder layers of each model chunk in "
                                        "pipeline order (chunk c runs on stage c % pp); the first chunk also holds "
                                        "the embedding, the last the final norm, lm_head and loss")
    ep: int = Field(default=1, ge=1, description="expert-parallel degree: each MoE layer's whole experts split over "
                    "ep of a stage's dp x sp ranks with all their tp ranks, ep * tp in all (1: no data ranks, and "
                    "every plan before schema version 6)")
    attention: AttentionCalls = Field(default="sdpa", description="the attention calls the module was priced with "
                                      "and runs: varlen (one variable-length flash call per layer; CUDA) or sdpa "
                                      "(one SDPA call per segment; every plan before schema version 7)")
    loss_chunk_tokens: int = Field(default=0, ge=0, description="the module with lm_head: tokens per chunk of its "
                                   "lm_head + cross-entropy, each chunk's logits recomputed in backward; 0: the "
                                   "whole slice's logits at once (a pipelined LLM, and every plan before version 7)")
    linear_attention: LinearAttentionKernel | None = Field(
        default=None, description="the kernel the module's linear-attention layers were priced with and run: fla "
        "(flash-linear-attention's, one call per layer over the packed row; CUDA) or torch (transformers' fallbacks "
        "per packed segment); None: the module has none, or a plan before schema version 9 (which ran torch)")
    zero: int = Field(ge=0, le=3)
    recompute: Literal["none", "selective", "full"]
    micro_batch: int = Field(ge=1)
    grad_accum: int = Field(ge=1)
    frozen: bool
    num_params: int
    predicted: ModulePrediction

    @model_validator(mode="after")
    def _ranks_match_degrees(self) -> "ModulePlan":
        degrees = self.pp * self.dp * self.tp * self.sp * self.cp
        if len(self.ranks) != degrees:
            raise ValueError(f"module {self.name}: {len(self.ranks)} ranks but pp*dp*tp*sp*cp = {degrees}")
        if (self.pp_schedule != "1f1b") != (self.virtual_stages > 1):
            raise ValueError(f"module {self.name}: virtual_stages={self.virtual_stages} with pp_schedule "
                             f"{self.pp_schedule}")
        chunks = self.pp * self.virtual_stages
        if self.pp > 1 and (self.pp_layers is None or len(self.pp_layers) != chunks or min(self.pp_layers) < 1):
            raise ValueError(f"module {self.name}: pp={self.pp} x virtual_stages={self.virtual_stages} needs pp_layers "
                             f"of {chunks} positive counts, got {self.pp_layers}")
        if self.pp == 1 and (self.pp_layers is not None or self.virtual_stages > 1):
            raise ValueError(f"module {self.name}: pp_layers / virtual_stages are for pp > 1")
        if self.pp_schedule in ZERO_BUBBLE_SCHEDULES and zero_bubble_reasons(self.zero, self.recompute):
            raise ValueError(f"module {self.name}: {zero_bubble_reasons(self.zero, self.recompute)[0]}")
        return self


class ModelInfo(_Frozen):
    name: str
    family: str
    hf_config: dict[str, Any] = Field(description="Hugging Face config the runtime builds the model from")
    num_params: int
    module_params: dict[str, int]


class ClusterInfo(_Frozen):
    device: DeviceSpec
    num_devices: int
    devices_per_node: int

    @field_validator("device", mode="before")
    @classmethod
    def _older_plans_host_fields(cls, device: Any) -> Any:
        """Plans written before host costs were modelled lack the host fields (``with_host_fields``)."""
        return with_host_fields(device) if isinstance(device, dict) else device

    @field_validator("device")
    @classmethod
    def _device_numbers_plausible(cls, device: DeviceSpec) -> DeviceSpec:
        """Each number within ``PLAUSIBLE_RANGES`` (a unit mistake named with its hint), as for a cluster file."""
        for field in PLAUSIBLE_RANGES:
            check_plausible(field, getattr(device, field), "cluster.device")
        return device

    @field_validator("num_devices", "devices_per_node")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"must be at least 1, got {value}")
        return value


class TokenPercentiles(_Frozen):
    p50: float
    p95: float
    max: float


class DatasetInfo(_Frozen):
    """The dataset a plan was made for (``plan --dataset``): one sample of the workload is one pack."""

    source: str = Field(description="the data or histogram file")
    samples: int = Field(description="usable samples of an epoch (packed)")
    skipped: dict[str, int] = Field(description="rows and samples left out, by reason")
    text_tokens: str = Field(description="how text tokens were counted")
    min_pixels: int
    max_pixels: int
    fps: float | None = Field(default=None, description="frames sampled per second of its video files (None: it has "
                              "none)")
    tokens_per_sample: dict[str, TokenPercentiles] = Field(description="per module, over the samples")
    pack_tokens: int | None = Field(description="LLM-token budget of a pack; None: one sample per pack")
    packs_per_epoch: int
    samples_per_pack: float
    packing_efficiency: float | None = Field(description="real LLM tokens / (packs * pack_tokens)")
    heaviest_pack_tokens: dict[str, float] = Field(description="per module, the tokens of its heaviest pack, "
                                                   "which the plan's memory holds")
    read_from: str | None = Field(default=None, description="the file given as the dataset (data or histogram), "
                                  "which a re-plan reads again; None: a histogram made in memory")
    tokenizer: str | None = Field(default=None, description="the folder whose tokenizer.json counted the text "
                                  "(None: the estimate text_tokens states)")
    data_root_only: bool = Field(default=False, description="rows naming a file outside the data file's folder "
                                 "were skipped")


class WorkloadInfo(_Frozen):
    image_sizes: list[tuple[int, int]]
    vision_tokens: int | None
    text_tokens: int
    audio_seconds: float
    global_batch: int
    videos: list[tuple[int, int, int]] = Field(default=[], description="(sampled frames, height, width) of each "
                                               "video clip of a sample")
    module_tokens: dict[str, int] = Field(description="tokens per sample entering each module")
    llm_image_tokens: int = Field(description="LLM tokens per sample that come from images")
    dataset: DatasetInfo | None = Field(default=None, description="with a dataset, a sample above is the mean "
                                        "pack (tokens rounded) and global_batch counts packs")


class TrainingInfo(_Frozen):
    precision: Literal["bf16_mixed", "bf16_pure"]
    optimizer: Literal["adamw"] = "adamw"
    learning_rate: float = Field(default=1e-5, gt=0, le=1.0, allow_inf_nan=False)
    warmup_steps: int = Field(default=10, ge=0, le=10**9)
    weight_decay: float = Field(default=0.0, ge=0, le=1.0, allow_inf_nan=False)
    grad_clip_norm: float = Field(default=1.0, gt=0, allow_inf_nan=False, description="global-norm clipping: a "
                                  "zero norm would zero every update, a negative one flip it")


class Prediction(_Frozen):
    """Whole-plan numbers."""

    step_time_s: float
    tokens_per_s: float = Field(description="LLM tokens (text + image + audio) per second")
    samples_per_s: float
    mfu: float = Field(description="model FLOPs per step / (step time * GPUs * peak FLOP/s)")
    peak_memory_gib: float = Field(description="largest per-GPU memory of any GPU")
    memory_breakdown_gib: MemoryBreakdown = Field(description="breakdown on the GPU with the peak")
    peak_phase: str | None = Field(default=None, description="the moment of the step the peak is at, e.g. 'llm "
                                   "forward' (planner.cost.phases); None in plans written before it was recorded")
    binding_constraint: str = Field(description="what limits the plan, in words")
    stage_memory_breakdown_gib: list[MemoryBreakdown] | None = Field(
        default=None, description="a pipelined LLM: the breakdown on each pipeline stage's GPUs at their own "
        "heaviest moment (colocated: with the other modules), overhead included; the largest is the LLM's peak")
    stage_peak_phases: list[str] | None = Field(default=None, description="a pipelined LLM: the moment of each "
                                                "stage's peak (planner.cost.phases)")
    calibration: str | None = Field(default=None, description="the profile calibration whose fitted assumptions the "
                                    "prediction used (runs, date, errors, values); None when uncalibrated")
    profile: str | None = Field(default=None, description="the profile file the plan was costed with (None: the "
                                "analytical model only)")


class BaselineResult(_Frozen):
    """A reference strategy costed by the same model, or why it does not fit."""

    description: str
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    peak_memory_gib: float | None = None
    mfu: float | None = None
    speedup: float | None = Field(default=None, description="baseline step time / plan step time")
    modules: dict[str, str] | None = Field(default=None, description="module -> strategy in short form")
    infeasible: str | None = None


class SolverInfo(_Frozen):
    status: Literal["OPTIMAL", "FEASIBLE", "EVALUATED"]
    num_candidates: int
    rank: int = Field(default=1, description="1 for the best plan, k for the k-th of --top-k")
    fixed: dict[str, str] = Field(default_factory=dict, description="degrees pinned with --fix")


class Plan(_Frozen):
    schema_version: int
    planner_version: str
    model: ModelInfo
    cluster: ClusterInfo
    workload: WorkloadInfo
    training: TrainingInfo
    placement: Literal["colocated", "disjoint"]
    modules: list[ModulePlan]
    predicted: Prediction
    baselines: dict[str, BaselineResult]
    solver: SolverInfo

    def module(self, name: str) -> ModulePlan:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(f"plan has no module {name!r}")

    def to_json(self) -> str:
        """Canonical JSON text: same plan -> same bytes."""
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"


class PlanError(ValueError):
    """A plan file that cannot be used, with a one-line reason."""


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file; raise PlanError with a one-line reason if it cannot be used."""
    data = read_versioned(path, kind="plan file", readable=READABLE_SCHEMA_VERSIONS, writer="plan --out",
                          error=PlanError)
    return validated(Plan, data, path, kind="plan", error=PlanError)
