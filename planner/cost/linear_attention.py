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


def gated_delta_rule_saved_bytes_per_token(w: LinearWidths, chunk: float, recompute: str,
                                           assumptions: CostAssumptions) -> float:
    """Bytes the token mixer of a linear-attention layer keeps for backward per token on one rank (without the
    feed-forward and the block's norm inputs, ``block_saved_bytes_per_token``'s replicated part):

    * the conv's input and its SiLU's input (``2 c`` activations);
    * what fla's ``ChunkGatedDeltaRuleFunction.forward`` saves: q and k (l2-normed, repeated to the value heads),
      v, their fp32 inverse norms, the fp32 gate and beta per head, and the fp32 ``C x C`` triangular inverse ``A``
      per chunk and head (``C`` fp32 per token and head); the state ``h`` is recomputed in backward;
    * the gate input z, the rule's output and the gated norm's output (out_proj input): ``3 Hv dv`` activations;
    * the a / b gate projections' outputs (``2 Hv``).

    Selective recomputation re-runs the rule's kernel: its ``A``, inverse norms and gates are not kept, only its
    inputs. Full recomputation keeps the layer input only (``block_saved_bytes_per_token``).
    """
    if recompute == "full":
        return 0.0
    e, f32 = assumptions.activation_bytes, 4
    key = w.value_heads * w.key_head_dim
    value = w.value_heads * w.value_head_dim
    inputs = (2 * w.conv_channels + 2 * key + value + 3 * value + 2 * w.value_heads) * e
    if recompute == "selective":
        return inputs
    return inputs + w.value_heads * (chunk + 2 + 2) * f32


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
