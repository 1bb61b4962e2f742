"""check_strategy: one-line reasons for each broken rule, [] when valid."""

from cost_toys import toy_cluster, toy_model, toy_workload

from planner.cost import check_strategy
from planner.contract.rules import heads_rule
from planner.contract.strategy import ModuleStrategy
from planner.contract.workload import Workload

MODEL = toy_model()
CLUSTER = toy_cluster(8)
WORKLOAD = toy_workload(global_batch=8)


def check(module, **degrees):
    return check_strategy(MODEL, module, ModuleStrategy(**degrees), CLUSTER, WORKLOAD)


def test_valid_strategies():
    assert check("llm", dp=4, tp=2, micro_batch=2) == []
    assert check("llm", dp=2, tp=2, cp=2, micro_batch=4) == []
    assert check("vision", dp=2, sp=4, micro_batch=4) == []
    assert check("vision", dp=8) == []


def test_heads_rule():
    assert heads_rule(4, "tp", 8, 2, "x") is None  # KV heads replicated 2x
    assert heads_rule(3, "tp", 8, 2, "x").startswith("tp=3 does not divide the 8 attention heads")
    assert "neither divides nor is a multiple" in heads_rule(4, "tp", 12, 6, "x")


def test_tp_must_divide_heads():
    reasons = check_strategy(
        MODEL, "vision", ModuleStrategy(dp=1, tp=8, micro_batch=8), CLUSTER, WORKLOAD, allow_cross_node_tp=True
    )
    assert reasons == [
        "tp=8 does not divide the 4 attention heads of window_block",
        "tp=8 does not divide the 4 attention heads of full_block",
    ]


def test_tp_inside_node():
    reasons = check("llm", dp=1, tp=8, micro_batch=8)
    assert any("does not fit inside a node of 4 GPUs" in r for r in reasons)
    assert not check_strategy(
        MODEL, "llm", ModuleStrategy(dp=1, tp=8, micro_batch=8), CLUSTER, WORKLOAD, allow_cross_node_tp=True
    )


def test_global_batch_must_match():
    (reason,) = check("llm", dp=4, micro_batch=1)
    assert reason == "dp*micro_batch*grad_accum = 4*1*1 = 4 but the global batch is 8"


def test_too_many_gpus():
    reasons = check_strategy(MODEL, "llm", ModuleStrategy(dp=16), toy_cluster(8), toy_workload(16))
    assert reasons == ["pp*dp*cp*sp*tp = 16 GPUs but the cluster has 8"]


def test_the_vision_tower_splits_its_windows_over_cp_and_sp_together():
    """Vision CP runs (the gathered form); its cp x sp ranks each need an attention window of the micro-batch."""
    assert check("vision", dp=4, cp=2, micro_batch=2) == []
    assert check("vision", dp=1, cp=2, sp=2, grad_accum=8) == []  # 4 windows a micro-batch: one per rank
    (reason,) = check("vision", dp=1, cp=4, sp=2, grad_accum=8)
    assert "sp=8" in reason and "4 attention windows" in reason


def test_ulysses_divides_the_heads_of_a_tp_rank():
    heads = MODEL.module("llm").layer("decoder_layer").attention.num_heads
    assert check("llm", dp=4, sp=2, micro_batch=2) == []
    assert check("vision", dp=1, tp=2, sp=2, micro_batch=8) == []
    too_many = check("llm", dp=1, tp=2, sp=heads, micro_batch=8)
    assert any(f"sp={heads} does not divide the {heads // 2} attention heads per TP rank" in r for r in too_many)


def test_sp_needs_a_window_per_rank():
    one_window = Workload(image_sizes=((56, 56),), text_tokens=48, global_batch=2)  # 4x4 patches: 1 window
    reasons = check_strategy(MODEL, "vision", ModuleStrategy(dp=2, sp=2), CLUSTER, one_window)
    assert reasons == ["sp=2 but a micro-batch has only 1 attention windows; each SP rank needs at least one"]
    # two samples per micro-batch bring two windows
    assert check_strategy(MODEL, "vision", ModuleStrategy(dp=1, sp=2, micro_batch=2), CLUSTER, one_window) == []


def test_cp_needs_tokens():
    workload = Workload(text_tokens=2, global_batch=8)
    reasons = check_strategy(MODEL, "llm", ModuleStrategy(dp=2, cp=2, micro_batch=4), CLUSTER, workload)
    assert reasons == ["cp=2 needs at least 4 tokens per sample, got 2"]
