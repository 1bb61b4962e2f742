"""Cost of a Gated DeltaNet (linear-attention) decoder layer for one micro-batch on one rank (Qwen3.5's
``Qwen3_5GatedDeltaNet``): its projections, the short causal conv over q, k, v, the gates, the chunked gated delta
rule, the gated RMSNorm, and the layer's feed-forward (dense SwiGLU or experts, as ``layers.block_terms`` prices it).

Time and memory grow linearly with the sequence: the rule runs chunk by chunk, carrying a state of key x value width
per value head (Yang et al. 2025, "Gated Delta Networks: Improving Mamba2 with Delta Rule", ICLR 2025, Sec. 3.3 and
eq. 7-9, the hardware-efficient chunkwise form; flash-linear-attention's ``chunk_gated_delta_rule``). TP splits the
key and the value heads alike (``planner.contract.rules.linear_attention_rules``); Ulysses SP exchanges q, k, v,
the gates and the output so that each rank runs whole sequences of its heads, and the recurrence runs unchanged.

Widths are per rank: ``key_width = Hv dk / (tp)`` counts the query / key heads repeated to the value heads, as
transformers repeats them before the kernel (``repeat_interleave`` by ``Hv / Hk``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.cost.assumptions import CostAssumptions
from planner.contract.models import LayerSpec


@dataclass(kw_only=True, frozen=True, slots=True)
class LinearWidths:
    """The per-rank widths of one Gated DeltaNet layer under TP."""

    value_heads: float
    """Value heads on the rank (each runs its own recurrence)."""
    key_head_dim: int
    """Width of one query / key head."""
    value_head_dim: int
    """Width of one value head."""
    conv_channels: float
    """Channels of the depthwise conv on the rank: its query, key and value widths before the repeat."""
    projected_key_width: float
    """Query (= key) width the projection writes on the rank, before the repeat to the value heads."""


def linear_widths(layer: LayerSpec, tp: int) -> LinearWidths:
    """The rank's share of a linear-attention layer's heads (TP divides both head kinds)."""
    la = layer.linear_attention
    key_width = la.num_key_heads * la.key_head_dim / tp
    value_width = la.num_value_heads * la.value_head_dim / tp
    return LinearWidths(value_heads=la.num_value_heads / tp, key_head_dim=la.key_head_dim,
                        value_head_dim=la.value_head_dim, conv_channels=2 * key_width + value_width,
                        projected_key_width=key_width)


def gated_delta_rule_flops_per_token(key_dim: float, value_dim: float, chunk: float) -> float:
    """Forward FLOPs per token and value head of the chunked gated delta rule, chunk size ``C``:

    per chunk (Yang et al. 2025, Sec. 3.3, the WY representation of Yang et al. 2024, "Parallelizing Linear
    Transformers with the Delta Rule over Sequence Length", NeurIPS 2024, Sec. 3.2-3.3; the steps of fla's
    ``chunk_gated_delta_rule_fwd``): ``K K^T`` (2 C^2 dk), the triangular inverse ``(I + A)^-1`` by forward
    substitution (2 C^3 / 3), ``W = T K`` (2 C^2 dk) and ``U = T V`` (2 C^2 dv), the corrected values ``U - W S``
    (2 C dk dv), the output's inter-chunk ``Q S`` (2 C dk dv) and intra-chunk ``(Q K^T) V'`` (2 C^2 dk + 2 C^2 dv),
    and the state update ``S + K^T V'`` (2 C dk dv). Divided by C:

        6 C dk + 4 C dv + 6 dk dv + 2 C^2 / 3

    Linear in the sequence (a constant per token), against softmax attention's 4 s d per token.
    """
    return 6 * chunk * key_dim + 4 * chunk * value_dim + 6 * key_dim * value_dim + 2 * chunk**2 / 3


def short_conv_flops_per_token(channels: float, kernel: int) -> float:
    """Forward FLOPs per token of the depthwise causal conv over q, k, v (``Qwen3_5GatedDeltaNet.conv1d``: one
    ``kernel``-tap filter per channel, no bias): a multiply and an add per tap and channel, ``2 K c``; its SiLU is
    elementwise. Source: Yang et al. 2025, Sec. 3.4 (the short convolution after the q, k, v projections)."""
    return 2 * kernel * channels


def recurrent_state_bytes(value_heads: float, key_dim: float, value_dim: float, state_bytes: float) -> float:
    """Bytes of the recurrent state ``S`` of one sequence: one ``dk x dv`` matrix per value head (Yang et al. 2025,
    eq. 7: S_t in R^{dv x dk}), in fp32 as fla keeps it. The chunk kernel passes it from chunk to chunk (forward and,
    recomputed, backward) and does not keep it per chunk for backward."""
    return value_heads * key_dim * value_dim * state_bytes


FP32_BYTES = 4
"""Bytes of the fp32 tensors both kernels keep whatever the recipe: the decay and its cumulative sums, inverse norms,
the gated norm's upcasts, and every intermediate of transformers' torch fallback (it casts its inputs to fp32)."""


def gates_and_gated_norm_saved_bytes_per_token(w: LinearWidths, activation_bytes: float) -> float:
    """Bytes per token a Gated DeltaNet layer keeps for backward around its kernels, whichever runs them
    (transformers 5.25's ``Qwen3_5GatedDeltaNet.forward`` and ``Qwen3_5RMSNormGated.forward``, as
    ``runtime.models.linear_attention`` runs them):

    * the gates: ``beta = sigmoid(b)`` keeps its output (``Hv``, the layer's dtype; the very tensor fla's kernel
      saves as its beta), the decay ``g = -exp(A_log) softplus(a + dt_bias)`` softplus's fp32 input and output
      (``2 Hv``);
    * the gated RMSNorm (norm before gate): the rule's output upcast to fp32, z upcast to fp32 (SiLU's input) and
      SiLU's fp32 output (``3 Hv dv`` fp32), the normalised output cast back and its product with the weight
      (``2 Hv dv``, the layer's dtype), one fp32 reciprocal rms per head (``Hv``);
    * out_proj's input (``Hv dv``).

    Measured with saved-tensor hooks on a tiny layer in fp32 and bf16 (``tests/cost/test_cost_linear_attention.py``
    holds the sum by hand; ``tests/runtime/test_units.py`` the whole layer as the runtime runs it).
    """
    value = w.value_heads * w.value_head_dim
    gates = w.value_heads * activation_bytes + 2 * w.value_heads * FP32_BYTES
    gated_norm = 3 * value * FP32_BYTES + 2 * value * activation_bytes + w.value_heads * FP32_BYTES
    return gates + gated_norm + value * activation_bytes


def short_conv_saved_bytes_per_token(channels: float, kernel: str, activation_bytes: float) -> float:
    """Bytes per token the depthwise causal conv over q, k, v keeps for backward: transformers' torch fallback
    (``causal_conv1d_fn``: ``F.conv1d`` then SiLU) keeps the conv's input and SiLU's input (``2 c``); fla's
    ``CausalConv1dFunction`` (fla-core 0.6.0, ``fla/modules/causal_conv1d/ops.py``) fuses SiLU into the conv and
    saves its input alone (``c``)."""
    return (2 if kernel == "torch" else 1) * channels * activation_bytes


def torch_chunk_rule_saved_bytes_per_token(w: LinearWidths, chunk: float, *, fp32_inputs: bool) -> float:
    """Bytes per token transformers' torch fallback of the chunked gated delta rule keeps for autograd
    (``torch_chunk_gated_delta_rule``, transformers 5.25 ``models/qwen3_5/modeling_qwen3_5.py``; the chunkwise form
    of Yang et al. 2025, Sec. 3.3, eq. 7-9). It repeats q and k to the value heads and casts everything to fp32, so
    per value head and token, all fp32:

    * ``8 dk``: q and k before their l2 norms, the normed key, ``k_beta``, the scaled query, ``k_cumdecay``, the
      decayed query and key of the scan; ``3 dv``: v, ``new_values`` (the triangular solve's output) and each
      chunk's corrected values ``v_new``;
    * ``5 C``: the pairwise decays, the two intra-chunk products ``K_beta K^T`` and ``Q K^T``, the decayed
      ``ut_system`` the solve reads and the intra-chunk attention;
    * ``6``: the two inverse norms, beta and three ``exp`` of the cumulative decay; per chunk its total decay
      (``1 / C``) and the state the scan reads (``dk dv / C``: one ``dk x dv`` matrix per chunk, kept because each
      chunk's products read it).

    With fp32 inputs (a CPU plan's recipe) its ``.to(float32, contiguous_format)`` returns the transposed inputs
    themselves, every elementwise result keeps that layout, and the two intra-chunk matmuls and two later
    products copy their operands: ``4 dk`` more. Padding to a multiple of ``C`` per segment and the ``C x C``
    mask (per call) are left out. Measured on a tiny layer at dk = dv and dk = dv / 2, fp32 and bf16: within 0.1 %.
    """
    per_head = ((12 if fp32_inputs else 8) * w.key_head_dim + 3 * w.value_head_dim + 5 * chunk + 6
                + (w.key_head_dim * w.value_head_dim + 1) / chunk)
    return w.value_heads * per_head * FP32_BYTES


def fla_chunk_rule_saved_bytes_per_token(w: LinearWidths, chunk: float, activation_bytes: float) -> float:
    """Bytes per token fla's chunk kernel keeps for backward (fla-core 0.6.0,
    ``fla/ops/gated_delta_rule/chunk.py`` ``ChunkGatedDeltaRuleFunction.forward``, with
    ``use_qk_l2norm_in_kernel``): the l2-normed q and k at the key heads (``2 Hk dk``, grouped value attention: not
    repeated) and their fp32 inverse norms (``2 Hk``), v (``Hv dv``: ``input_guard``'s contiguous copy of the conv
    output's slice), the fp32 cumulative decay (``Hv``) and the solved ``(I + A)^-1`` per chunk in k's dtype
    (``chunk_gated_delta_rule_fwd_intra``: ``[T, Hv, C]``, ``C`` per value head and token); beta is the gate's
    own output (``gates_and_gated_norm_saved_bytes_per_token``), the states are recomputed in backward."""
    key_heads = w.projected_key_width / w.key_head_dim
    kept = (2 * w.projected_key_width + w.value_heads * w.value_head_dim + w.value_heads * chunk) * activation_bytes
    return kept + (2 * key_heads + w.value_heads) * FP32_BYTES


def fla_chunk_rule_transient_bytes_per_token(w: LinearWidths, chunk: float, activation_bytes: float,
                                             backward: bool) -> float:
    """Bytes per token fla's chunk kernel allocates beside what it saves, at the most of one pass (fla-core 0.6.0,
    ``fla/ops/gated_delta_rule/chunk.py``), every tensor in k's dtype but the decay gradients (fp32):

    * forward (``chunk_gated_delta_rule_fwd``, at ``chunk_fwd_o``): ``input_guard``'s contiguous copies of q and
      k, held for the call (``2 Hk dk``), the WY factors ``w`` (``Hv dk``) and ``u`` (``Hv dv``), every chunk's
      state ``h`` (``dk dv / C`` per value head and token) and the corrected values ``v_new`` (``Hv dv``);
    * backward (``chunk_gated_delta_rule_bwd``, at ``prepare_wy_repr_bwd``): ``w``, ``u``, ``h`` and ``v_new``
      recomputed, the states' gradients ``dh`` (as ``h``), ``du``, ``dw``, ``dq`` and ``dk`` (at the key heads),
      and ``prepare_wy_repr_bwd``'s ``dk`` (value heads), ``dv``, ``db`` and fp32 ``dg`` beside the first fp32
      ``dg``: ``Hv (3 dk + 4 dv + 2 dk dv / C + 1)`` plus ``2 Hk dk`` in k's dtype and ``2 Hv`` fp32."""
    value_heads, dk, dv = w.value_heads, w.key_head_dim, w.value_head_dim
    states = dk * dv / chunk
    if not backward:
        return (value_heads * (dk + 2 * dv + states) + 2 * w.projected_key_width) * activation_bytes
    per_head = 3 * dk + 4 * dv + 2 * states + 1
    return ((value_heads * per_head + 2 * w.projected_key_width) * activation_bytes
            + 2 * value_heads * FP32_BYTES)


def gated_delta_rule_saved_bytes_per_token(w: LinearWidths, chunk: float, recompute: str,
                                           assumptions: CostAssumptions) -> float:
    """Bytes the token mixer of a linear-attention layer keeps for backward per token on one rank (without the
    feed-forward and the block's norm inputs, ``block_saved_bytes_per_token``'s replicated part), on the kernel
    that runs it (``assumptions.linear_attention_kernel``): the conv's (``short_conv_saved_bytes_per_token``), the
    gates' and gated norm's (``gates_and_gated_norm_saved_bytes_per_token``) and the rule's
    (``torch_chunk_rule_saved_bytes_per_token`` / ``fla_chunk_rule_saved_bytes_per_token``).

    Selective recomputation runs the rule under a checkpoint (``runtime.models.linear_attention``), which keeps
    its inputs instead: the conv's output (q, k and v are views of it) and the fp32 decay. Full recomputation keeps
    the layer input only (``block_saved_bytes_per_token``).
    """
    if recompute == "full":
        return 0.0
    e, kernel = assumptions.activation_bytes, assumptions.linear_attention_kernel
    around = (short_conv_saved_bytes_per_token(w.conv_channels, kernel, e)
              + gates_and_gated_norm_saved_bytes_per_token(w, e))
    if recompute == "selective":
        return around + w.conv_channels * e + w.value_heads * FP32_BYTES
    if kernel == "torch":
        return around + torch_chunk_rule_saved_bytes_per_token(w, chunk, fp32_inputs=e >= FP32_BYTES)
    return around + fla_chunk_rule_saved_bytes_per_token(w, chunk, e)


def gated_delta_rule_core_flops(tokens: float, w: LinearWidths, chunk: float) -> float:
    """Forward FLOPs of the rule over ``tokens`` tokens of the rank's value heads (whole sequences: under Ulysses the
    rank holds ``sp`` times the tokens of ``1 / sp`` of the heads, the same product)."""
    return tokens * w.value_heads * gated_delta_rule_flops_per_token(w.key_head_dim, w.value_head_dim, chunk)


def linear_mixer_elementwise_elements(tokens: float, w: LinearWidths) -> float:
    """Elements read + written by the token mixer's memory-bound ops on one rank: the conv and its SiLU (read and
    write ``c`` twice), the l2 norms of q and k (read + write ``2 Hv dk``), the gates (softplus, exp, sigmoid over
    ``2 Hv``, read + write), the gated RMSNorm (read the output and z, write one: ``3 Hv dv``)."""
    key = w.value_heads * w.key_head_dim
    value = w.value_heads * w.value_head_dim
    return tokens * (4 * w.conv_channels + 4 * key + 4 * w.value_heads + 3 * value)


def linear_kernel_calls(segments: float, micro_batch: int) -> float:
    """Calls of the conv and of the rule per micro-batch on the torch kernel (``runtime.models.linear_attention``
    runs them once per segment of a row, each from a zero state): a packed row (``segments`` > 1 samples per pack,
    a micro-batch's packs in one row) one per sample, ``micro_batch * segments``; rows of one sequence each (a
    fixed-shape workload) one call over all the rows. Under Ulysses the rank runs the group's whole sequences, the
    same segments."""
    return micro_batch * segments if segments > 1 else 1.0


def linear_kernel_chunks(calls: float, segment_tokens: float, chunk: int) -> float:
    """Iterations of the torch rule's loop over chunks per micro-batch: ``ceil(segment / chunk)`` per call
    (transformers' ``torch_chunk_gated_delta_rule`` pads each sequence to whole chunks and loops over them; rows
    batched in one call share the loop), with ``segment_tokens`` the segments' token-weighted mean length."""
    return calls * math.ceil(segment_tokens / chunk)
