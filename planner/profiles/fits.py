"""The device entry a profile implies: alpha-beta link fits and the measured matmul peak."""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from planner.contract.hardware import DeviceSpec, check_plausible
from planner.profiles.index import pick_time
from planner.profiles.schema import Profile

def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float]) -> tuple[float, float]:
    """Fit of t = alpha + bytes / beta (Hockney's alpha-beta model, Hockney 1994, eq. 1) minimising the RELATIVE
    error sum(((alpha + b/beta) - t) / t)^2, so small latency-bound messages weigh as much as large ones
    (weighted least squares, weights 1/t^2, closed form).

    Returns (alpha seconds, beta bytes/s); alpha is clipped at 0.
    """
    assert len(sizes) >= 2, "need two message sizes to fit alpha and beta"
    w = [1.0 / (t * t) for t in times]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, sizes)) / sw
    my = sum(wi * y for wi, y in zip(w, times)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, sizes))
    slope = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, sizes, times)) / sxx
    return max(my - slope * mx, 0.0), 1.0 / slope


LINK_FIT_OP = "all_reduce"
"""The collective whose measured curve sets the link model: the one TP and DP put on the critical path."""


def link_from_collectives(profile: Profile, bus_efficiency: float) -> tuple[float, float] | None:
    """(latency alpha, device bandwidth) such that the cost model's ring all-reduce over 2 devices,
    ``B / (bandwidth * bus_efficiency) + 2 alpha`` (Thakur et al. 2005, Sec. 4.4 with n = 2), fits the measured
    2-device all-reduce curve; else the send/recv curve (``B / bw + alpha``); None without either."""
    for op, latency_terms in ((LINK_FIT_OP, 2), ("send_recv", 1)):
        curve = sorted((c.message_bytes, pick_time(c.time, profile.time_statistic)) for c in profile.collectives
                       if c.op == op and c.group_size == 2)
        if len(curve) >= 2:
            alpha, beta = fit_alpha_beta([b for b, _ in curve], [t for _, t in curve])
            return alpha / latency_terms, beta / bus_efficiency
    return None


def device_from_profile(base: DeviceSpec, profile: Profile, *, intra_node_bus_efficiency: float = 0.8) -> DeviceSpec:
    """``base`` with the numbers the profile measured: matmul peak, memory bandwidth and the link model fitted to
    the measured collectives (``link_from_collectives``; ``intra_node_bus_efficiency`` must be the cost model's,
    CostAssumptions' default 0.8, so that it reproduces the measured curve).

    Fields the profile did not measure keep the catalog's value; ``source`` names the profile. A fitted number
    outside ``PLAUSIBLE_RANGES`` (a collective curve that falls with the message size) is a one-line ValueError.
    """
    changes: dict[str, float | str] = {}
    if profile.device is not None:
        changes["peak_bf16_flops"] = profile.device.peak_matmul_flops
        changes["memory_bandwidth"] = profile.device.memory_bandwidth
    fitted = link_from_collectives(profile, intra_node_bus_efficiency)
    if fitted is not None:
        changes["intra_node_latency"], changes["intra_node_bandwidth"] = fitted
    if not changes:
        return base
    for field, value in changes.items():
        check_plausible(field, value, f"the device profile {profile.hardware}/{profile.model} implies")
    changes["source"] = f"measured: profile {profile.hardware}/{profile.model} ({profile.provenance.date})"
    return replace(base, **changes)
