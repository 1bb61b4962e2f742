"""Shared fixtures. Keep additions additive: several areas of the project put fixtures here."""

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
"""...but for these, which run in the test process alone (fake process groups, no ranks)."""


def pytest_collection_modifyitems(config, items):
    """Under ``pytest -n 2 --dist loadgroup`` (``make test``): the many-process tests form one group, run in turn on
    one test worker and first, since they are the longest share, while the other worker takes the single-process
    tests (planner, cost model, dry-runs, notebooks), which use one core each. The many-process tests keep to one
    worker because they use both cores between them, and because one session must own the Ray cluster whose
    ``ray::Worker`` processes the recovery tests count."""
    def many(item) -> bool:
        return item.nodeid.startswith(MANY_PROCESS_TESTS) and not item.nodeid.startswith(IN_PROCESS_TESTS)

    for item in items:
        if many(item):
            item.add_marker(pytest.mark.xdist_group("many_processes"))
    items.sort(key=lambda item: not many(item))  # stable: each share keeps its order


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
