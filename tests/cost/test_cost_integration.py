"""The cost model on the real Qwen2.5-VL-32B catalog entry, 16 H100-80GB, and the import boundary."""

import subprocess
import sys
from dataclasses import replace

import pytest

from planner.catalog import get_model
from planner.cost import estimate
from planner.cost.assumptions import DEFAULT_ASSUMPTIONS
from planner.contract.hardware import Cluster, get_device
from planner.contract.strategy import ModuleStrategy, Strategy
from planner.contract.workload import Workload
from planner.contract.units import GIB

MODEL = get_model("qwen2.5-vl-32b")
CLUSTER = Cluster(device=get_device("h100-80gb"), num_devices=16, devices_per_node=8)
# 1344x1344 -> 9216 patches -> 2304 LLM tokens, + 1024 text tokens = 3328 LLM tokens per sample
WORKLOAD = Workload(image_sizes=((1344, 1344),), text_tokens=1024, global_batch=64)


def strategy(llm: ModuleStrategy, vision: ModuleStrategy | None = None, placement="colocated") -> Strategy:
    vision = vision or ModuleStrategy(
        dp=16, zero=3, recompute="full", grad_accum=llm.grad_accum, micro_batch=64 // (16 * llm.grad_accum)
    )
    return Strategy(placement=placement, modules={"vision": vision, "llm": llm})


def test_tp8_zero2_with_full_recompute_fits_and_is_sensible():
    e = estimate(
        MODEL,
        CLUSTER,
        WORKLOAD,
        strategy(ModuleStrategy(dp=2, tp=8, zero=2, recompute="full", micro_batch=8, grad_accum=4)),
    )
    assert e.fits, e.binding_constraint
    b = e.peak_breakdown
    assert b.total == b.weights + b.gradients + b.optimizer + b.activations + b.buffers + b.overhead
    # MFU of a dense 33B model on H100 is somewhere between 10% and 70%
    assert 0.1 < e.mfu < 0.7
    assert e.tokens_per_s == pytest.approx(64 * 3328 / e.step_time_s)
    assert set(e.modules) == {"vision", "llm"}


def test_tp_halves_llm_weight_memory():
    tp4 = estimate(
        MODEL, CLUSTER, WORKLOAD, strategy(ModuleStrategy(dp=4, tp=4, recompute="full", micro_batch=4, grad_accum=4))
    )
    tp8 = estimate(
        MODEL, CLUSTER, WORKLOAD, strategy(ModuleStrategy(dp=2, tp=8, recompute="full", micro_batch=8, grad_accum=4))
    )
    # 8 KV heads: both degrees split them, so the whole decoder halves (the final norm is negligible)
    assert tp8.modules["llm"].weights_bytes == pytest.approx(tp4.modules["llm"].weights_bytes / 2, rel=1e-4)
    # language model + lm_head = 32.76e9 params, 2 B each, over 4 ranks
    assert tp4.modules["llm"].weights_bytes == pytest.approx((31_985_308_672 + 778_567_680) * 2 / 4, rel=1e-3)


def test_plain_data_parallel_does_not_fit():
    e = estimate(MODEL, CLUSTER, WORKLOAD, strategy(ModuleStrategy(dp=16, micro_batch=1, grad_accum=4)))
    assert not e.fits
    assert e.binding_constraint.startswith("memory:")
    # 16 B/param of a 32.8B LLM alone is > 500 GB per GPU
    assert e.peak_breakdown.optimizer > 300 * GIB


def test_zero3_across_nodes_pays_for_inter_node_gathers():
    zero3 = estimate(
        MODEL, CLUSTER, WORKLOAD, strategy(ModuleStrategy(dp=16, zero=3, recompute="full", micro_batch=1, grad_accum=4))
    )
    assert zero3.modules["llm"].dp_comm_s > 1.0  # 64 GB of bf16 weights gathered twice per micro-batch over the NIC


def test_disjoint_placement_runs():
    disjoint = Strategy(
        placement="disjoint",
        modules={
            "vision": ModuleStrategy(dp=4, zero=1, micro_batch=1, grad_accum=16),
            "llm": ModuleStrategy(dp=2, tp=4, zero=1, recompute="full", micro_batch=2, grad_accum=16),
        },
    )
    e = estimate(MODEL, CLUSTER, WORKLOAD, disjoint)
    assert e.num_gpus == 12
    assert e.modules["vision"].in_flight_micro_batches == 2
    assert e.modules["vision"].handoff_s > 0
    assert set(e.memory_per_group) == {"vision", "llm"}


def test_cost_package_imports_without_heavy_dependencies():
    blocked = ("torch", "ray", "transformers", "ortools")
    code = f"import sys\nfor m in {blocked!r}:\n    sys.modules[m] = None\n"
    code += "import planner.cost\nimport planner.cost.report\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_modules_compute_scale_multiplies_its_compute_only_and_the_optimizer_scale_its_step():
    """``<module>_compute_scale`` (an adaptive run's per-module fit) doubles that module's forward, backward and
    recomputation and nothing else: its TP collectives, the other module, memory stay; ``optimizer_time_scale``
    doubles every module's optimizer step."""
    s = strategy(ModuleStrategy(dp=2, tp=8, zero=2, recompute="full", micro_batch=8, grad_accum=4))
    base = estimate(MODEL, CLUSTER, WORKLOAD, s)
    scaled = estimate(MODEL, CLUSTER, WORKLOAD, s, replace(DEFAULT_ASSUMPTIONS, llm_compute_scale=2.0,
                                                           optimizer_time_scale=2.0))
    llm, llm2 = base.modules["llm"], scaled.modules["llm"]
    for term in ("forward_s", "backward_s", "recompute_s"):
        assert getattr(llm2, term) == pytest.approx(2 * getattr(llm, term)) and getattr(llm, term) > 0
    assert llm2.tp_comm_s == llm.tp_comm_s > 0 and llm2.dp_comm_s == llm.dp_comm_s
    assert scaled.modules["vision"].forward_s == base.modules["vision"].forward_s
    for name in ("vision", "llm"):
        assert scaled.modules[name].optimizer_s == pytest.approx(2 * base.modules[name].optimizer_s)
    assert scaled.peak_memory_bytes == base.peak_memory_bytes


def test_a_modules_activation_memory_scale_multiplies_its_step_memory_only():
    """``<module>_activation_memory_scale`` (an adaptive run's memory fit) doubles that module's saved activations
    and its passes' and loss's buffers; its states and gradient bucket (sizes, not estimates), the other module and
    every time stay."""
    s = strategy(ModuleStrategy(dp=4, tp=4, zero=1, recompute="none", micro_batch=4, grad_accum=4))
    base = estimate(MODEL, CLUSTER, WORKLOAD, s)
    scaled = estimate(MODEL, CLUSTER, WORKLOAD, s, replace(DEFAULT_ASSUMPTIONS, llm_activation_memory_scale=2.0))
    llm, llm2 = base.modules["llm"], scaled.modules["llm"]
    assert llm2.activations_per_micro_batch_bytes == pytest.approx(2 * llm.activations_per_micro_batch_bytes, abs=1)
    assert llm.loss_backward_buffers_bytes > 0
    assert llm2.loss_backward_buffers_bytes == pytest.approx(2 * llm.loss_backward_buffers_bytes, abs=1)
    assert llm.forward_buffers_bytes > 0
    assert llm2.forward_buffers_bytes == pytest.approx(2 * llm.forward_buffers_bytes, abs=1)
    bucket = 2 * llm.backward_buffers_bytes - llm2.backward_buffers_bytes  # the gradient bucket, counted once
    assert bucket > 0
    for term in ("weights_bytes", "gradients_bytes", "optimizer_bytes"):
        assert getattr(llm2, term) == getattr(llm, term)
    assert scaled.modules["vision"] == base.modules["vision"] and scaled.step_time_s == base.step_time_s
    assert scaled.peak_memory_bytes > base.peak_memory_bytes
