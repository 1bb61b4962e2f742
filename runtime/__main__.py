"""``python -m runtime plan.json [--steps N] [--metrics FILE] [--checkpoint DIR] [--save DIR] [--data PATH] [--seed S]
[--tokenizer DIR] [--no-prefetch] [--checkpoint-dir DIR [--checkpoint-every K] [--keep-last N] [--max-failures N
[--elastic [SECONDS]]] [--adapt [STEPS] [--adapt-min-gain F] [--switch-cost SECONDS]]]
[--resume [PATH]] [--trace DIR [--trace-profiler]] [--balance modules|tokens] [--dry-run]``

Runs locally (starts Ray) or on the Ray cluster at RAY_ADDRESS / under ``ray job submit``; under
``torchrun --nproc-per-node N -m runtime plan.json`` each process runs one rank, without Ray.

The plan file, the paths and torchrun's environment are checked before torch and Ray are imported.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from planner.contract.file_io import refuse_shared_paths
from planner.contract.schema import Plan, PlanError, load_plan
from planner.contract.units import GIB
from runtime.run import preflight, run_lock
from runtime.run.checkpoint_dir import CheckpointOptions, latest_checkpoint
from runtime.run.stop_signals import name_and_status, stopping_on_signals

USER_ERRORS = (PlanError, ValueError, NotImplementedError, OSError)

DRY_RUN_FAILED = 3
"""Exit status of a dry-run that could not measure the plan: a fault, no memory verdict (1 is DOES NOT FIT)."""

REPORT_GRACE_S = 2.0
"""Under torchrun, how long the other ranks wait before exiting on a mistake every rank found and rank 0 reports:
torchrun stops the remaining ranks as soon as one exits, which could otherwise stop rank 0 before it printed."""

MAX_SEED = 2**63 - 1
"""Largest ``--seed``: torch's generators take a signed 64-bit seed, numpy's no negative one."""

ELASTIC_WAIT_S = 120.0
"""``--elastic`` without a value: how long a recovery waits for a lost device before re-planning without it."""
MAX_ELASTIC_WAIT_S = 86_400.0
"""Longest ``--elastic`` wait (a day)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m runtime", description="Train a model as a plan says, on Ray (or under torchrun)."
    )
    parser.add_argument("plan", help="plan JSON written by `plan --out`")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps to run (default 10)")
    parser.add_argument("--metrics", help="write one JSON line per step, then a summary line, to this file")
    parser.add_argument("--checkpoint", help="save_pretrained folder to start from (default: random init)")
    parser.add_argument("--save", help="after training, write the weights here with save_pretrained")
    parser.add_argument("--data", help="image-caption folder or JSONL, or a conversation JSONL (Qwen-VL / LLaVA "
                        "`conversations` or `messages` rows; needs --tokenizer) (default: synthetic data)")
    parser.add_argument("--tokenizer", help="model folder whose tokenizer and chat template conversation data goes "
                        "through (loss on the assistant turns only)")
    parser.add_argument("--data-root-only", action="store_true", help="read only files inside --data's folder "
                        "(resolved, symlinks followed): rows naming one outside (an absolute path, ../) are skipped "
                        "and counted, a caption line naming one refused; by default rows may name any file")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random init and synthetic data")
    parser.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True,
                        help="build the next step's samples in a worker process per rank during each step "
                        "(default); --no-prefetch builds them in the step loop")
    parser.add_argument("--checkpoint-dir", help="write sharded training checkpoints (weights, optimizer, schedule, "
                        "data position) into this folder, after the last step and every --checkpoint-every steps")
    parser.add_argument("--checkpoint-every", type=int, help="steps between checkpoints (default: only at the end)")
    parser.add_argument("--keep-last", type=int, help="keep only this many newest checkpoints (default: all)")
    parser.add_argument("--resume", nargs="?", const="latest", help="continue from a checkpoint folder, or without "
                        "a path from the latest complete one in --checkpoint-dir (the plan may differ from the one "
                        "that wrote it); --steps counts the steps already done")
    parser.add_argument("--async-checkpoint", action="store_true", help="write checkpoints from a thread while "
                        "training goes on (DCP async_save); the step stalls only while the state is copied")
    parser.add_argument("--dry-run", action="store_true", help="run one step of each distinct rank role on fake "
                        "tensors with a fake process group of the plan's size (no GPU, no memory): the runtime's "
                        "own peak memory per category beside the plan's prediction; exit 0 if it fits, 1 if not, "
                        "3 if it could not measure")
    parser.add_argument("--trace", metavar="DIR", help="write each step's measured timeline as a Chrome trace, "
                        "DIR/step-<k>.json (every rank's timed spans; `plan --trace` writes the predicted one; open "
                        "them in ui.perfetto.dev)")
    parser.add_argument("--trace-profiler", action="store_true", help="with --trace: each rank also writes "
                        "torch.profiler's trace of every step, DIR/profiler-step-<k>-rank-<r>.json (slower steps)")
    parser.add_argument("--balance", default="modules", help="how a dataset plan's steps are split over the "
                        "replicas: modules (default: each module's replicas on its own work, as the plan priced it) "
                        "or tokens (the earlier split, to compare: packs by LLM tokens, vision replica d running LLM "
                        "replica d's images)")
    parser.add_argument("--max-failures", type=int, default=0, help="on Ray: restart from the latest checkpoint "
                        "at most this many times when a worker dies (default 0)")
    parser.add_argument("--elastic", type=float, nargs="?", const=ELASTIC_WAIT_S, metavar="SECONDS",
                        help="on Ray, with --max-failures: when a lost worker's device is not back within SECONDS "
                        f"(default {ELASTIC_WAIT_S:g}), re-plan for the devices left (same global batch) and resume "
                        "there from the latest checkpoint; back to the first plan when they return")
    parser.add_argument("--adapt", type=int, nargs="?", const=3, metavar="STEPS",
                        help="on Ray, with --checkpoint-every: after STEPS measured steps (default 3), fit the cost "
                        "model to them and to collectives timed on the run's devices, re-plan, and switch plans at a "
                        "checkpoint when the new one is predicted faster and its gain over the steps left covers the "
                        "switch's cost; after STEPS more, switch back if it measures slower")
    parser.add_argument("--adapt-min-gain", type=float, default=0.05, metavar="F",
                        help="with --adapt: the smallest predicted gain, as a share of the step, worth a switch "
                        "(default 0.05)")
    parser.add_argument("--switch-cost", type=float, metavar="SECONDS",
                        help="with --adapt: seconds a switch costs (default: measured: the job's start-up, its first "
                        "step's extra time and a checkpoint's stall)")
    parser.add_argument("--memory-cap-gib", type=float, metavar="GIB",
                        help="CPU plans: let each worker hold at most GIB of tensors (torch's MemTracker counts them); "
                        "a step that needs more fails as out of memory, as a device of that size would (with "
                        "--adapt the run re-plans on its measured memory and resumes from the last checkpoint)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    return args


def check_flags(args: argparse.Namespace) -> None:
    """The checkpoint flags make sense together; raises ValueError (one line)."""
    for flag in ("checkpoint_every", "keep_last"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.max_failures < 0:
        raise ValueError(f"--max-failures must be >= 0, got {args.max_failures}")
    if args.elastic is not None:
        if not 0 <= args.elastic <= MAX_ELASTIC_WAIT_S:
            raise ValueError(f"--elastic waits 0 to {MAX_ELASTIC_WAIT_S:g} s for lost devices, got {args.elastic:g}")
        if not args.max_failures:
            raise ValueError("--elastic re-plans when a worker is lost: give --max-failures N too (how many times)")
    check_adapt_flags(args)
    if args.memory_cap_gib is not None and not 0 < args.memory_cap_gib < float("inf"):
        raise ValueError(f"--memory-cap-gib must be a positive number of GiB, got {args.memory_cap_gib:g}")
    if not 0 <= args.seed <= MAX_SEED:
        raise ValueError(f"--seed must be 0 to {MAX_SEED:,} (what torch and numpy seed with), got {args.seed}")
    needs_dir = [f for f in ("checkpoint_every", "keep_last") if getattr(args, f) is not None]
    needs_dir += ["async_checkpoint"] if args.async_checkpoint else []
    needs_dir += ["max_failures"] if args.max_failures else []
    if needs_dir and args.checkpoint_dir is None:
        raise ValueError(f"--{needs_dir[0].replace('_', '-')} needs --checkpoint-dir (where checkpoints go)")
    if args.resume is not None and args.checkpoint is not None:
        raise ValueError("--resume and --checkpoint both set the starting weights: give one")
    if args.trace_profiler and args.trace is None:
        raise ValueError("--trace-profiler needs --trace DIR (where the traces go)")
    if args.trace is not None and args.dry_run:
        raise ValueError("--trace records the steps of a run; --dry-run runs none (drop one of them)")


def check_adapt_flags(args: argparse.Namespace) -> None:
    """``--adapt`` and its settings make sense; raises ValueError (one line)."""
    if args.adapt is None:
        given = [f for f, v in (("--adapt-min-gain", args.adapt_min_gain != 0.05), ("--switch-cost",
                                                                                 args.switch_cost is not None)) if v]
        if given:
            raise ValueError(f"{given[0]} sets how --adapt decides: give --adapt too")
        return
    if args.adapt < 1:
        raise ValueError(f"--adapt measures at least 1 step before re-planning, got {args.adapt}")
    if not 0 <= args.adapt_min_gain < 1:
        raise ValueError(f"--adapt-min-gain is a share of the step in [0, 1), got {args.adapt_min_gain:g}")
    if args.switch_cost is not None and not 0 <= args.switch_cost < 86_400:
        raise ValueError(f"--switch-cost is seconds in [0, 86400), got {args.switch_cost:g}")
    if args.checkpoint_every is None:
        raise ValueError("--adapt switches plans at checkpoints: give --checkpoint-dir and --checkpoint-every K")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        env = preflight.TorchrunEnv.from_environ(os.environ)
    except ValueError as e:
        return _refuse(e)
    try:
        check_flags(args)
        plan = load_plan(args.plan)
        preflight.check_plan(plan)
        preflight.check_balance(plan, args.balance)
        if args.dry_run and plan.workload.dataset is not None:
            raise NotImplementedError("--dry-run measures fixed-shape plans; one made for a dataset (its heaviest "
                                      "pack) is not synthesised yet: plan with --image-size/--text-tokens to dry-run")
        if env is not None:
            preflight.check_world_size(plan, env)
        preflight.check_inputs(plan, data=args.data, checkpoint=args.checkpoint, tokenizer=args.tokenizer)
        check_paths_differ(args)
        # the metrics file is written by the driver, or rank 0 under torchrun: only that process probes it (every
        # rank creating and removing the same probe file raced, one rank then failing on a file another removed)
        preflight.check_outputs(metrics=args.metrics if env is None or env.rank == 0 else None, save=args.save)
        requested_resume = args.resume
        if args.resume is not None:  # the shards are checked once torch may be imported (below)
            args.resume = preflight.check_resume(args.resume, args.checkpoint_dir, plan.model.hf_config,
                                                 steps=args.steps)
        if args.checkpoint_dir is not None:
            preflight.prepare_folder(args.checkpoint_dir, "--checkpoint-dir")
        if args.trace is not None:
            preflight.prepare_folder(args.trace, "--trace")
        if env is not None and args.dry_run:
            raise ValueError("--dry-run runs every rank role in this one process: run it without torchrun")
        if env is not None and args.elastic is not None:
            raise ValueError("torchrun runs are not elastic (--elastic re-plans on Ray's view of the cluster): run "
                             "without torchrun, on Ray")
        if env is not None and args.adapt is not None:
            raise ValueError("torchrun runs do not adapt (--adapt restarts the job under another plan on Ray): run "
                             "without torchrun, on Ray")
        if env is not None and args.max_failures:
            raise ValueError("--max-failures is for the Ray launcher; under torchrun use torchrun's --max-restarts "
                             "with --resume")
    except USER_ERRORS as e:
        return _refuse(e, report=env is None or env.rank == 0)  # every torchrun rank finds the same mistake
    if args.dry_run:
        return _dry_run(plan, args)
    report = env is None or env.rank == 0
    owned = _owned_outputs(args) if report else ({}, {})  # under torchrun, rank 0 holds them for every rank
    with stopping_on_signals():
        try:
            with run_lock.hold(*owned):
                if args.resume is not None:
                    args.resume = _sound_resume(requested_resume, args, plan, report=report)
                if env is None:
                    return _run_on_ray(plan, args)
                return _run_under_torchrun(plan, args, env)
        except USER_ERRORS as e:
            return _refuse(e, report=report)
        except KeyboardInterrupt as e:  # Ctrl-C, or a scheduler's SIGTERM (runtime.run.stop_signals)
            return _interrupted(args, e, report=report)


def check_paths_differ(args: argparse.Namespace) -> None:
    """No output is the same file or folder as an input or another output (``planner.contract.file_io.refuse_shared_paths``);
    ``--checkpoint-dir`` may be the folder ``--resume`` takes the latest checkpoint from."""
    outputs = {"--metrics": args.metrics, "--save": args.save, "--checkpoint-dir": args.checkpoint_dir,
               "--trace": args.trace}
    inputs = {"the plan file": args.plan, "--checkpoint": args.checkpoint, "--data": args.data,
              "--tokenizer": args.tokenizer}
    refuse_shared_paths(inputs, outputs)
    resume = None if args.resume in (None, "latest") else args.resume
    refuse_shared_paths({"--resume": resume}, {k: v for k, v in outputs.items() if k != "--checkpoint-dir"})


def _owned_outputs(args: argparse.Namespace) -> tuple[dict[str, str | None], dict[str, str | None]]:
    """What a run owns and locks for its life (``runtime.run.run_lock``): its metrics file and checkpoint folder."""
    return {"--metrics": args.metrics}, {"--checkpoint-dir": args.checkpoint_dir}


def _sound_resume(requested: str, args: argparse.Namespace, plan: Plan, *, report: bool) -> str:
    """``preflight.check_resume`` with the DCP shards checked too (imports torch): from the latest, damaged
    checkpoints are passed over, saying so in one line; a damaged one named is refused."""
    from runtime.checkpoints.dcp_checkpoint import checkpoint_problem

    def warn(line: str) -> None:
        if report:
            print(f"runtime: warning: {line}", file=sys.stderr)

    return preflight.check_resume(requested, args.checkpoint_dir, plan.model.hf_config, steps=args.steps,
                                  problem=checkpoint_problem, warn=warn)


def _interrupted(args: argparse.Namespace, stop: KeyboardInterrupt, *, report: bool) -> int:
    """Ctrl-C or another stop signal: one line naming the complete checkpoint the run can resume from, if there is
    one; the exit status is 128 + the signal's number."""
    what, status = name_and_status(stop)
    newest = latest_checkpoint(args.checkpoint_dir) if args.checkpoint_dir else None
    newest = newest or args.resume
    where = (f"resume with --resume {newest}" if newest else
             "no complete checkpoint was written to resume from" + ("" if args.checkpoint_dir else
                                                                  " (--checkpoint-dir writes them)"))
    if report:
        print(f"runtime: interrupted ({what}): {where}", file=sys.stderr)
    return status


def _run_on_ray(plan: Plan, args: argparse.Namespace) -> int:
    from ray.exceptions import RayActorError, RayTaskError

    from runtime.launch.launcher import run

    options = _run_options(args)
    try:
        run(plan, options, steps=args.steps, metrics_path=args.metrics, save=args.save,
            checkpoints=_checkpoint_options(args), adapt=_adapt_options(args))
    except preflight.SavedElsewhere as e:
        return _refuse(e, status=1)
    except RayTaskError as e:  # a worker's error, wrapped by Ray (also an instance of the error's own class)
        if isinstance(e.cause, USER_ERRORS):
            return _refuse(e.cause)
        # the launcher restarted the job for it (up to --max-failures): a peer lost in a collective, a dead
        # device, or a fault in the runtime, whose stack is in the Ray worker's log
        return _refuse(_worker_failure(e.cause, args.max_failures), status=1)
    except USER_ERRORS as e:
        return _refuse(e)
    except RayActorError as e:
        return _refuse(_worker_failure(e, args.max_failures), status=1)
    return 0


def _run_options(args: argparse.Namespace):
    """What the command line adds to the plan (``runtime.training.trainer.RunOptions``)."""
    from runtime.training.trainer import RunOptions

    return RunOptions(seed=args.seed, data=args.data, tokenizer=args.tokenizer, data_root_only=args.data_root_only,
                      prefetch=args.prefetch,
                      checkpoint=args.checkpoint, resume=args.resume, trace=args.trace,
                      trace_profiler=args.trace_profiler, balance=args.balance,
                      memory_cap_bytes=None if args.memory_cap_gib is None else round(args.memory_cap_gib * GIB))


def _dry_run(plan: Plan, args: argparse.Namespace) -> int:
    from runtime.dry_run import dry_run
    from runtime.dry_run.report import format_report
    from runtime.training.trainer import RunOptions

    try:
        report = dry_run(plan, RunOptions(seed=args.seed), log=lambda line: print(line, file=sys.stderr))
    except USER_ERRORS as e:
        return _refuse(e)
    except Exception as e:  # a fault of the dry-run itself: say so, never as DOES NOT FIT's status
        return _refuse(f"the dry-run failed, so no memory verdict ({type(e).__name__}: {_first_line(e)}); please "
                       "report it with the plan file", status=DRY_RUN_FAILED)
    print(format_report(report))
    return 0 if report.fits else 1


def _worker_failure(error: BaseException, max_failures: int) -> str:
    """One line for a worker failure that ended the run (after ``max_failures`` recoveries)."""
    what = "a worker died" if type(error).__name__.endswith("ActorDiedError") else "a worker failed"
    detail = f"{type(error).__name__}: {_first_line(error)}"[:200]
    return (f"{what} and the run stopped after {max_failures} recoveries (--max-failures {max_failures}); resume "
            f"with --resume from the latest checkpoint in --checkpoint-dir ({detail})")


def _adapt_options(args: argparse.Namespace):
    """``--adapt``'s settings (``runtime.launch.adapt.AdaptOptions``), None without it."""
    if args.adapt is None:
        return None
    from runtime.launch.adapt import AdaptOptions

    return AdaptOptions(warmup_steps=args.adapt, min_gain=args.adapt_min_gain, switch_cost_s=args.switch_cost)


def _checkpoint_options(args: argparse.Namespace) -> CheckpointOptions:
    return CheckpointOptions(directory=args.checkpoint_dir, every=args.checkpoint_every, keep_last=args.keep_last,
                             max_failures=args.max_failures, overlap=args.async_checkpoint,
                             elastic_wait_s=args.elastic)


def _run_under_torchrun(plan: Plan, args: argparse.Namespace, env: preflight.TorchrunEnv) -> int:
    from runtime.launch.driver import validate_plan
    from runtime.launch.torchrun import run

    options = _run_options(args)
    try:
        validate_plan(plan, options)
    except USER_ERRORS as e:
        return _refuse(e, report=env.rank == 0)  # the same on every rank
    try:
        run(plan, options, env, steps=args.steps, metrics_path=args.metrics, save=args.save,
            checkpoints=_checkpoint_options(args))
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
