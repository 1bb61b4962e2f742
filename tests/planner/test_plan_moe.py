"""Expert parallelism in the planner's space: where it is offered, how it is pinned and refused, and how the plan
file carries it."""

import json

import pytest
from plan_helpers import problem

from planner.api import plan
from planner.enumeration import module_strategies
from planner.schema import SCHEMA_VERSION, load_plan
from planner.strategy import ModuleStrategy

MOE = problem("qwen3-vl-moe-tiny", 4, overhead_gib=0.0)


def _degrees(p, module):
    series, _ = module_strategies(p, module, p.num_gpus, {}, {})
    return {s.ep for group in series for s in group}, {(s.dp * s.sp) % s.ep for group in series for s in group}


def test_ep_is_offered_to_modules_with_experts_only():
    """The LLM's 8 experts on 4 GPUs: ep 1, 2 or 4, each dividing dp * sp; the vision tower and a dense LLM: 1."""
    assert _degrees(MOE, "llm") == ({1, 2, 4}, {0})
    assert _degrees(MOE, "vision")[0] == {1}
    assert _degrees(problem("qwen3-vl-tiny", 4), "llm")[0] == {1}


@pytest.mark.parametrize(("fix", "message"), [
    ("llm.ep=3", "no valid llm strategy: ep=3 does not divide the 8 experts of llm"),
    ("vision.ep=2", "--fix vision.ep=2: vision of qwen3-vl-moe-tiny has no mixture-of-experts layers"),
])
def test_an_impossible_ep_pin_is_refused_in_one_line(fix, message):
    with pytest.raises(ValueError, match=message) as error:
        plan(MOE, fix=[fix])
    assert "\n" not in str(error.value)


def test_the_plan_file_carries_ep_and_an_older_one_reads_as_ep_1(tmp_path):
    pinned = plan(MOE, fix=["llm.ep=2"])
    assert {m.name: m.ep for m in pinned.modules} == {"vision": 1, "llm": 2}
    assert pinned.schema_version == SCHEMA_VERSION == 6
    document = json.loads(pinned.model_dump_json())
    document["schema_version"] = 5
    for module in document["modules"]:
        del module["ep"]
        del module["predicted"]["time_s"]["ep_comm"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(document))
    assert {m.ep for m in load_plan(path).modules} == {1}


def test_describe_shows_ep_only_when_experts_are_split():
    assert ModuleStrategy(dp=4, ep=4).describe() == "DP4-TP1-SP1-CP1-EP4 ZeRO0 rc=none mb=1 ga=1"
    assert ModuleStrategy(dp=4).describe() == "DP4-TP1-SP1-CP1 ZeRO0 rc=none mb=1 ga=1"


def test_the_megatron_baseline_searches_ep_for_experts():
    """Megatron-style TP x EP x PP: the LLM's experts over EP ranks of each stage's DP group; 1 for a dense LLM."""
    from planner.baselines import megatron_family

    moe = problem("qwen3-vl-moe-tiny", 8, batch=16)
    assert {s.modules["llm"].ep for s in megatron_family(moe)} == {1, 2, 4}
    assert all(s.modules["vision"].ep == 1 for s in megatron_family(moe))
    assert {s.modules["llm"].ep for s in megatron_family(problem("qwen3-vl-tiny", 8, batch=16))} == {1}
