"""Building the next step's samples in a worker process while this step trains.

Which samples a rank needs in a step is known ahead (fixed-shape plans: sample indexes from the data position;
dataset plans: the seeded packs of runtime.packed_data), so while step ``k`` runs, a worker process decodes,
patchifies and tokenizes step ``k + 1``'s samples; the step loop then only assembles micro-batches from them
(``data_s`` in the metrics is that wait plus the assembly). The worker is forked from the rank's process, as a
DataLoader's workers are (the source is already built there, nothing is imported again), and sends the samples
back through shared memory (torch's multiprocessing reductions). What the worker skipped (bad rows, images that
did not decode) is added to the rank's own counts with each step.
"""

from __future__ import annotations

import multiprocessing
from collections import Counter
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

import torch

_SOURCE: Any = None
"""The data source, in the worker process."""


def _install(source: Any) -> None:
    global _SOURCE
    _SOURCE = source
    torch.set_num_threads(1)


def _build(indexes: list[int]) -> tuple[dict[int, dict[str, torch.Tensor]], Counter]:
    before = Counter(getattr(_SOURCE, "skipped", {}))
    samples = {i: _SOURCE.sample(i) for i in indexes}
    return samples, Counter(getattr(_SOURCE, "skipped", {})) - before


class Prefetcher:
    """One worker process building the samples of the step after this one (``submit``, then ``take``)."""

    def __init__(self, source: Any):
        self.source = source
        self.pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork"), initializer=_install,
                                        initargs=(source,))
        self._pending: tuple[int, Future] | None = None

    def submit(self, position: int, indexes: list[int]) -> None:
        """Start building the samples ``indexes`` of the step at data position ``position``."""
        self._pending = (position, self.pool.submit(_build, list(indexes)))

    def take(self, position: int, indexes: list[int]) -> dict[int, dict[str, torch.Tensor]]:
        """The samples of the step at ``position``: the worker's, when it was building them, else built here."""
        pending, self._pending = self._pending, None
        if pending is None or pending[0] != position:
            return {i: self.source.sample(i) for i in indexes}
        samples, skipped = pending[1].result()
        if skipped:
            self.source.skipped.update(skipped)
        return samples

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
