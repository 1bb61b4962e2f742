"""Result types of the cost model: per-module costs, memory breakdowns and whole-plan estimates."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from planner.cost.times import PassTimes
from planner.contract.strategy import ModuleStrategy, Placement
from planner.contract.units import GIB



@dataclass(kw_only=True, frozen=True)
class MemoryBreakdown:
    """Per-GPU bytes by what holds them."""

    weights: int
    """Parameters resident on the GPU (after TP split and ZeRO-3 sharding)."""
    gradients: int
    """Gradients resident on the GPU."""
    optimizer: int
    """Optimizer states (incl. fp32 master weights) resident on the GPU."""
    activations: int
    """Activations kept for backward, for every micro-batch in flight."""
    buffers: int
    """Temporary and communication buffers (gathered ZeRO-3 layers, gradient buckets, loss logits)."""
    overhead: int
    """Framework allowance (CUDA context, workspaces); counted once per GPU."""

    @property
    def total(self) -> int:
        """Sum of all parts."""
        return self.weights + self.gradients + self.optimizer + self.activations + self.buffers + self.overhead

    def __add__(self, other: "MemoryBreakdown") -> "MemoryBreakdown":
        return MemoryBreakdown(
            weights=self.weights + other.weights,
            gradients=self.gradients + other.gradients,
            optimizer=self.optimizer + other.optimizer,
            activations=self.activations + other.activations,
            buffers=self.buffers + other.buffers,
            overhead=self.overhead + other.overhead,
        )

    def describe(self) -> str:
        """``weights 10.0 + grads ... = total 60.0 GiB``."""
        parts = ("weights", "gradients", "optimizer", "activations", "buffers", "overhead")
        return " + ".join(f"{p} {getattr(self, p) / GIB:.1f}" for p in parts) + f" = {self.total / GIB:.1f} GiB"


@dataclass(kw_only=True, frozen=True)
class ModuleCost(PassTimes):
    """One module under one ModuleStrategy, per GPU of that module, for one optimizer step: its pass times over all
    micro-batches, what follows them, and its memory."""

    module: str
    """Module name."""
    strategy: ModuleStrategy
    """The strategy costed."""
    dp_comm_s: float
    """Exposed (not overlapped) DP/ZeRO communication per step."""
    optimizer_s: float
    """The optimizer step over this GPU's optimizer shard, once per step."""
    handoff_s: float
    """Per step: sending this encoder's output to the LLM layout and its gradient back (a pipelined LLM: stage 0
    receiving it)."""
    pp_comm_s: float = 0.0
    """Per step: exposed point-to-point sends between pipeline stages (hidden states forward, gradients back)."""
    per_micro_batch_s: float
    """forward + backward + recompute + tp/sp/cp comm + handoff + pp sends of ONE micro-batch (pipelined: on the
    slowest pipeline rank)."""
    weight_grad_per_micro_batch_s: float = 0.0
    """Of ``per_micro_batch_s``, the weight-gradient passes (what a zero-bubble pipeline schedule defers)."""
    forward_per_micro_batch_s: float
    """The forward part of ``per_micro_batch_s``: forward compute, the forward's share of the layer collectives and
    the outbound hand-off (what a disjoint pipeline's next stage waits for)."""
    weights_bytes: int
    """Resident weights per GPU."""
    gradients_bytes: int
    """Resident gradients per GPU."""
    optimizer_bytes: int
    """Resident optimizer state per GPU."""
    forward_buffers_bytes: int
    """Temporary/communication buffers per GPU while the module runs its forward (ZeRO-3 gathers, loss logits,
    all-to-all buffers)."""
    backward_buffers_bytes: int
    """... while it runs its blocks' backward (ZeRO-3 gathers and unsharded gradients, gradient buckets, the
    full-recomputation working block, all-to-all buffers)."""
    loss_backward_buffers_bytes: int = 0
    """... while its loss's backward runs, before the module's own (the loss's fp32 gradients; LLM only)."""
    loss_saved_bytes: int = 0
    """Of one micro-batch's activations, what the loss's backward frees (the fp32 log-softmax; LLM only)."""
    receive_buffers_bytes: int = 0
    """pp > 1: the pipeline stage's receive buffers, alive through every step (``pipeline_receive_buffer_bytes``)."""
    activations_per_micro_batch_bytes: int
    """Activations one micro-batch keeps for backward."""
    in_flight_micro_batches: int
    """Micro-batches whose activations are alive at once (colocated 1; 1F1B stage k of S: min(S-k, grad_accum))."""
    flops_per_step: float
    """Model FLOPs of this module per step over ALL its GPUs (no recomputation)."""
    sources: Mapping[str, str]
    """Where each number came from, e.g. ``{"window_block.forward": "analytical"}``."""
    pipeline_bubble_s: float = 0.0
    """Per step, pp > 1: the pipeline's fill and drain, idle on the slowest rank (``planner.cost.pipeline``)."""
    chunk_layers: tuple[int, ...] = ()
    """pp > 1: repeated blocks (decoder layers) of each model chunk, in pipeline order (chunk c on rank c % pp)."""
    stage_costs: tuple["ModuleCost", ...] = ()
    """pp > 1: the cost of each distinct pipeline rank (its layers and transfers, with the most in-flight
    activations of the ranks alike); the fields above are the slowest rank's times, the longest tail and the
    memory of the rank with the largest own peak."""
    rank_stages: tuple[tuple[int, int], ...] = ()
    """pp > 1: for each pipeline rank, (its entry in ``stage_costs``, the model chunks it holds in flight)."""
    imbalance: float | None = None
    """A dataset plan: the busiest replica's work over the mean replica's expected under the per-step assignment
    (``planner.cost.balance``; the times above are the busiest replica's); None otherwise."""

    def rank_costs(self) -> tuple["ModuleCost", ...]:
        """pp > 1: every pipeline rank's own cost, in pipeline order."""
        return tuple(replace(self.stage_costs[i], in_flight_micro_batches=n) for i, n in self.rank_stages)

    @property
    def micro_batches_s(self) -> float:
        """Every micro-batch of the step through the module: ``grad_accum * per_micro_batch + pipeline bubble``."""
        return self.strategy.grad_accum * self.per_micro_batch_s + self.pipeline_bubble_s

    @property
    def step_tail_s(self) -> float:
        """What follows the last micro-batch's backward: exposed DP/ZeRO communication + the optimizer step."""
        return self.dp_comm_s + self.optimizer_s

    @property
    def buffers_bytes(self) -> int:
        """The largest of the forward, backward and loss-backward buffers, with the receive buffers."""
        return max(self.forward_buffers_bytes, self.backward_buffers_bytes,
                   self.loss_backward_buffers_bytes) + self.receive_buffers_bytes

    @property
    def activations_bytes(self) -> int:
        """Activations of all micro-batches in flight."""
        return self.activations_per_micro_batch_bytes * self.in_flight_micro_batches

    def memory(self) -> MemoryBreakdown:
        """Everything this module ever holds on a GPU (each part at its largest), without the framework overhead;
        ``planner.cost.phases`` says what is alive together."""
        return MemoryBreakdown(
            weights=self.weights_bytes,
            gradients=self.gradients_bytes,
            optimizer=self.optimizer_bytes,
            activations=self.activations_bytes,
            buffers=self.buffers_bytes,
            overhead=0,
        )

    def time_parts(self) -> dict[str, float]:
        """Per-step seconds by cause."""
        return {
            "compute": self.forward_s + self.backward_s + self.recompute_s,
            "tp_comm": self.tp_comm_s,
            "sp_comm": self.sp_comm_s,
            "cp_comm": self.cp_comm_s,
            "ep_comm": self.ep_comm_s,
            "dp_comm": self.dp_comm_s,
            "optimizer": self.optimizer_s,
            "handoff": self.handoff_s,
            "pp_comm": self.pp_comm_s,
            "pp_bubble": self.pipeline_bubble_s,
        }


@dataclass(kw_only=True, frozen=True)
class Estimate:
    """Whole-plan prediction."""

    placement: Placement
    """colocated or disjoint."""
    step_time_s: float
    """Seconds per optimizer step."""
    tokens_per_s: float
    """LLM tokens (text + encoder outputs) per second."""
    samples_per_s: float
    """Samples per second."""
    mfu: float
    """Model FLOPs per step / (step time * GPUs * peak bf16 FLOP/s)."""
    num_gpus: int
    """GPUs the strategy uses."""
    peak_memory_bytes: int
    """Largest per-GPU memory of any GPU group."""
    peak_group: str
    """Group holding the peak (``all`` when colocated, else a module name)."""
    peak_phase: str
    """The moment of the step the peak is at (``planner.cost.phases``), e.g. ``llm forward``."""
    peak_breakdown: MemoryBreakdown
    """Breakdown on the peak GPU."""
    memory_per_group: Mapping[str, MemoryBreakdown]
    """Per-GPU memory of every group at its own peak moment (``all`` when colocated)."""
    usable_memory_bytes: int
    """Device memory * usable_memory_fraction."""
    fits: bool
    """Whether every group fits in the usable memory."""
    binding_constraint: str
    """What limits the plan, in words."""
    modules: Mapping[str, ModuleCost]
    """Per-module costs."""
    stage_peaks: tuple[tuple[str, MemoryBreakdown], ...] = ()
    """A pipelined LLM: (phase, per-GPU memory plus the overhead) of each pipeline stage's GPUs at their own
    heaviest moment, in pipeline order (colocated: with the other modules; disjoint: the LLM group); the largest
    is the LLM's group peak."""
