"""How one LLM rank runs its part of a micro-batch: the sequence slice it holds under Ulysses SP.

With ``sp = k`` each SP rank holds a contiguous, near-equal 1/k slice of every sample's token sequence (uneven
lengths are fine: the all-to-all takes per-rank sizes, so nothing is padded). What is computed on the whole
sequence first and then sliced, so that the slices sum to the single-device model exactly:

- the 3-D M-RoPE positions (``get_rope_index`` needs the whole sequence to place image and text positions);
- the next-token targets (the label of a slice's last position is the next slice's first token).

Image tokens are the same positions in every sample (all samples share one layout), so the image tokens a slice
holds (``image_slots_per_rank``) are known before any data is read; the hand-off routes exactly those.

Shape legend: B samples, L whole sequence, s this rank's slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from runtime.data import IGNORE_INDEX
from runtime.parallel.ulysses import UlyssesGroup, split_sequence


@dataclass(kw_only=True, frozen=True)
class LLMShard:
    """This rank's inputs for one LLM micro-batch."""

    input_ids_Bs: torch.Tensor
    """Its slice of the token ids."""
    position_ids_3Bs: torch.Tensor
    """The M-RoPE positions of those tokens (computed on the whole sequence)."""
    targets_Bs: torch.Tensor
    """Next-token label of each of its positions (IGNORE_INDEX where there is none)."""
    ulysses: UlyssesGroup | None
    """The SP group when the sequence is split, else None."""


def next_token_targets(labels_BL: torch.Tensor) -> torch.Tensor:
    """Label of the token after each position (IGNORE_INDEX after the last): what the logits at a position predict."""
    return F.pad(labels_BL, (0, 1), value=IGNORE_INDEX)[:, 1:]


def shard_llm_batch(
    input_ids_BL: torch.Tensor, position_ids_3BL: torch.Tensor, labels_BL: torch.Tensor, *, sp_rank: int,
    sp_group: Any, sp: int,
) -> LLMShard:
    """The slice of a micro-batch that SP rank ``sp_rank`` of ``sp`` processes."""
    length = input_ids_BL.shape[1]
    bounds = split_sequence(length, sp)
    start, end = bounds[sp_rank], bounds[sp_rank + 1]
    ulysses = None
    if sp > 1:
        ulysses = UlyssesGroup(group=sp_group, rank=sp_rank, segment_lens=(length,),
                               seq_lens=tuple(b - a for a, b in zip(bounds[:-1], bounds[1:])))
    return LLMShard(
        input_ids_Bs=input_ids_BL[:, start:end],
        position_ids_3Bs=position_ids_3BL[..., start:end],
        targets_Bs=next_token_targets(labels_BL)[:, start:end],
        ulysses=ulysses,
    )


def image_slots_per_rank(input_ids_L: torch.Tensor, image_token_id: int, sp: int) -> list[torch.Tensor]:
    """For each of ``sp`` SP ranks, the indexes (among a sample's image tokens, in order) of the image tokens its
    slice of the sequence ``input_ids_L`` holds."""
    positions = (input_ids_L == image_token_id).nonzero().flatten()
    bounds = split_sequence(len(input_ids_L), sp)
    slot = torch.arange(len(positions))
    return [slot[(positions >= a) & (positions < b)] for a, b in zip(bounds[:-1], bounds[1:])]
