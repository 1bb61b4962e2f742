"""Pipeline parallelism of the LLM (pp > 1): the schedule's formulas by hand, against torch's own schedule, and a
pipelined module's cost by hand on the toy model."""

from dataclasses import replace

import pytest
from cost_toys import COMPUTE_ONLY, LLM_HIDDEN, VOCAB, colocated, decoder_layer, toy_cluster, toy_model, toy_workload

from planner.cost import estimate, module_cost
from planner.cost.phases import Phase, alive, alive_bytes, own_peak_bytes, own_phases
from planner.cost.pipeline import (
    balanced_chunk_layers,
    in_flight_chunks,
    pipeline_bubble_time,
    pipelined_step_floor_s,
    stage0_handoff_bytes,
)
from planner.contract.models import ModelSpec
from planner.contract.strategy import ModuleStrategy, Strategy


def test_balanced_chunk_layers_by_hand():
    # max(0.5 + n0, n1, n2, 2 + n3) with n0 + n1 + n2 + n3 = 10, every n >= 1: 3.5 at (3, 3, 3, 1); at 3.0 the
    # chunks take at most 2 + 3 + 3 + 1 = 9 layers.
    assert balanced_chunk_layers(10, [0.5, 0.0, 0.0, 2.0], 1.0) == (3, 3, 3, 1)
    assert balanced_chunk_layers(8, [0.0, 0.0], 1.0) == (4, 4)
    assert balanced_chunk_layers(4, [0.0, 0.0, 0.0, 9.0], 1.0) == (1, 1, 1, 1)  # at least one layer each
    with pytest.raises(ValueError, match="3 layers cannot fill 4"):
        balanced_chunk_layers(3, [0.0] * 4, 1.0)
    # DeepStack into 3 layers: the first chunk keeps them although its hand-off makes it the slowest
    assert balanced_chunk_layers(8, [2.0, 0.0, 0.0, 0.0], 1.0) == (1, 3, 2, 2)
    assert balanced_chunk_layers(8, [2.0, 0.0, 0.0, 0.0], 1.0, first_at_least=3) == (3, 2, 2, 1)
    with pytest.raises(ValueError, match="5 layers cannot fill 4 pipeline chunks, the first with 3"):
        balanced_chunk_layers(5, [0.0] * 4, 1.0, first_at_least=3)


def test_pipelined_qwen3_vl_first_stage_holds_the_deepstack_layers():
    """Planner and runtime agree: every emitted pipelined Qwen3-VL plan's first chunk holds the DeepStack
    layers, and a plan whose first chunk does not is refused in one line."""
    from planner.api import plan
    from planner.contract.rules import injection_rule

    made = plan("qwen3-vl-32b", 64, fix=["llm.pp=8"])
    llm = made.module("llm")
    assert llm.pp == 8 and llm.pp_layers[0] >= 3 and injection_rule(llm.pp_layers, 3) is None
    assert "give it at least 3" in injection_rule([2, 30, 32], 3)


def test_bubble_by_hand():
    # Alpa Eq. 2: sum t + (m - 1) max t; the bubble is what it adds to m * max t.
    assert pipeline_bubble_time([1.0, 2.0, 1.5], 1) == pytest.approx(2.5)
    # equal stages: (p - 1) t (Narayanan et al. 2021), v times less interleaved
    assert pipeline_bubble_time([1.0] * 4, 1) == pytest.approx(3.0)
    assert pipeline_bubble_time([1.0] * 4, 2) == pytest.approx(1.5)
    assert pipeline_bubble_time([3.0], 1) == 0.0


def test_in_flight_of_1f1b_by_hand():
    assert [in_flight_chunks(k, 4, 8, 1) for k in range(4)] == [4, 3, 2, 1]
    assert [in_flight_chunks(k, 4, 2, 1) for k in range(4)] == [2, 2, 2, 1]


@pytest.mark.parametrize("pp,micro_batches,chunks", [(2, 4, 2), (4, 8, 2), (4, 6, 2), (2, 3, 3), (4, 4, 4)])
def test_in_flight_of_interleaved_matches_torch_warmup(pp, micro_batches, chunks):
    """Warm-up chunk forwards of torch's ScheduleInterleaved1F1B, plus the one running."""
    from torch.distributed.pipelining.schedules import _get_warmup_ops

    per_round = micro_batches // max(1, micro_batches // pp)
    for rank in range(pp):
        warmup = _get_warmup_ops(rank, chunks, per_round, pp, micro_batches)
        assert in_flight_chunks(rank, pp, micro_batches, chunks) == min(warmup + 1, micro_batches * chunks)


def test_zero_bubble_by_hand():
    # ZB-H1: (p - 1)(F + B - W) instead of (p - 1)(F + B + W): each rank's t_k - 2 W_k in the same formula
    assert pipeline_bubble_time([3.0, 3.0], 2, [1.0, 1.0]) == pytest.approx(0.5)
    assert pipeline_bubble_time([3.0, 3.0], 2) == pytest.approx(1.5)
    assert pipeline_bubble_time([3.0, 4.0, 3.0], 1, [1.0, 0.5, 1.0]) == pytest.approx(2.0)  # (1 + 3 + 1) - 3
    assert [in_flight_chunks(k, 2, 4, 2, zero_bubble=True) for k in range(2)] == [4, 4]  # (v - 1) * 2 + p
    assert [in_flight_chunks(k, 4, 2, 2, zero_bubble=True) for k in range(4)] == [4, 4, 4, 4]  # capped at m v


def test_weight_gradient_split_by_hand():
    from planner.cost.layers import weight_gradient_time

    # the GEMMs' weight-gradient half: 0.5 s of GEMMs * 2 (backward / forward) / 2 of 2.0 s of backward device
    # time, the same share (0.25) of a 3.0 s pass
    assert weight_gradient_time(3.0, 2.0, 0.5, "full", COMPUTE_ONLY) == pytest.approx(0.75)
    assert weight_gradient_time(3.0, 2.0, 0.5, "input", COMPUTE_ONLY) == 0.0


PASSES = {"FORWARD": "F", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
"""torch's computation types of a zero-bubble order (no full backwards)."""


def _torch_zero_bubble_order(pp: int, micro_batches: int) -> dict[int, list]:
    """torch's ScheduleInterleavedZeroBubble order of every rank (2 chunks per rank), built on a fake group."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleavedZeroBubble
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp)
    try:
        stages = [PipelineStage(torch.nn.Linear(2, 2), c, 2 * pp, torch.device("cpu")) for c in (0, pp)]
        schedule = ScheduleInterleavedZeroBubble(stages, n_microbatches=micro_batches, loss_fn=lambda a, b: a.sum(),
                                                 scale_grads=False)
        return {rank: [a for a in actions if a is not None] for rank, actions in schedule.pipeline_order.items()}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("pp,micro_batches", [(2, 2), (2, 4), (2, 8), (4, 4), (4, 8), (4, 16)])
def test_zero_bubble_matches_a_replay_of_torchs_order(pp, micro_batches):
    """Replay every rank's order with F = I = W = 1 per chunk (dependencies: a chunk's forward after the previous
    chunk's, its input gradient after the next chunk's, its weight gradient after its own input gradient): the idle
    time is the formula's bubble, and the chunks alive (forward run, weight gradient not yet) peak at its in-flight
    count."""
    orders = _torch_zero_bubble_order(pp, micro_batches)
    last = 2 * pp - 1
    done: dict[tuple[str, int, int], int] = {}
    clock = dict.fromkeys(orders, 0)
    position = dict.fromkeys(orders, 0)
    while any(position[r] < len(orders[r]) for r in orders):
        progressed = False
        for rank, actions in orders.items():
            if position[rank] == len(actions):
                continue
            a = actions[position[rank]]
            kind, stage, mb = PASSES[a.computation_type.name], a.stage_index, a.microbatch_index
            needs = {"F": ("F", stage - 1, mb) if stage else None,
                     "I": ("I", stage + 1, mb) if stage < last else ("F", stage, mb),
                     "W": ("I", stage, mb)}[kind]
            if needs is not None and needs not in done:
                continue
            start = max(clock[rank], done[needs] if needs else 0)
            clock[rank] = done[(kind, stage, mb)] = start + 1
            position[rank] += 1
            progressed = True
        assert progressed, "the order deadlocks"
    chunk_s, weight_s = 3.0, 1.0  # F + I + W per chunk, and W
    bubble = pipeline_bubble_time([2 * chunk_s] * pp, 2, [2 * weight_s] * pp)
    assert max(clock.values()) == pytest.approx(micro_batches * 2 * chunk_s + bubble)
    for rank, actions in orders.items():
        alive = peak = 0
        for a in actions:
            alive += {"F": 1, "I": 0, "W": -1}[PASSES[a.computation_type.name]]
            peak = max(peak, alive)
        assert peak == in_flight_chunks(rank, pp, micro_batches, 2, zero_bubble=True)


def deep_model(decoder_layers: int = 6) -> ModelSpec:
    """The toy model with more decoder layers, so that stages can split them."""
    model = toy_model()
    llm = model.module("llm")
    layers = tuple(decoder_layer(decoder_layers) if layer.kind == "decoder_layer" else layer for layer in llm.layers)
    return replace(model, modules=(model.module("vision"), replace(llm, layers=layers)))


def llm_cost(strategy: ModuleStrategy, model: ModelSpec, gpus: int = 8, cluster=None):
    return module_cost(model, "llm", cluster or toy_cluster(gpus), toy_workload(strategy.samples_per_step), strategy,
                       placement="colocated", precision="bf16_mixed", first_rank=0, assumptions=COMPUTE_ONLY)


def instant_links(gpus: int = 8):
    """Toy GPUs whose links take no time, so that compute alone shapes the pipeline (the toy's compute is
    nanoseconds, far below any link latency)."""
    cluster = toy_cluster(gpus)
    device = replace(cluster.device, intra_node_latency=0.0, inter_node_latency=0.0, intra_node_bandwidth=1e30,
                     inter_node_bandwidth=1e30)
    return replace(cluster, device=device)


def test_pipelined_llm_by_hand():
    model = deep_model(6)
    s = ModuleStrategy(dp=4, pp=2, micro_batch=1, grad_accum=4)
    cost = llm_cost(s, model)
    ranks = cost.rank_costs()
    first, last = ranks
    decoder = model.module("llm").layers[1]
    n0, n1 = cost.chunk_layers
    assert n0 + n1 == 6 and min(n0, n1) >= 1
    # each rank holds its own layers' bf16 weights: the embedding and n0 decoders, n1 decoders + norm + lm_head
    assert first.weights_bytes == 2 * (VOCAB * LLM_HIDDEN + n0 * decoder.params)
    assert last.weights_bytes == 2 * (n1 * decoder.params + LLM_HIDDEN + VOCAB * LLM_HIDDEN)
    # 1F1B: rank 0 holds min(pp, m) = 2 micro-batches, the last rank 1
    assert first.activations_bytes == 2 * first.activations_per_micro_batch_bytes
    assert last.activations_bytes == last.activations_per_micro_batch_bytes
    # stage boundary: 4 GPUs per stage and per node, so it crosses the NIC; hidden states of one micro-batch
    # (64 tokens x 128 x 2 bytes) forward and their gradient back, once per micro-batch on rank 0
    nic = toy_cluster().device.inter_node_bandwidth * COMPUTE_ONLY.inter_node_bus_efficiency
    send = 64 * LLM_HIDDEN * 2 / nic + toy_cluster().device.inter_node_latency
    assert first.pp_comm_s == pytest.approx(4 * 2 * send)
    assert last.pp_comm_s == 0.0
    # torch's stages keep a receive buffer per micro-batch: rank 0 for the gradient of what it sends, the last rank
    # for the hidden states it gets; alive in every phase of the step
    boundary = 64 * LLM_HIDDEN * 2
    assert first.receive_buffers_bytes == last.receive_buffers_bytes == 4 * boundary
    assert all(phase.buffers >= 4 * boundary for phase in own_phases(last))
    # the step: m * slowest + (sum - slowest) (Alpa Eq. 2)
    t = [first.per_micro_batch_s, last.per_micro_batch_s]
    assert cost.per_micro_batch_s == max(t)
    assert cost.micro_batches_s == pytest.approx(4 * max(t) + min(t))


def test_zero2_and_zero3_inside_a_stage_hold_what_torchs_schedules_keep():
    """torch's schedules turn gradient sync and reshard-after-backward off inside a step: ZeRO-2 and -3 stages
    accumulate unsharded fp32 gradients and keep the weights gathered, as ZeRO-1 does; ZeRO-2 communicates as
    ZeRO-1 (one reduce-scatter per step), ZeRO-3 adds a gather of each chunk for each forward before its first
    backward (the chunks it holds in flight)."""
    model = deep_model(6)
    no_overlap = replace(COMPUTE_ONLY, dp_comm_overlap=0.0)

    def ranks(zero):
        return module_cost(model, "llm", toy_cluster(8), toy_workload(4), ModuleStrategy(
            dp=4, pp=2, zero=zero, micro_batch=1, grad_accum=4), placement="colocated", precision="bf16_mixed",
            first_rank=0, assumptions=no_overlap).rank_costs()

    link = toy_cluster(8).device.intra_node_bandwidth * no_overlap.intra_node_bus_efficiency
    latency = toy_cluster(8).device.intra_node_latency
    for z1, z2, z3 in zip(ranks(1), ranks(2), ranks(3)):
        params = z1.weights_bytes / 2  # bf16 weights, unsharded under ZeRO-1
        for cost in (z1, z2, z3):
            assert (cost.weights_bytes, cost.gradients_bytes) == (2 * params, 4 * params)
        assert (z3.forward_buffers_bytes, z3.backward_buffers_bytes) == (z1.forward_buffers_bytes,
                                                                        z1.backward_buffers_bytes)
        assert z2.dp_comm_s == z1.dp_comm_s
        # ring all-gather over 4 ranks: 3/4 of the bf16 weights over the link, 3 latencies; no overlap
        gather = 3 / 4 * 2 * params / link + 3 * latency
        assert z3.dp_comm_s - z1.dp_comm_s == pytest.approx(z1.in_flight_micro_batches * gather)


def test_stage_split_balances_the_loss_against_decoder_layers():
    """The last stage's lm_head + loss over a large vocabulary costs layers: it gets fewer decoder layers."""
    model = deep_model(6)
    llm = model.module("llm")
    big_vocab = tuple(replace(layer, params=50 * layer.params, out_features=50 * VOCAB) if layer.kind == "lm_head"
                      else layer for layer in llm.layers)
    heavy = replace(model, modules=(model.module("vision"), replace(llm, layers=big_vocab)))
    s = ModuleStrategy(dp=4, pp=2, micro_batch=1, grad_accum=4)
    n0, n1 = llm_cost(s, heavy, cluster=instant_links()).chunk_layers
    assert n1 < n0
    assert llm_cost(s, model, cluster=instant_links()).chunk_layers[1] > n1


def test_receive_buffers_of_interleaved_stages_by_hand():
    """pp = 2 with 2 chunks per rank: rank 0 (chunks 0 and 2) receives chunk 2's activations and both chunks'
    gradients, rank 1 (chunks 1 and 3) both chunks' activations and chunk 1's gradient: 3 buffers of each of the
    m = 4 micro-batches on each."""
    s = ModuleStrategy(dp=4, pp=2, pp_schedule="interleaved_1f1b", virtual_stages=2, micro_batch=1, grad_accum=4)
    ranks = llm_cost(s, deep_model(6)).rank_costs()
    assert [c.receive_buffers_bytes for c in ranks] == [3 * 4 * 64 * LLM_HIDDEN * 2] * 2


def test_interleaved_chunks_shrink_the_bubble_and_hold_what_torch_warms_up():
    model = deep_model(8)
    plain = llm_cost(ModuleStrategy(dp=2, pp=4, micro_batch=1, grad_accum=4), model, cluster=instant_links())
    interleaved = llm_cost(ModuleStrategy(dp=2, pp=4, pp_schedule="interleaved_1f1b", virtual_stages=2,
                                          micro_batch=1, grad_accum=4), model, cluster=instant_links())
    assert len(interleaved.chunk_layers) == 8 and sum(interleaved.chunk_layers) == 8
    t = [c.per_micro_batch_s for c in interleaved.rank_costs()]
    assert interleaved.pipeline_bubble_s == pytest.approx((sum(t) - max(t)) / 2)
    assert interleaved.pipeline_bubble_s < plain.pipeline_bubble_s
    first_plain, first_interleaved = plain.rank_costs()[0], interleaved.rank_costs()[0]
    # rank 0 of interleaved warms up (v - 1) * 4 + 2 * 3 = 10 chunk forwards, capped at all m * v = 8 chunks (half
    # its layers each): 4 micro-batches' worth, as many as 1F1B's 4 here
    assert first_interleaved.in_flight_micro_batches == 8
    assert [c.in_flight_micro_batches for c in interleaved.rank_costs()] == [8, 8, 7, 5]
    assert first_interleaved.activations_bytes >= first_plain.activations_bytes


def test_zero_bubble_defers_each_ranks_weight_gradients_into_the_bubble():
    model = deep_model(8)
    options = dict(dp=2, pp=4, virtual_stages=2, micro_batch=1, grad_accum=4)
    interleaved = llm_cost(ModuleStrategy(pp_schedule="interleaved_1f1b", **options), model, cluster=instant_links())
    zero_bubble = llm_cost(ModuleStrategy(pp_schedule="interleaved_zb", **options), model, cluster=instant_links())
    ranks = zero_bubble.rank_costs()
    t = [c.per_micro_batch_s for c in ranks]
    w = [c.weight_grad_per_micro_batch_s for c in ranks]
    # the toy's weight gradients: the GEMMs' half of the backward, so more than none and less than all of it
    assert all(0 < c.weight_grad_per_micro_batch_s < c.backward_s / c.strategy.grad_accum for c in ranks)
    deferred = [x - 2 * y for x, y in zip(t, w)]
    assert zero_bubble.pipeline_bubble_s == pytest.approx((sum(deferred) - max(deferred)) / 2)
    assert zero_bubble.pipeline_bubble_s < interleaved.pipeline_bubble_s
    assert zero_bubble.per_micro_batch_s == pytest.approx(interleaved.per_micro_batch_s)
    # every rank holds (v - 1) * 4 + p = 8 chunks (capped at m v = 8): rank 0 no more than interleaved 1F1B's 8
    assert [c.in_flight_micro_batches for c in ranks] == [8, 8, 8, 8]


def test_pipelined_memory_is_its_heaviest_rank_at_every_phase():
    model = deep_model(6)
    cost = llm_cost(ModuleStrategy(dp=4, pp=2, micro_batch=1, grad_accum=4), model)
    for kind in ("forward", "backward_start", "backward_end"):
        phase = Phase("llm", kind)
        heaviest = max(alive(c, 0, phase, 0).total for c in cost.rank_costs())
        assert alive(cost, 0, phase, 0).total == heaviest
    assert max(m.total for m in own_phases(cost)) == max(max(m.total for m in own_phases(c))
                                                          for c in cost.rank_costs())


def test_encoders_feeding_a_pipeline_hold_every_micro_batch():
    model = deep_model(6)
    vision = ModuleStrategy(dp=8, micro_batch=1, grad_accum=4)
    pipelined = estimate(model, toy_cluster(8), toy_workload(32), colocated(
        vision, ModuleStrategy(dp=4, pp=2, micro_batch=2, grad_accum=4)), COMPUTE_ONLY)
    flat = estimate(model, toy_cluster(8), toy_workload(32), colocated(
        vision, ModuleStrategy(dp=8, micro_batch=1, grad_accum=4)), COMPUTE_ONLY)
    v_pipe, v_flat = pipelined.modules["vision"], flat.modules["vision"]
    assert v_flat.activations_bytes == v_flat.activations_per_micro_batch_bytes
    assert v_pipe.activations_bytes == 4 * v_pipe.activations_per_micro_batch_bytes
    llm = pipelined.modules["llm"]
    step = v_pipe.micro_batches_s + v_pipe.step_tail_s + llm.micro_batches_s + llm.step_tail_s
    assert pipelined.step_time_s == pytest.approx(step + COMPUTE_ONLY.step_overhead_s)


def test_the_first_stage_holds_every_micro_batchs_handoff_and_its_gradient():
    """The schedule takes all micro-batches' image rows at once: stage 0 holds 4 micro-batches x 2 samples x 16
    image tokens x 128 wide x 2 bytes = 32 KiB of them through the schedule, and their gradient (as much again)
    when the vision tower trains; the other stage holds none."""
    assert stage0_handoff_bytes(16 * LLM_HIDDEN * 2, True, 2, 4) == 2 * 4 * 2 * 16 * LLM_HIDDEN * 2
    vision, llm = ModuleStrategy(dp=8, micro_batch=1, grad_accum=4), ModuleStrategy(dp=4, pp=2, micro_batch=2,
                                                                                     grad_accum=4)

    def ranks(model):
        return estimate(model, instant_links(), toy_workload(32), colocated(vision, llm), COMPUTE_ONLY
                        ).modules["llm"].rank_costs()

    trained, frozen = ranks(deep_model(6)), ranks(replace(deep_model(6), modules=(
        replace(deep_model(6).module("vision"), frozen=True), deep_model(6).module("llm"))))
    rows = 4 * 2 * 16 * LLM_HIDDEN * 2
    assert trained[0].forward_buffers_bytes - frozen[0].forward_buffers_bytes == rows
    assert trained[0].backward_buffers_bytes - frozen[0].backward_buffers_bytes == rows
    assert trained[1].forward_buffers_bytes == frozen[1].forward_buffers_bytes


def test_under_sp_the_first_stage_holds_the_image_rows_of_its_slice():
    """SP8 over a 64-token sequence: slices of 8 tokens, so the rank whose slice holds the most of the 16 image
    tokens holds 8 rows of each sample: their gradient, what a trained vision tower adds, is 4 micro-batches x 16
    samples x 8 rows x 128 wide x 2 bytes (16 rows without the slice's bound)."""
    vision = ModuleStrategy(dp=16, micro_batch=1, grad_accum=4)
    llm = ModuleStrategy(dp=1, pp=2, sp=8, micro_batch=16, grad_accum=4)

    def stage0(model):
        return estimate(model, instant_links(16), toy_workload(64), colocated(vision, llm), COMPUTE_ONLY
                        ).modules["llm"].rank_costs()[0]

    frozen = replace(deep_model(6), modules=(replace(deep_model(6).module("vision"), frozen=True),
                                             deep_model(6).module("llm")))
    held = stage0(deep_model(6)).forward_buffers_bytes - stage0(frozen).forward_buffers_bytes
    assert held == 4 * 16 * 8 * LLM_HIDDEN * 2


def test_pipeline_rules():
    model = deep_model(6)
    flat = ModuleStrategy(dp=8, micro_batch=1, grad_accum=4)
    with pytest.raises(ValueError, match="planned for the LLM only"):
        estimate(model, toy_cluster(8), toy_workload(32),
                 colocated(ModuleStrategy(dp=4, pp=2, micro_batch=2, grad_accum=4), flat), COMPUTE_ONLY)
    with pytest.raises(ValueError, match=r"needs grad_accum >= 4"):
        estimate(model, toy_cluster(8), toy_workload(8), colocated(
            ModuleStrategy(dp=8), ModuleStrategy(dp=2, pp=4, micro_batch=4)), COMPUTE_ONLY)
    with pytest.raises(ValueError, match="8 pipeline chunks need 8 decoder layers, llm has 6"):
        estimate(model, toy_cluster(8), toy_workload(32), colocated(flat, ModuleStrategy(
            dp=2, pp=4, pp_schedule="interleaved_1f1b", virtual_stages=2, micro_batch=4, grad_accum=4)), COMPUTE_ONLY)
    for zero, recompute, rule in ((3, "none", "interleaved_zb with zero=3"),
                                  (1, "full", "interleaved_zb with recompute=full")):
        with pytest.raises(ValueError, match=rule):
            estimate(model, toy_cluster(8), toy_workload(32), colocated(flat, ModuleStrategy(
                dp=4, pp=2, pp_schedule="interleaved_zb", virtual_stages=2, zero=zero, recompute=recompute,
                micro_batch=2, grad_accum=4)), COMPUTE_ONLY)
    with pytest.raises(ValueError, match="virtual_stages=1 goes with pp_schedule 1f1b"):
        ModuleStrategy(dp=4, pp=2, pp_schedule="interleaved_zb")


def test_disjoint_encoder_feeding_a_pipeline_runs_before_and_after_it():
    """The runtime runs every vision forward, then the LLM's schedule, then every vision backward: the step is
    their sum (plus the longest tail), and the vision group holds every micro-batch's activations."""
    model = deep_model(6)
    strategy = Strategy(placement="disjoint", modules={
        "vision": ModuleStrategy(dp=4, micro_batch=1, grad_accum=4),
        "llm": ModuleStrategy(dp=2, pp=2, micro_batch=2, grad_accum=4)})
    e = estimate(model, toy_cluster(8), toy_workload(16), strategy, COMPUTE_ONLY)
    vision, llm = e.modules["vision"], e.modules["llm"]
    assert vision.activations_bytes == 4 * vision.activations_per_micro_batch_bytes
    expected = vision.micro_batches_s + llm.micro_batches_s + max(vision.step_tail_s, llm.step_tail_s)
    assert e.step_time_s == pytest.approx(expected + COMPUTE_ONLY.step_overhead_s)


@pytest.mark.parametrize("pp", [1, 2])
def test_phase_totals_of_the_hot_path_match_the_breakdowns(pp):
    model = deep_model(6)
    cost = llm_cost(ModuleStrategy(dp=4 // pp, pp=pp, micro_batch=1, grad_accum=4), model)
    for kind in ("forward", "backward_start", "backward_end"):
        for position, at in ((0, 0), (0, 1), (1, 0)):
            assert alive_bytes(cost, position, kind, at) == alive(cost, position, Phase("llm", kind), at).total
    assert own_peak_bytes(cost) == max(m.total for m in own_phases(cost))


@pytest.mark.parametrize("schedule,chunks", [("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_zb", 2)])
def test_pipelined_step_floor_by_hand(schedule, chunks):
    """``(m - 1/v) S / p + S / v`` (zero-bubble: ``S - 2 W`` in the second term), S and W one micro-batch's work
    and weight-gradient passes over every layer: the pp = 1 cost's, with instant links and no TP; never above
    the pipelined cost itself."""
    model, cluster = deep_model(6), instant_links()
    assumptions = replace(COMPUTE_ONLY, loss_chunk_tokens=0)  # the pp = 1 cost's loss as a pipelined LLM runs it
    s = ModuleStrategy(dp=4, pp=2, pp_schedule=schedule, virtual_stages=chunks, micro_batch=1, grad_accum=4)
    whole = module_cost(model, "llm", cluster, toy_workload(s.samples_per_step), replace(s, dp=8, pp=1,
                        pp_schedule="1f1b", virtual_stages=1), placement="colocated", precision="bf16_mixed",
                        first_rank=0, assumptions=assumptions)
    work, weight_grads = whole.per_micro_batch_s, whole.weight_grad_per_micro_batch_s
    filled = work - 2 * weight_grads if schedule == "interleaved_zb" else work
    floor = pipelined_step_floor_s(model, "llm", cluster, toy_workload(s.samples_per_step), s,
                                   assumptions=assumptions)
    assert floor == pytest.approx((4 - 1 / chunks) * work / 2 + filled / chunks)
    assert floor <= llm_cost(s, model, cluster=cluster).micro_batches_s


def test_a_pipelined_cost_does_not_depend_on_what_was_costed_before():
    """The layer sums' memo tells a pipelined loss (the whole logits at once) from a chunked one: costing a strategy
    without PP of the same sharding first leaves a pipelined strategy's cost as it is costed alone."""
    from planner.catalog import get_model
    from planner.cost import DEFAULT_ASSUMPTIONS
    from planner.contract.hardware import get_device, make_cluster
    from planner.contract.workload import Workload

    model, cluster = get_model("qwen-vl-32b"), make_cluster(get_device("h100-80gb"), 16)
    workload = Workload(image_sizes=((1344, 1344),), text_tokens=512, global_batch=64)
    piped = ModuleStrategy(dp=2, tp=2, pp=4, micro_batch=1, grad_accum=32)
    flat = replace(piped, pp=1, dp=8, grad_accum=8)

    def cost(strategy, assumptions):  # a new assumptions object: a memo of its own
        return module_cost(model, "llm", cluster, workload, strategy, placement="colocated", precision="bf16_mixed",
                           first_rank=0, assumptions=assumptions)

    alone = cost(piped, replace(DEFAULT_ASSUMPTIONS))
    after_flat = replace(DEFAULT_ASSUMPTIONS)
    cost(flat, after_flat)
    assert cost(piped, after_flat) == alone
