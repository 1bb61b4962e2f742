"""Step time of the disjoint placement's two-stage pipeline (encoders -> LLM), as the runtime schedules it.

The runtime (runtime/trainer.py, ``_disjoint_step``) runs ``m = grad_accum`` micro-batches: the encoder group runs
at most two forwards ahead, then alternates backward and forward (F0 F1 B0 F2 B1 F3 ... B(m-1)); the LLM group
runs each micro-batch's forward and backward, in order, once its activations have arrived, and sends the
gradient back. The step is the longest path through that dependency graph (critical-path method, Kelley &
Walker 1959). With the encoder's forward F and backward B per micro-batch (P = F + B) and the LLM's T, the
longest paths are, for m >= 2,

    max(P + m T,  (m - 1) P + 2 T,  m P + T - min(F, B),  m P)

(m = 1: P + T): the LLM-bound path (first forward, every LLM micro-batch, last backward); the path alternating
between the groups; the encoder-bound path that waits once for the first LLM micro-batch; the encoder alone.
Each path is a sum of one term per stage (``path_terms``), so the CP-SAT model encodes the max with one
constraint per path. The textbook 1F1B bound ``sum P + (m - 1) max`` (Narayanan et al. 2021, Sec. 2.2)
over-estimates an encoder-bound step by min(F, T): the LLM's first micro-batch overlaps the encoder's second
forward.
"""

from __future__ import annotations

from typing import Literal, Sequence

NUM_PATHS = 4
"""Critical paths ``pipeline_step_time`` takes the max of."""


def path_terms(
    per_micro_batch_s: float, forward_s: float, grad_accum: int, *, stage: Literal["encoder", "llm"]
) -> tuple[float, ...]:
    """One stage's share of each of the ``NUM_PATHS`` critical paths (module docstring).

    Args:
        per_micro_batch_s: The stage's time for one micro-batch (P for the encoder, T for the LLM).
        forward_s: The forward part of it (F; used for the encoder only).
        grad_accum: Micro-batches per step (m).
        stage: ``encoder`` or ``llm``.
    """
    m = grad_accum
    if stage == "llm":
        t = per_micro_batch_s
        return (m * t, min(m, 2) * t, t, 0.0)
    p, f = per_micro_batch_s, forward_s
    return (p, (m - 1) * p, m * p - min(f, p - f), m * p)


def pipeline_step_time(encoder_terms: Sequence[float], llm_terms: Sequence[float]) -> float:
    """Seconds from the first encoder forward to the last encoder backward: the longest critical path.

    Several encoders (vision and audio) are costed as one stage running them in turn: their terms are summed
    before this call (at least the exact value, since a sum of minima is at most the minimum of sums)."""
    return max(e + l for e, l in zip(encoder_terms, llm_terms, strict=True))
