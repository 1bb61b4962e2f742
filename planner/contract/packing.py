"""Packing samples into packs of at most a token budget (best-fit decreasing over an epoch's lengths), and dealing
packs to data-parallel replicas by load.

Pure Python, no torch: the planner prices the packs this forms, and a runtime packer can form the same ones.
"""

from __future__ import annotations

import bisect
import heapq
from collections import defaultdict
from typing import Sequence


def pack_best_fit(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indexes of ``lengths`` grouped into packs whose lengths sum to at most ``budget``, by best-fit decreasing
    (each sample, longest first, goes to the open pack it fills most tightly; Johnson 1973, "Near-optimal bin
    packing algorithms", which bounds it at 11/9 of the fewest packs plus a constant). Open packs are kept by
    remaining room, so a sample costs one bisection over the distinct rooms (at most ``budget`` of them).

    Raises:
        ValueError: a length outside 1..budget.
    """
    if lengths and not 0 < min(lengths) <= max(lengths) <= budget:
        raise ValueError(f"sample lengths must be between 1 and the budget {budget}, got {min(lengths)}..{max(lengths)}")
    packs: list[list[int]] = []
    by_room: dict[int, list[int]] = defaultdict(list)
    """Remaining room -> open packs (indexes into ``packs``) with exactly that room."""
    rooms: list[int] = []
    """The distinct rooms of open packs, ascending."""
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        length = lengths[index]
        at = bisect.bisect_left(rooms, length)
        if at < len(rooms):
            room = rooms[at]
            pack = by_room[room].pop()
            if not by_room[room]:
                del rooms[at]
        else:
            room, pack = budget, len(packs)
            packs.append([])
        packs[pack].append(index)
        left = room - length
        if left > 0:
            if not by_room[left]:
                bisect.insort(rooms, left)
            by_room[left].append(pack)
    return packs


def balance_packs(loads: Sequence[float], bins: int, per_bin: int) -> list[list[int]]:
    """Indexes of ``loads`` dealt into ``bins`` bins of exactly ``per_bin`` each by longest processing time first
    (each load, largest first, goes to the least-loaded bin that has room; Graham 1969, "Bounds on multiprocessing
    timing anomalies", 4/3 of the best makespan without the room limit); each bin lists its loads largest first.

    Raises:
        ValueError: ``len(loads) != bins * per_bin``.
    """
    if len(loads) != bins * per_bin:
        raise ValueError(f"{len(loads)} loads cannot fill {bins} bins of {per_bin}")
    heap = [(0.0, b) for b in range(bins)]
    dealt: list[list[int]] = [[] for _ in range(bins)]
    for index in sorted(range(len(loads)), key=lambda i: -loads[i]):
        load, b = heapq.heappop(heap)
        dealt[b].append(index)
        if len(dealt[b]) < per_bin:
            heapq.heappush(heap, (load + loads[index], b))
    return dealt
