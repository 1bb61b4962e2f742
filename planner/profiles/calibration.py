"""Which cost-model assumptions a calibration may refit from measured runs, within what physical ranges, and how a
profile's calibration is applied (the fit itself is ``runtime.profile.calibrate``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from planner.cost.assumptions import CostAssumptions
from planner.contract.units import GIB
from planner.profiles.schema import Calibration


@dataclass(kw_only=True, frozen=True)
class PhysicalRange:
    """The values a refitted assumption may take."""

    low: float
    high: float
    why: str
    """Where the range comes from."""
    prior_width: float | None
    """How far from its default the value plausibly lies (one standard deviation of the fit's prior, in its units);
    None: a share of the runs' median measured step (for a time only meaningful relative to the step)."""


STEP_TIME_ASSUMPTIONS: dict[str, PhysicalRange] = {
    "max_matmul_efficiency": PhysicalRange(low=0.2, high=0.95, prior_width=0.15, why="assumed: a large bf16 GEMM reaches well over "
                                           "half of peak, below 20 % a kernel is misconfigured, not inefficient"),
    "flash_attention_efficiency": PhysicalRange(low=0.1, high=0.9, prior_width=0.15, why="FlashAttention-2 reaches 50-73 % of A100 "
                                                "peak (Dao 2023, abstract)"),
    "mem_efficient_attention_efficiency": PhysicalRange(low=0.1, high=0.9, prior_width=0.15, why="as flash attention"),
    "eager_attention_efficiency": PhysicalRange(low=0.1, high=0.95, prior_width=0.15, why="two batched GEMMs, as matmuls"),
    "intra_node_bus_efficiency": PhysicalRange(low=0.2, high=1.0, prior_width=0.2, why="a collective cannot beat the link; assumed "
                                               "no worse than a fifth of it"),
    "inter_node_bus_efficiency": PhysicalRange(low=0.2, high=1.0, prior_width=0.2, why="as intra-node, over the NIC"),
    "host_seconds_per_op": PhysicalRange(low=0.5e-6, high=50e-6, prior_width=5e-6, why="eager dispatch of one call: about a "
                                         "microsecond in C++ to tens in Python-heavy paths"),
    "step_overhead_s": PhysicalRange(low=0.0, high=60.0, prior_width=None, why="the loop's own work per step, not negative"),
    "measured_time_scale": PhysicalRange(low=0.5, high=2.0, prior_width=0.25, why="a layer inside a step runs at most twice as slow (or "
                                         "fast) as timed alone; beyond that the profile is of another machine"),
}
"""Assumptions fitted to measured step times, and their physical ranges."""

MEMORY_ASSUMPTIONS: dict[str, PhysicalRange] = {
    "framework_overhead_bytes": PhysicalRange(low=0.0, high=32 * GIB, prior_width=None, why="CUDA context, workspaces and "
                                              "communicator buffers: 0.5-5 GiB in practice"),
}
"""Assumptions fitted to measured peak memory."""

MEASURED_ASSUMPTIONS: dict[str, PhysicalRange] = {
    "moe_load_imbalance": PhysicalRange(low=1.0, high=256.0, prior_width=None, why="the busiest EP rank's routed "
                                        "tokens over the mean: 1 is perfect balance, the EP group's size (every "
                                        "token on one rank) the most; the runtime measures it every step"),
}
"""Assumptions the runs measure directly (their metrics' median), set before the step-time fit."""

_COMPUTE_SCALE = PhysicalRange(low=0.05, high=20.0, prior_width=None, why="a module's measured passes within 20x "
                               "of its modelled compute either way; beyond that the model is of another machine")
ADAPTED_ASSUMPTIONS: dict[str, PhysicalRange] = {
    "vision_compute_scale": _COMPUTE_SCALE,
    "audio_compute_scale": _COMPUTE_SCALE,
    "llm_compute_scale": _COMPUTE_SCALE,
    "optimizer_time_scale": PhysicalRange(low=0.05, high=20.0, prior_width=None, why="as a module's compute"),
    **{f"{module}_activation_memory_scale": PhysicalRange(
        low=1.0, high=8.0, prior_width=None, why="only ever raised: a run that measured less than the model predicts "
        "keeps the model's margin; within 8x, the step memory of a module modelled at all")
       for module in ("vision", "audio", "llm")},
}
"""Assumptions an adaptive run fits per module and per term from its own measured spans (``planner.adapt``)."""

CALIBRATED_ASSUMPTIONS = {**STEP_TIME_ASSUMPTIONS, **MEMORY_ASSUMPTIONS, **MEASURED_ASSUMPTIONS, **ADAPTED_ASSUMPTIONS}


def apply_calibration(assumptions: CostAssumptions, calibration: Calibration | None) -> CostAssumptions:
    """``assumptions`` with a profile calibration's fitted values (unchanged without one).

    Raises:
        ValueError: a value of an assumption calibration does not fit, or outside its physical range (one line).
    """
    if calibration is None or not calibration.values:
        return assumptions
    for name, value in calibration.values.items():
        known = CALIBRATED_ASSUMPTIONS.get(name)
        if known is None:
            raise ValueError(f"the profile's calibration sets {name!r}, which is not one of the calibrated "
                             f"assumptions ({', '.join(CALIBRATED_ASSUMPTIONS)}): re-run --calibrate")
        if not known.low <= value <= known.high:
            raise ValueError(f"the profile's calibration sets {name} = {value:g}, outside its physical range "
                             f"{known.low:g}..{known.high:g}: re-run --calibrate")
    return with_values(assumptions, calibration.values)


def with_values(assumptions: CostAssumptions, values: dict[str, float]) -> CostAssumptions:
    """``assumptions`` with some fields set (integer fields rounded, as a fit returns floats)."""
    return replace(assumptions, **{k: (int(v) if isinstance(getattr(assumptions, k), int) else v)
                                   for k, v in values.items()})


def describe_calibration(calibration: Calibration) -> str:
    """One line: how many runs, when, the error before and after, and the fitted values."""
    values = ", ".join(f"{k}={v:.3g}" for k, v in sorted(calibration.values.items()))
    if calibration.rms_error_before is None:
        return f"fitted to a run's measured memory on {calibration.date[:10]}: {values}"
    loo = "" if calibration.leave_one_out_rms is None else f", leave-one-out {calibration.leave_one_out_rms:.1%}"
    return (f"fitted to {len(calibration.runs)} measured run(s) on {calibration.date[:10]} (RMS error "
            f"{calibration.rms_error_before:.1%} -> {calibration.rms_error_after:.1%}{loo}): {values}")


def relative_rms(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Root-mean-square of (predicted - measured) / measured."""
    return math.sqrt(sum(((p - m) / m) ** 2 for p, m in zip(predicted, measured)) / len(measured))
