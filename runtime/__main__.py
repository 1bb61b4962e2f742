"""``python -m runtime plan.json [--steps N] [--metrics FILE] [--checkpoint DIR] [--save DIR] [--data PATH] [--seed S]``

Runs locally (starts Ray) or on the Ray cluster at RAY_ADDRESS / under ``ray job submit``.
"""

from __future__ import annotations

import argparse
import sys

from planner.schema import PlanError, load_plan

USER_ERRORS = (PlanError, ValueError, NotImplementedError)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m runtime", description="Train a model as a plan says, on Ray.")
    parser.add_argument("plan", help="plan JSON written by `plan --out`")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps to run (default 10)")
    parser.add_argument("--metrics", help="write one JSON line per step, then a summary line, to this file")
    parser.add_argument("--checkpoint", help="save_pretrained folder to start from (default: random init)")
    parser.add_argument("--save", help="after training, write the weights here with save_pretrained")
    parser.add_argument("--data", help="image-caption folder or JSONL (default: synthetic data)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random init and synthetic data")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from ray.exceptions import RayTaskError

    from runtime.launcher import run
    from runtime.trainer import RunOptions

    options = RunOptions(seed=args.seed, data=args.data, checkpoint=args.checkpoint)
    try:
        run(load_plan(args.plan), options, steps=args.steps, metrics_path=args.metrics, save=args.save)
    except USER_ERRORS + (RayTaskError,) as e:
        cause = e.cause if isinstance(e, RayTaskError) else e  # a worker's error arrives wrapped by Ray
        if not isinstance(cause, USER_ERRORS):
            raise
        print(f"runtime: error: {cause}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
