"""The measured steps as Chrome traces (``python -m runtime plan.json --trace DIR``), in the format of the planner's
predicted one (``planner.trace``, ``plan --trace``), so the two open side by side in Perfetto (ui.perfetto.dev).

Each rank records the spans its Trainer already times (``Trainer._timed``: encoder and LLM forwards and backwards,
a pipeline stage's forward / backward actions inside the LLM's schedule, the gradient sync, the optimizer) and its
hand-off waits, in seconds from its own step start; the driver (rank 0 under torchrun) gathers them with the step's
other measurements and writes ``DIR/step-<k>.json``: ``pid`` the rank, ``tid`` its lane, ``args.measured_s`` the
span's seconds. Ranks are aligned at their step starts (their clocks are not compared). With ``--trace-profiler``
each rank also writes torch.profiler's own trace of every step, ``DIR/profiler-step-<k>-rank-<r>.json``, on its
node.
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from typing import Any, Iterator

from planner.contract.trace_format import LANES, US, chrome_trace, write_trace

STEP = "step"
"""The span of the whole step (host lane)."""
HANDOFF_WAIT = "hand-off wait"
"""A wait for hand-off messages (``runtime.models.handoff.Handoff.wait``)."""
_COMMUNICATION = ("grad_sync_s", HANDOFF_WAIT)
_MICRO_BATCHED = ("vision_forward_s", "vision_backward_s", "audio_forward_s", "audio_backward_s", "llm_forward_s",
                  "llm_backward_s")
"""Timers run once per micro-batch, in micro-batch order: their k-th span is micro-batch k."""
_PIPELINE_ACTIONS = {"forward_one_chunk": "llm stage forward", "backward_one_chunk": "llm stage backward",
                     "backward_weight_one_chunk": "llm stage backward (weights)"}


def span_name(key: str) -> tuple[str, str]:
    """(name, lane) of a recorded span: ``llm_forward_s`` -> (``llm forward``, compute)."""
    lane = "communication" if key in _COMMUNICATION else "host" if key == STEP else "compute"
    return _PIPELINE_ACTIONS.get(key, key.removesuffix("_s").replace("_", " ")), lane


def step_trace(step: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    """The Chrome trace of one measured step from every rank's measurements (``Trainer.train_step``)."""
    events = []
    for r in results:
        seen: dict[str, int] = defaultdict(int)
        for key, start, end in r["spans"]:
            name, lane = span_name(key)
            args = {"measured_s": end - start, "step": step}
            if key in _MICRO_BATCHED:
                args["micro_batch"] = seen[key]
                seen[key] += 1
            events.append({"name": name, "ph": "X", "pid": r["rank"], "tid": LANES[lane], "ts": start * US,
                           "dur": (end - start) * US, "cat": lane, "args": args})
    names = {r["rank"]: f"rank {r['rank']}: {', '.join(r['modules'])}" for r in results}
    return chrome_trace(events, names, kind="measured", step=step,
                        step_time_s=max(r["step_time_s"] for r in results))


def write_step_trace(directory: str, step: int, results: list[dict[str, Any]]) -> None:
    """``directory/step-<step>.json``."""
    write_trace(step_trace(step, results), os.path.join(directory, f"step-{step}.json"))


@contextlib.contextmanager
def profiled(directory: str | None, rank: int, step: int) -> Iterator[None]:
    """Run the block under torch.profiler and export its Chrome trace to ``directory`` (nothing when None)."""
    if directory is None:
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as profiler:
        yield
    profiler.export_chrome_trace(os.path.join(directory, f"profiler-step-{step}-rank-{rank}.json"))
