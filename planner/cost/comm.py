"""Collective communication times (alpha-beta model) and which link a process group uses.

Every collective is costed with the Hockney alpha-beta model ``time = latency_terms * alpha + bytes / bw``
and the ring algorithms of Thakur, Rabenseifner & Gropp (2005), "Optimization of Collective Communication
Operations in MPICH", Sec. 4 (ring all-gather, reduce-scatter; all-reduce = reduce-scatter + all-gather).
``bandwidth`` is the per-GPU unidirectional bandwidth of the slowest link on the ring, already multiplied by
the bus efficiency; ``latency`` is the per-message latency alpha.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Callable

from planner.cost.assumptions import CostAssumptions
from planner.contract.hardware import Cluster


@dataclass(kw_only=True, frozen=True)
class Link:
    """Effective bandwidth (bytes/s, bus efficiency applied) and per-message latency (s) of a group's ring."""

    bandwidth: float
    """Achieved per-GPU unidirectional bytes/s."""
    latency: float
    """Per-message latency alpha, seconds."""
    curve: Callable[[str, int, float], float | None] | None = None
    """(profiler) Measured seconds of (op, group size, per-rank input bytes), None where not measured; the
    formulas below apply where it has no answer. Set from a profile's collectives (``ProfileCostSource``)."""


def _measured(link: Link, op: str, group_size: int, per_rank_bytes: float) -> float | None:
    """(profiler) The link's measured time for this collective, if it has one."""
    return None if link.curve is None else link.curve(op, group_size, per_rank_bytes)


def all_reduce_time(num_bytes: float, group_size: int, link: Link) -> float:
    """Ring all-reduce of a ``num_bytes`` buffer: ``2(n-1)/n * B/bw + 2(n-1) * alpha``.

    Source: Thakur, Rabenseifner & Gropp 2005, Sec. 4.4 (reduce-scatter followed by all-gather, each n-1 steps
    of B/n bytes); Patarasuk & Yuan 2009 show the 2(n-1)/n bandwidth term is optimal.
    """
    n = group_size
    if n <= 1 or num_bytes <= 0:
        return 0.0
    measured = _measured(link, "all_reduce", n, num_bytes)
    if measured is not None:
        return measured
    return 2 * (n - 1) / n * num_bytes / link.bandwidth + 2 * (n - 1) * link.latency


def all_gather_time(num_bytes: float, group_size: int, link: Link) -> float:
    """Ring all-gather producing a ``num_bytes`` buffer: ``(n-1)/n * B/bw + (n-1) * alpha``.

    Source: Thakur, Rabenseifner & Gropp 2005, Sec. 4.1 (ring algorithm, n-1 steps of B/n bytes).
    """
    n = group_size
    if n <= 1 or num_bytes <= 0:
        return 0.0
    measured = _measured(link, "all_gather", n, num_bytes / n)
    if measured is not None:
        return measured
    return (n - 1) / n * num_bytes / link.bandwidth + (n - 1) * link.latency


def reduce_scatter_time(num_bytes: float, group_size: int, link: Link) -> float:
    """Ring reduce-scatter of a ``num_bytes`` input buffer: ``(n-1)/n * B/bw + (n-1) * alpha``.

    Source: Thakur, Rabenseifner & Gropp 2005, Sec. 4.3 (the dual of the ring all-gather).
    """
    measured = _measured(link, "reduce_scatter", group_size, num_bytes) if group_size > 1 and num_bytes > 0 else None
    if measured is not None:
        return measured
    return all_gather_time(num_bytes, group_size, link if link.curve is None else replace(link, curve=None))


def all_to_all_time(num_bytes: float, group_size: int, link: Link) -> float:
    """All-to-all where each rank holds ``num_bytes`` and keeps 1/n of it: ``(n-1)/n * B/bw + (n-1) * alpha``.

    Source: Thakur, Rabenseifner & Gropp 2005, Sec. 4.5 (pairwise exchange, n-1 steps of B/n bytes each);
    the volume matches DeepSpeed-Ulysses (Jacobs et al. 2023, Sec. 3.2: each all-to-all moves M/P per link).
    """
    n = group_size
    if n <= 1 or num_bytes <= 0:
        return 0.0
    measured = _measured(link, "all_to_all", n, num_bytes)
    if measured is not None:
        return measured
    return (n - 1) / n * num_bytes / link.bandwidth + (n - 1) * link.latency


def p2p_time(num_bytes: float, link: Link) -> float:
    """One point-to-point message: ``B/bw + alpha`` (Hockney 1994, the alpha-beta model itself)."""
    if num_bytes <= 0:
        return 0.0
    measured = _measured(link, "send_recv", 2, num_bytes)
    if measured is not None:
        return measured
    return num_bytes / link.bandwidth + link.latency


def exposed_time(comm_s: float, hideable_compute_s: float, overlap: float, floor_s: float = 0.0) -> float:
    """Communication left on the critical path when it overlaps ``overlap`` of ``hideable_compute_s``.

    ``max(floor, comm - overlap * compute)``, never more than ``comm``. ``floor_s`` is what can never overlap
    (e.g. the last gradient bucket, reduced after the backward ends). Source: the bucketed-overlap argument of
    Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", Sec. 3.2.3.
    """
    return min(comm_s, max(floor_s, comm_s - overlap * hideable_compute_s))


def pipelined_zero3_gather_time(
    *, weight_bytes: float, layer_weight_bytes: float, chunk_gathers: int, virtual_stages: int, group_size: int,
    link: Link, forward_s: float, overlap: float,
) -> float:
    """Exposed ZeRO-3 weight all-gathers of one pipeline rank per step under torch's schedules, beyond ZeRO-1's
    once-per-step gather.

    Each model chunk (``weight_bytes / virtual_stages``) is gathered for every forward it runs before its first
    backward, and stays gathered from that backward to the step's end (torch.distributed.pipelining 2.13 turns
    reshard-after-backward off inside a step): ``chunk_gathers`` gathers, the chunks the rank holds in flight at
    its peak, each hidden behind its chunk's forward as ``exposed_time`` (all-gather volume: Rajbhandari et al.
    2020, Sec. 7).
    """
    if group_size <= 1:
        return 0.0
    gather = all_gather_time(weight_bytes / virtual_stages, group_size, link)
    first_layer = all_gather_time(layer_weight_bytes, group_size, link)
    return chunk_gathers * exposed_time(gather, forward_s / virtual_stages, overlap, first_layer)


@lru_cache(maxsize=4096)
def axis_within_node(first_rank: int, stride: int, size: int, num_ranks: int, devices_per_node: int) -> bool:
    """Whether every process group along one grid axis lies inside one node.

    The module's ranks ``first_rank .. first_rank + num_ranks - 1`` form a ``dp x cp x sp x tp`` grid with tp
    innermost; a group along an axis of ``size`` with ``stride`` (tp: 1, sp: tp, cp: tp*sp, dp: tp*sp*cp) is
    ``{base + j * stride}``. Ranks are consecutive within a node (``rank // devices_per_node`` is the node).
    """
    if size <= 1:
        return True
    span = size * stride
    for outer in range(0, num_ranks, span):
        for inner in range(stride):
            lo = first_rank + outer + inner
            hi = lo + (size - 1) * stride
            if lo // devices_per_node != hi // devices_per_node:
                return False
    return True


def link(cluster: Cluster, assumptions: CostAssumptions, *, within_node: bool) -> Link:
    """NVLink (intra-node) or NIC (inter-node) bandwidth with its bus efficiency, and its latency."""
    device = cluster.device
    if within_node:
        return Link(
            bandwidth=device.intra_node_bandwidth * assumptions.intra_node_bus_efficiency,
            latency=device.intra_node_latency,
        )
    return Link(
        bandwidth=device.inter_node_bandwidth * assumptions.inter_node_bus_efficiency,
        latency=device.inter_node_latency,
    )


def zero_comm_time(
    *,
    zero: int,
    gradient_bytes: float,
    weight_bytes: float,
    layer_weight_bytes: float,
    bucket_bytes: float,
    group_size: int,
    link: Link,
    grad_accum: int,
    forward_s: float,
    backward_s: float,
    trainable: bool,
    runs_backward: bool,
    overlap: float,
    zero0_overlap: float,
) -> float:
    """Exposed DP/ZeRO communication per optimizer step on one rank.

    Volumes follow Rajbhandari et al. 2020 (ZeRO), Sec. 7: ZeRO-0 all-reduces gradients once per step
    (DDP ``no_sync`` while accumulating); ZeRO-1 reduce-scatters gradients and all-gathers updated weights
    once per step (same 2 Psi volume); ZeRO-2 reduce-scatters every micro-batch (to keep gradients sharded)
    and all-gathers weights once; ZeRO-3 all-gathers weights in forward and again in backward and
    reduce-scatters gradients every micro-batch (3 Psi). Gradient reduction overlaps the backward of the
    micro-batch that produces it except the last bucket; weight gathers overlap the forward (FSDP prefetch)
    except the first layer (``exposed_time``), ``overlap`` of the compute hiding them; ZeRO-0's all-reduce hides
    behind ``zero0_overlap`` of the backward instead. ``forward_s``/``backward_s`` are one micro-batch's compute.
    A frozen module only gathers ZeRO-3 weights.
    """
    n = group_size
    if n <= 1:
        return 0.0
    gather_w = all_gather_time(weight_bytes, n, link)
    first_layer = all_gather_time(layer_weight_bytes, n, link)
    if not trainable:
        if zero < 3:
            return 0.0
        per_mb = exposed_time(gather_w, forward_s, overlap, first_layer)
        if runs_backward:
            per_mb += exposed_time(gather_w, backward_s, overlap, first_layer)
        return grad_accum * per_mb
    if zero == 0:
        reduce = all_reduce_time(gradient_bytes, n, link)
        return exposed_time(reduce, backward_s, zero0_overlap, all_reduce_time(bucket_bytes, n, link))
    scatter = reduce_scatter_time(gradient_bytes, n, link)
    last_bucket = reduce_scatter_time(bucket_bytes, n, link)
    if zero == 1:
        return exposed_time(scatter, backward_s, overlap, last_bucket) + exposed_time(gather_w, forward_s, overlap)
    if zero == 2:
        per_mb = exposed_time(scatter, backward_s, overlap, last_bucket)
        return grad_accum * per_mb + exposed_time(gather_w, forward_s, overlap)
    per_mb = exposed_time(gather_w, forward_s, overlap, first_layer)
    per_mb += exposed_time(gather_w + scatter, backward_s, overlap, last_bucket)
    return grad_accum * per_mb
