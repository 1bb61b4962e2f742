"""Every signal a scheduler or a terminal sends to stop a run ends it the same way (runtime.__main__): one line
naming the complete checkpoint to resume from, the exit status ``128 + signal number`` (130 for Ctrl-C, 143 for
SIGTERM, 129 for SIGHUP, 138 for SIGUSR1, 140 for SIGUSR2), no traceback.

One handler turns each of ``STOP_SIGNALS`` into ``Stopped``, a ``KeyboardInterrupt``, so that the code which
already unwinds a run on Ctrl-C (shutting the workers down, closing the metrics file) unwinds it on a preemption too.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from types import FrameType
from typing import Iterator

STOP_SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM", signal.SIGHUP: "SIGHUP",
                signal.SIGUSR1: "SIGUSR1", signal.SIGUSR2: "SIGUSR2"}
"""The signals that stop a run, and how its last line names each: SIGTERM is what schedulers (Slurm, Kubernetes,
torchrun's agent) send on preemption or cancellation, SIGHUP a closed terminal, SIGUSR1 / SIGUSR2 the warning a
scheduler can be asked to send before a time limit (Slurm's ``--signal=USR1@120``; their default action would end
the run abruptly)."""


class Stopped(KeyboardInterrupt):
    """A stop signal arrived."""

    def __init__(self, signum: int):
        super().__init__(STOP_SIGNALS.get(signum, signal.Signals(signum).name))
        self.signum = signum


_received: list[int] = []
"""The stop signals received, in order (a library may turn ``Stopped`` into a plain KeyboardInterrupt)."""


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    _received.append(signum)
    raise Stopped(signum)


@contextlib.contextmanager
def stopping_on_signals() -> Iterator[None]:
    """Inside, each of ``STOP_SIGNALS`` raises ``Stopped`` in the main thread; the handlers before are put back
    after (an in-process caller, a test, keeps its own)."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    _received.clear()
    for signum in STOP_SIGNALS:
        signal.signal(signum, _raise_stopped)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def keep_handler(previous: object) -> None:
    """After a library replaced the SIGTERM handler (``ray.init`` installs its own, which exits abruptly), put
    ``previous`` back if it was this module's."""
    if previous is _raise_stopped:
        signal.signal(signal.SIGTERM, _raise_stopped)


def ignore_stop_signals() -> None:
    """For a helper process that ends with its parent's pipe (the prefetch worker): the parent handles them."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def name_and_status(error: KeyboardInterrupt) -> tuple[str, int]:
    """How the last line names what stopped the run, and its exit status (``128 + signal``)."""
    signum = getattr(error, "signum", _received[0] if _received else signal.SIGINT)
    return STOP_SIGNALS.get(signum, signal.Signals(signum).name), 128 + signum
