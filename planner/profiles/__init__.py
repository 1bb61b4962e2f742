"""Measured profiles: the file schema, reading, interpolation, fits, calibration, and the cost source the planner
plugs in (one module each; everything is importable from here).

A profile is what ``python -m runtime.profile`` measured on one device type for one model: per-layer shard times
(forward, backward, recompute), memory and FLOPs over a grid of sequence lengths and micro-batch sizes, collective
times over message sizes, device microbenchmarks, FakeTensor memory breakdowns, and the efficiency parameters a
named cost-model assumptions a calibration refitted from measured runs. This package is pure Python (pydantic only) so the planner can read profiles
without torch.

The file conventions (units, ``seq_len``, ``includes_comm``) are in ``planner.profiles.schema``.
"""

from planner.profiles.calibration import (
    ADAPTED_ASSUMPTIONS,
    CALIBRATED_ASSUMPTIONS,
    MEASURED_ASSUMPTIONS,
    MEMORY_ASSUMPTIONS,
    STEP_TIME_ASSUMPTIONS,
    PhysicalRange,
    apply_calibration,
    describe_calibration,
    relative_rms,
)
from planner.profiles.cost_source import RECOMPUTED_KINDS, ProfileCostSource
from planner.profiles.files import (
    PROFILES_DIR,
    READABLE_SCHEMA_VERSIONS,
    find_profile,
    load_profile,
    profile_path,
    save_profile,
)
from planner.profiles.fits import LINK_FIT_OP, device_from_profile, fit_alpha_beta, link_from_collectives
from planner.profiles.index import LayerCost, ProfileIndex, pick_time
from planner.profiles.interpolation import EXTRAPOLATION_SLOPES, interp_collective, interp_grid, interp_loglog
from planner.profiles.schema import (
    COLLECTIVE_OPS,
    MAX_MEASURED_AMOUNT,
    MAX_MEASURED_SECONDS,
    PROFILE_SCHEMA_VERSION,
    CalibratedRun,
    Calibration,
    CollectiveOp,
    CollectivePoint,
    DeviceMeasurements,
    LayerPoint,
    MatmulPoint,
    MemoryPoint,
    Profile,
    Provenance,
    Spread,
    concurrency_slowdown,
)

__all__ = [
    "ADAPTED_ASSUMPTIONS", "CALIBRATED_ASSUMPTIONS", "COLLECTIVE_OPS", "EXTRAPOLATION_SLOPES", "LINK_FIT_OP", "MAX_MEASURED_AMOUNT",
    "MAX_MEASURED_SECONDS", "MEASURED_ASSUMPTIONS", "MEMORY_ASSUMPTIONS", "PROFILES_DIR", "PROFILE_SCHEMA_VERSION",
    "READABLE_SCHEMA_VERSIONS",
    "RECOMPUTED_KINDS", "STEP_TIME_ASSUMPTIONS", "CalibratedRun", "Calibration", "CollectiveOp", "CollectivePoint",
    "DeviceMeasurements", "LayerCost", "LayerPoint", "MatmulPoint", "MemoryPoint", "PhysicalRange", "Profile",
    "ProfileCostSource", "ProfileIndex", "Provenance", "Spread", "apply_calibration", "concurrency_slowdown",
    "describe_calibration", "device_from_profile", "find_profile", "fit_alpha_beta", "interp_collective", "interp_grid",
    "interp_loglog", "link_from_collectives", "load_profile", "pick_time", "profile_path", "relative_rms",
    "save_profile",
]
