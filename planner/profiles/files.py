"""Reading, writing and finding profile files (``profiles/<hardware>/<model>.json``)."""

from __future__ import annotations

from pathlib import Path

from planner.profiles.schema import PROFILE_SCHEMA_VERSION, Profile, check_measurements
from planner.contract.versioned_json import read_versioned, validated
from planner.contract.file_io import write_output

READABLE_SCHEMA_VERSIONS = (1, 2, 3, 4)
"""Versions ``load_profile`` reads: version 1 lacks ``LayerPoint.includes_comm`` (all its points are single-process
shards, the field's default), versions 1-2 lack ``LayerPoint.optimizer`` (None), versions 1-3 the host cost per
operator call (None) and hold a calibration of another form (a scale and an offset on the step time), which is
refused; older files are upgraded to the current version on the next save."""
PROFILES_DIR = Path(__file__).resolve().parents[2] / "profiles"


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile file (its schema, then ``check_measurements``); raise ValueError with a one-line
    reason if it cannot be used."""
    data = read_versioned(path, kind="profile", readable=READABLE_SCHEMA_VERSIONS, writer="python -m runtime.profile")
    version = data["schema_version"]
    if version < 4 and data.get("calibration") is not None:
        raise ValueError(f"profile {path} holds a calibration of schema version {version} (a step-time scale and "
                         "offset), which this tool no longer reads: set its \"calibration\" to null and re-run "
                         "`python -m planner.calibrate`")
    profile = validated(Profile, {**data, "schema_version": PROFILE_SCHEMA_VERSION}, path, kind="profile")
    check_measurements(profile, f"profile {path}")
    return profile


def save_profile(profile: Profile, path: str | Path) -> None:
    """Write a profile atomically (a partial file never replaces a good one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_output(path, profile.to_json(), flag="the profile")


def profile_path(device_name: str, model_name: str, root: Path = PROFILES_DIR) -> Path:
    """Where the profile of ``model_name`` on ``device_name`` lives: ``profiles/<hardware>/<model>.json``."""
    return root / device_name / f"{model_name}.json"


def find_profile(device_name: str, model_name: str, root: Path = PROFILES_DIR) -> Path | None:
    """The committed profile for this hardware and model, or None when there is none."""
    path = profile_path(device_name, model_name, root)
    return path if path.is_file() else None
