"""The planner plans without torch/ray/transformers; the runtime runs without ortools."""

import subprocess
import sys

BLOCK = "import sys\nfor name in {blocked!r}:\n    sys.modules[name] = None\n"

CONTRACT_MODULES = ["schema", "rules", "models", "workload", "strategy", "packing", "units", "versioned_json",
                    "trace_format", "data_rows", "hardware", "param_counts", "families"]


def _import_with_blocked(modules: list[str], blocked: list[str]) -> subprocess.CompletedProcess:
    code = BLOCK.format(blocked=blocked) + "".join(f"import {m}\n" for m in modules)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_every_planner_module_imports_without_torch_ray_transformers():
    code = ("import importlib, pkgutil, planner\n"
            "for m in pkgutil.walk_packages(planner.__path__, 'planner.'):\n    importlib.import_module(m.name)\n")
    result = subprocess.run([sys.executable, "-c", BLOCK.format(blocked=["torch", "ray", "transformers"]) + code],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_contract_imports_without_ortools():
    result = _import_with_blocked(["planner.contract." + m for m in CONTRACT_MODULES], ["ortools"])
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
