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
from runtime.observability.metrics import innermost_frame

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


class SlowInWorkerSource:
    """Samples naming the process that built them: built at once in the rank, after ``worker_s`` in a forked worker
    (``inf``: never, a worker stuck on a lock it inherited)."""

    skipped: Counter = Counter()

    def __init__(self, worker_s: float, rank_s: float = 0.0):
        self.rank_pid, self.worker_s, self.rank_s = os.getpid(), worker_s, rank_s

    def sample(self, index: int) -> dict[str, int]:
        in_worker = os.getpid() != self.rank_pid
        time.sleep((3600.0 if self.worker_s == float("inf") else self.worker_s) if in_worker else self.rank_s)
        return {"index": index, "built_by": os.getpid()}


def test_a_stalled_worker_is_killed_and_the_rank_builds_its_samples_from_then_on():
    """A worker that never answers (a fork can inherit a lock held by another of the rank's threads) costs the rank
    ``stall_min_s``, not the run: it is killed, the samples are built here, and no worker is forked again (a fork
    that stalled once may stall again)."""
    prefetcher = Prefetcher(SlowInWorkerSource(worker_s=float("inf")), stall_min_s=1.0)
    try:
        assert _take_within(prefetcher, 0, [1])[1]["built_by"] == os.getpid()  # nothing prefetched for step 0
        prefetcher.submit(1, [2])
        _worker_pid()
        assert _take_within(prefetcher, 1, [2], seconds=10.0)[2]["built_by"] == os.getpid()
        assert prefetcher.stalls == 1 and prefetcher.restarts == 0 and not multiprocessing.active_children()
        assert innermost_frame(prefetcher.stalled_at).endswith("in sample")  # where it was stuck: time.sleep's caller
        prefetcher.submit(2, [3])
        assert not multiprocessing.active_children()
        assert _take_within(prefetcher, 2, [3])[3]["built_by"] == os.getpid()
    finally:
        prefetcher.close(wait_s=0.0)


@pytest.mark.parametrize("stall_factor, builder", [(20.0, "worker"), (1.0, "rank")])
def test_a_worker_gets_a_multiple_of_the_ranks_own_build_time(stall_factor, builder):
    """The stall limit is ``stall_factor`` times the longest the rank took to build a step's samples itself (0.2 s
    here): a worker that takes 1 s is waited for at 20x, taken as stuck at 1x."""
    source = SlowInWorkerSource(worker_s=1.0, rank_s=0.2)
    prefetcher = Prefetcher(source, stall_factor=stall_factor, stall_min_s=0.0)
    try:
        _take_within(prefetcher, 0, [1])
        prefetcher.submit(1, [2])
        built_by = _take_within(prefetcher, 1, [2])[2]["built_by"]
        assert ("rank" if built_by == os.getpid() else "worker") == builder
        assert prefetcher.stalls == (builder == "rank")
    finally:
        prefetcher.close(wait_s=0.0)


def test_a_stall_is_one_warning_and_counted_in_the_metrics(tmp_path, capsys):
    """The driver says once, when it happens, which step a stalled worker cost and where it was stuck (the innermost
    call of the thread that took the stack signal); the step records and the summary count the ranks whose worker
    stalled, the record of the step that found the stall holds its stacks."""
    from runtime.observability.metrics import MetricsLog
    from tests.runtime.plans import make_plan

    rank = dict(step_time_s=1.0, loss=1.0, grad_norm=1.0, lr=1e-3, llm_tokens=8, peak_memory_bytes=1 << 20)
    log = MetricsLog(make_plan({}, {}), steps=3, path=str(tmp_path / "m.jsonl"))
    stacks = ('Thread 0x00007f01 (most recent call first):\n  File "threading.py", line 320 in wait\n\n'
              'Current thread 0x00007f00 (most recent call first):\n  File "/lib/av/open.py", line 7 in decode\n'
              '  File "/runtime/data/packed_data.py", line 440 in decode_frames\n')
    stalled = {"prefetch_stalls": 1, "prefetch_stalled_at": stacks}
    for step, stalls in enumerate([0, 1, 1]):
        log.log(step, [dict(rank, rank=0), dict(rank, rank=1, **(stalled if stalls else {}))])
    log.close()
    warnings = [line for line in capsys.readouterr().err.splitlines() if "prefetch worker" in line]
    assert len(warnings) == 1 and warnings[0].startswith("runtime: warning: step 1: the prefetch worker of 1 rank(s)")
    assert 'stuck at File "/lib/av/open.py", line 7 in decode;' in warnings[0]
    assert log.records[1]["prefetch_stalled_at"] == stacks and "prefetch_stalled_at" not in log.records[2]
    assert [r.get("prefetch_stalls") for r in log.records] == [None, 1, 1]
    assert log.summary()["prefetch_stalls"] == 1


DECODER_STATE: list[int] = []
"""What a decoder sets up on first use in a process (FFmpeg's contexts and thread pools, PyAV's per-thread frame
converter): here, the pids of the processes that built a sample."""


class StatefulSource:
    """Samples that tell which processes had built a sample where they were built, fork included."""

    skipped: Counter = Counter()

    def sample(self, index: int) -> dict[str, list[int]]:
        before = list(DECODER_STATE)
        DECODER_STATE.append(os.getpid())
        return {"state_before": before}


def test_the_worker_is_forked_before_the_rank_builds_a_sample():
    """The rank builds the first step's samples itself; its worker, forked when the prefetcher was made, inherits
    none of the state that set up (the suite's video run stalled in a worker converting a frame with the converter
    its rank had made)."""
    DECODER_STATE.clear()
    prefetcher = Prefetcher(StatefulSource())
    try:
        _take_within(prefetcher, 0, [1])
        assert DECODER_STATE == [os.getpid()]
        prefetcher.submit(1, [2])
        assert _take_within(prefetcher, 1, [2])[2]["state_before"] == []
    finally:
        prefetcher.close()
