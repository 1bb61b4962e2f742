"""Calibration refit from measured runs: ``measured = scale * predicted + overhead``."""

from __future__ import annotations

import math
from typing import Sequence

from planner.profiles.schema import Calibration

def fit_scale_overhead(predicted: Sequence[float], measured: Sequence[float]) -> tuple[float, float]:
    """Least squares of measured = scale * predicted + overhead (ordinary least squares, closed form).

    With a single distinct prediction the overhead is not identifiable; then overhead = 0 and
    scale = sum(m*p) / sum(p*p).
    """
    n = len(predicted)
    assert n == len(measured) and n >= 1, "need matching, non-empty samples"
    mp, mm = sum(predicted) / n, sum(measured) / n
    sxx = sum((p - mp) ** 2 for p in predicted)
    if sxx <= 1e-12 * max(mp * mp, 1e-30):
        return sum(m * p for p, m in zip(predicted, measured)) / sum(p * p for p in predicted), 0.0
    scale = sum((p - mp) * (m - mm) for p, m in zip(predicted, measured)) / sxx
    return scale, mm - scale * mp


def relative_rms(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Root-mean-square of (predicted - measured) / measured."""
    return math.sqrt(sum(((p - m) / m) ** 2 for p, m in zip(predicted, measured)) / len(measured))


def refit_calibration(predicted: Sequence[float], measured: Sequence[float], *, sources: Sequence[str]) -> Calibration:
    """Refit scale/overhead from (predicted, measured) step times.

    ``predicted`` are the RAW predictions (before any calibration). A non-positive fitted scale (noise on near-identical predictions) falls back
    to the scale-only fit.
    """
    scale, overhead = fit_scale_overhead(predicted, measured)
    if scale <= 0:
        scale, overhead = sum(m * p for p, m in zip(predicted, measured)) / sum(p * p for p in predicted), 0.0
    after = [scale * p + overhead for p in predicted]
    return Calibration(
        scale=scale,
        overhead_s=overhead,
        num_samples=len(predicted),
        rms_error_before=relative_rms(predicted, measured),
        rms_error_after=relative_rms(after, measured),
        sources=list(sources),
    )


def calibrate(step_time_s: float, calibration: Calibration | None) -> float:
    """A raw predicted step time with the calibration applied."""
    if calibration is None:
        return step_time_s
    return calibration.scale * step_time_s + calibration.overhead_s
