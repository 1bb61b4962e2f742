"""``python -m runtime plan.json [--steps N] [--metrics FILE] [--checkpoint DIR] [--save DIR] [--data PATH] [--seed S]``

Runs locally (starts Ray) or on the Ray cluster at RAY_ADDRESS / under ``ray job submit``; under
``torchrun --nproc-per-node N -m runtime plan.json`` each process runs one rank, without Ray.

The plan file, the paths and torchrun's environment are checked before torch and Ray are imported.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from planner.schema import Plan, PlanError, load_plan
from runtime import preflight

USER_ERRORS = (PlanError, ValueError, NotImplementedError, OSError)

REPORT_GRACE_S = 2.0
"""Under torchrun, how long the other ranks wait before exiting on a mistake every rank found and rank 0 reports:
torchrun stops the remaining ranks as soon as one exits, which could otherwise stop rank 0 before it printed."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m runtime", description="Train a model as a plan says, on Ray (or under torchrun)."
    )
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
    try:
        env = preflight.TorchrunEnv.from_environ(os.environ)
    except ValueError as e:
        return _refuse(e)
    try:
        plan = load_plan(args.plan)
        preflight.check_plan(plan)
        if env is not None:
            preflight.check_world_size(plan, env)
        preflight.check_inputs(plan, data=args.data, checkpoint=args.checkpoint)
        preflight.check_outputs(metrics=args.metrics, save=args.save)
    except USER_ERRORS as e:
        return _refuse(e, report=env is None or env.rank == 0)  # every torchrun rank finds the same mistake
    if env is None:
        return _run_on_ray(plan, args)
    return _run_under_torchrun(plan, args, env)


def _run_on_ray(plan: Plan, args: argparse.Namespace) -> int:
    from ray.exceptions import RayTaskError

    from runtime.launcher import run
    from runtime.trainer import RunOptions

    options = RunOptions(seed=args.seed, data=args.data, checkpoint=args.checkpoint)
    try:
        run(plan, options, steps=args.steps, metrics_path=args.metrics, save=args.save)
    except preflight.SavedElsewhere as e:
        return _refuse(e, status=1)
    except USER_ERRORS + (RayTaskError,) as e:
        cause = e.cause if isinstance(e, RayTaskError) else e  # a worker's error arrives wrapped by Ray
        if not isinstance(cause, USER_ERRORS):
            raise
        return _refuse(cause)
    return 0


def _run_under_torchrun(plan: Plan, args: argparse.Namespace, env: preflight.TorchrunEnv) -> int:
    from runtime.driver import validate_plan
    from runtime.torchrun import run
    from runtime.trainer import RunOptions

    options = RunOptions(seed=args.seed, data=args.data, checkpoint=args.checkpoint)
    try:
        validate_plan(plan, options)
    except USER_ERRORS as e:
        return _refuse(e, report=env.rank == 0)  # the same on every rank
    try:
        run(plan, options, env, steps=args.steps, metrics_path=args.metrics, save=args.save)
    except preflight.SavedElsewhere as e:
        return _refuse(e, status=1, report=env.rank == 0)
    except USER_ERRORS as e:
        return _refuse(e)
    except RuntimeError as e:
        if not _raised_in_collective(e):
            raise
        # a peer rank failed (it printed its own line) and closed its connections: no traceback for that
        return _refuse(f"rank {env.rank} stopped: another rank failed ({_first_line(e)})", status=1)
    return 0


def _raised_in_collective(error: BaseException) -> bool:
    """Whether ``error`` was raised inside torch.distributed (a collective or a point-to-point operation)."""
    frame = error.__traceback__
    while frame.tb_next is not None:
        frame = frame.tb_next
    return f"torch{os.sep}distributed{os.sep}" in frame.tb_frame.f_code.co_filename


def _first_line(error: BaseException) -> str:
    """The first sentence of the error's message, the C++ source location that raised it left off."""
    message = " ".join(str(error).split())
    message = message.split("] ", 1)[-1] if message.startswith("[") else message
    return message.split(". ", 1)[0]


def _refuse(error: BaseException | str, *, status: int = 2, report: bool = True) -> int:
    """Print ``error`` as the one line ``runtime: error: ...`` (if ``report``) and return the exit status."""
    if report:
        print(f"runtime: error: {error}", file=sys.stderr)
    else:
        time.sleep(REPORT_GRACE_S)
    return status


if __name__ == "__main__":
    sys.exit(main())
