"""Host dispatch vs device work per pass (planner/cost/host.py), by hand."""

from dataclasses import replace

import pytest
from cost_toys import COMPUTE_ONLY, TOY_DEVICE, toy_model

from planner.cost.comm import Link
from planner.cost.host import device_pass_time, host_dispatch_time, pass_time
from planner.cost.layers import Shard, layer_terms
from planner.cost.op_counts import LAYER_OPS, PassOps, layer_pass_ops

OPS = PassOps(ops=100, dtensor_ops=20, kernels=50)
HOST = replace(COMPUTE_ONLY, host_seconds_per_op=5e-6, dtensor_seconds_per_op=10e-6)
GPU = replace(TOY_DEVICE, kernel_launch_latency=2e-6, host_overlap=0.9)


def test_host_dispatch_counts_every_call_and_dtensor_extra():
    assert host_dispatch_time(OPS, HOST) == pytest.approx(100 * 5e-6 + 20 * 10e-6)  # 0.7 ms


def test_device_pays_a_launch_per_kernel():
    assert device_pass_time(1e-3, OPS, GPU) == pytest.approx(1e-3 + 50 * 2e-6)


def test_pass_is_the_longer_side_plus_the_unhidden_part_of_the_shorter():
    # device 1.1 ms vs host 0.7 ms: 1.1 + 0.1 * 0.7
    assert pass_time(1e-3, OPS, GPU, HOST) == pytest.approx(1.1e-3 + 0.1 * 0.7e-3)
    # tiny kernels: the host binds (0.7 ms vs 0.1 + 0.1 ms device)
    assert pass_time(1e-4, OPS, GPU, HOST) == pytest.approx(0.7e-3 + 0.1 * 0.2e-3)
    # a CPU computes on the host: nothing hides
    cpu = replace(GPU, kernel_launch_latency=0.0, host_overlap=0.0)
    assert pass_time(1e-3, OPS, cpu, HOST) == pytest.approx(1e-3 + 0.7e-3)


def test_attention_loop_and_ulysses_add_calls():
    table = LAYER_OPS["vision_block"]
    forward, backward = layer_pass_ops("vision_block", tp=1, segments=16, ulysses=False)
    assert forward.ops == table.forward.ops + 16 * table.per_segment_forward.ops
    assert backward.ops == table.backward.ops + 16 * table.per_segment_backward.ops
    tp_forward, _ = layer_pass_ops("vision_block", tp=8, segments=0, ulysses=True)
    assert tp_forward.ops == table.tp_forward.ops + table.ulysses_forward.ops
    assert tp_forward.dtensor_ops == table.tp_forward.dtensor_ops > 0


def _block_shard(tp: int, tokens: float, assumptions, device=GPU) -> Shard:
    link = Link(bandwidth=GPU.intra_node_bandwidth, latency=GPU.intra_node_latency)
    return Shard(tp=tp, sp=1, cp=1, micro_batch=1, tokens=tokens, segment_tokens=tokens, segments=1,
                 window_tokens=0, windows=0, recompute="none", backward="full", tp_link=link, sp_link=link,
                 cp_link=link, device=device, assumptions=assumptions)


def test_a_narrow_block_under_tp_is_host_bound():
    """The toy vision block at 64 tokens: its GEMMs take microseconds, so TP4 cannot speed it up, while the host
    pays DTensor dispatch: the forward is slower at TP4 than at TP1 once host costs count, faster without them."""
    block = next(layer for layer in toy_model().modules[0].layers if layer.kind == "vision_block")
    with_host = [layer_terms(block, _block_shard(tp, 64, HOST)).forward_s for tp in (1, 4)]
    compute_only = [layer_terms(block, _block_shard(tp, 64, COMPUTE_ONLY, TOY_DEVICE)).forward_s for tp in (1, 4)]
    assert with_host[1] > with_host[0]
    assert compute_only[1] < compute_only[0]


@pytest.mark.parametrize("calls, dispatched", [("sdpa", 16), ("varlen", 1)])
def test_selective_recompute_redispatches_the_attention_loop(calls, dispatched):
    """A window block's selective recompute re-runs its attention calls: one SDPA per window (16 windows) or one
    variable-length call for them all, 4 operator calls each at 5 us, against the attention core's device time
    (overlap 0.9)."""
    block = next(layer for layer in toy_model().modules[0].layers if layer.attention and layer.attention.window_patches)
    link = Link(bandwidth=GPU.intra_node_bandwidth, latency=GPU.intra_node_latency)

    def terms(assumptions):
        shard = Shard(tp=1, sp=1, cp=1, micro_batch=1, tokens=1024, segment_tokens=1024, segments=1,
                      window_tokens=64, windows=16, recompute="selective", backward="full", tp_link=link,
                      sp_link=link, cp_link=link, device=GPU, assumptions=replace(assumptions, attention_calls=calls))
        return layer_terms(block, shard)

    device_s = terms(COMPUTE_ONLY).recompute_s  # no host cost: the core's work and its kernels' launches
    host_s = dispatched * LAYER_OPS["vision_block"].per_segment_forward.ops * HOST.host_seconds_per_op
    assert terms(HOST).recompute_s == pytest.approx(max(device_s, host_s) + 0.1 * min(device_s, host_s))
