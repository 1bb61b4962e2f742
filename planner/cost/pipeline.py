"""Pipeline schedules' costs: the disjoint placement's two-stage pipeline (encoders -> LLM), and a module's own
pipeline parallelism (pp > 1: ``pipelined_cost``, one ``rank_cost`` per distinct pipeline rank plus the bubble).

The disjoint placement, as the runtime schedules it:

The runtime (runtime/training/trainer.py, ``_disjoint_step``) runs ``m = grad_accum`` micro-batches: the encoder group runs
at most two forwards ahead, then alternates backward and forward (F0 F1 B0 F2 B1 F3 ... B(m-1)); the LLM group
runs each micro-batch's forward and backward, in order, once its activations have arrived, and sends the
gradient back. The step is the longest path through that dependency graph (critical-path method, Kelley &
Walker 1959). With the encoder's forward F and backward B per micro-batch (P = F + B) and the LLM's T, the
longest paths are, for m >= 2,

    max(P + m T,  (m - 1) P + 2 T,  m P + T - min(F, B),  m P)

(m = 1: P + T): the LLM-bound path (first forward, every LLM micro-batch, last backward); the path alternating
between the groups; the encoder-bound path that waits once for the first LLM micro-batch; the encoder alone.
Each path is a sum of one term per stage (``path_terms``), so the CP-SAT model encodes the max with one
constraint per path. The textbook 1F1B bound ``sum P + (m - 1) max`` (Narayanan et al. 2021, Sec. 2.2)
over-estimates an encoder-bound step by min(F, T): the LLM's first micro-batch overlaps the encoder's second
forward.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import replace
from types import MappingProxyType
from typing import Literal, Sequence

from planner.cost.assumptions import DEFAULT_ASSUMPTIONS, CostAssumptions
from planner.cost.comm import (
    axis_within_node,
    p2p_time,
)
from planner.cost.layer_costs import LayerCostSource
from planner.cost.memory import model_state_bytes
from planner.cost.phases import own_peak_bytes
from planner.cost.rank_cost import (
    ModuleStatic,
    axes_within_node,
    layer_axes_within_node,
    flops_per_sample,
    layer_sums,
    module_static,
    params_per_rank,
    rank_cost,
    with_measured_collectives,
)
from planner.cost.results import ModuleCost
from planner.contract.hardware import Cluster
from planner.contract.models import ENCODER_MODULES, LayerSpec, ModelSpec
from planner.contract.schema import ZERO_BUBBLE_SCHEDULES
from planner.contract.strategy import ModuleStrategy, Precision
from planner.contract.workload import Workload, pipeline_padded

NUM_PATHS = 4
"""Critical paths ``pipeline_step_time`` takes the max of."""


def path_terms(
    per_micro_batch_s: float, forward_s: float, grad_accum: int, *, stage: Literal["encoder", "llm"]
) -> tuple[float, ...]:
    """One stage's share of each of the ``NUM_PATHS`` critical paths (module docstring).

    Args:
        per_micro_batch_s: The stage's time for one micro-batch (P for the encoder, T for the LLM).
        forward_s: The forward part of it (F; used for the encoder only).
        grad_accum: Micro-batches per step (m).
        stage: ``encoder`` or ``llm``.
    """
    m = grad_accum
    if stage == "llm":
        t = per_micro_batch_s
        return (m * t, min(m, 2) * t, t, 0.0)
    p, f = per_micro_batch_s, forward_s
    return (p, (m - 1) * p, m * p - min(f, p - f), m * p)


def pipeline_step_time(encoder_terms: Sequence[float], llm_terms: Sequence[float]) -> float:
    """Seconds from the first encoder forward to the last encoder backward: the longest critical path.

    Several encoders (vision and audio) are costed as one stage running them in turn: their terms are summed
    before this call (at least the exact value, since a sum of minima is at most the minimum of sums)."""
    return max(e + l for e, l in zip(encoder_terms, llm_terms, strict=True))


# --- Pipeline parallelism of one module (pp > 1): the schedule ----------------------------------------------------


def balanced_chunk_layers(num_layers: int, chunk_extra_s: Sequence[float], layer_s: float,
                          first_at_least: int = 1) -> tuple[int, ...]:
    """Decoder layers per model chunk (pipeline stage, or virtual stage) that minimise the slowest chunk's time
    ``extra_c + n_c * layer_s``, each chunk holding at least one layer, the first at least ``first_at_least``
    (every layer the encoder's injected features reach: ``planner.contract.rules.injection_rule``).

    A chunk's ``extra`` is what it holds besides decoder layers: the first the token embedding and the encoders'
    hand-off, the last the final norm, the vocabulary projection and the loss (at a 152K vocabulary worth several
    decoder layers), so an even split is not the balanced one. Adding layers one at a time to the chunk that stays
    fastest is optimal for identical layers (it is list scheduling of identical jobs on machines with different
    ready times; Graham 1969, whose bound is tight at 0 for unit jobs); ties go to the earliest chunk.

    Raises:
        ValueError: fewer layers than chunks need.
    """
    chunks = len(chunk_extra_s)
    first = max(1, first_at_least)
    if num_layers < chunks - 1 + first:
        raise ValueError(f"{num_layers} layers cannot fill {chunks} pipeline chunks, the first with {first}")
    counts = [first] + [1] * (chunks - 1)
    heap = [(extra + (n + 1) * layer_s, c) for c, (extra, n) in enumerate(zip(chunk_extra_s, counts))]
    heapq.heapify(heap)
    for _ in range(num_layers - sum(counts)):
        _, c = heapq.heappop(heap)
        counts[c] += 1
        heapq.heappush(heap, (chunk_extra_s[c] + (counts[c] + 1) * layer_s, c))
    return tuple(counts)


def pipeline_bubble_time(device_s: Sequence[float], virtual_stages: int,
                         weight_grad_s: Sequence[float] | None = None) -> float:
    """Idle seconds per step a pipeline adds to ``grad_accum * max(device_s)``: ``(sum_k t_k - max_k t_k) / v``.

    ``device_s[k]`` is pipeline rank k's time for one micro-batch's forward and backward over all of its chunks.
    1F1B (v = 1) takes ``sum_k t_k + (m - 1) max_k t_k`` from the first forward to the last backward (Zheng et
    al. 2022, Alpa, Eq. 2; for equal stages Narayanan et al. 2021, Sec. 2.2.1: bubble ``(p - 1) t``, a fraction
    ``(p - 1) / m``); the interleaved schedule with v chunks per rank shrinks the bubble v times (Narayanan et al.
    2021, Sec. 2.2.2: ``(p - 1) t / v``).

    Zero-bubble (``weight_grad_s[k]``: rank k's weight-gradient passes W_k per micro-batch, deferred to fill the
    bubble): ZB-H1's bubble is ``(p - 1)(T_F + T_B - T_W)`` against 1F1B's ``(p - 1)(T_F + T_B + T_W)`` (Qi et al.
    2023, "Zero Bubble Pipeline Parallelism", Sec. 3.1, B the input-gradient pass), i.e. the same formula over
    ``t_k - 2 W_k``; torch's interleaved zero-bubble schedule idles exactly ``(p - 1)(F + B - W) / v`` per chunk in
    a replay of its own order (``ScheduleInterleavedZeroBubble``, pp = 2 and 4, m = 2..16).
    """
    if len(device_s) <= 1:
        return 0.0
    if weight_grad_s is not None:
        device_s = [max(0.0, t - 2 * w) for t, w in zip(device_s, weight_grad_s, strict=True)]
    return (sum(device_s) - max(device_s)) / virtual_stages


def in_flight_chunks(stage: int, num_stages: int, grad_accum: int, virtual_stages: int,
                     zero_bubble: bool = False) -> int:
    """Model chunks whose activations pipeline rank ``stage`` holds at its peak (a chunk: 1 / v of the rank's
    layers for one micro-batch).

    1F1B (v = 1): rank k runs ``p - 1 - k`` warm-up forwards before its first backward, so it holds
    ``min(p - k, m)`` micro-batches (Narayanan et al. 2021, Sec. 2.2.1; torch's ``Schedule1F1B``). Interleaved:
    ``(v - 1) r + 2 (p - 1 - k)`` warm-up chunk forwards with ``r`` micro-batches per round (``m`` over
    ``max(1, m // p)`` rounds), capped at ``m v``, plus the one in flight (torch's ``_get_warmup_ops`` for
    ``ScheduleInterleaved1F1B``, Megatron-LM's interleaved warm-up). Interleaved zero-bubble: ``(v - 1) r + p``
    on every rank, capped at ``m v`` (a chunk's activations live until its deferred weight-gradient pass; counted
    from torch's ``ScheduleInterleavedZeroBubble`` orders for pp = 2 and 4, m = 2..16, and its saved tensors
    measured; Qi et al. 2023, Sec. 3.1: ZB-H1 keeps 1F1B's peak of p micro-batches).
    """
    p, m, v = num_stages, grad_accum, virtual_stages
    if v == 1:
        return min(p - stage, m)
    per_round = m // max(1, m // p)
    if zero_bubble:
        return min((v - 1) * per_round + p, m * v)
    return min((v - 1) * per_round + 2 * (p - 1 - stage) + 1, m * v)


# --- Pipeline parallelism of one module (pp > 1): per-rank costs -------------------------------------------------


def pipeline_chunks(static: ModuleStatic, s: ModuleStrategy, layer_costs: LayerCostSource | None,
                    within: tuple[bool, ...], extra_first_s: float, p2p_s: float) -> tuple[int, ...]:
    """Decoder layers of each of the ``pp * virtual_stages`` model chunks, balanced on time per micro-batch: the first
    chunk also runs the layers before the decoder (embedding) and receives the hand-off (``extra_first_s``), the last
    the layers after it (final norm, lm_head and the loss), and every chunk but the last sends its output and
    receives its gradient (``p2p_s``). Alike decoder layers split by ``balanced_chunk_layers``; a hybrid decoder
    (``ModuleSpec.layer_order``: Qwen3.5's linear- and full-attention layers, of different costs) by
    ``balanced_ordered_chunks`` over each instance's own cost, so that stages hold equal cost, not equal counts."""
    key = (s.tp, s.sp, s.cp, s.ep, s.micro_batch, s.recompute, s.pp, s.virtual_stages, within, extra_first_s, p2p_s)
    if layer_costs is None and key in static.chunks:
        return static.chunks[key]
    before, blocks, after = split_decoder(static.spec.layers)
    block_s = {block.name: layer_sums(static, s, within, layer_costs, (replace(block, count=1),)).total_s
               for block in blocks}
    head_s = layer_sums(static, s, within, layer_costs, before).total_s if before else 0.0
    tail_s = layer_sums(static, s, within, layer_costs, after).total_s if after else 0.0
    chunks = s.pp * s.virtual_stages
    extra = [p2p_s] * (chunks - 1) + [tail_s]
    extra[0] += head_s + extra_first_s
    first = len(static.model.injection_layers)
    if static.spec.layer_order:
        costs = [block_s[name] for name in static.spec.layer_order]
        chunks = balanced_ordered_chunks(costs, extra, first_at_least=first)
    else:
        chunks = balanced_chunk_layers(blocks[0].count, extra, block_s[blocks[0].name], first_at_least=first)
    if layer_costs is None:
        static.chunks[key] = chunks
    return chunks


def balanced_ordered_chunks(layer_s: Sequence[float], chunk_extra_s: Sequence[float],
                            first_at_least: int = 1) -> tuple[int, ...]:
    """Layers per chunk of a sequence of layers of different costs ``layer_s`` (in forward order), cut into
    contiguous chunks so that the slowest chunk's ``extra_c + sum of its layers`` is least, each chunk holding at
    least one layer, the first at least ``first_at_least``.

    The linear partition problem, solved exactly by dynamic programming over prefix sums (Skiena, "The Algorithm
    Design Manual", 2nd ed., Sec. 8.5; O(chunks x layers^2)): ``best[c][i]``, the least slowest-chunk time of the
    first i layers in c chunks, is ``min_j max(best[c-1][j], extra_c + sum(layer_s[j:i]))``. Among optimal splits
    the one whose earlier chunks hold the most layers is taken.

    Raises:
        ValueError: fewer layers than chunks need.
    """
    n, chunks = len(layer_s), len(chunk_extra_s)
    first = max(1, first_at_least)
    if n < chunks - 1 + first:
        raise ValueError(f"{n} layers cannot fill {chunks} pipeline chunks, the first with {first}")
    prefix = [0.0]
    for cost in layer_s:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(chunks + 1)]
    cut = [[0] * (n + 1) for _ in range(chunks + 1)]
    best[0][0] = 0.0
    for c in range(1, chunks + 1):
        least = first if c == 1 else 1
        for i in range(c - 1 + first, n - (chunks - c) + 1):
            for j in range(i - least, -1, -1):
                if best[c - 1][j] == inf:
                    continue
                slowest = max(best[c - 1][j], chunk_extra_s[c - 1] + prefix[i] - prefix[j])
                if slowest < best[c][i] - 1e-15:
                    best[c][i], cut[c][i] = slowest, j
    counts, i = [], n
    for c in range(chunks, 0, -1):
        counts.append(i - cut[c][i])
        i = cut[c][i]
    return tuple(reversed(counts))


PIPELINED_KINDS = ("decoder_layer",)
"""The repeated block whose instances pipeline stages divide (the LLM's decoder layers)."""


def split_decoder(layers: tuple[LayerSpec, ...]
                  ) -> tuple[tuple[LayerSpec, ...], tuple[LayerSpec, ...], tuple[LayerSpec, ...]]:
    """(layers before the decoder layers, the decoder layer types, layers after them)."""
    blocks = [i for i, layer in enumerate(layers) if layer.kind in PIPELINED_KINDS]
    first, last = blocks[0], blocks[-1]
    assert blocks == list(range(first, last + 1)), "the decoder layer types must be consecutive"
    return layers[:first], layers[first:last + 1], layers[last + 1:]


def rank_layers(layers: tuple[LayerSpec, ...], chunk_layers: tuple[int, ...], rank: int, pp: int,
                order: tuple[str, ...] = ()) -> tuple[LayerSpec, ...]:
    """The layers pipeline rank ``rank`` holds: the decoder layers of its chunks (``rank``, ``rank + pp``, ...), by
    type as ``order`` (``ModuleSpec.layer_order``) places them, the layers before the decoder on rank 0 (chunk 0),
    the ones after it on the rank of the last chunk."""
    before, blocks, after = split_decoder(layers)
    order = order or (blocks[0].name,) * sum(block.count for block in blocks)
    starts = [sum(chunk_layers[:c]) for c in range(len(chunk_layers))]
    mine = range(rank, len(chunk_layers), pp)
    names = [name for c in mine for name in order[starts[c]:starts[c] + chunk_layers[c]]]
    held = [replace(block, count=names.count(block.name)) for block in blocks if block.name in names]
    if 0 in mine:
        held = list(before) + held
    if len(chunk_layers) - 1 in mine:
        held += list(after)
    return tuple(held)


def _rank_layers(static: ModuleStatic, chunk_layers: tuple[int, ...], rank: int, pp: int) -> tuple[LayerSpec, ...]:
    """``rank_layers`` of the module, memoised."""
    key = ("rank_layers", chunk_layers, rank, pp)
    held = static.chunks.get(key)
    if held is None:
        held = static.chunks[key] = rank_layers(static.spec.layers, chunk_layers, rank, pp, static.spec.layer_order)
    return held


def pipeline_parts(s: ModuleStrategy, first_rank: int, devices_per_node: int, chunk_layers: tuple[int, ...],
                   order: tuple[str, ...] = ()
                   ) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]]:
    """(the distinct pipeline ranks as (first rank of its kind, chunks it sends onward), each rank's (index of its
    kind, chunks it holds in flight)). Ranks are alike when they hold the same chunks' worth of layers (and whether
    the first or the last), send as many chunks onward and have the same links; the first of a kind holds the most
    in flight (in-flight falls with the rank), so its cost stands for the kind. Memoised."""
    key = (s.pp, s.pp_schedule, s.virtual_stages, s.grad_accum, s.tp, s.sp, s.cp, s.dp, s.ep,
           first_rank % devices_per_node, devices_per_node, chunk_layers, order)
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
        kind = (0 in mine, num_chunks - 1 in mine, _held_mix(chunk_layers, mine, order), sends,
                axes_within_node(s, first_rank + rank * s.stage_gpus, devices_per_node))
        if kind not in kinds:
            kinds[kind] = len(parts)
            parts.append((rank, sends))
        rank_stages.append((kinds[kind], in_flight_chunks(rank, s.pp, s.grad_accum, s.virtual_stages, zero_bubble)))
    found = _PARTS[key] = (tuple(parts), tuple(rank_stages))
    return found


_PARTS: dict[tuple, tuple] = {}


def _held_mix(chunk_layers: tuple[int, ...], chunks: range, order: tuple[str, ...]) -> tuple:
    """How many decoder layers of each type the ``chunks`` hold (of one type without an ``order``)."""
    if not order:
        return (sum(chunk_layers[c] for c in chunks),)
    starts = [sum(chunk_layers[:c]) for c in range(len(chunk_layers))]
    names = [name for c in chunks for name in order[starts[c]:starts[c] + chunk_layers[c]]]
    return tuple(sorted((name, names.count(name)) for name in set(names)))


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
    bytes a sample), and as much again for their gradient when an encoder trains (runtime.training.trainer ``llm_pipeline``:
    one leaf of all micro-batches' rows, whose gradient is allocated whole by the first backward to reach it)."""
    return math.ceil((1 + backward) * grad_accum * micro_batch * per_sample)


def encoder_handoff_bytes(static: ModuleStatic) -> tuple[float, bool]:
    """(bytes per sample every encoder hands the LLM, whether any of them takes the gradient back)."""
    total, backward = 0.0, False
    for name in static.model.module_names:
        if name in ENCODER_MODULES:
            encoder = module_static(static.model, name, static.workload, static.cluster, static.assumptions)
            total += encoder.handoff_bytes_per_sample
            backward = backward or encoder.backward == "full"
    return total, backward


def pipelined_cost(
    static: ModuleStatic, s: ModuleStrategy, *, precision: Precision, first_rank: int, layer_costs: LayerCostSource | None,
    chunk_layers: tuple[int, ...] | None = None,
) -> ModuleCost:
    """The cost of a pipelined module (pp > 1): one ``rank_cost`` per distinct pipeline rank (its layers, transfers
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
    within = layer_axes_within_node(axes_within_node(s, first_rank, dpn))
    hidden = next(layer.hidden_size for layer in static.spec.layers if layer.kind in PIPELINED_KINDS)
    boundary_bytes = s.micro_batch * static.tokens.tokens / (s.sp * s.cp) * hidden * assumptions.activation_bytes
    stage_link = static.links[not _stages_within_node(s, first_rank, dpn)]
    p2p = 2 * p2p_time(boundary_bytes, stage_link) * (1 - assumptions.pp_p2p_overlap)
    per_sample, backward = encoder_handoff_bytes(static)
    # under SP a stage-0 rank takes the image rows of its slice only: all of them, or at most a slice's worth
    slice_bytes = math.ceil(static.tokens.tokens / (s.sp * s.cp)) * hidden * assumptions.activation_bytes
    slice_bytes *= static.model.handoff_tensors
    per_sample = min(per_sample, slice_bytes)
    handoff = (1 + backward) * p2p_time(s.micro_batch * per_sample, static.links[s.gpus > dpn])
    chunks = chunk_layers or pipeline_chunks(static, s, layer_costs, within, handoff, p2p)
    parts, rank_stages = pipeline_parts(s, first_rank, dpn, chunks, static.spec.layer_order)
    held = stage0_handoff_bytes(per_sample, backward, s.micro_batch, s.grad_accum)
    last = (len(chunks) - 1) % s.pp
    ranks = [
        rank_cost(static, s, _rank_layers(static, chunks, rank, s.pp), precision=precision,
                   first_rank=first_rank + rank * s.stage_gpus, layer_costs=layer_costs,
                   in_flight_chunks=rank_stages[rank][1],
                   handoff_s=handoff if rank == 0 else 0.0, pp_comm_s=p2p * sends,
                   held_handoff_bytes=held if rank == 0 else 0.0,
                   receive_buffers_bytes=pipeline_receive_buffer_bytes(boundary_bytes, s.virtual_stages, rank == 0,
                                                                       rank == last, s.grad_accum))
        for rank, sends in parts
    ]
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
        flops_per_step=flops_per_sample(static) * s.samples_per_step,
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
    static = with_measured_collectives(module_static(model, module, pipeline_padded(workload), cluster, assumptions), s,
                                        layer_costs)
    key = ("pipeline work", s.tp, s.sp, s.cp, s.ep, s.micro_batch, s.recompute)  # memoised for the analytical model
    work, weight_grad = static.sums.get(key) or _pipeline_work(static, s, layer_costs)
    if layer_costs is None:
        static.sums[key] = work, weight_grad
    v = s.virtual_stages
    filled = max(0.0, work - 2 * weight_grad) if s.pp_schedule in ZERO_BUBBLE_SCHEDULES else work
    return (s.grad_accum - 1 / v) * work / s.pp + filled / v


def pipelined_state_floor_bytes(
    model: ModelSpec, module: str, cluster: Cluster, workload: Workload, strategy: ModuleStrategy, *,
    precision: Precision, assumptions: CostAssumptions = DEFAULT_ASSUMPTIONS,
) -> float:
    """A lower bound on the per-GPU memory of a pipelined strategy (pp > 1) from its model states alone, without
    splitting it into ranks: the ranks partition the module's layers, so the heaviest holds at least ``1 / pp`` of
    the parameters a TP (and EP) rank holds, and each costs at least its ZeRO-sharded weights, gradients and optimizer
    states (``model_state_bytes`` over the module's ZeRO shards: routed experts shard over fewer ranks, and a
    pipelined FSDP stage keeps whole weights and gradients, both more). Activations, buffers and the reserve come on
    top. The planner skips costing a pipelined strategy whose bound already exceeds a GPU (exact pruning)."""
    return sum(state_floor_bytes(model, module, cluster, workload, strategy, precision=precision,
                                 assumptions=assumptions))


def state_floor_bytes(
    model: ModelSpec, module: str, cluster: Cluster, workload: Workload, strategy: ModuleStrategy, *,
    precision: Precision, assumptions: CostAssumptions = DEFAULT_ASSUMPTIONS,
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer states) of ``pipelined_state_floor_bytes``: at most what a rank of ``strategy``
    holds of each."""
    s = strategy
    static = module_static(model, module, pipeline_padded(workload), cluster, assumptions)
    params = params_per_rank(static, s.tp, s.ep, static.spec.layers)[0]
    shards = s.dp * s.cp * s.sp if assumptions.zero_shards_over_sequence_ranks else s.dp
    return model_state_bytes(params / s.pp, assumptions.bytes_per_param(precision), zero=s.zero, shards=shards,
                             frozen=static.spec.frozen)


def _pipeline_work(static: ModuleStatic, s: ModuleStrategy, layer_costs: LayerCostSource | None) -> tuple[float, float]:
    """(``S``, ``W``) of ``pipelined_step_floor_s``: one micro-batch's compute, recomputation and layer collectives
    (each on the faster link) over every layer, and its weight-gradient passes."""
    fast, slow = (layer_sums(static, s, (within,) * 4, layer_costs, static.spec.layers) for within in (True, False))
    collectives = sum(min(getattr(fast, name), getattr(slow, name))
                      for name in ("tp_comm_s", "sp_comm_s", "cp_comm_s", "ep_comm_s"))
    return fast.forward_s + fast.backward_s + fast.recompute_s + collectives, fast.weight_grad_s
