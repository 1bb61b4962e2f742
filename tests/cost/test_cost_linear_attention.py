"""Qwen3.5's Gated DeltaNet layer against hand calculations: the chunked gated delta rule's FLOPs and saved bytes,
linear in the sequence (the gated full-attention layer quadratic), under every recompute mode; the shared rule for
both head kinds; pipeline chunks balanced by the cost of the hybrid layers they hold."""

from __future__ import annotations

import pytest
from test_cost_layers import shard

from planner.catalog import get_model
from planner.contract.rules import linear_attention_rules
from planner.cost.layers import layer_terms
from planner.cost.linear_attention import gated_delta_rule_flops_per_token, recurrent_state_bytes
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
    """Bytes kept for backward, tp = 1: the block's 4 h inputs (and the two norm inputs' fp32 copies,
    ``norm_upcast_bytes`` each), the MLP's 4 f, the conv's input and SiLU input (2 x 10240), q and k at 48 heads of 128 and
    v (3 x 6144), z, output and norm output (3 x 6144), a and b (2 x 48), and without recomputation fla's fp32
    A (64 per head), inverse norms and gates (4 per head)."""
    assumptions = shard().assumptions
    if recompute == "full":
        return tokens * 5120 * E
    block = (4 * 5120 + 4 * 17408) * E + 2 * 5120 * assumptions.norm_upcast_bytes
    mixer = (2 * 10240 + 3 * 6144 + 3 * 6144 + 2 * 48) * E
    kernel = 48 * (64 + 4) * 4 if recompute == "none" else 0
    return tokens * (block + mixer + kernel)


@pytest.mark.parametrize("seq", [4096, 16384])
def test_linear_layer_flops_and_bytes_by_hand_at_two_lengths(seq):
    terms = layer_terms(LINEAR, shard(seq=seq))
    assert terms.flops == pytest.approx(linear_layer_flops_by_hand(seq))
    for recompute in ("none", "selective", "full"):
        saved = layer_terms(LINEAR, shard(seq=seq, recompute=recompute)).saved_bytes
        assert saved == pytest.approx(linear_layer_saved_by_hand(seq, recompute)), recompute


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
