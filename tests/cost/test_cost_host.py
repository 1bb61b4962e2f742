"""Host dispatch vs device work per pass (planner/cost/host.py), and the operator calls a layer pays
(planner/cost/op_counts.py), by hand."""

from dataclasses import replace

import pytest
from cost_toys import COMPUTE_ONLY, TOY_DEVICE, toy_model

from planner.catalog import get_model
from planner.cost.comm import Link
from planner.cost.host import device_pass_time, host_dispatch_time, pass_time
from planner.cost.layers import Shard, layer_terms
from planner.cost.linear_attention import linear_kernel_calls, linear_kernel_chunks
from planner.cost.op_counts import (
    CONTEXT_PARALLEL_OPS,
    LAYER_OPS,
    NO_OPS,
    PassOps,
    context_parallel_ops,
    layer_pass_ops,
    linear_attention_pass_ops,
    ops_row,
)

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


HYBRID = get_model("qwen3.6-27b").module("llm")
LINEAR = HYBRID.layer("linear_decoder_layer")
CPU = replace(GPU, kernel_launch_latency=0.0, host_overlap=0.0)


def test_qwen3_5_decoder_layers_take_their_own_rows():
    assert ops_row(LINEAR) == "linear_decoder_layer"
    assert ops_row(HYBRID.layer("decoder_layer")) == "gated_decoder_layer"
    assert ops_row(toy_model().module("llm").layer("decoder_layer")) == "decoder_layer"


def test_linear_kernel_calls_per_packed_sample_else_one_over_the_rows():
    """8 rows of one 2,276-token sequence: one batched call looping over ceil(2276 / 64) = 36 chunks; 2 packs of 3
    samples of (token-weighted) 1,000 tokens in one row: 6 calls of ceil(1000 / 64) = 16 chunks."""
    assert linear_kernel_calls(1.0, 8) == 1
    assert linear_kernel_chunks(1, 2276, 64) == 36
    assert linear_kernel_calls(3.0, 2) == 6
    assert linear_kernel_chunks(6, 1000, 64) == 96


def test_torch_kernel_calls_grow_with_segments_and_chunks_fla_does_not():
    """TP2 under Ulysses, 6 calls over 96 chunks. torch: fixed 111 (32 DTensor, 57 kernels) + Ulysses 80 (28) + 6 x
    103 (54) + 96 x 37 (13) forward, 200 + 80 + 6 x 126 + 96 x 54 backward. fla: the fixed and Ulysses calls plus
    its conv (3 forward, 9 backward) and rule (27, 42), whatever the segments and chunks."""
    forward, backward = linear_attention_pass_ops("torch", tp=2, calls=6, chunks=96, ulysses=True)
    assert (forward.ops, forward.dtensor_ops, forward.kernels) == (
        111 + 80 + 6 * 103 + 96 * 37, 32, 57 + 28 + 6 * 54 + 96 * 13)
    assert backward.ops == 200 + 80 + 6 * 126 + 96 * 54
    fla = linear_attention_pass_ops("fla", tp=2, calls=6, chunks=96, ulysses=True)
    assert (fla[0].ops, fla[1].ops) == (111 + 80 + 3 + 27, 200 + 80 + 9 + 42)
    assert linear_attention_pass_ops("fla", tp=2, calls=1, chunks=1, ulysses=True) == fla


def _linear_host_s(kernel: str, *, samples: int, sample_tokens: int, recompute: str = "none") -> tuple[float, float]:
    """(forward, recompute) seconds Qwen3.6-27B's linear layer pays for dispatch at tp 1 on a CPU (nothing hides):
    the same terms with and without 5 us a call; ``samples`` > 1 are one packed row of that many."""
    link = Link(bandwidth=GPU.intra_node_bandwidth, latency=GPU.intra_node_latency)

    def terms(assumptions):
        shard = Shard(tp=1, sp=1, cp=1, micro_batch=1, tokens=samples * sample_tokens, segment_tokens=sample_tokens,
                      segments=samples, window_tokens=0, windows=0, recompute=recompute, backward="full",
                      tp_link=link, sp_link=link, cp_link=link, device=CPU,
                      assumptions=replace(assumptions, linear_attention_kernel=kernel))
        return layer_terms(LINEAR, shard)

    with_host, without = terms(HOST), terms(COMPUTE_ONLY)
    return with_host.forward_s - without.forward_s, with_host.recompute_s - without.recompute_s


def test_a_torch_kernel_layer_dispatches_every_chunk_of_every_sample():
    """One row of 4,096 tokens: 87 + 103 + 64 x 37 calls; a row packing 4 samples of 1,000 tokens: 87 + 4 x 103 +
    4 x 16 x 37; on fla 87 + 3 + 27 either way. Selective recomputation re-dispatches the kernel's forward calls
    (103 + 64 x 37; fla's 30)."""
    per_op = HOST.host_seconds_per_op
    assert _linear_host_s("torch", samples=1, sample_tokens=4096)[0] == pytest.approx((87 + 103 + 64 * 37) * per_op)
    assert _linear_host_s("torch", samples=4, sample_tokens=1000)[0] == pytest.approx(
        (87 + 4 * 103 + 4 * 16 * 37) * per_op)
    for samples, tokens in ((1, 4096), (4, 1000)):
        assert _linear_host_s("fla", samples=samples, sample_tokens=tokens)[0] == pytest.approx((87 + 30) * per_op)
    assert _linear_host_s("torch", samples=1, sample_tokens=4096, recompute="selective")[1] == pytest.approx(
        (103 + 64 * 37) * per_op)
    assert _linear_host_s("fla", samples=1, sample_tokens=4096, recompute="selective")[1] == pytest.approx(
        30 * per_op)


def test_ring_cp_adds_a_fixed_part_and_one_per_ring_step():
    """cp = 4: the fixed calls plus 3 steps' (ring: 25 + 3 x 25 forward, 32 + 3 x 29 backward); none at cp = 1."""
    forward, backward = context_parallel_ops("ring", 4)
    assert (forward.ops, forward.kernels, backward.ops, backward.kernels) == (100, 46, 119, 54)
    gathered, _ = context_parallel_ops("gathered", 2)
    assert (gathered.ops, gathered.kernels) == (26 + 4, 13 + 2)
    assert context_parallel_ops("ring", 1) == (NO_OPS, NO_OPS)


CPU = replace(TOY_DEVICE, kernel_launch_latency=0.0, host_overlap=0.0)


@pytest.mark.parametrize("module, segments, form", [(1, 1, "ring"), (1, 3, "gathered_masked"), (0, 1, "gathered")])
def test_a_cp_block_pays_its_context_parallel_calls(module, segments, form):
    """On a CPU (nothing hides the host) a full-attention block at cp = 2 pays, beyond its device work, the host time
    of its row's calls plus the CP form's fixed calls and one step's: (row + fixed + step) x 5 us, forward and
    backward."""
    block = next(layer for layer in toy_model().modules[module].layers
                 if layer.attention is not None and not layer.attention.window_patches)
    link = Link(bandwidth=CPU.intra_node_bandwidth, latency=CPU.intra_node_latency)

    def terms(assumptions):
        shard = Shard(tp=1, sp=1, cp=2, micro_batch=1, tokens=512, segment_tokens=1024 / segments,
                      segments=segments, window_tokens=0, windows=0, recompute="none", backward="full",
                      tp_link=link, sp_link=link, cp_link=link, device=CPU, assumptions=assumptions)
        return layer_terms(block, shard)

    row = LAYER_OPS[ops_row(block)]
    cp = CONTEXT_PARALLEL_OPS[form]
    loop = segments if not block.attention.causal else 0  # a vision block's per-segment calls
    host, device = terms(HOST), terms(COMPUTE_ONLY)
    forward_calls = row.forward.ops + loop * row.per_segment_forward.ops + cp.fixed_forward.ops + cp.step_forward.ops
    backward_calls = (row.backward.ops + loop * row.per_segment_backward.ops + cp.fixed_backward.ops
                      + cp.step_backward.ops)
    assert host.forward_s - device.forward_s == pytest.approx(forward_calls * 5e-6)
    assert host.backward_s - device.backward_s == pytest.approx(backward_calls * 5e-6)
