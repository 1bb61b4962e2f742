"""Peak-moment memory: what each module holds on a GPU at each phase of a training step.

A GPU's peak is the largest total of any one moment, not the sum of every module's worst moment: a module's
transients (ZeRO-3 gathers, loss logits, the re-created block of full recomputation) live only while it runs, its
activations from its forward to its backward, and with one micro-batch per step its gradients only from its own
backward on (the runtime frees gradients at each step's start). Korthikanti et al. 2022 (Sec. 4, "the memory peak
is at the start of the backward") and ZeRO (Rajbhandari et al. 2020, Sec. 5) reason about the same moments.

A step runs every module's forward in data-flow order (encoders, then the LLM) and the backwards in reverse. Each
module's work has three moments that bound everything in between (activations fall and gradients grow linearly
through a backward, so a backward's maximum is at one of its ends):

* ``forward``: its forward and loss, up to the start of its backward: its activations, its forward transients;
* ``backward_start``: the start of its backward, the heavier of two moments: the loss's backward (every
  activation, the loss's gradients) and its last block's backward right after (the log-softmax freed, the
  block's backward transients: ZeRO-3 gathers, the re-created block of full recomputation);
* ``backward_end``: its backward's last block: its gradients (all of them), its backward transients, and the
  activations of the micro-batches still in flight behind it (a disjoint 1F1B stage).

Every quantity is one module's, so a phase's total is a sum over modules and the CP-SAT model keeps one linear
memory constraint per phase.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

from planner.cost.results import MemoryBreakdown, ModuleCost
from planner.contract.models import ENCODER_MODULES

PhaseKind = Literal["forward", "backward_start", "backward_end"]
PHASE_KINDS: tuple[PhaseKind, ...] = ("forward", "backward_start", "backward_end")


@dataclass(frozen=True)
class Phase:
    """One moment of a step: a module's forward, or the start or end of its backward."""

    module: str
    kind: PhaseKind

    @property
    def name(self) -> str:
        """``llm forward``, ``vision backward end``."""
        return f"{self.module} {self.kind.replace('_', ' ')}"


def data_flow_order(modules: Sequence[str]) -> list[str]:
    """Encoders in the given order, then the LLM (the order the forwards run in)."""
    return [m for m in modules if m in ENCODER_MODULES] + [m for m in modules if m not in ENCODER_MODULES]


def step_phases(modules: Sequence[str]) -> tuple[Phase, ...]:
    """Every phase of a step over ``modules`` (in data-flow order), in execution order."""
    forwards = [Phase(m, "forward") for m in modules]
    backwards = [Phase(m, kind) for m in reversed(modules) for kind in ("backward_start", "backward_end")]
    return tuple(forwards + backwards)


def alive(cost: ModuleCost, position: int, phase: Phase, phase_position: int) -> MemoryBreakdown:
    """What ``cost``'s module (``position`` in data-flow order) holds during ``phase`` (whose module is at
    ``phase_position``). Weights and optimizer states always; gradients always when the step has several
    micro-batches (they accumulate), else once the module's backward has run (its end, for its own phases);
    activations from its forward until its backward; transients only in its own phases; a pipeline stage's receive
    buffers always. A pipelined module
    holds what its heaviest pipeline rank holds at that moment (the other modules are the same on every GPU, so
    the GPU's total is the largest there)."""
    held = max((_held(c, position, phase.kind, phase_position) for c in cost.stage_costs or (cost,)), key=sum)
    return MemoryBreakdown(**dict(zip(("weights", "gradients", "optimizer", "activations", "buffers"), held)),
                           overhead=0)


def alive_bytes(cost: ModuleCost, position: int, kind: PhaseKind, phase_position: int) -> int:
    """``alive(...).total`` for a phase of this ``kind``, without building the breakdown (the candidates' hot
    path)."""
    return max(sum(_held(c, position, kind, phase_position)) for c in cost.stage_costs or (cost,))


def _held(cost: ModuleCost, position: int, kind: PhaseKind, phase_position: int) -> tuple[int, int, int, int, int]:
    """(weights, gradients, optimizer states, activations, buffers) of one pipeline rank (or an unpipelined
    module) in a phase of ``kind`` (``alive``)."""
    own = position == phase_position
    several = cost.strategy.grad_accum > 1
    if kind == "forward":
        has_gradients = several
        activations = cost.activations_bytes if position <= phase_position else 0
        buffers = cost.forward_buffers_bytes if own else 0
    else:
        backward_done = position > phase_position or (own and kind == "backward_end")
        has_gradients = several or backward_done
        activations, buffers = 0, 0
        if position < phase_position:
            activations = cost.activations_bytes
        elif own and kind == "backward_start":
            at_loss = (cost.activations_bytes, cost.loss_backward_buffers_bytes)
            at_last_block = (cost.activations_bytes - cost.loss_saved_bytes, cost.backward_buffers_bytes)
            activations, buffers = max(at_loss, at_last_block, key=sum)
        elif own:
            activations = cost.activations_bytes - cost.activations_per_micro_batch_bytes
            buffers = cost.backward_buffers_bytes
    gradients = cost.gradients_bytes if has_gradients else 0
    return cost.weights_bytes, gradients, cost.optimizer_bytes, activations, buffers + cost.receive_buffers_bytes


def own_phases(cost: ModuleCost) -> tuple[MemoryBreakdown, ...]:
    """The module's memory in each of its own phases, alone on its GPUs (a disjoint group)."""
    return tuple(alive(cost, 0, Phase(cost.module, kind), 0) for kind in PHASE_KINDS)


def own_peak_bytes(cost: ModuleCost) -> int:
    """The largest total of ``own_phases``."""
    return max(alive_bytes(cost, 0, kind, 0) for kind in PHASE_KINDS)
