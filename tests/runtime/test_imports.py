"""The runtime runs without OR-Tools and reads only the Plan schema, the data-row formats (planner.data_rows, which
both halves parse datasets with), the packer (planner.packing: a dataset plan runs the packs it was priced
on), the shared validity rules (planner.rules) and unit constants (planner.units) from the planner, and what the schema
uses: the device description (planner.hardware) and the reader of versioned JSON files (planner.versioned_json)."""

import subprocess
import sys

RUNTIME_MODULES = ["runtime.__main__", "runtime.launcher", "runtime.torchrun", "runtime.trainer", "runtime.metrics",
                   "runtime.checkpoint", "runtime.preflight", "runtime.driver"]


def test_runtime_imports_without_ortools_and_only_the_plan_schema_data_rows_packer_rules_and_units():
    code = (
        "import sys\nsys.modules['ortools'] = None\n"
        + "".join(f"import {m}\n" for m in RUNTIME_MODULES)
        + "print(sorted(m for m in sys.modules if m.startswith('planner')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(["planner", "planner.data_rows", "planner.hardware", "planner.packing", "planner.rules",
                                         "planner.schema", "planner.units", "planner.versioned_json"])
