"""The runtime on Ray (gloo, CPU, fp32) against the unmodified single-process transformers model.

Same tiny Qwen2.5-VL (4 vision blocks: 2 window, 2 full attention, merger; 4 decoder layers), same seed, same
samples. Checked: the loss of 3 steps, every gradient after step 1 (after global-norm clipping), every parameter
after step 3.

Tolerances, and why they are not zero: the runtime sums the same fp32 numbers in a different order (TP splits
matmul reductions and all-reduces partial sums; SP computes gradients per shard and sums them; DP/ZeRO sums
per-replica gradients; micro-batching sums per-micro-batch losses). Each reorder changes results by a few fp32
ulps, so:
- loss: relative 1e-5 (observed <= 1e-7);
- gradients: per tensor, max |g - g_ref| <= 1e-5 * max |g_ref| (observed <= 2e-6 relative);
- parameters after 3 AdamW steps: max |p - p_ref| <= 0.1 * lr (observed <= 3e-5 with lr = 1e-3). Adam divides
  each gradient by its own magnitude, so an element whose gradient is near the fp32 noise floor (e.g. key
  biases, whose exact gradient is zero) moves by a noise-directed fraction of lr; a tenth of one step is far
  below what a wrong gradient (a whole step in the wrong direction) produces.
"""

from __future__ import annotations

import pytest
import torch

from runtime import launcher
from runtime.trainer import RunOptions
from tests.runtime.plans import make_plan, tiny_hf_config
from tests.runtime.reference import reference_run

STEPS = 3
SEED = 0
LR = 1e-3

PLANS = {
    "vision_sp2__llm_tp2": dict(vision=dict(sp=2), llm=dict(tp=2)),
    "uniform_tp2": dict(vision=dict(tp=2), llm=dict(tp=2)),
    "zero3_dp2": dict(vision=dict(dp=2, zero=3), llm=dict(dp=2, zero=3)),
    "vision_dp2__llm_tp2": dict(vision=dict(dp=2), llm=dict(tp=2, micro_batch=2)),
    "disjoint_1_1__2_micro_batches": dict(vision=dict(grad_accum=2), llm=dict(grad_accum=2), placement="disjoint"),
    "recompute_full_vision__selective_llm": dict(
        vision=dict(dp=2, zero=1, recompute="full"), llm=dict(tp=2, micro_batch=2, recompute="selective")
    ),
    # LLM Ulysses SP. 9 text tokens: a 33-token sequence, slices of 17 and 16 that split the 24 image tokens
    "vision_sp2__llm_sp2_selective__uneven_slices": dict(
        vision=dict(sp=2), llm=dict(sp=2, recompute="selective"), text_tokens=9
    ),
    # 1 local KV head per TP rank, repeated to 2 for the exchange; 64 tokens: slice 2 holds no image token
    "vision_dp2xtp2__llm_tp2xsp2_zero1_full": dict(
        vision=dict(dp=2, tp=2), llm=dict(tp=2, sp=2, micro_batch=2, zero=1, recompute="full")
    ),
    "disjoint_1__llm_sp2__2_micro_batches": dict(
        vision=dict(grad_accum=2), llm=dict(sp=2, grad_accum=2), placement="disjoint", text_tokens=7
    ),
}

def tied_embeddings_config() -> dict:
    """The tiny model with lm_head tied to the embedding (as Qwen2.5-VL-3B and Qwen2-VL-2B are)."""
    return {**tiny_hf_config(), "tie_word_embeddings": True}


SLOW_PLANS = {
    "zero1_zero2_grad_accum2": dict(vision=dict(dp=2, zero=1, grad_accum=2), llm=dict(dp=2, zero=2, grad_accum=2)),
    "zero0_dp2_grad_accum2": dict(vision=dict(dp=2, grad_accum=2), llm=dict(dp=2, grad_accum=2)),
    "frozen_vision_sp2__llm_tp2": dict(vision=dict(sp=2, frozen=True), llm=dict(tp=2)),
    "tied_embeddings_uniform_tp2": dict(vision=dict(tp=2), llm=dict(tp=2), hf_config=tied_embeddings_config()),
    "vision_sp2xtp2_zero2__llm_dp2xtp2_zero1": dict(
        vision=dict(sp=2, tp=2, micro_batch=2, zero=2), llm=dict(dp=2, tp=2, zero=1)
    ),
    "disjoint_vision_sp2__llm_tp2__3_micro_batches": dict(
        vision=dict(sp=2, grad_accum=3), llm=dict(tp=2, grad_accum=3), placement="disjoint"
    ),
}


def run_runtime(plan) -> dict:
    job = launcher.start(plan, RunOptions(seed=SEED))
    try:
        results = [job.step()]
        grads = job.gather("grad")
        results += [job.step() for _ in range(STEPS - 1)]
        params = job.gather("param")
    finally:
        job.shutdown()
    losses = [next(r["loss"] for r in step if r["loss"] is not None) for step in results]
    return {"losses": losses, "grads": grads, "params": params}


def assert_parity(plan) -> None:
    ref = reference_run(plan, seed=SEED, steps=STEPS)
    got = run_runtime(plan)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    assert set(got["grads"]) == set(ref["grads"]), "runtime and reference disagree on which parameters exist"
    for name, g_ref in ref["grads"].items():
        err = (got["grads"][name] - g_ref).abs().max().item()
        assert err <= 1e-5 * g_ref.abs().max().item() + 1e-12, f"gradient of {name}: max error {err:.3g}"
    for name, p_ref in ref["params"].items():
        err = (got["params"][name] - p_ref).abs().max().item()
        assert err <= 0.1 * LR, f"parameter {name} after {STEPS} steps: max error {err:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANS))
def test_parity(name, ray_cluster):
    spec = dict(PLANS[name])
    assert_parity(make_plan(spec.pop("vision"), spec.pop("llm"), learning_rate=LR, **spec))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SLOW_PLANS))
def test_parity_more_plans(name, ray_cluster):
    spec = dict(SLOW_PLANS[name])
    assert_parity(make_plan(spec.pop("vision"), spec.pop("llm"), learning_rate=LR, **spec))
