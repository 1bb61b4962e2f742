"""Per-module parallel strategies: the degrees the planner chooses and their validity rules.

A module (vision encoder, audio encoder, LLM decoder) runs on ``gpus`` devices arranged as a
``pp x dp x cp x sp x tp`` grid (tp innermost, so a TP group is a run of consecutive ranks inside a node; pp
outermost, so each pipeline stage is a block of consecutive ranks and, once a stage spans a node, stages meet
across nodes: TP inside a node, PP across nodes, as Megatron-LM lays them out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Mapping

Recompute = Literal["none", "selective", "full"]
Placement = Literal["colocated", "disjoint"]
Precision = Literal["bf16_mixed", "bf16_pure"]
PipelineSchedule = Literal["1f1b", "interleaved_1f1b", "interleaved_zb"]

RECOMPUTE_CHOICES: tuple[Recompute, ...] = ("none", "selective", "full")
PLACEMENTS: tuple[Placement, ...] = ("colocated", "disjoint")
PRECISIONS: tuple[Precision, ...] = ("bf16_mixed", "bf16_pure")
PIPELINE_SCHEDULES: tuple[PipelineSchedule, ...] = ("1f1b", "interleaved_1f1b", "interleaved_zb")
"""1F1B; interleaved 1F1B and interleaved zero-bubble (weight gradients deferred to fill the bubble), both with
``virtual_stages`` > 1 model chunks per rank (torch's ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
``ScheduleInterleavedZeroBubble``)."""
DEGREE_FIELDS = ("dp", "tp", "sp", "cp", "pp", "ep", "zero", "recompute", "micro_batch", "grad_accum")
STRATEGY_FIELDS = (*DEGREE_FIELDS, "pp_schedule", "virtual_stages")
"""Every field of a ``ModuleStrategy`` (a plan file's module has each of them)."""


@dataclass(kw_only=True, frozen=True)
class ModuleStrategy:
    """How one module is parallelised."""

    dp: int
    """Data-parallel degree (replicas, or ZeRO shards when ``zero`` > 0)."""
    tp: int = 1
    """Tensor-parallel degree (Megatron column/row split of every linear layer)."""
    sp: int = 1
    """Ulysses sequence-parallel degree (all-to-all from sequence- to head-sharding around attention)."""
    cp: int = 1
    """Ring / context-parallel degree (KV blocks passed around a ring)."""
    zero: int = 0
    """ZeRO stage over the DP group: 0 none, 1 optimizer, 2 +gradients, 3 +parameters (FSDP)."""
    recompute: Recompute = "none"
    """Activation recomputation: none, selective (attention core only) or full (whole block)."""
    micro_batch: int = 1
    """Samples per micro-batch on one DP replica."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (the same for every module of a plan)."""
    pp: int = 1
    """Pipeline stages (ranks along the pipeline; each holds a contiguous run of the module's layers)."""
    pp_schedule: PipelineSchedule = "1f1b"
    """Pipeline schedule when pp > 1 (``PIPELINE_SCHEDULES``): 1F1B, or an interleaved one with ``virtual_stages``
    model chunks per rank."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (1 for 1F1B; >= 2 for the interleaved schedules)."""
    ep: int = 1
    """Expert-parallel degree of a module with mixture-of-experts layers: each MoE layer's experts are split over an
    EP group of ``ep`` of the (pipeline stage's) dp x sp ranks with all their TP ranks, ``ep * tp`` ranks each holding
    whole experts and exchanging tokens by all-to-all, every TP rank its slice of the tokens (so tp > 1 splits them
    even with ep = 1); attention, router and norms keep the module's DP/TP/SP, and under ZeRO the experts are
    sharded over the remaining dp * sp / ep ranks (torchtitan's ``ep`` / ``efsdp`` meshes with etp=1, transformers
    ``AllToAllEP``). 1 on dense modules."""

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "sp", "cp", "pp", "ep", "virtual_stages", "micro_batch", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.pp_schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"pp_schedule must be one of {PIPELINE_SCHEDULES}, got {self.pp_schedule!r}")
        if (self.pp_schedule != "1f1b") != (self.virtual_stages > 1):
            expected = "interleaved_1f1b or interleaved_zb" if self.virtual_stages > 1 else "1f1b"
            raise ValueError(f"virtual_stages={self.virtual_stages} goes with pp_schedule {expected}, "
                             f"got {self.pp_schedule!r}")
        if self.pp == 1 and self.virtual_stages > 1:
            raise ValueError(f"virtual_stages={self.virtual_stages} needs pp > 1")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {self.zero}")
        if self.recompute not in RECOMPUTE_CHOICES:
            raise ValueError(f"recompute must be one of {RECOMPUTE_CHOICES}, got {self.recompute!r}")

    @classmethod
    def of_plan_module(cls, module: Any) -> "ModuleStrategy":
        """The strategy a plan file's module records (``planner.contract.schema.ModulePlan``)."""
        return cls(**{name: getattr(module, name) for name in STRATEGY_FIELDS})

    @property
    def gpus(self) -> int:
        """Devices the module occupies: pp * dp * cp * sp * tp."""
        return self.pp * self.dp * self.cp * self.sp * self.tp

    @property
    def stage_gpus(self) -> int:
        """Devices of one pipeline stage: dp * cp * sp * tp (all of them without PP)."""
        return self.dp * self.cp * self.sp * self.tp

    @property
    def samples_per_step(self) -> int:
        """Samples one optimizer step consumes: dp * micro_batch * grad_accum."""
        return self.dp * self.micro_batch * self.grad_accum

    def describe(self) -> str:
        """Short human-readable form, e.g. ``DP2-TP4-SP1-CP1 ZeRO1 rc=none mb=1 ga=8`` (with PP:
        ``PP4(1f1b)-DP2-TP4-...``, ``PP4(interleaved_1f1b x2)-...``; with expert parallelism ``...-CP1-EP2 ...``)."""
        pipeline = ""
        if self.pp > 1:
            chunks = f" x{self.virtual_stages}" if self.virtual_stages > 1 else ""
            pipeline = f"PP{self.pp}({self.pp_schedule}{chunks})-"
        return (
            f"{pipeline}DP{self.dp}-TP{self.tp}-SP{self.sp}-CP{self.cp}{f'-EP{self.ep}' if self.ep > 1 else ''} "
            f"ZeRO{self.zero} "
            f"rc={self.recompute} mb={self.micro_batch} ga={self.grad_accum}"
        )


@dataclass(kw_only=True, frozen=True)
class Strategy:
    """A whole-model strategy: placement plus one ModuleStrategy per module."""

    placement: Placement
    """colocated: every module spans all GPUs, run one after another; disjoint: one GPU group per module."""
    modules: Mapping[str, ModuleStrategy]
    """Module name -> strategy, in the model's module order."""
    precision: Precision = "bf16_mixed"
    """bf16_mixed: bf16 compute, fp32 master weights and Adam states (16 B/param); bf16_pure: all bf16 (8 B/param)."""

    def __post_init__(self) -> None:
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        accums = {s.grad_accum for s in self.modules.values()}
        if len(accums) > 1:
            raise ValueError(f"all modules must use the same grad_accum, got {sorted(accums)}")
        samples = {s.samples_per_step for s in self.modules.values()}
        if len(samples) > 1:
            raise ValueError(f"dp * micro_batch * grad_accum must agree across modules, got {sorted(samples)}")
        if self.placement == "colocated":
            counts = {s.gpus for s in self.modules.values()}
            if len(counts) > 1:
                raise ValueError(f"colocated modules must span the same GPUs, got GPU counts {sorted(counts)}")

    @property
    def num_gpus(self) -> int:
        """Total devices: shared (colocated) or summed (disjoint)."""
        counts = [s.gpus for s in self.modules.values()]
        return max(counts) if self.placement == "colocated" else sum(counts)

    @property
    def grad_accum(self) -> int:
        """Micro-batches per optimizer step."""
        return next(iter(self.modules.values())).grad_accum

    def first_ranks(self) -> dict[str, int]:
        """First global rank of each module.

        Colocated modules all start at rank 0. Disjoint groups are consecutive blocks with the LLM first, so
        that its (usually largest) TP groups start on a node boundary; encoders follow in model order.
        """
        if self.placement == "colocated":
            return {name: 0 for name in self.modules}
        order = sorted(self.modules, key=lambda name: name != "llm")
        starts, start = {}, 0
        for name in order:
            starts[name] = start
            start += self.modules[name].gpus
        return {name: starts[name] for name in self.modules}

    def module_ranks(self) -> dict[str, list[int]]:
        """Global ranks of each module (see first_ranks)."""
        firsts = self.first_ranks()
        return {name: list(range(firsts[name], firsts[name] + s.gpus)) for name, s in self.modules.items()}


def strategy_of(plan: Any) -> Strategy:
    """The strategy a plan file records (``planner.contract.schema.Plan``)."""
    modules = {m.name: ModuleStrategy.of_plan_module(m) for m in plan.modules}
    return Strategy(placement=plan.placement, modules=modules, precision=plan.training.precision)


def layout_of(plan: Any) -> str:
    """Each module's degrees a plan file records, in one line: ``vision DP2-TP1-SP1-CP1 ZeRO0 rc=none mb=1 ga=1;
    llm ...`` (``ModuleStrategy.describe``), after ``disjoint:`` when the modules have GPUs of their own."""
    layout = "; ".join(f"{m.name} {ModuleStrategy.of_plan_module(m).describe()}" for m in plan.modules)
    return f"disjoint: {layout}" if plan.placement == "disjoint" else layout
