"""Mixture-of-experts terms against hand calculations: the token exchange, the grouped expert GEMMs, the router,
load imbalance and the memory of experts under expert parallelism (the tiny Qwen3-VL-MoE's decoder layer: hidden
128, 8 experts of width 64, top-2)."""

from dataclasses import replace

import pytest
from cost_toys import COMPUTE_ONLY, TOY_DEVICE

from planner.catalog import get_model
from planner.cost import module_cost
from planner.cost.comm import Link, all_to_all_time
from planner.cost.compute import gemm_time, grouped_gemm_efficiency, grouped_gemm_time, matmul_efficiency
from planner.cost.layers import Shard, expert_all_to_all_time, expert_terms, layer_terms
from planner.cost.rank_cost import _STATIC
from planner.cost.memory import expert_dispatch_buffer_bytes, expert_saved_bytes_per_token, layer_params_per_rank
from planner.hardware import make_cluster
from planner.strategy import ModuleStrategy
from planner.workload import Workload

A = COMPUTE_ONLY
LINK = Link(bandwidth=1.6e11, latency=1e-5)
MODEL = get_model("qwen3-vl-moe-tiny")
MOE_LAYER = MODEL.module("llm").layer("decoder_layer")
H, F, E, K = 128, 64, 8, 2


def shard(*, tp=1, ep=1, tokens=64, recompute="none", assumptions=A):
    return Shard(tp=tp, sp=1, cp=1, micro_batch=1, tokens=tokens, segment_tokens=tokens, segments=1,
                 window_tokens=0.0, windows=0, recompute=recompute, backward="full", tp_link=LINK, sp_link=LINK,
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
    """Router 2 t h E, experts 6 t k h f (their mean, whatever the imbalance); TP splits the experts' width."""
    for tp, ep in ((1, 1), (1, 4), (2, 2)):
        _, flops, _, _ = expert_terms(MOE_LAYER, shard(tp=tp, ep=ep))
        assert flops == 2 * 64 * H * E + 6 * 64 * K * H * F / tp


def test_load_imbalance_multiplies_the_busiest_ranks_expert_time():
    """With ep > 1 the busiest rank's grouped GEMMs take imbalance x the mean tokens; one rank holding every expert
    receives exactly its own."""
    router = gemm_time(64, E, H, TOY_DEVICE, A)
    per_expert = 64 * K * 1.25 / (E / 4)
    expected = router + sum(grouped_gemm_time(per_expert, E / 4, n, k, TOY_DEVICE, A) for n, k in ((F, H), (F, H), (H, F)))
    assert expert_terms(MOE_LAYER, shard(ep=4))[0] == pytest.approx(expected)
    balanced = replace(A, moe_load_imbalance=1.0)
    assert expert_terms(MOE_LAYER, shard(ep=4, assumptions=balanced))[0] < expected
    assert expert_terms(MOE_LAYER, shard(ep=1))[0] == expert_terms(MOE_LAYER, shard(ep=1, assumptions=balanced))[0]


def test_expert_activation_and_buffer_bytes_by_hand():
    """Per token: fp32 router softmax (8 x 4) + 2 x 1.25 copies x (2 x 128 rows + 4 x 64 SwiGLU) x 2 bytes; the
    exchange holds the 128 sent and 160 received rows of 128 x 2 bytes."""
    per_token = expert_saved_bytes_per_token(hidden=H, expert_width=F, num_experts=E, experts_per_token=K,
                                             load_imbalance=1.25, assumptions=A)
    assert per_token == 8 * 4 + 2 * 1.25 * (2 * 128 + 4 * 64) * 2
    assert expert_dispatch_buffer_bytes(64, H, K, 1.25, 2) == (128 + 160) * 128 * 2
    assert expert_terms(MOE_LAYER, shard(ep=4))[2:] == (64 * per_token, (128 + 160) * 128 * 2)
    assert expert_terms(MOE_LAYER, shard(ep=1))[3] == 0.0


def test_experts_params_split_over_ep_and_tp():
    """TP splits attention and experts, EP the experts once more; the router and norms count as split (memory.py's
    < 0.1% approximation)."""
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
