"""The training-checkpoint folder (``--checkpoint-dir``) without torch: names, completeness, the latest complete
checkpoint, pruning. The sharded contents are runtime.checkpoints.dcp_checkpoint's.

Layout: ``DIR/step-000012/`` per checkpoint. A checkpoint is written as ``DIR/step-000012.tmp/``; once every rank
has written its shards, rank 0 writes the marker file ``COMPLETE`` into it (last) and renames the folder to its
final name. A folder without the marker, or still named ``*.tmp``, is never resumed from.

The marker records the checkpoint's place in the order the folder's checkpoints were completed (``{"order": n}``),
and "newest" means last completed, not most steps: a run resumed from an older checkpoint abandons the later
steps of the run it branched from, and its own checkpoints (step 3 after step 4 of the abandoned branch) are the
newest ones, which ``--resume`` picks and ``--keep-last`` keeps. Markers without an order (written before it was
recorded) come first, by step.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Callable

from planner.contract.file_io import read_json

PREFIX = "step-"
"""Name prefix of a checkpoint folder; the step count follows, six digits."""

TMP_SUFFIX = ".tmp"
"""Suffix of a checkpoint folder being written."""

COMPLETE_MARKER = "COMPLETE"
"""File written last into a checkpoint: its presence means every rank's shards and the run state are there."""

RUN_STATE = "run_state.json"
"""Rank 0's file: steps done and the next sample's global index."""

RUN_STATE_FIELDS = ("step", "samples_seen")
"""The run state's fields, each a non-negative integer."""

Problem = Callable[[str], "str | None"]
"""What is wrong with a complete checkpoint folder, in a few words (None: nothing found)."""

@dataclass(kw_only=True, frozen=True)
class CheckpointOptions:
    """Periodic sharded checkpoints and automatic recovery."""

    directory: str | None = None
    """Folder of the training checkpoints (``--checkpoint-dir``); none are written when None."""
    every: int | None = None
    """Save after every this many steps (and after the last); only after the last when None."""
    keep_last: int | None = None
    """Keep this many newest complete checkpoints; all when None."""
    max_failures: int = 0
    """Restarts from the latest complete checkpoint after a worker failed (Ray launcher only)."""
    elastic_wait_s: float | None = None
    """Elastic (``--elastic``): after a worker failed, wait this long for the plan's devices, then re-plan for the
    devices the cluster has (fewer, or the first plan's again when they came back); None: wait for the same ones."""
    overlap: bool = False
    """Write each checkpoint from a thread while training goes on (DCP async_save); training then stalls only
    while the state is copied to memory."""

    def due(self, done: int, steps: int) -> bool:
        """Whether to save after ``done`` steps of ``steps``."""
        if self.directory is None:
            return False
        return done == steps or (self.every is not None and done % self.every == 0)


_NAME = re.compile(rf"^{PREFIX}(\d+)$")


def checkpoint_name(step: int) -> str:
    """Folder name of the checkpoint taken after ``step`` optimizer steps."""
    return f"{PREFIX}{step:06d}"


def is_complete(path: str) -> bool:
    """Whether ``path`` is a finished checkpoint folder (its marker was written)."""
    return os.path.isfile(os.path.join(path, COMPLETE_MARKER))


def completion_order(path: str) -> int:
    """A complete checkpoint's place in the order its folder's checkpoints were completed (0 when its marker
    records none)."""
    try:
        with open(os.path.join(path, COMPLETE_MARKER), encoding="utf-8") as f:
            order = json.load(f).get("order")
    except (OSError, ValueError, AttributeError):  # unreadable, not JSON ("ok"), not an object
        return 0
    return order if type(order) is int and order > 0 else 0


def complete_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint in ``directory``, oldest first (in the order they were
    completed); [] if there is none."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        match = _NAME.match(name)
        path = os.path.join(directory, name)
        if match and is_complete(path):
            found.append((completion_order(path), int(match.group(1)), path))
    return [(step, path) for _, step, path in sorted(found)]


def latest_checkpoint(directory: str) -> str | None:
    """The complete checkpoint of ``directory`` completed last, or None."""
    found = complete_checkpoints(directory)
    return found[-1][1] if found else None


def mark_complete(tmp_path: str) -> str:
    """Write the marker into a fully written ``*.tmp`` checkpoint, after every complete one of its folder in the
    completion order, and give it its final name; returns that."""
    assert tmp_path.endswith(TMP_SUFFIX), tmp_path
    earlier = [completion_order(path) for _, path in complete_checkpoints(os.path.dirname(tmp_path))]
    with open(os.path.join(tmp_path, COMPLETE_MARKER), "w") as f:
        json.dump({"order": max(earlier, default=0) + 1}, f)
    final = tmp_path.removesuffix(TMP_SUFFIX)
    if os.path.exists(final):  # a checkpoint of the same step from an earlier attempt of this run
        shutil.rmtree(final)
    os.rename(tmp_path, final)
    return final


def prune(directory: str, keep_last: int) -> list[str]:
    """Remove all but the ``keep_last`` newest (last completed) complete checkpoints, and unfinished ``*.tmp``
    ones; returns the removed paths."""
    removed = [path for _, path in complete_checkpoints(directory)[:-keep_last]]
    removed += [os.path.join(directory, n) for n in os.listdir(directory)
                if n.startswith(PREFIX) and n.endswith(TMP_SUFFIX)]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def read_run_state(path: str) -> dict[str, int]:
    """A checkpoint's run state.

    Raises:
        ValueError: in one line naming the file and the field, when it is unreadable or a field is not a
            non-negative integer (a hand-edited file).
    """
    file = os.path.join(path, RUN_STATE)
    state = read_json(file, kind="run state")
    if not isinstance(state, dict):
        raise ValueError(f"{file} holds a {type(state).__name__}, not a JSON object")
    for field in RUN_STATE_FIELDS:
        value = state.get(field)
        if type(value) is not int or value < 0:
            raise ValueError(f"{file}: {field} must be a non-negative integer, got {json.dumps(value)}")
    return {field: state[field] for field in RUN_STATE_FIELDS}


def run_state_problem(path: str) -> str | None:
    """What is wrong with a checkpoint's run state (``read_run_state``), or None."""
    try:
        read_run_state(path)
    except ValueError as e:
        return str(e)
    return None


def newest_sound(directory: str, problem: Problem) -> tuple[str | None, list[str]]:
    """The newest complete checkpoint in ``directory`` in which ``problem`` finds nothing wrong (None if there is
    none), and ``"NAME (why)"`` for each newer one passed over."""
    skipped = []
    for _, path in reversed(complete_checkpoints(directory)):
        why = problem(path)
        if why is None:
            return path, skipped
        skipped.append(f"{os.path.basename(path)} ({why})")
    return None, skipped


def resolve_resume(resume: str, checkpoint_dir: str | None, problem: Problem = lambda path: None,
                   warn: Callable[[str], None] = lambda line: None) -> str:
    """The checkpoint ``--resume`` names: a complete checkpoint folder, or ``"latest"`` (the latest complete one
    in ``--checkpoint-dir``, or in the folder given). From the latest, checkpoints in which ``problem`` finds
    something wrong are passed over (``warn`` is told which and why); a named one is refused.

    Raises:
        ValueError: in one line, when there is no such complete checkpoint, or the named one has a problem.
    """
    if resume == "latest" and checkpoint_dir is None:
        raise ValueError("--resume without a path needs --checkpoint-dir (where to look for the latest checkpoint)")
    if resume != "latest" and not os.path.isdir(resume):
        raise ValueError(f"--resume {resume} is not a folder")
    if resume != "latest" and is_complete(resume):
        why = problem(resume)
        if why is not None:
            good, _ = newest_sound(os.path.dirname(os.path.abspath(resume)), problem)
            instead = f"the newest sound checkpoint beside it is {good}" if good else "no checkpoint beside it is sound"
            raise ValueError(f"--resume {resume} is damaged: {why}; {instead}")
        return resume
    directory = checkpoint_dir if resume == "latest" else resume  # a --checkpoint-dir given as the path
    if not complete_checkpoints(directory):
        if resume != "latest":
            raise ValueError(f"--resume {resume} is not a complete checkpoint (no {COMPLETE_MARKER} marker): it "
                             "was being written when the run stopped, or is not a checkpoint folder")
        raise ValueError(f"--resume: {directory} holds no complete checkpoint ({PREFIX}NNNNNN/{COMPLETE_MARKER})")
    path, skipped = newest_sound(directory, problem)
    if path is None:
        raise ValueError(f"--resume: no complete checkpoint in {directory} is sound: {'; '.join(skipped)}")
    if skipped:
        warn(f"resuming from {path}, the newest sound checkpoint; passed over {'; '.join(skipped)}")
    return path
