"""Every test file that starts Ray (its session cluster, the warm workers, the launcher, the runtime's command line
on a cluster) is in the Ray share that ``tests/conftest.py`` keeps on one test worker, and nothing else is: two Ray
clusters at once would break the recovery tests' count of ``ray::Worker`` processes."""

from pathlib import Path

import pytest

from tests.conftest import RAY_TESTS, _starts_ray

TESTS = Path(__file__).resolve().parent
STARTS_RAY = ("worker_pool", "ray_cluster", "launcher.", "RAY_ADDRESS")


def _files_starting_ray() -> list[str]:
    return sorted(str(path.relative_to(TESTS.parent)) for path in TESTS.rglob("test_*.py")
                  if path.name != Path(__file__).name and any(s in path.read_text() for s in STARTS_RAY))


def test_the_files_that_start_ray_are_found():
    assert "tests/runtime/test_recovery.py" in _files_starting_ray()


@pytest.mark.parametrize("path", _files_starting_ray())
def test_a_file_that_starts_ray_is_in_the_ray_share(path):
    assert _starts_ray(f"{path}::test"), f"{path} starts Ray: add it to RAY_TESTS in tests/conftest.py"


def test_the_ray_share_holds_only_files_that_start_ray():
    assert sorted(RAY_TESTS) == _files_starting_ray()
