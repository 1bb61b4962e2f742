"""Analytical cost of ONE instance of a layer for ONE micro-batch on one GPU, by layer kind.

Each ``*_terms`` function lists the layer's GEMMs, attention core, elementwise traffic, saved activations
and collectives, and hands them to the formulas in ``compute``, ``memory`` and ``comm``. Widths are per rank:
TP splits heads and MLP width; Ulysses SP and CP split tokens (``Shard.tokens``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner.cost.assumptions import CostAssumptions
from planner.cost.comm import Link, all_gather_time, all_reduce_time, all_to_all_time, exposed_time, p2p_time
from planner.cost.compute import (
    attention_core_time,
    attention_flops,
    elementwise_time,
    gemm_flops,
    gemm_time,
    grouped_gemm_time,
)
from planner.cost.host import pass_time
from planner.cost.linear_attention import (
    FP32_BYTES,
    LinearWidths,
    fla_chunk_rule_transient_bytes_per_token,
    gated_delta_rule_core_flops,
    gated_delta_rule_saved_bytes_per_token,
    linear_kernel_calls,
    linear_kernel_chunks,
    linear_mixer_elementwise_elements,
    linear_widths,
    recurrent_state_bytes,
    short_conv_flops_per_token,
)
from planner.cost.op_counts import (
    LAYER_OPS,
    NO_OPS,
    PassOps,
    context_parallel_ops,
    layer_pass_ops,
    linear_attention_pass_ops,
    linear_kernel_ops,
    ops_row,
)
from planner.cost.times import PassTimes
from planner.cost.memory import (
    block_saved_bytes_per_token,
    qk_norm_saved_bytes_per_token,
    chunked_loss_logits_bytes,
    expert_dispatch_buffer_bytes,
    expert_saved_bytes_per_token,
    loss_logits_bytes,
    mlp_backward_transient_bytes,
    packed_mask_bytes,
    score_matrix_bytes,
)
from planner.contract.hardware import DeviceSpec
from planner.contract.models import LayerSpec

Backward = str
"""How much backward a module runs: ``full`` (weight + input grads), ``input`` (frozen, input grads only,
because a trainable module feeds it), ``none`` (frozen with nothing trainable upstream: forward only)."""


@dataclass(kw_only=True, frozen=True, slots=True)
class Shard:
    """How one micro-batch of a module lies on one rank, and the links its groups use."""

    tp: int
    """Tensor-parallel degree."""
    sp: int
    """Ulysses degree."""
    cp: int
    """Context-parallel degree."""
    micro_batch: int
    """Samples per micro-batch."""
    tokens: float
    """Tokens per rank per micro-batch: micro_batch * tokens_per_sample / (sp * cp)."""
    segment_tokens: float
    """Token-weighted mean length of the full-attention segments (one per image / clip / sequence)."""
    segments: float
    """Full-attention segments per sample, such that segments * segment_tokens^2 = sum of squared lengths."""
    window_tokens: float
    """Mean tokens per attention window (0 without windows)."""
    windows: float
    """Attention windows per sample."""
    recompute: str
    """none, selective or full."""
    backward: Backward
    """full, input or none."""
    tp_link: Link
    """Link of the TP groups."""
    sp_link: Link
    """Link of the Ulysses groups."""
    cp_link: Link
    """Link of the CP ring."""
    device: DeviceSpec
    """The GPU."""
    assumptions: CostAssumptions
    """Cost-model knobs."""
    ep: int = 1
    """Expert-parallel degree (mixture-of-experts layers): the data ranks of an EP group, which holds all their TP
    ranks too (``expert_group_size``)."""
    ep_link: Link | None = None
    """Link of the EP groups, ep x tp consecutive ranks (needed when a MoE layer's ep * tp > 1)."""
    loss_chunk_tokens: float = 0.0
    """Tokens per chunk of the chunked loss (``memory.loss_chunk_tokens``); 0: the whole logits at once."""


@dataclass(kw_only=True, frozen=True, slots=True)
class LayerTerms(PassTimes):
    """Cost of one layer instance for one micro-batch on one rank: its pass times (collectives of forward, backward
    and recomputed forward) and its memory."""

    saved_bytes: float
    """Activations kept for backward under the recompute mode."""
    working_bytes: float
    """Activations a recomputable block holds while its backward runs (what full recomputation re-creates);
    0 for layers that are never recomputed."""
    buffer_bytes: float
    """Transient bytes alive while the layer runs its forward (loss logits, all-to-all and ring buffers)."""
    backward_buffer_bytes: float
    """... while it runs its backward (the loss's gradients, all-to-all and ring buffers)."""
    loss_saved_bytes: float
    """Of ``saved_bytes``, what the loss's backward frees as it ends (the fp32 log-softmax); 0 for other layers."""
    flops: float
    """Forward model FLOPs on this rank (GEMMs + attention core)."""
    backward_flops: float
    """Backward model FLOPs on this rank (no recomputation)."""
    weight_grad_s: float = 0.0
    """Of ``backward_s``, the weight-gradient pass (``weight_gradient_time``)."""


def gemm_backward_factor(backward: Backward, assumptions: CostAssumptions) -> float:
    """Backward/forward ratio of a GEMM: 2 with weight gradients, 1 for input gradients only, else 0.

    Source: Narayanan et al. 2021, Sec. 5.1 (backward = 2x forward: one GEMM for the input gradient, one
    for the weight gradient); a frozen weight skips the weight-gradient GEMM.
    """
    if backward == "full":
        return assumptions.backward_to_forward_flops
    if backward == "input":
        return assumptions.backward_to_forward_flops / 2
    return 0.0


def weight_gradient_time(backward_s: float, backward_device_s: float, gemm_s: float, backward: Backward,
                         assumptions: CostAssumptions) -> float:
    """The part of a layer's ``backward_s`` that computes weight gradients: its GEMMs' weight-gradient half of the
    backward's device time (``gemm_s * backward_to_forward_flops / 2`` of ``backward_device_s``), the same share of
    the pass time. A zero-bubble schedule defers exactly this pass to fill the pipeline's bubble.

    Source: Narayanan et al. 2021, Sec. 5.1 (a GEMM's backward is one GEMM for the input gradient and one for the
    weight gradient); Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Sec. 2 (the backward split into B, the
    input gradient, and W, the weight gradient). A frozen layer has none.
    """
    if backward != "full" or backward_device_s <= 0:
        return 0.0
    return backward_s * gemm_s * assumptions.backward_to_forward_flops / 2 / backward_device_s


def _gemms(shapes: tuple[tuple[float, float, float], ...], shard: Shard) -> tuple[float, float]:
    """(seconds, FLOPs) of a list of (m, n, k) GEMMs."""
    seconds = flops = 0.0
    for m, n, k in shapes:
        seconds += gemm_time(m, n, k, shard.device, shard.assumptions)
        flops += gemm_flops(m, n, k)
    return seconds, flops


def _terms(
    shard: Shard,
    *,
    ops: tuple[PassOps, PassOps],
    attention_ops: PassOps = NO_OPS,
    gemm_s: float,
    gemm_flops_: float,
    attention_s: float = 0.0,
    attention_flops_: float = 0.0,
    elementwise_s: float,
    saved: float,
    working: float | None = None,
    buffers: float = 0.0,
    backward_buffers: float | None = None,
    loss_saved: float = 0.0,
    tp_fwd: float = 0.0,
    tp_bwd: float = 0.0,
    sp_fwd: float = 0.0,
    sp_bwd: float = 0.0,
    cp_fwd: float = 0.0,
    cp_bwd: float = 0.0,
    cp_overlap: float | None = None,
    ep_fwd: float = 0.0,
    ep_bwd: float = 0.0,
    recomputable: bool = False,
    input_grad: bool = True,
) -> LayerTerms:
    """Assemble LayerTerms from forward pieces; backward, recompute and exposure follow the module's modes.

    ``backward_buffers`` defaults to ``buffers`` (the same exchange buffers run both ways). ``cp_overlap``: the
    fraction of the CP collectives the attention compute hides (default ``cp_comm_overlap``, the ring's).
    ``input_grad=False`` marks a first layer whose input (pixels, mel frames) needs no gradient: its backward
    is the weight-gradient GEMM only. ``ops`` are the (forward, backward) operator calls: each pass takes the
    longer of its device work and its host dispatch (``host.pass_time``); ``attention_ops`` are the calls of the
    attention core alone, which selective recomputation re-dispatches.
    """
    a = shard.assumptions
    runs_backward = shard.backward != "none"
    gemm_bwd = gemm_backward_factor(shard.backward, a)
    if not input_grad:
        gemm_bwd = max(0.0, gemm_bwd - a.backward_to_forward_flops / 2)
    attn_bwd = a.attention_backward_ratio() if runs_backward else 0.0
    elem_bwd = a.backward_to_forward_flops if runs_backward else 0.0
    forward_ops, backward_ops = ops
    forward = pass_time(gemm_s + attention_s + elementwise_s, forward_ops, shard.device, a)
    backward = backward_device = 0.0
    if runs_backward:
        backward_device = gemm_s * gemm_bwd + attention_s * attn_bwd + elementwise_s * elem_bwd
        backward = pass_time(backward_device, backward_ops, shard.device, a)
    rc = shard.recompute if (recomputable and runs_backward) else "none"
    recompute = 0.0
    if rc == "selective":
        recompute = pass_time(attention_s, attention_ops, shard.device, a)
    elif rc == "full":
        recompute = forward
    if not runs_backward:
        tp_bwd = sp_bwd = cp_bwd = ep_bwd = 0.0
        saved = working = 0.0
    if rc == "full":
        tp_fwd, sp_fwd, ep_fwd = 2 * tp_fwd, 2 * sp_fwd, 2 * ep_fwd
    cp_overlap = a.cp_comm_overlap if cp_overlap is None else cp_overlap
    cp_exposed = (exposed_time(cp_fwd, attention_s, cp_overlap)
                  + exposed_time(cp_bwd, attention_s * attn_bwd, cp_overlap))
    if rc != "none":
        cp_exposed += exposed_time(cp_fwd, attention_s, cp_overlap)
    return LayerTerms(
        forward_s=forward,
        backward_s=backward,
        recompute_s=recompute,
        tp_comm_s=(tp_fwd + tp_bwd) * (1 - a.tp_comm_overlap),
        sp_comm_s=(sp_fwd + sp_bwd) * (1 - a.sp_comm_overlap),
        cp_comm_s=cp_exposed,
        ep_comm_s=ep_fwd + ep_bwd,
        saved_bytes=saved,
        working_bytes=(saved if working is None else working) if recomputable else 0.0,
        buffer_bytes=buffers,
        backward_buffer_bytes=(buffers if backward_buffers is None else backward_buffers) if runs_backward else 0.0,
        loss_saved_bytes=loss_saved if runs_backward else 0.0,
        flops=gemm_flops_ + attention_flops_,
        backward_flops=gemm_flops_ * gemm_bwd + attention_flops_ * elem_bwd,
        weight_grad_s=weight_gradient_time(backward, backward_device, gemm_s, shard.backward, a),
    )


def ulysses_all_to_all_time(tokens: float, q_width: float, kv_width: float, shard: Shard) -> float:
    """Forward Ulysses exchange of one full-attention layer: all-to-alls of q, k, v (sequence -> head sharded)
    and of the output (head -> sequence sharded), each holding ``tokens x width`` per rank.

    Source: Jacobs et al. 2023, DeepSpeed-Ulysses, Sec. 3.1-3.2 (four all-to-alls per attention forward, the
    same in backward). K/V heads fewer than sp are replicated to sp before the exchange.
    """
    e = shard.assumptions.activation_bytes
    q_and_out = 2 * all_to_all_time(tokens * q_width * e, shard.sp, shard.sp_link)
    k_and_v = 2 * all_to_all_time(tokens * kv_width * e, shard.sp, shard.sp_link)
    return q_and_out + k_and_v


def expert_group_size(shard: Shard) -> int:
    """Ranks a mixture-of-experts layer's experts are split over, each holding ``num_experts / (ep * tp)`` whole
    experts: an EP group is ``ep`` data ranks with all their ``tp`` ranks (torchtitan's etp=1, where EP borrows the TP
    ranks: torchtitan/distributed/parallel_dims.py; transformers ``AllToAllEP``,
    transformers/distributed/expert_parallel.py). 1: one rank holds every expert."""
    return shard.ep * shard.tp


def expert_all_to_all_time(tokens: float, layer: LayerSpec, shard: Shard) -> float:
    """Forward token exchange of one mixture-of-experts layer on the busiest rank of its EP group
    (``expert_group_size``, ep x tp ranks). The TP ranks of a batch each route a disjoint ``1 / tp`` slice of the
    ``tokens`` they share: the dispatch all-to-all sends the slice's ``experts_per_token`` routed copies (``tokens / tp
    x k x hidden`` activations) to the ranks holding their experts and the combine all-to-all returns the experts'
    outputs; ``(n - 1) / n`` of the bytes leave the rank (``all_to_all_time`` over the n = ep * tp ranks),
    ``moe_load_imbalance`` times the mean on the busiest rank, over NVLink or the NIC as the EP group spans nodes. With
    tp > 1 the TP group then all-gathers its slices' outputs (``tokens x hidden``, ``all_gather_time`` on the TP link).
    The backward runs both all-to-alls again on the gradients and adds one more all-gather over TP: the backward of
    the input's Replicate -> Shard(0) slicing gathers the row gradients (``tokens x hidden``), while the combine's
    all-gather has a local slice for backward. So the backward costs this same time (``block_terms``' ``ep_bwd``).

    Source: Lepikhin et al. 2020, "GShard", Sec. 2.2 (dispatch and combine all-to-alls around the experts);
    Rajbhandari et al. 2022, "DeepSpeed-MoE", Sec. 5.1 (the all-to-all volume, tokens x k x hidden per rank);
    torchtitan's etp=1 ("ep borrows tp": torchtitan/distributed/parallel_dims.py, the MoE ``ExpertParallel`` of
    torchtitan/distributed/expert_parallel.py) and transformers ``AllToAllEP`` (transformers/distributed/
    expert_parallel.py: ``_dispatch_tokens`` slices the tokens over TP, ``_combine_tokens`` all-gathers them).
    """
    s, moe = shard, layer.moe
    if moe is None or expert_group_size(s) == 1:
        return 0.0
    e = s.assumptions.activation_bytes
    volume = tokens / s.tp * moe.experts_per_token * layer.hidden_size * e
    exchange = 2 * all_to_all_time(volume * rank_load_imbalance(s), expert_group_size(s), s.ep_link)
    return exchange + all_gather_time(tokens * layer.hidden_size * e, s.tp, s.tp_link)


def ring_kv_pass_time(kv_block_bytes: float, shard: Shard) -> float:
    """Forward ring-attention communication of one layer: cp - 1 point-to-point passes of a KV block (of as many
    heads as the queries: runtime.parallel.ring repeats grouped KV heads before the ring).

    Source: Liu et al. 2023, "Ring Attention with Blockwise Transformers", Sec. 3 (each host sends its KV
    block to the next while computing on the current one); the backward passes KV and dKV, twice this.
    """
    return (shard.cp - 1) * p2p_time(kv_block_bytes, shard.cp_link)


def replicated_kv_backward_time(layer: LayerSpec, shard: Shard) -> float:
    """Backward all-reduces a decoder layer adds when TP is a multiple of its KV heads (each KV head replicated
    on tp / kv ranks, as ``runtime.parallel.tensor_parallel.ReplicatedHeadsColwise`` runs it): for each of the K
    and V projections, its input gradient (``tokens x h``), its weight gradient (``h x kv d``) and its bias
    gradient (``kv d``), each summed over the TP ranks by an all-reduce of its own, in the activation dtype. Zero
    when TP divides the KV heads (then k/v are column-parallel like q).

    Source: Shoeybi et al. 2019 (Megatron-LM), Sec. 3: the "f" operator (identity forward, all-reduce backward)
    on a projection whose weight every TP rank holds; all-reduce cost as ``all_reduce_time``.
    """
    a, s, e = layer.attention, shard, shard.assumptions.activation_bytes
    if a is None or layer.kind != "decoder_layer" or s.tp == 1 or a.num_kv_heads % s.tp == 0:
        return 0.0
    width = a.num_kv_heads * a.head_dim
    per_projection = sum(all_reduce_time(elements * e, s.tp, s.tp_link)
                         for elements in (s.tokens * layer.hidden_size, layer.hidden_size * width, width))
    return 2 * per_projection


def _block_gemm_shapes(layer: LayerSpec, shard: Shard) -> tuple[tuple[float, float, float], ...]:
    """(m, n, k) of every GEMM of a block on one rank: QKV (fused in encoders, separate q/k/v in the decoder,
    K/V heads replicated when tp exceeds them; a gated attention's q_proj also writes the output gate, twice the
    query width), output projection, and the TP-split feed-forward (``feed_forward_gemm_shapes``)."""
    a, m, h, tp = layer.attention, shard.tokens, layer.hidden_size, shard.tp
    q = a.num_heads * a.head_dim / tp
    kv = max(a.num_kv_heads, tp) / tp * a.head_dim
    q_out = 2 * q if a.output_gate else q
    qkv = ((m, q_out, h), (m, kv, h), (m, kv, h)) if layer.kind == "decoder_layer" else ((m, q + 2 * kv, h),)
    return qkv + ((m, h, q),) + feed_forward_gemm_shapes(layer, shard)


def dense_feed_forward_width(layer: LayerSpec) -> int:
    """Hidden width of a layer's TP-split SwiGLU (or plain) MLP: its ``mlp``, or a mixture-of-experts layer's shared
    expert (0: none)."""
    if layer.mlp is not None:
        return layer.mlp.intermediate_size
    return layer.moe.shared_expert_intermediate_size if layer.moe is not None else 0


def feed_forward_gemm_shapes(layer: LayerSpec, shard: Shard) -> tuple[tuple[float, float, float], ...]:
    """(m, n, k) of the TP-split feed-forward GEMMs: the MLP (SwiGLU: gate, up, down), or a mixture-of-experts
    layer's shared expert (SwiGLU, column- then row-parallel as transformers' ``base_model_tp_plan`` of Qwen3.5-MoE
    splits it) and its sigmoid gate (h -> 1, replicated); the routed experts are ``expert_terms``."""
    m, h, tp = shard.tokens, layer.hidden_size, shard.tp
    width = dense_feed_forward_width(layer)
    if width == 0:
        return ()
    f = width / tp
    if layer.mlp is not None and not layer.mlp.gated:
        return ((m, f, h), (m, h, f))
    gate = ((m, 1, h),) if layer.mlp is None else ()
    return ((m, f, h), (m, f, h), (m, h, f)) + gate


def tp_all_reduces(layer: LayerSpec) -> int:
    """All-reduces of a block's output per pass under TP (Shoeybi et al. 2019, Sec. 3): one after the token mixer,
    one after a TP-split feed-forward (a dense MLP or a shared expert; routed experts meet in the expert exchange)."""
    return 1 + (dense_feed_forward_width(layer) > 0)


def attention_calls(layer: LayerSpec, shard: Shard) -> float:
    """Attention-kernel calls of one block on one rank per micro-batch: one per window or segment the rank attends
    (``sdpa``: transformers' Qwen-VL vision attention loops ``cu_seqlens`` with one SDPA call each), or one for
    them all (``varlen``: a single variable-length call over ``cu_seqlens``, FlashAttention-2's varlen API; Dao
    2023, Sec. 3.3 / torch's ``varlen_attn``)."""
    s = shard
    windowed = bool(layer.attention.window_patches) and s.windows > 0
    segments = (s.windows / s.sp if windowed else s.segments) * s.micro_batch
    return min(segments, 1.0) if s.assumptions.attention_calls == "varlen" else segments


def dense_packed_mask(layer: LayerSpec, shard: Shard) -> bool:
    """Whether a decoder's packed row (several samples, ``segments > 1``) runs one masked SDPA call: transformers'
    packed-sequence mask ([B, 1, L, L] booleans, built from the position ids) with per-segment calls (``sdpa``)
    and the whole row on the rank; Ulysses attends segment by segment, ``varlen`` takes ``cu_seqlens``, ring CP
    gathers its own mask (``packed_context_parallel``). The masked kernel computes every block of the row (no
    causal or segment skipping)."""
    s = shard
    return (layer.attention.causal and s.segments > 1 and s.assumptions.attention_calls == "sdpa"
            and s.sp == 1 and s.cp == 1)


def packed_context_parallel(layer: LayerSpec, shard: Shard) -> bool:
    """Whether a decoder's packed row (several samples, ``segments > 1``) runs over ring CP, which then takes the
    all-gather form (runtime.parallel.ring; Llama Team 2024, "The Llama 3 Herd of Models", Sec. 3.3.2): each CP
    rank gathers the group's keys and values and attends its queries to the whole row in one SDPA call under a
    ``[row / cp, row]`` sample-and-causal boolean mask, every block computed (torch's ring passes one mask to every
    block, and a sample boundary can fall in any of them)."""
    return layer.attention.causal and shard.segments > 1 and shard.cp > 1


def gathered_context_parallel(layer: LayerSpec, shard: Shard) -> bool:
    """Whether a block's attention over CP takes the all-gather form: a decoder's packed row
    (``packed_context_parallel``), or a bidirectional block (the vision tower's full attention: each CP rank's
    queries attend their own image's or temporal group's keys over the gathered sequence, per segment, no mask;
    runtime.parallel.ring ``gathered_bidirectional_attention``). Window blocks keep whole windows on a rank: no CP
    exchange."""
    return packed_context_parallel(layer, shard) or (not layer.attention.causal and shard.cp > 1)


def context_parallel_form(layer: LayerSpec, shard: Shard) -> str:
    """The form a block's attention takes over CP (a row of ``op_counts.CONTEXT_PARALLEL_OPS``): a decoder's packed
    row gathers under a mask (``gathered_masked``), a bidirectional block gathers per segment (``gathered``), else
    the causal ring (``ring``)."""
    if packed_context_parallel(layer, shard):
        return "gathered_masked"
    return "gathered" if gathered_context_parallel(layer, shard) else "ring"


def _keeps_windows(layer: LayerSpec, shard: Shard) -> bool:
    """Whether a block attends per window (its windows stay whole on a rank: no CP exchange)."""
    return bool(layer.attention.window_patches) and shard.windows > 0


def ring_kv_block_bytes(layer: LayerSpec, shard: Shard) -> float:
    """Bytes of one rank's keys and values of a block, of as many heads as the queries (grouped KV heads are
    repeated to the query heads: the kernels take equal heads)."""
    a = layer.attention
    return shard.tokens * 2 * a.num_heads / shard.tp * a.head_dim * shard.assumptions.activation_bytes


def ring_calls(layer: LayerSpec, shard: Shard) -> tuple[PassOps, PassOps]:
    """(forward, backward) operator calls ring CP adds to one instance of a block (``block_terms``) on ``shard``:
    those of its form (``context_parallel_form``); none on a window-attention block."""
    return context_parallel_ops(context_parallel_form(layer, shard), 1 if _keeps_windows(layer, shard) else shard.cp)


def ring_collective_times(layer: LayerSpec, shard: Shard) -> tuple[float, float]:
    """(forward, backward) seconds of the collectives ring CP runs in one instance of a block (``block_terms``):
    the gathered forms' all-gather and all-reduce (``packed_context_parallel_terms``), else the ring's KV passes,
    twice as many in the backward (KV and dKV); none on a window-attention block or at cp = 1."""
    if shard.cp == 1 or _keeps_windows(layer, shard):
        return 0.0, 0.0
    kv_block = ring_kv_block_bytes(layer, shard)
    if gathered_context_parallel(layer, shard):
        forward, backward, *_ = packed_context_parallel_terms(kv_block, shard, masked=layer.attention.causal)
        return forward, backward
    forward = ring_kv_pass_time(kv_block, shard)
    return forward, 2 * forward


def packed_context_parallel_terms(kv_block: float, shard: Shard, masked: bool = True
                                  ) -> tuple[float, float, float, float, float]:
    """(forward and backward collective seconds, forward and backward transient bytes, saved bytes beyond the
    rank's own keys and values) of one layer's all-gather CP (``gathered_context_parallel``), from its own key/value
    block of ``kv_block`` bytes (as many heads as the queries).

    The forward all-gathers ``cp`` blocks, the backward all-reduces their gradient and each rank keeps its part
    (``_GatherSequence``: gloo has no reduce-scatter); neither overlaps the attention, which waits for the whole
    gather. Without recomputation SDPA keeps the gathered blocks for its backward, the ``cp - 1`` other ranks'
    beyond the rank's own; otherwise they are transient in the forward and gathered again in the backward, beside
    their gradient. A packed row's mask (``masked``: one boolean per (query, key) pair of the rank's ``row / cp``
    positions against the row) lives through both passes (``packed_mask_bytes`` of a row, ``1 / cp`` of its
    queries); a bidirectional block slices its segments instead and builds none."""
    s = shard
    gathered = s.cp * kv_block
    mask = packed_mask_bytes(s.segment_tokens * s.segments, s.micro_batch) / s.cp if masked else 0.0
    kept = s.recompute == "none" and s.backward != "none"
    forward_buffers = mask + (0.0 if kept else gathered)
    backward_buffers = mask + gathered * (1 if kept else 2)
    saved = (s.cp - 1) * kv_block if kept else 0.0
    return (all_gather_time(gathered, s.cp, s.cp_link), all_reduce_time(gathered, s.cp, s.cp_link), forward_buffers,
            backward_buffers, saved)


def _block_attention(layer: LayerSpec, shard: Shard) -> tuple[float, float, float, bool]:
    """(seconds, FLOPs, score elements, windowed) of a block's attention core on one rank.

    Heads are split by tp and sp (Ulysses attends full segments on a head shard), queries by cp; window blocks
    attend per window, full blocks per segment, causal kernels skip masked blocks (eager computes them all); a
    packed row under a dense mask (``dense_packed_mask``, ``packed_context_parallel``) is one segment of the whole
    row, every block computed.
    """
    a, s, asm = layer.attention, shard, shard.assumptions
    heads = a.num_heads / (s.tp * s.sp)
    windowed = _keeps_windows(layer, s)
    seg, num_seg = (s.window_tokens, s.windows) if windowed else (s.segment_tokens, s.segments)
    causal = asm.causal_attention_flops_fraction if a.causal and asm.attention_implementation != "eager" else 1.0
    if dense_packed_mask(layer, s) or packed_context_parallel(layer, s):
        seg, num_seg, causal = s.segment_tokens * s.segments, 1.0, 1.0
    flops = attention_flops(seg, num_seg * s.micro_batch, heads * a.head_dim, causal) / s.cp
    scores = seg * seg * num_seg * s.micro_batch * heads / s.cp
    return attention_core_time(flops, seg / s.cp, scores, s.device, asm), flops, scores, windowed


def _block_saved(layer: LayerSpec, shard: Shard, scores: float, recompute: str) -> float:
    """Bytes a block keeps for backward on one rank (``block_saved_bytes_per_token`` x tokens + scores, plus a
    vision block's fp32 rotary copies of q and k). Inside Ulysses attention a rank holds all tokens of heads/sp,
    i.e. the same count per token of its shard; K/V heads fewer than tp*sp are replicated."""
    a, s = layer.attention, shard
    q_width = a.num_heads * a.head_dim / s.tp
    rotary = 2 * q_width * s.assumptions.vision_rotary_upcast_bytes
    if layer.kind != "vision_block" or recompute == "full":
        rotary = 0.0
    per_token = rotary + block_saved_bytes_per_token(
        hidden=layer.hidden_size,
        q_width=a.num_heads * a.head_dim / s.tp,
        kv_width=max(a.num_kv_heads, s.tp * s.sp) / s.tp * a.head_dim,
        mlp_width=dense_feed_forward_width(layer) / s.tp,
        gated=layer.mlp is None or layer.mlp.gated,
        heads=a.num_heads / s.tp,
        tp=s.tp,
        recompute=recompute,
        assumptions=s.assumptions,
    )
    if a.output_gate and recompute != "full":  # the gate and the attention output it scales
        per_token += 2 * q_width * s.assumptions.activation_bytes
    if a.qk_norm and recompute != "full":
        # on the rank's own heads, before any Ulysses repeat of the KV heads (TP replicates those fewer than tp)
        per_token += qk_norm_saved_bytes_per_token(q_width, max(a.num_kv_heads, s.tp) / s.tp * a.head_dim,
                                                   s.assumptions)
    experts = expert_terms(layer, s)[2] if layer.moe is not None and recompute != "full" else 0.0
    return s.tokens * per_token + score_matrix_bytes(scores, recompute, s.assumptions) + experts


def block_elementwise_elements(layer: LayerSpec, shard: Shard) -> float:
    """Elements read + written by a block's memory-bound ops on one rank: 2 norms (2h each), 2 residual adds
    (3h each), rotary on q and k (read + write), the MLP activation (SwiGLU: read gate and up, write one)."""
    a, tp = layer.attention, shard.tp
    h = layer.hidden_size / tp if shard.assumptions.megatron_sequence_parallel else layer.hidden_size
    rotary = 2 * (a.num_heads + max(a.num_kv_heads, tp)) * a.head_dim / tp
    gate = 3 * a.num_heads * a.head_dim / tp if a.output_gate else 0.0
    if layer.mlp is None:
        shared = 3 * dense_feed_forward_width(layer) / tp
        return shard.tokens * (10 * h + rotary + gate + shared) + expert_elementwise_elements(layer, shard)
    activation = (3 if layer.mlp.gated else 2) * layer.mlp.intermediate_size / tp
    return shard.tokens * (10 * h + rotary + gate + activation)


def expert_elementwise_elements(layer: LayerSpec, shard: Shard) -> float:
    """Elements read + written by a mixture-of-experts layer's memory-bound ops on the busiest rank: the router's
    softmax and top-k over all its tokens (read and write its ``num_experts`` logits per token; the router is
    replicated on TP ranks), and per routed copy of its TP slice (``tokens / tp x k``, ``expert_terms``) the
    permutation into expert order and back (read + write ``2 h``), the SwiGLU activation of a whole expert (read gate
    and up, write one, ``3 f``) and the routing weight's scaling and sum (read + write ``2 h``)."""
    moe, h = layer.moe, layer.hidden_size
    copies = shard.tokens / shard.tp * moe.experts_per_token * rank_load_imbalance(shard)
    return shard.tokens * 2 * moe.num_experts + copies * (6 * h + 3 * moe.expert_intermediate_size)


def expert_terms(layer: LayerSpec, shard: Shard) -> tuple[float, float, float, float]:
    """(seconds, model FLOPs, saved bytes, exchange buffer bytes) of the router and the routed experts of one
    mixture-of-experts layer's forward on one rank.

    Router: a ``tokens x hidden x num_experts`` GEMM (2 t h E FLOPs), replicated on TP ranks (all ``tokens``).
    Experts: the rank's ``num_experts / (ep * tp)`` whole experts (``expert_group_size``) run three grouped GEMMs
    (gate, up: ``h -> f``; down: ``f -> h``) over the routed copies it receives, on average its TP slice's ``tokens /
    tp x k`` (6 t k h f / tp FLOPs, the FLOPs of the model), times ``moe_load_imbalance`` on the busiest rank, which
    sets the time, at ``grouped_gemm_efficiency`` of the tokens each of its experts gets. Saved activations and the
    exchange buffers count the slice's copies, the router's softmax all tokens.
    Source: Fedus et al. 2022 (Switch Transformer), Sec. 2.1-2.2 (top-k routing, capacity); Gale et al. 2023
    (MegaBlocks), Sec. 3 (experts as grouped GEMMs); the TP slicing of torchtitan's etp=1 and transformers
    ``AllToAllEP`` (``expert_all_to_all_time``).
    """
    moe, s, h = layer.moe, shard, layer.hidden_size
    f = moe.expert_intermediate_size
    imbalance = rank_load_imbalance(s)
    local_experts = moe.num_experts / expert_group_size(s)
    copies = s.tokens / s.tp * moe.experts_per_token
    per_expert = copies * imbalance / local_experts
    router_s, router_flops = _gemms(((s.tokens, moe.num_experts, h),), s)
    experts_s = sum(grouped_gemm_time(per_expert, local_experts, n, k, s.device, s.assumptions)
                    for n, k in ((f, h), (f, h), (h, f)))
    flops = router_flops + 3 * gemm_flops(copies, f, h)
    saved = s.tokens * expert_saved_bytes_per_token(
        hidden=h, expert_width=f, num_experts=moe.num_experts, experts_per_token=moe.experts_per_token,
        load_imbalance=imbalance, tp=s.tp, assumptions=s.assumptions)
    buffers = expert_dispatch_buffer_bytes(s.tokens / s.tp, h, moe.experts_per_token, imbalance,
                                           s.assumptions.activation_bytes) if expert_group_size(s) > 1 else 0.0
    return router_s + experts_s, flops, saved, buffers


def rank_load_imbalance(shard: Shard) -> float:
    """Routed tokens of the busiest rank over the mean: ``moe_load_imbalance`` when experts are split over ranks
    (``expert_group_size`` > 1), 1 when one rank holds them all (it then receives exactly its own tokens' copies)."""
    return shard.assumptions.moe_load_imbalance if expert_group_size(shard) > 1 else 1.0


def block_terms(layer: LayerSpec, shard: Shard) -> LayerTerms:
    """A transformer block (ViT/Whisper encoder block or GQA + SwiGLU decoder layer).

    GEMMs per Narayanan et al. 2021 (eq. 3 accounting), attention core per segment/window, elementwise
    traffic, Korthikanti activations. TP: 2 all-reduces of the block output in forward and 2 in backward
    (Shoeybi et al. 2019, Megatron-LM, Sec. 3, Fig. 4), plus ``replicated_kv_backward_time`` when TP replicates
    KV heads; a mixture-of-experts layer's router and whole experts are not TP-split (transformers'
    ``base_model_tp_plan`` of Qwen3-VL-MoE splits attention only), so only attention's 1 + 1 remain, and its TP
    ranks meet in the expert exchange instead (``expert_all_to_all_time``). Ulysses and CP exchange only around full
    attention; window blocks keep whole windows on a rank. Ring CP passes KV blocks (KV + dKV in backward); a
    packed row and a bidirectional block gather them instead (``packed_context_parallel_terms``).
    """
    s, e, a = shard, shard.assumptions.activation_bytes, layer.attention
    gemm_s, gemm_fl = _gemms(_block_gemm_shapes(layer, s), s)
    attn_s, attn_fl, scores, windowed = _block_attention(layer, s)
    tp_ar = tp_all_reduces(layer) * all_reduce_time(s.tokens * layer.hidden_size * e, s.tp, s.tp_link)
    sp_fwd = buffers = cp_fwd = cp_bwd = cp_buffers = cp_backward_buffers = cp_saved = cp_working = 0.0
    cp_overlap = None
    if layer.moe is not None:
        experts_s, experts_fl, _, buffers = expert_terms(layer, s)
        gemm_s, gemm_fl = gemm_s + experts_s, gemm_fl + experts_fl
    if s.sp > 1 and not windowed:
        q, kv = a.num_heads * a.head_dim, max(a.num_kv_heads, s.sp) * a.head_dim
        sp_fwd = ulysses_all_to_all_time(s.tokens, q, kv, s)
        buffers = max(buffers, s.tokens * 2 * (q + kv) * e)
    if s.cp > 1 and not windowed:
        kv_block = ring_kv_block_bytes(layer, s)
        if gathered_context_parallel(layer, s):
            cp_fwd, cp_bwd, cp_buffers, cp_backward_buffers, cp_saved = packed_context_parallel_terms(
                kv_block, s, masked=a.causal)
            cp_working, cp_overlap = (s.cp - 1) * kv_block, 0.0
        else:
            cp_fwd, cp_bwd = ring_collective_times(layer, s)
            cp_buffers = cp_backward_buffers = 2 * kv_block
        buffers += cp_buffers
    if dense_packed_mask(layer, s):
        buffers += packed_mask_bytes(s.segment_tokens * s.segments, s.micro_batch)
    mlp_backward = _mlp_backward_bytes(layer, s)
    calls = attention_calls(layer, s)
    forward_ops, backward_ops = layer_pass_ops(ops_row(layer), tp=s.tp, segments=calls,
                                               ulysses=s.sp > 1 and not windowed)
    cp_forward_ops, cp_backward_ops = ring_calls(layer, s)
    return _terms(
        s,
        ops=(forward_ops.plus(cp_forward_ops), backward_ops.plus(cp_backward_ops)),
        attention_ops=NO_OPS.plus(LAYER_OPS[ops_row(layer)].per_segment_forward, calls).plus(cp_forward_ops),
        gemm_s=gemm_s,
        gemm_flops_=gemm_fl,
        attention_s=attn_s,
        attention_flops_=attn_fl,
        elementwise_s=elementwise_time(block_elementwise_elements(layer, s), s.device, s.assumptions),
        saved=_block_saved(layer, s, scores, s.recompute) + cp_saved,
        working=_block_saved(layer, s, scores, "none") + cp_working,
        buffers=buffers,
        backward_buffers=max(buffers - cp_buffers + cp_backward_buffers, mlp_backward),
        tp_fwd=tp_ar,
        tp_bwd=tp_ar + replicated_kv_backward_time(layer, s),
        sp_fwd=sp_fwd,
        sp_bwd=sp_fwd,
        cp_fwd=cp_fwd,
        cp_bwd=cp_bwd,
        cp_overlap=cp_overlap,
        ep_fwd=expert_all_to_all_time(s.tokens, layer, s),
        ep_bwd=expert_all_to_all_time(s.tokens, layer, s),
        recomputable=True,
    )


def _mlp_backward_bytes(layer: LayerSpec, shard: Shard) -> float:
    """``mlp_backward_transient_bytes`` of a layer's TP-split MLP or shared expert (0 without one)."""
    width = dense_feed_forward_width(layer)
    if width == 0:
        return 0.0
    gated = layer.mlp is None or layer.mlp.gated
    return mlp_backward_transient_bytes(shard.tokens, width / shard.tp, shard.assumptions, gated=gated)


def linear_attention_block_terms(layer: LayerSpec, shard: Shard) -> LayerTerms:
    """A hybrid model's Gated DeltaNet decoder layer (``planner.cost.linear_attention``): the projections
    in_proj_qkv / in_proj_z / in_proj_a / in_proj_b and out_proj, column- then row-parallel over both head kinds;
    the short conv, gates, l2 norms and gated RMSNorm as memory-bound traffic; the chunked gated delta rule at the
    attention kernel's efficiency for chunk-long blocks (``attention_core_time`` with ``C`` keys), its backward
    ``attention_backward_ratio`` times the forward, as selective recomputation re-runs it; the feed-forward as in
    ``block_terms``. TP: 2 all-reduces per pass (out_proj, the MLP's down). Ulysses: all-to-alls of the conv's input
    and the a / b gates to head-sharded whole sequences (the conv and the recurrence then run unchanged on each
    sequence) and of the rule's output back, in forward, and again in backward. Ring CP is refused by
    ``planner.contract.rules.linear_attention_rules`` (nothing priced). The kernel's transients
    (``_linear_kernel_transient_bytes``) come on top of the exchange buffers in each pass. Operator calls
    (``linear_attention_pass_ops``): the layer's fixed calls, and its kernel's: on ``torch``, per conv and rule call
    (``linear_kernel_calls``) and per iteration of the rule's loop over chunks (``linear_kernel_chunks``); on
    ``fla``, a fixed number; selective recomputation re-dispatches the kernel's forward calls."""
    s, asm = shard, shard.assumptions
    e, h, m = asm.activation_bytes, layer.hidden_size, shard.tokens
    w = linear_widths(layer, s.tp)
    value = w.value_heads * w.value_head_dim
    chunk = asm.linear_attention_chunk
    projections = ((m, w.conv_channels, h), (m, value, h), (m, w.value_heads, h), (m, w.value_heads, h),
                   (m, h, value))
    gemm_s, gemm_fl = _gemms(projections + feed_forward_gemm_shapes(layer, s), s)
    buffers = 0.0
    saved_experts = 0.0
    if layer.moe is not None:
        experts_s, experts_fl, saved_experts, dispatch = expert_terms(layer, s)
        gemm_s, gemm_fl, buffers = gemm_s + experts_s, gemm_fl + experts_fl, buffers + dispatch
    core_fl = gated_delta_rule_core_flops(m, w, chunk)
    conv_fl = m * short_conv_flops_per_token(w.conv_channels, layer.linear_attention.conv_kernel)
    core_s = attention_core_time(core_fl, chunk, 0.0, s.device, asm)
    sp_fwd = 0.0
    if s.sp > 1:
        exchanged = m * (w.conv_channels + 2 * w.value_heads)
        sp_fwd = (all_to_all_time(exchanged * e, s.sp, s.sp_link) + all_to_all_time(m * value * e, s.sp, s.sp_link))
        buffers += 2 * m * (w.conv_channels + value) * e
    backward_buffers = max(buffers + _linear_kernel_transient_bytes(w, s, backward=True), _mlp_backward_bytes(layer, s))
    buffers += _linear_kernel_transient_bytes(w, s, backward=False)
    calls = linear_kernel_calls(s.segments, s.micro_batch)
    chunks = linear_kernel_chunks(calls, s.segment_tokens, chunk)
    kernel = asm.linear_attention_kernel
    return _terms(
        s,
        ops=linear_attention_pass_ops(kernel, tp=s.tp, calls=calls, chunks=chunks, ulysses=s.sp > 1),
        attention_ops=linear_kernel_ops(kernel, calls=calls, chunks=chunks)[0],
        gemm_s=gemm_s,
        gemm_flops_=gemm_fl,
        attention_s=core_s,
        attention_flops_=core_fl + conv_fl,
        elementwise_s=elementwise_time(_linear_block_elementwise_elements(layer, s, w), s.device, asm),
        saved=_linear_block_saved(layer, s, w, s.recompute) + (saved_experts if s.recompute != "full" else 0.0),
        working=_linear_block_saved(layer, s, w, "none") + saved_experts,
        buffers=buffers,
        backward_buffers=backward_buffers,
        tp_fwd=tp_all_reduces(layer) * all_reduce_time(m * h * e, s.tp, s.tp_link),
        tp_bwd=tp_all_reduces(layer) * all_reduce_time(m * h * e, s.tp, s.tp_link),
        sp_fwd=sp_fwd,
        sp_bwd=sp_fwd,
        ep_fwd=expert_all_to_all_time(m, layer, s),
        ep_bwd=expert_all_to_all_time(m, layer, s),
        recomputable=True,
    )


def _linear_kernel_transient_bytes(w: LinearWidths, shard: Shard, *, backward: bool) -> float:
    """What a linear-attention layer's kernel allocates beside what it saves, in one pass on one rank: fla's WY
    factors, chunk states and their gradients (``fla_chunk_rule_transient_bytes_per_token``, per token: under
    Ulysses the rank runs ``sp`` times the tokens of ``1 / sp`` of the heads); the torch fallback's running state, one
    fp32 ``dk x dv`` per value head of each sequence (``recurrent_state_bytes``; the states it keeps per chunk are
    saved, ``torch_chunk_rule_saved_bytes_per_token``)."""
    s, asm = shard, shard.assumptions
    if asm.linear_attention_kernel == "fla":
        return s.tokens * fla_chunk_rule_transient_bytes_per_token(w, asm.linear_attention_chunk,
                                                                   asm.activation_bytes, backward)
    return s.micro_batch * recurrent_state_bytes(w.value_heads / s.sp, w.key_head_dim, w.value_head_dim, FP32_BYTES)


def _linear_block_saved(layer: LayerSpec, shard: Shard, w: LinearWidths, recompute: str) -> float:
    """Bytes a linear-attention block keeps for backward on one rank: the block's norm, mixer and MLP inputs and the
    MLP's activations (``block_saved_bytes_per_token`` with no softmax attention) and the token mixer's
    (``gated_delta_rule_saved_bytes_per_token``), per token."""
    s = shard
    block = block_saved_bytes_per_token(
        hidden=layer.hidden_size, q_width=0.0, kv_width=0.0, mlp_width=dense_feed_forward_width(layer) / s.tp,
        gated=layer.mlp is None or layer.mlp.gated, heads=0.0, tp=s.tp, recompute=recompute, assumptions=s.assumptions)
    mixer = gated_delta_rule_saved_bytes_per_token(w, s.assumptions.linear_attention_chunk, recompute, s.assumptions)
    return s.tokens * (block + mixer)


def _linear_block_elementwise_elements(layer: LayerSpec, shard: Shard, w: LinearWidths) -> float:
    """A linear-attention block's memory-bound traffic: the block's norms and residual adds (``10 h``), the MLP's
    activation or the experts' (as ``block_elementwise_elements``), and the token mixer's
    (``linear_mixer_elementwise_elements``)."""
    s = shard
    h = layer.hidden_size / s.tp if s.assumptions.megatron_sequence_parallel else layer.hidden_size
    ffn = 3 * dense_feed_forward_width(layer) / s.tp * s.tokens
    experts = expert_elementwise_elements(layer, s) if layer.moe is not None else 0.0
    return s.tokens * 10 * h + ffn + experts + linear_mixer_elementwise_elements(s.tokens, w)


def patch_embed_terms(layer: LayerSpec, shard: Shard) -> LayerTerms:
    """Patchifier (Conv3d with stride = kernel, i.e. one GEMM tokens x in_features x hidden), replicated on TP
    ranks. It keeps its pixel input only to form its weight gradient."""
    k = layer.in_features or layer.params / layer.hidden_size
    m = shard.tokens
    gemm_s, gemm_fl = _gemms(((m, layer.hidden_size, k),), shard)
    saved = m * k * shard.assumptions.activation_bytes if shard.backward == "full" else 0.0
    return _terms(shard, ops=_ops(layer, shard), gemm_s=gemm_s, gemm_flops_=gemm_fl, elementwise_s=0.0, saved=saved,
                  input_grad=False)


def patch_merger_terms(layer: LayerSpec, shard: Shard) -> LayerTerms:
    """Qwen-VL PatchMerger: norm, merge ``token_reduction`` tokens, Linear(in, in) -> GELU -> Linear(in, out).
    It keeps the norm input (with its fp32 copy), the merged MLP input, and the GELU input and output.

    The MLP is column- then row-parallel under TP (1 all-reduce forward, 1 backward, Shoeybi et al. 2019
    Sec. 3). Under Ulysses each rank merges its own tokens (merge groups never straddle windows).
    """
    asm, e = shard.assumptions, shard.assumptions.activation_bytes
    h, m = layer.hidden_size, shard.tokens
    in_f = layer.in_features or h * layer.token_reduction
    out = layer.out_features or h
    m_out = m / layer.token_reduction
    mid = in_f / shard.tp
    gemm_s, gemm_fl = _gemms(((m_out, mid, in_f), (m_out, out, mid)), shard)
    elem_s = elementwise_time(2 * m * h + 2 * m_out * mid, shard.device, asm)
    saved = (m * h + m_out * in_f + 2 * m_out * mid) * e + m * h * asm.norm_upcast_bytes
    return _terms(
        shard,
        ops=_ops(layer, shard),
        gemm_s=gemm_s,
        gemm_flops_=gemm_fl,
        elementwise_s=elem_s,
        saved=saved,
        tp_fwd=all_reduce_time(m_out * out * e, shard.tp, shard.tp_link),
        tp_bwd=all_reduce_time(m_out * in_f * e, shard.tp, shard.tp_link),
    )


def embedding_terms(layer: LayerSpec, shard: Shard) -> LayerTerms:
    """Token embedding: a memory-bound gather of ``tokens x h``; vocab-parallel under TP, whose partial
    outputs are all-reduced in forward (Shoeybi et al. 2019, Sec. 3). Backward only scatters the weight
    gradient, so a frozen embedding runs none. It keeps only the token ids (``token_id_bytes`` each)."""
    h, m = layer.hidden_size, shard.tokens
    elem_s = elementwise_time(2 * m * h, shard.device, shard.assumptions)
    if shard.backward != "full":
        shard = _forward_only(shard)
    e = shard.assumptions.activation_bytes
    return _terms(
        shard,
        ops=_ops(layer, shard),
        gemm_s=0.0,
        gemm_flops_=0.0,
        elementwise_s=elem_s,
        saved=0.0 if shard.backward != "full" else m * shard.assumptions.token_id_bytes,
        tp_fwd=all_reduce_time(m * h * e, shard.tp, shard.tp_link),
    )


def final_norm_terms(layer: LayerSpec, shard: Shard) -> LayerTerms:
    """Final RMSNorm: memory-bound read + write of ``tokens x h``; keeps its input and, unfused, its fp32 copy
    (``norm_upcast_bytes``), replicated under TP."""
    h, m, asm = layer.hidden_size, shard.tokens, shard.assumptions
    elem_s = elementwise_time(2 * m * h, shard.device, asm)
    saved = m * h * (asm.activation_bytes + asm.norm_upcast_bytes)
    return _terms(shard, ops=_ops(layer, shard), gemm_s=0.0, gemm_flops_=0.0, elementwise_s=elem_s, saved=saved)


def lm_head_terms(layer: LayerSpec, shard: Shard) -> LayerTerms:
    """Vocabulary projection + cross-entropy, vocab-parallel under TP (``loss_parallel``), whole or chunked.

    GEMM tokens x h x V/tp; the loss reads and writes the fp32 logits (memory-bound); it keeps its input and
    the fp32 log-softmax, and the bf16 + fp32 logits (forward) and the loss's fp32 gradients (backward) are transient
    peaks (``loss_logits_bytes``). Chunked (``Shard.loss_chunk_tokens``), only one chunk's logits live at a time
    (``chunked_loss_logits_bytes``) and the backward recomputes the forward once more. TP: two
    small fp32 all-reduces of per-token max and sum in forward, an all-reduce of the input gradient in
    backward (column-parallel input; Shoeybi et al. 2019, Sec. 3).
    """
    asm, e = shard.assumptions, shard.assumptions.activation_bytes
    h, m = layer.hidden_size, shard.tokens
    vocab = (layer.out_features or h) / shard.tp
    gemm_s, gemm_fl = _gemms(((m, vocab, h),), shard)
    saved_logits, transient, backward_transient = loss_logits_bytes(m, vocab, asm, vocab_parallel=shard.tp > 1)
    loss_s = 2 * (saved_logits + transient) / (shard.device.memory_bandwidth * asm.memory_bandwidth_efficiency)
    chunked = shard.loss_chunk_tokens > 0 and shard.backward != "none"
    if chunked:
        saved_logits, transient, backward_transient = chunked_loss_logits_bytes(
            min(m, shard.loss_chunk_tokens), vocab, asm, vocab_parallel=shard.tp > 1)
    terms = _terms(
        shard,
        ops=_ops(layer, shard),
        gemm_s=gemm_s,
        gemm_flops_=gemm_fl,
        elementwise_s=loss_s,
        saved=m * h * e + saved_logits,
        buffers=transient,
        backward_buffers=backward_transient,
        loss_saved=saved_logits,
        tp_fwd=2 * all_reduce_time(m * 4, shard.tp, shard.tp_link),
        tp_bwd=all_reduce_time(m * h * e, shard.tp, shard.tp_link),
    )
    return replace(terms, recompute_s=terms.forward_s) if chunked else terms


def audio_conv_terms(layer: LayerSpec, shard: Shard) -> LayerTerms:
    """Whisper conv front end as one GEMM per output position of ``params / h`` inputs (2 * params FLOPs per
    token, Kaplan et al. 2020 Sec. 2.1 accounting; ``in_features`` is the mel count, the conv weights dominate
    the parameters), replicated under TP; keeps the two conv outputs."""
    h, m = layer.hidden_size, shard.tokens
    k = layer.params / h
    gemm_s, gemm_fl = _gemms(((m, h, k),), shard)
    elem_s = elementwise_time(4 * m * h, shard.device, shard.assumptions)
    saved = 2 * m * h * shard.assumptions.activation_bytes
    return _terms(shard, ops=_ops(layer, shard), gemm_s=gemm_s, gemm_flops_=gemm_fl, elementwise_s=elem_s,
                  saved=saved, input_grad=False)


def audio_projector_terms(layer: LayerSpec, shard: Shard) -> LayerTerms:
    """Pooling + norm + Linear(in, out) into the LLM width, replicated under TP."""
    h, m = layer.hidden_size, shard.tokens
    in_f = layer.in_features or h
    m_out = m / layer.token_reduction
    gemm_s, gemm_fl = _gemms(((m_out, layer.out_features or h, in_f),), shard)
    elem_s = elementwise_time(4 * m * h, shard.device, shard.assumptions)
    saved = (m * h + m_out * in_f) * shard.assumptions.activation_bytes
    return _terms(shard, ops=_ops(layer, shard), gemm_s=gemm_s, gemm_flops_=gemm_fl, elementwise_s=elem_s,
                  saved=saved)


def _ops(layer: LayerSpec, shard: Shard) -> tuple[PassOps, PassOps]:
    """(forward, backward) operator calls of a layer without an attention loop."""
    return layer_pass_ops(ops_row(layer), tp=shard.tp, segments=0, ulysses=False)


def _forward_only(shard: Shard) -> Shard:
    """The same shard with no backward (for layers whose backward is nothing but a frozen weight gradient)."""
    return replace(shard, backward="none")


LAYER_TERMS = {
    "vision_block": block_terms,
    "audio_block": block_terms,
    "decoder_layer": block_terms,
    "patch_embed": patch_embed_terms,
    "patch_merger": patch_merger_terms,
    "embedding": embedding_terms,
    "final_norm": final_norm_terms,
    "lm_head": lm_head_terms,
    "audio_conv": audio_conv_terms,
    "audio_projector": audio_projector_terms,
}
"""Layer kind -> its analytical cost function."""


def layer_terms(layer: LayerSpec, shard: Shard) -> LayerTerms:
    """Analytical cost of one instance of ``layer`` on ``shard`` (a linear-attention decoder layer:
    ``linear_attention_block_terms``)."""
    if layer.linear_attention is not None:
        return linear_attention_block_terms(layer, shard)
    return LAYER_TERMS[layer.kind](layer, shard)
