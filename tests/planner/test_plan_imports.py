"""Import hygiene: ``import planner`` is free and only solving loads OR-Tools (that no planner module needs
torch/ray/transformers: tests/test_import_boundaries.py, tests/test_architecture.py)."""

import subprocess
import sys

BLOCK_HEAVY = "import sys\nfor name in ('torch', 'ray', 'transformers'):\n    sys.modules[name] = None\n"


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_import_planner_pulls_in_nothing_heavy():
    result = _python("import sys, planner\n"
                     "print(sorted(m for m in ('ortools', 'pydantic', 'torch', 'ray', 'transformers', 'planner.api')"
                     " if m in sys.modules))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_lazy_exports_resolve():
    result = _python("import planner\nprint(planner.plan.__module__, planner.load_plan.__module__)")
    assert result.stdout.split() == ["planner.api", "planner.contract.schema"]


def test_api_and_cli_load_ortools_only_when_solving():
    result = _python("import sys, planner.api, planner.cli\nprint('ortools' in sys.modules)")
    assert result.stdout.strip() == "False"


def test_whole_plan_command_runs_with_torch_ray_transformers_blocked(tmp_path):
    code = BLOCK_HEAVY + (f"from planner.cli import main\nmain(['--model', 'qwen2.5-vl-tiny', '--gpu', 'cpu', "
                          f"'--gpus', '2', '--out', {str(tmp_path / 'p.json')!r}])")
    result = _python(code)
    assert result.returncode == 0, result.stderr
