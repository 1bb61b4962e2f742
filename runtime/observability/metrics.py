"""Per-step measurements: one JSON line per step to a file (``elapsed_s``: seconds since the run's start when the
step ended), a progress bar, and a final summary beside the plan's predictions. A dataset plan's step also gives, per balanced module, the busiest rank's compute and assigned
work over the mean rank's (``imbalance``), and the summary the median step's beside the plan's expectation.

Each rank measures itself; a step's line takes, per quantity, the slowest rank holding the module (the step
waits for it), and keeps every rank's own numbers under ``ranks``. Communication that is measurable from the step
loop is the hand-off / hand-back wait time and ZeRO-0's gradient all-reduce (``grad_sync_s``); TP, SP and FSDP
collectives run inside forward/backward and are counted there.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from typing import Any, TextIO

from tqdm import tqdm

from planner.contract.schema import Plan
from planner.contract.units import GIB
from runtime.run.preflight import is_cpu_plan
from runtime.observability.trace import write_step_trace
from planner.contract.file_io import MAX_METRICS_BYTES, is_device, read_text, write_output

TIMED = ("vision_forward_s", "vision_backward_s", "audio_forward_s", "audio_backward_s", "llm_forward_s",
         "llm_backward_s", "llm_pipeline_s", "grad_sync_s", "optimizer_s", "handoff_comm_s", "data_s")
"""Per-rank timers reported as the max over ranks (and each rank's own under ``ranks``)."""
BALANCED = ("vision", "llm")
"""Modules whose replicas a dataset plan balances per step: each rank reports ``<module>_work_s``, its replica's
assigned work (``planner.cost.balance``)."""


def module_imbalance(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per balanced module, over its ranks: the busiest rank's over the mean rank's compute (forward + backward) time
    (``measured``) and assigned work (``assigned``); nothing for a fixed-shape plan."""
    out = {}
    for name in BALANCED:
        ranks = [r for r in results if f"{name}_work_s" in r]
        if len(ranks) > 1:
            compute = [r.get(f"{name}_forward_s", 0.0) + r.get(f"{name}_backward_s", 0.0) for r in ranks]
            work = [r[f"{name}_work_s"] for r in ranks]
            out[name] = {"measured": max_over_mean(compute), "assigned": max_over_mean(work)}
    return out


def innermost_frame(stacks: str) -> str:
    """The most recent call of the thread that took the signal in a ``faulthandler`` dump ("Current thread ...",
    else the first thread listed): ``File "...", line N in name``; "an unknown place" when there is none."""
    lines = [line.strip() for line in stacks.splitlines()]
    start = next((i for i, line in enumerate(lines) if line.startswith("Current thread")), 0)
    return next((line for line in lines[start:] if line.startswith("File ")), "an unknown place")


def max_over_mean(values: list[float]) -> float:
    """max / mean (1 when all are 0)."""
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def step_record(step: int, results: list[dict[str, Any]]) -> dict[str, Any]:
    """One step's JSON record from every rank's measurements (``llm_tokens``: the step's LLM tokens, which every rank
    knows; packed steps differ in it)."""
    step_time = max(r["step_time_s"] for r in results)
    record: dict[str, Any] = {
        "step": step,
        "loss": next(r["loss"] for r in results if r["loss"] is not None),
        "grad_norm": results[0]["grad_norm"],
        "lr": next(r["lr"] for r in results if r["lr"] is not None),
        "step_time_s": step_time,
        "llm_tokens": results[0]["llm_tokens"],
        "tokens_per_s": results[0]["llm_tokens"] / step_time,
    }
    for key in TIMED:
        record[key] = max(r.get(key, 0.0) for r in results)
    record["peak_memory_gib"] = max(r["peak_memory_bytes"] for r in results) / GIB
    if all("peak_tensor_bytes" in r for r in results):  # a GPU's allocator, or a CPU run's memory cap
        record["peak_tensor_bytes"] = [r["peak_tensor_bytes"] for r in sorted(results, key=lambda r: r["rank"])]
    if any("device_memory_bytes" in r for r in results):
        record["device_memory_bytes"] = min(r["device_memory_bytes"] for r in results if "device_memory_bytes" in r)
    skipped = [r["data_skipped"] for r in results if r.get("data_skipped")]
    if skipped:  # the rank that skipped most so far (DP replicas read different rows, TP peers the same ones)
        record["data_skipped"] = max(skipped, key=lambda counts: sum(counts.values()))
    stalled = [r for r in results if r.get("prefetch_stalls")]
    if stalled:  # ranks whose prefetch worker stalled (runtime.data.prefetch): they build their samples in the step
        record["prefetch_stalls"] = sum(r["prefetch_stalls"] for r in stalled)
        record["prefetch_stalled_at"] = stalled[0]["prefetch_stalled_at"]
    experts = next((r for r in results if "expert_tokens" in r), None)
    if experts:  # every LLM rank reports the same sums
        record["expert_tokens"], record["moe_load_imbalance"] = experts["expert_tokens"], experts["moe_load_imbalance"]
    stages = pipeline_stages(results)
    if stages:
        record["pp_stages"] = stages
    imbalance = module_imbalance(results)
    if imbalance:
        record["imbalance"] = imbalance
    work = tuple(f"{name}_work_s" for name in BALANCED)
    record["ranks"] = [{"rank": r["rank"], "step_time_s": r["step_time_s"],
                        **{k: r[k] for k in TIMED + work if k in r}} for r in results]
    return record


def pipeline_stages(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A pipelined LLM's stages, each with its compute (its micro-batches' forwards and backwards) and idle time
    (the rest of its schedule: bubbles and waits for sends) of the step, the slowest rank of the stage's; [] without
    pipeline parallelism."""
    stages: dict[int, dict[str, Any]] = {}
    for r in results:
        if "pp_stage" in r:
            stage = stages.setdefault(r["pp_stage"], {"stage": r["pp_stage"], "compute_s": 0.0, "idle_s": 0.0})
            stage["compute_s"] = max(stage["compute_s"], r["pp_compute_s"])
            stage["idle_s"] = max(stage["idle_s"], r["pp_idle_s"])
    return [stages[k] for k in sorted(stages)]


class MetricsLog:
    """Writes step records (JSON lines) and, with ``trace_dir``, each step's trace (runtime.observability.trace); drives the
    progress bar; ``summary`` compares with the plan."""

    def __init__(self, plan: Plan, *, steps: int, path: str | None, append: bool = False,
                 trace_dir: str | None = None):
        self.plan, self.trace_dir = plan, trace_dir
        self.records: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self.path = path
        self.file: TextIO | None = open(path, "a" if append else "w") if path else None
        self.bar = tqdm(total=steps, desc="train", unit="step", dynamic_ncols=True)
        self.started = time.perf_counter()

    def log(self, step: int, results: list[dict[str, Any]]) -> dict[str, Any]:
        record = step_record(step, results)
        record["elapsed_s"] = time.perf_counter() - self.started
        stalled = record.get("prefetch_stalls", 0) - (self.records[-1].get("prefetch_stalls", 0) if self.records else 0)
        if stalled > 0:
            self.warn(f"step {step}: the prefetch worker of {stalled} rank(s) sent nothing in time and was killed "
                      f"(runtime.data.prefetch), stuck at {innermost_frame(record['prefetch_stalled_at'])}; those "
                      "ranks build their samples in the step from now on (the metrics hold its stacks)")
        else:  # the stacks go into the record of the step that found the stall, not every one after it
            record.pop("prefetch_stalled_at", None)
        self.records.append(record)
        self._write(record)
        if self.trace_dir is not None:
            try:
                write_step_trace(self.trace_dir, step, results)
            except OSError as e:
                self.warn(f"the trace of step {step} cannot be written to {self.trace_dir} "
                          f"({' '.join(str(e).split())}): no more traces, training goes on")
                self.trace_dir = None
        self.bar.set_postfix(loss=f"{record['loss']:.4f}", step_s=f"{record['step_time_s']:.3f}")
        self.bar.update(1)
        return record

    def rewind(self, step: int) -> None:
        """Forget the records of steps ``step`` on (a recovery runs them again); their lines stay in the file."""
        self.records = [r for r in self.records if r["step"] < step]

    def start_at(self, step: int) -> None:
        """The progress bar counts from ``step`` steps done (a resumed or recovered run), its rate from here."""
        self.bar.n = self.bar.initial = self.bar.last_print_n = step
        self.bar.refresh()

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """A line about something other than a step: ``{"event": kind, ...}`` (a checkpoint saved, a resume, a
        recovery)."""
        record = {"event": kind, **fields}
        self.events.append(record)
        self._write(record)
        return record

    def say(self, message: str) -> None:
        """``runtime: message`` on stdout, one line, above the progress bar (a decision the run took)."""
        tqdm.write(f"runtime: {message}", file=sys.stdout)

    def warn(self, message: str) -> None:
        """``runtime: warning: message`` on stderr, one line, above the progress bar."""
        tqdm.write(f"runtime: warning: {message}", file=sys.stderr)

    def _write(self, record: dict[str, Any]) -> None:
        """One line to the file; if it cannot be written (a full disk), a warning, and training goes on without
        the file."""
        if self.file:
            try:
                self.file.write(json.dumps(record) + "\n")
                self.file.flush()
            except OSError as e:
                file, self.file = self.file, None
                with contextlib.suppress(OSError):
                    file.close()
                self.warn(f"{self.path} cannot be written ({' '.join(str(e).split())}): no more metrics lines go "
                          "to it, training goes on")

    def close(self) -> None:
        """End the progress bar's line (also when a step failed) and the metrics file."""
        self.bar.close()
        self.close_file()

    def close_file(self) -> None:
        """Stop writing lines to the metrics file (``summary`` rewrites it with the summary last)."""
        if self.file:
            self.file.close()
            self.file = None

    def summary(self, **extra: Any) -> dict[str, Any]:
        """Measured median step time (after the first, warm-up step) and peak memory beside the prediction; with
    checkpoints or recoveries, their count, save stall and lost steps / seconds; then ``extra`` (``stopped``: the
    signal that stopped the run)."""
        timed = self.records[1:] or self.records
        measured_step = statistics.median(r["step_time_s"] for r in timed)
        measured_mem = max(r["peak_memory_gib"] for r in self.records)
        predicted = self.plan.predicted
        result = {
            "summary": True,
            "steps": len(self.records),
            "final_loss": self.records[-1]["loss"],
            "step_time_s": {"measured": measured_step, "predicted": predicted.step_time_s,
                            "ratio": measured_step / predicted.step_time_s},
            "peak_memory_gib": {"measured": measured_mem, "predicted": predicted.peak_memory_gib,
                                "ratio": measured_mem / predicted.peak_memory_gib},
            "tokens_per_s": {"measured": statistics.median(r["tokens_per_s"] for r in timed),
                             "predicted": predicted.tokens_per_s},
        }
        skipped = [r["data_skipped"] for r in self.records if r.get("data_skipped")]
        if skipped:
            result["data_skipped"] = skipped[-1]
        stalls = [r["prefetch_stalls"] for r in self.records if r.get("prefetch_stalls")]
        if stalls:
            result["prefetch_stalls"] = stalls[-1]
        balanced = [r["imbalance"] for r in timed if "imbalance" in r]
        if balanced:  # the median step's, beside the plan's expectation
            result["imbalance"] = {name: {"measured": statistics.median(b[name]["measured"] for b in balanced),
                                          "assigned": statistics.median(b[name]["assigned"] for b in balanced),
                                          "predicted": self.plan.module(name).predicted.expected_imbalance}
                                   for name in balanced[0]}
        result.update(self._event_summary())
        result.update(extra)
        if self.path:
            self._append_last(result)
        return result

    def _append_last(self, record: dict[str, Any]) -> None:
        """The file's last line: the file is closed, and written again with ``record`` through a temporary file
        renamed into place, so that a full disk leaves the step lines as they were (said in one line)."""
        if is_device(self.path):  # /dev/null, a terminal: nothing to read back, the line goes after the others
            self._write(record)
            self.close_file()
            return
        try:
            self.close_file()
            lines = read_text(self.path, kind="metrics file", max_bytes=MAX_METRICS_BYTES)
            lines = lines[:lines.rfind("\n") + 1]  # a line cut short by a full disk is dropped
            write_output(self.path, lines + json.dumps(record) + "\n", flag="--metrics")
        except (OSError, ValueError) as e:  # ValueError: no longer a regular file, or too large
            self.warn(f"the summary line could not be added to {self.path} ({' '.join(str(e).split())}); its step "
                      "lines are kept")


    def _event_summary(self) -> dict[str, Any]:
        """Checkpoint stalls, checkpoints not written, and the steps and seconds failures cost."""
        saves = [e for e in self.events if e["event"] == "checkpoint"]
        recoveries = [e for e in self.events if e["event"] == "recovery"]
        failed = [e for e in self.events if e["event"] == "checkpoint_failed"]
        out: dict[str, Any] = {"failed_checkpoints": len(failed)} if failed else {}
        if saves:
            out["checkpoints"] = {"count": len(saves), "stall_s": sum(e["seconds"] for e in saves),
                                  "bytes": saves[-1]["bytes"]}
        if recoveries:
            out["recoveries"] = {"count": len(recoveries), "lost_steps": sum(e["lost_steps"] for e in recoveries),
                                 "lost_s": sum(e["lost_s"] for e in recoveries)}
        return out


def format_summary(summary: dict[str, Any], memory_note: str) -> str:
    """A small table for the terminal."""
    rows = [("", "measured", "predicted", "ratio")]
    for key, label in (("step_time_s", "step time (s)"), ("peak_memory_gib", f"peak memory (GiB, {memory_note})")):
        s = summary[key]
        rows.append((label, f"{s['measured']:.4g}", f"{s['predicted']:.4g}", f"{s['ratio']:.2f}"))
    t = summary["tokens_per_s"]
    rows.append(("tokens/s", f"{t['measured']:.4g}", f"{t['predicted']:.4g}", ""))
    for name, b in summary.get("imbalance", {}).items():
        predicted = "" if b["predicted"] is None else f"{b['predicted']:.3f}"
        rows.append((f"{name} imbalance (max/mean rank)", f"{b['measured']:.3f}", predicted, ""))
    width = max(len(r[0]) for r in rows)
    lines = [f"{r[0]:<{width}}  {r[1]:>10}  {r[2]:>10}  {r[3]:>6}" for r in rows]
    return "\n".join([f"{summary['steps']} steps, final loss {summary['final_loss']:.4f}", *lines])


def print_summary(log: MetricsLog, plan: Plan, **extra: Any) -> dict[str, Any] | None:
    """The run's summary (``extra`` added), printed and returned; None when no step was done."""
    if not log.records:
        return None
    summary = log.summary(**extra)
    print(format_summary(summary, "peak RSS per worker" if is_cpu_plan(plan) else "max allocated per GPU"))
    return summary
