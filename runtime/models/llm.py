"""How one LLM rank runs its part of a micro-batch: the sequence slice it holds under Ulysses SP and ring CP.

With ``sp = k`` each SP rank holds a contiguous, near-equal 1/k slice of every sample's token sequence (uneven
lengths are fine: the all-to-all takes per-rank sizes, so nothing is padded). With ``cp = c`` the sequence is
first padded to a multiple of ``2 c`` and each CP rank takes its two head-tail chunks (runtime.parallel.ring), which
its SP ranks then split so (``sequence_positions``). What is computed on the whole sequence first and then
sliced, so that the slices sum to the single-device model exactly:

- the 3-D M-RoPE positions (``get_rope_index`` needs the whole sequence to place image and text positions);
- the next-token targets (the label of a slice's last position is the next slice's first token).

Every rank knows where a micro-batch's image tokens sit before any data is read (a fixed-shape plan's layout, or a
dataset plan's index), so the image tokens a slice holds (``image_slots_per_rank``) are known too; the hand-off
routes exactly those.

A packed micro-batch (a dataset plan) is one row of samples back to back: attention stays within each sample
(``segment_lens`` under SP; transformers' packed-sequence mask otherwise, which it derives from the first of 4
position rows, each sample's own text positions), and the M-RoPE positions are each sample's own
(``packed_position_ids``).

A pipelined LLM's schedule exchanges one shape, so its packed rows are padded to the micro-batch's budget
(``pad_packed_row``): each pad token is a sequence of its own (position 0: it attends to itself only) without a
target.

Shape legend: B samples (1 when packed), L whole sequence, s this rank's slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from runtime.data.samples import IGNORE_INDEX
from runtime.parallel.ring import RingGroup, padded_length, segment_causal_mask, zigzag_positions
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


def sequence_positions(length: int, sp: int, cp: int = 1) -> list[torch.Tensor]:
    """The positions of a sequence of ``length`` tokens each sequence rank holds (rank ``c * sp + j`` of CP rank
    ``c`` and SP rank ``j``), in its local order: without CP, ``sp`` contiguous near-equal slices
    (``split_sequence``); with CP, each CP rank's two head-tail chunks (``zigzag_positions``, padded at the end)
    split so over its SP ranks."""
    per_cp = zigzag_positions(length, cp) if cp > 1 else [torch.arange(length)]
    out = []
    for positions in per_cp:
        bounds = split_sequence(len(positions), sp)
        out += [positions[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    return out


def shard_llm_batch(
    input_ids_BL: torch.Tensor, position_ids_3BL: torch.Tensor, labels_BL: torch.Tensor, *, sp_rank: int,
    sp_group: Any, sp: int, segment_lens: tuple[int, ...] | None = None, ring: RingGroup | None = None,
    cp_rank: int = 0,
) -> LLMShard:
    """The slice of a micro-batch that SP rank ``sp_rank`` of ``sp`` (of CP rank ``cp_rank`` of ``ring``'s, under
    context parallelism) processes; ``segment_lens``: the packed samples' lengths (default: each row is one
    sequence). Under CP the rows are first padded to ``padded_length`` (``pad_packed_row``'s pad tokens)."""
    cp = ring.degree if ring is not None else 1
    length = input_ids_BL.shape[1]
    targets_BL = next_token_targets(labels_BL)
    mask = None
    if cp > 1:
        padded = padded_length(length, cp)
        input_ids_BL, position_ids_3BL, targets_BL = pad_packed_row(input_ids_BL, position_ids_3BL, targets_BL, padded)
        if segment_lens is not None and len(segment_lens) > 1:  # each pad a sample of its own, as pad_packed_row's
            lengths = torch.tensor(list(segment_lens) + [1] * (padded - length))
            mask = segment_causal_mask(zigzag_positions(length, cp), torch.arange(len(lengths)).repeat_interleave(
                lengths), cp_rank)
    per_rank = sequence_positions(length, sp, cp)
    mine = per_rank[cp_rank * sp + sp_rank]
    ulysses = None
    if sp > 1 or cp > 1:
        whole = len(per_rank[0]) * sp if cp > 1 else length
        ulysses = UlyssesGroup(group=sp_group, rank=sp_rank, segment_lens=(whole,) if cp > 1 else segment_lens or (
            length,), seq_lens=tuple(len(p) for p in per_rank[cp_rank * sp:(cp_rank + 1) * sp]), ring=ring,
            segment_mask=mask)
    return LLMShard(
        input_ids_Bs=input_ids_BL[:, mine],
        position_ids_3Bs=position_ids_3BL[..., mine],
        targets_Bs=targets_BL[:, mine],
        ulysses=ulysses,
    )


def image_slots_per_rank(rows: list[tuple[int, torch.Tensor]], sp: int, cp: int = 1) -> list[torch.Tensor]:
    """For each of the ``cp * sp`` sequence ranks, which of a micro-batch's image tokens (rows in order, each row's in
    sequence order) its slice holds, in its local order, given each row's (length, image-token positions); every
    row is split alike (``sequence_positions``)."""
    slots: list[list[torch.Tensor]] = [[] for _ in range(cp * sp)]
    first = 0
    for length, positions in rows:
        slot = first + torch.arange(len(positions))
        for j, held in enumerate(sequence_positions(length, sp, cp)):
            where = torch.isin(held, positions)
            slots[j].append(slot[torch.searchsorted(positions, held[where])])
        first += len(positions)
    return [torch.cat(parts) for parts in slots]


def packed_position_ids(batch: dict[str, torch.Tensor], rope_index: Any) -> torch.Tensor:
    """[4, 1, L] positions of a packed row: each sample's text positions (from 0), then its own M-RoPE positions
    (the model's ``get_rope_index`` on the sample alone, its images' and clips' grids)."""
    rows, at, images, clips = [], 0, 0, 0
    videos = batch.get("sample_videos", torch.zeros_like(batch["sample_lens"])).tolist()
    for length, count, clip_count in zip(batch["sample_lens"].tolist(), batch["sample_images"].tolist(), videos):
        ids = batch["input_ids"][:, at:at + length]
        types = batch["mm_token_type_ids"][:, at:at + length]
        grids = batch["image_grid_thw"][images:images + count]
        clip_grids = batch["video_grid_thw"][clips:clips + clip_count] if clip_count else None
        mrope, _ = rope_index(ids, mm_token_type_ids=types, image_grid_thw=grids, video_grid_thw=clip_grids)
        rows.append(torch.cat([torch.arange(length).view(1, 1, length), mrope]))
        at, images, clips = at + length, images + count, clips + clip_count
    return torch.cat(rows, dim=-1)


PAD_TOKEN_ID = 0
"""Token id of a pipelined packed row's padding: any id but the image token's does (a pad sees only itself and has
no target, so its embedding reaches nothing that counts)."""


def pad_packed_row(input_ids_1L: torch.Tensor, position_ids_41L: torch.Tensor, labels_1L: torch.Tensor, length: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed row's ids, 4 position rows and labels padded to ``length`` tokens: pad ids, every position 0 (each
    pad token a sequence of its own in transformers' packed-sequence mask), IGNORE_INDEX labels.

    Raises:
        ValueError: the row is longer than ``length``.
    """
    pad = length - input_ids_1L.shape[-1]
    if pad < 0:
        raise ValueError(f"a packed row of {input_ids_1L.shape[-1]} tokens is longer than its budget of {length}")
    return (F.pad(input_ids_1L, (0, pad), value=PAD_TOKEN_ID), F.pad(position_ids_41L, (0, pad), value=0),
            F.pad(labels_1L, (0, pad), value=IGNORE_INDEX))
