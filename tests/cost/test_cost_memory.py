"""Model-state, activation and buffer formulas against hand calculations and the papers' own numbers."""

from dataclasses import replace

import pytest
from cost_toys import LLM_HEAD_DIM, LLM_HIDDEN, LLM_KV_HEADS, decoder_layer, toy_model

from planner.cost.assumptions import DEFAULT_ASSUMPTIONS, BytesPerParam
from planner.cost.memory import (
    block_saved_bytes_per_token,
    bucket_bytes,
    kv_params,
    layer_params_per_rank,
    loss_logits_bytes,
    model_state_bytes,
    pipelined_fsdp_state_bytes,
    score_matrix_bytes,
    zero3_gather_bytes,
)

A = replace(DEFAULT_ASSUMPTIONS, norm_upcast_bytes=0.0)
"""Korthikanti et al. count fused norms; the unfused fp32 copies are tested on their own below."""
MIXED = A.bf16_mixed


def test_recipes():
    assert A.bytes_per_param("bf16_mixed").total == 16  # 2 + 2 + 12
    assert A.bytes_per_param("bf16_pure").total == 8  # 2 + 2 + 2 + 2
    with pytest.raises(ValueError, match="unknown precision"):
        A.bytes_per_param("fp8")


def test_zero_paper_figure_1():
    # ZeRO Fig. 1: Psi = 7.5B, N = 64, K = 12 -> 120 GB, 31.4 GB, 16.6 GB, 1.9 GB
    psi, n = 7.5e9, 64
    totals = [sum(model_state_bytes(psi, MIXED, zero=z, shards=n, frozen=False)) / 1e9 for z in (0, 1, 2, 3)]
    assert totals[0] == pytest.approx(120)
    assert totals[1] == pytest.approx(31.4, abs=0.05)  # 2+2 + 12/64 = 4.1875 B/param
    assert totals[2] == pytest.approx(16.6, abs=0.05)  # 2 + 14/64 = 2.21875
    assert totals[3] == pytest.approx(1.875)  # 16/64


def test_zero_breakdown_and_frozen():
    w, g, o = model_state_bytes(1000, MIXED, zero=2, shards=4, frozen=False)
    assert (w, g, o) == (2000, 500, 3000)
    # frozen: weights only (ZeRO-3 still shards them)
    assert model_state_bytes(1000, MIXED, zero=0, shards=4, frozen=True) == (2000, 0.0, 0.0)
    assert model_state_bytes(1000, MIXED, zero=3, shards=4, frozen=True) == (500, 0.0, 0.0)


def test_pipelined_fsdp_keeps_zero1s_weights_and_unsharded_accumulated_gradients():
    # bf16 weights gathered (2 B/param), fp32 gradients accumulated unsharded (4 B/param); frozen: weights only
    assert pipelined_fsdp_state_bytes(1000, MIXED, accumulated_gradient_bytes=4.0, frozen=False) == (2000, 4000)
    assert pipelined_fsdp_state_bytes(1000, MIXED, accumulated_gradient_bytes=4.0, frozen=True) == (2000, 0.0)


def test_layer_params_per_rank_tp_and_kv_replication():
    layer = decoder_layer()
    kv = kv_params(layer)
    assert kv == 2 * (LLM_HIDDEN + 1) * LLM_KV_HEADS * LLM_HEAD_DIM  # k and v weights + biases
    assert layer_params_per_rank(layer, 1) == layer.params
    assert layer_params_per_rank(layer, 2) == pytest.approx(layer.params / 2)  # 2 KV heads split 2 ways
    # tp=8 > 2 KV heads: every rank holds the whole K/V projections (replicated), the rest split 8 ways
    assert layer_params_per_rank(layer, 8) == pytest.approx((layer.params - kv) / 8 + kv)


def test_replicated_kinds_are_not_split():
    patch = toy_model().module("vision").layer("patch_embed")
    assert layer_params_per_rank(patch, 4) == patch.params


def _gpt(t, recompute="none", assumptions=A):
    h = 1024
    return block_saved_bytes_per_token(
        hidden=h,
        q_width=h / t,
        kv_width=h / t,
        mlp_width=4 * h / t,
        gated=False,
        heads=16 / t,
        tp=t,
        recompute=recompute,
        assumptions=assumptions,
    )


def test_korthikanti_eq2_without_dropout():
    # eq. 2: s b h (10 + 24/t) + 5 a s^2 b / t; without dropout masks: s b h (8 + 24/t) + 2 a s^2 b / t
    eager = replace(A, attention_implementation="eager", eager_score_bytes_per_element=2)
    for t in (1, 2, 8):
        assert _gpt(t, assumptions=eager) == pytest.approx(1024 * (8 + 24 / t))
    s, a, t = 2048, 16, 4
    assert score_matrix_bytes(s * s * a / t, "none", eager) == pytest.approx(2 * a * s * s / t)


def test_unfused_norms_keep_an_fp32_copy_of_both_norm_inputs():
    # GPT layer, h = 1024 per token: fused 1024 * 32 B + 64 B logsumexp; unfused adds 2 inputs * 1024 * 4 B
    unfused = replace(A, norm_upcast_bytes=4.0)
    assert _gpt(1, assumptions=unfused) == pytest.approx(1024 * 32 + 16 * 4 + 2 * 1024 * 4)
    # under full recompute only the block input is kept: no norm copies
    assert _gpt(1, assumptions=unfused, recompute="full") == pytest.approx(_gpt(1, recompute="full"))


def test_flash_adds_logsumexp_only():
    # flash: 1024 * (8 + 24) bytes + 16 heads * 4 B of fp32 logsumexp
    assert _gpt(1) == pytest.approx(1024 * 32 + 16 * 4)
    assert score_matrix_bytes(1e9, "none", A) == 0.0


def test_selective_recompute_drops_scores_and_stats():
    eager = replace(A, attention_implementation="eager")
    assert score_matrix_bytes(1e6, "selective", eager) == 0.0
    assert _gpt(1, "selective") == pytest.approx(1024 * 32)


def test_full_recompute_keeps_block_input_only():
    assert _gpt(4, "full") == pytest.approx(1024 * 2)
    sp = replace(A, megatron_sequence_parallel=True)
    assert _gpt(4, "full", sp) == pytest.approx(1024 * 2 / 4)


def test_megatron_sequence_parallel_splits_replicated_part():
    # Korthikanti eq. 4 (TP + SP): everything / t -> (8 + 24)/t per h without dropout
    sp = replace(A, megatron_sequence_parallel=True, attention_implementation="eager")
    assert _gpt(4, assumptions=sp) == pytest.approx(1024 * 32 / 4)


def test_swiglu_and_gqa_per_token():
    # h=128, q=8x16=128, kv=2x16=32, f=256 gated, tp=1:
    # 4h + (2*128 + 2*32) + 4*256 = 512 + 320 + 1024 = 1856 elements * 2 B + 8 heads * 4 B
    got = block_saved_bytes_per_token(
        hidden=128,
        q_width=128,
        kv_width=32,
        mlp_width=256,
        gated=True,
        heads=8,
        tp=1,
        recompute="none",
        assumptions=A,
    )
    assert got == 1856 * 2 + 32


def test_loss_logits():
    # 1000 tokens x 500 vocab per rank: saved 4 B, transient 6 B per logit
    # 1000 x 500 logits: saved 4 B, forward transient 6 B, backward transient 8 B each
    assert loss_logits_bytes(1000, 500, A) == (2e6, 3e6, 4e6)
    # vocab-parallel (torch's loss_parallel): one more fp32 copy of the local logits in each pass, 4 B each
    assert loss_logits_bytes(1000, 500, A, vocab_parallel=True) == (2e6, 5e6, 6e6)


def test_zero3_gather_buffer():
    # forward: (3e6 root params + (1 + 1 prefetch) * 1e6 block params) * 2 B
    assert zero3_gather_bytes(3e6, 1e6, MIXED, prefetch=1, frozen=False, backward=False) == 10e6
    # backward adds the unsharded gradients of the root unit and one block: (3e6 + 1e6) * 2 B
    assert zero3_gather_bytes(3e6, 1e6, MIXED, prefetch=1, frozen=False, backward=True) == 18e6
    assert zero3_gather_bytes(3e6, 1e6, MIXED, prefetch=1, frozen=True, backward=True) == 10e6
    assert zero3_gather_bytes(0, 1e6, MIXED, prefetch=2, frozen=True, backward=False) == 6e6


def test_bucket_bytes_capped_by_gradients():
    assert bucket_bytes(1e12, A) == 2 * 25 * 1024**2
    assert bucket_bytes(1e6, A) == 1e6


def test_custom_recipe():
    recipe = BytesPerParam(weights=1, gradients=2, optimizer=4)
    assert model_state_bytes(10, recipe, zero=0, shards=1, frozen=False) == (10, 20, 40)
