"""Does ``--adapt`` pay? Each case's plan run twice on this machine's CPU workers (gloo), without and with ``--adapt``,
the same steps and checkpoints, and their tokens/s over the steps after the adaptive run's decision side by side
(wall clock from the decision's step to the last: the collectives timed, the fit, the switch and its checkpoint load
all count):

- ``wrong links``: planned from a cluster file that calls the interconnect 100x faster (and 100x lower latency) than
  the ``cpu`` entry's gloo numbers, one sample per step on 2 devices: the plan leans on sequence parallelism (the
  vision tower's ring CP, the LLM's Ulysses);
- ``right numbers``: the same request from the ``cpu`` entry's own numbers (the first plan is already the one the
  fit prefers: no switch, nothing but the fit's cost);
- ``hand-made TP2``: a TP2 layout of both modules, 2 samples per step on 2 devices (as a hand sweep would start).

    .venv/bin/python benchmarks/adapt.py [--steps 120] [--cases wrong,right,tp2] [--save benchmarks/results/adapt]

Prints one row per run and the decision lines (``--save``: each run's plan and metrics file too, which the fidelity
notebook draws); tests never assert on these times.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import planner  # noqa: E402
from planner.contract.families import model_from_hf_config  # noqa: E402
from planner.contract.hardware import get_device  # noqa: E402
from planner.contract.strategy import layout_of  # noqa: E402
from tests.runtime.plans import IMAGE_SIZE, TEXT_TOKENS, make_plan, tiny_hf_config  # noqa: E402

CHECKPOINT_EVERY = 5
ADAPT_AFTER = 3
LINK_FACTOR = 100


def planned(tmp: Path, cluster_file: str | None, global_batch: int) -> planner.Plan:
    """The planner's plan for the tiny model on 2 CPU workers."""
    spec = model_from_hf_config(tiny_hf_config(), "tiny")
    cluster = planner.ClusterInputs(gpus=2, gpu="cpu", gpus_per_node=2, cluster_file=cluster_file, profile=None)
    return planner.plan(spec, cluster, workload=planner.WorkloadInputs(image_sizes=[IMAGE_SIZE], text_tokens=TEXT_TOKENS,
                                                                       global_batch=global_batch))


def fast_links(tmp: Path) -> str:
    """A cluster file calling the ``cpu`` entry's interconnect ``LINK_FACTOR`` x faster."""
    cpu = get_device("cpu")
    path = tmp / "fast-links.json"
    path.write_text(json.dumps({"device": "cpu", "intra_node_bandwidth": cpu.intra_node_bandwidth * LINK_FACTOR,
                                "intra_node_latency": cpu.intra_node_latency / LINK_FACTOR}))
    return str(path)


def run(plan_path: Path, folder: Path, steps: int, adapt: bool) -> tuple[list[dict], list[str]]:
    """One CLI run: its metrics records and its ``runtime: adapt:`` lines."""
    folder.mkdir()
    metrics = folder / "metrics.jsonl"
    command = [sys.executable, "-m", "runtime", str(plan_path), "--steps", str(steps), "--metrics", str(metrics),
               "--checkpoint-dir", str(folder / "checkpoints"), "--checkpoint-every", str(CHECKPOINT_EVERY)]
    command += ["--adapt", str(ADAPT_AFTER)] if adapt else []
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return records, [line for line in result.stdout.splitlines() if line.startswith("runtime: adapt: ")]


def tokens_per_s_after(records: list[dict], step: int) -> float:
    """LLM tokens per wall-clock second from the end of step ``step - 1`` to the last step's end."""
    steps = {r["step"]: r for r in records if "loss" in r}  # a redone step: its last record
    rest = [r for s, r in steps.items() if s >= step]
    return sum(r["llm_tokens"] for r in rest) / (steps[max(steps)]["elapsed_s"] - steps[step - 1]["elapsed_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--cases", default="wrong,right,tp2")
    parser.add_argument("--save", help="copy each case's plan and both runs' metrics files into this folder")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        cases = {"wrong": ("wrong links", lambda: planned(tmp, fast_links(tmp), 1)),
                 "right": ("right numbers", lambda: planned(tmp, None, 1)),
                 "tp2": ("hand-made TP2", lambda: make_plan(dict(tp=2, micro_batch=2), dict(tp=2, micro_batch=2)))}
        print(f"{args.steps} steps, a checkpoint every {CHECKPOINT_EVERY}, --adapt {ADAPT_AFTER}; tokens/s after the "
              "decision (wall clock)")
        for key in args.cases.split(","):
            name, make = cases[key]
            plan = make()
            plan_path = tmp / f"{key}.json"
            plan_path.write_text(plan.to_json())
            fixed, _ = run(plan_path, tmp / f"{key}-fixed", args.steps, adapt=False)
            adaptive, said = run(plan_path, tmp / f"{key}-adaptive", args.steps, adapt=True)
            decision = next(r for r in adaptive if r.get("event") == "adapt")["step"]
            before, after = tokens_per_s_after(fixed, decision), tokens_per_s_after(adaptive, decision)
            print(f"\n{name}: {layout_of(plan)}")
            for line in said:
                print(f"  {line}")
            print(f"  without --adapt {before:8.1f} tokens/s   with --adapt {after:8.1f} tokens/s   "
                  f"ratio {after / before:.2f}")
            if args.save:
                save = Path(args.save)
                save.mkdir(parents=True, exist_ok=True)
                shutil.copy(plan_path, save / f"{key}-plan.json")
                for run_name, records in (("fixed", fixed), ("adaptive", adaptive)):  # each rank's numbers left out
                    (save / f"{key}-{run_name}.jsonl").write_text(
                        "".join(json.dumps({k: v for k, v in r.items() if k != "ranks"}) + "\n" for r in records))


if __name__ == "__main__":
    main()
