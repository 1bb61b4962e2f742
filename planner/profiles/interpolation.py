"""Interpolation over a profile's measured grid: log-log in size, bilinear over (sequence, micro-batch), linear
in message size."""

from __future__ import annotations

import bisect
import math
from typing import Sequence

EXTRAPOLATION_SLOPES = (1.0, 2.0)
"""Power-law exponents allowed when extrapolating beyond the measured sizes: a layer's work grows at least linearly
(GEMMs, norms) and at most quadratically (attention) in tokens and micro-batch; the measured end segment's slope,
which noise can make anything, is clamped to this range (downward only the upper bound applies)."""


def interp_loglog(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise power-law interpolation: linear in (log x, log y); beyond the ends, the end segment's exponent
    clamped to ``EXTRAPOLATION_SLOPES``.

    Exact for y = c * x**p inside the range (any p) and outside it for 1 <= p <= 2, which covers linear (MLP) and
    quadratic (attention) scaling; a mix is approximated segment by segment. A single point scales linearly.
    ``xs`` must be increasing and ``ys`` positive.
    """
    assert len(xs) == len(ys) and len(xs) >= 1, "need at least one point"
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], max(ys[i - 1], 1e-30), max(ys[i], 1e-30)
    slope = math.log(y1 / y0) / math.log(x1 / x0)
    lo, hi = EXTRAPOLATION_SLOPES
    if x > xs[-1]:
        return y1 * math.exp(min(max(slope, lo), hi) * math.log(x / x1))
    if x < xs[0]:
        slope = min(max(slope, 0.0), hi)
    return y0 * math.exp(slope * math.log(x / x0))


def interp_grid(points: dict[tuple[int, int], float], seq_len: float, micro_batch: float) -> float:
    """Interpolate a value measured on a (seq_len, micro_batch) grid: along seq_len at each measured micro-batch,
    then along micro-batch (both with ``interp_loglog``)."""
    by_mb: dict[int, list[tuple[int, float]]] = {}
    for (seq, mb), value in points.items():
        by_mb.setdefault(mb, []).append((seq, value))
    mbs = sorted(by_mb)
    at_seq = []
    for mb in mbs:
        row = sorted(by_mb[mb])
        at_seq.append(interp_loglog([s for s, _ in row], [v for _, v in row], seq_len))
    return interp_loglog(mbs, at_seq, micro_batch)


def interp_collective(sizes: Sequence[float], times: Sequence[float], message_bytes: float) -> float:
    """Collective time at ``message_bytes``: linear between measured sizes (the alpha-beta model is linear in size),
    flat at the smallest size below it (latency floor) and extrapolated with the last segment's bandwidth above."""
    if message_bytes <= sizes[0] or len(sizes) == 1:
        return times[0] if message_bytes <= sizes[0] else times[0] * message_bytes / sizes[0]
    i = min(bisect.bisect_left(sizes, message_bytes), len(sizes) - 1)
    x0, x1, y0, y1 = sizes[i - 1], sizes[i], times[i - 1], times[i]
    return y0 + (y1 - y0) * (message_bytes - x0) / (x1 - x0)
