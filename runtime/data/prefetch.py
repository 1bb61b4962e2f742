"""Building the next step's samples in a worker process while this step trains.

Which samples a rank needs in a step is known ahead (fixed-shape plans: sample indexes from the data position;
dataset plans: the seeded packs of runtime.data.packed_data), so while step ``k`` runs, a worker process decodes,
patchifies and tokenizes step ``k + 1``'s samples; the step loop then only assembles micro-batches from them
(``data_s`` in the metrics is that wait plus the assembly). The worker is forked from the rank's process, as a
DataLoader's workers are (the source is already built there, nothing is imported again), and sends the samples
back through shared memory (torch's multiprocessing reductions). What the worker skipped (bad rows, images that
did not decode) is added to the rank's own counts with each step.

A worker that dies (killed, out of memory) costs nothing but time: the rank builds that step's samples itself
and forks a new worker for the next. A worker can also stall for good: a process forked from a threaded one (a Ray
worker: Ray's, gloo's, a decoder's threads) can block on a lock that another thread held at the fork (the
DataLoader's long history of such hangs, pytorch/pytorch#1355; PyAV-Org/PyAV#1962). The rank waits for it at most
``stall_factor`` times the longest it took to build a step's samples itself (``stall_min_s`` at least), then kills
it and builds the samples in the step from then on (``stalls``): a fork that stalled once may stall again.

Each side holds only its own end of each pipe, so a death is seen as the pipe's end of file.
(``concurrent.futures.ProcessPoolExecutor``, used before, keeps the worker's end of its result pipe open in the
rank: a worker killed in the middle of sending a result left the rank waiting for the rest of that message
forever.)
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import tempfile
import time
from collections import Counter
from multiprocessing.connection import Connection
from typing import Any

import torch

from runtime.run.stop_signals import ignore_stop_signals

WORKER_EXIT_WAIT_S = 5.0
"""How long ``close`` waits for the worker to leave after its request pipe closed, before killing it."""

STALL_FACTOR = 10.0
"""A worker that has not sent a step's samples within this many times the longest the rank took to build a step's
samples itself (the first step's, at least: nothing is prefetched for it) is taken as stuck."""

STALL_MIN_S = 30.0
"""The least time a worker gets to send a step's samples before it is taken as stuck."""

STALLED = object()
"""What ``Prefetcher._answer`` returns for a worker that sent nothing in time."""

STACK_SIGNAL = signal.SIGQUIT
"""Asks a worker for its Python stacks (``faulthandler``, which answers even while a thread is blocked in C; the
JVM's thread-dump signal, and not one of the stop signals the rank handles): where a stalled worker was stuck goes
into the rank's report before it is killed."""

STACK_WAIT_S = 1.0
"""How long a stalled worker gets to write its stacks."""


def _serve(source: Any, requests: Connection, results: Connection, rank_ends: tuple[Connection, ...],
           stacks: Any) -> None:
    """The worker's loop: build the samples of each requested index list until the rank closes its pipe."""
    for end in rank_ends:  # the rank's ends, inherited by the fork: held here, a dead rank would not be seen
        end.close()
    ignore_stop_signals()  # Ctrl-C, SIGTERM are the rank's to handle; this worker ends with its pipe
    faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True)
    torch.set_num_threads(1)
    while True:
        try:
            indexes = requests.recv()
        except EOFError:
            return
        before = Counter(getattr(source, "skipped", {}))
        samples = {i: source.sample(i) for i in indexes}
        try:
            results.send((samples, Counter(getattr(source, "skipped", {})) - before))
        except OSError:  # the rank closed its end (``close`` while this step was being built)
            return


class Prefetcher:
    """One worker process building the samples of the step after this one (``submit``, then ``take``), forked when
    the prefetcher is made: before the rank has built any sample itself, so that the worker inherits nothing the
    rank's decoders set up (FFmpeg's contexts and thread pools, PyAV's per-thread frame converter)."""

    def __init__(self, source: Any, *, stall_factor: float = STALL_FACTOR, stall_min_s: float = STALL_MIN_S):
        self.source = source
        self.stall_factor, self.stall_min_s = stall_factor, stall_min_s
        self.restarts = 0
        """Workers that died and were replaced."""
        self.stalls = 0
        """Workers that stalled and were killed (one at most: prefetching stops)."""
        self.stalled_at = ""
        """Where the stalled worker was stuck: its Python stacks (``faulthandler``'s format)."""
        self.slowest_build_s = 0.0
        """The longest the rank took to build a step's samples itself."""
        self._worker: tuple[multiprocessing.process.BaseProcess, Connection, Connection] | None = None
        self._pending: int | None = None
        self._submitted_at = 0.0
        self._stack_file: Any = None
        self._start()  # before the rank builds a sample: the fork inherits no state its decoders made

    def submit(self, position: int, indexes: list[int]) -> None:
        """Start building the samples ``indexes`` of the step at data position ``position`` (forking a worker if
        there is none, or the last one died; nothing once a worker stalled)."""
        for _ in range(0 if self.stalls else 2):
            if self._worker is None:
                self._start()
            try:
                self._worker[1].send(list(indexes))
            except OSError:  # the worker died since the last step
                self._lost()
                continue
            self._pending, self._submitted_at = position, time.monotonic()
            return

    def take(self, position: int, indexes: list[int]) -> dict[int, dict[str, torch.Tensor]]:
        """The samples of the step at ``position``: the worker's, when it was building them, else built here (also
        when the worker died or stalled; another step's samples it built are dropped)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            answer = self._answer(self._submitted_at + max(self.stall_min_s, self.stall_factor * self.slowest_build_s))
            if answer is None:
                self._lost()
            elif answer is STALLED:
                self.stalls += 1
                self.stalled_at = self._stacks()
                self.close(wait_s=0.0)
            elif pending == position:
                samples, skipped = answer
                if skipped:
                    self.source.skipped.update(skipped)
                return samples
        started = time.perf_counter()
        samples = {i: self.source.sample(i) for i in indexes}
        self.slowest_build_s = max(self.slowest_build_s, time.perf_counter() - started)
        return samples

    def close(self, wait_s: float = WORKER_EXIT_WAIT_S) -> None:
        """Stop the worker: it leaves when its request pipe closes, or is killed after ``wait_s``."""
        if self._worker is not None:
            process, requests, results = self._worker
            self._worker, self._pending = None, None
            requests.close()
            results.close()
            process.join(wait_s)
            if process.is_alive():
                process.kill()  # not SIGTERM: the fork inherited the rank's handler of it (Ray's)
                process.join()
            self._stack_file.close()

    def _start(self) -> None:
        context = multiprocessing.get_context("fork")
        request_reader, request_writer = context.Pipe(duplex=False)
        result_reader, result_writer = context.Pipe(duplex=False)
        self._stack_file = tempfile.TemporaryFile()
        process = context.Process(target=_serve, args=(self.source, request_reader, result_writer,
                                                       (request_writer, result_reader), self._stack_file), daemon=True)
        process.start()
        request_reader.close()  # the worker's ends: held here, a dead worker would not be seen
        result_writer.close()
        self._worker = (process, request_writer, result_reader)

    def _stacks(self) -> str:
        """The worker's Python stacks, written by its ``faulthandler`` when asked (``STACK_SIGNAL``)."""
        os.kill(self._worker[0].pid, STACK_SIGNAL)
        deadline = time.monotonic() + STACK_WAIT_S
        while time.monotonic() < deadline and not os.fstat(self._stack_file.fileno()).st_size:
            time.sleep(0.05)
        time.sleep(0.05)  # the rest of the dump
        self._stack_file.seek(0)
        return self._stack_file.read().decode(errors="replace")

    def _answer(self, deadline: float) -> tuple[dict, Counter] | object | None:
        """The worker's samples and skip counts; None when it died (its end closed) or died before its shared
        memory was read; ``STALLED`` when it sent nothing by ``deadline`` (``time.monotonic``)."""
        results = self._worker[2]
        try:
            return results.recv() if results.poll(max(0.0, deadline - time.monotonic())) else STALLED
        except (EOFError, OSError):
            return None

    def _lost(self) -> None:
        """The worker died: reap it; the next ``submit`` forks a new one."""
        self.restarts += 1
        self.close(wait_s=0.0)
