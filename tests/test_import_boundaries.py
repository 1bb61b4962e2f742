"""The planner plans without torch/ray/transformers; the runtime runs without ortools."""

import subprocess
import sys

import pytest

BLOCK = "import sys\nfor name in {blocked!r}:\n    sys.modules[name] = None\n"


def _import_with_blocked(modules: list[str], blocked: list[str]) -> subprocess.CompletedProcess:
    code = BLOCK.format(blocked=blocked) + "".join(f"import {m}\n" for m in modules)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


PLANNER_MODULES = [
    "planner",
    "planner.schema",
    "planner.models",
    "planner.workload",
    "planner.strategy",
    "planner.hardware",
    "planner.catalog",
    "planner.cost",
    "planner.profiles",
    "planner.dataset",
    "planner.packing",
    "planner.data_rows",
    "planner.rules",
    "planner.units",
    "planner.versioned_json",
    "planner.problem",
    "planner.search",
    "planner.plan_document",
    "planner.trace",
    "planner.trace_format",
    "planner.arguments",
    "planner.profiles.calibrate",
    "planner.profiles.compare",
]


@pytest.mark.parametrize("module", PLANNER_MODULES)
def test_planner_imports_without_torch_ray_transformers(module):
    result = _import_with_blocked([module], ["torch", "ray", "transformers"])
    assert result.returncode == 0, result.stderr


def test_plan_schema_imports_without_ortools():
    result = _import_with_blocked(["planner.schema"], ["ortools"])
    assert result.returncode == 0, result.stderr


def test_calibration_and_the_profiler_reach_the_planner_through_its_api_not_its_cli():
    """planner/profiles and runtime/profile plan through ``planner.api`` / ``planner.arguments``, never by running the
    ``plan`` command (``planner.cli``) with swapped streams."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sources = [*(root / "planner" / "profiles").glob("*.py"), *(root / "runtime" / "profile").glob("*.py")]
    assert sources
    offenders = [str(p.relative_to(root)) for p in sources
                 if "planner.cli" in p.read_text() or "from planner import cli" in p.read_text()]
    assert not offenders
