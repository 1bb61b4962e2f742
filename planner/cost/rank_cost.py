"""What one GPU running some of a module's layers costs: ``rank_cost`` composes the per-layer formulas
(planner.cost.layers), model states, DP/ZeRO communication, the optimizer step and the transfers into a
ModuleCost. planner.cost.module applies it to a whole module, planner.cost.pipeline to each pipeline rank.

Per-call work is kept small because the solver costs thousands of candidates: everything that depends only
on (model, module, workload, assumptions) is computed once (``ModuleStatic``), and per-layer terms are memoised by
the sharding that determines them (tp, sp, cp, micro-batch, recompute, links).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Mapping

from planner.cost.assumptions import CostAssumptions
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
from planner.cost.host import device_pass_time, host_dispatch_time
from planner.cost.layers import LAYER_TERMS, Shard, block_terms, layer_terms, ring_calls, ring_collective_times
from planner.cost.op_counts import LAYER_OPS, PassOps, ops_row
from planner.cost.memory import (
    FSDP_BLOCK_KINDS,
    bucket_bytes,
    expert_params_per_rank,
    loss_chunk_tokens,
    layer_params_per_rank,
    model_state_bytes,
    pipelined_fsdp_state_bytes,
    zero3_gather_bytes,
)
from planner.cost.results import ModuleCost
from planner.cost.times import PassTimes
from planner.contract.hardware import Cluster
from planner.contract.models import ENCODER_MODULES, LayerSpec, ModelSpec, ModuleSpec
from planner.contract.strategy import ModuleStrategy, Placement, Precision
from planner.contract.workload import ModuleTokens, Workload, module_tokens


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


def handoff_bytes(output_tokens: float, width: int, tensors: int, activation_bytes: float) -> float:
    """Bytes of one sample's encoder output crossing to the LLM: ``tensors`` tensors of ``output_tokens x width``
    activations. A Qwen-VL merger hands over one; Qwen3-VL adds one per DeepStack level, each the features of a
    vision block merged to the LLM's width and added to a decoder layer's output at the image positions (Meng et
    al. 2024, "DeepStack", Sec. 3.1, Eq. 2; transformers ``Qwen3VLModel.forward``)."""
    return output_tokens * width * tensors * activation_bytes


def injected_feature_bytes(model: ModelSpec, workload: Workload, micro_batch: int, sequence_shards: int,
                           activation_bytes: float) -> float:
    """Bytes of the DeepStack features an unpipelined LLM rank holds per micro-batch in flight: one tensor of its
    image tokens at the LLM's width per injection level, from the hand-off until the backward of the layer that adds
    it (``handoff_bytes`` minus the merged output, which the embedding's scatter consumes). Under SP x CP a rank
    holds the image tokens of its slice of each sequence: all of them, or at most a slice's worth on the first rank
    (image tokens come first). 0 for a model without injections."""
    if not model.injection_layers:
        return 0.0
    tokens = module_tokens(workload, model)
    image_tokens = sum(tokens[m].output_tokens for m in model.module_names if m in ENCODER_MODULES)
    held = min(image_tokens, math.ceil(tokens["llm"].tokens / sequence_shards))
    width = model.module("llm").layer("embedding").hidden_size
    return handoff_bytes(micro_batch * held, width, len(model.injection_layers), activation_bytes)


@dataclass(eq=False)
class ModuleStatic:
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


_STATIC: dict[tuple, ModuleStatic] = {}
_STATIC_LIMIT = 256


def module_static(
    model: ModelSpec, module: str, workload: Workload, cluster: Cluster, assumptions: CostAssumptions
) -> ModuleStatic:
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
    entry = ModuleStatic(
        model=model,
        workload=workload,
        cluster=cluster,
        assumptions=assumptions,
        spec=spec,
        tokens=tokens,
        segment_tokens=seg_len,
        segments=seg_count,
        backward=backward_mode(model, module),
        handoff_bytes_per_sample=handoff_bytes(tokens.output_tokens, out_width, model.handoff_tensors,
                                               assumptions.activation_bytes),
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


def _shard(static: ModuleStatic, s: ModuleStrategy, links: tuple[Link, ...], micro_batch: int | None = None) -> Shard:
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
        ep=s.ep,
        ep_link=links[3],
        loss_chunk_tokens=loss_chunk_tokens(s.pp, static.assumptions),
    )


@dataclass(kw_only=True, frozen=True, slots=True)
class LayerSums(PassTimes):
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
    optimizer_formula_expert_params: float
    """Of ``optimizer_formula_params``, the routed experts' (ZeRO shards them over dp * cp * sp / ep ranks)."""
    weight_grad_s: float
    """Of ``backward_s``, the weight-gradient passes (``planner.cost.layers.weight_gradient_time``; a measured
    backward keeps the analytical share)."""
    sources: Mapping[str, str]


def _sum_layers(
    static: ModuleStatic, s: ModuleStrategy, links: tuple[Link, ...], layer_costs: LayerCostSource | None,
    layers: tuple[LayerSpec, ...], sharding: tuple | None = None,
) -> LayerSums:
    """Sum the layers' terms for one micro-batch; measured numbers replace analytical ones where available.
    A measurement that includes the layer's TP/SP collectives replaces their analytical time too (source
    ``<layer>.tp_sp_collectives: measured``).

    Buffers: see ``LayerSums.forward_buffer_bytes`` and ``backward_buffer_bytes``. ``sharding`` (analytical model):
    the key under which one instance's terms of each layer are memoised (pipeline stages sum different counts of
    the same layers).
    """
    shard = _shard(static, s, links)
    times = PassTimes()
    saved = optimizer_s = optimizer_call = 0.0
    full = s.recompute == "full"
    forward_buffers = backward_buffers = 0.0
    loss_buffers = (0.0, 0.0, 0.0)
    formula_params = formula_tensors = formula_experts = weight_grad = 0.0
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
            formula_params += n * layer_params_per_rank(layer, s.tp, s.ep)
            formula_experts += n * expert_params_per_rank(layer, s.tp, s.ep)
            formula_tensors += n * LAYER_OPS[ops_row(layer)].param_tensors
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
    scale = static.assumptions.compute_scale(static.spec.name)
    if scale != 1.0:
        times = replace(times, forward_s=scale * times.forward_s, backward_s=scale * times.backward_s,
                        recompute_s=scale * times.recompute_s)
        weight_grad *= scale
    memory = static.assumptions.activation_memory_scale(static.spec.name)
    if memory != 1.0:
        saved, forward_buffers, backward_buffers = memory * saved, memory * forward_buffers, memory * backward_buffers
        loss_buffers = tuple(memory * b for b in loss_buffers)
    return LayerSums(**times.terms(), saved_bytes=saved, forward_buffer_bytes=forward_buffers,
                 backward_buffer_bytes=backward_buffers, loss_buffer_bytes=loss_buffers,
                 optimizer_measured_s=optimizer_s, optimizer_call_s=optimizer_call,
                 optimizer_formula_params=formula_params, optimizer_formula_tensors=formula_tensors,
                 optimizer_formula_expert_params=formula_experts, weight_grad_s=weight_grad, sources=final_sources)


def _measure(
    layer_costs: LayerCostSource, static: ModuleStatic, layer: LayerSpec, s: ModuleStrategy
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


def layer_sums(
    static: ModuleStatic, s: ModuleStrategy, within: tuple[bool, ...], layer_costs: LayerCostSource | None,
    layers: tuple[LayerSpec, ...],
) -> LayerSums:
    """Sums over ``layers`` (the module's, or one pipeline stage's), memoised by the sharding (with whether it
    pipelines: a pipelined loss is not chunked) and the layer counts that determine them.
    ``within``: whether the TP, SP, CP and EP groups stay in a node (``layer_axes_within_node``)."""
    links = tuple(static.links[not w] for w in within)
    if layer_costs is not None:  # by the profile too, and whether its collective curves cover the strategy's groups
        key = ("measured", id(layer_costs), static.analytical_sources.get("collectives"), s.tp, s.sp, s.cp, s.ep,
               s.micro_batch, s.recompute, s.pp > 1, within, _counts(layers))
        known = static.sums.get(key)
        if known is None or known[0] is not layer_costs:
            known = static.sums[key] = (layer_costs, _sum_layers(static, s, links, layer_costs, layers))
        return known[1]
    key = (s.tp, s.sp, s.cp, s.ep, s.micro_batch, s.recompute, s.pp > 1, within, _counts(layers))
    sums = static.sums.get(key)
    if sums is None:
        sums = static.sums[key] = _sum_layers(static, s, links, None, layers, key[:-1])
    return sums


def _instance_terms(static: ModuleStatic, layer: LayerSpec, shard: Shard, sharding: tuple | None):
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


def fsdp_gradient_bytes(
    params: float, precision: Precision, *, shards: float, grad_accum: int, assumptions: CostAssumptions
) -> float:
    """Gradient bytes per GPU of a ZeRO-1/2 module as the runtime runs it (FSDP2): a ZeRO-1 module with several
    micro-batches accumulates unsharded gradients (no per-micro-batch reduce-scatter); otherwise each backward
    reduce-scatters them into the sharded parameter's gradient, ``1 / shards`` of them (Rajbhandari et al. 2020,
    Sec. 5.1, P_os+g). Either way in FSDP2's reduce dtype (``CostAssumptions.accumulated_gradient_bytes``: fp32
    under bf16_mixed, whose sharded parameters are fp32), not the recipe's bf16 gradient: a ZeRO-2 module's split
    experts, sharded over the few ranks that hold the same ones, hold 4 bytes per parameter, not 2."""
    if grad_accum > 1:
        return params * assumptions.accumulated_gradient_bytes(precision)
    return params * assumptions.accumulated_gradient_bytes(precision) / shards


def params_per_rank(static: ModuleStatic, tp: int, ep: int, layers: tuple[LayerSpec, ...]
                     ) -> tuple[float, float, float, float, float]:
    """On one TP (and EP) rank, of ``layers`` (the module's, or one pipeline stage's): (parameters, largest single
    layer instance, the FSDP root unit's parameters (every layer but the blocks, ``FSDP_BLOCK_KINDS``), largest block
    instance, routed-expert parameters)."""
    key = (tp, ep, _counts(layers))
    cached = static.params.get(key)
    if cached is None:
        per_layer = [layer_params_per_rank(layer, tp, ep) for layer in layers]
        total = sum(p * layer.count for p, layer in zip(per_layer, layers))
        root = sum(p * layer.count for p, layer in zip(per_layer, layers) if layer.kind not in FSDP_BLOCK_KINDS)
        block = max((p for p, layer in zip(per_layer, layers) if layer.kind in FSDP_BLOCK_KINDS), default=0.0)
        experts = sum(expert_params_per_rank(layer, tp, ep) * layer.count for layer in layers)
        cached = static.params[key] = (total, max(per_layer), root, block, experts)
    return cached


INPUT_LAYER_KINDS = frozenset({"embedding", "patch_embed", "audio_conv"})
"""Layer kinds that take a module's input: their gradients come last in its backward."""


def _input_layer_params(layers: tuple[LayerSpec, ...], tp: int, ep: int) -> float:
    """Parameters on one rank of ``layers``' input layer (0 when they hold none: a later pipeline stage)."""
    return sum(layer_params_per_rank(layer, tp, ep) * layer.count for layer in layers
               if layer.kind in INPUT_LAYER_KINDS)


def flops_per_sample(static: ModuleStatic) -> float:
    """Model FLOPs (forward + backward, no recomputation, no parallelism) of one sample."""
    if static.flops_per_sample is None:
        base = ModuleStrategy(dp=1)
        links = (_UNUSED_LINK,) * 4
        shard = _shard(static, base, links, micro_batch=1)
        static.flops_per_sample = sum(
            (t.flops + t.backward_flops) * layer.count
            for layer in static.spec.layers
            for t in (layer_terms(layer, shard),)
        )
    return static.flops_per_sample


def ring_floor_s(static: ModuleStatic, s: ModuleStrategy, links: tuple[Link, ...]) -> float:
    """Seconds of one micro-batch on a rank of ``s`` at least taken by ring CP itself. A block's pass takes at least
    the host dispatch and at least the kernel launches of its calls (``host.pass_time``), the ring's
    (``layers.ring_calls``) among them; and the pass with its exposed CP collectives at least those collectives
    (``layers.ring_collective_times``: ``exposed_time`` hides at most ``cp_comm_overlap <= 1`` of the attention the
    pass computes) -- forward, backward, and under recomputation the forward's again (selective recomputation
    re-dispatches the attention core's calls, the ring's among them). ``links``: as ``layer_sums``' (TP, SP, CP,
    EP)."""
    shard, a = _shard(static, s, links), static.assumptions
    device, backward = static.cluster.device, static.backward != "none"
    scale = a.compute_scale(static.spec.name)  # scales the passes, not the collectives: at least min(scale, 1) of them

    def pass_floor(ops: PassOps, collectives_s: float) -> float:
        dispatch = max(host_dispatch_time(ops, a), device_pass_time(0.0, ops, device))
        return max(scale * dispatch, min(scale, 1.0) * collectives_s)

    total = 0.0
    for layer in static.spec.layers:
        if layer.linear_attention is not None or LAYER_TERMS[layer.kind] is not block_terms:
            continue
        forward_ops, backward_ops = ring_calls(layer, shard)
        forward_s, backward_s = ring_collective_times(layer, shard)
        forward = pass_floor(forward_ops, forward_s)
        passes = forward * (2 if backward and s.recompute != "none" else 1)
        if backward:
            passes += pass_floor(backward_ops, backward_s)
        total += layer.count * passes
    return total


def handoff_per_micro_batch(
    static: ModuleStatic,
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


def with_measured_collectives(static: ModuleStatic, s: ModuleStrategy, layer_costs: LayerCostSource | None) -> ModuleStatic:
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


def rank_cost(
    static: ModuleStatic, s: ModuleStrategy, layers: tuple[LayerSpec, ...], *, precision: Precision, first_rank: int,
    layer_costs: LayerCostSource | None, in_flight_chunks: int, handoff_s: float, pp_comm_s: float,
    held_handoff_bytes: float = 0.0, receive_buffers_bytes: int = 0,
) -> ModuleCost:
    """The cost on one GPU that runs ``layers`` (all of the module's, or one pipeline rank's chunks) for every
    micro-batch, with ``handoff_s`` and ``pp_comm_s`` of transfers per micro-batch and ``in_flight_chunks``
    micro-batches' (with PP: model chunks') activations alive at its peak; a pipeline rank's encoder outputs held
    over its schedule (``held_handoff_bytes``, in both passes' buffers) and its receive buffers."""
    assumptions, cluster = static.assumptions, static.cluster
    within_all = axes_within_node(s, first_rank, cluster.devices_per_node)
    sums = layer_sums(static, s, layer_axes_within_node(within_all), layer_costs, layers)
    forward_buffers, backward_buffers = sums.forward_buffer_bytes, sums.backward_buffer_bytes

    recipe = assumptions.bytes_per_param(precision)
    params, largest, root, block, experts = params_per_rank(static, s.tp, s.ep, layers)
    reduce_group = s.dp * s.cp * s.sp
    shards = reduce_group if assumptions.zero_shards_over_sequence_ranks else s.dp
    trainable = not static.spec.frozen
    # inside a step, torch's schedules neither reduce-scatter gradients nor reshard weights after a backward
    pipelined_fsdp = s.pp > 1 and s.zero >= 2 and shards > 1 and static.backward != "none"
    dense_states = _state_bytes(static, s, precision, params - experts, shards, pipelined_fsdp)
    # the routed experts' states, sharded by ZeRO over the dp * cp * sp / ep ranks that hold the same experts
    expert_states = _state_bytes(static, s, precision, experts, expert_zero_shards(shards, s.ep), pipelined_fsdp)
    weights, grads, optim = (dense + expert for dense, expert in zip(dense_states, expert_states))
    if s.zero == 3 and shards > 1 and not pipelined_fsdp:
        forward_buffers += zero3_gather_bytes(root, block, recipe, prefetch=assumptions.zero3_prefetch_layers,
                                              frozen=not trainable, backward=False)
        backward_buffers += zero3_gather_bytes(root, block, recipe, prefetch=assumptions.zero3_prefetch_layers,
                                               frozen=not trainable, backward=True,
                                               input_params=_input_layer_params(layers, s.tp, s.ep))
        bucket = largest * recipe.gradients
    else:
        bucket = bucket_bytes(params * recipe.gradients, assumptions) if trainable and reduce_group > 1 else 0.0
        backward_buffers += bucket
        bucket = min(bucket, assumptions.communication_bucket_bytes)
    forward_buffers = max(forward_buffers, sums.loss_buffer_bytes[0]) + held_handoff_bytes
    backward_buffers += held_handoff_bytes
    loss_backward_buffers, loss_saved = sums.loss_buffer_bytes[1:]

    # with ep = 1 the ranks holding the same experts (split over TP or not) are the dense reduce group: one reduction
    dp_params = params - experts if s.ep > 1 else params
    dp_comm = _dp_comm(static, s, sums, precision, pipelined_fsdp, dp_params, largest, bucket, reduce_group,
                       not within_all[3])
    if s.ep > 1:  # expert gradients are reduced over the ranks holding the same experts (Lepikhin et al. 2020)
        dp_comm += _dp_comm(static, s, sums, precision, pipelined_fsdp, experts, largest, bucket,
                            round(expert_zero_shards(reduce_group, s.ep)), not within_all[5])
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
    expert_shards = expert_zero_shards(shards, s.ep) if s.zero >= 1 else 1
    formula_experts = sums.optimizer_formula_expert_params if s.ep > 1 else 0.0
    optimizer_params = ((sums.optimizer_formula_params - formula_experts) / optimizer_shards
                        + formula_experts / expert_shards)
    optimizer_time = assumptions.optimizer_time_scale * (
        sums.optimizer_call_s + sums.optimizer_measured_s / optimizer_shards + optimizer_pass_time(
            optimizer_params, sums.optimizer_formula_tensors, recipe,
            dtensor=s.tp > 1 or s.zero >= 1, device=cluster.device, assumptions=assumptions))
    activations = sums.saved_bytes / s.virtual_stages
    if static.spec.name == "llm" and s.pp == 1:
        activations += injected_feature_bytes(static.model, static.workload, s.micro_batch, s.sp * s.cp,
                                              assumptions.activation_bytes)
    ga = s.grad_accum
    transfers = handoff_s + pp_comm_s
    forward_per_mb = (sums.forward_s + sums.collectives_s / collective_passes(static.backward, s.recompute)
                      + transfers / transfer_passes(static.backward))
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
        activations_per_micro_batch_bytes=math.ceil(activations),
        receive_buffers_bytes=receive_buffers_bytes,
        in_flight_micro_batches=in_flight_chunks,
        flops_per_step=flops_per_sample(static) * s.samples_per_step,
        sources=sums.sources,
    )


def collective_passes(backward: str, recompute: str) -> int:
    """Passes a layer's collectives run in per micro-batch, each an equal share: the forward, the backward (unless
    the module runs none: ``backward_mode``) and full recomputation's second forward."""
    return 1 + (backward != "none") + (recompute == "full")


def transfer_passes(backward: str) -> int:
    """Passes a micro-batch's transfers (hand-off, pipeline sends) are shared over: the forward's outbound one, and
    the gradient's way back for a fully trainable module (``backward_mode`` ``full``)."""
    return 2 if backward == "full" else 1


def axes_within_node(s: ModuleStrategy, first_rank: int, devices_per_node: int) -> tuple[bool, ...]:
    """Whether each of the TP, SP, CP, DP-reduce, EP and expert-reduce axes of the (pipeline stage's) grid starting
    at ``first_rank`` stays in a node: what the links of a part cost depend on. An EP group is ``ep`` consecutive
    ranks of the dp x cp x sp axis with all their TP ranks, ``ep * tp`` consecutive ranks
    (``layers.expert_group_size``), the experts' reduce group the ranks ``tp * ep`` apart holding the same experts.
    Memoised: it depends on ``first_rank`` only through its offset in a node."""
    key = (s.tp, s.sp, s.cp, s.dp, s.ep, first_rank % devices_per_node, devices_per_node)
    found = _WITHIN.get(key)
    if found is None:
        found = _WITHIN[key] = tuple(
            axis_within_node(first_rank % devices_per_node, stride, size, s.stage_gpus, devices_per_node)
            for stride, size in ((1, s.tp), (s.tp, s.sp), (s.tp * s.sp, s.cp), (s.tp, s.dp * s.cp * s.sp),
                                 (1, s.ep * s.tp), (s.tp * s.ep, s.dp * s.cp * s.sp // s.ep)))
    return found


def layer_axes_within_node(within_all: tuple[bool, ...]) -> tuple[bool, bool, bool, bool]:
    """Of ``axes_within_node``, the axes a layer's own collectives use: TP, SP, CP and EP."""
    return within_all[0], within_all[1], within_all[2], within_all[4]


def expert_zero_shards(shards: int, ep: int) -> float:
    """Ranks ZeRO shards a routed expert's states over: the module's ZeRO shards that hold the same experts,
    ``shards / ep`` (torchtitan's ``efsdp`` mesh, dp_shard * cp * tp / ep_titan with etp=1, where its EP degree
    ep_titan is our ep * tp; transformers ``AllToAllEP``'s efsdp_size = fsdp_size * tp_size / ep_size), at least 1."""
    return max(1.0, shards / ep)


def _state_bytes(static: ModuleStatic, s: ModuleStrategy, precision: Precision, params: float, shards: float,
                 pipelined_fsdp: bool) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per GPU of ``params`` parameters sharded by ZeRO over ``shards``
    ranks: ``model_state_bytes``, the gradients of a ZeRO-1/2 module FSDP2 wraps (``fsdp_gradient_bytes``; its
    split experts too, whatever ``shards``) and a pipelined FSDP stage's (``pipelined_fsdp_state_bytes``)."""
    assumptions, trainable = static.assumptions, not static.spec.frozen
    recipe = assumptions.bytes_per_param(precision)
    weights, grads, optim = model_state_bytes(params, recipe, zero=s.zero, shards=shards, frozen=not trainable)
    fsdp = s.dp * s.cp * s.sp > 1  # runtime.models.parallelize.uses_fsdp
    if s.zero in (1, 2) and trainable and fsdp:
        grads = fsdp_gradient_bytes(params, precision, shards=shards, grad_accum=s.grad_accum if s.zero == 1 else 1,
                                    assumptions=assumptions)
    if pipelined_fsdp:
        weights, grads = pipelined_fsdp_state_bytes(
            params, recipe, accumulated_gradient_bytes=assumptions.accumulated_gradient_bytes(precision),
            frozen=not trainable)
    return weights, grads, optim


def _dp_comm(static: ModuleStatic, s: ModuleStrategy, sums: LayerSums, precision: Precision, pipelined_fsdp: bool,
             params: float, largest: float, bucket: float, group_size: int, cross_node: bool) -> float:
    """``zero_comm_time`` of ``params`` parameters reduced (and, ZeRO-3, gathered) over ``group_size`` ranks."""
    assumptions = static.assumptions
    recipe = assumptions.bytes_per_param(precision)
    return zero_comm_time(
        zero=1 if pipelined_fsdp else s.zero,
        gradient_bytes=params * recipe.gradients,
        weight_bytes=params * recipe.weights,
        layer_weight_bytes=largest * recipe.weights,
        bucket_bytes=bucket,
        group_size=group_size,
        link=static.links[cross_node],
        grad_accum=s.grad_accum,
        forward_s=sums.forward_s,
        backward_s=sums.backward_s,
        trainable=not static.spec.frozen,
        runs_backward=static.backward != "none",
        overlap=assumptions.dp_comm_overlap,
        zero0_overlap=assumptions.zero0_grad_sync_overlap,
    )


_WITHIN: dict[tuple, tuple[bool, ...]] = {}
