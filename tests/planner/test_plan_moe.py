"""Expert parallelism in the planner's space: where it is offered, how it is pinned and refused, and how the plan
file carries it."""

import copy
import json
from dataclasses import replace

import pytest
from plan_helpers import problem

from planner.api import plan
from planner.catalog import CATALOG, model_from_hf_config
from planner.search.enumeration import module_strategies
from planner.contract.rules import expert_parallel_rule
from planner.contract.schema import SCHEMA_VERSION, load_plan
from planner.contract.strategy import ModuleStrategy

MOE = problem("qwen3-vl-moe-tiny", 4, overhead_gib=0.0)
SIXTEEN = problem("qwen3-vl-moe-tiny", 16, batch=16, overhead_gib=0.0)


def _degrees(p, module):
    series, _ = module_strategies(p, module, p.num_gpus, {}, {})
    return {s.ep for group in series for s in group}, {(s.dp * s.sp) % s.ep for group in series for s in group}


def test_ep_is_offered_to_modules_with_experts_only():
    """The LLM's 8 experts on 4 GPUs: ep 1, 2 or 4, each dividing dp * sp; the vision tower and a dense LLM: 1."""
    assert _degrees(MOE, "llm") == ({1, 2, 4}, {0})
    assert _degrees(MOE, "vision")[0] == {1}
    assert _degrees(problem("qwen3-vl-tiny", 4), "llm")[0] == {1}


@pytest.mark.parametrize(("fix", "message"), [
    ("llm.ep=3,llm.tp=1", r"no valid llm strategy: ep\*tp = 3\*1 = 3 does not divide the 8 experts of llm"),
    ("llm.ep=4,llm.tp=4", r"no valid llm strategy: ep\*tp = 4\*4 = 16 does not divide the 8 experts of llm"),
    ("vision.ep=2", "--fix vision.ep=2: vision of qwen3-vl-moe-tiny has no mixture-of-experts layers"),
])
def test_an_impossible_ep_pin_is_refused_in_one_line(fix, message):
    with pytest.raises(ValueError, match=message) as error:
        plan(SIXTEEN, fix=fix.split(","))
    assert "\n" not in str(error.value)


def test_the_rule_splits_experts_over_ep_times_tp_ranks():
    """An EP group is ep data ranks with all their tp ranks, holding whole experts: 8 experts go over ep=2 x tp=4 but
    not ep=2 x tp=8; tp alone splits them (ep=1, tp=2 is fine, tp=16 is not); a dense module takes any tp."""
    assert expert_parallel_rule(2, 4, 8, 1, 1, 8, "the LLM") is None
    assert expert_parallel_rule(2, 8, 8, 1, 1, 8, "the LLM") == (
        "ep*tp = 2*8 = 16 does not divide the 8 experts of the LLM (experts are split over an EP group's ep x tp "
        "ranks)")
    assert expert_parallel_rule(1, 2, 4, 1, 1, 8, "the LLM") is None
    assert expert_parallel_rule(1, 16, 1, 1, 1, 8, "the LLM").startswith("ep*tp = 1*16 = 16 does not divide")
    assert expert_parallel_rule(1, 16, 1, 1, 1, None, "the LLM") is None
    assert expert_parallel_rule(2, 1, 3, 1, 1, 8, "the LLM").startswith("ep=2 does not divide dp*cp*sp = 3*1*1 = 3")
    assert expert_parallel_rule(2, 1, 1, 1, 2, 8, "the LLM") is None  # the CP ranks hold different tokens
    assert expert_parallel_rule(4, 1, 1, 1, 2, 8, "the LLM").startswith("ep=4 does not divide dp*cp*sp = 1*2*1")


def test_the_space_keeps_ep_times_tp_dividing_the_experts():
    """The tiny LLM's 8 experts on 16 GPUs: every (tp, ep) offered has ep x tp dividing 8, and with tp=4 the data
    ranks' ep stops at 2 though dp*sp = 4 would allow 4."""
    series, _ = module_strategies(SIXTEEN, "llm", 16, {}, {})
    pairs = {(s.tp, s.ep) for group in series for s in group}
    assert all(8 % (ep * tp) == 0 for tp, ep in pairs)
    assert {ep for tp, ep in pairs if tp == 4} == {1, 2}


def test_a_tp_that_does_not_divide_the_experts_is_refused_with_its_reason():
    """6 experts: tp=4 cannot hold them whole even with ep=1, and a pinned tp=4 says so (not a generic refusal)."""
    config = copy.deepcopy(CATALOG["qwen3-vl-moe-tiny"].config)
    config["text_config"]["num_experts"] = 6
    six = replace(MOE, model=model_from_hf_config(config, "six-experts"))
    with pytest.raises(ValueError, match=r"ep\*tp = 1\*4 = 4 does not divide the 6 experts of llm"):
        plan(six, fix=["llm.tp=4"])


def test_the_plan_file_carries_ep_and_an_older_one_reads_as_ep_1(tmp_path):
    pinned = plan(MOE, fix=["llm.ep=2"])
    assert {m.name: m.ep for m in pinned.modules} == {"vision": 1, "llm": 2}
    assert pinned.schema_version == SCHEMA_VERSION == 9
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
    from planner.search.baselines import megatron_family

    moe = problem("qwen3-vl-moe-tiny", 8, batch=16)
    assert {s.modules["llm"].ep for s in megatron_family(moe)} == {1, 2, 4}
    assert all(s.modules["vision"].ep == 1 for s in megatron_family(moe))
    assert {s.modules["llm"].ep for s in megatron_family(problem("qwen3-vl-tiny", 8, batch=16))} == {1}


def test_the_balancing_loss_is_not_pipelined():
    """A config that trains with transformers' load-balancing loss (``output_router_logits``): its counts span every
    stage's layers, which the runtime does not exchange, so the planner offers no pipelined LLM and a pinned one is
    refused in one line (the same rule the runtime applies); without the loss PP is offered."""
    config = copy.deepcopy(dict(CATALOG["qwen3-vl-moe-tiny"].config))
    config["text_config"]["output_router_logits"] = True
    balanced = model_from_hf_config(config, "balanced")
    pipelined = lambda p: {s.pp for group in module_strategies(p, "llm", p.num_gpus, {}, {})[0] for s in group}
    assert pipelined(problem("qwen3-vl-moe-tiny", 4, allow_pp=True)) > {1}
    assert pipelined(replace(problem("qwen3-vl-moe-tiny", 4, allow_pp=True), model=balanced)) == {1}
    with pytest.raises(ValueError, match=r"pp=2: the load-balancing loss \(text_config.output_router_logits\) is "
                                         r"not run with a pipelined LLM") as error:
        plan(replace(problem("qwen3-vl-moe-tiny", 4, allow_pp=True), model=balanced), fix=["llm.pp=2"])
    assert "\n" not in str(error.value)
