"""The runtime runs without OR-Tools and reads only the Plan schema, the data-row formats (planner.data_rows, which
both halves parse datasets with), the packer (planner.packing: a dataset plan runs the packs it was priced
on), the shared validity rules (planner.rules) and unit constants (planner.units) from the planner, the model
families' config reading with the workload's resize (planner.families, planner.models, planner.param_counts,
planner.workload: a video plan's clips are laid out as the planner counted them), the trace format the predicted and
measured steps share (planner.trace_format), the cost model a sample's work per module comes from (planner.balance,
planner.cost, planner.strategy: a dataset plan's steps are assigned with the costs the plan was priced on; the cost
model is pure Python), and what the schema uses: the device description (planner.hardware), the reader of
versioned JSON files (planner.versioned_json) and the reader and writer of every file both halves use
(planner.file_io)."""

import subprocess
import sys

RUNTIME_MODULES = ["runtime.__main__", "runtime.launcher", "runtime.torchrun", "runtime.trainer", "runtime.metrics",
                   "runtime.checkpoint", "runtime.preflight", "runtime.driver"]


def test_runtime_imports_without_ortools_and_only_the_planner_parts_it_shares():
    code = (
        "import sys\nsys.modules['ortools'] = None\n"
        + "".join(f"import {m}\n" for m in RUNTIME_MODULES)
        + "print(sorted(m for m in sys.modules if m.startswith('planner')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    families = ["planner.families", "planner.families.fields", "planner.families.qwen2_5_vl",
                "planner.families.qwen2_audio", "planner.families.qwen2_vl", "planner.families.qwen3_vl",
                "planner.families.qwen3_vl_moe",
                "planner.families.qwen_parts", "planner.families.text_decoders"]
    cost = ["planner.cost"] + [f"planner.cost.{m}" for m in (
        "assumptions", "comm", "compute", "estimate", "host", "layer_costs", "layers", "memory", "module", "op_counts",
        "phases", "pipeline", "rank_cost", "results", "times", "validity")]
    assert result.stdout.strip() == str(["planner", "planner.balance", *cost, "planner.data_rows", *families,
                                         "planner.file_io", "planner.hardware", "planner.models", "planner.packing", "planner.param_counts",
                                         "planner.rules", "planner.schema", "planner.strategy", "planner.trace_format",
                                         "planner.units", "planner.versioned_json", "planner.workload"])
