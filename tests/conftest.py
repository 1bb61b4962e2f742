"""Shared fixtures. Keep additions additive: several areas of the project put fixtures here."""

import gc
import os
import tempfile

import pytest

os.environ.setdefault("DHPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="dhplan-test-cache-"))
"""Dataset caches (planner histograms, runtime indexes) of the test session go to a fresh folder, which the Ray
workers inherit (set before Ray starts), not to ~/.cache."""


MANY_PROCESS_TESTS = ("tests/runtime/", "tests/profile/", "tests/test_gpu_check.py")
"""Tests that train on several processes (gloo ranks, Ray workers, torchrun, the runtime's command line)..."""
IN_PROCESS_TESTS = ("tests/runtime/test_dry_run.py", "tests/runtime/test_units.py",
                    "tests/runtime/test_hf_config_contract.py", "tests/runtime/test_checkpoint_io.py")
"""...but for these, which run in the test process (fake process groups; no Ray: the dry-run's comparison with
real peaks alone spawns 2-4 gloo ranks, a small share left beside the many-process tests; tests/test_test_groups.py
checks that every file starting Ray is in the many-process share)."""


def _many_processes(nodeid: str) -> bool:
    return nodeid.startswith(MANY_PROCESS_TESTS) and not nodeid.startswith(IN_PROCESS_TESTS)


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, Ray, the planner: ~1 M objects in a test worker) is taken out
    of the cyclic garbage collector's reach: every full collection of a test worker otherwise traverses it all
    (0.3 s each; planner-heavy files ran 12 % faster once it was frozen), as the runtime's training processes do
    (``runtime.training.trainer.freeze_startup_heap``)."""
    gc.collect()
    gc.freeze()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under ``pytest -n 2`` (``make test``): the many-process tests are one unit of work, which runs in turn on one
    test worker (first: xdist hands out the largest unit first) while the other takes the single-process tests
    (planner, cost model, dry-runs, notebooks), which use one core each. The many-process tests keep to one worker
    because they use both cores between them, and because one session must own the Ray cluster whose
    ``ray::Worker`` processes the recovery tests count. (A scheduler of our own, not ``xdist_group`` marks:
    ``--dist loadgroup`` stopped grouping under pytest 9.2, pytest-dev/pytest-xdist#1386.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ManyProcessesAsOne(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "many-process tests" if _many_processes(nodeid) else nodeid

    return ManyProcessesAsOne(config, log)


@pytest.fixture(scope="session")
def ray_cluster():
    """Ray, started once per test session (~10 s here) with 4 CPU slots, so runtime tests can place up to 4
    single-CPU workers on this 2-core machine."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
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
