"""planner.analysis: compare/sweep tables agree with the plans they come from; infeasible points are rows;
longest sequences are the edge of fitting; fidelity tables follow the profiles and the results file."""

import json
import math
import subprocess
import sys
from dataclasses import replace

import pandas as pd
import pytest

from planner.analysis import (
    MEMORY_PARTS,
    MODULE_FIELDS,
    _largest,
    baseline_plans,
    binding_module,
    compare,
    layer_fidelity,
    load_fidelity_results,
    longest_sequence,
    sweep,
)
from planner.api import WorkloadInputs, evaluate, make_problem, max_seq, plan, with_max_seq_margin
from planner.search.baselines import best_of, zero3_family
from planner.profiles import PROFILES_DIR, load_profile
from planner.contract.schema import load_plan


@pytest.fixture(scope="module")
def plans():
    """Two fast plans: one colocated, one pinned disjoint."""
    return {
        "colocated": plan("qwen-vl-7b", 8, workload=WorkloadInputs(image_sizes=[(896, 896)])),
        "disjoint": plan("qwen-vl-7b", 8, workload=WorkloadInputs(image_sizes=[(896, 896)]), placement="disjoint"),
    }


def test_compare_has_one_row_per_plan_with_the_plans_numbers(plans):
    table = compare(plans)
    assert list(table.index) == ["colocated", "disjoint"]
    for label, p in plans.items():
        row = table.loc[label]
        assert row.placement == p.placement
        assert row.step_time_s == p.predicted.step_time_s
        assert row.tokens_per_s == p.predicted.tokens_per_s
        assert row.mfu == p.predicted.mfu
        assert row.peak_memory_gib == p.predicted.peak_memory_gib
        assert sum(row[f"{part}_gib"] for part in MEMORY_PARTS) == pytest.approx(p.predicted.peak_memory_gib)
        for m in p.modules:
            assert row[f"{m.name}_gpus"] == len(m.ranks)
            assert all(row[f"{m.name}_{f}"] == getattr(m, f) for f in MODULE_FIELDS)
        for name, b in p.baselines.items():
            expected = math.nan if b.speedup is None else b.speedup
            assert row[f"speedup_vs_{name}"] == pytest.approx(expected, nan_ok=True)


def test_compare_of_a_loaded_plan_file_is_the_same_row(plans, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text(plans["disjoint"].to_json())
    loaded, direct = compare([load_plan(path)]).iloc[0], compare([plans["disjoint"]]).iloc[0]
    assert loaded.to_dict() == pytest.approx(direct.to_dict(), nan_ok=True)


def test_compare_of_a_list_keeps_order(plans):
    table = compare(list(plans.values()))
    assert list(table.placement) == ["colocated", "disjoint"]


def test_speedup_vs_best_baseline_is_over_the_fastest_fitting_baseline(plans):
    row = compare([plans["colocated"]]).iloc[0]
    fitting = [b.speedup for b in plans["colocated"].baselines.values() if b.speedup is not None]
    assert row.speedup_vs_best_baseline == pytest.approx(min(fitting))


def test_binding_module_matches_the_cost_models_binding_sentence(plans):
    for p in plans.values():
        # "time: llm takes the most of the step; ..." / "pipeline: vision stage is the slowest ..."
        first_clause = p.predicted.binding_constraint.split(";")[0]
        assert binding_module(p) in first_clause.split()


def test_binding_module_of_a_colocated_plan_is_the_longest_module():
    p = plan("qwen-vl-7b", 8, workload=WorkloadInputs(image_sizes=[(3584, 3584)]), placement="colocated")
    row = compare([p]).iloc[0]
    longest = max(("vision", "llm"), key=lambda m: row[f"{m}_time_s"])
    assert row.binding_module == longest


def test_sweep_rows_match_direct_plans_and_infeasible_points_are_rows():
    table = sweep(["qwen-vl-7b", "qwen-vl-72b"], gpus=[8], image_sizes=[448])
    assert list(table.model) == ["qwen2.5-vl-7b", "qwen2.5-vl-72b"]
    ok, bad = table.iloc[0], table.iloc[1]
    direct = plan("qwen-vl-7b", 8, workload=WorkloadInputs(image_sizes=[(448, 448)]))
    assert ok.feasible and pd.isna(ok.reason)
    assert ok.step_time_s == pytest.approx(direct.predicted.step_time_s)
    assert ok.vision_tokens == 32 * 32 and ok.image == "448x448" and ok.global_batch == 32
    assert not bad.feasible
    assert bad.reason.startswith("no plan fits 8 x h100-80gb")
    assert math.isnan(bad.step_time_s)
    assert bad.vision_tokens == 32 * 32 and bad.num_gpus == 8


def test_sweep_covers_the_grid_in_order():
    table = sweep("qwen-vl-3b", gpus=[8, 16], global_batches=[16, 32], placements=["colocated", "disjoint"])
    assert len(table) == 2 * 2 * 2
    assert list(table.num_gpus) == [8] * 4 + [16] * 4
    assert list(table.global_batch) == [16, 16, 32, 32] * 2
    assert list(table.requested_placement) == ["colocated", "disjoint"] * 4
    fitting = table[table.feasible]
    assert (fitting.placement == fitting.requested_placement).all()


def test_sweep_gpu_types_change_the_device_and_its_sections_hold_at_every_point():
    table = sweep("qwen-vl-7b", gpus=[8], gpu_types=["h100", "h200"], workload=WorkloadInputs(text_tokens=100),
                  profile=None)
    assert list(table.gpu) == ["h100-80gb", "h200-141gb"]
    assert list(table.llm_tokens) == [2304 + 100] * 2


def test_sweep_baseline_rows_are_consistent_with_the_plans_speedups():
    table = sweep("qwen-vl-7b", gpus=[8], image_sizes=[896], baselines=True)
    rows = table.set_index("strategy")
    assert list(rows.index) == ["auto", "uniform_tp", "zero3", "megatron"]
    auto = rows.loc["auto"]
    for name in ("uniform_tp", "zero3", "megatron"):
        baseline = rows.loc[name]
        assert baseline.feasible and baseline.placement == "colocated"
        assert baseline[f"speedup_vs_{name}"] == pytest.approx(1.0)
        assert auto[f"speedup_vs_{name}"] == pytest.approx(baseline.step_time_s / auto.step_time_s)
        assert baseline.step_time_s >= auto.step_time_s * (1 - 1e-9)


def test_baseline_plans_give_a_reason_when_a_baseline_does_not_fit():
    outcomes = baseline_plans("qwen-vl-32b", 8, workload=WorkloadInputs(image_sizes=[(1344, 1344)]))
    assert isinstance(outcomes["zero3"], str) and "does not fit" in outcomes["zero3"]
    assert outcomes["uniform_tp"].solver.status == "EVALUATED"
    assert outcomes["uniform_tp"].placement == "colocated"
    assert {m.tp for m in outcomes["uniform_tp"].modules} == {outcomes["uniform_tp"].module("llm").tp}


def test_largest_finds_the_edge_of_a_monotone_predicate():
    assert _largest(lambda u: u <= 37, 1000) == 37
    assert _largest(lambda u: u <= 5000, 1000) == 1000
    assert _largest(lambda u: u <= 1, 1000) == 1
    assert _largest(lambda u: False, 1000) is None


def test_longest_sequence_of_a_baseline_is_the_edge_of_fitting_inside_the_margin():
    """A baseline's longest sequence is searched as ``--max-seq`` searches the planner's: in all but
    ``max_seq_memory_margin`` of the usable memory."""
    tokens = longest_sequence("qwen-vl-7b", 8, strategy="zero3")
    side = math.isqrt(tokens)
    assert side * side == tokens and side % 2 == 0
    problem = with_max_seq_margin(make_problem("qwen-vl-7b", 8))

    def fits(s):
        at = replace(problem, workload=replace(problem.workload, image_sizes=(), vision_tokens=s * s))
        return best_of(at, "zero3", zero3_family(at)).estimate is not None

    assert fits(side) and not fits(side + 2)


def test_longest_sequence_of_the_planner_is_max_seq():
    assert longest_sequence("qwen-vl-7b", 8) == max_seq("qwen-vl-7b", 8).workload.vision_tokens


def test_longest_sequence_rejects_an_unknown_strategy():
    with pytest.raises(ValueError, match="strategy must be one of"):
        longest_sequence("qwen-vl-7b", 8, strategy="pipeline")


def test_layer_fidelity_of_the_memory_profile():
    path = PROFILES_DIR / "fake" / "qwen2.5-vl-32b.json"
    profile = load_profile(path)
    table = layer_fidelity(path)
    assert len(table) == len(profile.memory)
    assert set(table.quantity) == {"activation_bytes"}
    first = profile.memory[0]
    row = table.iloc[0]
    assert (row.layer, row.tp, row.seq_len) == (first.layer, first.tp, first.seq_len)
    assert row.measured == first.saved_activation_bytes
    measured = table[table.measured > 0]
    assert (measured.error == measured.predicted / measured.measured - 1).all()
    blocks = table[table.layer == "decoder_layer"]
    assert (blocks.predicted > 0).all()


def test_layer_fidelity_of_the_cpu_profile_has_times_and_activations():
    path = PROFILES_DIR / "cpu" / "qwen2.5-vl-cpu-small.json"
    profile = load_profile(path)
    table = layer_fidelity(path, str(PROFILES_DIR.parent / "benchmarks" / "qwen2.5-vl-cpu-small"))
    times = table[table.quantity == "time_s"]
    assert len(times) == len(profile.layers)
    point = profile.layers[0]
    assert times.iloc[0].measured == pytest.approx(point.forward.median_s + point.backward.median_s)
    assert (times.predicted > 0).all()


def test_layer_fidelity_rejects_the_wrong_model():
    with pytest.raises(ValueError, match="measured qwen2.5-vl-32b, not qwen2.5-vl-7b"):
        layer_fidelity(PROFILES_DIR / "fake" / "qwen2.5-vl-32b.json", "qwen-vl-7b")


def test_load_fidelity_results_recomputes_the_error(tmp_path):
    path = tmp_path / "fidelity.json"
    rows = [{"name": "a", "strategy": "coloc", "predicted_s": 1.2, "measured_s": 1.0, "error": 0.0},
            {"name": "b", "strategy": "disj", "predicted_s": 0.9, "measured_s": 1.0}]
    path.write_text(json.dumps(rows))
    table = load_fidelity_results(path)
    assert list(table.name) == ["a", "b"]
    assert table.error.tolist() == pytest.approx([0.2, -0.1])


@pytest.mark.parametrize("content, message", [
    ("not json", "cannot read"),
    ("{}", "non-empty JSON list"),
    ('[{"name": "a", "predicted_s": 1.0}]', "lack measured_s"),
])
def test_load_fidelity_results_rejects_bad_files(tmp_path, content, message):
    path = tmp_path / "fidelity.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_fidelity_results(path)


def test_analysis_imports_without_torch_ray_transformers_or_ortools():
    blocked = ["torch", "ray", "transformers", "ortools"]
    code = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in blocked) + "import planner.analysis\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_strategy_of_a_plan_is_its_strategy():
    from planner.analysis import strategy_of

    p = plan("qwen-vl-7b", 8)
    again = evaluate("qwen-vl-7b", strategy_of(p), 8)
    assert again.predicted.step_time_s == p.predicted.step_time_s and again.modules == p.modules


def test_dataset_comparison_costs_fixed_shape_plans_on_the_dataset():
    from planner.analysis import dataset_comparison
    from planner.dataset import DatasetHistogram

    # mostly 448x448 thumbnails, a few 2688x2688 scans: a plan for the mean image packs micro-batches the scans break
    h = DatasetHistogram(source="test", text_tokens="given", skipped={},
                         shapes=((60, 200, ((448, 448),), ()), (4, 200, ((2688, 2688),), ())))
    table = dataset_comparison("qwen-vl-32b", 8, h)
    packed, mean, largest = table.iloc[0], table.iloc[2], table.iloc[3]
    assert packed.fits_heaviest_micro_batch and packed.promised_tokens_per_s == packed.dataset_tokens_per_s
    assert largest.fits_heaviest_micro_batch and largest.dataset_tokens_per_s < largest.promised_tokens_per_s
    assert mean.dataset_peak_memory_gib > table.attrs["usable_gib"] and not mean.fits_heaviest_micro_batch
    assert packed.dataset_tokens_per_s > largest.dataset_tokens_per_s
