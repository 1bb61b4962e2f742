"""Dry-run vs planner at full size: the runtime's own peak memory per role, module and category (runtime.dry_run)
beside the plan's prediction, for the 32B / 72B plans of issue 10, Qwen3-VL's and the mixture-of-experts ones.

    PYTHONPATH=$PWD python benchmarks/dry_run.py [--only NAME ...] [--out benchmarks/results/dry_run.txt]

Plans come from the planner's Python API. Plans that do not fit 8 x H100-80GB by the planner's own account (the
65,536-token SP8 + TP8 plan, the ZeRO-3 DP8 plans) are made for 8 x H200-141GB. Each configuration's report is
appended to the output as soon as it is measured.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

from planner.api import ClusterInputs, WorkloadInputs
from planner.api import plan as make_plan
from runtime.dry_run import dry_run
from runtime.dry_run.report import format_report
from runtime.training.trainer import RunOptions

OUT = Path(__file__).parent / "results" / "dry_run.txt"


@dataclass(kw_only=True, frozen=True)
class Config:
    """One plan request."""

    name: str
    """Short name (``--only``)."""
    model: str
    """Catalog model."""
    gpus: int
    """GPU count."""
    gpu: str = "h100-80gb"
    """Device."""
    vision_tokens: int | None = None
    """Vision tokens per sample (None: the default 1344 x 1344 image, 9,216 tokens)."""
    fix: tuple[str, ...] = field(default=())
    """``--fix`` pins."""
    videos: tuple[tuple[int, int, int], ...] = ()
    """``--video`` clips (frames, height, width)."""

    def command(self) -> str:
        parts = [f"plan --model {self.model} --gpus {self.gpus}"]
        if self.gpu != "h100-80gb":
            parts.append(f"--gpu {self.gpu}")
        if self.vision_tokens:
            parts.append(f"--vision-tokens {self.vision_tokens}")
        parts += [f"--video {f}x{h}x{w}" for f, h, w in self.videos]
        parts += [f"--fix {f}" for f in self.fix]
        return " ".join(parts)


SP8_TP8 = ("vision.sp=8", "llm.tp=8")
ZERO3_DP8 = ("vision.zero=3", "llm.zero=3", "vision.dp=8", "llm.dp=8")
CONFIGS = (
    Config(name="32b-default", model="qwen-vl-32b", gpus=16),
    Config(name="32b-sp8-tp8-16k", model="qwen-vl-32b", gpus=8, vision_tokens=16384, fix=SP8_TP8),
    Config(name="32b-sp8-tp8-64k", model="qwen-vl-32b", gpus=8, gpu="h200-141gb", vision_tokens=65536, fix=SP8_TP8),
    Config(name="32b-zero3-9k", model="qwen-vl-32b", gpus=8, gpu="h200-141gb", vision_tokens=9216, fix=ZERO3_DP8),
    Config(name="32b-zero3-16k", model="qwen-vl-32b", gpus=8, gpu="h200-141gb", vision_tokens=16384, fix=ZERO3_DP8),
    Config(name="72b-64gpus", model="qwen-vl-72b", gpus=64),
    Config(name="qwen3-32b-default", model="qwen3-vl-32b", gpus=16),
    Config(name="qwen3-32b-sp8-tp8-16k", model="qwen3-vl-32b", gpus=8, vision_tokens=16384, fix=SP8_TP8),
    Config(name="qwen3-32b-video-2min-720p", model="qwen3-vl-32b", gpus=16, videos=((240, 720, 1280),)),
    Config(name="qwen3-moe-30b-8gpus", model="qwen3-vl-30b-a3b", gpus=8),
    Config(name="qwen3-moe-30b-16gpus", model="qwen3-vl-30b-a3b", gpus=16),
    Config(name="qwen3-moe-30b-tp2-ep4", model="qwen3-vl-30b-a3b", gpus=8, fix=("llm.tp=2", "llm.ep=4")),
    Config(name="qwen3-moe-235b-64gpus", model="qwen3-vl-235b-a22b", gpus=64),
)


def run(config: Config) -> str:
    """Plan, dry-run, and the report's text."""
    start = time.perf_counter()
    plan = make_plan(config.model, ClusterInputs(gpus=config.gpus, gpu=config.gpu), fix=list(config.fix),
                     workload=WorkloadInputs(vision_tokens=config.vision_tokens, videos=config.videos))
    planned = time.perf_counter() - start
    report = dry_run(plan, RunOptions(), log=print)
    return (f"== {config.name}: {config.command()}  (planned in {planned:.0f} s, dry-run {report.seconds:.0f} s)\n"
            f"{format_report(report)}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="configuration names to run (default: all)")
    parser.add_argument("--out", default=str(OUT), help="file the reports are appended to")
    args = parser.parse_args()
    configs = [c for c in CONFIGS if not args.only or c.name in args.only]
    for config in configs:
        text = run(config)
        print(text, flush=True)
        with open(args.out, "a") as file:
            file.write(text + "\n")


if __name__ == "__main__":
    main()
