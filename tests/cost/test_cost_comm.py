"""Alpha-beta collectives, link choice and ZeRO communication against hand calculations."""

import pytest
from cost_toys import toy_cluster

from planner.cost.assumptions import DEFAULT_ASSUMPTIONS
from planner.cost.comm import (
    Link,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    axis_within_node,
    exposed_time,
    link,
    p2p_time,
    pipelined_zero3_gather_time,
    reduce_scatter_time,
    zero_comm_time,
)

LINK = Link(bandwidth=1e11, latency=1e-5)


def test_all_reduce_ring():
    # 2(n-1)/n * B/bw + 2(n-1) alpha = 2*3/4 * 1e9/1e11 + 6e-5 = 0.015 + 0.00006
    assert all_reduce_time(1e9, 4, LINK) == pytest.approx(0.01506)


def test_all_gather_and_reduce_scatter_ring():
    # (n-1)/n * B/bw + (n-1) alpha = 7/8 * 8e8/1e11 + 7e-5 = 0.007 + 0.00007
    assert all_gather_time(8e8, 8, LINK) == pytest.approx(0.00707)
    assert reduce_scatter_time(8e8, 8, LINK) == pytest.approx(0.00707)


def test_all_to_all():
    # (n-1)/n * B/bw + (n-1) alpha = 1/2 * 2e8/1e11 + 1e-5 = 0.001 + 0.00001
    assert all_to_all_time(2e8, 2, LINK) == pytest.approx(0.00101)


def test_p2p():
    # B/bw + alpha = 1e8/1e11 + 1e-5
    assert p2p_time(1e8, LINK) == pytest.approx(0.00101)


@pytest.mark.parametrize("fn", [all_reduce_time, all_gather_time, reduce_scatter_time, all_to_all_time])
def test_group_of_one_or_empty_message_is_free(fn):
    assert fn(1e9, 1, LINK) == 0.0
    assert fn(0.0, 8, LINK) == 0.0


def test_all_reduce_is_reduce_scatter_plus_all_gather():
    assert all_reduce_time(3e8, 6, LINK) == pytest.approx(
        reduce_scatter_time(3e8, 6, LINK) + all_gather_time(3e8, 6, LINK)
    )


def test_exposed_time():
    # 1.0 s of comm, 0.9 * 0.5 s hideable -> 0.55 s exposed
    assert exposed_time(1.0, 0.5, 0.9) == pytest.approx(0.55)
    # fully hidden except the floor (last bucket)
    assert exposed_time(1.0, 10.0, 0.9, floor_s=0.05) == pytest.approx(0.05)
    # never more than the comm itself
    assert exposed_time(0.01, 0.0, 0.9, floor_s=0.05) == pytest.approx(0.01)


def test_axis_within_node():
    # 8 ranks, 4 per node: tp=4 groups {0-3},{4-7} stay inside nodes
    assert axis_within_node(0, 1, 4, 8, 4)
    # dp=2 with stride 4: {0,4} crosses nodes
    assert not axis_within_node(0, 4, 2, 8, 4)
    # tp=2 starting at rank 1: {1,2} fine, {3,4} crosses
    assert not axis_within_node(1, 1, 2, 4, 4)
    # degree 1 needs no link
    assert axis_within_node(3, 1, 1, 1, 4)


def test_link_picks_nvlink_or_nic():
    cluster = toy_cluster(8)
    a = DEFAULT_ASSUMPTIONS
    intra = link(cluster, a, within_node=True)
    inter = link(cluster, a, within_node=False)
    assert intra == Link(bandwidth=2e11 * a.intra_node_bus_efficiency, latency=1e-5)
    assert inter == Link(bandwidth=2.5e10 * a.inter_node_bus_efficiency, latency=5e-5)


def _zero(stage, **overrides):
    args = dict(
        zero=stage,
        gradient_bytes=1e9,
        weight_bytes=1e9,
        layer_weight_bytes=1e8,
        bucket_bytes=1e7,
        group_size=4,
        link=LINK,
        grad_accum=2,
        forward_s=0.01,
        backward_s=0.02,
        trainable=True,
        runs_backward=True,
        overlap=0.5,
        zero0_overlap=0.5,
    )
    args.update(overrides)
    return zero_comm_time(**args)


def test_zero0_all_reduce_once_per_step():
    # AR(1e9, 4) = 2*3/4*1e-2 + 6e-5 = 0.01506; exposed = 0.01506 - 0.5*0.02 = 0.00506
    assert _zero(0) == pytest.approx(0.00506)
    # the runtime's one all-reduce after the backward (zero0_overlap 0): all of it; ZeRO-1+ keep their overlap
    assert _zero(0, zero0_overlap=0.0) == pytest.approx(0.01506)
    assert _zero(1, zero0_overlap=0.0) == pytest.approx(_zero(1))


def test_zero1_reduce_scatter_plus_gather_once():
    # RS = 3/4*1e-2 + 3e-5 = 0.00753 -> exposed 0.00753 - 0.01 < floor RS(1e7) = 3/4*1e-4 + 3e-5 = 0.000105
    # AG = 0.00753 -> exposed 0.00753 - 0.5*0.01 = 0.00253
    assert _zero(1) == pytest.approx(0.000105 + 0.00253)


def test_zero2_reduce_scatter_every_micro_batch():
    # 2 micro-batches x 0.000105 + 0.00253
    assert _zero(2) == pytest.approx(2 * 0.000105 + 0.00253)


def test_zero3_gathers_forward_and_backward():
    # per mb: AG fwd exposed 0.00753 - 0.005 = 0.00253; bwd: AG+RS = 0.01506 - 0.01 = 0.00506; x 2
    assert _zero(3) == pytest.approx(2 * (0.00253 + 0.00506))


def test_pipelined_zero3_gathers_each_in_flight_chunk_once():
    # 2 chunks of 0.5e9 bytes: AG = 3/4 * 5e8/1e11 + 3e-5 = 0.003780 each; exposed behind half the 0.01 s forward
    # at overlap 0.5: 0.00378 - 0.0025 = 0.00128, above the first layer's AG(1e8) = 0.00078; 5 chunks in flight
    gathers = pipelined_zero3_gather_time(weight_bytes=1e9, layer_weight_bytes=1e8, chunk_gathers=5, virtual_stages=2,
                                          group_size=4, link=LINK, forward_s=0.01, overlap=0.5)
    assert gathers == pytest.approx(5 * 0.00128)
    assert pipelined_zero3_gather_time(weight_bytes=1e9, layer_weight_bytes=1e8, chunk_gathers=5, virtual_stages=2,
                                       group_size=1, link=LINK, forward_s=0.01, overlap=0.5) == 0.0


def test_frozen_module_only_gathers_zero3_weights():
    assert _zero(0, trainable=False) == 0.0
    assert _zero(2, trainable=False) == 0.0
    # forward-only frozen ZeRO-3: one gather per micro-batch
    assert _zero(3, trainable=False, runs_backward=False) == pytest.approx(2 * 0.00253)


def test_single_replica_has_no_dp_comm():
    assert _zero(3, group_size=1) == 0.0
