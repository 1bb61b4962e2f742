"""Per-module balancing against LLM-token-only balancing, on the mixed-resolution mixture of docs/planner.md and
on the same mixture with video clips mixed in (Qwen2.5-VL-32B's vision tower and LLM on H100s, the cost model's
work per item, ``planner.cost.balance``).

For 8, 64 and 1,024 ranks (each module DP over all of them, one pack per replica per micro-batch, 4 micro-batches a
step), steps are drawn from the dataset's packs and assigned two ways:

- **tokens**: the LLM replicas take the packs by LLM tokens (``balance_packs``), vision replica ``d`` the images of
  LLM replica ``d``'s packs (what the runtime did before);
- **per module**: the LLM replicas take the packs by LLM work, each micro-batch's images go to the vision replicas by
  vision work (``assign_lpt``), independently.

Printed per module: the imbalance (sum over micro-batches of the busiest replica's work over the mean's,
``step_imbalance``), the step's compute time on the busiest replicas (vision then LLM per micro-batch, colocated),
and the assignment's own time per step. Last, the most a per-step vision SP degree could still gain: the vision
work above the mean replica's that balancing leaves, as a share of the step (an SP group splits an image's work
over its ranks, so at best it removes that excess).

    python benchmarks/balance.py

``--cpu-run`` runs both policies instead of simulating them: a tiny Qwen2.5-VL (tests/runtime/plans.py) planned
over 4 CPU ranks, both modules DP 4, on a conversation file of many small images and a few large ones, trained
``--steps`` steps under ``torchrun`` (gloo, one thread per rank) once with ``--balance tokens`` and once with
``--balance modules``; printed per rank, the median over the steps after the first: measured vision and LLM compute
(forward + backward) beside the work the assignment gave the rank (the cost model's, on its CPU device spec), and
the step time (each step waits for its slowest rank).

    python benchmarks/balance.py --cpu-run [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from planner.analysis import mixed_resolution_histogram
from planner.cost.balance import SampleWork, assign_lpt, llm_micro_loads, step_imbalance
from planner.catalog import get_model
from planner.contract.data_rows import VideoShape
from planner.dataset import DatasetHistogram, pack_budgets, pack_dataset, sample_tokens
from planner.contract.hardware import get_device
from planner.contract.packing import balance_packs

ROOT = Path(__file__).resolve().parent.parent
MODEL = get_model("qwen-vl-32b")
RANKS = (8, 64, 1024)
MICRO_BATCHES = 4
STEPS = 6


def with_clips(histogram: DatasetHistogram, share: float = 0.05, seed: int = 1) -> DatasetHistogram:
    """The mixture with ``share`` of its samples turned into video clips (10 to 60 s at 30 fps, 720p or 1080p, one
    clip and the sample's text each)."""
    rng = np.random.default_rng(seed)
    shapes = []
    for count, text, images, videos in histogram.shapes:
        clips = int(rng.binomial(count, share))
        if count - clips:
            shapes.append((count - clips, text, images, videos))
        for _ in range(clips):
            h, w = ((720, 1280), (1080, 1920))[int(rng.integers(2))]
            shapes.append((1, text, (), (VideoShape(int(rng.integers(300, 1800)), h, w, 30.0),)))
    return DatasetHistogram(source=histogram.source + " + 5 % clips", text_tokens=histogram.text_tokens,
                            skipped={}, shapes=tuple(shapes))


def simulate(balance, work: SampleWork, ranks: int, per_module: bool, rng: np.random.Generator) -> dict:
    """Mean imbalance per module and busiest-replica step time over ``STEPS`` drawn steps of ``ranks`` replicas."""
    vision_ratios, llm_ratios, step_s, assign_s, sp_gain = [], [], [], [], []
    for _ in range(STEPS):
        packs = rng.choice(len(balance.pack_lengths), size=ranks * MICRO_BATCHES,
                           replace=ranks * MICRO_BATCHES > len(balance.pack_lengths))
        start = time.perf_counter()
        llm_work = [work.llm(balance.pack_lengths[k]) for k in packs]
        keys = llm_work if per_module else [sum(balance.pack_lengths[k]) for k in packs]
        dealt = balance_packs(keys, ranks, MICRO_BATCHES)
        vision = []
        for m in range(MICRO_BATCHES):
            replica_packs = [packs[mine[m]] for mine in dealt]  # LLM replica e's pack of micro-batch m
            if per_module:
                costs = [work.vision(g) for k in replica_packs for g in balance.pack_grids[k]]
                vision.append([sum(costs[i] for i in mine) for mine in assign_lpt(costs, ranks)])
            else:
                vision.append([sum(work.vision(g) for g in balance.pack_grids[k]) for k in replica_packs])
        assign_s.append(time.perf_counter() - start)
        llm = llm_micro_loads(llm_work, dealt, 1)
        vision_ratios.append(step_imbalance(vision))
        llm_ratios.append(step_imbalance(llm))
        step_s.append(sum(max(v) + max(l) for v, l in zip(vision, llm)))
        sp_gain.append(sum(max(v) - sum(v) / len(v) for v in vision) / step_s[-1])
    return {"vision": np.mean(vision_ratios), "llm": np.mean(llm_ratios), "step_s": np.mean(step_s),
            "assign_ms": 1e3 * np.mean(assign_s), "sp_gain": np.mean(sp_gain)}


CPU_RANKS = 4
CPU_SMALL = ((112, 112), (112, 168), (168, 112), (140, 140))
"""(height, width) of the many small images: one or two attention windows, 16 to 25 LLM tokens."""
CPU_LARGE = ((672, 672), (560, 784))
"""The few large ones: 2,304 / 2,240 patches, 576 / 560 LLM tokens, attention ~500x a small image's."""
CPU_ROWS, CPU_LARGE_EVERY = 192, 12
"""Conversations, and every how many is a large image's: best-fit decreasing packs up to 3 large images together (their
samples are the longest), so a step's packs differ widely in vision work."""
CPU_PACK_TOKENS, CPU_MAX_PIXELS = 2048, 672 * 672
CPU_GRAD_ACCUM = 2


def write_cpu_data(folder: Path) -> tuple[Path, Path]:
    """(conversation JSONL, tokenizer folder): ``CPU_ROWS`` rows of random-pixel images, one in ``CPU_LARGE_EVERY``
    large, answers of 2 to 30 words, and the tests' byte-level tokenizer with the tiny model's special tokens."""
    from PIL import Image

    from tests.runtime.tokenizer import qwen_special_tokens, save_tokenizer

    rng = np.random.default_rng(0)
    names = []
    for k, (h, w) in enumerate(CPU_SMALL + CPU_LARGE):
        names.append(f"image{k}.png")
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / names[-1])
    rows = []
    for k in range(CPU_ROWS):
        image = names[len(CPU_SMALL) + k // CPU_LARGE_EVERY % len(CPU_LARGE)] if k % CPU_LARGE_EVERY == 0 else \
            names[k % len(CPU_SMALL)]
        rows.append({"image": image, "conversations": [
            {"from": "human", "value": f"<image>\nWhat is in picture {k}?"},
            {"from": "gpt", "value": " ".join(["thing"] * int(rng.integers(2, 31)))}]})
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return data, save_tokenizer(folder / "tokenizer", qwen_special_tokens(get_model("qwen2.5-vl-tiny").hf_config))


def cpu_plan(path: Path) -> Path:
    """The tiny model over ``CPU_RANKS`` CPU ranks, vision and LLM DP ``CPU_RANKS`` each, one pack per replica per
    micro-batch, as a dataset plan of ``CPU_PACK_TOKENS``-token packs and images up to ``CPU_MAX_PIXELS``."""
    from tests.runtime.plans import make_plan

    plan = make_plan(dict(dp=CPU_RANKS, grad_accum=CPU_GRAD_ACCUM), dict(dp=CPU_RANKS, grad_accum=CPU_GRAD_ACCUM),
                     pack_tokens=CPU_PACK_TOKENS)
    dataset = plan.workload.dataset.model_copy(update={"max_pixels": CPU_MAX_PIXELS})
    plan = plan.model_copy(update={"workload": plan.workload.model_copy(update={"dataset": dataset})})
    path.write_text(plan.to_json())
    return path


def cpu_run(policy: str, plan: Path, data: Path, tokenizer: Path, steps: int, folder: Path) -> list[dict]:
    """The per-step records of ``steps`` steps of ``plan`` under torchrun with ``--balance policy``."""
    metrics = folder / f"metrics-{policy}.jsonl"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(CPU_RANKS),
               "-m", "runtime", str(plan), "--data", str(data), "--tokenizer", str(tokenizer), "--steps", str(steps),
               "--metrics", str(metrics), "--balance", policy, "--no-prefetch"]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"--balance {policy} run failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return [r for r in map(json.loads, metrics.read_text().splitlines()) if "step" in r and "ranks" in r]


def rank_rows(records: list[dict]) -> list[tuple[int, int, dict[str, float]]]:
    """(step, rank, its vision and LLM compute (forward + backward) and assigned work, step time) of the steps
    after the first."""
    return [(record["step"], r["rank"], {
        "vision": r.get("vision_forward_s", 0.0) + r.get("vision_backward_s", 0.0), "vision_work": r["vision_work_s"],
        "llm": r.get("llm_forward_s", 0.0) + r.get("llm_backward_s", 0.0), "llm_work": r["llm_work_s"],
        "step": r["step_time_s"]}) for record in records[1:] for r in record["ranks"]]


def cpu_main(steps: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        data, tokenizer = write_cpu_data(folder)
        plan = cpu_plan(folder / "plan.json")
        runs = {policy: cpu_run(policy, plan, data, tokenizer, steps, folder) for policy in ("tokens", "modules")}
    small = ", ".join(f"{w}x{h}" for h, w in CPU_SMALL)
    large = ", ".join(f"{w}x{h}" for h, w in CPU_LARGE)
    print(f"tiny Qwen2.5-VL (tests/runtime/plans.py) on {CPU_RANKS} CPU ranks (gloo, 1 thread each, on "
          f"{os.cpu_count()} cores: times are noisy), vision DP {CPU_RANKS} + LLM DP {CPU_RANKS} colocated, "
          f"{CPU_GRAD_ACCUM} micro-batches of one {CPU_PACK_TOKENS}-token pack per replica; {CPU_ROWS} conversations, "
          f"1 in {CPU_LARGE_EVERY} over a large image ({large} px), the others small ({small}); {steps} steps per "
          "policy, the same packs each step; work: the cost model's per rank (planner.cost.balance, the plan's CPU device "
          "spec); compute: forward + backward\n")
    print("| policy | step | rank | vision compute (s) | vision work (s) | LLM compute (s) | LLM work (s) | step (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for policy, records in runs.items():
        for step, rank, r in rank_rows(records):
            print(f"| {policy} | {step} | {rank} | {r['vision']:.3f} | {r['vision_work']:.4f} | {r['llm']:.3f} | "
                  f"{r['llm_work']:.4f} | {r['step']:.3f} |")
    print("\nmedians over the steps after the first; busiest / mean rank per step (runtime.observability.metrics' imbalance):\n")
    print("| policy | vision compute: busiest / mean | vision work: busiest / mean | LLM compute: busiest / mean | "
          "step time (s) |")
    print("|---|---:|---:|---:|---:|")
    for policy, records in runs.items():
        timed = records[1:]

        def median(module: str, what: str) -> float:
            return statistics.median(r["imbalance"][module][what] for r in timed)

        print(f"| {policy} | {median('vision', 'measured'):.2f} | {median('vision', 'assigned'):.2f} | "
              f"{median('llm', 'measured'):.2f} | {statistics.median(r['step_time_s'] for r in timed):.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-run", action="store_true", help="run both policies on a tiny 4-rank CPU plan")
    parser.add_argument("--steps", type=int, default=6, help="steps per policy of --cpu-run (default 6)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (the first is a warm-up), got {args.steps}")
    if args.cpu_run:
        return cpu_main(args.steps)
    work = SampleWork(MODEL, get_device("h100"))
    mixture = mixed_resolution_histogram()
    print(f"{MODEL.name} on H100s; work per item from the cost model (planner.cost.balance.SampleWork); "
          f"{MICRO_BATCHES} micro-batches of one pack per replica; mean of {STEPS} drawn steps\n")
    print("| data | ranks | vision imbalance: tokens / per module | LLM imbalance: tokens / per module "
          "| step compute (s): tokens / per module | speed-up | assignment (ms/step) | per-step SP could gain |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, histogram in (("mixture", mixture), ("mixture + 5 % clips", with_clips(mixture))):
        tokens = sample_tokens(histogram, MODEL)
        balance = pack_dataset(tokens, MODEL, pack_budgets(tokens, (1,))[0]).packed.balance
        for ranks in RANKS:
            old = simulate(balance, work, ranks, False, np.random.default_rng(0))
            new = simulate(balance, work, ranks, True, np.random.default_rng(0))
            print(f"| {name} | {ranks:,} | {old['vision']:.2f} / {new['vision']:.3f} | {old['llm']:.3f} / "
                  f"{new['llm']:.3f} | {old['step_s']:.2f} / {new['step_s']:.2f} | "
                  f"{old['step_s'] / new['step_s']:.2f}x | {new['assign_ms']:.0f} | {new['sp_gain']:.1%} |")


if __name__ == "__main__":
    main()
