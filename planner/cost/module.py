"""Analytical per-module cost (``module_cost``): one module under one strategy, per GPU, for one optimizer step; a
pipelined module (pp > 1) by planner.cost.pipeline, every other by planner.cost.rank_cost."""

from __future__ import annotations

from dataclasses import replace

from planner.cost.assumptions import DEFAULT_ASSUMPTIONS, CostAssumptions
from planner.cost.layer_costs import LayerCostSource
from planner.cost.pipeline import pipelined_cost
from planner.cost import balance  # a module: planner.cost.balance imports planner.cost
from planner.cost.rank_cost import (
    axes_within_node,
    flops_per_sample,
    handoff_per_micro_batch,
    layer_axes_within_node,
    layer_sums,
    module_static,
    rank_cost,
    ring_floor_s,
    with_measured_collectives,
)
from planner.cost.results import ModuleCost
from planner.contract.hardware import Cluster
from planner.contract.models import ModelSpec
from planner.contract.strategy import ModuleStrategy, Placement, Precision
from planner.contract.workload import Workload, pipeline_padded


def module_cost(
    model: ModelSpec,
    module: str,
    cluster: Cluster,
    workload: Workload,
    strategy: ModuleStrategy,
    *,
    placement: Placement,
    precision: Precision,
    first_rank: int,
    num_stages: int = 1,
    stage_index: int = 0,
    feeds_pipeline: bool = False,
    assumptions: CostAssumptions = DEFAULT_ASSUMPTIONS,
    layer_costs: LayerCostSource | None = None,
) -> ModuleCost:
    """Cost of ``module`` under ``strategy``, per GPU of the module, for one optimizer step.

    Args:
        model: The model.
        module: Which of its modules.
        cluster: Devices and nodes.
        workload: Sample shape and global batch.
        strategy: The module's degrees.
        placement: colocated (hand-off is a re-layout) or disjoint (hand-off is point-to-point).
        precision: bf16_mixed or bf16_pure.
        first_rank: Global rank of the module's rank 0 (``Strategy.first_ranks()``); decides the links.
        num_stages: Stages of the disjoint chain (disjoint: 2, colocated: 1).
        stage_index: This module's stage in that chain (encoders 0, LLM num_stages - 1).
        feeds_pipeline: (encoder) the LLM is pipelined (pp > 1): its schedule takes every micro-batch at once, so
            the encoder runs all forwards before it and all backwards after it, holding every micro-batch's
            activations in between.
        assumptions: Cost-model knobs.
        layer_costs: Optional measured per-layer source; analytical where it returns None.

    Composes per-layer terms, model states, DP/ZeRO communication, the optimizer step and the hand-off; with
    pp > 1, one such cost per pipeline rank (``pipelined_cost``), a dataset's packs padded to their budget
    (``pipeline_padded``).
    Cost: ~20 us per call when the (tp, sp, cp, micro_batch, recompute) sharding was costed before for the same
    model/workload/cluster/assumptions OBJECTS (memoised by identity: reuse them across calls), ~70 us when not.
    """
    options = dict(placement=placement, precision=precision, first_rank=first_rank, num_stages=num_stages,
                   stage_index=stage_index, assumptions=assumptions, layer_costs=layer_costs)
    if strategy.pp > 1:  # every pack padded to the budget: the pipeline's rows are alike
        workload = pipeline_padded(workload)
    balanced, imbalance = (workload, None) if strategy.pp > 1 else balance.balanced_workload(
        workload, model, module, strategy.dp, strategy.micro_batch, strategy.grad_accum, cluster.device, assumptions)
    cost = _module_cost(model, module, cluster, balanced, strategy, **options)
    if imbalance is not None:  # model FLOPs are the mean replica's: the busiest one's extra work is others' waiting
        mean = module_static(model, module, workload, cluster, assumptions)
        cost = replace(cost, imbalance=imbalance, flops_per_step=flops_per_sample(mean) * strategy.samples_per_step)
    heaviest = workload.heaviest() if strategy.pp > 1 else balance.heaviest_replica_workload(
        workload, model, module, strategy.dp, strategy.micro_batch, strategy.grad_accum, cluster.device, assumptions)
    if heaviest is not None:
        heavy = _module_cost(model, module, cluster, heaviest, strategy, chunk_layers=cost.chunk_layers, **options)
        cost = _with_heavy_memory(cost, heavy)
    return feeding_pipeline(cost) if feeds_pipeline else cost


def per_micro_batch_floor(
    model: ModelSpec, module: str, cluster: Cluster, workload: Workload, strategy: ModuleStrategy, *,
    first_rank: int, assumptions: CostAssumptions = DEFAULT_ASSUMPTIONS, layer_costs: LayerCostSource | None = None,
) -> tuple[float, float]:
    """(seconds, saved bytes) of one micro-batch of ``strategy`` (pp = 1) through ``module``'s layers: at most
    ``module_cost``'s ``per_micro_batch_s`` (which adds the hand-off) and ``activations_per_micro_batch_bytes`` (which
    adds injected features and takes a dataset's heaviest pack) -- the layer sums alone, memoised by the sharding, so
    that the search bounds a strategy at a fraction of a costing (``candidates.context_parallel_floor``)."""
    s = strategy
    balanced, _ = balance.balanced_workload(workload, model, module, s.dp, s.micro_batch, s.grad_accum, cluster.device,
                                            assumptions)
    static = with_measured_collectives(module_static(model, module, balanced, cluster, assumptions), s, layer_costs)
    within = layer_axes_within_node(axes_within_node(s, first_rank, cluster.devices_per_node))
    sums = layer_sums(static, s, within, layer_costs, static.spec.layers)
    return sums.total_s, sums.saved_bytes


def ring_share_floor(
    model: ModelSpec, module: str, cluster: Cluster, workload: Workload, strategy: ModuleStrategy, *,
    first_rank: int, assumptions: CostAssumptions = DEFAULT_ASSUMPTIONS,
) -> float:
    """Seconds, at most ``per_micro_batch_floor``'s, of one micro-batch of a ring context-parallel ``strategy``
    under the analytical model: the same strategy's layer sums without the ring (cp = 1, the same links for its
    other axes), divided by cp. A rank's share of every GEMM, attention block and memory-bound op of a sequence split
    over cp ranks is at least 1/cp of the whole at no higher efficiency (``matmul_efficiency`` and
    ``attention_efficiency`` rise with the size), its host dispatch at least 1/cp of the same calls, and the ring
    only adds passes and transfers; and at least what the ring itself takes (``ring_floor_s``: its calls and
    collectives, which grow with cp). The layer sums drop cp, the axis with the most values (a cheap first bound
    for the search: ``candidates.ring_share_floor_terms``)."""
    s = strategy
    balanced, _ = balance.balanced_workload(workload, model, module, s.dp, s.micro_batch, s.grad_accum, cluster.device,
                                            assumptions)
    static = module_static(model, module, balanced, cluster, assumptions)
    within = layer_axes_within_node(axes_within_node(s, first_rank, cluster.devices_per_node))
    key = ("ring_share_floor", s.tp, s.sp, s.cp, s.ep, s.micro_batch, s.recompute, within)
    floor = static.sums.get(key)
    if floor is None:
        sums = layer_sums(static, replace(s, cp=1), within[:2] + (True,) + within[3:], None, static.spec.layers)
        floor = static.sums[key] = max(sums.total_s / s.cp,
                                       ring_floor_s(static, s, tuple(static.links[not w] for w in within)))
    return floor


def feeding_pipeline(cost: ModuleCost) -> ModuleCost:
    """An encoder's ``cost`` in a plan whose LLM is pipelined: the same, but holding every micro-batch's activations
    (it runs all of the step's forwards before the LLM's schedule and all backwards after it)."""
    return replace(cost, in_flight_micro_batches=cost.strategy.grad_accum)


def _with_heavy_memory(cost: ModuleCost, heavy: ModuleCost) -> ModuleCost:
    """``cost`` with the memory that grows with a micro-batch's tokens taken from ``heavy`` (per pipeline rank)."""
    stages = tuple(_with_heavy_memory(c, h) for c, h in zip(cost.stage_costs, heavy.stage_costs, strict=True))
    return replace(cost, stage_costs=stages, **{name: getattr(heavy, name) for name in PACK_MEMORY_FIELDS})


PACK_MEMORY_FIELDS = ("forward_buffers_bytes", "backward_buffers_bytes", "loss_backward_buffers_bytes",
                      "loss_saved_bytes", "activations_per_micro_batch_bytes")
"""ModuleCost fields that grow with a micro-batch's tokens: for a dataset plan they are those of the heaviest
micro-batch a replica holds (every micro-batch of the step must fit; ``planner.cost.balance.heaviest_replica_workload``),
the times the mean pack's."""


def _module_cost(
    model: ModelSpec, module: str, cluster: Cluster, workload: Workload, strategy: ModuleStrategy, *,
    placement: Placement, precision: Precision, first_rank: int, num_stages: int, stage_index: int,
    assumptions: CostAssumptions, layer_costs: LayerCostSource | None, chunk_layers: tuple[int, ...] | None = None,
) -> ModuleCost:
    """``module_cost`` of one workload; ``chunk_layers``: a pipelined module's layer split, when another workload
    (the mean pack's, whose memory this heaviest pack's cost gives) decided it."""
    s = strategy
    static = with_measured_collectives(module_static(model, module, workload, cluster, assumptions), s, layer_costs)
    if s.pp > 1:
        return pipelined_cost(static, s, precision=precision, first_rank=first_rank, layer_costs=layer_costs,
                               chunk_layers=chunk_layers)
    in_flight = 1 if placement == "colocated" else min(num_stages - stage_index, s.grad_accum)
    sp_link = static.links[not axes_within_node(s, first_rank, cluster.devices_per_node)[1]]
    handoff = handoff_per_micro_batch(static, s, placement=placement, first_rank=first_rank, sp_link=sp_link)
    return rank_cost(static, s, static.spec.layers, precision=precision, first_rank=first_rank,
                      layer_costs=layer_costs, in_flight_chunks=in_flight, handoff_s=handoff, pp_comm_s=0.0)
