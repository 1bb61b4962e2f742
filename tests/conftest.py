"""Shared fixtures. Keep additions additive: several areas of the project put fixtures here."""

import os
import tempfile

import pytest

os.environ.setdefault("DHPLAN_CACHE_DIR", tempfile.mkdtemp(prefix="dhplan-test-cache-"))
"""Dataset caches (planner histograms, runtime indexes) of the test session go to a fresh folder, which the Ray
workers inherit (set before Ray starts), not to ~/.cache."""


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
