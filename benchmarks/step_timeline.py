"""Predicted and measured step timelines of one CPU plan, side by side (docs/runtime.md, notebooks/fidelity).

    .venv/bin/python benchmarks/step_timeline.py [--steps 4] [--out benchmarks/results/step_timeline]
        [--figure docs/figures/step_timeline.png]

1. ``plan`` (the CLI) plans ``benchmarks/qwen2.5-vl-cpu-small`` on 2 CPU workers, disjoint (vision on one, the LLM on
   the other, one micro-batch each of 4 per step: fidelity_cpu.py's "2w disjoint mb1"), costed with the committed
   CPU profile, and writes its predicted step with ``--trace``.
2. ``python -m runtime`` trains it for ``--steps`` steps with ``--trace``; the fastest step's trace after the first
   (a warm-up) is kept: the prediction is for an otherwise idle machine, and other processes only ever add time.
3. Prints the predicted and measured step time and, per span name, the mean seconds of each, then draws both
   traces at one time scale.

Everything it writes comes from these two commands: OUT/plan.json, OUT/predicted.json, OUT/measured.json, the
figure, and OUT/summary.txt (what it printed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = "benchmarks/qwen2.5-vl-cpu-small"
PROFILE = "profiles/cpu/qwen2.5-vl-cpu-small.json"
"""Paths from the repository root, where the commands run (the plan records the profile's)."""
PLAN_ARGS = ["--model", MODEL, "--gpu", "cpu", "--gpus", "2", "--vision-tokens", "576", "--text-tokens", "128",
             "--global-batch", "4", "--profile", PROFILE, "--fix", "placement=disjoint",
             *(arg for m in ("vision", "llm")
               for k, v in dict(dp=1, tp=1, sp=1, cp=1, zero=0, recompute="none", micro_batch=1).items()
               for arg in ("--fix", f"{m}.{k}={v}"))]
"""fidelity_cpu.py's "2w disjoint mb1" configuration."""


def _run(command: list[str]) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command[:4])} ... failed:\n{result.stderr[-3000:]}")


def mean_spans(trace: dict, key: str) -> dict[str, float]:
    """Mean seconds of each span name over ranks and micro-batches."""
    spans = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["name"] != "step":
            spans[e["name"]].append(e["args"][key])
    return {name: statistics.mean(values) for name, values in spans.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "step_timeline"))
    parser.add_argument("--figure", default=str(ROOT / "docs" / "figures" / "step_timeline.png"))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load = f"{os.getloadavg()[0]:.1f}"
    with tempfile.TemporaryDirectory() as scratch:
        _run([sys.executable, "-c", "import sys; from planner.cli import main; sys.exit(main())", *PLAN_ARGS,
              "--out", str(out / "plan.json"), "--trace", str(out / "predicted.json")])
        _run([sys.executable, "-m", "runtime", str(out / "plan.json"), "--steps", str(args.steps), "--no-prefetch",
              "--trace", scratch])
        steps = [json.loads((Path(scratch) / f"step-{k}.json").read_text()) for k in range(1, args.steps)]
    measured = min(steps, key=lambda t: t["otherData"]["step_time_s"])
    (out / "measured.json").write_text(json.dumps(measured))
    predicted = json.loads((out / "predicted.json").read_text())
    p_step, m_step = predicted["otherData"]["step_time_s"], measured["otherData"]["step_time_s"]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    lines = [f"# .venv/bin/python benchmarks/step_timeline.py --steps {args.steps}   "
             f"({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%dT%H:%M}Z, commit {commit.strip()})",
             f"fastest of steps 1-{args.steps - 1} (step {measured['otherData']['step']}): predicted "
             f"{p_step * 1e3:.1f} ms, measured {m_step * 1e3:.1f} ms (predicted / measured {p_step / m_step:.2f}); "
             f"1-minute load average {load} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs",
             f"{'span (mean per occurrence)':36} {'predicted':>10} {'measured':>10}"]
    p_spans, m_spans = mean_spans(predicted, "predicted_s"), mean_spans(measured, "measured_s")
    for name in sorted(set(p_spans) | set(m_spans)):
        cells = [f"{d[name] * 1e3:8.2f}ms" if name in d else f"{'-':>10}" for d in (p_spans, m_spans)]
        lines.append(f"{name:36} {cells[0]} {cells[1]}")
    text = "\n".join(lines)
    print(text)
    (out / "summary.txt").write_text(text + "\n")
    draw(predicted, measured, args.figure)


def draw(predicted: dict, measured: dict, path: str) -> None:
    """Both traces, one above the other, at the longer one's time scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from planner.analysis import plot_step_trace

    until = max(t["otherData"]["step_time_s"] for t in (predicted, measured))
    fig, axes = plt.subplots(2, 1, figsize=(12, 5.5), sharex=True)
    plot_step_trace(predicted, axes[0], title="predicted (plan --trace)", until_s=until, legend=True)
    plot_step_trace(measured, axes[1], title="measured (python -m runtime --trace), one step", until_s=until)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
