"""The prefetch worker dying (killed, out of memory) costs the rank nothing but time."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections import Counter

import pytest

from runtime.data.prefetch import Prefetcher

PAYLOAD_BYTES = 16 << 20
"""A sample far larger than a pipe's buffer (64 KiB): the worker blocks in the middle of sending it."""


class BulkySource:
    """Samples of ``PAYLOAD_BYTES`` pickled inline (not shared memory), one byte value per index."""

    skipped: Counter = Counter()

    def sample(self, index: int) -> dict[str, bytes]:
        return {"payload": bytes([index]) * PAYLOAD_BYTES}


def _worker_pid() -> int:
    (worker,) = multiprocessing.active_children()
    return worker.pid


def _take_within(prefetcher: Prefetcher, position: int, indexes: list[int], seconds: float = 30.0) -> dict:
    taken: dict = {}
    thread = threading.Thread(target=lambda: taken.update(prefetcher.take(position, indexes)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "take() hung on a dead worker"
    return taken


@pytest.mark.parametrize("when", ["idle", "sending"])
def test_a_killed_worker_is_replaced_and_its_samples_built_here(when):
    """Killed between steps, the next request forks a new worker; killed in the middle of sending a step's samples
    (the rank has read part of the message), the rank builds them itself: it does not wait for the rest."""
    source, prefetcher = BulkySource(), Prefetcher(BulkySource())
    try:
        prefetcher.submit(0, [1])
        assert _take_within(prefetcher, 0, [1]) == {1: source.sample(1)}
        first = _worker_pid()
        if when == "idle":
            os.kill(first, signal.SIGKILL)
            time.sleep(0.5)
            prefetcher.submit(1, [2])
            assert _worker_pid() != first  # a new worker builds step 1's samples
        else:
            prefetcher.submit(1, [2])
            time.sleep(1.0)  # the worker has built the sample and blocks writing it into the full pipe
            os.kill(first, signal.SIGKILL)
        assert _take_within(prefetcher, 1, [2]) == {2: source.sample(2)}
        assert prefetcher.restarts == 1
        prefetcher.submit(2, [3])
        assert _take_within(prefetcher, 2, [3]) == {3: source.sample(3)}
        assert _worker_pid() != first and prefetcher.restarts == 1  # the new worker built step 2's
    finally:
        prefetcher.close()
    assert not multiprocessing.active_children()


def test_ctrl_c_reaches_the_rank_and_not_its_prefetch_worker():
    """A terminal's Ctrl-C signals the whole process group: the worker ignores it (the rank ends the run in one
    line, runtime.__main__) and goes on serving instead of printing its own KeyboardInterrupt traceback."""
    source, prefetcher = BulkySource(), Prefetcher(BulkySource())
    try:
        prefetcher.submit(0, [1])
        assert _take_within(prefetcher, 0, [1]) == {1: source.sample(1)}
        worker = _worker_pid()
        os.kill(worker, signal.SIGINT)
        prefetcher.submit(1, [2])
        assert _take_within(prefetcher, 1, [2]) == {2: source.sample(2)}
        assert _worker_pid() == worker
    finally:
        prefetcher.close()
