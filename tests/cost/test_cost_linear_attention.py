"""Qwen3.5's Gated DeltaNet layer against hand calculations: the chunked gated delta rule's FLOPs and saved bytes,
linear in the sequence (the gated full-attention layer quadratic), under every recompute mode; the shared rule for
both head kinds; pipeline chunks balanced by the cost of the hybrid layers they hold."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_cost_layers import A, shard

from planner.catalog import get_model
from planner.contract.rules import linear_attention_rules
from planner.cost.layers import layer_terms
from planner.cost.linear_attention import (
    fla_chunk_rule_transient_bytes_per_token,
    gated_delta_rule_flops_per_token,
    linear_widths,
    recurrent_state_bytes,
    torch_chunk_rule_saved_bytes_per_token,
)
from planner.cost.pipeline import balanced_ordered_chunks, rank_layers

LLM = get_model("qwen3.6-27b").module("llm")
LINEAR = LLM.layer("linear_decoder_layer")
FULL = LLM.layer("decoder_layer")
E = 2  # bf16


def test_chunk_rule_flops_per_token_by_hand():
    """C = 64, dk = dv = 128: 6*64*128 + 4*64*128 + 6*128*128 + 2*64^2/3."""
    assert gated_delta_rule_flops_per_token(128, 128, 64) == pytest.approx(49152 + 32768 + 98304 + 8192 / 3)


def test_recurrent_state_is_key_by_value_width_per_value_head():
    assert recurrent_state_bytes(48, 128, 128, 4) == 48 * 128 * 128 * 4


def linear_layer_flops_by_hand(tokens: int) -> float:
    """Qwen3.6-27B's linear-attention layer, tp = 1: projections h=5120 -> 10240 (qkv), 6144 (z), 48 + 48 (a, b),
    out_proj 6144 -> 5120, the MLP 3 x 5120 x 17408; the rule over 48 value heads (q, k repeated 3 times to them);
    the conv, 2 x 4 taps over 10240 channels."""
    gemms = 2 * tokens * (5120 * (10240 + 6144 + 96) + 6144 * 5120 + 3 * 5120 * 17408)
    core = tokens * 48 * gated_delta_rule_flops_per_token(128, 128, 64)
    conv = tokens * 2 * 4 * 10240
    return gemms + core + conv


def linear_layer_saved_by_hand(tokens: int, recompute: str) -> float:
    """Bytes kept for backward, tp = 1, on fla's kernel: the block's 4 h inputs (and the two norm inputs' fp32
    copies, ``norm_upcast_bytes`` each), the MLP's 4 f; the conv's input (10240); beta (48) and softplus's fp32 input
    and output (2 x 48 x 4); the gated norm's fp32 upcasts of the output and z and SiLU's output (3 x 6144 x 4), its
    two bf16 products (2 x 6144), its fp32 rms (48 x 4) and out_proj's input (6144); and fla's q and k at 16 key
    heads of 128 (2 x 2048), v (6144), A (64 per value head) with the fp32 inverse norms (2 x 16) and cumulative
    decay (48); selective: the conv's output (10240) and the fp32 decay (48) instead of fla's."""
    assumptions = shard().assumptions
    if recompute == "full":
        return tokens * 5120 * E
    block = (4 * 5120 + 4 * 17408) * E + 2 * 5120 * assumptions.norm_upcast_bytes
    around = 10240 * E + 48 * E + 2 * 48 * 4 + 3 * 6144 * 4 + 2 * 6144 * E + 48 * 4 + 6144 * E
    if recompute == "selective":
        return tokens * (block + around + 10240 * E + 48 * 4)
    kernel = (2 * 2048 + 6144 + 48 * 64) * E + (2 * 16 + 48) * 4
    return tokens * (block + around + kernel)


@pytest.mark.parametrize("seq", [4096, 16384])
def test_linear_layer_flops_and_bytes_by_hand_at_two_lengths(seq):
    terms = layer_terms(LINEAR, shard(seq=seq))
    assert terms.flops == pytest.approx(linear_layer_flops_by_hand(seq))
    for recompute in ("none", "selective", "full"):
        saved = layer_terms(LINEAR, shard(seq=seq, recompute=recompute)).saved_bytes
        assert saved == pytest.approx(linear_layer_saved_by_hand(seq, recompute)), recompute


def test_torch_fallbacks_saved_tensors_by_hand():
    """transformers' torch rule, 48 value heads of 128 (q and k repeated to them), C = 64, all fp32: 8 dk + 3 dv
    (12 dk with fp32 inputs, whose transposed layout makes four more copies), 5 C, 6 scalars, a state and a decay
    per chunk; the layer on it keeps the conv's SiLU input too (10240 more in the layer's dtype) and the rule's
    tensors instead of fla's."""
    w = linear_widths(LINEAR, 1)
    per_head = 8 * 128 + 3 * 128 + 5 * 64 + 6 + (128 * 128 + 1) / 64
    assert torch_chunk_rule_saved_bytes_per_token(w, 64, fp32_inputs=False) == pytest.approx(48 * per_head * 4)
    assert torch_chunk_rule_saved_bytes_per_token(w, 64, fp32_inputs=True) == pytest.approx(
        48 * (per_head + 4 * 128) * 4)
    fla = layer_terms(LINEAR, shard(seq=4096)).saved_bytes
    torch_kernel = layer_terms(LINEAR, shard(seq=4096, assumptions=replace(A, linear_attention_kernel="torch")))
    fla_kernel = (2 * 2048 + 6144 + 48 * 64) * E + (2 * 16 + 48) * 4
    assert torch_kernel.saved_bytes - fla == pytest.approx(4096 * (10240 * E + 48 * per_head * 4 - fla_kernel))


def test_fla_kernels_transients_by_hand():
    """fla's forward holds w (dk), u and v_new (2 dv) and every chunk's state (dk dv / C) per value head, and the
    contiguous copies of q and k at the 16 key heads; its backward
    w, u, v_new, du, dw, both dk and dv (3 dk + 4 dv), h and dh, db, dq and dk at the 16 key heads and two fp32 dg;
    the layer's backward buffers are the larger of the kernel's and the MLP's gradients (2.2 x 17408 a token)."""
    w = linear_widths(LINEAR, 1)
    forward = (48 * (128 + 2 * 128 + 256) + 2 * 2048) * E
    assert fla_chunk_rule_transient_bytes_per_token(w, 64, E, backward=False) == forward
    backward = fla_chunk_rule_transient_bytes_per_token(w, 64, E, backward=True)
    assert backward == 48 * (3 * 128 + 4 * 128 + 2 * 256 + 1) * E + 2 * 2048 * E + 2 * 48 * 4
    terms = layer_terms(LINEAR, shard(seq=4096))
    assert terms.buffer_bytes == 4096 * forward
    assert terms.backward_buffer_bytes == pytest.approx(4096 * max(backward, 2.2 * 17408 * E))


def test_linear_layer_grows_linearly_and_full_attention_faster():
    short, long = (layer_terms(LINEAR, shard(seq=seq)) for seq in (4096, 16384))
    assert long.flops == pytest.approx(4 * short.flops)
    assert long.saved_bytes == pytest.approx(4 * short.saved_bytes)
    full_short, full_long = (layer_terms(FULL, shard(seq=seq)) for seq in (4096, 16384))
    assert full_long.flops > 4.5 * full_short.flops


def test_selective_recompute_reruns_the_rule_and_full_the_layer():
    none, selective, full = (layer_terms(LINEAR, shard(seq=4096, recompute=r)) for r in ("none", "selective", "full"))
    assert full.saved_bytes < selective.saved_bytes < none.saved_bytes
    assert 0 < selective.recompute_s < full.recompute_s == pytest.approx(full.forward_s)


def test_tp_splits_both_head_kinds_and_ulysses_exchanges():
    one, two = layer_terms(LINEAR, shard(seq=4096)), layer_terms(LINEAR, shard(seq=4096, tp=2))
    assert two.flops == pytest.approx(one.flops / 2)
    assert layer_terms(LINEAR, shard(seq=4096, sp=2)).sp_comm_s > 0


def test_both_head_kinds_must_divide_and_ring_cp_is_refused():
    assert linear_attention_rules(2, 1, 1, 16, 48, "l") == []
    assert linear_attention_rules(4, 4, 1, 16, 24, "l") == [
        "tp*sp=16 does not divide the 24 linear-attention value heads of l"]
    assert linear_attention_rules(2, 3, 1, 16, 48, "l") == ["tp*sp=6 does not divide the 16 linear-attention key heads of l"]
    assert linear_attention_rules(3, 1, 1, 16, 48, "l") == ["tp=3 does not divide the 16 linear-attention key heads of l"]
    refused = linear_attention_rules(1, 1, 2, 16, 48, "l")
    assert len(refused) == 1 and "cp=2: ring context parallelism" in refused[0] and "\n" not in refused[0]


def test_ordered_chunks_balance_cost_not_count():
    """Three cheap layers (1) then an expensive one (5), twice: a split by count (4 + 4) is already balanced here,
    but with the expensive layers at the end of the first half the cost split moves them."""
    costs = [1, 1, 1, 5, 1, 1, 1, 1]
    assert balanced_ordered_chunks(costs, [0, 0]) == (4, 4)
    costs = [1, 1, 5, 5, 1, 1, 1, 1]
    assert balanced_ordered_chunks(costs, [0, 0]) == (3, 5)
    assert balanced_ordered_chunks([1, 1, 1, 1], [0, 10]) == (3, 1)
    assert balanced_ordered_chunks([1, 1, 1, 1], [0, 0], first_at_least=3) == (3, 1)


def test_rank_layers_count_each_type_in_order():
    held = rank_layers(LLM.layers, (6, 58), 0, 2, LLM.layer_order)
    counts = {layer.name: layer.count for layer in held}
    assert counts == {"embedding": 1, "linear_decoder_layer": 5, "decoder_layer": 1}
