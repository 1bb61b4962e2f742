"""The window layout of a replica's images and its split over Ulysses SP ranks: which merged tokens each rank emits.
Qwen2-VL and Qwen3-VL have no windows: their sequence is split on merge units."""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers.vision_utils import get_vision_window_index

from runtime.parallel.ulysses import split_windows


def window_layout(grid_thw: torch.Tensor, config: Any) -> tuple[torch.Tensor, list[int]]:
    """Merge-unit window order and window boundaries (in patches) of a replica's images."""
    unit = config.spatial_merge_size**2
    if getattr(config, "window_size", None) is None:  # Qwen2-VL: no windows, split anywhere on merge units
        num_units = int(grid_thw.prod(-1).sum()) // unit
        return torch.arange(num_units), list(range(0, num_units * unit + 1, unit))
    window_index, cu_windows = _windows(tuple(map(tuple, grid_thw.tolist())), config.spatial_merge_size,
                                        config.window_size, config.patch_size)
    return window_index.clone(), list(cu_windows)


@functools.lru_cache(maxsize=256)
def _windows(grids: tuple[tuple[int, int, int], ...], spatial_merge_size: int, window_size: int, patch_size: int
             ) -> tuple[torch.Tensor, tuple[int, ...]]:
    """transformers' ``get_vision_window_index`` of ``grids``, memoised (1-2 ms a call; a run's replicas and a plan's
    checks ask about the same few image layouts again and again)."""
    window_index, cu_windows = get_vision_window_index(
        torch.tensor(grids), spatial_merge_size=spatial_merge_size, window_size=window_size, patch_size=patch_size)
    return window_index, tuple(cu_windows.tolist())


def merged_positions_per_rank(grid_thw: torch.Tensor, config: Any, sp: int) -> list[torch.Tensor]:
    """Replica-order index of the merged tokens each of ``sp`` SP ranks emits (what the hand-off routes)."""
    unit = config.spatial_merge_size**2
    window_index, cu_windows = window_layout(grid_thw, config)
    bounds = split_windows(cu_windows, sp)
    return [window_index[a // unit : b // unit] for a, b in zip(bounds[:-1], bounds[1:])]
