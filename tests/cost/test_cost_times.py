"""The one definition of the pass-time terms (planner/cost/times.py) and the records that share it."""

from dataclasses import fields

import pytest

from planner.cost.layers import LayerTerms
from planner.cost.results import ModuleCost
from planner.cost.times import PASS_TIME_FIELDS, PassTimes
from planner.contract.schema import PASS_TIME_DOCS, ModuleTime


def test_every_term_is_documented_and_shared():
    assert set(PASS_TIME_FIELDS) == set(PASS_TIME_DOCS)
    for record in (LayerTerms, ModuleCost):
        assert set(PASS_TIME_FIELDS) <= {f.name for f in fields(record)}, record
    plan_fields = ModuleTime.model_fields
    for name in PASS_TIME_FIELDS:
        assert plan_fields[name.removesuffix("_s")].description == PASS_TIME_DOCS[name]


def test_sums_by_hand():
    a = PassTimes(forward_s=1.0, backward_s=2.0, tp_comm_s=0.5)
    b = PassTimes(forward_s=0.1, recompute_s=1.0, sp_comm_s=0.25, cp_comm_s=0.25)
    total = a.plus(b, 2)
    assert total.terms() == pytest.approx({"forward_s": 1.2, "backward_s": 2.0, "recompute_s": 2.0, "tp_comm_s": 0.5,
                                           "sp_comm_s": 0.5, "cp_comm_s": 0.5, "ep_comm_s": 0.0})
    assert total.collectives_s == pytest.approx(1.5) and total.total_s == pytest.approx(6.7)
    assert a.scaled(3).terms() == pytest.approx({**PassTimes().terms(), "forward_s": 3.0, "backward_s": 6.0,
                                                 "tp_comm_s": 1.5})
