"""The disjoint pipeline's step time against a hand calculation and an event simulation of the runtime's schedule."""

import random

import pytest

from planner.cost.pipeline import path_terms, pipeline_step_time

IN_FLIGHT = 2
"""Encoder forwards the runtime runs ahead (runtime/training/trainer.py MAX_ENCODER_IN_FLIGHT)."""


def simulate(forward: float, backward: float, llm: float, micro_batches: int) -> float:
    """End of the last encoder backward when the encoder runs F0 F1 B0 F2 B1 ... and the LLM runs micro-batches in
    order as soon as their activations arrived (the runtime's ``_disjoint_step``)."""
    order = [("F", k) for k in range(min(IN_FLIGHT, micro_batches))]
    for k in range(micro_batches):
        order.append(("B", k))
        if k + IN_FLIGHT < micro_batches:
            order.append(("F", k + IN_FLIGHT))
    activations, gradients, encoder, llm_free = {}, {}, 0.0, 0.0
    for op, k in order:
        if op == "F":
            encoder += forward
            activations[k] = encoder
            continue
        while len(gradients) <= k:  # the LLM catches up to micro-batch k
            j = len(gradients)
            llm_free = max(llm_free, activations[j]) + llm
            gradients[j] = llm_free
        encoder = max(encoder, gradients[k]) + backward
    return encoder


def step(forward: float, backward: float, llm: float, m: int) -> float:
    encoder = path_terms(forward + backward, forward, m, stage="encoder")
    return pipeline_step_time(encoder, path_terms(llm, 0.0, m, stage="llm"))


def test_hand_calculated_cases():
    # encoder-bound, F=1 B=2 T=1.5, m=4: the encoder works 4 * 3 = 12, waiting once for the first LLM micro-batch
    # (ready at F + T = 2.5, the encoder's second forward ends at 2): 12.5 = m P + T - min(F, B)
    assert step(1.0, 2.0, 1.5, 4) == pytest.approx(12.5)
    # LLM-bound, F=1 B=2 T=5, m=3: first forward, three LLM micro-batches, last backward: 1 + 15 + 2 = 18 = P + m T
    assert step(1.0, 2.0, 5.0, 3) == pytest.approx(18.0)
    # one micro-batch: F + T + B
    assert step(1.0, 2.0, 5.0, 1) == pytest.approx(8.0)
    # the textbook bound sum P + (m - 1) max P would give 3 + 1.5 + 3 * 3 = 13.5 for the first case
    assert simulate(1.0, 2.0, 1.5, 4) == pytest.approx(12.5)


def test_equals_the_simulated_schedule():
    rng = random.Random(0)
    for _ in range(3000):
        f, b, t, m = rng.uniform(0.01, 1), rng.uniform(0, 2), rng.uniform(0.01, 2), rng.randint(1, 12)
        assert step(f, b, t, m) == pytest.approx(simulate(f, b, t, m), rel=1e-12)
