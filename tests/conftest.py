"""Shared fixtures. Keep additions additive: several areas of the project put fixtures here."""

import gc
import os
import tempfile

import pytest

os.environ.setdefault("DHPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="dhplan-test-cache-"))
"""Dataset caches (planner histograms, runtime indexes) of the test session go to a fresh folder, which the Ray
workers inherit (set before Ray starts), not to ~/.cache."""


RAY_TESTS = ("tests/runtime/test_cli.py", "tests/runtime/test_conversations.py", "tests/runtime/test_packed_data.py",
             "tests/runtime/test_packed_video.py", "tests/runtime/test_parity.py", "tests/runtime/test_recovery.py",
             "tests/runtime/test_run_faults.py", "tests/profile/test_fidelity.py")
"""Test files that start Ray (the session cluster, the warm workers, the launcher, the runtime's command line on the
session cluster): one test worker runs them all, in turn. tests/test_test_groups.py checks the list."""


def _starts_ray(nodeid: str) -> bool:
    return nodeid.startswith(RAY_TESTS)


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, Ray, the planner: ~1 M objects in a test worker) is taken out
    of the cyclic garbage collector's reach: every full collection of a test worker otherwise traverses it all
    (0.3 s each; planner-heavy files ran 12 % faster once it was frozen), as the runtime's training processes do
    (``runtime.training.trainer.freeze_startup_heap``)."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``pytest -n 2`` (``make test``): the Ray tests are one unit of work, which runs in turn on one test worker
    (first: xdist hands out the unit of most tests first) while the other takes every other test, one at a time
    (planner, cost model, dry-runs, notebooks, and the gloo-rank and torchrun tests), and the first worker free takes
    what is left. One session must own the Ray cluster whose ``ray::Worker`` processes the recovery tests count; the
    Ray tests' 2-4 workers and the other tests' processes share the two cores, so neither worker waits for the other
    (one unit of every many-process test left the second worker idle for the last 45 % of a run). (A scheduler of our
    own, not ``xdist_group`` marks: ``--dist loadgroup`` stopped grouping under pytest 9.2, pytest-dev/pytest-xdist#1386.)"""
    from xdist.scheduler import LoadScopeScheduling

    class RayTestsAsOne(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "Ray tests" if _starts_ray(nodeid) else nodeid

    return RayTestsAsOne(config, log)


@pytest.fixture(scope="session")
def ray_cluster():
    """Ray, started once per test session (~10 s here) with 4 CPU slots, so runtime tests can place up to 4
    single-CPU workers on this 2-core machine. A cluster of the session's own (``address="local"``), also where one
    started by ``ray start`` runs on this machine (``ray.init()`` would join that one instead)."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def worker_pool(ray_cluster):
    """Warm Ray workers (runtime.launch.launcher.WorkerPool) that the parity tests' jobs reuse: each job joins a fresh
    process group and builds fresh Trainers, without paying the workers' start-up again. Tests of start-up,
    recovery and the command line start their own."""
    from runtime.launch.launcher import WorkerPool

    pool = WorkerPool()
    yield pool
    pool.shutdown()
