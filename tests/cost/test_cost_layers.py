"""Per-layer analytical terms against hand calculations on the toy model."""

from dataclasses import replace

import pytest
from cost_toys import COMPUTE_ONLY, TOY_DEVICE, toy_model

from planner.cost.comm import Link, all_gather_time, all_reduce_time, all_to_all_time, p2p_time
from planner.cost.compute import attention_core_time, gemm_time
from planner.cost.layers import (
    Shard,
    block_elementwise_elements,
    gemm_backward_factor,
    layer_terms,
    ring_kv_pass_time,
    ulysses_all_to_all_time,
)

A = COMPUTE_ONLY
LINK = Link(bandwidth=1.6e11, latency=1e-5)
MODEL = toy_model()
DECODER = MODEL.module("llm").layer("decoder_layer")
WINDOW = MODEL.module("vision").layer("window_block")
FULL = MODEL.module("vision").layer("full_block")


def shard(*, tp=1, sp=1, cp=1, mb=1, seq=64, windows=0, recompute="none", backward="full", assumptions=A):
    return Shard(
        tp=tp,
        sp=sp,
        cp=cp,
        micro_batch=mb,
        tokens=mb * seq / (sp * cp),
        segment_tokens=seq,
        segments=1,
        window_tokens=seq / windows if windows else 0.0,
        windows=windows,
        recompute=recompute,
        backward=backward,
        tp_link=LINK,
        sp_link=LINK,
        cp_link=LINK,
        device=TOY_DEVICE,
        assumptions=assumptions,
    )


# decoder, 64 tokens, tp=1: q 128x128, k,v 32x128, o 128x128, gate/up 256x128, down 128x256
DECODER_GEMM_FLOPS = 2 * 64 * (128 * 128 + 2 * 32 * 128 + 128 * 128 + 2 * 256 * 128 + 128 * 256)
DECODER_ATTN_FLOPS = 4 * 64 * 64 * 128 * 0.5  # causal half


def test_gemm_backward_factor():
    assert gemm_backward_factor("full", A) == 2
    assert gemm_backward_factor("input", A) == 1
    assert gemm_backward_factor("none", A) == 0


def test_decoder_flops():
    t = layer_terms(DECODER, shard())
    assert DECODER_GEMM_FLOPS == 17825792
    assert t.flops == pytest.approx(DECODER_GEMM_FLOPS + DECODER_ATTN_FLOPS)
    assert t.backward_flops == pytest.approx(2 * (DECODER_GEMM_FLOPS + DECODER_ATTN_FLOPS))


def test_frozen_backward_modes():
    full = layer_terms(DECODER, shard())
    inputs = layer_terms(DECODER, shard(backward="input"))
    none = layer_terms(DECODER, shard(backward="none"))
    assert inputs.backward_flops == pytest.approx(DECODER_GEMM_FLOPS + 2 * DECODER_ATTN_FLOPS)
    assert inputs.backward_s < full.backward_s
    assert none.backward_s == 0.0 and none.saved_bytes == 0.0 and none.tp_comm_s == 0.0
    assert none.forward_s == pytest.approx(full.forward_s)


def test_decoder_saved_activations():
    # per token: 4h + 2q + 2kv + 4f = 512 + 256 + 64 + 1024 = 1856 elements * 2 B + 8 heads * 4 B lse
    # + the fp32 copies of the two norm inputs, 2 * 128 * 4 B
    assert layer_terms(DECODER, shard()).saved_bytes == pytest.approx(64 * (1856 * 2 + 32 + 2 * 128 * 4))


def test_gemm_time_sums_the_shapes():
    expected = sum(
        gemm_time(64, n, k, TOY_DEVICE, A)
        for n, k in ((128, 128), (32, 128), (32, 128), (128, 128), (256, 128), (256, 128), (128, 256))
    )
    none = layer_terms(DECODER, shard(backward="none"))
    attention = attention_core_time(DECODER_ATTN_FLOPS, 64, 0, TOY_DEVICE, A)
    assert none.forward_s > expected + attention  # plus elementwise traffic
    assert none.forward_s < expected + attention + 1e-5


def test_tp_all_reduces_two_forward_two_backward():
    # 4 all-reduces of 64 tokens x 128 x 2 B over the TP group
    t = layer_terms(DECODER, shard(tp=2))
    assert t.tp_comm_s == pytest.approx(4 * all_reduce_time(64 * 128 * 2, 2, LINK))


def test_tp_replicating_kv_heads_adds_their_backward_all_reduces():
    # tp=4 over 2 KV heads: for K and for V, the input gradient (64 x 128 x 2 B), the weight gradient
    # (128 x 2 heads x 16 x 2 B) and the bias gradient (2 heads x 16 x 2 B), each all-reduced over the 4 TP ranks
    t = layer_terms(DECODER, shard(tp=4))
    block = 4 * all_reduce_time(64 * 128 * 2, 4, LINK)
    kv = 2 * (all_reduce_time(64 * 128 * 2, 4, LINK) + all_reduce_time(128 * 32 * 2, 4, LINK)
              + all_reduce_time(32 * 2, 4, LINK))
    assert t.tp_comm_s == pytest.approx(block + kv)
    assert layer_terms(DECODER, shard(tp=2)).tp_comm_s == pytest.approx(4 * all_reduce_time(64 * 128 * 2, 2, LINK))


def test_full_recompute_reruns_forward_and_its_all_reduces():
    t = layer_terms(DECODER, shard(tp=2, recompute="full"))
    assert t.recompute_s == pytest.approx(t.forward_s)
    assert t.tp_comm_s == pytest.approx(6 * all_reduce_time(64 * 128 * 2, 2, LINK))
    # only the block input (h per token, replicated under TP without sequence parallelism) is kept
    assert t.saved_bytes == pytest.approx(64 * 128 * 2)


def test_selective_recompute_reruns_attention_core():
    t = layer_terms(DECODER, shard(recompute="selective"))
    assert t.recompute_s == pytest.approx(attention_core_time(DECODER_ATTN_FLOPS, 64, 0, TOY_DEVICE, A))


def test_tp_splits_decoder_flops():
    # tp=2 splits every GEMM and the heads: 2 KV heads -> 1 per rank, no replication
    assert layer_terms(DECODER, shard(tp=2)).flops == pytest.approx((DECODER_GEMM_FLOPS + DECODER_ATTN_FLOPS) / 2)


def test_window_attention_flops():
    # 4 windows of 16 patches, width 64: 4 * 16^2 * 64 * 4 windows; full block: 4 * 64^2 * 64
    gemm = 2 * 64 * (64 * 192 + 64 * 64 + 2 * 128 * 64 + 64 * 128)
    assert layer_terms(WINDOW, shard(windows=4)).flops == pytest.approx(gemm + 4 * 16 * 16 * 64 * 4)
    assert layer_terms(FULL, shard(windows=4)).flops == pytest.approx(gemm + 4 * 64 * 64 * 64)


def test_ulysses_exchanges_nothing_on_window_blocks():
    assert layer_terms(WINDOW, shard(sp=2, windows=4)).sp_comm_s == 0.0


def test_ulysses_all_to_alls_on_full_attention():
    # 32 tokens per rank; q, k, v, out each 32 x 64 x 2 B; 4 all-to-alls forward + 4 backward
    t = layer_terms(FULL, shard(sp=2, windows=4))
    assert t.sp_comm_s == pytest.approx(8 * all_to_all_time(32 * 64 * 2, 2, LINK))


def test_ulysses_divides_activations():
    one = layer_terms(FULL, shard(windows=4)).saved_bytes
    two = layer_terms(FULL, shard(sp=2, windows=4)).saved_bytes
    assert two == pytest.approx(one / 2)


def test_ring_cp_passes_kv_blocks():
    # cp=2: 32 tokens per rank, KV block 32 x (2 x 128) x 2 B (the 1 KV head repeated to the 4 query heads of 32,
    # as the runtime passes them); forward 1 pass, backward KV + dKV
    no_overlap = replace(A, cp_comm_overlap=0.0)
    t = layer_terms(DECODER, shard(cp=2, assumptions=no_overlap))
    assert t.cp_comm_s == pytest.approx(3 * p2p_time(32 * 256 * 2, LINK))
    hidden = layer_terms(DECODER, shard(cp=2))
    assert hidden.cp_comm_s < t.cp_comm_s


def test_eager_stores_score_matrix():
    eager = replace(A, attention_implementation="eager")
    flash = layer_terms(FULL, shard(windows=4)).saved_bytes
    t = layer_terms(FULL, shard(windows=4, assumptions=eager))
    # 64^2 scores x 4 heads x 6 B (fp32 softmax + bf16 copy), minus 4 heads x 4 B x 64 tokens of logsumexp
    assert t.saved_bytes - flash == pytest.approx(64 * 64 * 4 * 6 - 64 * 4 * 4)


def test_patch_embed_backward_is_weight_gradient_only():
    patch = MODEL.module("vision").layer("patch_embed")
    t = layer_terms(patch, shard())
    assert t.backward_s == pytest.approx(t.forward_s)
    assert t.saved_bytes == 64 * 1176 * 2  # pixels kept for the weight gradient
    assert layer_terms(patch, shard(backward="input")).backward_s == 0.0


def test_lm_head_logits():
    head = MODEL.module("llm").layer("lm_head")
    t = layer_terms(head, shard(tp=2))
    # input 64 x 128 x 2 B + fp32 log-softmax 64 x 500 x 4 B; transient 64 x 500 x (6 + 4 of loss_parallel) B
    assert t.saved_bytes == pytest.approx(64 * 128 * 2 + 64 * 500 * 4)
    assert t.buffer_bytes == pytest.approx(64 * 500 * 10)
    assert layer_terms(head, shard()).buffer_bytes == pytest.approx(64 * 1000 * 6)  # one rank: fused, no extra


def test_merger_reduces_tokens():
    merger = MODEL.module("vision").layer("patch_merger")
    # 64 patches -> 16 tokens: (16 x 256 x 256) and (16 x 128 x 256) GEMMs
    assert layer_terms(merger, shard()).flops == pytest.approx(2 * 16 * 256 * 256 + 2 * 16 * 128 * 256)


def test_embedding_keeps_int64_token_ids():
    emb = MODEL.module("llm").layer("embedding")
    assert layer_terms(emb, shard()).saved_bytes == 64 * 8
    assert layer_terms(emb, shard(backward="input")).saved_bytes == 0


def test_vision_blocks_keep_fp32_rotary_copies_of_q_and_k():
    a = WINDOW.attention
    no_copy = replace(A, vision_rotary_upcast_bytes=0.0)
    extra = layer_terms(WINDOW, shard()).saved_bytes - layer_terms(WINDOW, shard(assumptions=no_copy)).saved_bytes
    # 64 tokens x (q + k) x heads * head_dim x 4 B
    assert extra == pytest.approx(64 * 2 * a.num_heads * a.head_dim * 4)
    # decoder layers rotate in the activation dtype; full recomputation keeps only the block input
    assert layer_terms(DECODER, shard(assumptions=no_copy)).saved_bytes == pytest.approx(
        layer_terms(DECODER, shard()).saved_bytes)
    full = shard(recompute="full")
    assert layer_terms(WINDOW, full).saved_bytes == layer_terms(WINDOW, replace(full, assumptions=no_copy)).saved_bytes


def test_merger_keeps_the_fp32_copy_of_its_norm_input():
    merger = MODEL.module("vision").layer("patch_merger")
    no_copy = replace(A, norm_upcast_bytes=0.0)
    extra = layer_terms(merger, shard()).saved_bytes - layer_terms(merger, shard(assumptions=no_copy)).saved_bytes
    assert extra == pytest.approx(64 * merger.hidden_size * 4)


def test_frozen_embedding_has_no_backward():
    emb = MODEL.module("llm").layer("embedding")
    assert layer_terms(emb, shard(backward="input")).backward_s == 0.0
    assert layer_terms(emb, shard()).backward_s > 0.0


def test_ulysses_all_to_all_time_formula():
    # q and out: 2 x a2a(100 tokens x 64 x 2 B); k and v: 2 x a2a(100 x 32 x 2 B)
    s = shard(sp=4)
    expected = 2 * all_to_all_time(100 * 64 * 2, 4, LINK) + 2 * all_to_all_time(100 * 32 * 2, 4, LINK)
    assert ulysses_all_to_all_time(100, 64, 32, s) == pytest.approx(expected)


def test_ring_kv_pass_time_formula():
    # cp=4: 3 passes of a 1 MB block
    assert ring_kv_pass_time(1e6, shard(cp=4)) == pytest.approx(3 * p2p_time(1e6, LINK))


def test_block_elementwise_elements():
    # decoder, 64 tokens, tp=1: 10h + 2(q + kv) + 3f = 1280 + 2*(128 + 32) + 768 = 2368 per token
    assert block_elementwise_elements(DECODER, shard()) == 64 * 2368


def test_a_packed_row_under_sdpa_attends_its_whole_row_through_a_dense_mask():
    """A decoder row of 4 packed samples of 16 tokens: ``varlen`` attends each sample (causal half of 4 x 16^2
    pairs per head width), per-segment ``sdpa`` runs transformers' packed mask, every one of the 64^2 pairs computed
    and a 64 x 64 boolean mask beside them; a row of one sample needs no mask."""
    def packed(calls, segments=4):
        s = replace(shard(assumptions=replace(A, attention_calls=calls)), segment_tokens=64 / segments,
                    segments=segments)
        return layer_terms(DECODER, s), layer_terms(DECODER, replace(s, segments=segments))

    varlen, _ = packed("varlen")
    sdpa, _ = packed("sdpa")
    assert varlen.flops == pytest.approx(DECODER_GEMM_FLOPS + 4 * 4 * 16 * 16 * 128 * 0.5)
    assert sdpa.flops == pytest.approx(DECODER_GEMM_FLOPS + 4 * 64 * 64 * 128)
    assert sdpa.buffer_bytes - varlen.buffer_bytes == 64 * 64
    alone = layer_terms(DECODER, shard(assumptions=replace(A, attention_calls="sdpa")))
    assert alone.flops == pytest.approx(DECODER_GEMM_FLOPS + DECODER_ATTN_FLOPS) and alone.buffer_bytes == 0


def test_a_packed_row_over_context_parallelism_gathers_keys_and_values_under_its_own_mask():
    """A decoder row of 4 packed samples of 16 tokens over CP2 runs the all-gather form: each rank's 32 queries
    attend all 64 keys (every pair computed, 4 x 32 x 64 x 128 FLOPs), its 32 x 64 boolean mask lives through the
    step, the KV blocks (32 tokens x 2 x 4 heads x 32 x 2 B = 16 KiB a rank, the 1 KV head repeated) are
    all-gathered forward and their gradient all-reduced backward, unhidden. Without recomputation SDPA keeps the
    other rank's block; selective recomputation keeps none, and holds the gathered blocks transiently instead."""
    e = A.activation_bytes
    kv_block = 32 * 2 * 4 * 32 * e

    def row(recompute="none", segments=4):
        return layer_terms(DECODER, replace(shard(cp=2, recompute=recompute), segment_tokens=64 / segments,
                                            segments=segments))

    packed, ring = row(), row(segments=1)
    assert packed.flops == pytest.approx(DECODER_GEMM_FLOPS / 2 + 4 * 32 * 64 * 128)
    assert packed.cp_comm_s == pytest.approx(all_gather_time(2 * kv_block, 2, LINK) + all_reduce_time(2 * kv_block, 2,
                                                                                                        LINK))
    assert packed.buffer_bytes == 32 * 64
    assert packed.saved_bytes - ring.saved_bytes == pytest.approx(kv_block)
    selective, ring_selective = row("selective"), row("selective", segments=1)
    assert selective.buffer_bytes == pytest.approx(32 * 64 + 2 * kv_block)
    assert selective.backward_buffer_bytes == pytest.approx(32 * 64 + 4 * kv_block)
    assert selective.saved_bytes == pytest.approx(ring_selective.saved_bytes)


def test_the_vision_towers_full_blocks_over_context_parallelism_gather_and_attend_their_own_image():
    """A vision full block of two 32-patch images over CP2: each rank's 32 queries attend their own image's 32 keys
    (half the FLOPs of one rank: no query computes against another image, none waits on a causal block); its KV
    block (32 patches x 2 x 64 x 2 B) is all-gathered forward and its gradient all-reduced backward, unhidden; no
    mask is built; SDPA keeps the other rank's block for its backward (beyond what an SP2 rank of the same 32
    patches saves). A window block keeps its windows on the rank: no CP exchange."""
    e = A.activation_bytes
    kv_block = 32 * 2 * 64 * e

    def images(**degrees):
        return layer_terms(FULL, replace(shard(**degrees), segment_tokens=32, segments=2))

    one, cp2, sp2 = images(), images(cp=2), images(sp=2)
    assert cp2.flops == pytest.approx(one.flops / 2)
    assert cp2.cp_comm_s == pytest.approx(all_gather_time(2 * kv_block, 2, LINK) + all_reduce_time(2 * kv_block, 2,
                                                                                                     LINK))
    assert cp2.buffer_bytes == 0 and cp2.saved_bytes - sp2.saved_bytes == pytest.approx(kv_block)
    windows = layer_terms(WINDOW, shard(cp=2, windows=4))
    assert windows.cp_comm_s == 0 and windows.flops == pytest.approx(layer_terms(WINDOW, shard(windows=4)).flops / 2)


def test_per_head_qk_norms_keep_an_fp32_copy_and_the_normalised_heads():
    """Qwen3's q_norm / k_norm: per element of the rank's q and k widths, the fp32 input copy (4 B) and the
    normalised bf16 tensor (2 B). The toy decoder over 64 tokens: q 8 heads x 16, k 2 x 16 -> 64 x 160 x 6 B; TP2
    halves both; under TP4 a rank holds 2 query heads and one KV head, replicated (64 x 48 x 6 B); full
    recomputation keeps none of it."""
    normed = replace(DECODER, attention=replace(DECODER.attention, qk_norm=True))
    assert (DECODER.attention.num_heads, DECODER.attention.num_kv_heads, DECODER.attention.head_dim) == (8, 2, 16)
    for tp, widths in ((1, 128 + 32), (2, 64 + 16), (4, 32 + 16)):
        extra = layer_terms(normed, shard(tp=tp)).saved_bytes - layer_terms(DECODER, shard(tp=tp)).saved_bytes
        assert extra == pytest.approx(64 * widths * 6)
    full = shard(recompute="full")
    assert layer_terms(normed, full).saved_bytes == layer_terms(DECODER, full).saved_bytes


def test_an_mlps_backward_holds_its_hidden_gradients_beside_the_saved_activations():
    """The toy decoder's SwiGLU (intermediate 256): its backward holds 2.2 tensors of 64 tokens x 256 / tp beside
    what the layer saved (an ungated MLP 1.3); the forward holds none, and a TP rank holds its share."""
    e = A.activation_bytes
    for tp in (1, 2):
        t = layer_terms(DECODER, shard(tp=tp))
        assert t.backward_buffer_bytes == pytest.approx(2.2 * 64 * 256 / tp * e)
        assert t.buffer_bytes == 0
    ungated = replace(DECODER, mlp=replace(DECODER.mlp, gated=False))  # fc1, activation, fc2: 1.3 such tensors
    assert layer_terms(ungated, shard()).backward_buffer_bytes == pytest.approx(1.3 * 64 * 256 * e)
