"""What a run owns, locked for the run's life: its metrics file and its checkpoint folder. Two runs writing one
metrics file or one checkpoint folder would interleave their lines and checkpoints; the second one is refused in
one line instead. The lock is an advisory ``fcntl.flock`` on a lock file (``<folder>/.dhplan-run.lock`` in the
checkpoint folder, ``.<name>.lock`` beside the metrics file, both left in place), held on an open descriptor: the
kernel releases it when the run ends, however it ends (a crash, a kill). Torch-free.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from typing import Iterator, Mapping

from planner.contract.file_io import is_device

FOLDER_LOCK = ".dhplan-run.lock"
"""Lock file of a checkpoint folder, inside it (the checkpoints are ``step-NNNNNN``: nothing else reads it)."""


def lock_file(path: str, *, folder: bool) -> str:
    """The lock file of an output: ``FOLDER_LOCK`` inside a folder, ``.<name>.lock`` beside a file (symlinks
    resolved, so that two names of one output share one lock)."""
    real = os.path.realpath(path)
    if folder:
        return os.path.join(real, FOLDER_LOCK)
    directory, name = os.path.split(real)
    return os.path.join(directory, f".{name}.lock")


@contextlib.contextmanager
def hold(files: Mapping[str, str | None], folders: Mapping[str, str | None]) -> Iterator[None]:
    """Hold the lock of every output file and folder (flag -> path; None: not given; a character device such as
    ``/dev/null`` is shared) until the block ends.

    Raises:
        ValueError: another run holds one of them, or its lock file cannot be created (one line).
    """
    with contextlib.ExitStack() as stack:
        for flag, path in files.items():
            if path is not None and not is_device(path):
                stack.enter_context(_locked(flag, path, lock_file(path, folder=False)))
        for flag, path in folders.items():
            if path is not None:
                stack.enter_context(_locked(flag, path, lock_file(path, folder=True)))
        yield


@contextlib.contextmanager
def _locked(flag: str, path: str, lock: str) -> Iterator[None]:
    """An exclusive lock on ``lock`` for the block, taken without waiting."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot create its run lock {lock}: {e.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"{flag} {path} is in use by another run (it holds {lock}): wait for that run to end "
                             f"or give {flag} another path") from None
        yield
    finally:
        os.close(fd)
