"""The runtime's entry points import without OR-Tools. What of the planner the runtime may read (the contract, and
the cost model where it runs) is pinned by tests/test_architecture.py."""

import subprocess
import sys

RUNTIME_MODULES = ["runtime.__main__", "runtime.launch.launcher", "runtime.launch.torchrun", "runtime.training.trainer",
                   "runtime.observability.metrics", "runtime.checkpoints.hf_folder", "runtime.run.preflight",
                   "runtime.launch.driver", "runtime.export", "runtime.dry_run"]


def test_runtime_imports_without_ortools():
    code = "import sys\nsys.modules['ortools'] = None\n" + "".join(f"import {m}\n" for m in RUNTIME_MODULES)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
