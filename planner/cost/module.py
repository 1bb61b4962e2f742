"""Analytical per-module cost: composes the per-layer formulas into a ModuleCost.

Per-call work is kept small because the solver costs thousands of candidates: everything that depends only
on (model, module, workload, assumptions) is computed once (``_Static``), and per-layer terms are memoised by
the sharding that determines them (tp, sp, cp, micro-batch, recompute, links).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from planner.cost.assumptions import CostAssumptions
from planner.cost.comm import Link, all_gather_time, group_link, p2p_time, span_link, zero_comm_time
from planner.cost.layer_costs import ANALYTICAL, MEASURED, LayerCostSource
from planner.cost.layers import LayerTerms, Shard, layer_terms
from planner.cost.memory import bucket_bytes, layer_params_per_rank, model_state_bytes, zero3_gather_bytes
from planner.cost.results import ModuleCost
from planner.hardware import Cluster, DeviceSpec
from planner.models import ENCODER_MODULES, LayerSpec, ModelSpec, ModuleSpec
from planner.strategy import ModuleStrategy, Placement, Precision
from planner.workload import ModuleTokens, Workload, module_tokens

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
    total = sum(tokens.segments)
    squares = sum(s * s for s in tokens.segments)
    if total == 0:
        return 0.0, 0.0
    return squares / total, total * total / squares


@dataclass(eq=False)
class _Static:
    """What one (model, module, workload, device, assumptions) fixes, plus the memo of layer terms."""

    model: ModelSpec
    workload: Workload
    device: DeviceSpec
    assumptions: CostAssumptions
    spec: ModuleSpec
    tokens: ModuleTokens
    segment_tokens: float
    segments: float
    backward: str
    handoff_bytes_per_sample: float
    terms: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    flops_per_sample: float | None = None


_STATIC: dict[tuple, _Static] = {}
_STATIC_LIMIT = 256


def _static(model: ModelSpec, module: str, workload: Workload, device: DeviceSpec, assumptions: CostAssumptions) -> _Static:
    """The memoised static data of a module (keyed by object identity; the entry holds the objects)."""
    key = (id(model), module, id(workload), id(device), id(assumptions))
    entry = _STATIC.get(key)
    same = entry is not None and entry.model is model and entry.workload is workload and entry.device is device
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
        device=device,
        assumptions=assumptions,
        spec=spec,
        tokens=tokens,
        segment_tokens=seg_len,
        segments=seg_count,
        backward=backward_mode(model, module),
        handoff_bytes_per_sample=tokens.output_tokens * out_width * assumptions.activation_bytes,
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
        device=static.device,
        assumptions=static.assumptions,
    )


def _layer(static: _Static, index: int, layer: LayerSpec, s: ModuleStrategy, links: tuple[Link, Link, Link]) -> LayerTerms:
    """Memoised analytical terms of one layer type under this sharding."""
    key = (index, s.tp, s.sp, s.cp, s.micro_batch, s.recompute, links)
    terms = static.terms.get(key)
    if terms is None:
        terms = layer_terms(layer, _shard(static, s, links))
        static.terms[key] = terms
    return terms


def _params_per_rank(static: _Static, tp: int) -> tuple[float, float]:
    """(module parameters on one TP rank, largest single layer instance on one TP rank)."""
    cached = static.params.get(tp)
    if cached is None:
        per_layer = [layer_params_per_rank(layer, tp) for layer in static.spec.layers]
        total = sum(p * layer.count for p, layer in zip(per_layer, static.spec.layers))
        cached = static.params[tp] = (total, max(per_layer))
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
    cluster: Cluster,
    assumptions: CostAssumptions,
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
    link = span_link(cluster, assumptions, first_rank=0, last_rank=first_rank + s.gpus - 1)
    return directions * p2p_time(per_mb / s.sp, link)


def analytical_module_cost(
    model: ModelSpec,
    module: str,
    cluster: Cluster,
    workload: Workload,
    strategy: ModuleStrategy,
    *,
    placement: Placement,
    precision: Precision,
    first_rank: int,
    num_stages: int,
    stage_index: int,
    assumptions: CostAssumptions,
    layer_costs: LayerCostSource | None,
) -> ModuleCost:
    """Compose per-layer terms, model states, DP/ZeRO communication and the hand-off into a ModuleCost."""
    s = strategy
    static = _static(model, module, workload, cluster.device, assumptions)
    grid = dict(first_rank=first_rank, num_ranks=s.gpus)
    links = (
        group_link(cluster, assumptions, stride=1, size=s.tp, **grid),
        group_link(cluster, assumptions, stride=s.tp, size=s.sp, **grid),
        group_link(cluster, assumptions, stride=s.tp * s.sp, size=s.cp, **grid),
    )
    fwd = bwd = rc = tp_c = sp_c = cp_c = saved = working = buffers = 0.0
    sources: dict[str, str] = {}
    for index, layer in enumerate(static.spec.layers):
        t = _layer(static, index, layer, s, links)
        f, b, r, act = t.forward_s, t.backward_s, t.recompute_s, t.saved_bytes
        source = ANALYTICAL
        if layer_costs is not None:
            measured = layer_costs.layer_cost(
                module=module,
                layer=layer,
                tp=s.tp,
                sp=s.sp,
                cp=s.cp,
                seq_len=static.tokens.tokens,
                tokens_per_rank=round(s.micro_batch * static.tokens.tokens / (s.sp * s.cp)),
                micro_batch=s.micro_batch,
                recompute=s.recompute,
            )
            if measured is not None:
                f, b, r, source = measured.forward_s, measured.backward_s, measured.recompute_s, MEASURED
                if measured.activation_bytes is not None:
                    act = measured.activation_bytes
                sources[f"{layer.name}.activations"] = MEASURED if measured.activation_bytes is not None else ANALYTICAL
        sources.setdefault(f"{layer.name}.activations", ANALYTICAL)
        sources[f"{layer.name}.time"] = source
        n = layer.count
        fwd, bwd, rc = fwd + n * f, bwd + n * b, rc + n * r
        tp_c, sp_c, cp_c = tp_c + n * t.tp_comm_s, sp_c + n * t.sp_comm_s, cp_c + n * t.cp_comm_s
        saved += n * act
        working = max(working, t.working_bytes)
        buffers = max(buffers, t.buffer_bytes)
    if s.recompute == "full":
        buffers += working

    recipe = assumptions.bytes_per_param(precision)
    params, largest = _params_per_rank(static, s.tp)
    reduce_group = s.dp * s.cp * s.sp
    shards = reduce_group if assumptions.zero_shards_over_sequence_ranks else s.dp
    trainable = not static.spec.frozen
    weights, grads, optim = model_state_bytes(params, recipe, zero=s.zero, shards=shards, frozen=not trainable)
    if s.zero == 3 and shards > 1:
        buffers += zero3_gather_bytes(largest, recipe, prefetch=assumptions.zero3_prefetch_layers, frozen=not trainable)
        bucket = largest * recipe.gradients
    else:
        bucket = bucket_bytes(params * recipe.gradients, assumptions) if trainable and reduce_group > 1 else 0.0
        buffers += bucket
        bucket = min(bucket, assumptions.communication_bucket_bytes)

    sp_link = links[1]
    handoff = handoff_per_micro_batch(
        static, s, cluster, assumptions, placement=placement, first_rank=first_rank, sp_link=sp_link
    )
    dp_comm = zero_comm_time(
        zero=s.zero,
        gradient_bytes=params * recipe.gradients,
        weight_bytes=params * recipe.weights,
        layer_weight_bytes=largest * recipe.weights,
        bucket_bytes=bucket,
        group_size=reduce_group,
        link=group_link(cluster, assumptions, stride=s.tp, size=reduce_group, **grid),
        grad_accum=s.grad_accum,
        forward_s=fwd,
        backward_s=bwd,
        trainable=trainable,
        runs_backward=static.backward != "none",
        overlap=assumptions.dp_comm_overlap,
    )
    sources["collectives"] = ANALYTICAL
    sources["states"] = ANALYTICAL
    ga = s.grad_accum
    per_mb = fwd + bwd + rc + tp_c + sp_c + cp_c + handoff
    in_flight = 1 if placement == "colocated" else min(num_stages - stage_index, ga)
    return ModuleCost(
        module=module,
        strategy=s,
        forward_s=ga * fwd,
        backward_s=ga * bwd,
        recompute_s=ga * rc,
        tp_comm_s=ga * tp_c,
        sp_comm_s=ga * sp_c,
        cp_comm_s=ga * cp_c,
        dp_comm_s=dp_comm,
        handoff_s=ga * handoff,
        per_micro_batch_s=per_mb,
        weights_bytes=math.ceil(weights),
        gradients_bytes=math.ceil(grads),
        optimizer_bytes=math.ceil(optim),
        buffers_bytes=math.ceil(buffers),
        activations_per_micro_batch_bytes=math.ceil(saved),
        in_flight_micro_batches=in_flight,
        flops_per_step=_flops_per_sample(static) * s.samples_per_step,
        sources=sources,
    )
