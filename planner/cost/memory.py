"""Per-GPU memory formulas: model states by precision recipe and ZeRO stage, activations per layer, buffers.

All sizes are bytes. "Per token" means per token entering the layer on one rank.
"""

from __future__ import annotations

from planner.cost.assumptions import BytesPerParam, CostAssumptions
from planner.contract.models import LayerSpec

TP_SPLIT_KINDS = frozenset({"vision_block", "audio_block", "decoder_layer", "patch_merger", "embedding", "lm_head"})
"""Layer kinds whose weights TP splits (Megatron column/row linears, vocab-parallel embedding and lm_head);
the patchifier, audio convolutions, audio projector and final norm are replicated on every TP rank."""


def kv_params(layer: LayerSpec) -> float:
    """Parameters of the K and V projections (weights + biases) of a block layer: ``2 * (h + 1) * kv * d``."""
    a = layer.attention
    if a is None:
        return 0.0
    return 2.0 * (layer.hidden_size + 1) * a.num_kv_heads * a.head_dim


def layer_params_per_rank(layer: LayerSpec, tp: int, ep: int = 1) -> float:
    """Parameters of ONE instance of ``layer`` held by one TP rank (and, for a mixture-of-experts layer, one rank of
    an EP group of ``ep`` x ``tp`` ranks: its experts are split over them as whole experts).

    TP-split kinds hold ``params / tp``, except the K/V projections when TP does not divide the KV heads (a
    multiple of them): every TP rank then holds them whole (``runtime.parallel.tensor_parallel.
    ReplicatedHeadsColwise`` keeps them ``Replicate`` and projects its own head; Megatron-LM keeps the rank's
    one head, a difference of (kv - 1) / kv of the small GQA K/V weights). Other kinds are
    replicated. Norm weights and row-parallel biases (a few thousand parameters per layer) are counted as split,
    a < 0.1% approximation.
    """
    experts = expert_params_per_rank(layer, tp, ep)
    params = layer.params - (layer.moe.expert_params if layer.moe is not None else 0)
    if layer.kind not in TP_SPLIT_KINDS or tp == 1:
        return params + experts
    kv = kv_params(layer)
    if kv == 0.0 or layer.attention.num_kv_heads % tp == 0:
        return params / tp + experts
    return (params - kv) / tp + kv + experts


def expert_params_per_rank(layer: LayerSpec, tp: int, ep: int) -> float:
    """Routed-expert parameters of ONE instance of ``layer`` on one rank: ``expert_params / (tp * ep)`` (0 on a
    dense layer). Expert parallelism places ``num_experts / (ep * tp)`` whole experts on each rank of an EP group,
    ``ep`` data ranks with all their ``tp`` ranks (Lepikhin et al. 2020, GShard, Sec. 2.2; Rajbhandari et al. 2022,
    DeepSpeed-MoE, Sec. 5.1; torchtitan's etp=1 and transformers ``AllToAllEP``, where EP borrows the TP ranks)."""
    return 0.0 if layer.moe is None else layer.moe.expert_params / (tp * ep)


def model_state_bytes(
    params: float, recipe: BytesPerParam, *, zero: int, shards: int, frozen: bool
) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per GPU for ``params`` parameters on each rank before ZeRO.

    Source: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
    Sec. 5.1 and Fig. 1: baseline ``(2 + 2 + K) * Psi``; P_os ``2Psi + 2Psi + K*Psi/N``; P_os+g
    ``2Psi + (2 + K)*Psi/N``; P_os+g+p ``(2 + 2 + K)*Psi/N`` with N = ``shards``. A frozen module keeps its
    weights only (no gradients, no optimizer state); ZeRO-3 still shards them.
    """
    weights = params * recipe.weights / (shards if zero >= 3 else 1)
    if frozen:
        return weights, 0.0, 0.0
    gradients = params * recipe.gradients / (shards if zero >= 2 else 1)
    optimizer = params * recipe.optimizer / (shards if zero >= 1 else 1)
    return weights, gradients, optimizer


def pipelined_fsdp_state_bytes(
    params: float, recipe: BytesPerParam, *, accumulated_gradient_bytes: float, frozen: bool
) -> tuple[float, float]:
    """(weights, gradients) bytes per GPU of a ZeRO-2 or ZeRO-3 module inside a pipeline stage, as torch runs it.

    torch.distributed.pipelining (2.13, ``_PipelineStageBase.backward_maybe_with_nosync``) runs every micro-batch's
    backward of an FSDP2 stage with gradient sync and reshard-after-backward off and reduce-scatters once after the
    last: the stage accumulates unsharded gradients in FSDP2's reduce dtype (``accumulated_gradient_bytes`` per
    parameter), and weights a backward gathered stay gathered to the step's end. At the peak that is ZeRO-1's
    states (Rajbhandari et al. 2020, Sec. 5.1, P_os: ``2 Psi`` weights, unsharded gradients); the optimizer
    states stay sharded. A frozen stage accumulates no gradients.
    """
    return params * recipe.weights, 0.0 if frozen else params * accumulated_gradient_bytes


def qk_norm_saved_bytes_per_token(q_width: float, kv_width: float, assumptions: CostAssumptions) -> float:
    """Bytes the per-head q / k RMSNorms of a block (Qwen3's ``q_norm`` / ``k_norm``) keep for backward per token,
    beyond ``block_saved_bytes_per_token``: like the block's own norms (transformers' ``Qwen3RMSNorm``: the input
    cast to fp32, kept for the variance's and the scaling's backward; the normalised tensor cast back, kept for the
    weight's gradient), ``norm_upcast_bytes + activation_bytes`` per element of the rank's q and k widths. Zhang and
    Sennrich 2019 (RMSNorm, eq. 4) for the norm; the saved set is what autograd keeps for its ops (measured on
    Qwen3-VL-8B's dry-run: the LLM's activations were 1.21x the prediction without it)."""
    return (q_width + kv_width) * (assumptions.norm_upcast_bytes + assumptions.activation_bytes)


def block_saved_bytes_per_token(
    *,
    hidden: float,
    q_width: float,
    kv_width: float,
    mlp_width: float,
    gated: bool,
    heads: float,
    tp: int,
    recompute: str,
    assumptions: CostAssumptions,
) -> float:
    """Bytes a transformer block keeps for backward per token, excluding any s x s score matrix.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 4.1-4.2,
    eq. 1-2, without dropout (Qwen trains with dropout 0), generalised:

    * replicated on every TP rank (divided by tp only with Megatron sequence parallelism): the two norm inputs,
      the QKV input and the MLP input, ``4h`` elements;
    * attention (TP-split, per rank widths): q, k, v after rotary and the core output (= out-proj input),
      ``2 q_width + 2 kv_width`` (GQA shrinks K/V); flash / memory-efficient kernels add an fp32 logsumexp per
      head (``heads`` per rank), unless selective recomputation re-runs the core;
    * MLP: SwiGLU keeps gate, up, act(gate) and the product (down-proj input), ``4 f`` per rank; a plain MLP
      keeps the activation input and output, ``2 f`` (Korthikanti's ``16sbh/t`` for f = 4h).

    Full recomputation keeps only the block input, ``h`` (or ``h/tp`` with sequence parallelism).
    For a GPT layer (q = kv = h, f = 4h, eager, ``norm_upcast_bytes`` 0) this gives Korthikanti eq. 2 without
    dropout: ``sbh(8 + 24/t)`` plus the score term. Unfused norms add ``norm_upcast_bytes`` per element of
    each of the two norm inputs (their fp32 copy).
    """
    replicated = hidden / tp if assumptions.megatron_sequence_parallel else hidden
    e = assumptions.activation_bytes
    if recompute == "full":
        return replicated * e
    attention = 2 * q_width + 2 * kv_width
    mlp = (4 if gated else 2) * mlp_width
    saved = (4 * replicated + attention + mlp) * e + 2 * replicated * assumptions.norm_upcast_bytes
    if recompute == "none" and assumptions.attention_implementation != "eager":
        saved += heads * assumptions.softmax_stat_bytes
    return saved


def expert_saved_bytes_per_token(*, hidden: float, expert_width: float, num_experts: float, experts_per_token: float,
                                 load_imbalance: float, tp: int, assumptions: CostAssumptions) -> float:
    """Bytes a mixture-of-experts feed-forward keeps for backward per token entering it on the busiest rank of its
    EP group, whose ``tp`` ranks each route a disjoint ``1 / tp`` slice of the tokens they share.

    Router (replicated on the TP ranks): its fp32 softmax over ``num_experts`` for every token (read by its
    backward). Each of the slice's ``experts_per_token`` routed copies (``1 / tp`` per token entering, times
    ``load_imbalance`` on the busiest rank): the dispatched input row (``hidden``), the whole expert's SwiGLU gate, up,
    act(gate) and product (``4 expert_width``, as Korthikanti et al. 2022, Sec. 4.1 count a SwiGLU MLP) and its output
    row before the routing weight scales it (``hidden``, read by the weight's gradient).
    Source: the grouped-experts forward of transformers ``grouped_mm_experts_forward`` / torchtitan
    ``GroupedExperts``, the TP slicing of transformers ``AllToAllEP`` / torchtitan's etp=1; activation accounting per
    Korthikanti et al. 2022, eq. 1-2.
    """
    copies = experts_per_token * load_imbalance / tp
    router = num_experts * 4
    return router + copies * (2 * hidden + 4 * expert_width) * assumptions.activation_bytes


def expert_dispatch_buffer_bytes(tokens: float, hidden: float, experts_per_token: float, load_imbalance: float,
                                 activation_bytes: float) -> float:
    """Transient bytes of one token exchange of a MoE layer on the busiest rank: the permuted send buffer and the
    receive buffer of ``tokens x experts_per_token`` rows of ``hidden`` (times ``load_imbalance`` received), where
    ``tokens`` are the rank's own (with TP, its ``1 / tp`` slice of the tokens its TP group shares).
    Source: the all-to-all dispatch of Lepikhin et al. 2020 (GShard), Sec. 2.2 / Rajbhandari et al. 2022
    (DeepSpeed-MoE), Sec. 5.1: each routed copy is sent once and received once."""
    rows = tokens * experts_per_token
    return (rows + rows * load_imbalance) * hidden * activation_bytes


def score_matrix_bytes(score_elements: float, recompute: str, assumptions: CostAssumptions) -> float:
    """Bytes of attention scores kept for backward: only eager attention without recomputation stores them.

    Korthikanti et al. 2022, eq. 1: the ``5as^2b`` term (softmax output + dropout mask + dropout output);
    without dropout, eager keeps the softmax output (and, in HF, its fp32 original) per score element.
    Flash-style kernels keep no s^2 matrix (Dao et al. 2022, Sec. 3.1); selective recomputation drops it
    (Korthikanti Sec. 4.2.2).
    """
    if assumptions.attention_implementation != "eager" or recompute != "none":
        return 0.0
    return score_elements * assumptions.eager_score_bytes_per_element


def loss_logits_bytes(
    tokens: float, vocab_per_rank: float, assumptions: CostAssumptions, *, vocab_parallel: bool = False
) -> tuple[float, float, float]:
    """(saved, forward transient, backward transient) bytes of the cross-entropy over ``tokens x vocab_per_rank``
    logits.

    Saved: the fp32 log-softmax the loss backward reads; forward transient: bf16 logits + fp32 upcast alive while
    the loss is formed; backward transient: the loss's and the log-softmax's fp32 gradients. With TP the logits stay
    vocab-parallel (``loss_parallel``; Shoeybi et al. 2019, Sec. 3, fused parallel cross-entropy), so
    ``vocab_per_rank = vocab / tp``, and torch's unfused vocab-parallel kernels add ``loss_parallel_extra_bytes``
    per logit to both transients.
    """
    logits = tokens * vocab_per_rank
    extra = assumptions.loss_parallel_extra_bytes if vocab_parallel else 0.0
    return (logits * assumptions.loss_logits_saved_bytes, logits * (assumptions.loss_logits_transient_bytes + extra),
            logits * (assumptions.loss_logits_backward_bytes + extra))


def chunked_loss_logits_bytes(
    chunk_tokens: float, vocab_per_rank: float, assumptions: CostAssumptions, *, vocab_parallel: bool = False
) -> tuple[float, float, float]:
    """(saved, forward transient, backward transient) bytes of a cross-entropy formed ``chunk_tokens`` at a time,
    each chunk's lm_head and loss under activation checkpointing (the fused / chunked linear cross-entropy of
    Hsu et al. 2024, "Liger Kernel", Sec. 3.3, and Wijmans et al. 2025, "Cut Your Losses in Large-Vocabulary
    Language Models", Sec. 3): nothing of the logits is saved; one chunk's log-softmax lives beside its forward
    transient while the chunk forms its loss, and beside its backward transient while its backward (after the
    recompute) runs. ``loss_logits_bytes`` of one chunk gives each piece."""
    saved, transient, backward = loss_logits_bytes(chunk_tokens, vocab_per_rank, assumptions,
                                                   vocab_parallel=vocab_parallel)
    return 0.0, saved + transient, saved + backward


def mlp_backward_transient_bytes(tokens: float, intermediate_per_rank: float, assumptions: CostAssumptions, *,
                                 gated: bool) -> float:
    """Bytes an MLP's backward holds beside the layer's saved activations on one rank: ``tokens x intermediate /
    tp`` activation-dtype tensors, ``mlp_backward_transient_tensors`` of them for a gated MLP,
    ``ungated_mlp_backward_transient_tensors`` for an ungated one (its hidden activations' gradients; measured, see
    the assumptions)."""
    tensors = (assumptions.mlp_backward_transient_tensors if gated
               else assumptions.ungated_mlp_backward_transient_tensors)
    return tensors * tokens * intermediate_per_rank * assumptions.activation_bytes


def packed_mask_bytes(row_tokens: float, rows: float) -> float:
    """Bytes of transformers' packed-sequence mask for SDPA: one boolean per (query, key) pair of each row,
    ``[rows, 1, L, L]`` (``masking_utils.sdpa_mask``), alive through the decoder's forward and backward."""
    return rows * row_tokens * row_tokens


def loss_chunk_tokens(pp: int, assumptions: CostAssumptions) -> int:
    """Tokens per chunk of the LLM's loss (``assumptions.loss_chunk_tokens``), or 0 (the whole logits at once)
    for a pipelined LLM, whose schedule hands the last stage's logits to its loss function."""
    return 0 if pp > 1 else assumptions.loss_chunk_tokens


FSDP_BLOCK_KINDS = frozenset({"vision_block", "audio_block", "decoder_layer"})
"""Layer kinds the runtime shards as their own FSDP unit (``fully_shard`` per block); every other layer of a
module (patchifier, merger, embedding, final norm, lm_head) belongs to the module's root unit."""


def zero3_gather_bytes(
    root_params: float, largest_block_params: float, recipe: BytesPerParam, *, prefetch: int, frozen: bool,
    backward: bool, input_params: float = 0.0,
) -> float:
    """ZeRO-3 temporary buffers alive while the module runs its forward (``backward=False``) or its backward.

    Rajbhandari et al. 2020, Sec. 5.3 / 7.2.2: parameters are all-gathered unit by unit ahead of use and released
    after; each unit's gradients exist unsharded until reduce-scattered. With FSDP2 (``fully_shard`` per block,
    then the module: Zhao et al. 2023, "PyTorch FSDP", Sec. 3.2 units) the root unit's parameters (``root_params``:
    embedding, final norm, lm_head) are gathered around the whole module's forward and again around its whole
    backward, and its gradients wait for the module's post-backward reduce-scatter. Both passes hold the root unit and
    the running + ``prefetch`` blocks; the backward adds the unsharded gradients of the root unit and of one block,
    though not both whole at once: the root's input layer (``input_params``: the embedding, the patch embedding)
    gets its gradient last, after every block's backward.
    """
    gathered = (root_params + (1 + prefetch) * largest_block_params) * recipe.weights
    if frozen or not backward:
        return gathered
    unsharded = max(root_params, root_params - input_params + largest_block_params)
    return gathered + unsharded * recipe.gradients


def bucket_bytes(gradient_bytes: float, assumptions: CostAssumptions) -> float:
    """Gradient-reduction buckets in flight (Li et al. 2020, PyTorch DDP, Sec. 3.2.3), capped at all gradients."""
    return min(gradient_bytes, assumptions.communication_buckets_in_flight * assumptions.communication_bucket_bytes)
