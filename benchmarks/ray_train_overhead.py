"""Runtime overhead on CPU under Ray Train: the runtime's Trainer inside a ``TorchTrainer`` vs a plain PyTorch step,
with the plain-actor launcher (runtime.launch.launcher) measured in the same run for comparison.

The model, plan, samples and plain step are benchmarks/runtime_overhead.py's (imported, not copied). The
TorchTrainer runs one worker (``ScalingConfig(num_workers=1, use_gpu=False, resources_per_worker={"CPU": 1})``,
``RunConfig(storage_path=<temp dir>)``); its ``train_loop_per_worker`` builds ``runtime.training.trainer.Trainer`` on the
gloo process group Ray Train initialised and ``ray.train.report``s every step's ``step_time_s``.

Same load: the three loops run in lockstep, one step each in turn (plain in this process, then the launcher's
actor, then the TorchTrainer worker), so only one of them computes at any time and background load on a shared
machine hits all alike. The TorchTrainer worker waits for its turn on a Ray queue outside its timed region.

Printed: the median step time of plain PyTorch; of the launcher's actor (its own step timer, and the driver's
wall of ``job.step()``); of the Trainer inside TorchTrainer (its own step timer, and the loop's wall from the step's
start until ``ray.train.report`` returned); each one's ratio to plain (target <= 1.10); and the start-up time of
``launcher.start`` vs ``TorchTrainer.fit()`` until the worker's Trainer is built. Then the TorchTrainer worker
runs as many steps again alone, back to back (step + report, no lockstep): what a real run reporting every step
sees, including waits on Ray Train's controller, which takes one report per poll of its workers.

    PYTHONPATH=$PWD python benchmarks/ray_train_overhead.py [--steps 8]   # needs pip install "ray[train]"
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from queue import Empty

try:
    import ray.train
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    from ray.util.queue import Queue
except ImportError:
    print('error: this benchmark needs Ray Train: pip install "ray[train]==2.60.0" (adds pyarrow and friends)',
          file=sys.stderr)
    sys.exit(2)
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.runtime_overhead import WARMUP_STEPS, PlainStep, benchmark_plan  # noqa: E402
from runtime.launch import launcher  # noqa: E402
from runtime.training.trainer import RunOptions, Trainer  # noqa: E402

WAIT_S = 600
"""Longest wait for the TorchTrainer worker's next message before the benchmark gives up."""


def train_loop_per_worker(config: dict) -> None:
    """Ray Train's worker: build the runtime's Trainer on Ray Train's process group, then one step per ``go``
    token, each reported with ``ray.train.report`` and sent back on the ``done`` queue with its timings."""
    torch.set_num_threads(1)
    entered = time.time()
    trainer = Trainer(config["plan"], rank=ray.train.get_context().get_world_rank(), options=RunOptions(seed=0))
    config["done"].put({"entered": entered, "built": time.time()})
    for _ in range(config["steps"]):
        config["go"].get()
        start = time.perf_counter()
        result = trainer.train_step()
        reported = time.perf_counter()
        ray.train.report({"step": trainer.step, "loss": result["loss"], "step_time_s": result["step_time_s"]})
        end = time.perf_counter()
        config["done"].put({"step_time_s": result["step_time_s"], "loop_s": end - start, "report_s": end - reported})
    free = []
    for _ in range(config["free_steps"]):
        start = time.perf_counter()
        result = trainer.train_step()
        ray.train.report({"step": trainer.step, "loss": result["loss"], "step_time_s": result["step_time_s"]})
        free.append(time.perf_counter() - start)
    config["done"].put({"free_loop_s": free})


def _receive(done: Queue, fit: threading.Thread, errors: list[BaseException]) -> dict:
    """The worker's next message; raises if ``fit()`` ended (failed) or nothing came for ``WAIT_S``."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            return done.get(timeout=5)
        except Empty:
            if not fit.is_alive():
                raise RuntimeError(f"TorchTrainer.fit() ended early: {errors[0] if errors else 'no error'}")
    raise TimeoutError(f"no message from the TorchTrainer worker in {WAIT_S} s")


def measure(plan, steps: int, storage: str) -> dict[str, list[float]]:
    """Every loop's step times (and the start-up times as one-element lists), the loops in lockstep; then the
    TorchTrainer worker's loop alone for as many steps, free-running (``free_loop``)."""
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {key: [] for key in ("plain", "actor", "actor_driver", "ray_train",
                                                          "ray_train_loop", "report")}
    plain = PlainStep(plan)
    start = time.perf_counter()
    job = launcher.start(plan, RunOptions(seed=0))
    times["actor_start"] = [time.perf_counter() - start]
    go, done = Queue(actor_options={"num_cpus": 0}), Queue(actor_options={"num_cpus": 0})
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"plan": plan, "steps": steps, "free_steps": steps, "go": go, "done": done},
        scaling_config=ScalingConfig(num_workers=1, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(storage_path=storage, name="ray_train_overhead"),
    )
    errors: list[BaseException] = []

    def fit() -> None:
        try:
            trainer.fit()
        except BaseException as e:  # surfaced by _receive in the main thread
            errors.append(e)

    try:
        fit_called = time.time()
        fit_thread = threading.Thread(target=fit, daemon=True)
        fit_thread.start()
        ready = _receive(done, fit_thread, errors)
        times["ray_train_start"] = [ready["built"] - fit_called]
        times["ray_train_enter"] = [ready["entered"] - fit_called]
        for _ in range(steps):
            times["plain"].append(plain())
            start = time.perf_counter()
            results = job.step()
            times["actor_driver"].append(time.perf_counter() - start)
            times["actor"].append(results[0]["step_time_s"])
            go.put(None)
            message = _receive(done, fit_thread, errors)
            times["ray_train"].append(message["step_time_s"])
            times["ray_train_loop"].append(message["loop_s"])
            times["report"].append(message["report_s"])
        times["free_loop"] = _receive(done, fit_thread, errors)["free_loop_s"]
        fit_thread.join(timeout=WAIT_S)
        if errors:
            raise RuntimeError(f"TorchTrainer.fit() failed: {errors[0]}")
    finally:
        job.shutdown()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="measured steps (after 2 warm-up steps)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    plan = benchmark_plan()
    launcher.ensure_ray()
    with tempfile.TemporaryDirectory(prefix="ray_train_overhead_") as storage:
        times = measure(plan, WARMUP_STEPS + args.steps, storage)
    median = {key: statistics.median(t[WARMUP_STEPS:]) for key, t in times.items() if len(t) > 1}
    plain = median["plain"]
    print(f"{args.steps} measured steps after {WARMUP_STEPS} warm-up, loops in lockstep, median step time:")
    print(f"plain PyTorch step                        {plain * 1e3:8.1f} ms")
    for key, label in (("actor", "plain actors (in worker)"), ("actor_driver", "plain actors (by driver)"),
                       ("ray_train", "TorchTrainer (in worker)"), ("ray_train_loop", "TorchTrainer (step + report)")):
        print(f"{label:42s}{median[key] * 1e3:8.1f} ms   ratio {median[key] / plain:.3f}   (target <= 1.10)")
    print(f"start-up: launcher.start {times['actor_start'][0]:.1f} s; TorchTrainer.fit() to Trainer built "
          f"{times['ray_train_start'][0]:.1f} s (to train loop entered {times['ray_train_enter'][0]:.1f} s)")
    poll = os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2.0 (default)")
    print(f"ray.train.report alone: median {median['report'] * 1e3:.1f} ms per call; Ray Train controller poll "
          f"interval RAY_TRAIN_HEALTH_CHECK_INTERVAL_S = {poll} s")
    print(f"TorchTrainer free-running (step + report, no lockstep, after the others): median "
          f"{median['free_loop'] * 1e3:.1f} ms   ratio {median['free_loop'] / plain:.3f} to the plain step above")


if __name__ == "__main__":
    main()
