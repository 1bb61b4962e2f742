"""A pytest plugin that writes each test's CPU seconds, of the whole machine (/proc/stat: the test's own process, its
ranks, Ray workers and subprocesses alike), and its wall seconds, one tab-separated line per test. Valid only for a
serial run on an otherwise quiet machine:

    PYTHONPATH=.:benchmarks TEST_CPU_OUT=cpu.tsv python -m pytest -q -p cpu_per_test tests
"""

import os
import time

import pytest


def _busy_seconds() -> float:
    """CPU seconds the machine has been busy since boot (every state but idle and iowait)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    busy, start = _busy_seconds(), time.monotonic()
    yield
    with open(os.environ.get("TEST_CPU_OUT", "test_cpu.tsv"), "a") as out:
        out.write(f"{_busy_seconds() - busy:.2f}\t{time.monotonic() - start:.2f}\t{item.nodeid}\n")
