"""module_cost / combine / estimate: the linear combination rules, memory accounting and the profile seam."""

from dataclasses import replace

import pytest
from cost_toys import COMPUTE_ONLY, TOY_DEVICE, colocated, toy_cluster, toy_model, toy_workload

from planner.cost import LayerMeasurement, ModuleCost, combine, estimate, module_cost
from planner.contract.strategy import ModuleStrategy, Strategy
from planner.contract.units import GIB

A = COMPUTE_ONLY
MODEL = toy_model()
CLUSTER = toy_cluster(8)
WORKLOAD = toy_workload(global_batch=8)


def fake_cost(module, *, per_mb, dp_comm, states, act, buffers, in_flight=1, gpus=4, ga=2, flops=1e12, optimizer=0.0,
              forward=None, backward_buffers=None):
    strategy = ModuleStrategy(dp=gpus, micro_batch=8 // (gpus * ga), grad_accum=ga)
    return ModuleCost(
        module=module,
        strategy=strategy,
        forward_s=0,
        backward_s=0,
        recompute_s=0,
        tp_comm_s=0,
        sp_comm_s=0,
        cp_comm_s=0,
        dp_comm_s=dp_comm,
        optimizer_s=optimizer,
        handoff_s=0,
        per_micro_batch_s=per_mb,
        forward_per_micro_batch_s=per_mb / 3 if forward is None else forward,
        weights_bytes=states,
        gradients_bytes=states,
        optimizer_bytes=2 * states,
        forward_buffers_bytes=buffers,
        backward_buffers_bytes=buffers if backward_buffers is None else backward_buffers,
        activations_per_micro_batch_bytes=act,
        in_flight_micro_batches=in_flight,
        flops_per_step=flops,
        sources={},
    )


def test_combine_colocated_is_a_sum():
    costs = {
        "vision": fake_cost("vision", per_mb=1.0, dp_comm=0.5, states=1 * GIB, act=2 * GIB, buffers=GIB),
        "llm": fake_cost("llm", per_mb=3.0, dp_comm=0.25, states=2 * GIB, act=5 * GIB, buffers=GIB,
                         backward_buffers=3 * GIB),
    }
    e = combine(MODEL, CLUSTER, WORKLOAD, "colocated", costs, A)
    # step = sum (ga * per_mb + dp) = 2*1 + 0.5 + 2*3 + 0.25
    assert e.step_time_s == pytest.approx(8.75)
    # grad_accum 2: every state always (4 + 8); the heaviest moment is the LLM's backward start: both modules'
    # activations (2 + 5) and the LLM's backward buffers (3), + 3 GiB overhead; its forward has 1 GiB of buffers
    assert e.peak_memory_bytes == 25 * GIB
    assert e.peak_phase == "llm backward start"
    assert e.peak_breakdown.activations == 7 * GIB
    assert e.peak_breakdown.buffers == 3 * GIB
    assert e.peak_breakdown.overhead == A.framework_overhead_bytes
    assert e.peak_group == "all"
    # 8 samples x 64 LLM tokens / 8.75 s; MFU = 2e12 / (8.75 * 4 GPUs * 1e15)
    assert e.tokens_per_s == pytest.approx(8 * 64 / 8.75)
    assert e.samples_per_s == pytest.approx(8 / 8.75)
    assert e.mfu == pytest.approx(2e12 / (8.75 * 4 * 1e15))
    assert e.fits
    assert e.binding_constraint.startswith("time: llm")


def test_colocated_peak_is_the_heaviest_moment_not_the_sum_of_every_part():
    # one micro-batch per step: no gradients until a module's backward has run, buffers only while it runs
    costs = {
        "vision": fake_cost("vision", per_mb=1.0, dp_comm=0, states=GIB, act=2 * GIB, buffers=GIB, gpus=8, ga=1),
        "llm": fake_cost("llm", per_mb=1.0, dp_comm=0, states=2 * GIB, act=5 * GIB, buffers=4 * GIB,
                         backward_buffers=GIB, gpus=8, ga=1),
    }
    e = combine(MODEL, CLUSTER, WORKLOAD, "colocated", costs, A)
    # LLM forward: weights 1 + 2, optimizer 2 + 4, activations 2 + 5, LLM forward buffers 4, no gradients; + 3
    # (the LLM's backward start has 1 GiB of buffers: 17 + 3; its end 2 GiB of gradients and no LLM activations)
    assert e.peak_phase == "llm forward"
    assert e.peak_memory_bytes == 23 * GIB
    assert (e.peak_breakdown.gradients, e.peak_breakdown.buffers) == (0, 4 * GIB)
    # summing every part as if alive at once would say 1+1+2 + 2+2+4 + 2+5 + 1+4 + 3 = 27 GiB
    costs["llm"] = fake_cost("llm", per_mb=1.0, dp_comm=0, states=2 * GIB, act=GIB, buffers=GIB,
                             backward_buffers=6 * GIB, gpus=8, ga=1)
    e = combine(MODEL, CLUSTER, WORKLOAD, "colocated", costs, A)
    # LLM backward end: 9 + LLM gradients 2 + vision activations 2 + 6 > its backward start 9 + 2 + 1 + 6
    assert (e.peak_phase, e.peak_memory_bytes) == ("llm backward end", 22 * GIB)


def test_backward_start_is_the_loss_backward_or_the_last_block_after_it():
    vision = fake_cost("vision", per_mb=1.0, dp_comm=0, states=GIB, act=2 * GIB, buffers=0, gpus=8, ga=1)
    llm = fake_cost("llm", per_mb=1.0, dp_comm=0, states=2 * GIB, act=5 * GIB, buffers=0, backward_buffers=3 * GIB,
                    gpus=8, ga=1)
    # the loss's backward: all 2 + 5 GiB of activations + 2.5 GiB of its gradients; the last block's backward after
    # it: the 2 GiB log-softmax freed, the blocks' 3 GiB of backward buffers (9 GiB of states in both)
    at_loss = replace(llm, loss_backward_buffers_bytes=5 * GIB // 2, loss_saved_bytes=2 * GIB)
    e = combine(MODEL, CLUSTER, WORKLOAD, "colocated", {"vision": vision, "llm": at_loss}, A)
    assert (e.peak_phase, e.peak_memory_bytes) == ("llm backward start", 9 * GIB + 7 * GIB + 5 * GIB // 2 + 3 * GIB)
    assert (e.peak_breakdown.activations, e.peak_breakdown.buffers) == (7 * GIB, 5 * GIB // 2)
    at_block = replace(llm, loss_backward_buffers_bytes=GIB, loss_saved_bytes=GIB)
    e = combine(MODEL, CLUSTER, WORKLOAD, "colocated", {"vision": vision, "llm": at_block}, A)
    assert (e.peak_breakdown.activations, e.peak_breakdown.buffers) == (6 * GIB, 3 * GIB)


def test_combine_disjoint_is_a_pipeline():
    costs = {
        "vision": fake_cost("vision", per_mb=1.0, dp_comm=0.5, states=GIB, act=2 * GIB, buffers=0, in_flight=2),
        "llm": fake_cost("llm", per_mb=3.0, dp_comm=0.25, states=2 * GIB, act=5 * GIB, buffers=0),
    }
    e = combine(MODEL, CLUSTER, WORKLOAD, "disjoint", costs, A)
    # LLM-bound, 2 micro-batches: vision P + 2 T + max tail = 1 + 2 * 3 + 0.5
    assert e.step_time_s == pytest.approx(7.5)
    # vision-bound: P = 3 (F = 1, B = 2), T = 1.5: m P + T - min(F, B) = 6.5 beats P + m T = 6; + tail 0.5
    costs["vision"] = fake_cost("vision", per_mb=3.0, forward=1.0, dp_comm=0.5, states=GIB, act=0, buffers=0)
    costs["llm"] = fake_cost("llm", per_mb=1.5, dp_comm=0.25, states=GIB, act=0, buffers=0)
    assert combine(MODEL, CLUSTER, WORKLOAD, "disjoint", costs, A).step_time_s == pytest.approx(7.0)
    # vision group: 4 + 2*2 + 3 = 11 GiB; llm group: 8 + 5 + 3 = 16 GiB
    assert e.memory_per_group["vision"].total == 11 * GIB
    assert e.memory_per_group["llm"].total == 16 * GIB
    assert e.peak_group == "llm"
    assert e.num_gpus == 8
    assert e.binding_constraint.startswith("pipeline: llm stage is the slowest")


def test_optimizer_step_joins_the_tail_of_either_placement():
    vision = fake_cost("vision", per_mb=1.0, dp_comm=0.5, states=GIB, act=GIB, buffers=0, optimizer=0.1)
    llm = fake_cost("llm", per_mb=3.0, dp_comm=0.25, states=GIB, act=GIB, buffers=0, optimizer=0.5)
    costs = {"vision": vision, "llm": llm}
    # colocated: 2*1 + (0.5 + 0.1) + 2*3 + (0.25 + 0.5)
    assert combine(MODEL, CLUSTER, WORKLOAD, "colocated", costs, A).step_time_s == pytest.approx(9.35)
    # disjoint (LLM-bound): 1 + 2 * 3 + max(0.6, 0.75)
    assert combine(MODEL, CLUSTER, WORKLOAD, "disjoint", costs, A).step_time_s == pytest.approx(7.75)


def test_combine_reports_memory_binding():
    costs = {"llm": fake_cost("llm", per_mb=1.0, dp_comm=0, states=20 * GIB, act=5 * GIB, buffers=0)}
    e = combine(MODEL, CLUSTER, WORKLOAD, "colocated", costs, A)
    assert not e.fits
    assert e.binding_constraint.startswith("memory: all GPUs need 88.0 GiB")


def _estimate(vision, llm, **kw):
    return estimate(MODEL, CLUSTER, WORKLOAD, colocated(vision, llm, **kw), A)


def test_estimate_breakdown_sums_and_reproduces_combine():
    e = _estimate(ModuleStrategy(dp=8), ModuleStrategy(dp=8))
    b = e.peak_breakdown
    assert b.total == b.weights + b.gradients + b.optimizer + b.activations + b.buffers + b.overhead
    assert e.peak_memory_bytes == b.total
    assert sum(c.weights_bytes for c in e.modules.values()) == b.weights
    assert e.step_time_s == pytest.approx(sum(c.per_micro_batch_s + c.step_tail_s for c in e.modules.values()))


def test_states_by_precision_and_zero():
    vision_params = MODEL.module("vision").num_params
    e = _estimate(ModuleStrategy(dp=8), ModuleStrategy(dp=8))
    v = e.modules["vision"]
    assert (v.weights_bytes, v.gradients_bytes, v.optimizer_bytes) == (
        2 * vision_params,
        2 * vision_params,
        12 * vision_params,
    )
    pure = _estimate(ModuleStrategy(dp=8), ModuleStrategy(dp=8), precision="bf16_pure").modules["vision"]
    assert pure.optimizer_bytes == 4 * vision_params
    # the optimizer step touches 30 B per local parameter (ZeRO-0: all of them) at 0.8 x HBM bandwidth
    assert e.modules["vision"].optimizer_s == pytest.approx(
        30 * vision_params / (CLUSTER.device.memory_bandwidth * 0.8))
    z1 = _estimate(ModuleStrategy(dp=8, zero=1), ModuleStrategy(dp=8)).modules["vision"]
    assert z1.optimizer_s == pytest.approx(e.modules["vision"].optimizer_s / 8)
    z3 = _estimate(ModuleStrategy(dp=8, zero=3), ModuleStrategy(dp=8)).modules["vision"]
    assert z3.weights_bytes == pytest.approx(2 * vision_params / 8, abs=1)
    assert z3.optimizer_bytes == pytest.approx(12 * vision_params / 8, abs=1)


def test_tp_halves_llm_weights():
    one = _estimate(ModuleStrategy(dp=8), ModuleStrategy(dp=4, tp=2, micro_batch=2))
    llm_params = MODEL.module("llm").num_params
    # decoder KV heads (2) split 2 ways, embedding / lm_head vocab-parallel; final norm replicated
    norm = MODEL.module("llm").layer("final_norm").params
    assert one.modules["llm"].weights_bytes == pytest.approx(2 * ((llm_params - norm) / 2 + norm), abs=2)


def test_frozen_vision_keeps_weights_only_and_runs_no_backward():
    model = toy_model(frozen=("vision",))
    e = estimate(model, CLUSTER, WORKLOAD, colocated(ModuleStrategy(dp=8), ModuleStrategy(dp=8)))
    v = e.modules["vision"]
    assert v.gradients_bytes == 0 and v.optimizer_bytes == 0
    assert v.backward_s == 0 and v.activations_per_micro_batch_bytes == 0 and v.dp_comm_s == 0
    # model FLOPs: forward only; trainable = 3x forward, except the patchifier's input gradient
    # (8 samples x 2 x 64 patches x 64 x 1176)
    trainable = estimate(MODEL, CLUSTER, WORKLOAD, colocated(ModuleStrategy(dp=8), ModuleStrategy(dp=8)))
    patch_embed = 8 * 2 * 64 * 64 * 1176
    assert trainable.modules["vision"].flops_per_step == pytest.approx(3 * v.flops_per_step - patch_embed)


def test_frozen_llm_still_passes_input_gradients():
    model = toy_model(frozen=("llm",))
    e = estimate(model, CLUSTER, WORKLOAD, colocated(ModuleStrategy(dp=8), ModuleStrategy(dp=8)))
    llm = e.modules["llm"]
    assert llm.optimizer_bytes == 0 and llm.backward_s > 0
    assert (
        llm.backward_s
        < estimate(MODEL, CLUSTER, WORKLOAD, colocated(ModuleStrategy(dp=8), ModuleStrategy(dp=8)))
        .modules["llm"]
        .backward_s
    )


def test_recompute_trades_memory_for_time():
    none = _estimate(ModuleStrategy(dp=8), ModuleStrategy(dp=8)).modules["llm"]
    full = _estimate(ModuleStrategy(dp=8), ModuleStrategy(dp=8, recompute="full")).modules["llm"]
    assert full.activations_per_micro_batch_bytes < none.activations_per_micro_batch_bytes
    assert full.recompute_s > none.recompute_s > 0  # without recomputation: the chunked loss's lm_head alone
    whole_loss = colocated(ModuleStrategy(dp=8), ModuleStrategy(dp=8))
    unchunked = estimate(MODEL, CLUSTER, WORKLOAD, whole_loss, replace(A, loss_chunk_tokens=0))
    assert unchunked.modules["llm"].recompute_s == 0


def test_grad_accum_scales_per_step_times():
    one = _estimate(ModuleStrategy(dp=8), ModuleStrategy(dp=8)).modules["llm"]
    two = estimate(
        MODEL,
        CLUSTER,
        toy_workload(16),
        colocated(ModuleStrategy(dp=8, grad_accum=2), ModuleStrategy(dp=8, grad_accum=2)),
        A,
    ).modules["llm"]
    assert two.forward_s == pytest.approx(2 * one.forward_s)
    assert two.per_micro_batch_s == pytest.approx(one.per_micro_batch_s)


def test_colocated_handoff_gathers_within_sp_group():
    sp1 = _estimate(ModuleStrategy(dp=8), ModuleStrategy(dp=8)).modules["vision"]
    sp2 = _estimate(ModuleStrategy(dp=4, sp=2, micro_batch=2), ModuleStrategy(dp=4, tp=2, micro_batch=2))
    sp2 = sp2.modules["vision"]
    assert sp1.handoff_s == 0
    # 2 samples x 16 tokens x 128 x 2 B all-gathered over 2 ranks on NVLink, and reduce-scattered back
    link_bw = TOY_DEVICE.intra_node_bandwidth * A.intra_node_bus_efficiency
    one_way = 0.5 * 2 * 16 * 128 * 2 / link_bw + TOY_DEVICE.intra_node_latency
    assert sp2.handoff_s == pytest.approx(2 * one_way)


def test_disjoint_in_flight_and_p2p_handoff():
    strategy = Strategy(
        placement="disjoint",
        modules={
            "vision": ModuleStrategy(dp=2, grad_accum=4),
            "llm": ModuleStrategy(dp=2, tp=2, micro_batch=1, grad_accum=4),
        },
    )
    e = estimate(MODEL, CLUSTER, WORKLOAD, strategy)
    assert e.modules["vision"].in_flight_micro_batches == 2  # stage 0 of 2
    assert e.modules["llm"].in_flight_micro_batches == 1
    # LLM on ranks 0-3, vision on 4-5: different nodes -> NIC; per micro-batch 16 x 128 x 2 B each way
    nic = TOY_DEVICE.inter_node_bandwidth * A.inter_node_bus_efficiency
    per_mb = 2 * (16 * 128 * 2 / nic + TOY_DEVICE.inter_node_latency)
    assert e.modules["vision"].handoff_s == pytest.approx(4 * per_mb)
    assert e.modules["llm"].handoff_s == 0


def test_invalid_strategy_raises_one_line():
    with pytest.raises(ValueError, match="llm: dp\\*micro_batch\\*grad_accum = 4\\*1\\*1 = 4"):
        _estimate(ModuleStrategy(dp=4), ModuleStrategy(dp=4))


def test_strategy_must_cover_the_model():
    with pytest.raises(ValueError, match="strategy covers modules"):
        estimate(MODEL, CLUSTER, WORKLOAD, Strategy(placement="colocated", modules={"llm": ModuleStrategy(dp=8)}))


class FixedSource:
    """A fake profile: measures only the decoder layer, with a given forward time and activation size."""

    def __init__(self, forward_s, activation_bytes):
        self.forward_s, self.activation_bytes = forward_s, activation_bytes
        self.calls = []

    def layer_cost(self, *, module, layer, tp, sp, cp, seq_len, tokens_per_rank, micro_batch, recompute):
        self.calls.append((module, layer.name, tp, sp, cp, seq_len, tokens_per_rank, micro_batch, recompute))
        if layer.name != "decoder_layer":
            return None
        return LayerMeasurement(
            forward_s=self.forward_s, backward_s=0.2, recompute_s=0.0, activation_bytes=self.activation_bytes
        )


def _llm_cost(source):
    return module_cost(
        MODEL,
        "llm",
        CLUSTER,
        WORKLOAD,
        ModuleStrategy(dp=4, tp=2, micro_batch=2),
        placement="colocated",
        precision="bf16_mixed",
        first_rank=0,
        layer_costs=source,
    )


def test_layer_cost_source_overrides_and_records_sources():
    fast, slow = FixedSource(0.1, 1000), FixedSource(0.4, 1500)
    a, b, analytical = _llm_cost(fast), _llm_cost(slow), _llm_cost(None)
    # 64 tokens per sample, 2 samples per micro-batch, no SP/CP split -> 128 tokens per rank
    assert ("llm", "decoder_layer", 2, 1, 1, 64, 128, 2, "none") in fast.calls
    assert a.sources["decoder_layer.time"] == "measured"
    assert a.sources["decoder_layer.activations"] == "measured"
    assert a.sources["lm_head.time"] == "analytical"
    assert analytical.sources["decoder_layer.time"] == "analytical"
    # 2 decoder layers x 1 micro-batch: forward differs by 2 x 0.3 s, activations by 2 x 500 B
    assert b.forward_s - a.forward_s == pytest.approx(0.6)
    assert b.backward_s == pytest.approx(a.backward_s)
    assert b.activations_per_micro_batch_bytes - a.activations_per_micro_batch_bytes == 1000
    assert a.tp_comm_s == pytest.approx(analytical.tp_comm_s)  # collectives stay analytical


def test_assumption_overrides_change_results():
    base = _estimate(ModuleStrategy(dp=8), ModuleStrategy(dp=8))
    slow = estimate(
        MODEL,
        CLUSTER,
        WORKLOAD,
        colocated(ModuleStrategy(dp=8), ModuleStrategy(dp=8)),
        assumptions=replace(A, memory_bandwidth_efficiency=0.4),
    )
    assert slow.step_time_s > base.step_time_s


def test_tp_group_crossing_a_node_uses_the_nic():
    strategy = ModuleStrategy(dp=1, tp=4, micro_batch=8)
    args = dict(placement="disjoint", precision="bf16_mixed")
    aligned = module_cost(MODEL, "llm", CLUSTER, WORKLOAD, strategy, first_rank=0, **args)
    straddling = module_cost(MODEL, "llm", CLUSTER, WORKLOAD, strategy, first_rank=2, **args)
    assert straddling.tp_comm_s > aligned.tp_comm_s
    assert straddling.forward_s == pytest.approx(aligned.forward_s)


def test_buffers_by_pass_the_loss_alone_and_zero3_root_unit_in_both_passes():
    llm = MODEL.module("llm")
    params = llm.num_params
    root = sum(l.params * l.count for l in llm.layers if l.kind != "decoder_layer")
    block = max(l.params for l in llm.layers if l.kind == "decoder_layer")
    loss_forward, loss_backward = 64 * 1000 * 6, 64 * 1000 * 8  # 64 tokens x 1000 vocab x 6 B / x 8 B
    whole = replace(A, loss_chunk_tokens=0,  # the whole logits at once (a pipelined LLM's loss)
                    mlp_backward_transient_tensors=0)  # the blocks' backward transients: their own test
    embedding = sum(l.params * l.count for l in llm.layers if l.kind == "embedding")

    def _estimate(vision, llm, workload=WORKLOAD):
        return estimate(MODEL, CLUSTER, workload, colocated(vision, llm), whole)
    z0 = _estimate(ModuleStrategy(dp=8), ModuleStrategy(dp=8)).modules["llm"]
    # forward: the loss's transient logits; the loss's backward: its gradients, and it frees the fp32 log-softmax
    # (64 x 1000 x 4 B); the blocks' backward: the gradient bucket (all of the toy's bf16 gradients, under the
    # 2 x 25 MiB cap; decoder layers have no transient without SP)
    assert z0.forward_buffers_bytes == loss_forward
    assert (z0.loss_backward_buffers_bytes, z0.loss_saved_bytes) == (loss_backward, 64 * 1000 * 4)
    assert z0.backward_buffers_bytes == pytest.approx(2 * params, abs=1)
    z3 = _estimate(ModuleStrategy(dp=8), ModuleStrategy(dp=8, zero=3)).modules["llm"]
    # ZeRO-3: the root unit (embedding, norm, lm_head) and two blocks gathered in bf16 in both passes; the backward
    # adds one block's and the root unit's unsharded bf16 gradients, the embedding's only after the blocks'. The
    # loss runs outside the module's forward and backward, with none of them gathered.
    unsharded = max(root, root - embedding + block)
    assert unsharded == root - embedding + block  # the toy's block outweighs its embedding
    gathered = 2 * (root + 2 * block)
    assert gathered > loss_forward
    assert z3.forward_buffers_bytes == pytest.approx(gathered, abs=1)
    assert z3.backward_buffers_bytes == pytest.approx(gathered + 2 * unsharded, abs=1)
    one_sample = replace(WORKLOAD, global_batch=64)  # 8 samples per rank: the loss's 8 x 64 x 1000 x 6 B dominate
    big = _estimate(ModuleStrategy(dp=8, micro_batch=8), ModuleStrategy(dp=8, zero=3, micro_batch=8), one_sample)
    assert big.modules["llm"].forward_buffers_bytes == 8 * loss_forward
    assert big.modules["llm"].loss_backward_buffers_bytes == 8 * loss_backward
    assert big.modules["llm"].backward_buffers_bytes == pytest.approx(gathered + 2 * unsharded, abs=1)


def test_a_chunked_loss_holds_one_chunks_logits_and_saves_none():
    """Chunked at 16 of the toy's 64 tokens: a chunk's log-softmax beside its forward transient (4 + 6 B per
    logit) and beside its backward transient (4 + 8 B), nothing saved across the pass."""
    z0 = estimate(MODEL, CLUSTER, WORKLOAD, colocated(ModuleStrategy(dp=8), ModuleStrategy(dp=8)),
                  replace(A, loss_chunk_tokens=16)).modules["llm"]
    assert z0.forward_buffers_bytes == 16 * 1000 * 10
    assert (z0.loss_backward_buffers_bytes, z0.loss_saved_bytes) == (16 * 1000 * 12, 0)


def test_zero1_and_zero2_gradients_as_fsdp2_holds_them():
    params = MODEL.module("vision").num_params
    one = _estimate(ModuleStrategy(dp=8, zero=1), ModuleStrategy(dp=8)).modules["vision"]
    # one micro-batch: reduce-scattered during the backward into the fp32 sharded parameters' gradients, 1/8 each
    assert one.gradients_bytes == pytest.approx(4 * params / 8, abs=1)
    zero2 = estimate(MODEL, CLUSTER, WORKLOAD, colocated(ModuleStrategy(dp=4, zero=2, grad_accum=2),
                                                         ModuleStrategy(dp=4, grad_accum=2)))
    assert zero2.modules["vision"].gradients_bytes == pytest.approx(4 * params / 4, abs=1)  # every micro-batch
    two = estimate(MODEL, CLUSTER, WORKLOAD, colocated(ModuleStrategy(dp=4, zero=1, grad_accum=2),
                                                       ModuleStrategy(dp=4, grad_accum=2)))
    # two micro-batches: FSDP2 accumulates the unsharded gradients in fp32
    assert two.modules["vision"].gradients_bytes == pytest.approx(4 * params, abs=1)


def test_deepstack_hands_over_one_more_tensor_per_injection_layer():
    """Qwen3-VL-style DeepStack: the merged output plus 3 injected features cross the hand-off (4x the bytes, so
    4x the link time), and the LLM ranks hold the 3 injected tensors per micro-batch in flight."""
    deepstack = replace(MODEL, injection_layers=(0, 1, 2))
    strategy = Strategy(
        placement="disjoint",
        modules={
            "vision": ModuleStrategy(dp=2, grad_accum=4),
            "llm": ModuleStrategy(dp=2, tp=2, micro_batch=1, grad_accum=4),
        },
    )
    plain, stacked = estimate(MODEL, CLUSTER, WORKLOAD, strategy), estimate(deepstack, CLUSTER, WORKLOAD, strategy)
    nic = TOY_DEVICE.inter_node_bandwidth * A.inter_node_bus_efficiency
    per_mb = 2 * (4 * 16 * 128 * 2 / nic + TOY_DEVICE.inter_node_latency)
    assert stacked.modules["vision"].handoff_s == pytest.approx(4 * per_mb)
    assert plain.modules["vision"].handoff_s < stacked.modules["vision"].handoff_s
    # 3 tensors of 16 image tokens x 128 x 2 B for the LLM's one-sample micro-batch
    grown = stacked.modules["llm"].activations_per_micro_batch_bytes - plain.modules["llm"].activations_per_micro_batch_bytes
    assert grown == 3 * 16 * 128 * 2


def test_deepstack_bytes_by_hand():
    """Qwen3-VL-32B, one 1344x1344 image: 1,764 LLM image tokens of width 5,120 in bf16, 4 tensors across."""
    from planner.catalog import get_model
    from planner.cost.rank_cost import handoff_bytes, injected_feature_bytes
    from planner.contract.workload import Workload

    assert handoff_bytes(1764, 5120, 4, 2) == 1764 * 5120 * 4 * 2 == 72_253_440
    model, workload = get_model("qwen3-vl-32b"), Workload(image_sizes=((1344, 1344),), text_tokens=512, global_batch=8)
    # micro-batch 2 split over SP 4: a 2,276-token sequence's first slice of 569 tokens is all image tokens, so that
    # rank holds 2 x 569 rows of each of the 3 injected tensors; unsplit, all 1,764
    assert injected_feature_bytes(model, workload, 2, 4, 2) == 3 * 2 * 569 * 5120 * 2
    assert injected_feature_bytes(model, workload, 1, 1, 2) == 3 * 1764 * 5120 * 2
    assert injected_feature_bytes(get_model("qwen2.5-vl-32b"), workload, 2, 4, 2) == 0
