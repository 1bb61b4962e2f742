"""The runtime runs without OR-Tools and reads only the Plan schema, the data-row formats (planner.contract.data_rows, which
both halves parse datasets with), the packer (planner.contract.packing: a dataset plan runs the packs it was priced
on), the shared validity rules (planner.contract.rules) and unit constants (planner.contract.units) from the planner, the model
families' config reading with the workload's resize (planner.contract.families, planner.contract.models, planner.contract.param_counts,
planner.contract.workload: a video plan's clips are laid out as the planner counted them), the trace format the predicted and
measured steps share (planner.contract.trace_format), the cost model a sample's work per module comes from (planner.cost.balance,
planner.cost, planner.contract.strategy: a dataset plan's steps are assigned with the costs the plan was priced on; the cost
model is pure Python), and what the schema uses: the device description (planner.contract.hardware) and the reader of
versioned JSON files (planner.contract.versioned_json)."""

import subprocess
import sys

RUNTIME_MODULES = ["runtime.__main__", "runtime.launch.launcher", "runtime.launch.torchrun", "runtime.training.trainer", "runtime.observability.metrics",
                   "runtime.checkpoints.hf_folder", "runtime.run.preflight", "runtime.launch.driver"]


def test_runtime_imports_without_ortools_and_only_the_planner_parts_it_shares():
    code = (
        "import sys\nsys.modules['ortools'] = None\n"
        + "".join(f"import {m}\n" for m in RUNTIME_MODULES)
        + "print(sorted(m for m in sys.modules if m.startswith('planner')))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    families = ["planner.contract.families", "planner.contract.families.fields", "planner.contract.families.qwen2_5_vl",
                "planner.contract.families.qwen2_audio", "planner.contract.families.qwen2_vl", "planner.contract.families.qwen3_vl",
                "planner.contract.families.qwen3_vl_moe",
                "planner.contract.families.qwen_parts", "planner.contract.families.text_decoders"]
    cost = ["planner.cost"] + [f"planner.cost.{m}" for m in (
        "assumptions", "comm", "compute", "estimate", "host", "layer_costs", "layers", "memory", "module", "op_counts",
        "phases", "pipeline", "rank_cost", "results", "times", "validity")]
    assert result.stdout.strip() == str(["planner", "planner.cost.balance", *cost, "planner.contract.data_rows", *families,
                                         "planner.contract.hardware", "planner.contract.models", "planner.contract.packing", "planner.contract.param_counts",
                                         "planner.contract.rules", "planner.contract.schema", "planner.contract.strategy", "planner.contract.trace_format",
                                         "planner.contract.units", "planner.contract.versioned_json", "planner.contract.workload"])
