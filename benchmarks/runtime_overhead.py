"""Runtime overhead on CPU: a 1-device plan run by ``python -m runtime``'s machinery vs a plain PyTorch step.

Same model (a small-but-not-trivial Qwen2.5-VL: 8 vision blocks with 2 full-attention, 4 decoder layers of
hidden 256), same synthetic samples (generated inside the step in both loops), fp32, one thread each, AdamW,
global-norm clipping. The plain step is transformers' ``model(**batch).loss.backward()`` + clip + AdamW.

Prints the median step time of each and their ratio (target <= 1.10): "in worker" is the runtime's own step
timer, "by driver" adds the Ray round trip of each step. The two loops alternate step by step (the plain one in
this process, the runtime in its Ray worker), so background load on a shared machine hits both alike.

    .venv/bin/python benchmarks/runtime_overhead.py [--steps 8]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.launch import launcher  # noqa: E402
from runtime.data.samples import SyntheticData, collate  # noqa: E402
from runtime.models.families import family_of  # noqa: E402
from runtime.models.model import build_model  # noqa: E402
from runtime.training.optim import warmup_factor  # noqa: E402
from runtime.training.trainer import RunOptions  # noqa: E402
from tests.runtime.plans import make_plan, tiny_hf_config  # noqa: E402

WARMUP_STEPS = 2
BATCH = 2


def small_config() -> dict:
    """The tiny catalog model, widened so that compute, not bookkeeping, dominates a step."""
    config = copy.deepcopy(tiny_hf_config())
    config["text_config"].update(hidden_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=4,
                                 vocab_size=4096)
    config["vision_config"].update(depth=8, hidden_size=128, intermediate_size=384, num_heads=8, out_hidden_size=256,
                                   fullatt_block_indexes=[3, 7])
    for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        config[key] += 3000
    return config


class PlainStep:
    """transformers' own training step on the same samples."""

    def __init__(self, plan):
        self.model = build_model(plan.model.hf_config, seed=0)
        config = self.model.config
        self.data = SyntheticData(family_of(config).encoder.layout_from_plan(plan.workload, config), seed=0)
        self.training = plan.training
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.training.learning_rate,
                                           weight_decay=self.training.weight_decay)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: warmup_factor(s, self.training.warmup_steps))
        self.step = 0

    def __call__(self) -> float:
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        batch = collate([self.data.sample(self.step * BATCH + i) for i in range(BATCH)])
        self.model(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.training.grad_clip_norm)
        self.optimizer.step()
        self.schedule.step()
        self.step += 1
        return time.perf_counter() - start


def benchmark_plan():
    """The 1-device CPU plan both overhead benchmarks run: the widened model, two 224 x 336 images per step."""
    return make_plan(dict(micro_batch=BATCH), dict(micro_batch=BATCH), hf_config=small_config(),
                     image_size=(224, 336), text_tokens=128)


def measure(plan, steps: int) -> tuple[list[float], list[float], list[float]]:
    """Plain, runtime in-worker and runtime driver-observed step times, the two loops interleaved step by step
    so that both see the same background load on a shared machine."""
    torch.set_num_threads(1)
    plain = PlainStep(plan)
    job = launcher.start(plan, RunOptions(seed=0))
    times: tuple[list[float], list[float], list[float]] = ([], [], [])
    try:
        for _ in range(steps):
            times[0].append(plain())
            start = time.perf_counter()
            results = job.step()
            times[2].append(time.perf_counter() - start)
            times[1].append(results[0]["step_time_s"])
    finally:
        job.shutdown()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="measured steps (after 2 warm-up steps)")
    args = parser.parse_args()
    plan = benchmark_plan()
    launcher.ensure_ray()
    plain, inner, outer = (statistics.median(t[WARMUP_STEPS:]) for t in measure(plan, WARMUP_STEPS + args.steps))
    print(f"plain PyTorch step        {plain * 1e3:8.1f} ms")
    print(f"runtime step (in worker)  {inner * 1e3:8.1f} ms   ratio {inner / plain:.3f}")
    print(f"runtime step (by driver)  {outer * 1e3:8.1f} ms   ratio {outer / plain:.3f}   (target <= 1.10)")


if __name__ == "__main__":
    main()
