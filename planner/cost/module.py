"""Analytical per-module cost: composes the per-layer formulas into a ModuleCost.

Per-call work is kept small because the solver costs thousands of candidates: everything that depends only
on (model, module, workload, assumptions) is computed once (``_Static``), and per-layer terms are memoised by
the sharding that determines them (tp, sp, cp, micro-batch, recompute, links).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping

from planner.cost.assumptions import DEFAULT_ASSUMPTIONS, CostAssumptions
from planner.cost.compute import bucket_copy_time, optimizer_pass_time
from planner.cost.comm import (
    Link,
    all_gather_time,
    axis_within_node,
    link,
    p2p_time,
    pipelined_zero3_gather_time,
    zero_comm_time,
)
from planner.cost.layer_costs import ANALYTICAL, MEASURED, LayerCostSource, LayerMeasurement
from planner.cost.layers import Shard, layer_terms
from planner.cost.op_counts import LAYER_OPS
from planner.cost.phases import own_peak_bytes
from planner.cost.pipeline import balanced_chunk_layers, in_flight_chunks, pipeline_bubble_time
from planner.cost.memory import (
    FSDP_BLOCK_KINDS,
    bucket_bytes,
    layer_params_per_rank,
    model_state_bytes,
    pipelined_fsdp_state_bytes,
    zero3_gather_bytes,
)
from planner.cost.results import ModuleCost
from planner.cost.times import PassTimes
from planner.hardware import Cluster
from planner.models import ENCODER_MODULES, LayerSpec, ModelSpec, ModuleSpec
from planner.schema import ZERO_BUBBLE_SCHEDULES
from planner.strategy import ModuleStrategy, Placement, Precision
from planner.workload import ModuleTokens, Workload, module_tokens, pipeline_padded

_UNUSED_LINK = Link(bandwidth=1.0, latency=0.0)


def backward_mode(model: ModelSpec, module: str) -> str:
    """``full`` for a trainable module; ``input`` for a frozen one fed by a trainable module (it must pass
    input gradients upstream); ``none`` for a frozen module with nothing trainable upstream (forward only).
    Encoders are first in the data flow; the LLM's upstream are the encoders."""
    spec = model.module(module)
    if not spec.frozen:
        return "full"
    if module in ENCODER_MODULES:
        return "none"
    upstream_trainable = any(not m.frozen for m in model.modules if m.name in ENCODER_MODULES)
    return "input" if upstream_trainable else "none"


def segment_stats(tokens: ModuleTokens) -> tuple[float, float]:
    """(token-weighted mean segment length, equivalent segment count) with count * len^2 = sum(len^2) and
    count * len = sum(len), so attention FLOPs and scores of unequal segments are reproduced exactly."""
    total = tokens.tokens if tokens.segment_squares is not None else sum(tokens.segments)
    squares = tokens.squared_segments
    if total == 0 or squares == 0:
        return 0.0, 0.0
    return squares / total, total * total / squares


@dataclass(eq=False)
class _Static:
    """What one (model, module, workload, device, assumptions) fixes, plus the memo of layer terms."""

    model: ModelSpec
    workload: Workload
    cluster: Cluster
    assumptions: CostAssumptions
    spec: ModuleSpec
    tokens: ModuleTokens
    segment_tokens: float
    segments: float
    backward: str
    handoff_bytes_per_sample: float
    links: tuple[Link, Link]
    """(NVLink, NIC) with bus efficiency, indexed by ``not within_node``."""
    analytical_sources: Mapping[str, str]
    """Sources when every number is analytical."""
    sums: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    chunks: dict = field(default_factory=dict)
    """Memo of balanced pipeline chunk splits (analytical model only)."""
    flops_per_sample: float | None = None


_STATIC: dict[tuple, _Static] = {}
_STATIC_LIMIT = 256


def _static(
    model: ModelSpec, module: str, workload: Workload, cluster: Cluster, assumptions: CostAssumptions
) -> _Static:
    """The memoised static data of a module (keyed by object identity; the entry holds the objects)."""
    key = (id(model), module, id(workload), id(cluster), id(assumptions))
    entry = _STATIC.get(key)
    same = entry is not None and entry.model is model and entry.workload is workload and entry.cluster is cluster
    if same and entry.assumptions is assumptions:
        return entry
    if len(_STATIC) >= _STATIC_LIMIT:
        _STATIC.clear()
    spec = model.module(module)
    tokens = module_tokens(workload, model)[module]
    seg_len, seg_count = segment_stats(tokens)
    out_width = spec.layers[-1].out_features or spec.layers[-1].hidden_size
    entry = _Static(
        model=model,
        workload=workload,
        cluster=cluster,
        assumptions=assumptions,
        spec=spec,
        tokens=tokens,
        segment_tokens=seg_len,
        segments=seg_count,
        backward=backward_mode(model, module),
        handoff_bytes_per_sample=tokens.output_tokens * out_width * assumptions.activation_bytes,
        links=(
            link(cluster, assumptions, within_node=True),
            link(cluster, assumptions, within_node=False),
        ),
        analytical_sources=MappingProxyType(
            {
                **{f"{layer.name}.{what}": ANALYTICAL for layer in spec.layers for what in ("time", "activations")},
                "collectives": ANALYTICAL,
                "optimizer": ANALYTICAL,
                "states": ANALYTICAL,
            }
        ),
    )
    _STATIC[key] = entry
    return entry


def _shard(static: _Static, s: ModuleStrategy, links: tuple[Link, Link, Link], micro_batch: int | None = None) -> Shard:
    """The per-rank view of one micro-batch under strategy ``s``."""
    mb = s.micro_batch if micro_batch is None else micro_batch
    t = static.tokens
    return Shard(
        tp=s.tp,
        sp=s.sp,
        cp=s.cp,
        micro_batch=mb,
        tokens=mb * t.tokens / (s.sp * s.cp),
        segment_tokens=static.segment_tokens,
        segments=static.segments,
        window_tokens=t.tokens / t.windows if t.windows else 0.0,
        windows=float(t.windows),
        recompute=s.recompute,
        backward=static.backward,
        tp_link=links[0],
        sp_link=links[1],
        cp_link=links[2],
        device=static.cluster.device,
        assumptions=static.assumptions,
    )


@dataclass(kw_only=True, frozen=True, slots=True)
class _Sums(PassTimes):
    """Per-micro-batch sums over a module's layers on one rank: their pass times and memory."""

    saved_bytes: float
    forward_buffer_bytes: float
    """The largest forward transient of a layer other than the loss (only one layer runs at a time)."""
    backward_buffer_bytes: float
    """The largest backward transient of a layer other than the loss, with, under full recomputation, the block's
    re-created activations."""
    loss_buffer_bytes: tuple[float, float, float]
    """(forward transient, backward transient, saved log-softmax) of the loss. The runtime forms the loss outside
    the module's forward (as torchtitan does), so its transients are never alive together with the module's ZeRO-3
    gathers or gradient buckets."""
    optimizer_measured_s: float
    """Measured optimizer-step shares of the layers that have one, before ZeRO sharding."""
    optimizer_call_s: float
    """The measured fixed cost of the module's optimizer call (the largest its layers saw)."""
    optimizer_formula_params: float
    """Parameters on this rank (before ZeRO sharding) of the layers whose optimizer step is left to the formula."""
    optimizer_formula_tensors: float
    """... and their parameter tensors (ZeRO shards each tensor, so their count does not shrink)."""
    weight_grad_s: float
    """Of ``backward_s``, the weight-gradient passes (``planner.cost.layers.weight_gradient_time``; a measured
    backward keeps the analytical share)."""
    sources: Mapping[str, str]


def _layer_sums(
    static: _Static, s: ModuleStrategy, links: tuple[Link, Link, Link], layer_costs: LayerCostSource | None,
    layers: tuple[LayerSpec, ...], sharding: tuple | None = None,
) -> _Sums:
    """Sum the layers' terms for one micro-batch; measured numbers replace analytical ones where available.
    A measurement that includes the layer's TP/SP collectives replaces their analytical time too (source
    ``<layer>.tp_sp_collectives: measured``).

    Buffers: see ``_Sums.forward_buffer_bytes`` and ``backward_buffer_bytes``. ``sharding`` (analytical model):
    the key under which one instance's terms of each layer are memoised (pipeline stages sum different counts of
    the same layers).
    """
    shard = _shard(static, s, links)
    times = PassTimes()
    saved = optimizer_s = optimizer_call = 0.0
    full = s.recompute == "full"
    forward_buffers = backward_buffers = 0.0
    loss_buffers = (0.0, 0.0, 0.0)
    formula_params = formula_tensors = weight_grad = 0.0
    sources = dict(static.analytical_sources)
    optimizer_measured = bool(layers)
    for layer in layers:
        t = _instance_terms(static, layer, shard, sharding)
        layer_times, act = t.pass_times(), t.saved_bytes
        measured = None if layer_costs is None else _measure(layer_costs, static, layer, s)
        if measured is not None:
            layer_times = replace(layer_times, forward_s=measured.forward_s, backward_s=measured.backward_s,
                                  recompute_s=measured.recompute_s)
            sources[f"{layer.name}.time"] = MEASURED
            if measured.includes_comm:  # timed as run: its TP/SP collectives are inside the pass times
                layer_times = replace(layer_times, tp_comm_s=0.0, sp_comm_s=0.0)
                sources[f"{layer.name}.tp_sp_collectives"] = MEASURED
            if measured.activation_bytes is not None:
                act = measured.activation_bytes
                sources[f"{layer.name}.activations"] = MEASURED
        n = layer.count
        if measured is not None and measured.optimizer_s is not None:
            optimizer_s += n * measured.optimizer_s
            optimizer_call = max(optimizer_call, measured.optimizer_call_s)
        else:
            formula_params += n * layer_params_per_rank(layer, s.tp)
            formula_tensors += n * LAYER_OPS[layer.kind].param_tensors
            optimizer_measured = False
        times = times.plus(layer_times, n)
        if t.backward_s > 0:
            weight_grad += n * t.weight_grad_s * layer_times.backward_s / t.backward_s
        saved += n * act
        if layer.kind == "lm_head":
            loss_buffers = (t.buffer_bytes, t.backward_buffer_bytes, t.loss_saved_bytes)
        else:
            forward_buffers = max(forward_buffers, t.buffer_bytes)
            backward_buffers = max(backward_buffers, t.backward_buffer_bytes + (t.working_bytes if full else 0.0))
    if optimizer_measured:
        sources["optimizer"] = MEASURED
    final_sources = static.analytical_sources if layer_costs is None else MappingProxyType(sources)
    return _Sums(**times.terms(), saved_bytes=saved, forward_buffer_bytes=forward_buffers,
                 backward_buffer_bytes=backward_buffers, loss_buffer_bytes=loss_buffers,
                 optimizer_measured_s=optimizer_s, optimizer_call_s=optimizer_call,
                 optimizer_formula_params=formula_params, optimizer_formula_tensors=formula_tensors,
                 weight_grad_s=weight_grad, sources=final_sources)


def _measure(
    layer_costs: LayerCostSource, static: _Static, layer: LayerSpec, s: ModuleStrategy
) -> LayerMeasurement | None:
    """Ask the measured source about one layer instance under this sharding."""
    return layer_costs.layer_cost(
        module=static.spec.name,
        layer=layer,
        tp=s.tp,
        sp=s.sp,
        cp=s.cp,
        seq_len=round(static.tokens.tokens),
        tokens_per_rank=round(s.micro_batch * static.tokens.tokens / (s.sp * s.cp)),
        micro_batch=s.micro_batch,
        recompute=s.recompute,
    )


def _sums(
    static: _Static, s: ModuleStrategy, within: tuple[bool, bool, bool], layer_costs: LayerCostSource | None,
    layers: tuple[LayerSpec, ...],
) -> _Sums:
    """Sums over ``layers`` (the module's, or one pipeline stage's), memoised for the analytical model by the
    sharding and the layer counts that determine them."""
    links = tuple(static.links[not w] for w in within)
    if layer_costs is not None:
        return _layer_sums(static, s, links, layer_costs, layers)
    key = (s.tp, s.sp, s.cp, s.micro_batch, s.recompute, within, _counts(layers))
    sums = static.sums.get(key)
    if sums is None:
        sums = static.sums[key] = _layer_sums(static, s, links, None, layers, key[:-1])
    return sums


def _instance_terms(static: _Static, layer: LayerSpec, shard: Shard, sharding: tuple | None):
    """``layer_terms`` of one instance of ``layer``, memoised under ``sharding`` when given."""
    if sharding is None:
        return layer_terms(layer, shard)
    key = (sharding, layer.name)
    terms = static.sums.get(key)
    if terms is None:
        terms = static.sums[key] = layer_terms(layer, shard)
    return terms


def _counts(layers: tuple[LayerSpec, ...]) -> tuple[tuple[str, int], ...]:
    """What identifies a run of a module's layers: (name, count) of each."""
    return tuple((layer.name, layer.count) for layer in layers)


def zero1_gradient_bytes(
    params: float, precision: Precision, *, shards: int, grad_accum: int, assumptions: CostAssumptions
) -> float:
    """Gradient bytes per GPU of a ZeRO-1 module as the runtime runs it (FSDP2 without per-micro-batch
    reduce-scatter): several micro-batches accumulate unsharded gradients in the reduce dtype
    (``CostAssumptions.accumulated_gradient_bytes``); a single one is reduce-scattered during the backward, leaving
    ZeRO-2's ``gradients / shards`` (Rajbhandari et al. 2020, Sec. 5.1, P_os+g)."""
    if grad_accum > 1:
        return params * assumptions.accumulated_gradient_bytes(precision)
    return params * assumptions.bytes_per_param(precision).gradients / shards


def _params_per_rank(static: _Static, tp: int, layers: tuple[LayerSpec, ...]) -> tuple[float, float, float, float]:
    """On one TP rank, of ``layers`` (the module's, or one pipeline stage's): (parameters, largest single layer
    instance, the FSDP root unit's parameters (every layer but the blocks, ``FSDP_BLOCK_KINDS``), largest block
    instance)."""
    key = (tp, _counts(layers))
    cached = static.params.get(key)
    if cached is None:
        per_layer = [layer_params_per_rank(layer, tp) for layer in layers]
        total = sum(p * layer.count for p, layer in zip(per_layer, layers))
        root = sum(p * layer.count for p, layer in zip(per_layer, layers) if layer.kind not in FSDP_BLOCK_KINDS)
        block = max((p for p, layer in zip(per_layer, layers) if layer.kind in FSDP_BLOCK_KINDS), default=0.0)
        cached = static.params[key] = (total, max(per_layer), root, block)
    return cached


def _flops_per_sample(static: _Static) -> float:
    """Model FLOPs (forward + backward, no recomputation, no parallelism) of one sample."""
    if static.flops_per_sample is None:
        base = ModuleStrategy(dp=1)
        links = (_UNUSED_LINK,) * 3
        shard = _shard(static, base, links, micro_batch=1)
        static.flops_per_sample = sum(
            (t.flops + t.backward_flops) * layer.count
            for layer in static.spec.layers
            for t in (layer_terms(layer, shard),)
        )
    return static.flops_per_sample


def handoff_per_micro_batch(
    static: _Static,
    s: ModuleStrategy,
    *,
    placement: Placement,
    first_rank: int,
    sp_link: Link,
) -> float:
    """Seconds one micro-batch spends moving an encoder's output to the LLM's layout and its gradient back.

    Colocated: the output is sharded over the SP group; the LLM needs it whole per DP replica, so it is
    all-gathered within the SP group (ring all-gather, Thakur et al. 2005), and the gradient comes back by
    the dual reduce-scatter of the same size. Disjoint: each encoder rank sends its shard to the LLM group,
    point-to-point over the link joining the groups (Hockney alpha-beta), and receives its gradient back
    likewise unless nothing upstream needs it (frozen encoder). The LLM (rank 0 onward in disjoint
    placement) is the receiver; the link is NVLink only if both groups share one node.
    """
    if static.spec.name == "llm" or static.handoff_bytes_per_sample == 0:
        return 0.0
    per_mb = s.micro_batch * static.handoff_bytes_per_sample
    directions = 2 if static.backward == "full" else 1
    if placement == "colocated":
        return directions * all_gather_time(per_mb, s.sp, sp_link)
    same_node = (first_rank + s.gpus - 1) // static.cluster.devices_per_node == 0
    return directions * p2p_time(per_mb / s.sp, static.links[not same_node])


def _with_measured_collectives(static: _Static, s: ModuleStrategy, layer_costs: LayerCostSource | None) -> _Static:
    """(profiler) ``static`` whose intra-node link answers with the profile's measured collective curves where it
    has them (``collective_time``), and whose sources say "measured" for collectives when the curves cover every
    process group of ``s``. Inter-node links keep the formula (a single-node profile cannot measure them)."""
    curve = getattr(layer_costs, "collective_time", None)
    if curve is None:
        return static
    nvlink, nic = static.links
    groups = [g for g in (s.tp, s.sp, s.cp, s.dp * s.sp * s.cp) if g > 1]
    covered = bool(groups) and all(curve("all_reduce", g, 1.0) is not None for g in groups)
    sources = {**static.analytical_sources, "collectives": MEASURED} if covered else static.analytical_sources
    return replace(static, links=(replace(nvlink, curve=curve), nic), analytical_sources=MappingProxyType(sources))


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
    pp > 1, one such cost per pipeline rank (``_pipelined_cost``), a dataset's packs padded to their budget
    (``pipeline_padded``).
    Cost: ~20 us per call when the (tp, sp, cp, micro_batch, recompute) sharding was costed before for the same
    model/workload/cluster/assumptions OBJECTS (memoised by identity: reuse them across calls), ~70 us when not.
    """
    options = dict(placement=placement, precision=precision, first_rank=first_rank, num_stages=num_stages,
                   stage_index=stage_index, assumptions=assumptions, layer_costs=layer_costs)
    if strategy.pp > 1:
        workload = pipeline_padded(workload)
    cost = _module_cost(model, module, cluster, workload, strategy, **options)
    heaviest = workload.heaviest()
    if heaviest is not None:
        heavy = _module_cost(model, module, cluster, heaviest, strategy, chunk_layers=cost.chunk_layers, **options)
        cost = _with_heavy_memory(cost, heavy)
    return feeding_pipeline(cost) if feeds_pipeline else cost


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
"""ModuleCost fields that grow with a micro-batch's tokens: for a dataset plan they are the heaviest pack's (every
micro-batch of the step must fit), the times the mean pack's."""


def _module_cost(
    model: ModelSpec, module: str, cluster: Cluster, workload: Workload, strategy: ModuleStrategy, *,
    placement: Placement, precision: Precision, first_rank: int, num_stages: int, stage_index: int,
    assumptions: CostAssumptions, layer_costs: LayerCostSource | None, chunk_layers: tuple[int, ...] | None = None,
) -> ModuleCost:
    """``module_cost`` of one workload; ``chunk_layers``: a pipelined module's layer split, when another workload
    (the mean pack's, whose memory this heaviest pack's cost gives) decided it."""
    s = strategy
    static = _with_measured_collectives(_static(model, module, workload, cluster, assumptions), s, layer_costs)
    if s.pp > 1:
        return _pipelined_cost(static, s, precision=precision, first_rank=first_rank, layer_costs=layer_costs,
                               chunk_layers=chunk_layers)
    in_flight = 1 if placement == "colocated" else min(num_stages - stage_index, s.grad_accum)
    sp_link = static.links[not _within_all(s, first_rank, cluster.devices_per_node)[1]]
    handoff = handoff_per_micro_batch(static, s, placement=placement, first_rank=first_rank, sp_link=sp_link)
    return _part_cost(static, s, static.spec.layers, precision=precision, first_rank=first_rank,
                      layer_costs=layer_costs, in_flight_chunks=in_flight, handoff_s=handoff, pp_comm_s=0.0)


def _part_cost(
    static: _Static, s: ModuleStrategy, layers: tuple[LayerSpec, ...], *, precision: Precision, first_rank: int,
    layer_costs: LayerCostSource | None, in_flight_chunks: int, handoff_s: float, pp_comm_s: float,
) -> ModuleCost:
    """The cost on one GPU that runs ``layers`` (all of the module's, or one pipeline rank's chunks) for every
    micro-batch, with ``handoff_s`` and ``pp_comm_s`` of transfers per micro-batch and ``in_flight_chunks``
    micro-batches' (with PP: model chunks') activations alive at its peak."""
    assumptions, cluster = static.assumptions, static.cluster
    within_all = _within_all(s, first_rank, cluster.devices_per_node)
    sums = _sums(static, s, within_all[:3], layer_costs, layers)
    forward_buffers, backward_buffers = sums.forward_buffer_bytes, sums.backward_buffer_bytes

    recipe = assumptions.bytes_per_param(precision)
    params, largest, root, block = _params_per_rank(static, s.tp, layers)
    reduce_group = s.dp * s.cp * s.sp
    shards = reduce_group if assumptions.zero_shards_over_sequence_ranks else s.dp
    trainable = not static.spec.frozen
    weights, grads, optim = model_state_bytes(params, recipe, zero=s.zero, shards=shards, frozen=not trainable)
    if s.zero == 1 and trainable and shards > 1:
        grads = zero1_gradient_bytes(params, precision, shards=shards, grad_accum=s.grad_accum,
                                     assumptions=assumptions)
    # inside a step, torch's schedules neither reduce-scatter gradients nor reshard weights after a backward
    pipelined_fsdp = s.pp > 1 and s.zero >= 2 and shards > 1 and static.backward != "none"
    if pipelined_fsdp:
        weights, grads = pipelined_fsdp_state_bytes(
            params, recipe, accumulated_gradient_bytes=assumptions.accumulated_gradient_bytes(precision),
            frozen=not trainable)
    if s.zero == 3 and shards > 1 and not pipelined_fsdp:
        forward_buffers += zero3_gather_bytes(root, block, recipe, prefetch=assumptions.zero3_prefetch_layers,
                                              frozen=not trainable, backward=False)
        backward_buffers += zero3_gather_bytes(root, block, recipe, prefetch=assumptions.zero3_prefetch_layers,
                                               frozen=not trainable, backward=True)
        bucket = largest * recipe.gradients
    else:
        bucket = bucket_bytes(params * recipe.gradients, assumptions) if trainable and reduce_group > 1 else 0.0
        backward_buffers += bucket
        bucket = min(bucket, assumptions.communication_bucket_bytes)
    forward_buffers = max(forward_buffers, sums.loss_buffer_bytes[0])
    loss_backward_buffers, loss_saved = sums.loss_buffer_bytes[1:]

    dp_comm = zero_comm_time(
        zero=1 if pipelined_fsdp else s.zero,
        gradient_bytes=params * recipe.gradients,
        weight_bytes=params * recipe.weights,
        layer_weight_bytes=largest * recipe.weights,
        bucket_bytes=bucket,
        group_size=reduce_group,
        link=static.links[not within_all[3]],
        grad_accum=s.grad_accum,
        forward_s=sums.forward_s,
        backward_s=sums.backward_s,
        trainable=trainable,
        runs_backward=static.backward != "none",
        overlap=assumptions.dp_comm_overlap,
        zero0_overlap=assumptions.zero0_grad_sync_overlap,
    )
    if pipelined_fsdp and s.zero == 3:
        dp_comm += pipelined_zero3_gather_time(
            weight_bytes=params * recipe.weights, layer_weight_bytes=largest * recipe.weights,
            chunk_gathers=in_flight_chunks + (0 if trainable else s.virtual_stages), virtual_stages=s.virtual_stages,
            group_size=reduce_group, link=static.links[not within_all[3]], forward_s=sums.forward_s,
            overlap=assumptions.dp_comm_overlap)
    if s.zero == 0 and trainable and reduce_group > 1:
        dp_comm += bucket_copy_time(params * recipe.gradients, assumptions.zero0_bucket_copies, cluster.device,
                                    assumptions)
    optimizer_shards = shards if s.zero >= 1 else 1
    optimizer_time = sums.optimizer_call_s + sums.optimizer_measured_s / optimizer_shards + optimizer_pass_time(
        sums.optimizer_formula_params / optimizer_shards, sums.optimizer_formula_tensors, recipe,
        dtensor=s.tp > 1 or s.zero >= 1, device=cluster.device, assumptions=assumptions)
    ga = s.grad_accum
    transfers = handoff_s + pp_comm_s
    passes = 1 + (static.backward != "none") + (s.recompute == "full")  # forwards and backwards a collective repeats in
    forward_share = 2 if static.backward == "full" else 1
    forward_per_mb = sums.forward_s + sums.collectives_s / passes + transfers / forward_share
    return ModuleCost(
        module=static.spec.name,
        strategy=s,
        **sums.scaled(ga).terms(),
        dp_comm_s=dp_comm,
        optimizer_s=optimizer_time if trainable else 0.0,
        handoff_s=ga * handoff_s,
        pp_comm_s=ga * pp_comm_s,
        per_micro_batch_s=sums.total_s + transfers,
        weight_grad_per_micro_batch_s=sums.weight_grad_s,
        forward_per_micro_batch_s=forward_per_mb,
        weights_bytes=math.ceil(weights),
        gradients_bytes=math.ceil(grads),
        optimizer_bytes=math.ceil(optim),
        forward_buffers_bytes=math.ceil(forward_buffers),
        backward_buffers_bytes=math.ceil(backward_buffers),
        loss_backward_buffers_bytes=math.ceil(loss_backward_buffers),
        loss_saved_bytes=math.ceil(loss_saved),
        activations_per_micro_batch_bytes=math.ceil(sums.saved_bytes / s.virtual_stages),
        in_flight_micro_batches=in_flight_chunks,
        flops_per_step=_flops_per_sample(static) * s.samples_per_step,
        sources=sums.sources,
    )


# --- Pipeline parallelism ---------------------------------------------------------------------------------------


def pipeline_chunks(static: _Static, s: ModuleStrategy, layer_costs: LayerCostSource | None,
                    within: tuple[bool, bool, bool], extra_first_s: float, p2p_s: float) -> tuple[int, ...]:
    """Decoder layers of each of the ``pp * virtual_stages`` model chunks, balanced on time per micro-batch
    (``balanced_chunk_layers``): the first chunk also runs the layers before the decoder (embedding) and receives
    the hand-off (``extra_first_s``), the last the layers after it (final norm, lm_head and the loss), and every
    chunk but the last sends its output and receives its gradient (``p2p_s``)."""
    key = (s.tp, s.sp, s.cp, s.micro_batch, s.recompute, s.pp, s.virtual_stages, within, extra_first_s, p2p_s)
    if layer_costs is None and key in static.chunks:
        return static.chunks[key]
    layers = static.spec.layers
    blocks = [i for i, layer in enumerate(layers) if layer.kind in PIPELINED_KINDS]
    assert len(blocks) == 1, f"{static.spec.name}: pipeline parallelism needs one repeated block type"
    index = blocks[0]
    before, block, after = layers[:index], layers[index], layers[index + 1:]
    layer_s = _sums(static, s, within, layer_costs, (replace(block, count=1),)).total_s
    head_s = _sums(static, s, within, layer_costs, before).total_s if before else 0.0
    tail_s = _sums(static, s, within, layer_costs, after).total_s if after else 0.0
    chunks = s.pp * s.virtual_stages
    extra = [p2p_s] * (chunks - 1) + [tail_s]
    extra[0] += head_s + extra_first_s
    chunks = balanced_chunk_layers(block.count, extra, layer_s)
    if layer_costs is None:
        static.chunks[key] = chunks
    return chunks


PIPELINED_KINDS = ("decoder_layer",)
"""The repeated block whose instances pipeline stages divide (the LLM's decoder layers)."""


def rank_layers(layers: tuple[LayerSpec, ...], chunk_layers: tuple[int, ...], rank: int, pp: int
                ) -> tuple[LayerSpec, ...]:
    """The layers pipeline rank ``rank`` holds: the decoder layers of its chunks (``rank``, ``rank + pp``, ...), the
    layers before the decoder on rank 0 (chunk 0), the ones after it on the rank of the last chunk."""
    index = next(i for i, layer in enumerate(layers) if layer.kind in PIPELINED_KINDS)
    mine = range(rank, len(chunk_layers), pp)
    held = [replace(layers[index], count=sum(chunk_layers[c] for c in mine))]
    if 0 in mine:
        held = list(layers[:index]) + held
    if len(chunk_layers) - 1 in mine:
        held += list(layers[index + 1:])
    return tuple(held)


def _rank_layers(static: _Static, chunk_layers: tuple[int, ...], rank: int, pp: int) -> tuple[LayerSpec, ...]:
    """``rank_layers`` of the module, memoised."""
    key = ("rank_layers", chunk_layers, rank, pp)
    held = static.chunks.get(key)
    if held is None:
        held = static.chunks[key] = rank_layers(static.spec.layers, chunk_layers, rank, pp)
    return held


def pipeline_parts(s: ModuleStrategy, first_rank: int, devices_per_node: int, chunk_layers: tuple[int, ...]
                   ) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
    """(the distinct pipeline ranks as (first rank of its kind, chunks it sends onward), each rank's (index of its
    kind, chunks it holds in flight)). Ranks are alike when they hold the same chunks' worth of layers (and whether
    the first or the last), send as many chunks onward and have the same links; the first of a kind holds the most
    in flight (in-flight falls with the rank), so its cost stands for the kind. Memoised."""
    key = (s.pp, s.pp_schedule, s.virtual_stages, s.grad_accum, s.tp, s.sp, s.cp, s.dp,
           first_rank % devices_per_node, devices_per_node, chunk_layers)
    found = _PARTS.get(key)
    if found is not None:
        return found
    zero_bubble = s.pp_schedule in ZERO_BUBBLE_SCHEDULES
    num_chunks = len(chunk_layers)
    kinds: dict[tuple, int] = {}
    parts, rank_stages = [], []
    for rank in range(s.pp):
        mine = range(rank, num_chunks, s.pp)
        sends = sum(c < num_chunks - 1 for c in mine)
        kind = (0 in mine, num_chunks - 1 in mine, sum(chunk_layers[c] for c in mine), sends,
                _within_all(s, first_rank + rank * s.stage_gpus, devices_per_node))
        if kind not in kinds:
            kinds[kind] = len(parts)
            parts.append((rank, sends))
        rank_stages.append((kinds[kind], in_flight_chunks(rank, s.pp, s.grad_accum, s.virtual_stages, zero_bubble)))
    found = _PARTS[key] = (tuple(parts), tuple(rank_stages))
    return found


_PARTS: dict[tuple, tuple] = {}


def _stages_within_node(s: ModuleStrategy, first_rank: int, devices_per_node: int) -> bool:
    """Whether consecutive pipeline stages of the grid starting at ``first_rank`` exchange within a node (one
    memoised ``axis_within_node`` along the pipeline axis)."""
    key = (s.stage_gpus, s.pp, first_rank % devices_per_node, devices_per_node)
    found = _STAGES_WITHIN.get(key)
    if found is None:
        found = _STAGES_WITHIN[key] = axis_within_node(first_rank % devices_per_node, s.stage_gpus, s.pp, s.gpus,
                                                        devices_per_node)
    return found


_STAGES_WITHIN: dict[tuple, bool] = {}


def _within_all(s: ModuleStrategy, first_rank: int, devices_per_node: int) -> tuple[bool, ...]:
    """Whether each of the TP, SP, CP and DP-reduce axes of the (pipeline stage's) grid starting at ``first_rank``
    stays in a node: what the links of a part cost depend on. Memoised: it depends on ``first_rank`` only through
    its offset in a node."""
    key = (s.tp, s.sp, s.cp, s.dp, first_rank % devices_per_node, devices_per_node)
    found = _WITHIN.get(key)
    if found is None:
        found = _WITHIN[key] = tuple(
            axis_within_node(first_rank % devices_per_node, stride, size, s.stage_gpus, devices_per_node)
            for stride, size in ((1, s.tp), (s.tp, s.sp), (s.tp * s.sp, s.cp), (s.tp, s.dp * s.cp * s.sp)))
    return found


_WITHIN: dict[tuple, tuple[bool, ...]] = {}


def pipeline_receive_buffer_bytes(boundary_bytes: float, chunks: int, first: bool, last: bool,
                                  grad_accum: int) -> int:
    """Bytes of the receive buffers a pipeline rank keeps for the whole run: torch's ``PipelineStage`` allocates one
    buffer per micro-batch for the activations each of its model chunks but the first receives, and one for the
    gradient each chunk but the last receives (``_setup_forward_recv_info`` and ``_setup_backward_recv_info``,
    torch 2.13, each a loop over every micro-batch), ``boundary_bytes`` each (the hidden states of a micro-batch).
    ``chunks``: the rank's model chunks; ``first`` / ``last``: whether it holds the pipeline's first / last one. A
    chunk's first layer saves its input, which is one of these buffers while the micro-batch is in flight: counted
    twice, up to the in-flight micro-batches' inputs (conservative)."""
    slots = 2 * chunks - first - last
    return math.ceil(slots * grad_accum * boundary_bytes)


def stage0_handoff_bytes(per_sample: float, backward: bool, micro_batch: int, grad_accum: int) -> int:
    """Bytes a pipeline's first stage holds through the schedule: every micro-batch's encoder output (``per_sample``
    bytes a sample), and as much again for their gradient when an encoder trains (runtime.trainer ``llm_pipeline``:
    one leaf of all micro-batches' rows, whose gradient is allocated whole by the first backward to reach it)."""
    return math.ceil((1 + backward) * grad_accum * micro_batch * per_sample)


def encoder_handoff_bytes(static: _Static) -> tuple[float, bool]:
    """(bytes per sample every encoder hands the LLM, whether any of them takes the gradient back)."""
    total, backward = 0.0, False
    for name in static.model.module_names:
        if name in ENCODER_MODULES:
            encoder = _static(static.model, name, static.workload, static.cluster, static.assumptions)
            total += encoder.handoff_bytes_per_sample
            backward = backward or encoder.backward == "full"
    return total, backward


def _pipelined_cost(
    static: _Static, s: ModuleStrategy, *, precision: Precision, first_rank: int, layer_costs: LayerCostSource | None,
    chunk_layers: tuple[int, ...] | None = None,
) -> ModuleCost:
    """The cost of a pipelined module (pp > 1): one ``_part_cost`` per distinct pipeline rank (its layers, transfers
    and links; ranks alike differ only in what they keep in flight, and the first of them holds the most), then the
    step of the schedule (``pipeline_bubble_time``): time is the slowest rank's plus the bubble, the tail the longest
    rank's, memory the rank whose own peak is the largest (``stage_costs`` keeps every distinct rank's, which
    ``planner.cost.phases`` reads).

    Transfers per micro-batch: a stage boundary carries the micro-batch's hidden states forward and their
    gradient back, point-to-point between the ranks of the same grid position in consecutive stages (Hockney
    alpha-beta over the link joining them); stage 0 also receives the encoders' output (colocated: from every
    GPU; disjoint: from the encoder group) over the NIC once the module spans nodes, and sends its gradient back.
    The schedule takes every micro-batch's encoder output at once, so stage 0 holds all of them, and their
    gradient once its first backward reaches them, for the whole schedule (``stage0_handoff_bytes``); under SP a
    stage-0 rank holds the rows of its slice of each sequence, at most a slice's worth (image tokens come first).
    Every rank also keeps torch's per-micro-batch receive buffers (``pipeline_receive_buffer_bytes``). The layers
    are split by ``pipeline_chunks`` unless ``chunk_layers`` gives the split.
    """
    assumptions, dpn = static.assumptions, static.cluster.devices_per_node
    within = _within_all(s, first_rank, dpn)[:3]
    hidden = next(layer.hidden_size for layer in static.spec.layers if layer.kind in PIPELINED_KINDS)
    boundary_bytes = s.micro_batch * static.tokens.tokens / (s.sp * s.cp) * hidden * assumptions.activation_bytes
    stage_link = static.links[not _stages_within_node(s, first_rank, dpn)]
    p2p = 2 * p2p_time(boundary_bytes, stage_link) * (1 - assumptions.pp_p2p_overlap)
    per_sample, backward = encoder_handoff_bytes(static)
    # under SP a stage-0 rank takes the image rows of its slice only: all of them, or at most a slice's worth
    slice_bytes = math.ceil(static.tokens.tokens / (s.sp * s.cp)) * hidden * assumptions.activation_bytes
    per_sample = min(per_sample, slice_bytes)
    handoff = (1 + backward) * p2p_time(s.micro_batch * per_sample, static.links[s.gpus > dpn])
    chunks = chunk_layers or pipeline_chunks(static, s, layer_costs, within, handoff, p2p)
    parts, rank_stages = pipeline_parts(s, first_rank, dpn, chunks)
    ranks = [
        _part_cost(static, s, _rank_layers(static, chunks, rank, s.pp), precision=precision,
                   first_rank=first_rank + rank * s.stage_gpus, layer_costs=layer_costs,
                   in_flight_chunks=rank_stages[rank][1],
                   handoff_s=handoff if rank == 0 else 0.0, pp_comm_s=p2p * sends)
        for rank, sends in parts
    ]
    held = stage0_handoff_bytes(per_sample, backward, s.micro_batch, s.grad_accum)
    ranks[0] = replace(ranks[0], forward_buffers_bytes=ranks[0].forward_buffers_bytes + held,
                       backward_buffers_bytes=ranks[0].backward_buffers_bytes + held)
    last = (len(chunks) - 1) % s.pp
    ranks = [replace(c, receive_buffers_bytes=pipeline_receive_buffer_bytes(
        boundary_bytes, s.virtual_stages, rank == 0, rank == last, s.grad_accum)) for c, (rank, _) in zip(ranks, parts)]
    slowest = max(ranks, key=lambda c: c.per_micro_batch_s)
    tail = max(ranks, key=lambda c: c.step_tail_s)
    memory = max(ranks, key=own_peak_bytes)
    zero_bubble = s.pp_schedule in ZERO_BUBBLE_SCHEDULES
    deferred = [ranks[i].weight_grad_per_micro_batch_s for i, _ in rank_stages] if zero_bubble else None
    bubble = pipeline_bubble_time([ranks[i].per_micro_batch_s for i, _ in rank_stages], s.virtual_stages, deferred)
    sources = ranks[0].sources
    if any(c.sources is not sources for c in ranks):
        sources = MappingProxyType({k: v for c in ranks for k, v in c.sources.items()})
    return replace(
        memory,
        **slowest.terms(),
        handoff_s=slowest.handoff_s,
        pp_comm_s=slowest.pp_comm_s,
        per_micro_batch_s=slowest.per_micro_batch_s,
        weight_grad_per_micro_batch_s=slowest.weight_grad_per_micro_batch_s,
        forward_per_micro_batch_s=slowest.forward_per_micro_batch_s,
        dp_comm_s=tail.dp_comm_s,
        optimizer_s=tail.optimizer_s,
        pipeline_bubble_s=bubble,
        chunk_layers=chunks,
        stage_costs=tuple(ranks),
        rank_stages=tuple(rank_stages),
        flops_per_step=_flops_per_sample(static) * s.samples_per_step,
        sources=sources,
    )


def pipelined_step_floor_s(
    model: ModelSpec, module: str, cluster: Cluster, workload: Workload, strategy: ModuleStrategy, *,
    assumptions: CostAssumptions = DEFAULT_ASSUMPTIONS, layer_costs: LayerCostSource | None = None,
) -> float:
    """A lower bound on ``module_cost(...).micro_batches_s`` of a pipelined strategy (pp > 1) from the module's
    per-micro-batch layer sums alone, without splitting it into ranks (15-25x cheaper than costing it here).

    With ``t_k`` rank k's time per micro-batch, the schedule takes ``m max t + bubble``
    (``pipeline_bubble_time``). The ranks partition the layers, so ``sum t >= S``: compute, recomputation and each
    layer collective over the faster of its two links (transfers are >= 0); ``max t >= S / p``. Then
    ``m max t + (sum t - max t) / v >= (m - 1/v) S / p + S / v``, as ``m >= p > 1/v``: Narayanan et al. 2021,
    Sec. 2.2, ``(m + (p - 1) / v) t`` for equal stages. Zero-bubble fills the bubble with the weight-gradient
    passes (``W``, summed over every layer): ``(m - 1/v) S / p + max(0, S - 2 W) / v`` (Qi et al. 2023, Sec. 3.1).
    The planner skips costing a pipelined strategy whose bound already exceeds a plan it has (exact pruning).
    """
    s = strategy
    static = _with_measured_collectives(_static(model, module, pipeline_padded(workload), cluster, assumptions), s,
                                        layer_costs)
    key = ("pipeline work", s.tp, s.sp, s.cp, s.micro_batch, s.recompute)  # memoised for the analytical model
    work, weight_grad = static.sums.get(key) or _pipeline_work(static, s, layer_costs)
    if layer_costs is None:
        static.sums[key] = work, weight_grad
    v = s.virtual_stages
    filled = max(0.0, work - 2 * weight_grad) if s.pp_schedule in ZERO_BUBBLE_SCHEDULES else work
    return (s.grad_accum - 1 / v) * work / s.pp + filled / v


def _pipeline_work(static: _Static, s: ModuleStrategy, layer_costs: LayerCostSource | None) -> tuple[float, float]:
    """(``S``, ``W``) of ``pipelined_step_floor_s``: one micro-batch's compute, recomputation and layer collectives
    (each on the faster link) over every layer, and its weight-gradient passes."""
    fast, slow = (_sums(static, s, (within,) * 3, layer_costs, static.spec.layers) for within in (True, False))
    collectives = sum(min(getattr(fast, name), getattr(slow, name)) for name in ("tp_comm_s", "sp_comm_s", "cp_comm_s"))
    return fast.forward_s + fast.backward_s + fast.recompute_s + collectives, fast.weight_grad_s
