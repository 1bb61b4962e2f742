"""Cost results convert into the Plan schema's prediction records."""

import pytest
from cost_toys import colocated, toy_cluster, toy_model, toy_workload

from planner.cost import estimate
from planner.cost.report import module_predictions, prediction
from planner.contract.strategy import ModuleStrategy, Strategy
from planner.contract.units import GIB

MODEL, CLUSTER, WORKLOAD = toy_model(), toy_cluster(8), toy_workload(8)


def test_prediction_in_gib_matches_estimate():
    e = estimate(MODEL, CLUSTER, WORKLOAD, colocated(ModuleStrategy(dp=8), ModuleStrategy(dp=8)))
    p = prediction(e)
    assert p.peak_memory_gib == pytest.approx(e.peak_memory_bytes / GIB)
    assert p.memory_breakdown_gib.total == pytest.approx(p.peak_memory_gib)
    assert p.step_time_s == e.step_time_s and p.binding_constraint == e.binding_constraint
    modules = module_predictions(e)
    llm = modules["llm"]
    assert llm.time_s.per_micro_batch == e.modules["llm"].per_micro_batch_s
    assert llm.memory_gib.overhead == 0  # colocated: the module's own share
    assert llm.sources["decoder_layer.time"] == "analytical"


def test_disjoint_module_memory_is_its_group():
    strategy = Strategy(
        placement="disjoint",
        modules={"vision": ModuleStrategy(dp=2, grad_accum=4), "llm": ModuleStrategy(dp=2, tp=2, grad_accum=4)},
    )
    e = estimate(MODEL, CLUSTER, WORKLOAD, strategy)
    vision = module_predictions(e)["vision"]
    assert vision.memory_gib.total == pytest.approx(e.memory_per_group["vision"].total / GIB)
