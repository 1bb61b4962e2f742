"""Mixture-of-experts terms against hand calculations: the token exchange, the grouped expert GEMMs, the router,
load imbalance and the memory of experts under expert parallelism (the tiny Qwen3-VL-MoE's decoder layer: hidden
128, 8 experts of width 64, top-2). An EP group is ep data ranks with all their tp ranks: each rank holds 8 / (ep x tp)
whole experts and routes a 1/tp slice of the tokens its TP group shares (torchtitan's etp=1, transformers
``AllToAllEP``)."""

from dataclasses import replace

import pytest
from cost_toys import COMPUTE_ONLY, TOY_DEVICE

from planner.catalog import get_model
from planner.cost import module_cost
from planner.cost.comm import Link, all_gather_time, all_reduce_time, all_to_all_time
from planner.cost.compute import gemm_time, grouped_gemm_efficiency, grouped_gemm_time, matmul_efficiency
from planner.cost.layers import (
    Shard,
    expert_all_to_all_time,
    expert_elementwise_elements,
    expert_terms,
    layer_terms,
)
from planner.cost.rank_cost import _STATIC, axes_within_node
from planner.cost.memory import expert_dispatch_buffer_bytes, expert_saved_bytes_per_token, layer_params_per_rank
from planner.contract.hardware import make_cluster
from planner.contract.strategy import ModuleStrategy
from planner.contract.workload import Workload

A = COMPUTE_ONLY
LINK = Link(bandwidth=1.6e11, latency=1e-5)
TP_LINK = Link(bandwidth=4e11, latency=2e-6)
MODEL = get_model("qwen3-vl-moe-tiny")
MOE_LAYER = MODEL.module("llm").layer("decoder_layer")
H, F, E, K = 128, 64, 8, 2


def shard(*, tp=1, ep=1, tokens=64, recompute="none", assumptions=A, tp_link=LINK):
    return Shard(tp=tp, sp=1, cp=1, micro_batch=1, tokens=tokens, segment_tokens=tokens, segments=1,
                 window_tokens=0.0, windows=0, recompute=recompute, backward="full", tp_link=tp_link, sp_link=LINK,
                 cp_link=LINK, device=TOY_DEVICE, assumptions=assumptions, ep=ep, ep_link=LINK)


def test_the_tiny_layer_is_what_the_hand_numbers_assume():
    moe = MOE_LAYER.moe
    assert (MOE_LAYER.hidden_size, moe.expert_intermediate_size, moe.num_experts, moe.experts_per_token) == (H, F, E, K)
    assert moe.expert_params == E * 3 * H * F


def test_dispatch_and_combine_all_to_alls_by_hand():
    """64 tokens x top-2 x 128 wide x 2 bytes = 32,768 bytes per direction, 1.25x on the busiest rank; 3/4 of it
    leaves each of 4 EP ranks; dispatch + combine in forward, their gradients in backward."""
    volume = 64 * 2 * 128 * 2 * 1.25
    one = 3 / 4 * volume / 1.6e11 + 3 * 1e-5
    assert expert_all_to_all_time(64, MOE_LAYER, shard(ep=4)) == pytest.approx(2 * one)
    assert all_to_all_time(volume, 4, LINK) == pytest.approx(one)
    assert layer_terms(MOE_LAYER, shard(ep=4)).ep_comm_s == pytest.approx(4 * one)
    assert expert_all_to_all_time(64, MOE_LAYER, shard(ep=1)) == 0.0


def test_tp_slices_the_exchange_and_all_gathers_the_outputs_by_hand():
    """ep=2 x tp=2: each TP rank routes 64 / 2 = 32 tokens, 32 x top-2 x 128 wide x 2 bytes = 16,384 bytes per
    direction, 1.25x on the busiest rank; 3/4 of it leaves each of the 2 x 2 = 4 ranks of the EP group. Then the TP
    pair all-gathers the 64 x 128 x 2 = 16,384-byte output over the TP link (1/2 of it arrives, one latency); the
    backward runs both all-to-alls and one all-gather again (of the row gradients)."""
    one = 3 / 4 * (32 * 2 * 128 * 2 * 1.25) / 1.6e11 + 3 * 1e-5
    gather = 1 / 2 * (64 * 128 * 2) / 4e11 + 2e-6
    assert all_gather_time(64 * 128 * 2, 2, TP_LINK) == pytest.approx(gather)
    both = shard(tp=2, ep=2, tp_link=TP_LINK)
    assert expert_all_to_all_time(64, MOE_LAYER, both) == pytest.approx(2 * one + gather)
    assert layer_terms(MOE_LAYER, both).ep_comm_s == pytest.approx(2 * (2 * one + gather))
    recomputed = shard(tp=2, ep=2, tp_link=TP_LINK, recompute="full")
    assert layer_terms(MOE_LAYER, recomputed).ep_comm_s == pytest.approx(3 * (2 * one + gather))


def test_tp_alone_splits_the_experts_over_its_ranks_by_hand():
    """ep=1 x tp=2: the 2 TP ranks are the EP group; each sends 1/2 of its 32 x 2 x 128 x 2 x 1.25 bytes to the
    other, twice, and the pair all-gathers the 64 x 128 x 2-byte output."""
    one = 1 / 2 * (32 * 2 * 128 * 2 * 1.25) / 1.6e11 + 1e-5
    gather = 1 / 2 * (64 * 128 * 2) / 4e11 + 2e-6
    assert expert_all_to_all_time(64, MOE_LAYER, shard(tp=2, tp_link=TP_LINK)) == pytest.approx(2 * one + gather)


def test_grouped_gemm_efficiency_halves_at_the_named_tokens_per_expert():
    full = matmul_efficiency(float("inf"), 4096, 4096, A)
    assert grouped_gemm_efficiency(A.expert_gemm_half_efficiency_tokens, 4096, 4096, A) == pytest.approx(full / 2)
    slower = replace(A, expert_gemm_half_efficiency_tokens=4 * A.expert_gemm_half_efficiency_tokens)
    assert grouped_gemm_efficiency(128, 4096, 4096, slower) == pytest.approx(full / 5)


def test_grouped_gemm_time_by_hand():
    """4 experts x 2 x t x 4096 x 4096 FLOPs at 0.7 * 4096/4224 * t/(t + 128) of 1 PFLOP/s, against reading the 4
    weights and the rows (2 bytes each) at 0.8 x 2 TB/s: 256 tokens per expert are weight-bound, 4,096 are not."""
    for tokens in (256, 4096):
        efficiency = 0.7 * 4096 / (4096 + 128) * tokens / (tokens + 128)
        compute = 4 * 2 * tokens * 4096 * 4096 / (1e15 * efficiency)
        memory = 4 * 2 * (2 * tokens * 4096 + 4096 * 4096) / (0.8 * 2e12)
        assert grouped_gemm_time(tokens, 4, 4096, 4096, TOY_DEVICE, A) == pytest.approx(max(compute, memory))
        assert (memory > compute) == (tokens == 256)


def test_router_and_expert_flops_by_hand():
    """Router 2 t h E on all 64 tokens (replicated on TP ranks), experts 6 (t / tp) k h f on the rank's TP slice of
    whole experts (their mean, whatever the imbalance)."""
    for tp, ep in ((1, 1), (1, 4), (2, 2), (2, 1)):
        _, flops, _, _ = expert_terms(MOE_LAYER, shard(tp=tp, ep=ep))
        assert flops == 2 * 64 * H * E + 6 * (64 / tp) * K * H * F


def test_load_imbalance_multiplies_the_busiest_ranks_expert_time():
    """With ep > 1 the busiest rank's grouped GEMMs take imbalance x the mean tokens; one rank holding every expert
    receives exactly its own."""
    router = gemm_time(64, E, H, TOY_DEVICE, A)
    per_expert = 64 * K * 1.25 / (E / 4)
    shapes = ((F, H), (F, H), (H, F))
    expected = router + sum(grouped_gemm_time(per_expert, E / 4, n, k, TOY_DEVICE, A) for n, k in shapes)
    assert expert_terms(MOE_LAYER, shard(ep=4))[0] == pytest.approx(expected)
    balanced = replace(A, moe_load_imbalance=1.0)
    assert expert_terms(MOE_LAYER, shard(ep=4, assumptions=balanced))[0] < expected
    assert expert_terms(MOE_LAYER, shard(ep=1))[0] == expert_terms(MOE_LAYER, shard(ep=1, assumptions=balanced))[0]


def test_tp_ranks_hold_whole_experts_and_route_their_slice_by_hand():
    """ep=2 x tp=2: 8 / 4 = 2 whole experts (width 64) per rank, each getting 64 / 2 tokens x top-2 x 1.25 / 2 = 40
    rows on the busiest rank; the router still runs on all 64 tokens. tp=2 alone splits the experts too (4 each,
    imbalance applies)."""
    router = gemm_time(64, E, H, TOY_DEVICE, A)
    expected = router + sum(grouped_gemm_time(40, 2, n, k, TOY_DEVICE, A) for n, k in ((F, H), (F, H), (H, F)))
    assert expert_terms(MOE_LAYER, shard(tp=2, ep=2))[0] == pytest.approx(expected)
    tp_only = router + sum(grouped_gemm_time(20, 4, n, k, TOY_DEVICE, A) for n, k in ((F, H), (F, H), (H, F)))
    assert expert_terms(MOE_LAYER, shard(tp=2))[0] == pytest.approx(tp_only)


def test_expert_elementwise_traffic_by_hand():
    """Router softmax: 64 tokens x 2 x 8 logits on every TP rank; per routed copy of the rank's slice (64 / tp x 2 x
    1.25 with experts split) 6 x 128 permutation and scaling plus 3 x 64 SwiGLU elements."""
    assert expert_elementwise_elements(MOE_LAYER, shard()) == 64 * 2 * 8 + 64 * 2 * (6 * 128 + 3 * 64)
    assert expert_elementwise_elements(MOE_LAYER, shard(tp=2, ep=2)) == 64 * 2 * 8 + 80 * (6 * 128 + 3 * 64)


def test_expert_activation_and_buffer_bytes_by_hand():
    """Per token: fp32 router softmax (8 x 4) + 2 x 1.25 copies x (2 x 128 rows + 4 x 64 SwiGLU) x 2 bytes; the
    exchange holds the 128 sent and 160 received rows of 128 x 2 bytes. With tp=2 each rank keeps the copies of its
    half of the tokens (whole-expert width 64) but the router's softmax of all of them: 64 sent, 80 received rows."""
    per_token = expert_saved_bytes_per_token(hidden=H, expert_width=F, num_experts=E, experts_per_token=K,
                                             load_imbalance=1.25, tp=1, assumptions=A)
    assert per_token == 8 * 4 + 2 * 1.25 * (2 * 128 + 4 * 64) * 2
    assert expert_dispatch_buffer_bytes(64, H, K, 1.25, 2) == (128 + 160) * 128 * 2
    assert expert_terms(MOE_LAYER, shard(ep=4))[2:] == (64 * per_token, (128 + 160) * 128 * 2)
    assert expert_terms(MOE_LAYER, shard(ep=1))[3] == 0.0
    sliced = expert_saved_bytes_per_token(hidden=H, expert_width=F, num_experts=E, experts_per_token=K,
                                          load_imbalance=1.25, tp=2, assumptions=A)
    assert sliced == 8 * 4 + 2 * 1.25 / 2 * (2 * 128 + 4 * 64) * 2
    assert expert_terms(MOE_LAYER, shard(tp=2, ep=2))[2:] == (64 * sliced, (64 + 80) * 128 * 2)


def test_experts_params_split_over_ep_and_tp():
    """TP splits attention; the ep x tp ranks of an EP group hold 1 / (ep x tp) of the experts, whole; the router and
    norms count as split (memory.py's < 0.1% approximation)."""
    experts = MOE_LAYER.moe.expert_params
    rest = MOE_LAYER.params - experts
    assert layer_params_per_rank(MOE_LAYER, 1, 4) == rest + experts / 4
    assert layer_params_per_rank(MOE_LAYER, 2, 4) == rest / 2 + experts / 8
    assert layer_params_per_rank(MOE_LAYER, 2, 1) == MOE_LAYER.params / 2


CLUSTER = make_cluster("cpu", 4)
WORKLOAD = Workload(global_batch=4, text_tokens=64, image_sizes=((224, 224),))


def _llm_cost(**degrees):
    s = ModuleStrategy(micro_batch=1, **degrees)
    return module_cost(MODEL, "llm", CLUSTER, WORKLOAD, s, placement="colocated", precision="bf16_mixed",
                       first_rank=0, assumptions=A)


def test_expert_states_under_ep_and_zero_by_hand():
    """bf16 mixed (2 + 2 + 12 bytes): without ZeRO a rank holds its experts (1/ep of them) whole; under ZeRO-3 the
    experts are sharded over the dp / ep ranks holding the same experts, the rest over all dp ranks."""
    llm = MODEL.module("llm")
    experts = sum(layer.moe.expert_params * layer.count for layer in llm.layers if layer.moe is not None)
    rest = llm.num_params - experts
    plain = _llm_cost(dp=4, ep=4)
    assert (plain.weights_bytes, plain.optimizer_bytes) == (2 * (rest + experts / 4), 12 * (rest + experts / 4))
    sharded = _llm_cost(dp=4, ep=2, zero=3)
    assert sharded.weights_bytes == pytest.approx(2 * (rest / 4 + experts / 2 / 2), abs=1)
    assert sharded.optimizer_bytes == pytest.approx(12 * (rest / 4 + experts / 4), abs=1)


def test_a_cost_does_not_depend_on_what_was_costed_before():
    """The memoised layer sums are keyed by ep: ep=4 costed after ep=1 is ep=4 costed first."""
    _STATIC.clear()
    after = (_llm_cost(dp=4, ep=1), _llm_cost(dp=4, ep=4))[1]
    _STATIC.clear()
    assert _llm_cost(dp=4, ep=4) == after


def test_an_ep_group_is_ep_times_tp_consecutive_ranks():
    """Axes (TP, SP, CP, DP-reduce, EP, expert-reduce) on nodes of 8: ep=2 x tp=4 is ranks 0-7, one node; ep=4 x tp=4
    is ranks 0-15, two; ep=1 x tp=2 is the TP pair (here across nodes of 1). The experts' reduce group, ranks tp x ep
    apart, spans nodes whenever dp*sp / ep > 1 and tp x ep fills a node."""
    assert axes_within_node(ModuleStrategy(dp=4, tp=4, ep=2), 0, 8)[4:] == (True, False)
    assert axes_within_node(ModuleStrategy(dp=4, tp=4, ep=4), 0, 8)[4:] == (False, True)
    assert axes_within_node(ModuleStrategy(dp=2, tp=2), 0, 1)[4] is False


def test_tp_alone_prices_the_exchange_in_a_module():
    """ep=1 x tp=2 splits the tiny LLM's experts over the TP pair: the step pays all-to-alls and all-gathers."""
    assert _llm_cost(dp=2, tp=2).ep_comm_s > 0
    assert _llm_cost(dp=4).ep_comm_s == 0


def test_a_moe_layer_all_reduces_over_tp_around_attention_only():
    """tp=2: the attention output's all-reduce in forward and its input gradient's in backward, 64 x 128 x 2 bytes
    each (1/2 x 2 of it on the TP link plus 2 latencies); the router and the whole experts add none."""
    one = 2 * (1 / 2) * (64 * 128 * 2) / 4e11 + 2 * 2e-6
    assert all_reduce_time(64 * 128 * 2, 2, TP_LINK) == pytest.approx(one)
    terms = layer_terms(MOE_LAYER, shard(tp=2, tp_link=TP_LINK))
    assert terms.tp_comm_s == pytest.approx(2 * one * (1 - A.tp_comm_overlap))
