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

import heapq
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


# --- Pipeline parallelism of one module (pp > 1) -------------------------------------------------------------------


def balanced_chunk_layers(num_layers: int, chunk_extra_s: Sequence[float], layer_s: float) -> tuple[int, ...]:
    """Decoder layers per model chunk (pipeline stage, or virtual stage) that minimise the slowest chunk's time
    ``extra_c + n_c * layer_s``, each chunk holding at least one layer.

    A chunk's ``extra`` is what it holds besides decoder layers: the first the token embedding and the encoders'
    hand-off, the last the final norm, the vocabulary projection and the loss (at a 152K vocabulary worth several
    decoder layers), so an even split is not the balanced one. Adding layers one at a time to the chunk that stays
    fastest is optimal for identical layers (it is list scheduling of identical jobs on machines with different
    ready times; Graham 1969, whose bound is tight at 0 for unit jobs); ties go to the earliest chunk.

    Raises:
        ValueError: fewer layers than chunks.
    """
    chunks = len(chunk_extra_s)
    if num_layers < chunks:
        raise ValueError(f"{num_layers} layers cannot fill {chunks} pipeline chunks")
    counts = [1] * chunks
    heap = [(extra + 2 * layer_s, c) for c, extra in enumerate(chunk_extra_s)]
    heapq.heapify(heap)
    for _ in range(num_layers - chunks):
        _, c = heapq.heappop(heap)
        counts[c] += 1
        heapq.heappush(heap, (chunk_extra_s[c] + (counts[c] + 1) * layer_s, c))
    return tuple(counts)


def pipeline_bubble_time(device_s: Sequence[float], virtual_stages: int,
                         weight_grad_s: Sequence[float] | None = None) -> float:
    """Idle seconds per step a pipeline adds to ``grad_accum * max(device_s)``: ``(sum_k t_k - max_k t_k) / v``.

    ``device_s[k]`` is pipeline rank k's time for one micro-batch's forward and backward over all of its chunks.
    1F1B (v = 1) takes ``sum_k t_k + (m - 1) max_k t_k`` from the first forward to the last backward (Zheng et
    al. 2022, Alpa, Eq. 2; for equal stages Narayanan et al. 2021, Sec. 2.2.1: bubble ``(p - 1) t``, a fraction
    ``(p - 1) / m``); the interleaved schedule with v chunks per rank shrinks the bubble v times (Narayanan et al.
    2021, Sec. 2.2.2: ``(p - 1) t / v``).

    Zero-bubble (``weight_grad_s[k]``: rank k's weight-gradient passes W_k per micro-batch, deferred to fill the
    bubble): ZB-H1's bubble is ``(p - 1)(T_F + T_B - T_W)`` against 1F1B's ``(p - 1)(T_F + T_B + T_W)`` (Qi et al.
    2023, "Zero Bubble Pipeline Parallelism", Sec. 3.1, B the input-gradient pass), i.e. the same formula over
    ``t_k - 2 W_k``; torch's interleaved zero-bubble schedule idles exactly ``(p - 1)(F + B - W) / v`` per chunk in
    a replay of its own order (``ScheduleInterleavedZeroBubble``, pp = 2 and 4, m = 2..16).
    """
    if len(device_s) <= 1:
        return 0.0
    if weight_grad_s is not None:
        device_s = [max(0.0, t - 2 * w) for t, w in zip(device_s, weight_grad_s, strict=True)]
    return (sum(device_s) - max(device_s)) / virtual_stages


def in_flight_chunks(stage: int, num_stages: int, grad_accum: int, virtual_stages: int,
                     zero_bubble: bool = False) -> int:
    """Model chunks whose activations pipeline rank ``stage`` holds at its peak (a chunk: 1 / v of the rank's
    layers for one micro-batch).

    1F1B (v = 1): rank k runs ``p - 1 - k`` warm-up forwards before its first backward, so it holds
    ``min(p - k, m)`` micro-batches (Narayanan et al. 2021, Sec. 2.2.1; torch's ``Schedule1F1B``). Interleaved:
    ``(v - 1) r + 2 (p - 1 - k)`` warm-up chunk forwards with ``r`` micro-batches per round (``m`` over
    ``max(1, m // p)`` rounds), capped at ``m v``, plus the one in flight (torch's ``_get_warmup_ops`` for
    ``ScheduleInterleaved1F1B``, Megatron-LM's interleaved warm-up). Interleaved zero-bubble: ``(v - 1) r + p``
    on every rank, capped at ``m v`` (a chunk's activations live until its deferred weight-gradient pass; counted
    from torch's ``ScheduleInterleavedZeroBubble`` orders for pp = 2 and 4, m = 2..16, and its saved tensors
    measured; Qi et al. 2023, Sec. 3.1: ZB-H1 keeps 1F1B's peak of p micro-batches).
    """
    p, m, v = num_stages, grad_accum, virtual_stages
    if v == 1:
        return min(p - stage, m)
    per_round = m // max(1, m // p)
    if zero_bubble:
        return min((v - 1) * per_round + p, m * v)
    return min((v - 1) * per_round + 2 * (p - 1 - stage) + 1, m * v)
