"""Every test file that starts Ray (its session cluster, the warm workers, the launcher, the runtime's command line
on a cluster) is in the many-process share that ``tests/conftest.py`` keeps on one test worker: two Ray clusters at
once would break the recovery tests' count of ``ray::Worker`` processes and overload the two cores."""

from pathlib import Path

import pytest

from tests.conftest import _many_processes

TESTS = Path(__file__).resolve().parent
STARTS_RAY = ("worker_pool", "ray_cluster", "launcher.", "RAY_ADDRESS")


def _files_starting_ray() -> list[str]:
    return sorted(str(path.relative_to(TESTS.parent)) for path in TESTS.rglob("test_*.py")
                  if path.name != Path(__file__).name and any(s in path.read_text() for s in STARTS_RAY))


def test_the_files_that_start_ray_are_found():
    assert "tests/runtime/test_recovery.py" in _files_starting_ray()


@pytest.mark.parametrize("path", _files_starting_ray())
def test_a_file_that_starts_ray_is_in_the_many_process_share(path):
    assert _many_processes(f"{path}::test"), f"{path} starts Ray: add it to MANY_PROCESS_TESTS in tests/conftest.py"
