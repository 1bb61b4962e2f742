"""Per-module balancing against LLM-token-only balancing, on README's mixed-resolution mixture and on the same mixture
with video clips mixed in (Qwen2.5-VL-32B's vision tower and LLM on H100s, the cost model's work per item,
``planner.balance``).

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
"""

from __future__ import annotations

import time

import numpy as np

from planner.analysis import mixed_resolution_histogram
from planner.balance import SampleWork, assign_lpt, llm_micro_loads, step_imbalance
from planner.catalog import get_model
from planner.data_rows import VideoShape
from planner.dataset import DatasetHistogram, pack_budgets, pack_dataset, sample_tokens
from planner.hardware import get_device
from planner.packing import balance_packs

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


def main() -> None:
    work = SampleWork(MODEL, get_device("h100"))
    mixture = mixed_resolution_histogram()
    print(f"{MODEL.name} on H100s; work per item from the cost model (planner.balance.SampleWork); "
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
