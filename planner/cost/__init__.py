"""Analytical cost model: per-GPU memory and per-step time of a per-module parallel strategy.

Public API (the CP-SAT solver codes against it):

* ``module_cost(...) -> ModuleCost``: one module under one ``ModuleStrategy``.
* ``combine(...) -> Estimate``: per-module costs into a plan, by rules linear in per-module quantities.
* ``estimate(model, cluster, workload, strategy) -> Estimate``: validate, cost, combine.
* ``check_strategy(...) -> list[str]``: validity rules, one-line reasons.
* ``CostAssumptions`` / ``DEFAULT_ASSUMPTIONS``: every assumption, named and overridable.
* ``LayerCostSource``: the seam for measured per-layer costs.
* ``planner.cost.report``: ``prediction`` / ``module_predictions`` turn an Estimate into Plan schema records.
"""

from planner.cost.assumptions import DEFAULT_ASSUMPTIONS, BytesPerParam, CostAssumptions
from planner.cost.estimate import Estimate, MemoryBreakdown, ModuleCost, combine, estimate, module_cost
from planner.cost.layer_costs import LayerCostSource, LayerMeasurement
from planner.cost.validity import check_strategy

__all__ = [
    "DEFAULT_ASSUMPTIONS",
    "BytesPerParam",
    "CostAssumptions",
    "Estimate",
    "LayerCostSource",
    "LayerMeasurement",
    "MemoryBreakdown",
    "ModuleCost",
    "check_strategy",
    "combine",
    "estimate",
    "module_cost",
]
