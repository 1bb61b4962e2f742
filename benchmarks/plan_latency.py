"""Latency of the planner: the whole ``plan`` process, and candidate building + CP-SAT alone per cluster size.

    .venv/bin/python benchmarks/plan_latency.py [--repeats 5] [--sizes 8 16 64 256 1024] [--no-pp] [--workers N]

Whole process: ``plan --model qwen-vl-32b --gpus N --out <tmp>`` as a fresh process (Python start-up, imports,
candidates, both placements, tie-break, baselines, report), median of ``--repeats`` runs, at 16 and 1024 GPUs, with
the planner's bytecode cached (``byte_compile_planner``).
Search alone: for each N and placement, in one process, the time to enumerate, cost and prune the candidates and
solve them with CP-SAT (with pipeline parallelism: the plans without it first, then pipelined strategies costed on
demand, ``planner.search.solve_strategies``), and the candidates the best plan's placement handed to the solver. Workload: the ``plan`` defaults (one 1344x1344 image, 512 text
tokens, 4 samples per GPU). Targets: whole process <= 1.5 s at 16 GPUs and <= 10 s at 1024 GPUs (issue 3); goals
1 s and 3 s (issue 13). Mixture of experts: the whole process for ``MOE_MODEL`` (expert parallelism in the space)
at 1024 GPUs, goal 5 s (issue 31).
"""

from __future__ import annotations

import argparse
import importlib
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = "qwen-vl-32b"
MOE_MODEL = "qwen3-vl-235b-a22b"


def plan_command() -> list[str]:
    """The installed ``plan`` entry point next to this interpreter, else ``python -m planner.cli``."""
    script = Path(sys.executable).with_name("plan")
    return [str(script)] if script.exists() else [sys.executable, "-m", "planner.cli"]


def byte_compile_planner() -> None:
    """Write the planner's bytecode caches, as ``pip install`` does and as any run does unless
    ``PYTHONDONTWRITEBYTECODE`` is set (it is on the development machine): a user's ``plan`` does not compile the
    planner's sources every time (about 0.1 s here)."""
    import compileall

    import planner

    compileall.compile_dir(Path(planner.__file__).parent, quiet=1)


def whole_process_s(num_gpus: int, repeats: int, extra: list[str], model: str = MODEL) -> tuple[float, float]:
    """Median (wall, CPU) seconds of ``plan --model model --gpus num_gpus``; CPU time (user + system) shows how much
    of the wall time was the planner's own work when other processes load the machine."""
    walls, cpus = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats):
            before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
            subprocess.run([*plan_command(), "--model", model, "--gpus", str(num_gpus), "--out", f"{tmp}/p.json",
                            *extra], check=True, capture_output=True)
            walls.append(time.perf_counter() - start)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return statistics.median(walls), statistics.median(cpus)


def solver_row(num_gpus: int, placement: str, allow_pp: bool, workers: int) -> dict:
    """Search timing of one placement at ``num_gpus`` GPUs."""
    from planner.api import ClusterInputs, Infeasible, SearchOptions, make_problem
    from planner.search import solve_strategies

    problem = make_problem(MODEL, ClusterInputs(gpus=num_gpus, profile=None),
                           search=SearchOptions(allow_pp=allow_pp, workers=workers))
    start = time.perf_counter()
    try:
        best = solve_strategies(problem, placement, None, {}, 1, None)[0][0]
    except Infeasible:  # the search then also looks for what would fit
        return dict(gpus=num_gpus, placement=placement, kept=0, search_s=time.perf_counter() - start,
                    status="INFEASIBLE", step_s=float("nan"), pp=0)
    return dict(gpus=num_gpus, placement=placement, kept=best.num_candidates, search_s=time.perf_counter() - start,
                status=best.status, step_s=best.objective_s, pp=best.strategy.modules["llm"].pp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs of the whole process (median)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 64, 256, 1024])
    parser.add_argument("--no-pp", action="store_true", help="leave pipeline parallelism out (plan --no-pp)")
    parser.add_argument("--workers", type=int, help="processes that cost candidates (plan --workers; default: the "
                        "plan default, every CPU, for the whole process and 1 for the per-placement rows)")
    args = parser.parse_args()

    print(f"{'GPUs':>5} {'placement':>10} {'kept':>5} {'search':>7} {'status':>10} {'step time':>9} {'LLM pp':>6}")
    importlib.import_module("planner.search.solver.cp_sat")  # its OR-Tools import is not solver time

    for n in args.sizes:
        for placement in ("colocated", "disjoint"):
            r = solver_row(n, placement, not args.no_pp, args.workers or 1)
            print(f"{r['gpus']:5d} {r['placement']:>10} {r['kept']:5d} {r['search_s']:6.2f}s {r['status']:>10} "
                  f"{r['step_s']:8.3f}s {r['pp']:6d}")
    print()
    byte_compile_planner()
    for model, n, target, goal in ((MODEL, 16, 1.5, 1.0), (MODEL, 1024, 10.0, 3.0), (MOE_MODEL, 1024, 10.0, 5.0)):
        extra = (["--no-pp"] if args.no_pp else []) + ([f"--workers={args.workers}"] if args.workers else [])
        wall, cpu = whole_process_s(n, args.repeats if n <= 64 else max(1, args.repeats // 2), extra, model)
        print(f"whole process `plan --model {model} --gpus {n}{''.join(' ' + e for e in extra)}`: median {wall:.2f} s "
              f"wall, {cpu:.2f} s CPU "
              f"(target <= {target:g} s wall, goal {goal:g} s)")
    print(f"load average (1/5/15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
