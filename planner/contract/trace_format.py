"""The Chrome trace event format both traces of a step use: the predicted one (``planner.trace``, ``plan --trace``) and
the measured ones (``runtime.observability.trace``, ``python -m runtime --trace``), so Perfetto (ui.perfetto.dev) and
chrome://tracing open them alike: ``X`` (complete) events with ``ts`` / ``dur`` in microseconds, ``pid`` a global
rank, ``tid`` a lane (``LANES``), ``M`` events naming ranks and lanes, ``otherData`` what the trace is of. Pure
Python (the runtime reads it without the cost model)."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any, Mapping

from planner.contract.file_io import write_output

LANES = {"compute": 0, "communication": 1, "host": 2}
"""Lane name -> ``tid`` of every rank's rows."""
US = 1e6
"""Microseconds per second (the format's unit)."""


def chrome_trace(events: list[dict[str, Any]], rank_names: Mapping[int, str], **other: Any) -> dict[str, Any]:
    """The trace document: ``events`` with the ``M`` events naming each rank (sorted by rank) and its lanes;
    ``other`` goes to ``otherData``."""
    meta: list[dict[str, Any]] = []
    lanes = defaultdict(set)
    for event in events:
        lanes[event["pid"]].add(event["tid"])
    for pid in sorted(rank_names):
        meta += [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": rank_names[pid]}},
                 {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": lane}}
                 for lane, tid in LANES.items() if tid in lanes[pid]]
    return {"traceEvents": meta + events, "displayTimeUnit": "ms", "otherData": dict(other)}


def makespan_s(trace: Mapping[str, Any]) -> float:
    """Seconds from the first span's start to the last one's end."""
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    return (max(e["ts"] + e["dur"] for e in spans) - min(e["ts"] for e in spans)) / US


def write_trace(trace: Mapping[str, Any], path: str, *, flag: str = "--trace") -> None:
    """Write ``trace`` as JSON (whole or not at all; ``planner.contract.file_io.write_output``)."""
    write_output(path, json.dumps(trace), flag=flag)
