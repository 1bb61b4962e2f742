"""The predicted step as a Chrome trace (``plan --trace``): what each GPU does when, as the cost model prices it.

The trace is the Chrome trace event format that Perfetto (ui.perfetto.dev) and chrome://tracing open: ``X``
(complete) events with ``ts`` / ``dur`` in microseconds, ``pid`` a global rank, ``tid`` a lane (``LANES``:
compute, communication, host), ``args.predicted_s`` the span's seconds; ``M`` events name the ranks and lanes.
``runtime.observability.trace`` writes the measured steps of ``python -m runtime --trace`` in the same format.

It is drawn from the cost model's own terms of the plan (``planner.cost.Estimate``), the ones its step time sums,
so the trace ends at the plan's predicted step time; it is not a replay of a schedule. Ranks doing the same work
are drawn once: one rank per GPU group (disjoint: the LLM's, each encoder's; colocated: all GPUs), one per pipeline
stage, named with the ranks it stands for.

* A micro-batch of a module: its forward compute, then the forward's share of its layer collectives (TP, Ulysses
  all-to-alls, ring CP, EP dispatch) and of its transfers (hand-off, pipeline sends); its backward: recomputation,
  backward compute (zero-bubble: input and weight gradients apart), then the rest of the collectives and transfers.
  Collectives and compute are priced as exposed (they add up), so they follow each other here.
* Colocated: each micro-batch runs the encoders' forwards, the LLM's forward and backward, the encoders' backwards
  (the runtime's order); disjoint: the encoder group runs two micro-batches ahead, then alternates backward and
  forward, and the LLM group runs each micro-batch once its hand-off arrived (``planner.cost.pipeline``'s critical
  paths, exact for that order).
* A pipelined LLM runs every micro-batch once the encoders' forwards are done, the encoders' backwards after it.
  Each stage holds its micro-batches in 1F1B order (warm-up forwards, one forward one backward, cool-down
  backwards), back to back at its own speed, after the first micro-batch's forward has crossed the stages before
  it (over ``virtual_stages``); the block lasts the priced ``m x slowest stage + bubble``, so the gaps before and
  after a stage's work are its bubble. A micro-batch's model chunks (interleaved schedules) are drawn as one span.
* Then each module's exposed DP/ZeRO communication and optimizer step (disjoint groups at once: the gradient clip
  takes every module's norm), then the step's fixed overhead on the host lane.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from planner.cost import CostAssumptions, Estimate, ModuleCost, estimate
from planner.cost.phases import data_flow_order
from planner.cost.rank_cost import backward_mode, collective_passes, transfer_passes
from planner.contract.models import ModelSpec
from planner.problem import Problem
from planner.contract.schema import ZERO_BUBBLE_SCHEDULES, Plan
from planner.contract.strategy import Strategy, strategy_of
from planner.contract.trace_format import LANES, US, chrome_trace

_COLLECTIVES = (("tp_comm_s", "TP"), ("sp_comm_s", "SP all-to-all"), ("cp_comm_s", "CP ring"),
                ("ep_comm_s", "EP all-to-all"))
_TRANSFERS = (("handoff_s", "hand-off"), ("pp_comm_s", "PP send/recv"))


@dataclass(frozen=True)
class Part:
    """A span of one micro-batch's work before it is placed in time."""

    name: str
    lane: str
    seconds: float


def micro_batch_parts(cost: ModuleCost, backward: str, zero_bubble: bool = False) -> tuple[list[Part], list[Part]]:
    """(forward parts, backward parts) of one micro-batch of ``cost`` (a module, or one pipeline rank of it) whose
    backward mode is ``backward`` (``planner.cost.rank_cost.backward_mode``); they sum to its ``per_micro_batch_s``,
    the forward ones to its ``forward_per_micro_batch_s`` (the shares of ``collective_passes`` and
    ``transfer_passes``)."""
    m, name = cost.strategy.grad_accum, cost.module
    passes = collective_passes(backward, cost.strategy.recompute)
    recompute_share = 1 / passes if cost.strategy.recompute == "full" and backward != "none" else 0.0
    collectives = [(label, getattr(cost, field) / m) for field, label in _COLLECTIVES]
    transfers = [(label, getattr(cost, field) / m) for field, label in _TRANSFERS]
    share = 1 / transfer_passes(backward)
    forward = [Part(f"{name} forward", "compute", cost.forward_s / m)]
    forward += [Part(f"{name} {label} (forward)", "communication", t / passes) for label, t in collectives]
    forward += [Part(f"{name} {label}", "communication", t * share) for label, t in transfers]
    backward_parts = [Part(f"{name} recompute", "compute", cost.recompute_s / m)]
    backward_parts += [Part(f"{name} {label} (recompute)", "communication", t * recompute_share)
                       for label, t in collectives]
    weights = cost.weight_grad_per_micro_batch_s if zero_bubble else 0.0
    backward_parts.append(Part(f"{name} backward", "compute", cost.backward_s / m - weights))
    backward_parts.append(Part(f"{name} backward (weights, deferred)", "compute", weights))
    backward_parts += [Part(f"{name} {label} (backward)", "communication", t * (1 - 1 / passes - recompute_share))
                       for label, t in collectives]
    backward_parts += [Part(f"{name} {label} (gradient)", "communication", t * (1 - share)) for label, t in transfers]
    return [p for p in forward if p.seconds > 0], [p for p in backward_parts if p.seconds > 0]


class _Timeline:
    """Trace events placed rank by rank."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def put(self, pid: int, start: float, parts: Iterable[Part], **args: Any) -> float:
        """``parts`` one after another from ``start`` (seconds) on rank ``pid``; returns where they end."""
        for part in parts:
            self.events.append({"name": part.name, "ph": "X", "pid": pid, "tid": LANES[part.lane],
                                "ts": start * US, "dur": part.seconds * US, "cat": part.lane,
                                "args": {"predicted_s": part.seconds, **args}})
            start += part.seconds
        return start


def predicted_trace(result: Estimate, model: ModelSpec, assumptions: CostAssumptions) -> dict[str, Any]:
    """The Chrome trace of one step of ``result`` (the cost of a strategy of ``model`` under ``assumptions``)."""
    costs = result.modules
    order = data_flow_order(list(costs))
    encoders, llm = order[:-1], costs["llm"]
    backward = {name: backward_mode(model, name) for name in costs}
    parts = {name: micro_batch_parts(c, backward[name]) for name, c in costs.items()}
    firsts = Strategy(placement=result.placement, modules={n: c.strategy for n, c in costs.items()}).first_ranks()
    colocated, m, s = result.placement == "colocated", llm.strategy.grad_accum, llm.strategy
    llm_pids = [firsts["llm"] + k * s.stage_gpus for k in range(s.pp)]
    # the ranks running the encoders: on each LLM rank drawn (colocated), or each encoder's first rank
    lanes = [{e: pid for e in encoders} for pid in llm_pids] if colocated else [{e: firsts[e] for e in encoders}]
    timeline = _Timeline()
    if llm.stage_costs:
        end = _pipelined(timeline, llm, parts, backward["llm"], encoders, lanes, llm_pids)
    elif colocated:
        end = _colocated(timeline, parts, order, llm_pids[0], m)
    else:
        end = _disjoint(timeline, parts, encoders, lanes[0], llm_pids[0], m)
    stages = llm.rank_costs() or (llm,)
    tails: dict[int, list[ModuleCost]] = {pid: [] for pid in {*llm_pids, *(p for lane in lanes for p in lane.values())}}
    for lane in lanes:
        for e, pid in lane.items():
            tails[pid].append(costs[e])
    for pid, stage in zip(llm_pids, stages):
        tails[pid].append(stage)
    # colocated: one module's tail after another's (each its longest pipeline rank's); disjoint: the groups at once
    tail = (sum if colocated else max)(c.step_tail_s for c in costs.values())
    for pid, held in tails.items():
        timeline.put(pid, end, [p for c in held for p in (
            Part(f"{c.module} DP/ZeRO sync (exposed)", "communication", c.dp_comm_s),
            Part(f"{c.module} optimizer", "compute", c.optimizer_s)) if p.seconds > 0])
        if assumptions.step_overhead_s > 0:
            timeline.put(pid, end + tail, [Part("step overhead", "host", assumptions.step_overhead_s)])
    return chrome_trace(timeline.events, _rank_names(result, firsts, llm_pids, colocated), kind="predicted",
                        step_time_s=result.step_time_s)


def _colocated(timeline: _Timeline, parts: Mapping[str, tuple[list[Part], list[Part]]], order: list[str],
               pid: int, m: int) -> float:
    """Every micro-batch through every module on the one rank drawn; returns the end."""
    now, encoders = 0.0, order[:-1]
    for j in range(m):
        for e in encoders:
            now = timeline.put(pid, now, parts[e][0], micro_batch=j)
        now = timeline.put(pid, now, parts["llm"][0] + parts["llm"][1], micro_batch=j)
        for e in reversed(encoders):
            now = timeline.put(pid, now, parts[e][1], micro_batch=j)
    return now


def _disjoint(timeline: _Timeline, parts: Mapping[str, tuple[list[Part], list[Part]]], encoders: list[str],
              lane: Mapping[str, int], llm_pid: int, m: int) -> float:
    """The runtime's disjoint order (``planner.cost.pipeline``): the encoders as one stage (in turn) two micro-batches
    ahead, then a backward and a forward in turn; the LLM on each micro-batch once its forward is done. Returns the
    end of the last encoder backward."""
    encoder_free, llm_free, llm_done = 0.0, 0.0, {}

    def forward(j: int) -> None:
        nonlocal encoder_free, llm_free
        for e in encoders:
            encoder_free = timeline.put(lane[e], encoder_free, parts[e][0], micro_batch=j)
        llm_free = llm_done[j] = timeline.put(llm_pid, max(llm_free, encoder_free),
                                              parts["llm"][0] + parts["llm"][1], micro_batch=j)

    for j in range(min(2, m)):
        forward(j)
    for j in range(m):
        encoder_free = max(encoder_free, llm_done[j])
        for e in reversed(encoders):
            encoder_free = timeline.put(lane[e], encoder_free, parts[e][1], micro_batch=j)
        if j + 2 < m:
            forward(j + 2)
    return encoder_free


def _pipelined(timeline: _Timeline, llm: ModuleCost, parts: Mapping[str, tuple[list[Part], list[Part]]],
               backward: str, encoders: list[str], lanes: list[Mapping[str, int]], llm_pids: list[int]) -> float:
    """Every encoder forward, the LLM's pipeline over every micro-batch (the priced block, module docstring), every
    encoder backward; returns the end."""
    s = llm.strategy
    m, zero_bubble = s.grad_accum, s.pp_schedule in ZERO_BUBBLE_SCHEDULES
    start = 0.0
    for lane in lanes:
        start = 0.0
        for j in range(m):
            for e in encoders:
                start = timeline.put(lane[e], start, parts[e][0], micro_batch=j)
    block, fill = llm.micro_batches_s, 0.0
    for k, (pid, stage) in enumerate(zip(llm_pids, llm.rank_costs())):
        forward, backward_parts = micro_batch_parts(stage, backward, zero_bubble)
        warmup = min(s.pp - 1 - k, m)
        order = [(forward, j) for j in range(warmup)]
        order += [pair for j in range(m - warmup) for pair in ((forward, warmup + j), (backward_parts, j))]
        order += [(backward_parts, j) for j in range(m - warmup, m)]
        now = start + min(fill, block - m * stage.per_micro_batch_s)
        for work, j in order:
            now = timeline.put(pid, now, work, micro_batch=j, stage=k)
        fill += stage.forward_per_micro_batch_s / s.virtual_stages
    end = start + block
    for lane in lanes:
        now = end
        for j in range(m):
            for e in reversed(encoders):
                now = timeline.put(lane[e], now, parts[e][1], micro_batch=j)
    return now


def _ranks(first: int, count: int) -> str:
    return f"rank {first}" if count == 1 else f"ranks {first}-{first + count - 1}"


def _rank_names(result: Estimate, firsts: Mapping[str, int], llm_pids: list[int], colocated: bool) -> dict[int, str]:
    """Each rank drawn, named with the ranks it stands for."""
    llm = result.modules["llm"].strategy
    stage = [f" stage {k}" if llm.pp > 1 else "" for k in range(llm.pp)]
    if colocated:
        modules = ", ".join(result.modules)
        return {pid: f"rank {pid}: {modules}{stage[k]} ({_ranks(pid, llm.stage_gpus)})"
                for k, pid in enumerate(llm_pids)}
    names = {pid: f"rank {pid}: llm{stage[k]} ({_ranks(pid, llm.stage_gpus)})" for k, pid in enumerate(llm_pids)}
    names.update({firsts[e]: f"rank {firsts[e]}: {e} ({_ranks(firsts[e], c.strategy.gpus)})"
                  for e, c in result.modules.items() if e != "llm"})
    return names


def plan_trace(problem: Problem, plan: Plan) -> dict[str, Any]:
    """The predicted trace of ``plan``, re-costed on ``problem`` (the one it was planned on).

    Raises:
        ValueError: ``problem`` costs the plan's strategy at another step time than the plan records.
    """
    result = estimate(problem.model, problem.cluster, problem.workload, strategy_of(plan), problem.assumptions,
                      problem.layer_costs)
    if abs(result.step_time_s - plan.predicted.step_time_s) > 1e-9 * max(1.0, plan.predicted.step_time_s):
        raise ValueError(f"the plan's strategy re-costs at {result.step_time_s:.6g} s, not the plan's "
                         f"{plan.predicted.step_time_s:.6g} s: its inputs differ from the plan's")
    return predicted_trace(result, problem.model, problem.assumptions)
